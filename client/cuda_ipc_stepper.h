// CudaIpcStepper: steps of a Session over CUDA IPC (docs/transports.md), for a C++ trainer whose
// gradients are in CUDA device memory on the daemon's node. Built with the CUDA toolkit only
// (libmuond_client_cuda, linking the CUDA runtime); the header needs no CUDA headers.
//
// It owns one flat device buffer (cudaMalloc, a 4-byte slot per element of every parameter) and an
// interprocess event, registers both with RegisterCudaMemory under a liveness ticket of the
// daemon's socket (so the daemon drops them if this process dies), and for each step: copies the
// caller's device gradients into their slots on the caller's stream, records the event there, calls
// StepCuda, then copies each parameter from its slot into the caller's device tensor, enqueued on
// the same stream. Nothing crosses the host but the gRPC call. Transient failures are retried with
// the same step number, re-registering after a daemon restart, as Session::Step does.
//
// Ownership: the stepper owns its buffer, event and socket; the Client and Session must outlive it.
// Not thread-safe (one trainer thread, like the Session).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "client/muond_client.h"

namespace muond::client {

// `numel` elements of `dtype` (fp32, bf16 or fp16) in CUDA device memory of the stepper's device.
struct DeviceTensor {
  std::string name;
  void* data = nullptr;
  int64_t numel = 0;
  v1::DType dtype = v1::DTYPE_FP32;
};

class CudaIpcStepper {
 public:
  // For `session` of `client`, on CUDA device `device`; the copies run on `stream` (a
  // cudaStream_t; null: the default stream). FAILED_PRECONDITION naming `transport` when the daemon
  // offers no CUDA IPC or is not on this host; the CUDA runtime's error otherwise.
  static absl::StatusOr<std::unique_ptr<CudaIpcStepper>> Create(Client* client, Session* session, int device,
                                                                void* stream = nullptr);
  ~CudaIpcStepper();
  CudaIpcStepper(const CudaIpcStepper&) = delete;
  CudaIpcStepper& operator=(const CudaIpcStepper&) = delete;

  // Step `step` with `gradients` (a parameter left out has no gradient this step). Each of
  // `parameters_out` receives its parameter after the step in its dtype (enqueued on the stream:
  // synchronize it before reading on another); parameters not listed stay in the buffer.
  // StepReply::parameters stays empty. StepOptions::parameters_out and return_dtype do not apply.
  // The name the buffer is registered under now (a new one after each re-registration).
  const std::string& region_name() const { return region_name_; }

  absl::StatusOr<StepReply> Step(int64_t step, std::span<const DeviceTensor> gradients,
                                 std::span<const DeviceTensor> parameters_out, const StepOptions& options = {});

 private:
  struct Cuda;  // the CUDA objects, defined where the runtime's headers are included
  CudaIpcStepper(Client* client, Session* session, std::unique_ptr<Cuda> cuda, std::map<std::string, uint64_t> slots);
  absl::Status Register();
  absl::StatusOr<StepReply> StepOnce(int64_t step, std::span<const DeviceTensor> gradients,
                                     std::span<const DeviceTensor> parameters_out, const StepOptions& options);

  Client* const client_;
  Session* const session_;
  std::unique_ptr<Cuda> cuda_;
  const std::map<std::string, uint64_t> slots_;  // byte offset of each parameter's slots
  std::string region_name_;
  bool registered_ = false;
};

}  // namespace muond::client
