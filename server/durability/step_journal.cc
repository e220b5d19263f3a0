#include "server/durability/step_journal.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/durability/file_util.h"

namespace muond::durability {
namespace {

constexpr char kMagic[4] = {'M', 'J', 'R', '2'};
constexpr char kOldMagic[4] = {'M', 'J', 'R', '1'};
constexpr size_t kRecordHeader = 12;

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

uint32_t Crc(const char* data, size_t size) {
  return static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(data), static_cast<uInt>(size)));
}

}  // namespace

absl::Status StepJournal::Open(const std::string& path) {
  path_ = path;
  committed_bytes_ = 0;
  if (env_->FileExists(path)) {
    MUOND_ASSIGN_OR_RETURN(committed_bytes_, env_->GetFileSize(path));
  }
  MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path));
  return env_->SyncDir(std::filesystem::path(path).parent_path().string());
}

absl::Status StepJournal::CutTornTail() {
  MUOND_ASSIGN_OR_RETURN(std::string bytes, env_->ReadFile(path_, kNoReadLimit));
  bytes.resize(std::min<uint64_t>(bytes.size(), committed_bytes_));
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(env_, path_, bytes));
  MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path_));
  return absl::OkStatus();
}

absl::Status StepJournal::Append(absl::string_view request, const std::vector<HostTensor>& gradients) {
  if (file_ == nullptr) MUOND_RETURN_IF_ERROR(CutTornTail());
  std::string payload;
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
  Put<uint32_t>(record, static_cast<uint32_t>(payload.size()));
  Put<uint32_t>(record, Crc(payload.data(), payload.size()));
  record += payload;
  absl::Status written = file_->Append(record);
  if (written.ok()) written = file_->Sync();
  if (!written.ok()) {
    // What reached the file is a torn record at most, which a Read drops at the end of the file; a
    // later record must not follow it, so the next Append cuts it off first.
    file_->Close().IgnoreError();
    file_.reset();
    return written;
  }
  committed_bytes_ += record.size();
  return absl::OkStatus();
}

absl::Status StepJournal::Clear() {
  if (file_ == nullptr) {
    MUOND_ASSIGN_OR_RETURN(file_, env_->NewAppendableFile(path_));
  }
  MUOND_RETURN_IF_ERROR(file_->Truncate());
  committed_bytes_ = 0;
  return absl::OkStatus();
}

void StepJournal::Close() {
  if (file_ != nullptr) file_->Close().IgnoreError();
  file_.reset();
}

absl::StatusOr<JournalContents> StepJournal::Read(Env* env, const std::string& path, size_t num_parameters) {
  JournalContents contents;
  if (!env->FileExists(path)) return contents;
  MUOND_ASSIGN_OR_RETURN(std::string bytes, env->ReadFile(path, kNoReadLimit));
  size_t pos = 0;
  auto corrupt = [&](size_t at, absl::string_view why) {
    return absl::DataLossError(absl::StrCat("journal ", path, " is unusable: record at byte ", at, " ", why));
  };
  while (pos < bytes.size()) {
    const size_t start = pos;
    if (bytes.size() - pos < kRecordHeader) {
      contents.dropped_torn_tail = true;
      break;
    }
    if (std::memcmp(bytes.data() + pos, kOldMagic, 4) == 0) {
      return corrupt(start, "is in the format of an earlier muond (MJR1); restore it with that version");
    }
    if (std::memcmp(bytes.data() + pos, kMagic, 4) != 0) return corrupt(start, "has no record marker (altered)");
    pos += 4;
    uint32_t length = 0, crc = 0;
    Get(bytes, &pos, bytes.size(), &length);
    Get(bytes, &pos, bytes.size(), &crc);
    if (bytes.size() - pos < length) {
      contents.dropped_torn_tail = true;  // cut short by a crash during its append
      break;
    }
    if (Crc(bytes.data() + pos, length) != crc) return corrupt(start, "fails its CRC (altered)");
    const size_t end = pos + length;
    JournalRecord record;
    uint32_t request_length = 0, present = 0;
    if (!Get(bytes, &pos, end, &request_length) || end - pos < request_length) {
      return corrupt(start, "has a bad step request");
    }
    record.request.assign(bytes.data() + pos, request_length);
    pos += request_length;
    record.gradients.resize(num_parameters);
    if (!Get(bytes, &pos, end, &present)) return corrupt(start, "is truncated");
    for (uint32_t t = 0; t < present; ++t) {
      uint32_t index = 0;
      uint64_t count = 0;
      double sum_squares = 0;
      if (!Get(bytes, &pos, end, &index) || !Get(bytes, &pos, end, &count) || !Get(bytes, &pos, end, &sum_squares) ||
          index >= num_parameters || (end - pos) / sizeof(float) < count) {
        return corrupt(start, "has a bad gradient entry");
      }
      HostTensor& g = record.gradients[index];
      g.values.resize(count);
      std::memcpy(g.values.data(), bytes.data() + pos, count * sizeof(float));
      g.received = static_cast<int64_t>(count);
      g.sum_squares = sum_squares;
      pos += count * sizeof(float);
    }
    if (pos != end) return corrupt(start, "has trailing bytes");
    contents.records.push_back(std::move(record));
  }
  return contents;
}

}  // namespace muond::durability
