// NcclChannels: the daemon's NCCL channels (docs/transports.md, "NCCL"): per trainer rank of a
// session, a two-rank communicator whose rank 0 is the daemon's backend, opened by OpenNcclChannel
// and joined by the client.
//
// Each communicator can hold hundreds of MiB of GPU memory, so at most `max_channels` exist at once
// (RESOURCE_EXHAUSTED beyond, after dropping idle channels that no step used within `join_timeout`
// of their opening or of their last step). A channel goes when its caller closes it, when its
// session closes, when the same rank of the same session opens a new one (a restarted trainer), and
// after a failed step (Drop: the communicator is aborted, since transfers may be in flight on either
// side). A step holds the
// channel (its `busy` mutex) while it uses it; a second step on a busy channel is refused.
//
// Thread-safety: thread-safe. Communicators are aborted and destroyed outside the table's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "server/transport/region_table.h"

namespace muond::transport {

struct NcclChannel {
  std::string caller;
  BoundSession session;
  int rank = 0;
  absl::Time join_deadline;
  std::unique_ptr<kernels::PeerChannel> peer;
  absl::Mutex busy;                                                   // held by the step using the channel
  absl::Time last_used ABSL_GUARDED_BY(busy) = absl::InfinitePast();  // the end of its last step; past: none yet
};

struct NcclChannelLimits {
  int max_channels = 4;
  absl::Duration join_timeout = absl::Seconds(60);
};

class NcclChannels {
 public:
  // `backend` (not owned) must outlive this.
  NcclChannels(kernels::Backend* backend, NcclChannelLimits limits) : backend_(backend), limits_(limits) {}
  ~NcclChannels();

  const NcclChannelLimits& limits() const { return limits_; }

  struct Opened {
    std::string name;
    kernels::NcclUniqueId unique_id;
  };
  // A new channel for rank `rank` of `session` (checked by the caller).
  absl::StatusOr<Opened> Open(const std::string& caller, const BoundSession& session, int rank);
  absl::Status Close(const std::string& caller, const std::string& name);
  // The caller's channel `name`, for a step of `session`; errors name `field`.
  absl::StatusOr<std::shared_ptr<NcclChannel>> Find(const std::string& caller, const std::string& name,
                                                    const BoundSession& session, const std::string& field) const;
  // Aborts the caller's channel `name` and forgets it (after a failed step).
  void Drop(const std::string& caller, const std::string& name);
  // The channels of `session` (not those of a later session of the same id).
  void DropSession(const BoundSession& session);
  size_t size() const;

 private:
  // Idle channels past their time, taken out of the table (aborted by the caller, outside the lock).
  std::vector<std::shared_ptr<NcclChannel>> TakeExpiredLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The channels of `rank` of `session` opened by `caller`, taken out of the table.
  std::vector<std::shared_ptr<NcclChannel>> TakeRankLocked(const std::string& caller, const BoundSession& session,
                                                           int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  kernels::Backend* const backend_;
  const NcclChannelLimits limits_;
  mutable absl::Mutex mu_;
  RegionTable<NcclChannel> channels_ ABSL_GUARDED_BY(mu_){"NCCL channel", ErrorReason::kChannelNotFound};
  int opening_ ABSL_GUARDED_BY(mu_) = 0;  // places taken by Open calls not yet filed
};

}  // namespace muond::transport
