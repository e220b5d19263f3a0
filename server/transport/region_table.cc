#include "server/transport/region_table.h"

#include "absl/strings/str_cat.h"

namespace muond::transport {

absl::Status CheckRegionName(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat("name: a region name has 1 to 128 characters, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return absl::InvalidArgumentError("name: control characters are not allowed");
  }
  return absl::OkStatus();
}

}  // namespace muond::transport
