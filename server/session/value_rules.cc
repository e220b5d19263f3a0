#include "server/session/value_rules.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/half_float.h"

namespace muond::session {

absl::Status CheckStepNumber(absl::string_view field, int64_t step, int64_t min) {
  if (step < min || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be between ", min, " and ", kMaxStep, " (2^53 - 1), got ", step));
  }
  return absl::OkStatus();
}

double StorageLimit(kernels::StorageDtype dtype) { return std::min(kMagnitudeLimit, kernels::StorageMaxFinite(dtype)); }

absl::StatusOr<double> CheckTensorValues(absl::string_view field, absl::string_view tensor,
                                         std::span<const float> values, bool non_negative,
                                         kernels::StorageDtype dtype) {
  const double limit = StorageLimit(dtype);
  float largest = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const float magnitude = std::abs(values[i]);
    if (!(magnitude <= limit)) {  // NaN fails the comparison too
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", tensor, "' has the value ", values[i], " at element ", i,
                       "; values must be finite and within +-", limit,
                       dtype == kernels::StorageDtype::kFp32
                           ? ""
                           : absl::StrCat(" (it is stored as ", std::string(kernels::StorageDtypeName(dtype)), ")")));
    }
    if (non_negative && values[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", tensor, " has the negative value ", values[i],
                                                     " at element ", i, "; it holds squares and must not be negative"));
    }
    largest = std::max(largest, magnitude);
  }
  // The bound of what is stored: rounding to 16 bits may raise a magnitude (monotonically, so the
  // largest value rounds to the largest stored one), and a replay from a checkpoint measures the
  // stored values; both must start from the same bound.
  return RoundedToStorage(largest, dtype);
}

float RoundedToStorage(float value, kernels::StorageDtype dtype) {
  switch (dtype) {
    case kernels::StorageDtype::kBf16:
      return Bf16ToFloat(FloatToBf16(value));
    case kernels::StorageDtype::kFp16:
      return Fp16ToFloat(FloatToFp16(value));
    case kernels::StorageDtype::kFp32:
      break;
  }
  return value;
}

double MaxAbs(std::span<const float> values) {
  float largest = 0;
  for (float v : values) largest = std::max(largest, std::abs(v));
  return largest;
}

}  // namespace muond::session
