// Prints the daemon's option facts as JSON, for the Python client's test that its own facts agree:
// {"options": {name: {"applies_to": [...], "choices": [...]}}, "coefficient_sets": [...],
//  "coefficients": {set: {"tuples": [[a, b, c], ...], "after": ..., "gram_restarts": [...]}},
//  "defaults": {optimizer: {option: value}}}. Which optimizer reads an option and the defaults are the
// kernels' (kernels/optim/options.h); the named values are the wire's (server/rpc/group_option_table.h).
#include <cstdio>

#include "kernels/optim/options.h"
#include "nlohmann/json.hpp"
#include "server/rpc/group_option_table.h"

namespace {

using nlohmann::json;
namespace optim = muond::optim;

json Options() {
  json options = json::object();
  for (const optim::OptionUse& option : optim::GroupOptionUses()) {
    json applies = json::array();
    for (optim::OptimizerKind kind : option.applies_to) applies.push_back(optim::OptimizerName(kind));
    json choices = json::array();
    if (const auto* names = muond::rpc::ChoicesOf(option.name)) {
      for (std::string_view choice : *names) choices.push_back(choice);
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

// Each optimizer's defaults, for the options it reads (by their API names).
json Defaults() {
  json defaults = json::object();
  for (optim::OptimizerKind kind : {optim::OptimizerKind::kMuon, optim::OptimizerKind::kAdamW,
                                    optim::OptimizerKind::kLion, optim::OptimizerKind::kSgd}) {
    const optim::GroupOptions o = optim::DefaultOptions(kind);
    const json all = {
        {"lr", o.lr},
        {"weight_decay", o.weight_decay},
        {"momentum", o.momentum},
        {"nesterov", o.nesterov},
        {"ns_steps", o.ns_steps},
        {"ns_coefficients", o.ns_schedule.name},
        {"ns_eps", o.ns_eps},
        {"ns_norm_safety", o.ns_norm_safety},
        {"extra_scale_factor", o.extra_scale_factor},
        {"qk_clip_threshold", o.qk_clip_threshold},
        {"qk_clip_alpha", o.qk_clip_alpha},
        {"beta1", o.beta1},
        {"beta2", o.beta2},
        {"eps", o.eps},
        {"telemetry", o.telemetry},
        {"warn_clip_below", o.warn_clip_below},
        {"warn_clip_steps", o.warn_clip_steps},
        {"warn_stale_steps", o.warn_stale_steps},
        {"warn_residual_above", o.warn_residual_above.has_value() ? json(*o.warn_residual_above) : json(nullptr)}};
    json mine = json::object();
    for (const auto& [name, value] : all.items()) {
      if (optim::OptionApplies(kind, name)) mine[name] = value;
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
