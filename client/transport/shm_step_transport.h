// The shared-memory step transport: one memfd region per session (ShmRegion, a 4-byte slot per
// element of every parameter, so either direction fits in any dtype), registered with the daemon
// when the session opens the transport (Prepare) or else at the first try. A setup the daemon
// refuses (the grant, the memfd, the registration) rather than fails to answer is kept as refusal(). Each try writes
// the gradients into their slots, calls StepShared with references to them, and reads the parameters the daemon wrote
// back over the same slots. A region the daemon lost (restart) is dropped and the try fails UNAVAILABLE, so the next
// try registers a new one. A streamed step's gradients are written into their slots as they are added (StageGradient).
//
// Viable when the daemon offers a socket, runs on this host and its socket is reachable from here.
// Ownership: owns its region; borrows the Client and the Session. One thread at a time.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>

#include "client/shm_region.h"
#include "client/transport/transport_choice.h"

namespace muond::client {

const TransportKind& ShmTransportKind();

class ShmStepTransport : public StepTransport {
 public:
  ShmStepTransport(Client& client, const Session& session) : client_(client), session_(session) {}
  std::string_view name() const override { return "shm"; }
  absl::StatusOr<StepReply> StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                     const StepOptions& options) override;
  bool StageGradient(const TensorView& gradient) override;
  void DropStaged() override { staged_.clear(); }
  absl::Status Prepare() override { return SetUpRegion(); }
  absl::Status refusal() const override { return refusal_; }

 private:
  // Creates and registers the region, and keeps refusal_.
  absl::Status SetUpRegion();
  absl::Status TrySetUpRegion();
  // The request's gradient references, with the gradients written into their slots.
  void WriteGradients(std::span<const TensorView> gradients, v1::StepSharedRequest& request);

  Client& client_;
  const Session& session_;
  std::unique_ptr<ShmRegion> region_;  // once a try needed it
  std::string region_name_;
  std::map<std::string, uint64_t> offsets_;  // per parameter, into region_
  std::set<std::string> staged_;             // gradients in their slots already, for the next try
  absl::Status refusal_;
};

}  // namespace muond::client
