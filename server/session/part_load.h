// PartLoad: what the ranks of a session with partitioned groups write part by part — the initial
// parameters each rank uploads (UploadParameters with its rank), or a saved state each rank loads
// (SetState with its rank) — and the ranks that have written theirs so far. A session whose ranks
// loaded states of different steps, or stepped while some ranks had written their parts and others
// had not (a part never uploaded is zeros; one not loaded is of the state before), would hold two
// states mixed; PartLoad refuses both, naming the ranks. A load replaces an upload under way (a
// rank may load its checkpoint before the others have opened); an upload while a load is under
// way is refused. The record empties once every rank has written, or when a whole upload or load
// writes every part at once. Under HSDP the replicas of a shard are interchangeable: one of them
// writing counts for all. The record travels in the session's checkpoints (Record, Restore), so a
// daemon restarted in the middle of an upload or load still waits for the ranks that have not
// written. Owned by Session and used under its mutex; not thread-safe itself.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace muond::session {

// PartLoad's record as a checkpoint keeps it (SessionState::parts_written), so that a daemon restarted
// in the middle of an upload or load goes on waiting for the ranks that have not written: what the
// ranks write (their initial parameters, or a state of `last_step` with its per-parameter step
// counts) and the ranks that have written it.
struct PartsWritten {
  bool upload = false;
  int64_t last_step = 0;
  std::vector<int64_t> step_counts;  // by parameter; empty for an upload
  std::vector<int> ranks;            // ascending
  bool operator==(const PartsWritten&) const = default;
};

class PartLoad {
 public:
  // Every rank its own: each one writes its parts.
  explicit PartLoad(int world_size);
  // replica_of[r]: the lowest rank holding what rank r holds (partition.h, ReplicaOf).
  explicit PartLoad(std::vector<int> replica_of)
      : world_size_(static_cast<int>(replica_of.size())), replica_of_(std::move(replica_of)) {}

  // OK unless other ranks have written parts of something else (a state of another step, with
  // other per-parameter step counts, or the initial parameters) since every rank last wrote:
  // FAILED_PRECONDITION naming them. Changes nothing.
  absl::Status CheckLoad(int rank, int64_t last_step, const std::vector<int64_t>& step_counts) const;
  absl::Status CheckUpload(int rank) const;
  // Records `rank`'s load of the state CheckLoad accepted; `session_step` is the session's last
  // step before it. Once every rank has loaded, the load is over; a rank loading that same state
  // again before any step (a retried SetState) starts no new one, unless `another_state` (its
  // values differ from those loaded: another state of the same step and counts).
  void Loaded(int rank, int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step,
              bool another_state = false);
  // Whether some rank has written its parts and another rank holding other parts has not.
  bool under_way() const { return UnderWay(); }
  // The ranks that have loaded their parts of the load a rank's Loaded with these arguments would
  // join (the same state, under way or over with no step since); empty when it would start a new one.
  std::vector<int> LoadedWith(int64_t last_step, const std::vector<int64_t>& step_counts, int64_t session_step) const;
  // Records `rank`'s upload of its initial parts (uploads come before the first step).
  void Uploaded(int rank);
  // Every part written at once (a whole upload or load): nothing is under way any more.
  void WroteWhole() { written_.clear(); }
  // OK when nothing is under way; otherwise FAILED_PRECONDITION for step `step`, naming the ranks
  // that have not written their parts and those that have.
  absl::Status CheckStep(int64_t step) const;

  // The record, once some rank has written its parts (none before, or after a whole write).
  std::optional<PartsWritten> Record() const;
  // OK when `record` could be this session's, in a state of `last_step` with `step_counts` (a load
  // under way is of that state; a load over, of one at most as recent): INVALID_ARGUMENT naming
  // parts_written otherwise. Changes nothing.
  absl::Status CheckRecord(const PartsWritten& record, int64_t last_step,
                           const std::vector<int64_t>& step_counts) const;
  // Takes up `record` (CheckRecord accepted it) as the record.
  void Restore(const PartsWritten& record);

 private:
  // What the ranks write: the initial parameters (upload_) or a state of last_step_.
  struct Written {
    bool upload = false;
    int64_t last_step = 0;
    std::vector<int64_t> step_counts;
    bool operator==(const Written&) const = default;
  };
  absl::Status Check(int rank, const Written& what) const;
  void Wrote(int rank, const Written& what, int64_t session_step);
  // Whether writing `what` now starts a new record rather than joining this one.
  bool Starts(const Written& what, int64_t session_step) const;
  // Something is under way while some rank has not written, nor has any of its replicas (written_
  // empty before the first).
  bool UnderWay() const;
  // The ranks whose flag in written_ is `written`.
  std::vector<int> Ranks(bool written) const;
  // The ranks none of whose replicas has written (written_ not empty).
  std::vector<int> Missing() const;

  const int world_size_;
  const std::vector<int> replica_of_;
  // What is under way, or was last written (written_ then all true).
  Written what_;
  std::vector<bool> written_;  // by rank
};

}  // namespace muond::session
