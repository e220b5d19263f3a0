// The pieces of Prometheus's text exposition format (version 0.0.4) the exporters write: numbers,
// a family's HELP and TYPE lines, samples and escaped labels. Stateless functions.
#pragma once

#include <string>
#include <string_view>

namespace muond::metrics {

// A sample value: +Inf, -Inf, NaN or the shortest decimal that reads back the same.
std::string Number(double value);
void Family(std::string* out, std::string_view name, std::string_view type, std::string_view help);
// `labels` is empty or key="value",... without braces.
void Sample(std::string* out, std::string_view name, const std::string& labels, double value);
// key="value", with \, " and newlines escaped as the exposition format asks.
std::string Label(std::string_view key, std::string_view value);

}  // namespace muond::metrics
