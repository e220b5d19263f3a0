// Device memory shared with another process, and the byte channels to it: what the GPU transports
// (CUDA IPC and NCCL, docs/transports.md) need from a backend, in host-compiler C++ so the daemon
// uses them without CUDA headers. The CUDA backend implements them in libmuond_cuda.so
// (kernels/cuda/cuda_peer.cc, cuda_nccl.cc); a backend without them refuses each with
// FAILED_PRECONDITION saying why (Backend's defaults).
//
// PeerMemory: a device allocation another process exported (cudaIpcGetMemHandle), opened once in
// this backend's device (cudaIpcOpenMemHandle, lazy peer access) and closed when destroyed. Its
// pointer is a device pointer of this backend: the backend's primitives (CopyOnDevice, Widen,
// Narrow, CopyBytes) read and write it like their own buffers.
// PeerEvent: an interprocess event another process exported (cudaIpcGetEventHandle); Await returns
// once the peer's latest record of it has completed, so everything the backend enqueues afterwards
// follows the peer's work. It polls the event from the host (once per step, never per tensor) rather
// than making the backend's stream wait on it: the stream is shared by every session, and a peer
// whose work never completes must fail its own step at the deadline, not stall the daemon; a peer
// whose call was abandoned (the client died, its connection closed) fails it at the next poll.
// PeerChannel: a two-rank NCCL communicator between this backend (rank 0) and one peer (rank 1),
// created non-blocking; Receive and Send move lists of byte ranges in one group each (uint8 counts,
// so both ends always agree on datatype and count), on a stream ordered with the backend's work, and
// return when the transfer completed — or, at `deadline`, abort the communicator (ncclCommAbort)
// and answer DEADLINE_EXCEEDED: a peer that vanished never hangs the caller. An aborted channel
// refuses everything after (the peer opens a new one).
//
// Ownership: the caller owns each object; none may outlive its backend.
// Thread-safety: PeerMemory and PeerEvent are safe to use from several threads; a PeerChannel is used
// by one thread at a time (a step), except Abort, which any thread may call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muond::kernels {

// The sizes of the handles CUDA exchanges between processes (cudaIpcMemHandle_t,
// cudaIpcEventHandle_t) and of NCCL's ncclUniqueId.
inline constexpr size_t kIpcHandleBytes = 64;
inline constexpr size_t kNcclUniqueIdBytes = 128;

class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  virtual void* data() = 0;
  virtual uint64_t size() const = 0;  // bytes, as the peer's allocation has them
};

class PeerEvent {
 public:
  virtual ~PeerEvent() = default;
  // Whether the peer's last record of the event (before the call) has completed; an error when the
  // event cannot be queried. Never waits.
  virtual absl::StatusOr<bool> Poll() = 0;
  // Polls until the event has completed (OK): 10 µs between polls at first, doubling to 100 µs, so
  // that the step learns of the completion at most about 100 µs (plus the timer's slack) late.
  // DEADLINE_EXCEEDED naming the event when it has not by `deadline`; CANCELLED as soon as
  // `caller_gone` (polled as often; may be empty) says the call waiting for it was abandoned.
  absl::Status Await(absl::Time deadline, const std::function<bool()>& caller_gone);
};

// A piece of device memory a PeerChannel moves.
struct ByteRange {
  void* data = nullptr;
  size_t bytes = 0;
};

class PeerChannel {
 public:
  virtual ~PeerChannel() = default;
  // Whether the communicator finished its set-up (the peer joined); waits for it until `deadline`.
  virtual absl::Status Ready(absl::Time deadline) = 0;
  // Receives the peer's sends into `ranges`, in order, as one group; complete when it returns.
  virtual absl::Status Receive(std::span<const ByteRange> ranges, absl::Time deadline) = 0;
  // Sends `ranges` to the peer, in order, as one group, after the backend's work enqueued so far.
  virtual absl::Status Send(std::span<const ByteRange> ranges, absl::Time deadline) = 0;
  // Aborts the communicator (idempotent): every transfer in flight and every later one fails.
  virtual void Abort() = 0;
  virtual bool aborted() const = 0;
};

using NcclUniqueId = std::array<uint8_t, kNcclUniqueIdBytes>;

}  // namespace muond::kernels
