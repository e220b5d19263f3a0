// PeerPrimitives' defaults: a backend without GPU transports refuses each, saying why. And
// PeerEvent::Await's polling (kernels/peer_exchange.h).
#include "kernels/peer_primitives.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace muond::kernels {
namespace {

absl::Status NoPeerTransport(const PeerPrimitives& backend, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("the ", backend.Name(), " backend has no ", what,
                   ": GPU transports need the daemon on a CUDA GPU (--backend cuda); use the grpc or shm transport"));
}

}  // namespace

absl::Status PeerEvent::Await(absl::Time deadline, const std::function<bool()>& caller_gone) {
  // Polled without any lock of the backend: other sessions' work goes on meanwhile.
  absl::Duration pause = absl::Microseconds(10);
  for (;;) {
    absl::StatusOr<bool> done = Poll();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    // The deadline first: a call past its deadline is also cancelled, and should say why.
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "event_handle: the work the client recorded its event after (writing the gradients) did not complete "
          "by the step's deadline; nothing was applied");
    }
    if (caller_gone && caller_gone()) {
      return absl::CancelledError(
          "event_handle: the client went away (its call was cancelled) before the work it recorded its event after "
          "completed; nothing was applied");
    }
    absl::SleepFor(pause);
    // At most 100 µs: a 1 ms cap could notice an event that completed at 0.9 ms only at about
    // 1.6 ms (the sleeps 20, 40, ... 640 µs, each stretched by the timer's slack), the most of a
    // small step's time. A poll is one cudaEventQuery.
    pause = std::min(pause * 2, absl::Microseconds(100));
  }
}

absl::StatusOr<std::unique_ptr<PeerMemory>> PeerPrimitives::OpenPeerMemory(std::string_view, uint64_t) {
  return NoPeerTransport(*this, "CUDA IPC memory");
}

absl::StatusOr<std::unique_ptr<PeerEvent>> PeerPrimitives::OpenPeerEvent(std::string_view) {
  return NoPeerTransport(*this, "CUDA IPC events");
}

absl::StatusOr<NcclUniqueId> PeerPrimitives::NewNcclUniqueId() { return NoPeerTransport(*this, "NCCL"); }

absl::StatusOr<std::unique_ptr<PeerChannel>> PeerPrimitives::OpenPeerChannel(const NcclUniqueId&) {
  return NoPeerTransport(*this, "NCCL");
}

}  // namespace muond::kernels
