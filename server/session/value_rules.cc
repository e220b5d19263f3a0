#include "server/session/value_rules.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace muond::session {

absl::Status CheckStepNumber(absl::string_view field, int64_t step, int64_t min) {
  if (step < min || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be between ", min, " and ", kMaxStep, " (2^53 - 1), got ", step));
  }
  return absl::OkStatus();
}

absl::Status CheckTensorValues(absl::string_view field, absl::string_view tensor, std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!(std::abs(values[i]) <= kMagnitudeLimit)) {  // NaN fails the comparison too
      return absl::InvalidArgumentError(absl::StrCat(field, ": '", tensor, "' has the value ", values[i],
                                                     " at element ", i, "; values must be finite and within +-",
                                                     kMagnitudeLimit));
    }
  }
  return absl::OkStatus();
}

double MaxAbs(std::span<const float> values) {
  float largest = 0;
  for (float v : values) largest = std::max(largest, std::abs(v));
  return largest;
}

}  // namespace muond::session
