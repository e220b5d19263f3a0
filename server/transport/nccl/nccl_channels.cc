#include "server/transport/nccl/nccl_channels.h"

#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "server/transport/liveness_tickets.h"

namespace muond::transport {
namespace {

void AbortAll(std::vector<std::shared_ptr<NcclChannel>>& channels) {
  for (const auto& channel : channels) {
    if (channel->peer != nullptr) channel->peer->Abort();
  }
  channels.clear();
}

}  // namespace

NcclChannels::~NcclChannels() {
  std::vector<std::shared_ptr<NcclChannel>> all;
  {
    absl::MutexLock lock(&mu_);
    all = channels_.TakeAll();
  }
  AbortAll(all);
}

std::vector<std::shared_ptr<NcclChannel>> NcclChannels::TakeExpiredLocked(absl::Time now) {
  return channels_.TakeIf([&](const RegionOwner&, NcclChannel& channel) {
    if (!channel.busy.TryLock()) return false;  // a step using it is not idle
    const absl::Time since =
        channel.last_used == absl::InfinitePast() ? channel.join_deadline - limits_.join_timeout : channel.last_used;
    channel.busy.Unlock();
    return now - since > limits_.join_timeout;
  });
}

std::vector<std::shared_ptr<NcclChannel>> NcclChannels::TakeRankLocked(const std::string& caller,
                                                                       const BoundSession& session, int rank) {
  return channels_.TakeIf([&](const RegionOwner& owner, const NcclChannel& channel) {
    return owner.caller == caller && owner.session == session && channel.rank == rank;
  });
}

absl::StatusOr<NcclChannels::Opened> NcclChannels::Open(const std::string& caller, const BoundSession& session,
                                                        int rank) {
  std::vector<std::shared_ptr<NcclChannel>> dropped;  // aborted outside the lock
  absl::Cleanup abort_dropped = [&] { AbortAll(dropped); };
  {
    absl::MutexLock lock(&mu_);
    // A rank opens a new channel when its trainer restarted (or its last step failed): the old one
    // is of no use any more.
    dropped = TakeRankLocked(caller, session, rank);
    if (channels_.size() + opening_ >= static_cast<size_t>(limits_.max_channels)) {
      std::vector<std::shared_ptr<NcclChannel>> expired = TakeExpiredLocked(absl::Now());
      dropped.insert(dropped.end(), expired.begin(), expired.end());
    }
    if (channels_.size() + opening_ >= static_cast<size_t>(limits_.max_channels)) {
      return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", channels_.size() + opening_,
                                                       " NCCL channels, its most (--max-nccl-channels); close "
                                                       "one (CloseNcclChannel) or use the cuda_ipc or grpc transport"));
    }
    ++opening_;
  }
  absl::Cleanup opened_or_not = [&] {
    absl::MutexLock lock(&mu_);
    --opening_;
  };
  AbortAll(dropped);
  MUOND_ASSIGN_OR_RETURN(kernels::NcclUniqueId id, backend_->NewNcclUniqueId());
  auto channel = std::make_shared<NcclChannel>();
  channel->caller = caller;
  channel->session = session;
  channel->rank = rank;
  channel->join_deadline = absl::Now() + limits_.join_timeout;
  MUOND_ASSIGN_OR_RETURN(channel->peer, backend_->OpenPeerChannel(id));
  Opened opened{absl::StrCat("nccl-", RandomTicket()), id};
  absl::MutexLock lock(&mu_);
  channels_.Insert({.caller = caller, .session = session, .connection = 0}, opened.name, std::move(channel));
  return opened;
}

absl::Status NcclChannels::Close(const std::string& caller, const std::string& name) {
  std::shared_ptr<NcclChannel> closed;
  absl::Cleanup abort_closed = [&] {
    if (closed != nullptr && closed->peer != nullptr) closed->peer->Abort();
  };
  absl::MutexLock lock(&mu_);
  closed = channels_.Take(caller, name);
  if (closed == nullptr) return absl::NotFoundError(absl::StrCat("channel: no NCCL channel '", Echo(name), "'"));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<NcclChannel>> NcclChannels::Find(const std::string& caller, const std::string& name,
                                                                const BoundSession& session,
                                                                const std::string& field) const {
  absl::MutexLock lock(&mu_);
  return channels_.Find(caller, name, &session, field,
                        " (closed after a failed step, or the daemon restarted): open a new one");
}

void NcclChannels::Drop(const std::string& caller, const std::string& name) {
  std::vector<std::shared_ptr<NcclChannel>> dropped;
  absl::Cleanup abort_dropped = [&] { AbortAll(dropped); };
  absl::MutexLock lock(&mu_);
  if (std::shared_ptr<NcclChannel> channel = channels_.Take(caller, name)) dropped.push_back(std::move(channel));
}

void NcclChannels::DropSession(const BoundSession& session) {
  std::vector<std::shared_ptr<NcclChannel>> dropped;
  absl::Cleanup abort_dropped = [&] { AbortAll(dropped); };
  absl::MutexLock lock(&mu_);
  dropped = channels_.TakeSession(session);
}

size_t NcclChannels::size() const {
  absl::MutexLock lock(&mu_);
  return channels_.size();
}

}  // namespace muond::transport
