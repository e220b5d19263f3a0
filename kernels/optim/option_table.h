// The one table of a parameter group's options (proto/muond/v1/group_options.json, embedded at build
// time): each option's name, the optimizers that read it, its type, its choices, its defaults, its
// range and its doc. The daemon's defaults, ranges, choice names and "does not apply" refusals come
// from it (options.cc, server/rpc/group_options_codec.cc), as do the Python client's facts and the
// docs' tables. Parsed once, on first use; immutable and thread-safe after.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muond::optim {

// An optimizer's index in the table's "optimizers" (and OptimizerKind's order).
inline constexpr int kOptimizerCount = 5;

enum class OptionCarrier { kGroup, kParameter };
enum class OptionType { kFloat, kInt, kBool, kChoice, kCoefficients, kCoefficientList, kRows3 };

// One bound of a range: `value` with `op` one of >, >=, <, <=.
struct OptionBound {
  std::string op;
  double value = 0;
};

// A range: bounds that must all hold, and how a refusal says it ("must be in [0, 1)", or one
// "must be >= 1" per one-sided bound).
struct OptionRange {
  std::vector<OptionBound> bounds;
  std::string interval;  // "[0, 1)" when given as an interval, else empty
};

// A default: a number (float, int, bool as 0/1), a name (choice, coefficients), or none.
struct OptionDefault {
  std::optional<double> number;
  std::string name;
  bool is_set() const { return number.has_value() || !name.empty(); }
};

struct OptionSpec {
  std::string name;
  OptionCarrier carrier = OptionCarrier::kGroup;
  std::array<bool, kOptimizerCount> applies_to = {};
  std::string muon_needs;  // a muon group reads it only with this option set (moment2_method)
  OptionType type = OptionType::kFloat;
  std::vector<std::string> choices;  // kChoice: in the order of the C++ enum
  std::array<OptionDefault, kOptimizerCount> defaults;
  OptionDefault otherwise;  // what a group of an optimizer that does not read it holds, when set
  std::optional<OptionRange> range;
  std::string label;  // the name a range refusal uses
  std::array<bool, kOptimizerCount> per_step = {};
  std::string doc;
  // kChoice: per choice, the options it sets when a group leaves them unset (name, value); each
  // names a row of the table and fits its type.
  struct ChoiceDefault {
    std::string choice, option;
    OptionDefault value;
  };
  std::vector<ChoiceDefault> choice_defaults;
  // The option the group reads this one only with, and the values of it that make it read (e.g.
  // heloco_kappa with heloco true); `option` empty when it is always read. Each value fits the
  // named row's type.
  struct ReadWith {
    std::string option;
    std::vector<OptionDefault> values;
  };
  ReadWith read_with;
  // "qk_clip": read only in a session that names QK-clip pairs (spec.qk_clip); empty otherwise.
  std::string read_for;
};

struct CoefficientSetSpec {
  std::string name;
  std::vector<std::array<double, 3>> tuples;  // as the table writes them (before `safety`)
  std::string after;                          // "cycle" or "repeat_last"
  std::vector<int> gram_restarts;
  std::optional<int> steps;      // the only ns_steps the set is tuned for
  std::optional<double> safety;  // folded in as (a/s, b/s³, c/s⁵)
};

struct OptionTable {
  std::vector<std::string> optimizers;
  std::vector<OptionSpec> options;
  std::vector<CoefficientSetSpec> coefficient_sets;
};

// The embedded table; a damaged table is a build defect and aborts with its parse error (the tests
// parse it first).
const OptionTable& GroupOptionTable();
// Parses a table's JSON text (what GroupOptionTable parses; tests feed it damaged tables).
absl::StatusOr<OptionTable> ParseOptionTable(std::string_view json);

// The row named `name`, or null.
const OptionSpec* FindOption(std::string_view name);

// Whether `value` lies in `range`; every value must also be finite.
bool InRange(const OptionRange& range, double value);
// INVALID_ARGUMENT "<label> must be in [0, 1), got 2" (or "must be >= 1, got 0", one bound at a
// time) unless InRange; `value` is printed as an integer for an int option.
absl::Status CheckRange(const OptionSpec& option, double value);

// The names a choice option accepts, or null when `option` is no choice.
const std::vector<std::string>* ChoicesOf(std::string_view option);
// The index `value` has among `option`'s choices; INVALID_ARGUMENT "unknown value 'x'; expected one
// of a, b" (without the option's path, which the caller prefixes).
absl::StatusOr<int> ChoiceIndex(std::string_view option, std::string_view value);

}  // namespace muond::optim
