// The NCCL transport of a step (the StepNccl RPC): gradients and parameters travel as byte buffers
// over the step's channel (NcclChannels), in the order the request lists them.
//
// ResolveNcclTensors makes the checks of every out-of-band transport (transport/tensor_refs.h);
// `rank`'s references to partitioned parameters carry its parts (RefFields::rank). A part of no
// elements travels as no transfer at all, on both sides.
// NcclGradientSource waits for the channel to be joined, then receives every listed gradient in one
// group: an fp32 gradient straight into the step's backend buffer when the step takes device
// gradients, anything else into a device buffer of its own and from there into the step
// (TakeDeviceGradient). A replay receives them too (the client sends them) and drops them.
// NcclParameterSink sends the parameters after the step in one group (nothing for a prepare), put
// into send buffers from the masters on the device when the step left them there.
// Each transfer (the gradients in, the parameters out) ends by the call's deadline and within
// `timeout` of its start — the answer's clock starts after the step, however long the step took
// (ranks gathering, a checkpoint): past it the channel is aborted and the step fails, so a trainer
// that vanished never holds the daemon. One step, one thread; the caller holds the channel's `busy`.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "kernels/backend.h"
#include "muond/v1/muond.pb.h"
#include "server/session/session_config.h"
#include "server/transport/api_codec/tensor_refs.h"
#include "server/transport/nccl/nccl_channels.h"
#include "server/transport/step_transport.h"

namespace muond::transport {

// When a transfer starting now must end.
inline absl::Time TransferDeadline(absl::Time call_deadline, absl::Duration timeout) {
  return std::min(call_deadline, absl::Now() + timeout);
}

absl::StatusOr<std::vector<TensorRef>> ResolveNcclTensors(
    const session::SessionConfig& config, const google::protobuf::RepeatedPtrField<v1::NcclTensor>& refs,
    absl::string_view field, bool require_all, int rank);

class NcclGradientSource final : public GradientSource {
 public:
  NcclGradientSource(kernels::Backend* backend, NcclChannel* channel, std::vector<TensorRef> refs,
                     absl::Time call_deadline, absl::Duration timeout)
      : backend_(backend),
        channel_(channel),
        refs_(std::move(refs)),
        call_deadline_(call_deadline),
        timeout_(timeout) {}
  absl::Status ReadGradients(session::IncomingStep& step) override;
  std::string_view transport() const override { return "nccl"; }

 private:
  kernels::Backend* const backend_;
  NcclChannel* const channel_;
  const std::vector<TensorRef> refs_;
  const absl::Time call_deadline_;
  const absl::Duration timeout_;
  std::string host_bytes_;
};

class NcclParameterSink final : public ParameterSink {
 public:
  NcclParameterSink(const session::Session* session, kernels::Backend* backend, NcclChannel* channel,
                    std::vector<TensorRef> refs, absl::Time call_deadline, absl::Duration timeout)
      : session_(session),
        backend_(backend),
        channel_(channel),
        refs_(std::move(refs)),
        call_deadline_(call_deadline),
        timeout_(timeout) {}
  absl::Status Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) override;
  const v1::StepResult& result() const { return result_; }

 private:
  const session::Session* const session_;
  kernels::Backend* const backend_;
  NcclChannel* const channel_;
  const std::vector<TensorRef> refs_;
  const absl::Time call_deadline_;
  const absl::Duration timeout_;
  std::string host_bytes_;
  v1::StepResult result_;
};

}  // namespace muond::transport
