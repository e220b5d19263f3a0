#include "server/metrics/exposition.h"

#include <cmath>

#include "fmt/format.h"

namespace muond::metrics {

std::string Number(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (std::isnan(value)) return "NaN";
  return fmt::format("{}", value);
}

// Debian's abseil has a string_view of its own; std::string_view goes through fmt here.
void Family(std::string* out, std::string_view name, std::string_view type, std::string_view help) {
  out->append(fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type));
}

void Sample(std::string* out, std::string_view name, const std::string& labels, double value) {
  out->append(labels.empty() ? fmt::format("{} {}\n", name, Number(value))
                             : fmt::format("{}{{{}}} {}\n", name, labels, Number(value)));
}

std::string Label(std::string_view key, std::string_view value) {
  std::string escaped;
  for (char c : value) {
    if (c == '\\' || c == '"') escaped += '\\';
    if (c == '\n') {
      escaped += "\\n";
      continue;
    }
    escaped += c;
  }
  return fmt::format("{}=\"{}\"", key, escaped);
}

}  // namespace muond::metrics
