// The formats a session may keep a master or an optimizer state slot in (the precision-aware
// optimizer: GroupOptions' master_dtype, momentum_dtype, exp_avg_dtype, exp_avg_sq_dtype). The
// arithmetic of a step is fp32 whatever the storage: 16-bit values are widened before an operation
// and rounded to nearest even when stored (common/half_float.h). Plain values and constants.
#pragma once

#include <cstddef>
#include <string_view>

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

}  // namespace muond::kernels
