#include "common/echo.h"

#include "absl/strings/str_cat.h"

namespace muond {

std::string Echo(absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return std::string(value);
  size_t keep = max_bytes;
  // Back off over continuation bytes (10xxxxxx) so that no character is cut in two.
  while (keep > 0 && (static_cast<unsigned char>(value[keep]) & 0xC0) == 0x80) --keep;
  return absl::StrCat(value.substr(0, keep), "…(", value.size(), " bytes)");
}

}  // namespace muond
