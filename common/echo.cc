#include "common/echo.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muond {

std::string Echo(absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return EscapeControls(value);
  size_t keep = max_bytes;
  // Back off over continuation bytes (10xxxxxx) so that no character is cut in two.
  while (keep > 0 && (static_cast<unsigned char>(value[keep]) & 0xC0) == 0x80) --keep;
  return absl::StrCat(EscapeControls(value.substr(0, keep)), "…(", value.size(), " bytes)");
}

std::string EscapeControls(absl::string_view text, bool keep_line_breaks) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto next = [&](size_t k) { return i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0; };
    const bool line_break = byte == '\n' || byte == '\t';
    if ((byte < 0x20 && !(keep_line_breaks && line_break)) || byte == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    } else if (byte == 0xc2 && next(1) >= 0x80 && next(1) <= 0x9f) {  // C1: U+0080–U+009F
      absl::StrAppendFormat(&out, "\\u{%04x}", next(1));
      i += 1;
    } else if (byte == 0xe2 && ((next(1) == 0x80 && next(2) >= 0xaa && next(2) <= 0xae) ||
                                (next(1) == 0x81 && next(2) >= 0xa6 && next(2) <= 0xa9))) {
      absl::StrAppendFormat(&out, "\\u{%04x}", 0x2000 + ((next(1) & 0x3f) << 6) + (next(2) & 0x3f));
      i += 2;
    } else {
      out.push_back(static_cast<char>(byte));
    }
  }
  return out;
}

}  // namespace muond
