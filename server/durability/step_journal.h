// StepJournal: the append-only log of a session's steps for `--durability journal`. Each step's
// request (opaque bytes from the session layer) and gradients (as the daemon assembled them, fp32,
// with their sums of squares) are appended and synced before the step is applied and acknowledged;
// replaying the records over the last checkpoint rebuilds the exact state after a crash. A
// checkpoint empties the journal; a step that failed before it changed anything withdraws its record.
//
// Record (after leveldb's log format, with the header checked on its own): a 20-byte header — magic
// "MJR4" | payload length (u64) | CRC-32 of the payload (u32) | CRC-32 of the 16 bytes before it (u32)
// — then the payload: checkpoint generation (u64) | request length (u32) | request (JSON) | gradient
// count (u32) | per gradient: parameter index (u32), element count (u64), sum of squares (f64), the
// fp32 values. The generation is that of the last checkpoint the session tried to write before the
// step (checkpoint.h): a record older than the checkpoint in place predates it, whatever its step.
//
// Reading: only a record cut short at the very end of the file — fewer than 20 bytes left, or a header
// whose own CRC verifies and whose payload runs past the end — is the trace of a crash during an
// append (that step was never acknowledged) and is dropped. Anything else refuses the whole journal
// with DATA_LOSS naming the file and the record's offset: a bad marker or header CRC (an altered
// length is caught here, so it can never pass for a torn tail), a length above what the session's
// parameters allow, a payload CRC that does not match, a gradient of the wrong size. Reading changes
// nothing on disk. Records of the earlier formats are still read, as of generation 0: "MJR3" (the
// same header, a payload without the generation) and "MJR2" (a 12-byte header of magic, u32 length
// and payload CRC, the MJR3 payload), whose length past the end counts as a torn tail only within
// the same plausible bound. "MJR1" journals are refused with a message saying so.
//
// Not thread-safe: the owning session serializes appends.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/host_tensor.h"
#include "server/durability/env.h"

namespace muond::durability {

struct JournalRecord {
  uint64_t checkpoint_generation = 0;  // as given to Append; 0 in the earlier formats
  std::string request;                 // as given to Append
  std::vector<HostTensor> gradients;   // indexed like the session's parameters; absent ones empty
};

struct JournalContents {
  std::vector<JournalRecord> records;
  bool dropped_torn_tail = false;
  // The file's bytes up to the end of its last complete record (a torn tail is past them).
  uint64_t complete_bytes = 0;
};

class StepJournal {
 public:
  explicit StepJournal(Env* env) : env_(env) {}

  // Opens (creating it if needed) for appending, and makes the file's creation durable.
  // `complete_bytes`: where its last complete record ends, as Read found (JournalContents); a torn
  // tail past it is cut off before the next record is appended. Unset: the whole file.
  absl::Status Open(const std::string& path, std::optional<uint64_t> complete_bytes = std::nullopt);
  // Appends one step and syncs it: on OK the record survives a crash. On an error the file may end
  // in a partial record (which Read drops as a torn tail if the daemon stops now); the next Append
  // first cuts the file back to its last complete record, so no record ever follows a torn one.
  absl::Status Append(uint64_t checkpoint_generation, absl::string_view request,
                      const std::vector<HostTensor>& gradients);
  // Removes, durably, the record the last Append wrote: its step failed before it changed any state,
  // so a restore must not apply it (and a resend of the step is recorded anew). Only right after an
  // Append that succeeded; FAILED_PRECONDITION otherwise. The file is cut back to its records before
  // it (ftruncate + fsync: no copy, no room on the disk). On an error the record may remain in the
  // file; the next Append cuts it off first.
  absl::Status WithdrawLast();
  // Empties the journal durably (every record is in a checkpoint). On an error the next Append
  // empties it first.
  absl::Status Clear();
  void Close();

  // Reads every record, one at a time (memory for the records, not for the file's size). `numel` is
  // the element count of each of the session's parameters: it bounds the parameter indices, fixes
  // each gradient's size and bounds a record's plausible length. A gradient whose stored sum of
  // squares cannot be its values' (the replay skips and clips by it) is refused. A missing file is
  // empty; a link or a file other than a regular one is refused.
  static absl::StatusOr<JournalContents> Read(Env* env, const std::string& path, const std::vector<int64_t>& numel);

 private:
  // Rewrites the file with its first committed_bytes_ bytes and reopens it.
  absl::Status CutTornTail();

  Env* const env_;
  std::string path_;
  std::unique_ptr<WritableFile> file_;  // null after a failed append, until CutTornTail
  uint64_t committed_bytes_ = 0;        // the file's size up to its last complete record
  uint64_t last_record_bytes_ = 0;      // the size of the record the last Append wrote; 0: none to withdraw
};

}  // namespace muond::durability
