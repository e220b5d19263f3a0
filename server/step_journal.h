// StepJournal: the append-only log of a session's steps for `--durability journal`. Each step's
// header and gradients (as the daemon assembled them, fp32, with their sums of squares) are appended
// and fsynced before the step is applied and acknowledged; replaying the records over the last
// checkpoint rebuilds the exact state after a crash. A checkpoint empties the journal.
//
// Record: magic "MJR1" | payload length (u32) | CRC-32 of the payload (u32) | payload.
// A record cut short at the end of the file is the trace of a crash during an append — that step was
// never acknowledged — and is dropped; a complete record whose CRC does not match means the file was
// altered, and reading refuses it, naming the file and the offset.
//
// Not thread-safe: the owning session serializes appends.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/durable_file.h"
#include "server/tensor_assembler.h"

namespace muond::server {

struct JournalRecord {
  v1::StepHeader header;
  std::vector<AssembledTensor> gradients;  // indexed like the session's parameters; absent ones empty
};

struct JournalContents {
  std::vector<JournalRecord> records;
  bool dropped_torn_tail = false;
};

class StepJournal {
 public:
  absl::Status Open(const std::string& path) { return file_.Open(path); }
  absl::Status Append(const v1::StepHeader& header, const std::vector<AssembledTensor>& gradients);
  absl::Status Clear() { return file_.Truncate(); }
  void Close() { file_.Close(); }
  const std::string& path() const { return file_.path(); }

  // Reads every record; `num_parameters` bounds the parameter indices. A missing file is empty.
  static absl::StatusOr<JournalContents> Read(const std::string& path, size_t num_parameters);

 private:
  AppendOnlyFile file_;
};

}  // namespace muond::server
