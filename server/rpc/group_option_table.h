// The muond.v1 spelling of a parameter group's named values: for each option whose value is a name,
// the names it accepts, in the order of its C++ enum (kernels/optim/options.h). The spec codec
// converts requests with it, GetServerInfo and the clients' tables are tested against it; which
// optimizer reads which option, and every range, are the kernels' (optim::GroupOptionUses,
// optim::ValidateOptions). Immutable; thread-safe.
#pragma once

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace muond::rpc {

struct OptionChoices {
  std::string_view name;
  std::vector<std::string_view> choices;  // index i is the enum's value i
};
const std::vector<OptionChoices>& GroupOptionTable();

// The names `option` accepts, or null when its value is not a name (ns_coefficients takes
// optim::NamedScheduleNames or a list).
const std::vector<std::string_view>* ChoicesOf(std::string_view option);

// The enum value `value` names for `option`; INVALID_ARGUMENT "unknown value 'x'; expected one of
// a, b" (without the option's path, which the caller prefixes).
absl::StatusOr<int> ChoiceIndex(std::string_view option, std::string_view value);

}  // namespace muond::rpc
