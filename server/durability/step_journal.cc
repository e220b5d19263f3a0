#include "server/durability/step_journal.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/durability/file_util.h"
#include "server/durability/json_depth.h"

namespace muond::durability {
namespace {

constexpr char kMagic[4] = {'M', 'J', 'R', '4'};
constexpr char kMagicWithoutGeneration[4] = {'M', 'J', 'R', '3'};  // the same header, no generation
constexpr char kPreviousMagic[4] = {'M', 'J', 'R', '2'};
constexpr char kOldMagic[4] = {'M', 'J', 'R', '1'};
constexpr size_t kHeader = 20;          // MJR4, MJR3: magic, u64 length, payload CRC, header CRC
constexpr size_t kPreviousHeader = 12;  // MJR2: magic, u32 length, payload CRC
// A step request is a small JSON object (overrides per group, QK-clip logits per head).
constexpr uint64_t kMaxRequestBytes = uint64_t{16} << 20;
// Per gradient entry: index (u32), element count (u64), sum of squares (f64).
constexpr uint64_t kGradientEntryBytes = 20;
// Payloads above this are checked against their CRC, kPayloadPiece bytes at a time, before they are
// read into memory.
constexpr uint64_t kPayloadReadWhole = uint64_t{64} << 20;
constexpr size_t kPayloadPiece = size_t{1} << 20;

template <typename T>
void Put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads a T at *pos when it fits before `end`.
template <typename T>
bool Get(const std::string& in, size_t* pos, size_t end, T* value) {
  if (end - *pos < sizeof(T)) return false;
  std::memcpy(value, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

// Why a record's gradient and its stored sum of squares cannot be what the daemon wrote (empty when
// they can): the daemon journals the sum the step clips and skips by, taken in fp64 over the values
// in blocks, so the sum is non-finite exactly when a value is, and otherwise within a rounding of
// this fp64 sum in another order (at most n·2⁻⁵³ apart relatively, below 10⁻⁶ for n < 2³²).
std::string SumSquaresMismatch(const std::vector<float>& values, double stored) {
  double sum = 0;
  bool finite = true;
  for (const float v : values) {
    finite = finite && std::isfinite(v);
    sum += static_cast<double>(v) * v;
  }
  if (!finite) return std::isfinite(stored) ? "a value that is not finite, but a finite sum of squares" : "";
  if (!std::isfinite(stored)) return absl::StrCat("finite values, but a sum of squares of ", stored);
  if (!(std::abs(stored - sum) <= 1e-6 * sum)) {
    return absl::StrCat("values whose sum of squares is ", sum, ", but a recorded sum of ", stored);
  }
  return "";
}

uint32_t Crc(const char* data, size_t size) {
  return static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(data), size));
}

// Reads `length` bytes of `file` from `offset`, kPayloadPiece at a time, handing each piece to
// `take`: memory for a piece, not for the whole. Returns the bytes read, fewer where the file ends.
absl::StatusOr<uint64_t> ReadInPieces(ReadableFile& file, uint64_t offset, uint64_t length,
                                      const std::function<absl::Status(absl::string_view)>& take) {
  std::string piece(static_cast<size_t>(std::min<uint64_t>(length, kPayloadPiece)), '\0');
  uint64_t done = 0;
  while (done < length) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, piece.size()));
    MUOND_ASSIGN_OR_RETURN(const size_t got, file.ReadAt(offset + done, piece.data(), want));
    MUOND_RETURN_IF_ERROR(take(absl::string_view(piece.data(), got)));
    done += got;
    if (got < want) break;
  }
  return done;
}

// The largest payload a record of a session with these parameters can have: the generation, the
// request and every gradient present once.
uint64_t MaxPayloadBytes(const std::vector<int64_t>& numel) {
  uint64_t bytes = 8 + 4 + kMaxRequestBytes + 4;
  for (const int64_t n : numel) bytes += kGradientEntryBytes + 4 * static_cast<uint64_t>(std::max<int64_t>(n, 0));
  return bytes;
}

}  // namespace

absl::Status StepJournal::Open(const std::string& path, std::optional<uint64_t> complete_bytes) {
  path_ = path;
  last_record_bytes_ = 0;
  uint64_t size = 0;
  if (env_->FileExists(path)) {
    MUOND_ASSIGN_OR_RETURN(size, env_->GetFileSize(path));
  }
  committed_bytes_ = std::min(size, complete_bytes.value_or(size));
  MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path));
  MUOND_RETURN_IF_ERROR(env_->SyncDir(std::filesystem::path(path).parent_path().string()));
  if (committed_bytes_ < size) {
    // A torn tail: left as it is (a checkpoint may empty the journal first), and cut off before the
    // next record, which must not follow it.
    Close();  // the next Append cuts the file back first (CutTornTail)
  }
  return absl::OkStatus();
}

absl::Status StepJournal::CutTornTail() {
  // The committed records copied a piece at a time into the journal's replacement: memory for a
  // piece, not for the journal.
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in, env_->NewReadableFile(path_));
  const uint64_t keep = std::min<uint64_t>(in->size(), committed_bytes_);
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(env_, path_, [&](WritableFile& out) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(const uint64_t copied,
                           ReadInPieces(*in, 0, keep, [&](absl::string_view piece) { return out.Append(piece); }));
    if (copied < keep) {
      return absl::DataLossError(
          absl::StrCat("journal ", path_, " shrank below its ", keep, " committed bytes while it was cut back"));
    }
    return absl::OkStatus();
  }));
  MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path_));
  return absl::OkStatus();
}

absl::Status StepJournal::Append(uint64_t checkpoint_generation, absl::string_view request,
                                 const std::vector<HostTensor>& gradients) {
  last_record_bytes_ = 0;
  if (file_ == nullptr) MUOND_RETURN_IF_ERROR(CutTornTail());
  std::string payload;
  Put<uint64_t>(payload, checkpoint_generation);
  Put<uint32_t>(payload, static_cast<uint32_t>(request.size()));
  payload.append(request.data(), request.size());
  uint32_t present = 0;
  for (const HostTensor& g : gradients) present += g.present() ? 1 : 0;
  Put<uint32_t>(payload, present);
  for (size_t i = 0; i < gradients.size(); ++i) {
    const HostTensor& g = gradients[i];
    if (!g.present()) continue;
    Put<uint32_t>(payload, static_cast<uint32_t>(i));
    Put<uint64_t>(payload, g.values.size());
    Put<double>(payload, g.sum_squares);  // kept, not recomputed: the replay must clip identically
    payload.append(reinterpret_cast<const char*>(g.values.data()), g.values.size() * sizeof(float));
  }
  std::string record(kMagic, 4);
  Put<uint64_t>(record, payload.size());
  Put<uint32_t>(record, Crc(payload.data(), payload.size()));
  Put<uint32_t>(record, Crc(record.data(), record.size()));  // the header's own CRC
  record += payload;
  absl::Status written = file_->Append(record);
  if (written.ok()) written = file_->Sync();
  if (!written.ok()) {
    // What reached the file is a torn record at most, which a Read drops at the end of the file; a
    // later record must not follow it, so the next Append cuts it off first.
    Close();
    return written;
  }
  committed_bytes_ += record.size();
  last_record_bytes_ = record.size();
  return absl::OkStatus();
}

absl::Status StepJournal::WithdrawLast() {
  if (last_record_bytes_ == 0 || file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("journal ", path_, ": no record to withdraw (the last append did not succeed, or was withdrawn)"));
  }
  committed_bytes_ -= last_record_bytes_;
  last_record_bytes_ = 0;
  // The file ends with that record: cut back in place, whatever the journal's size, and needing no
  // room on the disk. On an error the record may still be there (or gone without the cut being
  // durable): the next Append cuts the file back to committed_bytes_ first, as it does a torn tail.
  absl::Status cut = file_->Truncate(committed_bytes_);
  if (!cut.ok()) Close();
  return cut;
}

absl::Status StepJournal::Clear() {
  if (file_ == nullptr) {
    MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path_));
  }
  absl::Status truncated = file_->Truncate(0);
  // Called once a checkpoint holds every record, so none of them is kept either way. On an error the
  // file may be whole, empty, or empty but not durably so: the next Append rewrites it with no record
  // (CutTornTail) before it appends.
  committed_bytes_ = 0;
  last_record_bytes_ = 0;
  if (!truncated.ok()) Close();
  return truncated;
}

void StepJournal::Close() {
  if (file_ != nullptr) file_->Close().IgnoreError();
  file_.reset();
}

absl::StatusOr<JournalContents> StepJournal::Read(Env* env, const std::string& path,
                                                  const std::vector<int64_t>& numel) {
  JournalContents contents;
  if (!env->FileExists(path) && !env->IsLink(path)) return contents;
  // A record at a time: memory for one record's payload (at most what a step of this session can
  // hold) besides the records kept, never for the file, whose size only the disk bounds (and a
  // sparse file can claim without holding).
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, env->NewReadableFile(path));
  const uint64_t size = file->size();
  const uint64_t max_payload = MaxPayloadBytes(numel);
  auto corrupt = [&](uint64_t at, absl::string_view why) {
    return absl::DataLossError(absl::StrCat("journal ", path, " is unusable: record at byte ", at, " ", why));
  };
  std::string head(kHeader, '\0');
  std::string payload;
  uint64_t pos = 0;
  while (pos < size) {
    const uint64_t start = pos;
    const size_t want = static_cast<size_t>(std::min<uint64_t>(size - pos, kHeader));
    MUOND_ASSIGN_OR_RETURN(const size_t got, file->ReadAt(pos, head.data(), want));
    if (got < 4) {
      // A few bytes of a header at the very end: what an append cut short leaves, if they begin one.
      if (std::memcmp(head.data(), kMagic, got) != 0) return corrupt(start, "has no record marker (altered)");
      contents.dropped_torn_tail = true;
      break;
    }
    const bool generationed = std::memcmp(head.data(), kMagic, 4) == 0;
    const bool current = generationed || std::memcmp(head.data(), kMagicWithoutGeneration, 4) == 0;
    const bool previous = std::memcmp(head.data(), kPreviousMagic, 4) == 0;
    if (std::memcmp(head.data(), kOldMagic, 4) == 0) {
      return corrupt(start, "is in the format of an earlier muond (MJR1); restore it with that version");
    }
    if (!current && !previous) return corrupt(start, "has no record marker (altered)");
    const size_t header = current ? kHeader : kPreviousHeader;
    if (got < header) {
      contents.dropped_torn_tail = true;  // the header itself cut short at the end of the file
      break;
    }
    size_t at = 4;
    uint64_t length = 0;
    uint32_t crc = 0;
    if (current) {
      uint32_t header_crc = 0;
      Get(head, &at, header, &length);
      Get(head, &at, header, &crc);
      Get(head, &at, header, &header_crc);
      if (Crc(head.data(), kHeader - 4) != header_crc) return corrupt(start, "fails its header CRC (altered)");
    } else {
      uint32_t length32 = 0;
      Get(head, &at, header, &length32);
      Get(head, &at, header, &crc);
      length = length32;
    }
    if (length > max_payload) {
      return corrupt(start, absl::StrCat("declares ", length, " payload bytes, more than the ", max_payload,
                                         " a step of this session can hold (altered)"));
    }
    pos += header;
    if (size - pos < length) {
      contents.dropped_torn_tail = true;  // cut short by a crash during its append, at the end of the file
      break;
    }
    // A forged header can claim any length up to a step's largest: a large payload is checked
    // against its CRC a piece at a time before memory is taken for it.
    if (length > kPayloadReadWhole) {
      uLong running = crc32_z(0L, Z_NULL, 0);
      MUOND_ASSIGN_OR_RETURN(const uint64_t checked, ReadInPieces(*file, pos, length, [&](absl::string_view piece) {
                               running = crc32_z(running, reinterpret_cast<const Bytef*>(piece.data()), piece.size());
                               return absl::OkStatus();
                             }));
      if (checked < length) {
        contents.dropped_torn_tail = true;  // the file shrank while it was read
        break;
      }
      if (static_cast<uint32_t>(running) != crc) return corrupt(start, "fails its CRC (altered)");
    }
    try {
      payload.resize(static_cast<size_t>(length));
    } catch (const std::exception&) {  // std::bad_alloc, std::length_error
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot read journal ", path, ": no memory for its record of ", length, " bytes"));
    }
    MUOND_ASSIGN_OR_RETURN(const size_t read, file->ReadAt(pos, payload.data(), payload.size()));
    if (read < payload.size()) {
      contents.dropped_torn_tail = true;  // the file shrank while it was read
      break;
    }
    pos += length;
    if (Crc(payload.data(), payload.size()) != crc) return corrupt(start, "fails its CRC (altered)");
    const size_t end = payload.size();
    size_t p = 0;
    JournalRecord record;
    if (generationed && !Get(payload, &p, end, &record.checkpoint_generation)) return corrupt(start, "is truncated");
    uint32_t request_length = 0, present = 0;
    if (!Get(payload, &p, end, &request_length) || end - p < request_length) {
      return corrupt(start, "has a bad step request");
    }
    record.request.assign(payload.data() + p, request_length);
    if (!JsonDepthWithin(record.request)) return corrupt(start, "has a step request nested too deeply");
    p += request_length;
    record.gradients.resize(numel.size());
    if (!Get(payload, &p, end, &present)) return corrupt(start, "is truncated");
    for (uint32_t t = 0; t < present; ++t) {
      uint32_t index = 0;
      uint64_t count = 0;
      double sum_squares = 0;
      if (!Get(payload, &p, end, &index) || !Get(payload, &p, end, &count) || !Get(payload, &p, end, &sum_squares) ||
          index >= numel.size() || (end - p) / sizeof(float) < count) {
        return corrupt(start, "has a bad gradient entry");
      }
      HostTensor& g = record.gradients[index];
      if (g.present()) return corrupt(start, absl::StrCat("holds parameter ", index, "'s gradient twice"));
      if (count != static_cast<uint64_t>(numel[index])) {
        return corrupt(start, absl::StrCat("holds a gradient of ", count, " elements for parameter ", index,
                                           ", whose spec gives ", numel[index]));
      }
      g.values.resize(count);
      std::memcpy(g.values.data(), payload.data() + p, count * sizeof(float));
      g.received = static_cast<int64_t>(count);
      g.sum_squares = sum_squares;
      p += count * sizeof(float);
      if (const std::string mismatch = SumSquaresMismatch(g.values, sum_squares); !mismatch.empty()) {
        return corrupt(start, absl::StrCat("holds a gradient of parameter ", index, " with ", mismatch, " (altered)"));
      }
    }
    if (p != end) return corrupt(start, "has trailing bytes");
    contents.records.push_back(std::move(record));
    contents.complete_bytes = pos;
  }
  return contents;
}

}  // namespace muond::durability
