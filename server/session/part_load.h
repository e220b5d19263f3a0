// PartLoad: a state that a session with partitioned groups loads part by part — each rank its own
// parts, with SetState — and the ranks that have loaded it so far. A session whose ranks loaded
// states of different steps, or stepped while some ranks had loaded and others had not, would hold
// two states mixed; PartLoad refuses both, naming the ranks. The record empties once every rank has
// loaded. Owned by Session and used under its mutex; not thread-safe itself.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace muond::session {

class PartLoad {
 public:
  explicit PartLoad(int world_size) : world_size_(world_size) {}

  // OK unless other ranks have loaded a state of another step (or other per-parameter step counts)
  // since every rank last loaded: FAILED_PRECONDITION naming them. Changes nothing.
  absl::Status CheckLoad(int rank, int64_t last_step, const std::vector<int64_t>& step_counts) const;
  // Records `rank`'s load of the state CheckLoad accepted; `session_step` is the session's last
  // step before it. Once every rank has loaded, the load is over; a rank loading that same state
  // again before any step (a retried SetState) starts no new one.
  void Loaded(int rank, int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step);
  // OK when no load is under way; otherwise FAILED_PRECONDITION for step `step`, naming the ranks
  // that have not loaded their parts and those that have.
  absl::Status CheckStep(int64_t step) const;

 private:
  // A load is under way while some rank has not loaded (loaded_ empty before the first load).
  bool UnderWay() const;
  // The ranks whose flag in loaded_ is `loaded`.
  std::vector<int> Ranks(bool loaded) const;

  const int world_size_;
  // The state of the load under way, or of the last one over (loaded_ then all true).
  int64_t last_step_ = 0;
  std::vector<int64_t> step_counts_;
  std::vector<bool> loaded_;  // by rank
};

}  // namespace muond::session
