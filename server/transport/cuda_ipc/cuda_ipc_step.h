// The CUDA IPC transport of a step (the StepCuda RPC): gradients are read from, and the parameters
// after the step written to, device memory the caller registered (CudaMemoryRegions).
//
// ResolveCudaTensors makes the checks of every out-of-band transport (transport/tensor_refs.h),
// with offsets aligned to the dtype, against the caller's regions of the stepping session; `rank`'s
// references to partitioned parameters carry its parts (RefFields::rank).
// CudaIpcGradientSource first waits for the client's event (recorded once it wrote the gradients;
// DEADLINE_EXCEEDED at `deadline`, nothing applied), then takes each gradient device to device
// (TakeDeviceGradient): nothing crosses the host when the step takes device gradients. A replay
// reads nothing. CudaIpcParameterSink
// writes the parameters into the regions — device to device when the step left them on the device
// (StepRequest::device_answer), else from their host copy — after the client's event (so that a
// replay's answer is not overwritten by gradient copies the client still had in flight), and waits
// until they are there, so the client may read them as soon as the answer arrives; it writes through
// the claims the call made on its regions (ClaimCudaRegions, answer_gate.h), so that a call its
// caller gave up (EventWait::caller_gone) writes nothing. Both hold their regions until destroyed.
// One step, one thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "kernels/backend.h"
#include "muond/v1/muond.pb.h"
#include "server/session/session_config.h"
#include "server/transport/api_codec/tensor_refs.h"
#include "server/transport/cuda_ipc/cuda_memory_regions.h"
#include "server/transport/step_transport.h"

namespace muond::transport {

struct CudaTensorPlace {
  TensorRef ref;
  std::shared_ptr<CudaRegion> region;
  void* data() const { return static_cast<char*>(region->memory->data()) + ref.offset; }
};

// How long a step waits for its client's events: until `deadline`, or until `caller_gone` (may be
// empty) says the call was abandoned — the client died or cancelled, so its event may never
// complete and the session must not stay held until the deadline.
struct EventWait {
  EventWait(absl::Time until, std::function<bool()> gone = {})  // NOLINT: a deadline alone is a wait
      : deadline(until), caller_gone(std::move(gone)) {}
  absl::Time deadline;
  std::function<bool()> caller_gone;
};

// Waits for the event of every region `places` name, once each.
absl::Status AwaitClientEvents(const std::vector<CudaTensorPlace>& places, const EventWait& wait);

absl::StatusOr<std::vector<CudaTensorPlace>> ResolveCudaTensors(
    const session::SessionConfig& config, const CudaMemoryRegions& regions, const std::string& caller,
    const BoundSession& session, const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs,
    absl::string_view field, bool require_all, int rank);

// The call's claims on every region `gradients` and `parameters` name, for `session_id`'s `rank`.
inline AnswerClaims ClaimCudaRegions(const std::vector<CudaTensorPlace>& gradients,
                                     const std::vector<CudaTensorPlace>& parameters, std::string session_id, int rank) {
  return ClaimPlaces(
      gradients, parameters, [](const CudaTensorPlace& place) { return &place.region->answers; }, std::move(session_id),
      rank);
}

class CudaIpcGradientSource final : public GradientSource {
 public:
  CudaIpcGradientSource(kernels::Backend* backend, std::vector<CudaTensorPlace> places, EventWait wait)
      : backend_(backend), places_(std::move(places)), wait_(std::move(wait)) {}
  absl::Status ReadGradients(session::IncomingStep& step) override;
  std::string_view transport() const override { return "cuda_ipc"; }

 private:
  kernels::Backend* const backend_;
  const std::vector<CudaTensorPlace> places_;
  const EventWait wait_;
  std::string host_bytes_;
};

class CudaIpcParameterSink final : public ParameterSink {
 public:
  CudaIpcParameterSink(const session::Session* session, kernels::Backend* backend, std::vector<CudaTensorPlace> places,
                       EventWait wait, AnswerClaims claims = {})
      : session_(session),
        backend_(backend),
        places_(std::move(places)),
        wait_(std::move(wait)),
        claims_(std::move(claims)) {}
  absl::Status Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) override;
  const v1::StepResult& result() const { return result_; }

 private:
  // Writes the parameters into the places and waits until they are there.
  absl::Status WriteParameters(const session::StepOutcome& outcome, session::ParameterReader& parameters);

  const session::Session* const session_;
  kernels::Backend* const backend_;
  const std::vector<CudaTensorPlace> places_;
  const EventWait wait_;
  const AnswerClaims claims_;  // after places_: released before the regions are
  std::string host_bytes_;
  v1::StepResult result_;
};

}  // namespace muond::transport
