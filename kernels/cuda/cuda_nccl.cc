// The NCCL side of the GPU transports (kernels/peer_exchange.h): CudaBackend::NcclVersion,
// NewNcclUniqueId and OpenPeerChannel, and NcclChannel, the PeerChannel they open.
//
// NcclChannel: a two-rank communicator, this backend rank 0 and the peer rank 1, created
// non-blocking (ncclConfig_t::blocking = 0), so that no NCCL call waits for the peer: the creation
// and each group of transfers return at once, and the channel polls ncclCommGetAsyncError (and,
// once NCCL has enqueued a group, a CUDA event after it) until the work is done, sleeping 20 µs
// between polls and doubling up to 1 ms. At a deadline, on an NCCL error, or when Abort is called,
// the communicator is aborted (ncclCommAbort, which also stops the transfer kernels) and the
// channel refuses everything after. Transfers run on a stream of the channel's own: each group
// first waits (on the device) for the work the backend enqueued before it, and the backend's work
// enqueued after a Receive returns sees the received bytes (the transfer completed). The backend's
// mutex is held only to record that ordering event, never while polling.
// Destruction: a healthy communicator is finalized (ncclCommFinalize, polled for at most
// kFinalizeGrace) and destroyed; any other is aborted, so a destructor never hangs on a peer.
//
// Built where CMake found nccl.h (MUOND_HAVE_NCCL); NCCL itself is loaded at first use
// (nccl_library.h), so the backend runs without it and refuses the channel with FAILED_PRECONDITION
// saying why. A build without nccl.h refuses it the same way, saying that.
//
// Ownership: the caller owns the channel, which must not outlive its backend.
// Thread-safety: one thread at a time uses a channel (a step), except Abort and aborted, which any
// thread may call: the communicator is guarded by a mutex that the stepping thread holds only for
// each short, non-blocking NCCL call.
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/peer_exchange.h"

#ifdef MUOND_HAVE_NCCL

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/nccl_library.h"

namespace muond::kernels::cuda {
namespace {

// The loaded NCCL: only after LoadNccl() succeeded, which the creation of every channel, unique id
// and version check does first (a channel exists only once NCCL is loaded).
const NcclLibrary& Nccl() { return **LoadNccl(); }

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);

constexpr int kRanks = 2, kSelf = 0, kPeer = 1;
// How long a destructor waits for a healthy communicator to finalize before aborting it.
constexpr absl::Duration kFinalizeGrace = absl::Seconds(2);

// The waits between polls: short at first (a transfer of a few MiB over NVLink takes tens of µs),
// then doubling to 1 ms.
class Backoff {
 public:
  void Sleep() {
    std::this_thread::sleep_for(delay_);
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(1000));
  }

 private:
  std::chrono::microseconds delay_{20};
};

class NcclChannel final : public PeerChannel {
 public:
  static absl::StatusOr<std::unique_ptr<PeerChannel>> Open(CudaBackend* backend, const NcclUniqueId& id);
  ~NcclChannel() override;
  NcclChannel(const NcclChannel&) = delete;
  NcclChannel& operator=(const NcclChannel&) = delete;

  absl::Status Ready(absl::Time deadline) override;
  absl::Status Receive(std::span<const ByteRange> ranges, absl::Time deadline) override {
    return Transfer(/*receive=*/true, ranges, deadline);
  }
  absl::Status Send(std::span<const ByteRange> ranges, absl::Time deadline) override {
    return Transfer(/*receive=*/false, ranges, deadline);
  }
  void Abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    AbortLocked();
  }
  bool aborted() const override { return aborted_.load(); }

 private:
  explicit NcclChannel(CudaBackend* backend) : backend_(backend), device_(backend->device()), opened_(absl::Now()) {}

  absl::Status Transfer(bool receive, std::span<const ByteRange> ranges, absl::Time deadline);
  // Polls the communicator until it leaves ncclInProgress (set-up done, or a group enqueued on
  // stream_): OK at ncclSuccess; otherwise the channel is aborted and the answer names `what`.
  absl::Status AwaitComm(absl::string_view what, absl::Time deadline);
  // Polls the event recorded after a group until the stream reached it, watching the communicator
  // for errors on the way.
  absl::Status AwaitTransfer(absl::string_view what, absl::Time deadline);
  // The communicator's state (ncclCommGetAsyncError); *gone when an Abort, from this thread or
  // another, already released it.
  ncclResult_t State(bool* gone);
  // Aborts and answers UNAVAILABLE with NCCL's text for `result` and its last error.
  absl::Status Failed(absl::string_view what, ncclResult_t result);
  // Aborts and answers DEADLINE_EXCEEDED.
  absl::Status TimedOut(absl::string_view what, absl::Time deadline);
  // What a call answers once the channel is aborted.
  absl::Status Refused(absl::string_view what) const;
  void AbortLocked();  // requires mu_

  CudaBackend* const backend_;
  const int device_;
  const absl::Time opened_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ordered_ = nullptr;  // recorded on the backend's stream; stream_ waits for it
  cudaEvent_t done_ = nullptr;     // recorded on stream_ after each group
  cudaEvent_t fence_ = nullptr;    // recorded on stream_ by an abort; the backend's stream waits for it
  bool ready_ = false;             // set-up completed (the stepping thread's)
  bool healthy_ = false;           // ready and no transfer left unfinished (the stepping thread's)

  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;  // null once aborted; guarded by mu_
  std::atomic<bool> aborted_{false};
};

std::string NcclText(ncclResult_t result, ncclComm_t comm) {
  std::string text = Nccl().GetErrorString(result);
  const char* last = Nccl().GetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&text, " (", last, ")");
  return text;
}

size_t TotalBytes(std::span<const ByteRange> ranges) {
  size_t total = 0;
  for (const ByteRange& range : ranges) total += range.bytes;
  return total;
}

absl::StatusOr<std::unique_ptr<PeerChannel>> NcclChannel::Open(CudaBackend* backend, const NcclUniqueId& id) {
  MUOND_RETURN_IF_ERROR(LoadNccl().status());
  std::unique_ptr<NcclChannel> channel(new NcclChannel(backend));
  // From here on the destructor releases whatever was created before a failure.
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(channel->device_));
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&channel->stream_, cudaStreamNonBlocking));
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&channel->ordered_, cudaEventDisableTiming));
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&channel->done_, cudaEventDisableTiming));
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&channel->fence_, cudaEventDisableTiming));
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.data(), sizeof(nccl_id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = "muond";
  std::lock_guard<std::mutex> lock(channel->mu_);
  const ncclResult_t result = Nccl().CommInitRankConfig(&channel->comm_, kRanks, nccl_id, kSelf, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    const std::string text = NcclText(result, channel->comm_);
    channel->AbortLocked();
    return absl::UnavailableError(absl::StrCat("ncclCommInitRankConfig (rank 0 of 2) failed: ", text));
  }
  return std::unique_ptr<PeerChannel>(std::move(channel));
}

NcclChannel::~NcclChannel() {
  cudaSetDevice(device_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const ncclResult_t finalize = comm_ != nullptr && healthy_ ? Nccl().CommFinalize(comm_) : ncclInvalidUsage;
    if (finalize == ncclSuccess || finalize == ncclInProgress) {
      // Non-blocking: ncclInProgress until the communicator is quiescent.
      const absl::Time give_up = absl::Now() + kFinalizeGrace;
      ncclResult_t state = ncclInProgress;
      Backoff backoff;
      while (Nccl().CommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             absl::Now() < give_up) {
        backoff.Sleep();
      }
      if (state == ncclSuccess) {
        Nccl().CommDestroy(comm_);
        comm_ = nullptr;
      }
    }
    AbortLocked();  // anything else: not set up, a transfer unfinished, an error, or finalize stuck
  }
  // Aborting stopped NCCL's kernels, so nothing on the stream waits for the peer any longer; CUDA
  // frees the stream and events once their pending work is done.
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (fence_ != nullptr) cudaEventDestroy(fence_);
  if (ordered_ != nullptr) cudaEventDestroy(ordered_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void NcclChannel::AbortLocked() {
  aborted_.store(true);
  if (comm_ == nullptr) return;
  cudaSetDevice(device_);
  Nccl().CommAbort(comm_);
  comm_ = nullptr;
  // Aborting stops NCCL's kernels, but those in flight may still write into buffers the caller
  // hands back to the backend: the backend's later work waits for them (on the device).
  if (stream_ != nullptr && fence_ != nullptr && cudaEventRecord(fence_, stream_) == cudaSuccess) {
    backend_
        ->OnStream([this](cudaStream_t stream) {
          return CudaStatus(cudaStreamWaitEvent(stream, fence_, 0), "fencing an aborted NCCL channel");
        })
        .IgnoreError();
  }
  cudaGetLastError();
}

ncclResult_t NcclChannel::State(bool* gone) {
  std::lock_guard<std::mutex> lock(mu_);
  *gone = comm_ == nullptr;
  if (*gone) return ncclInvalidUsage;
  ncclResult_t state = ncclSuccess;
  if (const ncclResult_t result = Nccl().CommGetAsyncError(comm_, &state); result != ncclSuccess) return result;
  return state;
}

absl::Status NcclChannel::Failed(absl::string_view what, ncclResult_t result) {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) return Refused(what);
  const std::string text = NcclText(result, comm_);
  AbortLocked();
  return absl::UnavailableError(
      absl::StrCat("the NCCL channel failed while ", what, ": ", text, "; the channel is aborted"));
}

absl::Status NcclChannel::TimedOut(absl::string_view what, absl::Time deadline) {
  Abort();
  if (!ready_) {
    return absl::DeadlineExceededError(absl::StrCat("the trainer did not join the NCCL channel within ",
                                                    absl::FormatDuration(deadline - opened_),
                                                    " of its opening; the channel is aborted"));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("the NCCL channel's peer did not complete ", what, " by the deadline; the channel is aborted"));
}

absl::Status NcclChannel::Refused(absl::string_view what) const {
  return absl::FailedPreconditionError(
      absl::StrCat("the NCCL channel is aborted, so ", what, " cannot proceed; the peer must open a new channel"));
}

absl::Status NcclChannel::AwaitComm(absl::string_view what, absl::Time deadline) {
  Backoff backoff;
  for (;;) {
    bool gone = false;
    const ncclResult_t state = State(&gone);
    if (gone) return Refused(what);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return Failed(what, state);
    if (absl::Now() >= deadline) return TimedOut(what, deadline);
    backoff.Sleep();
  }
}

absl::Status NcclChannel::AwaitTransfer(absl::string_view what, absl::Time deadline) {
  Backoff backoff;
  for (;;) {
    const cudaError_t query = cudaEventQuery(done_);
    if (query == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // not ready is the thread's last error too: the next launch would report it
    if (query != cudaErrorNotReady) {
      Abort();
      return CudaStatus(query, absl::StrCat("the NCCL channel's stream while ", what));
    }
    // A peer that failed, or NCCL's own errors, show here while the kernels still wait.
    bool gone = false;
    const ncclResult_t state = State(&gone);
    if (gone) return Refused(what);
    if (state != ncclSuccess && state != ncclInProgress) return Failed(what, state);
    if (absl::Now() >= deadline) return TimedOut(what, deadline);
    backoff.Sleep();
  }
}

absl::Status NcclChannel::Ready(absl::Time deadline) {
  if (ready_) return absl::OkStatus();
  if (aborted_.load()) return Refused("waiting for the peer to join");
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  MUOND_RETURN_IF_ERROR(AwaitComm("waiting for the peer to join", deadline));
  ready_ = healthy_ = true;
  return absl::OkStatus();
}

absl::Status NcclChannel::Transfer(bool receive, std::span<const ByteRange> ranges, absl::Time deadline) {
  const std::string what = absl::StrCat(receive ? "receiving " : "sending ", ranges.size(), " range(s) of ",
                                        TotalBytes(ranges), " bytes in all");
  if (aborted_.load()) return Refused(what);
  MUOND_RETURN_IF_ERROR(Ready(deadline));
  if (TotalBytes(ranges) == 0) return absl::OkStatus();

  // On the device, after the work the backend enqueued so far: a Send reads what it computed, a
  // Receive overwrites nothing it still reads.
  MUOND_RETURN_IF_ERROR(backend_->OnStream([this](cudaStream_t stream) {
    return CudaStatus(cudaEventRecord(ordered_, stream), "cudaEventRecord on the backend's stream");
  }));
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ordered_, 0));

  healthy_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return Refused(what);
    ncclResult_t result = Nccl().GroupStart();
    if (result == ncclSuccess) {
      for (const ByteRange& range : ranges) {
        if (range.bytes == 0) continue;
        result = receive ? Nccl().Recv(range.data, range.bytes, ncclUint8, kPeer, comm_, stream_)
                         : Nccl().Send(range.data, range.bytes, ncclUint8, kPeer, comm_, stream_);
        if (result != ncclSuccess && result != ncclInProgress) break;
      }
      // Always closes the group, also after a failed call in it.
      const ncclResult_t end = Nccl().GroupEnd();
      if (result == ncclSuccess || result == ncclInProgress) result = end;
    }
    if (result != ncclSuccess && result != ncclInProgress) {
      const std::string text = NcclText(result, comm_);
      AbortLocked();
      return absl::UnavailableError(
          absl::StrCat("the NCCL channel failed while ", what, ": ", text, "; the channel is aborted"));
    }
  }
  // With a non-blocking communicator the group may still be being enqueued (ncclInProgress): the
  // stream is touched only once the communicator is back to ncclSuccess.
  MUOND_RETURN_IF_ERROR(AwaitComm(what, deadline));
  if (const cudaError_t error = cudaEventRecord(done_, stream_); error != cudaSuccess) {
    Abort();
    return CudaStatus(error, "cudaEventRecord on the NCCL channel's stream");
  }
  MUOND_RETURN_IF_ERROR(AwaitTransfer(what, deadline));
  // An abort from another thread (the channel closed, its session closed) also ends the kernels,
  // which completes `done_` with the transfer unfinished.
  if (aborted_.load()) return Refused(what);
  healthy_ = true;
  return absl::OkStatus();
}

}  // namespace

int CudaBackend::NcclVersion() const {
  if (!LoadNccl().ok()) return 0;  // GetServerInfo reports no NCCL; a channel's refusal says why
  int version = 0;
  return Nccl().GetVersion(&version) == ncclSuccess ? version : 0;
}

absl::StatusOr<NcclUniqueId> CudaBackend::NewNcclUniqueId() {
  MUOND_RETURN_IF_ERROR(LoadNccl().status());
  ncclUniqueId id;
  if (const ncclResult_t result = Nccl().GetUniqueId(&id); result != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("ncclGetUniqueId failed: ", NcclText(result, nullptr)));
  }
  NcclUniqueId out;
  std::memcpy(out.data(), &id, out.size());
  return out;
}

absl::StatusOr<std::unique_ptr<PeerChannel>> CudaBackend::OpenPeerChannel(const NcclUniqueId& id) {
  return NcclChannel::Open(this, id);
}

}  // namespace muond::kernels::cuda

#else  // !MUOND_HAVE_NCCL

namespace muond::kernels::cuda {
namespace {

absl::Status NoNccl() {
  return absl::FailedPreconditionError(
      "this build of the CUDA backend has no NCCL (nccl.h or libnccl were not found when it was "
      "configured): the NCCL channel is unavailable; use another transport");
}

}  // namespace

int CudaBackend::NcclVersion() const { return 0; }

absl::StatusOr<NcclUniqueId> CudaBackend::NewNcclUniqueId() { return NoNccl(); }

absl::StatusOr<std::unique_ptr<PeerChannel>> CudaBackend::OpenPeerChannel(const NcclUniqueId&) { return NoNccl(); }

}  // namespace muond::kernels::cuda

#endif  // MUOND_HAVE_NCCL
