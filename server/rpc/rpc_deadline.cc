#include "server/rpc/rpc_deadline.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpc/grpc.h"
#include "grpc/support/time.h"

namespace muond::rpc {

bool CallerGaveUp(const grpc::ServerContext& context) {
  // The raw deadline, in its own clock: a far one (a client's "forever" of centuries) stays far,
  // where its conversion to a std::chrono time point would overflow.
  const gpr_timespec deadline = context.raw_deadline();
  return context.IsCancelled() || gpr_time_cmp(deadline, gpr_now(deadline.clock_type)) <= 0;
}

RpcDeadlines::RpcDeadlines(absl::Duration timeout) : timeout_(timeout) {
  if (timeout_ > absl::ZeroDuration()) thread_ = std::thread([this] { Loop(); });
}

RpcDeadlines::~RpcDeadlines() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

RpcDeadlines::Scope RpcDeadlines::Watch(grpc::ServerContext* context) {
  absl::MutexLock lock(&mu_);
  ++active_;
  if (timeout_ <= absl::ZeroDuration()) return Scope(this, {}, /*armed=*/false);
  const std::pair<absl::Time, uint64_t> key{absl::Now() + timeout_, next_++};
  calls_.emplace(key, context);
  return Scope(this, key, /*armed=*/true);
}

RpcDeadlines::Scope::~Scope() {
  if (owner_ == nullptr) return;
  // Taking the lock also waits out a cancellation of this very call that is under way.
  absl::MutexLock lock(&owner_->mu_);
  if (armed_) owner_->calls_.erase(key_);
  --owner_->active_;
}

bool RpcDeadlines::AwaitIdle(absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), limit);
}

void RpcDeadlines::Loop() {
  const std::string message = absl::StrCat("the call ran longer than the daemon's limit of ",
                                           absl::FormatDuration(timeout_), " (--rpc-timeout)");
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const absl::Time now = absl::Now();
    while (!calls_.empty() && calls_.begin()->first.first <= now) {
      grpc::ServerContext* context = calls_.begin()->second;
      calls_.erase(calls_.begin());
      // Ends the call with this status on both sides; a handler blocked in Read() wakes up with
      // false, and whatever it returns afterwards is not sent.
      grpc_call_cancel_with_status(context->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED, message.c_str(), nullptr);
      MUOND_LOG(warn, "a call from {} exceeded --rpc-timeout ({}) and was cancelled", context->peer(),
                absl::FormatDuration(timeout_));
    }
    // Wake up for the earliest deadline, a newly armed call (at the latest after one timeout, which
    // is before its deadline passes) or shutdown.
    const absl::Time wake = calls_.empty() ? now + timeout_ : calls_.begin()->first.first;
    const absl::Time until = std::min(wake, now + timeout_);
    mu_.AwaitWithDeadline(absl::Condition(&stopping_), until);
  }
}

}  // namespace muond::rpc
