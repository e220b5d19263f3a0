#include "server/durability/file_util.h"

#include <openssl/evp.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muond::durability {
namespace {

std::string ParentFolder(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  // A bare file name lives in the working directory, which needs the sync just the same.
  return parent.empty() ? "." : parent;
}

}  // namespace

absl::Status WriteFileAtomically(Env* env, const std::string& path, absl::string_view contents) {
  const std::string temp = path + ".tmp";
  absl::StatusOr<std::unique_ptr<WritableFile>> file = env->NewWritableFile(temp);
  if (!file.ok()) return file.status();
  absl::Status status = (*file)->Append(contents);
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
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

}  // namespace muond::durability
