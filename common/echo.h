// Echo: a client's string (a session id, a channel, a parameter or region name) as the daemon quotes
// it in an error or a log line — bounded, so that a peer sending a megabyte of name gets a short
// error naming the field (not a message over its metadata limit) and the log gets a short line.
//
// Up to `max_bytes` bytes are kept, cut at a UTF-8 character boundary; a longer value ends in
// "…(N bytes)" with its full length. Pure function.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace muond {

inline constexpr size_t kEchoBytes = 128;

std::string Echo(absl::string_view value, size_t max_bytes = kEchoBytes);

}  // namespace muond
