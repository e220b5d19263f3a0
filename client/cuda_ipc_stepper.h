// CudaIpcStepper: steps of a Session from CUDA device memory, for a C++ trainer on the daemon's
// node (docs/transports.md). A thin handle over the CUDA IPC step transport
// (client/transport/cuda_ipc_step_transport.h): it checks the daemon offers CUDA IPC, opens the
// transport, checks each step's device tensors before anything is sent, and steps through
// Session::StepThrough (the same header, retries and counts as Session::Step). Nothing crosses the
// host but the gRPC call. Built with the CUDA toolkit only (libmuond_client_cuda, linking the CUDA
// runtime); the header needs no CUDA headers.
//
// Ownership: the stepper owns its transport; the Client and Session must outlive it. Not
// thread-safe (one trainer thread, like the Session).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "client/muond_client.h"
#include "client/transport/step_transport.h"

namespace muond::client {

class CudaIpcStepTransport;

class CudaIpcStepper {
 public:
  // For `session` of `client`, on CUDA device `device`; the copies run on `stream` (a
  // cudaStream_t; null: the default stream). FAILED_PRECONDITION naming `transport` when the daemon
  // offers no CUDA IPC or is not on this host; the CUDA runtime's error otherwise. A rank that
  // holds parts calls Session::HoldParts first: the buffer is sized for its parts, and each
  // DeviceTensor then counts the rank's part (an empty part: numel 0, data may be null).
  static absl::StatusOr<std::unique_ptr<CudaIpcStepper>> Create(Client* client, Session* session, int device,
                                                                void* stream = nullptr);
  ~CudaIpcStepper();
  CudaIpcStepper(const CudaIpcStepper&) = delete;
  CudaIpcStepper& operator=(const CudaIpcStepper&) = delete;

  // The name the buffer is registered under now (a new one after each re-registration).
  const std::string& region_name() const;

  // Step `step` with `gradients` (a parameter left out has no gradient this step). Each of
  // `parameters_out` receives its parameter after the step in its dtype (enqueued on the stream:
  // synchronize it before reading on another); parameters not listed stay in the buffer.
  // StepReply::parameters stays empty. StepOptions::parameters_out and return_dtype do not apply.
  absl::StatusOr<StepReply> Step(int64_t step, std::span<const DeviceTensor> gradients,
                                 std::span<const DeviceTensor> parameters_out, const StepOptions& options = {});

 private:
  CudaIpcStepper(Session* session, std::unique_ptr<CudaIpcStepTransport> transport);

  Session* const session_;
  std::unique_ptr<CudaIpcStepTransport> transport_;
};

}  // namespace muond::client
