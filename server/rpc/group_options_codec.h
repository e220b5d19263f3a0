// One parameter group's muond.v1 options read into optim::GroupOptions: the codec converts names
// (kernels/optim/option_table.h) and refuses what the wire spelling alone makes wrong (an option its optimizer
// does not read, a named set beside a custom list); every rule on values is optim::ValidateOptions'.
// Errors are INVALID_ARGUMENT with the option's path, e.g. "spec.groups[1].options.lr must be in
// [0, 100], got -1". Stateless; thread-safe.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/optim/options.h"
#include "muond/v1/muond.pb.h"

namespace muond::rpc {

// INVALID_ARGUMENT "<field>: <what>": how the spec codecs refuse a field.
absl::Status InvalidField(const std::string& field, absl::string_view what);

// Converts one group's wire options; `field` is the path used in error messages.
absl::StatusOr<optim::GroupOptions> ParseGroupOptions(const v1::GroupOptions& options, const std::string& field);

}  // namespace muond::rpc
