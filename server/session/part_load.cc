// PartLoad: the record of a state loaded part by part (part_load.h).
#include "server/session/part_load.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::session {
namespace {

// "rank 2" or "ranks 0, 1": the ranks whose `loaded` flag is `which`.
std::string RanksWhere(const std::vector<bool>& loaded, bool which) {
  std::vector<int> ranks;
  for (size_t r = 0; r < loaded.size(); ++r) {
    if (loaded[r] == which) ranks.push_back(static_cast<int>(r));
  }
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

}  // namespace

absl::Status PartLoad::CheckLoad(int rank, int64_t last_step, const std::vector<int64_t>& step_counts) const {
  if (!under_way_) return absl::OkStatus();
  if (last_step != last_step_ || step_counts != step_counts_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.last_step: rank ", rank, "'s state is of step ", last_step,
        last_step == last_step_ ? " with other per-parameter step counts" : "", ", but ", RanksWhere(loaded_, true),
        " loaded ", std::count(loaded_.begin(), loaded_.end(), true) == 1 ? "its" : "their",
        " parts of a state of step ", last_step_,
        " and the other ranks have not loaded theirs yet: every rank loads the state dict it saved at the same "
        "step; nothing was loaded"));
  }
  return absl::OkStatus();
}

void PartLoad::Loaded(int rank, int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step) {
  if (rank < 0 || rank >= world_size_) return;
  if (!under_way_) {
    const bool again = !loaded_.empty() && last_step == last_step_ && step_counts == step_counts_ &&
                       session_step == last_step_;  // steps only raise the session's last step
    if (again) return;
    last_step_ = last_step;
    step_counts_ = step_counts;
    loaded_.assign(static_cast<size_t>(world_size_), false);
    under_way_ = true;
  }
  loaded_[static_cast<size_t>(rank)] = true;
  under_way_ = std::count(loaded_.begin(), loaded_.end(), false) > 0;
}

absl::Status PartLoad::CheckStep(int64_t step) const {
  if (!under_way_) return absl::OkStatus();
  const bool one = std::count(loaded_.begin(), loaded_.end(), false) == 1;
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, ": ", RanksWhere(loaded_, false), " sent it without loading ", one ? "its" : "their",
                   " parts of the state of step ", last_step_, " that ", RanksWhere(loaded_, true),
                   " loaded: the step would mix that state with the one before. ",
                   "Every rank loads the state dict it saved at the same step; no update was applied"));
}

}  // namespace muond::session
