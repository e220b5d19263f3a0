// The CUDA IPC step transport (docs/transports.md), for gradients in CUDA device memory on the
// daemon's node. Built with the CUDA toolkit only (libmuond_client_cuda); this header needs no
// CUDA headers.
//
// It owns one flat device buffer (cudaMalloc, a 4-byte slot per element of every parameter) and an
// interprocess event, registers both with RegisterCudaMemory under a liveness ticket of the
// daemon's socket (so the daemon drops them if this process dies), and for each try: copies the
// device gradients into their slots on its stream, records the event there, calls StepCuda, then
// copies each parameter from its slot into the caller's device tensor, enqueued on the same stream.
// Memory the daemon lost (restart) is registered again on the next try.
//
// Ownership: owns its buffer, event and socket; borrows the Client and Session. One thread at a time.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "client/transport/transport_choice.h"

namespace muond::client {

// Viability only (CUDA IPC moves device memory: not a host kind, opened by CudaIpcStepper).
const TransportKind& CudaIpcTransportKind();

class CudaIpcStepTransport : public StepTransport {
 public:
  // On CUDA device `device`, copies on `stream` (a cudaStream_t; null: the default stream). The
  // CUDA runtime's error when the buffer or event cannot be made.
  static absl::StatusOr<std::unique_ptr<CudaIpcStepTransport>> Open(Client& client, const Session& session, int device,
                                                                    void* stream);
  ~CudaIpcStepTransport() override;

  std::string_view name() const override { return "cuda_ipc"; }
  // Reads payload.device_gradients and writes payload.device_parameters_out.
  absl::StatusOr<StepReply> StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                     const StepOptions& options) override;
  // The name the buffer is registered under now (a new one after each re-registration).
  const std::string& region_name() const { return region_name_; }
  absl::Status Register();

 private:
  struct Cuda;  // the CUDA objects, defined where the runtime's headers are included
  CudaIpcStepTransport(Client& client, const Session& session, std::unique_ptr<Cuda> cuda,
                       std::map<std::string, uint64_t> slots);
  // Copies the gradients into their slots and adds their references to `request`.
  absl::Status WriteGradients(std::span<const DeviceTensor> gradients, v1::StepSharedRequest& request);
  absl::Status ReadParameters(std::span<const DeviceTensor> parameters_out);

  Client& client_;
  const Session& session_;
  std::unique_ptr<Cuda> cuda_;
  const std::map<std::string, uint64_t> slots_;  // byte offset of each parameter's slots
  std::string region_name_;
  bool registered_ = false;
};

}  // namespace muond::client
