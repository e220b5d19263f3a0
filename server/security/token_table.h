// Bearer-token authentication of the daemon's callers.
//
// A TokenTable holds the tokens read from --auth-token-file: one per line, either `name:token` or a
// bare `token`, named after the token itself, "token-<the first 16 hex digits of its SHA-256>" (so
// that lines added, removed or reordered never hand one token's sessions to another); blank lines
// and lines starting with '#' are skipped, and a UTF-8 byte order mark at the start is ignored. A
// call proves who it is with the metadata `authorization: Bearer <token>`; the matching line's name
// is the caller's identity, the plain string the session registry records as a session's owner. Two
// lines may share a name (a token being rotated), and then both tokens own the same sessions; one
// token under two names, or a name that is another line's bare token's, is refused at load.
//
// Tokens are compared by their SHA-256, in time independent of where they differ, and every line is
// compared on every call, so the timing of a refusal does not reveal a token prefix or which line
// nearly matched, and a long presented token costs one digest, not a pass over every line. Tokens
// are not kept once read and never appear in log lines or error messages.
//
// Immutable once loaded; safe to share between threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muond::security {

class TokenTable {
 public:
  // Parses the text of a token file; INVALID_ARGUMENT naming the line when one is malformed (an
  // empty name or token), gives a token a second name or takes a bare token's name, and when no
  // token is left.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);
  // Reads and parses `path` (NOT_FOUND / PERMISSION_DENIED when it cannot be read).
  static absl::StatusOr<TokenTable> Load(const std::string& path);

  // `authorization` is the value of the call's authorization metadata, absent when the call has
  // none. Returns the caller's name, or UNAUTHENTICATED saying what is missing or wrong.
  absl::StatusOr<std::string> Authenticate(std::optional<absl::string_view> authorization) const;

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    std::string digest;  // the token's SHA-256 (32 bytes); the token itself is not kept
  };
  std::vector<Entry> entries_;
};

// Equality of two byte strings in time that depends only on their lengths, never on their contents.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace muond::security
