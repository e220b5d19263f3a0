#include "server/transport/answer_gate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace muond::transport {

AnswerClaims::AnswerClaims(std::vector<AnswerGate*> gates, std::string session_id, int rank)
    : session_id_(std::move(session_id)), rank_(rank) {
  std::erase(gates, nullptr);
  std::sort(gates.begin(), gates.end());
  gates.erase(std::unique(gates.begin(), gates.end()), gates.end());
  claims_.reserve(gates.size());
  for (AnswerGate* gate : gates) {
    absl::MutexLock lock(&gate->mu_);
    const uint64_t number = ++gate->claims_;
    ++gate->calls_in_flight_;
    gate->latest_[{session_id_, rank_}] = number;
    claims_.push_back({gate, number});
  }
}

AnswerClaims::AnswerClaims(AnswerClaims&& other) noexcept
    : claims_(std::move(other.claims_)), session_id_(std::move(other.session_id_)), rank_(other.rank_) {
  other.claims_.clear();
}

AnswerClaims::~AnswerClaims() { Release(); }

void AnswerClaims::Release() {
  for (const Claim& claim : claims_) {
    absl::MutexLock lock(&claim.gate->mu_);
    --claim.gate->calls_in_flight_;
    auto it = claim.gate->latest_.find({session_id_, rank_});
    if (it != claim.gate->latest_.end() && it->second == claim.number) claim.gate->latest_.erase(it);
  }
  claims_.clear();
}

absl::Status AnswerClaims::Write(absl::FunctionRef<bool()> given_up, absl::FunctionRef<absl::Status()> write,
                                 const std::string& what) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // In address order, as every call locks them: two calls naming the same gates cannot deadlock.
  for (const Claim& claim : claims_) claim.gate->mu_.Lock();
  absl::Status status;
  if (given_up()) {
    status =
        absl::CancelledError(absl::StrCat("the caller gave this call up (its deadline passed, it cancelled or its "
                                          "connection closed): its answer was not written into its ",
                                          what));
  } else {
    for (const Claim& claim : claims_) {
      auto it = claim.gate->latest_.find({session_id_, rank_});
      if (it == claim.gate->latest_.end() || it->second != claim.number) {
        status = absl::FailedPreconditionError(
            absl::StrCat("a later step call of session '", session_id_, "' rank ", rank_, " named the same ", what,
                         " while this one was in flight: this call's answer was not written there (one step call "
                         "at a time per session and rank)"));
        break;
      }
    }
  }
  if (status.ok()) status = write();
  for (auto it = claims_.rbegin(); it != claims_.rend(); ++it) it->gate->mu_.Unlock();
  return status;
}

}  // namespace muond::transport
