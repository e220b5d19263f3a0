// Prints the daemon's option facts as JSON, for the Python client's test that its own facts agree:
// {"options": {name: {"applies_to": [...], "choices": [...]}}, "coefficient_sets": [...],
//  "coefficients": {set: {"tuples": [[a, b, c], ...], "after": ..., "gram_restarts": [...]}},
//  "defaults": {optimizer: {option: value}}}. Both sides read the option table; what this checks is
// the daemon's use of it: each option's GroupOptions member (option_fields.h), the defaults
// DefaultOptions sets, the schedules NamedSchedule builds.
#include <cstdio>
#include <type_traits>

#include "kernels/optim/option_fields.h"
#include "kernels/optim/option_table.h"
#include "kernels/optim/options.h"
#include "nlohmann/json.hpp"

namespace {

using nlohmann::json;
namespace optim = muond::optim;

json Options() {
  json options = json::object();
  for (const optim::OptionUse& option : optim::GroupOptionUses()) {
    json applies = json::array();
    for (optim::OptimizerKind kind : option.applies_to) applies.push_back(optim::OptimizerName(kind));
    json choices = json::array();
    if (const auto* names = optim::ChoicesOf(option.name)) {
      for (const std::string& choice : *names) choices.push_back(choice);
    }
    options[std::string(option.name)] = {{"applies_to", applies}, {"choices", choices}};
  }
  return options;
}

json Coefficients() {
  json sets = json::object();
  for (const std::string& name : optim::NamedScheduleNames()) {
    const optim::NsSchedule schedule = *optim::NamedSchedule(name);
    json tuples = json::array();
    for (const optim::NsCoefficient& t : schedule.tuples) tuples.push_back({t.a, t.b, t.c});
    sets[name] = {{"tuples", tuples},
                  {"after", schedule.after == optim::CoefficientsAfter::kCycle ? "cycle" : "repeat_last"},
                  {"gram_restarts", schedule.gram_restarts}};
  }
  return sets;
}

// Each optimizer's defaults as DefaultOptions sets them, for the options it reads (by their API
// names; named values by their names).
json Defaults() {
  json defaults = json::object();
  for (optim::OptimizerKind kind : {optim::OptimizerKind::kMuon, optim::OptimizerKind::kAdamW,
                                    optim::OptimizerKind::kLion, optim::OptimizerKind::kSgd}) {
    const optim::GroupOptions o = optim::DefaultOptions(kind);
    json mine = {{"ns_coefficients", o.ns_schedule.name}};
    optim::VisitOptionFields(o, [&](std::string_view name, const auto& member) {
      using Member = std::decay_t<decltype(member)>;
      json value;
      if constexpr (std::is_enum_v<Member>) {
        value = (*optim::ChoicesOf(name))[static_cast<size_t>(member)];
      } else if constexpr (std::is_same_v<Member, std::optional<double>>) {
        value = member.has_value() ? json(*member) : json(nullptr);
      } else {
        value = member;
      }
      mine[std::string(name)] = value;
    });
    for (auto it = mine.begin(); it != mine.end();) {
      it = optim::OptionApplies(kind, it.key()) ? std::next(it) : mine.erase(it);
    }
    defaults[std::string(optim::OptimizerName(kind))] = mine;
  }
  return defaults;
}

}  // namespace

int main() {
  const json out = {{"options", Options()},
                    {"coefficient_sets", optim::NamedScheduleNames()},
                    {"coefficients", Coefficients()},
                    {"defaults", Defaults()}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
