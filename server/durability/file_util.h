// Helpers on top of Env for the daemon's state directory: atomic replacement of a whole file, and
// SHA-256 digests of its contents. Stateless; thread-safe as long as the Env is (every Env is). Two
// concurrent WriteFileAtomically calls on the same path race on its temporary file, so callers
// serialize writes to one path.
#pragma once

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/durability/env.h"

namespace muond::durability {

// Replaces `path` with `contents` so that a crash at any moment leaves either the previous file (or
// none) or the new one, never a mix: writes `path`.tmp, syncs and closes it, renames it over `path`,
// then syncs the parent folder. If writing, syncing, closing or renaming the temporary file fails, the
// temporary file is removed and `path` is untouched. If only the final folder sync fails, `path`
// already holds `contents` but the rename may not survive a power cut; the error is returned.
absl::Status WriteFileAtomically(Env* env, const std::string& path, absl::string_view contents);
// The same, with the contents written by `write` into the temporary file (piece by piece: a file
// larger than the memory one wants to spend on it).
absl::Status WriteFileAtomically(Env* env, const std::string& path,
                                 absl::FunctionRef<absl::Status(WritableFile&)> write);

// SHA-256 of `bytes` as 64 lowercase hex digits.
std::string Sha256Hex(absl::string_view bytes);

}  // namespace muond::durability
