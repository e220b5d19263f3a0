#include "kernels/optim/option_table.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace muond::optim {

// The text of proto/muond/v1/group_options.json (group_options_json.cc, written by CMake).
extern const char* const kGroupOptionsJson;

namespace {

using nlohmann::json;

absl::Status Bad(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("group option table: ", where, ": ", what));
}

absl::StatusOr<OptionType> ParseType(const std::string& type) {
  static const std::pair<const char*, OptionType> kTypes[] = {{"float", OptionType::kFloat},
                                                              {"int", OptionType::kInt},
                                                              {"bool", OptionType::kBool},
                                                              {"choice", OptionType::kChoice},
                                                              {"coefficients", OptionType::kCoefficients},
                                                              {"coefficient_list", OptionType::kCoefficientList},
                                                              {"rows3", OptionType::kRows3}};
  for (const auto& [name, value] : kTypes) {
    if (type == name) return value;
  }
  return Bad("type", absl::StrCat("unknown type ", type));
}

absl::StatusOr<double> Number(absl::string_view text, absl::string_view where) {
  double value = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &value))
    return Bad(where, absl::StrCat("not a number: ", text));
  return value;
}

// "[0, 1)", "(0, 100]": an interval; "> 0", ">= 1": one bound.
absl::StatusOr<OptionRange> ParseRange(const json& value, absl::string_view where) {
  OptionRange range;
  std::vector<std::string> parts;
  if (value.is_array()) {
    for (const json& part : value) parts.push_back(part.get<std::string>());
  } else {
    parts.push_back(value.get<std::string>());
  }
  for (const std::string& part : parts) {
    absl::string_view text = absl::StripAsciiWhitespace(part);
    if (!text.empty() && (text.front() == '[' || text.front() == '(')) {
      const std::vector<absl::string_view> ends = absl::StrSplit(text.substr(1, text.size() - 2), ',');
      if (ends.size() != 2 || (text.back() != ']' && text.back() != ')')) return Bad(where, part);
      absl::StatusOr<double> lo = Number(ends[0], where), hi = Number(ends[1], where);
      if (!lo.ok()) return lo.status();
      if (!hi.ok()) return hi.status();
      range.bounds.push_back({text.front() == '[' ? ">=" : ">", *lo});
      range.bounds.push_back({text.back() == ']' ? "<=" : "<", *hi});
      range.interval = std::string(text);
      continue;
    }
    const size_t op_end = text.find_first_not_of("<>=");
    if (op_end == 0 || op_end == absl::string_view::npos) return Bad(where, part);
    std::string op(text.substr(0, op_end));
    if (op != ">" && op != ">=" && op != "<" && op != "<=") return Bad(where, part);
    absl::StatusOr<double> bound = Number(text.substr(op_end), where);
    if (!bound.ok()) return bound.status();
    range.bounds.push_back({std::move(op), *bound});
  }
  if (!range.interval.empty() && parts.size() != 1) return Bad(where, "an interval stands alone");
  return range;
}

absl::StatusOr<OptionDefault> ParseDefault(const json& value, OptionType type, absl::string_view where) {
  OptionDefault out;
  if (value.is_null()) return out;
  if (value.is_boolean() && type == OptionType::kBool) {
    out.number = value.get<bool>() ? 1 : 0;
  } else if (value.is_number() && (type == OptionType::kFloat || type == OptionType::kInt)) {
    out.number = value.get<double>();
  } else if (value.is_string() && (type == OptionType::kChoice || type == OptionType::kCoefficients)) {
    out.name = value.get<std::string>();
  } else {
    return Bad(where, absl::StrCat("default ", value.dump(), " does not fit the type"));
  }
  return out;
}

// Which optimizers a row's "applies_to" or "per_step" names: "all", true, or a list of names.
absl::StatusOr<std::array<bool, kOptimizerCount>> ParseOptimizers(const json& value,
                                                                  const std::vector<std::string>& optimizers,
                                                                  absl::string_view where) {
  std::array<bool, kOptimizerCount> out = {};
  if (value.is_null() || (value.is_boolean() && !value.get<bool>())) return out;
  if ((value.is_string() && value.get<std::string>() == "all") || (value.is_boolean() && value.get<bool>())) {
    out.fill(true);
    return out;
  }
  if (!value.is_array()) return Bad(where, value.dump());
  for (const json& name : value) {
    bool found = false;
    for (size_t i = 0; i < optimizers.size(); ++i) {
      if (name == optimizers[i]) out[i] = found = true;
    }
    if (!found) return Bad(where, absl::StrCat("unknown optimizer ", name.dump()));
  }
  return out;
}

absl::StatusOr<OptionSpec> ParseOption(const json& row, const std::vector<std::string>& optimizers) {
  OptionSpec spec;
  spec.name = row.at("name").get<std::string>();
  const std::string where = absl::StrCat("option ", spec.name);
  const std::string carrier = row.at("carrier").get<std::string>();
  if (carrier != "group" && carrier != "parameter") return Bad(where, absl::StrCat("carrier ", carrier));
  spec.carrier = carrier == "group" ? OptionCarrier::kGroup : OptionCarrier::kParameter;
  absl::StatusOr<OptionType> type = ParseType(row.at("type").get<std::string>());
  if (!type.ok()) return Bad(where, type.status().message());
  spec.type = *type;
  absl::StatusOr<std::array<bool, kOptimizerCount>> applies = ParseOptimizers(row.at("applies_to"), optimizers, where);
  if (!applies.ok()) return applies.status();
  spec.applies_to = *applies;
  absl::StatusOr<std::array<bool, kOptimizerCount>> per_step =
      ParseOptimizers(row.value("per_step", json()), optimizers, where);
  if (!per_step.ok()) return per_step.status();
  spec.per_step = *per_step;
  spec.muon_needs = row.value("muon_needs", "");
  spec.label = row.value("label", spec.name);
  spec.doc = row.at("doc").get<std::string>();
  if (row.contains("choices")) spec.choices = row.at("choices").get<std::vector<std::string>>();
  if ((spec.type == OptionType::kChoice) != !spec.choices.empty()) return Bad(where, "choices go with type choice");
  if (row.contains("range")) {
    absl::StatusOr<OptionRange> range = ParseRange(row.at("range"), where);
    if (!range.ok()) return range.status();
    spec.range = *std::move(range);
  }
  const json& defaults = row.at("default");
  for (size_t i = 0; i < optimizers.size(); ++i) {
    if (!spec.applies_to[i]) continue;
    const json& value = defaults.is_object() ? defaults.value(optimizers[i], json()) : defaults;
    absl::StatusOr<OptionDefault> parsed = ParseDefault(value, spec.type, where);
    if (!parsed.ok()) return parsed.status();
    spec.defaults[i] = *std::move(parsed);
    if (!spec.defaults[i].name.empty() && spec.type == OptionType::kChoice) {
      bool known = false;
      for (const std::string& choice : spec.choices) known = known || choice == spec.defaults[i].name;
      if (!known) return Bad(where, absl::StrCat("default ", spec.defaults[i].name, " is no choice"));
    }
    if (spec.defaults[i].number.has_value() && spec.range.has_value() &&
        !InRange(*spec.range, *spec.defaults[i].number)) {
      return Bad(where, "default out of range");
    }
  }
  absl::StatusOr<OptionDefault> otherwise = ParseDefault(row.value("otherwise", json()), spec.type, where);
  if (!otherwise.ok()) return otherwise.status();
  spec.otherwise = *std::move(otherwise);
  spec.read_for = row.value("read_for", "");
  if (!spec.read_for.empty() && spec.read_for != "qk_clip") return Bad(where, absl::StrCat("read_for ", spec.read_for));
  if (!spec.read_for.empty() && (spec.carrier != OptionCarrier::kGroup || spec.type != OptionType::kFloat)) {
    return Bad(where, "read_for goes with a group's float");
  }
  return spec;
}

// A row's "choice_defaults", once every row is known (each value parsed by its own row's type).
absl::Status ParseChoiceDefaults(const json& row, OptionTable& table, OptionSpec& spec) {
  if (!row.contains("choice_defaults")) return absl::OkStatus();
  const std::string where = absl::StrCat("option ", spec.name, " choice_defaults");
  const json& all = row.at("choice_defaults");
  if (!all.is_object()) return Bad(where, "not an object");
  for (const auto& [choice, options] : all.items()) {
    if (std::find(spec.choices.begin(), spec.choices.end(), choice) == spec.choices.end())
      return Bad(where, absl::StrCat(choice, " is no choice"));
    if (!options.is_object()) return Bad(where, absl::StrCat(choice, ": not an object"));
    for (const auto& entry : options.items()) {
      const std::string name = entry.key();  // a copy the lambda can capture (not a structured binding)
      const json& value = entry.value();
      const auto target = std::find_if(table.options.begin(), table.options.end(),
                                       [&](const OptionSpec& other) { return other.name == name; });
      if (target == table.options.end()) return Bad(where, absl::StrCat("unknown option ", name));
      absl::StatusOr<OptionDefault> parsed = ParseDefault(value, target->type, where);
      if (!parsed.ok()) return parsed.status();
      if (!parsed->is_set()) return Bad(where, absl::StrCat(name, ": no value"));
      spec.choice_defaults.push_back({choice, name, *std::move(parsed)});
    }
  }
  return absl::OkStatus();
}

// A row's "read_with", once every row is known (its values parsed by the named row's type).
absl::Status ParseReadWith(const json& row, const OptionTable& table, OptionSpec& spec) {
  if (!row.contains("read_with")) return absl::OkStatus();
  const std::string where = absl::StrCat("option ", spec.name, " read_with");
  const json& read_with = row.at("read_with");
  if (!read_with.is_object() || read_with.size() != 2) return Bad(where, "an object of option and values");
  const std::string option = read_with.at("option").get<std::string>();
  const auto target = std::find_if(table.options.begin(), table.options.end(),
                                   [&](const OptionSpec& other) { return other.name == option; });
  if (target == table.options.end() || option == spec.name) return Bad(where, absl::StrCat("no other option ", option));
  // Both are one value of the group's (a parameter's own options and Newton–Schulz's coefficients
  // hold no value a group is read with).
  const auto one_group_value = [](const OptionSpec& o) {
    return o.carrier == OptionCarrier::kGroup && (o.type == OptionType::kFloat || o.type == OptionType::kInt ||
                                                  o.type == OptionType::kBool || o.type == OptionType::kChoice);
  };
  if (!one_group_value(spec) || !one_group_value(*target)) {
    return Bad(where, absl::StrCat("this option and ", option, " must each be one value of the group's"));
  }
  for (int i = 0; i < kOptimizerCount; ++i) {
    if (spec.applies_to[i] && !target->applies_to[i])
      return Bad(where, absl::StrCat(option, " applies to fewer optimizers"));
  }
  if (!read_with.at("values").is_array() || read_with.at("values").empty()) return Bad(where, "no values");
  spec.read_with.option = option;
  for (const json& value : read_with.at("values")) {
    absl::StatusOr<OptionDefault> parsed = ParseDefault(value, target->type, where);
    if (!parsed.ok()) return parsed.status();
    if (!parsed->is_set()) return Bad(where, "a value is null");
    if (target->type == OptionType::kChoice &&
        std::find(target->choices.begin(), target->choices.end(), parsed->name) == target->choices.end()) {
      return Bad(where, absl::StrCat(parsed->name, " is no choice of ", option));
    }
    spec.read_with.values.push_back(*std::move(parsed));
  }
  return absl::OkStatus();
}

absl::StatusOr<CoefficientSetSpec> ParseSet(const json& row) {
  CoefficientSetSpec set;
  set.name = row.at("name").get<std::string>();
  set.after = row.at("after").get<std::string>();
  if (set.after != "cycle" && set.after != "repeat_last") return Bad(set.name, absl::StrCat("after ", set.after));
  for (const json& tuple : row.at("tuples")) {
    if (!tuple.is_array() || tuple.size() != 3) return Bad(set.name, "a tuple is (a, b, c)");
    set.tuples.push_back({tuple[0].get<double>(), tuple[1].get<double>(), tuple[2].get<double>()});
  }
  if (set.tuples.empty()) return Bad(set.name, "no tuples");
  if (row.contains("gram_restarts")) set.gram_restarts = row.at("gram_restarts").get<std::vector<int>>();
  if (row.contains("steps")) set.steps = row.at("steps").get<int>();
  if (row.contains("safety")) set.safety = row.at("safety").get<double>();
  return set;
}

}  // namespace

absl::StatusOr<OptionTable> ParseOptionTable(std::string_view text) {
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Bad("json", "not a JSON object");
  OptionTable table;
  try {
    table.optimizers = doc.at("optimizers").get<std::vector<std::string>>();
    if (table.optimizers.size() != kOptimizerCount)
      return Bad("optimizers", absl::StrCat(kOptimizerCount, " optimizers"));
    for (const json& row : doc.at("options")) {
      absl::StatusOr<OptionSpec> spec = ParseOption(row, table.optimizers);
      if (!spec.ok()) return spec.status();
      for (const OptionSpec& earlier : table.options) {
        if (earlier.name == spec->name) return Bad(spec->name, "named twice");
      }
      table.options.push_back(*std::move(spec));
    }
    for (const json& row : doc.at("coefficient_sets")) {
      absl::StatusOr<CoefficientSetSpec> set = ParseSet(row);
      if (!set.ok()) return set.status();
      table.coefficient_sets.push_back(*std::move(set));
    }
    for (size_t i = 0; i < table.options.size(); ++i) {
      MUOND_RETURN_IF_ERROR(ParseChoiceDefaults(doc.at("options")[i], table, table.options[i]));
      MUOND_RETURN_IF_ERROR(ParseReadWith(doc.at("options")[i], table, table.options[i]));
      for (const OptionSpec::ChoiceDefault& d : table.options[i].choice_defaults) {
        const bool is_set_name = std::any_of(table.coefficient_sets.begin(), table.coefficient_sets.end(),
                                             [&](const CoefficientSetSpec& set) { return set.name == d.value.name; });
        if (!d.value.name.empty() && d.option == "ns_coefficients" && !is_set_name)
          return Bad(table.options[i].name, absl::StrCat("choice_defaults: no coefficient set ", d.value.name));
      }
    }
  } catch (const json::exception& e) {
    return Bad("json", e.what());
  }
  return table;
}

const OptionTable& GroupOptionTable() {
  static const OptionTable* const table = [] {
    absl::StatusOr<OptionTable> parsed = ParseOptionTable(kGroupOptionsJson);
    if (!parsed.ok()) {
      std::fprintf(stderr, "muond: %s\n", std::string(parsed.status().message()).c_str());
      std::abort();
    }
    return new OptionTable(*std::move(parsed));
  }();
  return *table;
}

const OptionSpec* FindOption(std::string_view name) {
  for (const OptionSpec& option : GroupOptionTable().options) {
    if (option.name == name) return &option;
  }
  return nullptr;
}

namespace {

bool Holds(const OptionBound& bound, double value) {
  if (bound.op == ">") return value > bound.value;
  if (bound.op == ">=") return value >= bound.value;
  if (bound.op == "<") return value < bound.value;
  return value <= bound.value;
}

}  // namespace

bool InRange(const OptionRange& range, double value) {
  if (!std::isfinite(value)) return false;
  for (const OptionBound& bound : range.bounds) {
    if (!Holds(bound, value)) return false;
  }
  return true;
}

absl::Status CheckRange(const OptionSpec& option, double value) {
  if (!option.range.has_value() || InRange(*option.range, value)) return absl::OkStatus();
  const std::string got = option.type == OptionType::kInt && std::isfinite(value)
                              ? absl::StrCat(static_cast<int64_t>(value))
                              : absl::StrCat(value);
  if (!option.range->interval.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(option.label, " must be in ", option.range->interval, ", got ", got));
  }
  for (const OptionBound& bound : option.range->bounds) {
    if (std::isfinite(value) && Holds(bound, value)) continue;
    return absl::InvalidArgumentError(
        absl::StrCat(option.label, " must be ", bound.op, " ", bound.value, ", got ", got));
  }
  return absl::OkStatus();
}

const std::vector<std::string>* ChoicesOf(std::string_view option) {
  const OptionSpec* spec = FindOption(option);
  return spec != nullptr && spec->type == OptionType::kChoice ? &spec->choices : nullptr;
}

absl::StatusOr<int> ChoiceIndex(std::string_view option, std::string_view value) {
  const std::vector<std::string>* choices = ChoicesOf(option);
  std::string known;
  for (size_t i = 0; choices != nullptr && i < choices->size(); ++i) {
    if (value == (*choices)[i]) return static_cast<int>(i);
    absl::StrAppend(&known, known.empty() ? "" : ", ", (*choices)[i]);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown value '", Echo(std::string(value)), "'; expected one of ", known));
}

}  // namespace muond::optim
