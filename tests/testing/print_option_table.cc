// Prints the C++ option table (kernels/optim/options.h) as JSON, for the Python client's test that
// its own table agrees: {"options": {name: {"applies_to": [...], "choices": [...]}},
// "coefficient_sets": [...]}.
#include <cstdio>

#include "kernels/optim/options.h"
#include "nlohmann/json.hpp"

int main() {
  using nlohmann::json;
  json options = json::object();
  for (const muond::optim::OptionSpec& option : muond::optim::GroupOptionTable()) {
    json applies = json::array();
    for (muond::optim::OptimizerKind kind : option.applies_to) applies.push_back(muond::optim::OptimizerName(kind));
    json choices = json::array();
    for (std::string_view choice : option.choices) choices.push_back(choice);
    options[std::string(option.name)] = {{"applies_to", applies}, {"choices", choices}};
  }
  const json out = {{"options", options}, {"coefficient_sets", muond::optim::NamedScheduleNames()}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
