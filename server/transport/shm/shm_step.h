// The shared-memory transport of a step (the StepShared RPC): gradients are read from, and the
// parameters after the step written to, regions the caller registered (SharedMemoryRegions).
//
// ResolveSharedTensors checks every tensor reference before the step begins — the parameter exists
// and appears at most once (for the answer: every parameter exactly once), the region is the
// caller's, the dtype is concrete, byte_size is exactly the parameter's elements in that dtype and
// lies within the region (overflow-safe) — so that a step is never applied and then found to have
// nowhere to put its answer. Each error names the field, e.g. "gradients[2].offset".
//
// ShmGradientSource copies each gradient once, from the region into the session's gradient tensor
// while its sum of squares is taken; everything after (finiteness, clipping, the optimizer) reads
// that copy, so a client writing its region during the step can change nothing but its own data.
// ShmParameterSink encodes the parameters into the regions (one copy) and keeps the result for the
// RPC's response; it writes through the claims the call made on its regions (ClaimSharedRegions,
// answer_gate.h), so that a call its caller gave up (`given_up`) writes nothing. Both split their copies over `pool`'s
// threads (bulk_codec.h: the sums of squares have the same bits whatever its thread count; null: the step's thread
// alone), and hold their regions (shared_ptr) until destroyed. One step, one calling thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "muond/v1/muond.pb.h"
#include "server/session/session_config.h"
#include "server/transport/answer_gate.h"
#include "server/transport/shm/shared_memory_regions.h"
#include "server/transport/step_transport.h"

namespace muond {
class ComputePool;
}

namespace muond::transport {

struct SharedTensorPlace {
  size_t index = 0;  // the parameter
  std::shared_ptr<SharedMapping> region;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  v1::DType dtype = v1::DTYPE_FP32;
};

absl::StatusOr<std::vector<SharedTensorPlace>> ResolveSharedTensors(
    const session::SessionConfig& config, const SharedMemoryRegions& regions, const std::string& caller,
    const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs, absl::string_view field, bool require_all,
    int rank);

// The call's claims on every region `gradients` and `parameters` name, for `session_id`'s `rank`.
inline AnswerClaims ClaimSharedRegions(const std::vector<SharedTensorPlace>& gradients,
                                       const std::vector<SharedTensorPlace>& parameters, std::string session_id,
                                       int rank) {
  return ClaimPlaces(
      gradients, parameters, [](const SharedTensorPlace& place) { return &place.region->answers(); },
      std::move(session_id), rank);
}

class ShmGradientSource final : public GradientSource {
 public:
  ShmGradientSource(std::vector<SharedTensorPlace> places, ComputePool* pool)
      : places_(std::move(places)), pool_(pool) {}
  absl::Status ReadGradients(session::IncomingStep& step) override;
  std::string_view transport() const override { return "shm"; }

 private:
  const std::vector<SharedTensorPlace> places_;
  ComputePool* const pool_;
};

class ShmParameterSink final : public ParameterSink {
 public:
  // `claims` on the regions of `places` (none: the answer is written unless `given_up`); `given_up`
  // (may be empty) says whether the caller gave the call up.
  ShmParameterSink(std::vector<SharedTensorPlace> places, ComputePool* pool, AnswerClaims claims = {},
                   std::function<bool()> given_up = {})
      : places_(std::move(places)), pool_(pool), claims_(std::move(claims)), given_up_(std::move(given_up)) {}
  absl::Status Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) override;
  const v1::StepResult& result() const { return result_; }

 private:
  const std::vector<SharedTensorPlace> places_;
  ComputePool* const pool_;
  const AnswerClaims claims_;  // after places_: released before the regions are
  const std::function<bool()> given_up_;
  v1::StepResult result_;
};

}  // namespace muond::transport
