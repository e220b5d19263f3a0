// Echo: a client's string (a session id, a channel, a parameter or region name) as the daemon quotes
// it in an error or a log line — bounded, so that a peer sending a megabyte of name gets a short
// error naming the field (not a message over its metadata limit) and the log gets a short line.
//
// Up to `max_bytes` bytes are kept, cut at a UTF-8 character boundary; a longer value ends in
// "…(N bytes)" with its full length. Control characters are written as escapes (EscapeControls), so
// that a client's string cannot start a forged log line or drive an operator's terminal. Pure
// functions.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace muond {

inline constexpr size_t kEchoBytes = 128;

std::string Echo(absl::string_view value, size_t max_bytes = kEchoBytes);

// `text` with its control characters (C0 — newline and tab too unless `keep_line_breaks` — DEL, C1)
// and the bidirectional embedding, override and isolate marks (U+202A–U+202E, U+2066–U+2069)
// written as escapes: "\x1b", "\u{009b}", "\u{202e}".
std::string EscapeControls(absl::string_view text, bool keep_line_breaks = false);

}  // namespace muond
