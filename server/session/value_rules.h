// The rules every number and value a session takes in must follow, whatever brought it (a wire
// message, a journal record, a checkpoint): step numbers within range, tensor values finite. One
// home for them, documented in docs/protocol.md (Ranges and rules). Stateless functions.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/storage_dtype.h"

namespace muond::session {

// The largest step number (and step count) a session holds: 2^53 − 1, exact in a double, so that
// JSON readers and Python clients see every step as it is, and last step + 1 never overflows.
inline constexpr int64_t kMaxStep = (int64_t{1} << 53) - 1;

// The largest magnitude a step may leave in a master or a state slot, or compute on the way: 1e36,
// a margin of about 340 below fp32's largest value (3.4e38) for the rounding of a step's
// arithmetic. A step whose bound exceeds it is not applied (Session's finiteness guard).
inline constexpr double kMagnitudeLimit = 1e36;

// INVALID_ARGUMENT naming `field` unless min <= step <= kMaxStep.
absl::Status CheckStepNumber(absl::string_view field, int64_t step, int64_t min);

// The largest magnitude a tensor stored in `dtype` may hold: kMagnitudeLimit, or fp16's largest
// finite value (65504), beyond which it would be stored as infinity.
double StorageLimit(kernels::StorageDtype dtype);

// Values loaded into a session (uploads, SetState, checkpoints) must be finite and within
// ±StorageLimit(dtype) of the tensor they go to, and not negative where `non_negative` (Adam's second
// moment); INVALID_ARGUMENT naming `field`, the tensor and the first element that is not. Returns
// their largest |x| as stored in `dtype` (the magnitude bound the finiteness guard starts from),
// found in the same pass.
absl::StatusOr<double> CheckTensorValues(absl::string_view field, absl::string_view tensor,
                                         std::span<const float> values, bool non_negative = false,
                                         kernels::StorageDtype dtype = kernels::StorageDtype::kFp32);

// The largest |x| of `values` (0 when empty); a magnitude bound for the step's finiteness guard.
double MaxAbs(std::span<const float> values);

// `value` as a tensor stored in `dtype` holds it (rounded to nearest even for 16 bits).
float RoundedToStorage(float value, kernels::StorageDtype dtype);

}  // namespace muond::session
