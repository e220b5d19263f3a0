#include "server/security/token_table.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muond::security {
namespace {

constexpr absl::string_view kBearer = "bearer ";

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Walk the longer length whatever the contents, and accumulate instead of returning early.
  size_t diff = a.size() ^ b.size();
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<size_t>(x ^ y);
  }
  return diff == 0;
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source) {
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    Entry entry;
    if (const size_t colon = line.find(':'); colon != absl::string_view::npos) {
      entry.name = std::string(absl::StripAsciiWhitespace(line.substr(0, colon)));
      entry.token = std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      if (entry.name.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": empty name before ':'"));
      }
    } else {
      entry.name = absl::StrCat("token-", line_number);
      entry.token = std::string(line);
    }
    if (entry.token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": empty token"));
    }
    if (std::any_of(entry.token.begin(), entry.token.end(),
                    [](char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); })) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": a token may not contain spaces"));
    }
    table.entries_.push_back(std::move(entry));
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens (one per line: 'name:token' or 'token')"));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth-token-file: cannot read '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  return Parse(text.str(), absl::StrCat("--auth-token-file ", path));
}

absl::StatusOr<std::string> TokenTable::Authenticate(std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "missing credentials: this daemon requires the metadata 'authorization: Bearer <token>' with a token "
        "from its --auth-token-file");
  }
  absl::string_view value = absl::StripAsciiWhitespace(*authorization);
  if (value.size() < kBearer.size() || !absl::EqualsIgnoreCase(value.substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError("authorization: expected 'Bearer <token>'");
  }
  const absl::string_view presented = absl::StripAsciiWhitespace(value.substr(kBearer.size()));
  // Compare with every line, keeping the first match, so the time does not depend on which matched.
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {
    const bool equal = ConstantTimeEquals(entry.token, presented);
    if (equal && match == nullptr) match = &entry;
  }
  if (match == nullptr) {
    return absl::UnauthenticatedError("authorization: the bearer token is not one this daemon accepts");
  }
  return match->name;
}

}  // namespace muond::security
