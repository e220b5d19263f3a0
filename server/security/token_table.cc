#include "server/security/token_table.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "openssl/evp.h"

namespace muond::security {
namespace {

constexpr absl::string_view kBearer = "bearer ";
constexpr absl::string_view kByteOrderMark = "\xEF\xBB\xBF";

// The SHA-256 of `token`, 32 bytes: what a line keeps and a presented token is compared by, so every
// comparison takes the same time whatever the lengths, and the tokens themselves are not kept.
std::string TokenDigest(absl::string_view token) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(token.data(), token.size(), digest, &size, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), size);
}

// A bare token's identity: "token-" and the first 16 hex digits of its SHA-256, the same wherever
// its line is; the digest reveals nothing usable about the token.
std::string BareTokenName(absl::string_view digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name = "token-";
  for (size_t i = 0; i < 8 && i < digest.size(); ++i) {
    const auto byte = static_cast<unsigned char>(digest[i]);
    name += kHex[byte >> 4];
    name += kHex[byte & 15];
  }
  return name;
}

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
  absl::ConsumePrefix(&text, kByteOrderMark);
  std::vector<int> lines;  // each entry's line, for the checks across lines
  std::vector<bool> bare;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    Entry entry;
    const size_t colon = line.find(':');
    absl::string_view token = line;
    if (colon != absl::string_view::npos) {
      entry.name = std::string(absl::StripAsciiWhitespace(line.substr(0, colon)));
      token = absl::StripAsciiWhitespace(line.substr(colon + 1));
      if (entry.name.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": empty name before ':'"));
      }
    }
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": empty token"));
    }
    if (std::any_of(token.begin(), token.end(),
                    [](char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); })) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": a token may not contain spaces"));
    }
    entry.digest = TokenDigest(token);
    if (colon == absl::string_view::npos) entry.name = BareTokenName(entry.digest);
    table.entries_.push_back(std::move(entry));
    lines.push_back(line_number);
    bare.push_back(colon == absl::string_view::npos);
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens (one per line: 'name:token' or 'token')"));
  }
  // One token is one identity: the first line would always win, so the second name could never be
  // used; and a name given to a line must not be one a bare token is known by, or two tokens would
  // own each other's sessions. (Maps, not pairs of lines: a file may hold many thousands.)
  absl::flat_hash_map<std::string, size_t> by_digest, by_name;
  for (size_t i = 0; i < table.entries_.size(); ++i) {
    const Entry& entry = table.entries_[i];
    const auto [same_token, new_token] = by_digest.emplace(entry.digest, i);
    if (!new_token && table.entries_[same_token->second].name != entry.name) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", lines[i], ": the token of line ",
                                                     lines[same_token->second],
                                                     " under another name; one token is one identity"));
    }
    const auto [same_name, new_name] = by_name.emplace(entry.name, i);
    if (!new_name && bare[same_name->second] != bare[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", lines[i], ": the name '", entry.name, "' is that of the bare token on line ",
                       bare[i] ? lines[i] : lines[same_name->second], "; choose another"));
    }
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
  const std::string presented = TokenDigest(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
  // Compare with every line, keeping the first match, so the time does not depend on which matched.
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {
    const bool equal = ConstantTimeEquals(entry.digest, presented);
    if (equal && match == nullptr) match = &entry;
  }
  if (match == nullptr) {
    return absl::UnauthenticatedError("authorization: the bearer token is not one this daemon accepts");
  }
  return match->name;
}

}  // namespace muond::security
