// StepTransport: the client's side of the transport seam — how one try of a step carries the
// trainer's gradients to the daemon and the parameters back. gRPC streams (grpc_step_transport),
// shared memory (shm_step_transport) and CUDA IPC (cuda_ipc_step_transport, in
// libmuond_client_cuda) implement it; the daemon's side of the same role is
// server/transport/step_transport.h. transport_choice.h lists them and settles "auto".
//
// The Session builds the step's header, checks the caller's tensors, retries and counts
// (Session::StepThrough); a transport only moves one try's tensors, registers what it needs with
// the daemon on first use, and forgets what the daemon lost (its region after a restart: the try
// then fails UNAVAILABLE, so the next try registers again).
//
// Ownership: a transport belongs to one Session, which must outlive it; one thread at a time.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "client/muond_client.h"

namespace muond::client {

// `numel` elements of `dtype` (fp32, bf16 or fp16) in CUDA device memory.
struct DeviceTensor {
  std::string name;
  void* data = nullptr;
  int64_t numel = 0;
  v1::DType dtype = v1::DTYPE_FP32;
};

// One step's tensors: in host memory (gRPC, shared memory) or in device memory (CUDA IPC). Each
// transport reads the kind it moves.
struct StepPayload {
  std::span<const TensorView> gradients = {};
  std::span<const DeviceTensor> device_gradients = {};
  // Where each parameter after the step goes, in its dtype (device transports; host transports
  // take StepOptions::parameters_out).
  std::span<const DeviceTensor> device_parameters_out = {};
};

class StepTransport {
 public:
  virtual ~StepTransport() = default;
  // The name ClientOptions::transport and Client::Transport() use ("grpc", "shm", "cuda_ipc").
  virtual std::string_view name() const = 0;
  // One try of the step `header` names. A failure worth another try is UNAVAILABLE or
  // DEADLINE_EXCEEDED (IsTransient).
  virtual absl::StatusOr<StepReply> StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                             const StepOptions& options) = 0;
  // A streamed step's gradient, final for the coming try: copied now to where that try reads it
  // (shared memory: its slots), so that the try need not. False when this transport has no such
  // place, or could not set it up (the try then writes the gradient as usual). What was staged
  // serves the next StepOnce only; a retry writes every gradient again.
  virtual bool StageGradient(const TensorView& gradient) { return false; }
  // Forgets what was staged: the streamed step it was for was cancelled (or refused before its
  // first try), so the next StepOnce writes every gradient it is given.
  virtual void DropStaged() {}
  // Sets up what the first try needs (shared memory: its region) ahead of it; a failure here is
  // also the first try's, which sets up again.
  virtual absl::Status Prepare() { return absl::OkStatus(); }
  // Why the daemon refused what this transport needs, as opposed to being away: set by the last
  // setup that failed so (its region, its grant); OK otherwise. "auto" then falls back to gRPC.
  virtual absl::Status refusal() const { return absl::OkStatus(); }
};

}  // namespace muond::client
