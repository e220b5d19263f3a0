// StepJournal: the append-only log of a session's steps for `--durability journal`. Each step's
// request (opaque bytes from the session layer) and gradients (as the daemon assembled them, fp32,
// with their sums of squares) are appended and synced before the step is applied and acknowledged;
// replaying the records over the last checkpoint rebuilds the exact state after a crash. A
// checkpoint empties the journal.
//
// Record: magic "MJR2" | payload length (u32) | CRC-32 of the payload (u32) | payload, where the
// payload is: request length (u32) | request | gradient count (u32) | per gradient: parameter index
// (u32), element count (u64), sum of squares (f64), the fp32 values.
// A record cut short at the end of the file is the trace of a crash during an append — that step was
// never acknowledged — and is dropped; a complete record whose CRC does not match means the file was
// altered, and reading refuses it, naming the file and the offset.
//
// Not thread-safe: the owning session serializes appends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/host_tensor.h"
#include "server/durability/env.h"

namespace muond::durability {

struct JournalRecord {
  std::string request;               // as given to Append
  std::vector<HostTensor> gradients;  // indexed like the session's parameters; absent ones empty
};

struct JournalContents {
  std::vector<JournalRecord> records;
  bool dropped_torn_tail = false;
};

class StepJournal {
 public:
  explicit StepJournal(Env* env) : env_(env) {}

  // Opens (creating it if needed) for appending, and makes the file's creation durable.
  absl::Status Open(const std::string& path);
  // Appends one step and syncs it: on OK the record survives a crash. On an error the file may end
  // in a partial record (which Read drops as a torn tail if the daemon stops now); the next Append
  // first cuts the file back to its last complete record, so no record ever follows a torn one.
  absl::Status Append(absl::string_view request, const std::vector<HostTensor>& gradients);
  // Empties the journal durably.
  absl::Status Clear();
  void Close();

  // Reads every record; `num_parameters` bounds the parameter indices. A missing file is empty.
  static absl::StatusOr<JournalContents> Read(Env* env, const std::string& path, size_t num_parameters);

 private:
  // Rewrites the file with its first committed_bytes_ bytes and reopens it.
  absl::Status CutTornTail();

  Env* const env_;
  std::string path_;
  std::unique_ptr<WritableFile> file_;  // null after a failed append, until CutTornTail
  uint64_t committed_bytes_ = 0;         // the file's size up to its last complete record
};

}  // namespace muond::durability
