// PeerPrimitives: what a backend offers the GPU transports (CUDA IPC and NCCL, docs/transports.md),
// apart from its compute primitives (backend.h): the GPU's identity, device memory and events
// another process exported, and two-rank NCCL channels. The objects they return are described in
// kernels/peer_exchange.h; all of it is host-compiler C++, so the daemon uses it without CUDA headers.
//
// Every Backend is one (Backend derives from this interface). The defaults refuse with
// FAILED_PRECONDITION naming the backend (Name()) and saying why: only the CUDA backend shares
// device memory with other processes, and it overrides every method (kernels/cuda/cuda_peer.cc,
// cuda_nccl.cc).
//
// Ownership: the caller owns each object returned; none may outlive the backend that opened it.
// Thread-safety: every method is safe to call concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/peer_exchange.h"

namespace muond::kernels {

class PeerPrimitives {
 public:
  virtual ~PeerPrimitives() = default;

  // The backend's name ("cpu", "cuda"), which a refusal names.
  virtual std::string Name() const = 0;
  // The GPU's identity across processes ("GPU-" and its UUID, as nvidia-smi -L prints it; "" for
  // a backend without a GPU), and the NCCL version the backend links (ncclGetVersion; 0 without).
  virtual std::string DeviceUuid() const { return ""; }
  virtual int NcclVersion() const { return 0; }

  // Opens a cudaIpcMemHandle_t (kIpcHandleBytes) and checks that the allocation holds `byte_size`
  // bytes.
  virtual absl::StatusOr<std::unique_ptr<PeerMemory>> OpenPeerMemory(std::string_view handle, uint64_t byte_size);
  // Opens a cudaIpcEventHandle_t (kIpcHandleBytes).
  virtual absl::StatusOr<std::unique_ptr<PeerEvent>> OpenPeerEvent(std::string_view handle);
  // NewNcclUniqueId and OpenPeerChannel set up a two-rank NCCL communicator whose rank 0 is this
  // backend.
  virtual absl::StatusOr<NcclUniqueId> NewNcclUniqueId();
  virtual absl::StatusOr<std::unique_ptr<PeerChannel>> OpenPeerChannel(const NcclUniqueId& id);
};

}  // namespace muond::kernels
