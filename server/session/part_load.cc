// PartLoad: the record of a state loaded part by part (part_load.h).
#include "server/session/part_load.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/session/partition.h"

namespace muond::session {

bool PartLoad::UnderWay() const { return std::find(loaded_.begin(), loaded_.end(), false) != loaded_.end(); }

std::vector<int> PartLoad::Ranks(bool loaded) const {
  std::vector<int> ranks;
  for (size_t r = 0; r < loaded_.size(); ++r) {
    if (loaded_[r] == loaded) ranks.push_back(static_cast<int>(r));
  }
  return ranks;
}

absl::Status PartLoad::CheckLoad(int rank, int64_t last_step, const std::vector<int64_t>& step_counts) const {
  if (!UnderWay()) return absl::OkStatus();
  if (last_step != last_step_ || step_counts != step_counts_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.last_step: rank ", rank, "'s state is of step ", last_step,
        last_step == last_step_ ? " with other per-parameter step counts" : "", ", but ", RanksText(Ranks(true)),
        " loaded ", Ranks(true).size() == 1 ? "its" : "their", " parts of a state of step ", last_step_,
        " and the other ranks have not loaded theirs yet: every rank loads the state dict it saved at the same "
        "step; nothing was loaded"));
  }
  return absl::OkStatus();
}

void PartLoad::Loaded(int rank, int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step) {
  if (rank < 0 || rank >= world_size_) return;
  if (!UnderWay()) {
    const bool again = !loaded_.empty() && last_step == last_step_ && step_counts == step_counts_ &&
                       session_step == last_step_;  // steps only raise the session's last step
    if (again) return;
    last_step_ = last_step;
    step_counts_ = step_counts;
    loaded_.assign(static_cast<size_t>(world_size_), false);
  }
  loaded_[static_cast<size_t>(rank)] = true;
}

absl::Status PartLoad::CheckStep(int64_t step) const {
  if (!UnderWay()) return absl::OkStatus();
  const std::vector<int> missing = Ranks(false);
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, ": ", RanksText(missing), " sent it without loading ",
                   missing.size() == 1 ? "its" : "their", " parts of the state of step ", last_step_, " that ",
                   RanksText(Ranks(true)), " loaded: the step would mix that state with the one before. ",
                   "Every rank loads the state dict it saved at the same step; no update was applied"));
}

}  // namespace muond::session
