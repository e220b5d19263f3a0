#include "server/durability/file_util.h"

#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/durability/sha256_stream.h"

namespace muond::durability {
namespace {

std::string ParentFolder(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  // A bare file name lives in the working directory, which needs the sync just the same.
  return parent.empty() ? "." : parent;
}

}  // namespace

absl::Status WriteFileAtomically(Env* env, const std::string& path, absl::string_view contents) {
  return WriteFileAtomically(env, path, [&](WritableFile& file) { return file.Append(contents); });
}

absl::Status WriteFileAtomically(Env* env, const std::string& path,
                                 absl::FunctionRef<absl::Status(WritableFile&)> write) {
  const std::string temp = path + ".tmp";
  // What a crash (or anyone) left at the temporary name goes first: a file, a link or a FIFO, which
  // the create below would refuse (a link or FIFO) forever after. A folder there stays, and fails it.
  env->RemoveFile(temp).IgnoreError();
  absl::StatusOr<std::unique_ptr<WritableFile>> file = env->NewWritableFile(temp);
  if (!file.ok()) return file.status();
  absl::Status status = write(**file);
  // Sync before the rename: otherwise a crash could leave `path` renamed onto a file whose data never
  // reached the disk.
  if (status.ok()) status = (*file)->Sync();
  absl::Status closed = (*file)->Close();
  if (status.ok()) status = closed;
  if (status.ok()) status = env->RenameFile(temp, path);
  if (!status.ok()) {
    // Best effort: the error that matters is the one already in `status`.
    env->RemoveFile(temp).IgnoreError();
    return status;
  }
  return env->SyncDir(ParentFolder(path));
}

std::string Sha256Hex(absl::string_view bytes) {
  Sha256Stream stream;
  stream.Update(bytes);
  return stream.FinishHex();
}

}  // namespace muond::durability
