// PeerPrimitives' defaults: a backend without GPU transports refuses each, saying why.
#include "kernels/peer_primitives.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muond::kernels {
namespace {

absl::Status NoPeerTransport(const PeerPrimitives& backend, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("the ", backend.Name(), " backend has no ", what,
                   ": GPU transports need the daemon on a CUDA GPU (--backend cuda); use the grpc or shm transport"));
}

}  // namespace

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
