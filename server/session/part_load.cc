// PartLoad: the record of parts written rank by rank (part_load.h).
#include "server/session/part_load.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/session/partition.h"

namespace muond::session {
namespace {

const char* Their(const std::vector<int>& ranks) { return ranks.size() == 1 ? "its" : "their"; }

std::vector<int> EachItsOwn(int world_size) {
  std::vector<int> ranks(static_cast<size_t>(std::max(world_size, 0)));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

}  // namespace

PartLoad::PartLoad(int world_size) : PartLoad(EachItsOwn(world_size)) {}

bool PartLoad::UnderWay() const { return !written_.empty() && !Missing().empty(); }

std::vector<int> PartLoad::Missing() const {
  std::vector<bool> replica_wrote(written_.size(), false);
  for (size_t r = 0; r < written_.size(); ++r) {
    if (written_[r]) replica_wrote[static_cast<size_t>(replica_of_[r])] = true;
  }
  std::vector<int> missing;
  for (size_t r = 0; r < written_.size(); ++r) {
    if (!replica_wrote[static_cast<size_t>(replica_of_[r])]) missing.push_back(static_cast<int>(r));
  }
  return missing;
}

std::vector<int> PartLoad::Ranks(bool written) const {
  std::vector<int> ranks;
  for (size_t r = 0; r < written_.size(); ++r) {
    if (written_[r] == written) ranks.push_back(static_cast<int>(r));
  }
  return ranks;
}

absl::Status PartLoad::CheckLoad(int rank, int64_t last_step, const std::vector<int64_t>& step_counts) const {
  return Check(rank, Written{.upload = false, .last_step = last_step, .step_counts = step_counts});
}

absl::Status PartLoad::CheckUpload(int rank) const {
  return Check(rank, Written{.upload = true, .last_step = 0, .step_counts = {}});
}

absl::Status PartLoad::Check(int rank, const Written& what) const {
  if (!UnderWay() || what == what_) return absl::OkStatus();
  // A load replaces the initial parameters some ranks have not uploaded yet (a rank loading its
  // checkpoint before the others have opened): it starts its own record, which the step waits for.
  if (what_.upload && !what.upload) return absl::OkStatus();
  const std::vector<int> done = Ranks(true);
  if (!what.upload && !what_.upload) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.last_step: rank ", rank, "'s state is of step ", what.last_step,
        what.last_step == what_.last_step ? " with other per-parameter step counts" : "", ", but ", RanksText(done),
        " loaded ", Their(done), " parts of a state of step ", what_.last_step,
        " and the other ranks have not loaded theirs yet: every rank loads the state dict it saved at the same "
        "step; nothing was loaded"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, "'s ",
      what.upload ? "upload of its initial parameters" : absl::StrCat("state of step ", what.last_step),
      " comes while ", RanksText(done), what_.upload ? " uploaded " : " loaded ", Their(done), " parts of ",
      what_.upload ? "the initial parameters" : absl::StrCat("a state of step ", what_.last_step),
      " and the other ranks have not written theirs yet: every rank writes its parts of the same thing (its "
      "initial parameters before the first step, or the state dict it saved at the same step); nothing was written"));
}

void PartLoad::Loaded(int rank, int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step,
                      bool another_state) {
  if (another_state) written_.clear();  // starts anew, whatever it would have joined
  Wrote(rank, Written{.upload = false, .last_step = last_step, .step_counts = step_counts}, session_step);
}

void PartLoad::Uploaded(int rank) {
  Wrote(rank, Written{.upload = true, .last_step = 0, .step_counts = {}}, /*session_step=*/0);
}

bool PartLoad::Starts(const Written& what, int64_t session_step) const {
  // Under way, only what Check let through differs (a load replacing an upload); over, the same
  // thing again before any step is a retry (steps only raise the session's last step).
  return UnderWay() ? what != what_ : written_.empty() || what != what_ || session_step != what_.last_step;
}

std::vector<int> PartLoad::LoadedWith(int64_t last_step, const std::vector<int64_t>& step_counts,
                                      int64_t session_step) const {
  const Written what{.upload = false, .last_step = last_step, .step_counts = step_counts};
  return Starts(what, session_step) ? std::vector<int>{} : Ranks(true);
}

void PartLoad::Wrote(int rank, const Written& what, int64_t session_step) {
  if (rank < 0 || rank >= world_size_) return;
  if (Starts(what, session_step)) {
    what_ = what;
    written_.assign(static_cast<size_t>(world_size_), false);
  }
  written_[static_cast<size_t>(rank)] = true;
}

std::optional<PartsWritten> PartLoad::Record() const {
  if (written_.empty()) return std::nullopt;
  return PartsWritten{
      .upload = what_.upload, .last_step = what_.last_step, .step_counts = what_.step_counts, .ranks = Ranks(true)};
}

absl::Status PartLoad::CheckRecord(const PartsWritten& record, int64_t last_step,
                                   const std::vector<int64_t>& step_counts) const {
  if (record.ranks.empty()) return absl::InvalidArgumentError("parts_written.ranks: no rank has written");
  for (size_t i = 0; i < record.ranks.size(); ++i) {
    const int rank = record.ranks[i];
    if (rank < 0 || rank >= world_size_ || (i > 0 && rank <= record.ranks[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat("parts_written.ranks: ", rank, " is not a rank of the session's ",
                                                     world_size_, " after the one before (ranks ascend, each once)"));
    }
  }
  PartLoad restored = *this;
  restored.Restore(record);
  if (record.upload) {
    if (record.last_step != 0 || !record.step_counts.empty()) {
      return absl::InvalidArgumentError("parts_written: an upload has no last_step or step_counts");
    }
    // Uploads come before the first step.
    if (restored.UnderWay() && last_step != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parts_written: an upload of initial parameters under way in a state of step ", last_step));
    }
    return absl::OkStatus();
  }
  if (record.step_counts.size() != step_counts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("parts_written.step_counts: ", record.step_counts.size(),
                                                   " counts for ", step_counts.size(), " parameters"));
  }
  for (int64_t count : record.step_counts) {
    if (count < 0 || count > record.last_step) {
      return absl::InvalidArgumentError(
          absl::StrCat("parts_written.step_counts: a count of ", count, " in a state of step ", record.last_step));
    }
  }
  const bool same_state = record.last_step == last_step && record.step_counts == step_counts;
  if (restored.UnderWay() ? !same_state : record.last_step > last_step) {
    return absl::InvalidArgumentError(absl::StrCat("parts_written.last_step: a load of the state of step ",
                                                   record.last_step, restored.UnderWay() ? ", under way," : "",
                                                   " in a state of step ", last_step));
  }
  return absl::OkStatus();
}

void PartLoad::Restore(const PartsWritten& record) {
  what_ = Written{.upload = record.upload, .last_step = record.last_step, .step_counts = record.step_counts};
  written_.assign(static_cast<size_t>(world_size_), false);
  for (int rank : record.ranks) written_[static_cast<size_t>(rank)] = true;
}

absl::Status PartLoad::CheckStep(int64_t step) const {
  if (!UnderWay()) return absl::OkStatus();
  const std::vector<int> missing = Missing();
  const std::vector<int> done = Ranks(true);
  if (what_.upload) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, ": ", RanksText(missing), " sent it without uploading ", Their(missing),
        " parts of the initial parameters, which ", RanksText(done), " uploaded: ", Their(missing),
        " parts would start from zeros. Every rank uploads its parts before the first step (UploadParameters "
        "with its rank); no update was applied"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, ": ", RanksText(missing), " sent it without loading ", Their(missing),
                   " parts of the state of step ", what_.last_step, " that ", RanksText(done),
                   " loaded: the step would mix that state with the one before. ",
                   "Every rank loads the state dict it saved at the same step; no update was applied"));
}

}  // namespace muond::session
