// The formats a session may keep a master or an optimizer state slot in (the precision-aware
// optimizer: GroupOptions' master_dtype, momentum_dtype, exp_avg_dtype, exp_avg_sq_dtype). The
// arithmetic of a step is fp32 whatever the storage: 16-bit values are widened before an operation
// and rounded to nearest even when stored (common/half_float.h). Plain values and constants.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/half_float.h"

namespace muond::kernels {

enum class StorageDtype { kFp32, kBf16, kFp16 };

inline constexpr size_t StorageBytes(StorageDtype dtype) { return dtype == StorageDtype::kFp32 ? 4 : 2; }

inline constexpr std::string_view StorageDtypeName(StorageDtype dtype) {
  switch (dtype) {
    case StorageDtype::kFp32:
      return "fp32";
    case StorageDtype::kBf16:
      return "bf16";
    case StorageDtype::kFp16:
      return "fp16";
  }
  return "fp32";
}

// The largest finite magnitude of the format; a value beyond it is stored as ±inf.
inline constexpr double StorageMaxFinite(StorageDtype dtype) {
  switch (dtype) {
    case StorageDtype::kFp32:
      return 3.4028234663852886e38;
    case StorageDtype::kBf16:
      return 3.3895313892515355e38;
    case StorageDtype::kFp16:
      return 65504.0;
  }
  return 0;
}

// The unit roundoff of storing a value: |stored| ≤ |x|·(1 + u) for round to nearest (fp32 2⁻²⁴,
// bf16 2⁻⁸, fp16 2⁻¹¹), 0 for fp32 whose arithmetic already rounded.
inline constexpr double StorageRoundoff(StorageDtype dtype) {
  switch (dtype) {
    case StorageDtype::kFp32:
      return 0.0;
    case StorageDtype::kBf16:
      return 0x1p-8;
    case StorageDtype::kFp16:
      return 0x1p-11;
  }
  return 0;
}

// Elements of a tensor in backend memory in a storage format: `data` points at element 0. The
// element-wise primitives take their optimizer state as StoredRefs and load 16-bit elements as fp32,
// compute, and round what they store. An fp32 pointer converts implicitly, so fp32 callers pass their
// pointers as they are. A plain value; trivially copyable (it is a CUDA kernel argument).
struct StoredRef {
  void* data = nullptr;
  StorageDtype dtype = StorageDtype::kFp32;

  StoredRef() = default;
  StoredRef(float* values) : data(values) {}  // NOLINT(google-explicit-constructor): fp32 by default
  // For arguments a primitive only reads (Axpby's x).
  StoredRef(const float* values) : data(const_cast<float*>(values)) {}  // NOLINT(google-explicit-constructor)
  StoredRef(void* values, StorageDtype format) : data(values), dtype(format) {}

  bool is_fp32() const { return dtype == StorageDtype::kFp32; }
  float* fp32() const { return static_cast<float*>(data); }
  uint16_t* bits16() const { return static_cast<uint16_t*>(data); }
  // The same tensor from element `offset` on.
  StoredRef At(size_t offset) const {
    return StoredRef(static_cast<char*>(data) + offset * StorageBytes(dtype), dtype);
  }
};

// Element i of `ref` as fp32, and storing x into it rounded to its format (for CUDA kernels; the CPU
// loops widen and round blocks instead).
MUOND_HALF_HD float LoadElement(const StoredRef& ref, int64_t i) {
  switch (ref.dtype) {
    case StorageDtype::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(ref.data)[i]);
    case StorageDtype::kFp16:
      return Fp16ToFloat(static_cast<const uint16_t*>(ref.data)[i]);
    default:
      return static_cast<const float*>(ref.data)[i];
  }
}

MUOND_HALF_HD void StoreElement(const StoredRef& ref, int64_t i, float x) {
  switch (ref.dtype) {
    case StorageDtype::kBf16:
      static_cast<uint16_t*>(ref.data)[i] = FloatToBf16(x);
      return;
    case StorageDtype::kFp16:
      static_cast<uint16_t*>(ref.data)[i] = FloatToFp16(x);
      return;
    default:
      static_cast<float*>(ref.data)[i] = x;
  }
}

}  // namespace muond::kernels
