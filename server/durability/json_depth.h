// A bound on the nesting of JSON read from a state directory. nlohmann::json parses iteratively, but
// copying, comparing and dumping a document recurse once per level, so a crafted file nested a
// hundred thousand levels deep would overflow the stack. State files are checked with this scan
// before they are parsed. Stateless; thread-safe.
#pragma once

#include "absl/strings/string_view.h"

namespace muond::durability {

// The deepest nesting muond's own state files reach is well under this (a spec nests about six).
inline constexpr int kMaxJsonDepth = 64;

// Whether the arrays and objects of `text` nest at most `max_depth` levels deep. A scan of brackets
// outside strings; it does not check that `text` is JSON (the parser does that next).
bool JsonDepthWithin(absl::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace muond::durability
