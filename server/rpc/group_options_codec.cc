// muond.v1.GroupOptions → optim::GroupOptions (group_options_codec.h).
#include "server/rpc/group_options_codec.h"

#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "kernels/optim/option_fields.h"
#include "kernels/optim/option_table.h"

namespace muond::rpc {

absl::Status InvalidField(const std::string& field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

namespace {

using optim::OptimizerKind;

absl::StatusOr<OptimizerKind> ParseOptimizer(v1::OptimizerKind kind, const std::string& field) {
  switch (kind) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_MUON:
      return OptimizerKind::kMuon;
    case v1::OPTIMIZER_ADAMW:
      return OptimizerKind::kAdamW;
    case v1::OPTIMIZER_LION:
      return OptimizerKind::kLion;
    case v1::OPTIMIZER_SGD:
      return OptimizerKind::kSgd;
    case v1::OPTIMIZER_DION2:
      return OptimizerKind::kDion2;
    default:
      return InvalidField(field + ".optimizer", absl::StrCat("unknown optimizer ", static_cast<int>(kind)));
  }
}

// The values of the option table's rows the request sets, each into its member (option_fields.h);
// a name that is none of its option's choices is refused naming the field.
absl::Status CopyValues(const v1::GroupOptions& in, const std::string& field, optim::GroupOptions& out) {
  const google::protobuf::Descriptor* descriptor = in.GetDescriptor();
  const google::protobuf::Reflection* reflection = in.GetReflection();
  absl::Status status;
  optim::VisitOptionFields(out, [&](std::string_view name, auto& member) {
    using Member = std::decay_t<decltype(member)>;
    const google::protobuf::FieldDescriptor* f = descriptor->FindFieldByName(std::string(name));
    if (!status.ok() || f == nullptr || !reflection->HasField(in, f)) return;
    if constexpr (std::is_enum_v<Member>) {
      absl::StatusOr<int> index = optim::ChoiceIndex(name, reflection->GetString(in, f));
      if (!index.ok()) {
        status = InvalidField(absl::StrCat(field, ".", std::string(name)), index.status().message());
        return;
      }
      member = static_cast<Member>(*index);
    } else if constexpr (std::is_same_v<Member, bool>) {
      member = reflection->GetBool(in, f);
    } else if constexpr (std::is_same_v<Member, int>) {
      member = reflection->GetInt32(in, f);
    } else {
      member = reflection->GetDouble(in, f);  // double or std::optional<double>
    }
  });
  return status;
}

// Coefficients: a named set, or a custom list (with its after-the-list rule).
absl::Status ParseCoefficients(const v1::GroupOptions& in, const std::string& field, optim::GroupOptions& out) {
  const bool custom = in.ns_custom_coefficients_size() > 0;
  if (custom && in.has_ns_coefficients() && in.ns_coefficients() != "custom") {
    return InvalidField(field + ".ns_coefficients", "give either a named set or ns_custom_coefficients, not both");
  }
  if (!custom) {
    if (in.has_ns_coefficients_after()) {
      return InvalidField(field + ".ns_coefficients_after", "applies only to ns_custom_coefficients");
    }
    if (!in.has_ns_coefficients()) return absl::OkStatus();
    if (in.ns_coefficients() == "custom") {
      return InvalidField(field + ".ns_coefficients", "'custom' needs ns_custom_coefficients");
    }
    absl::StatusOr<optim::NsSchedule> schedule = optim::NamedSchedule(in.ns_coefficients());
    if (!schedule.ok()) {
      absl::string_view why = schedule.status().message();
      absl::ConsumePrefix(&why, "ns_coefficients: ");  // named by the field path here
      return InvalidField(field + ".ns_coefficients", why);
    }
    out.ns_schedule = *std::move(schedule);
    return absl::OkStatus();
  }
  out.ns_schedule.name = "custom";
  out.ns_schedule.tuples.clear();
  for (const v1::NsCoefficients& t : in.ns_custom_coefficients()) {
    out.ns_schedule.tuples.push_back({t.a(), t.b(), t.c()});
  }
  out.ns_schedule.after = optim::CoefficientsAfter::kCycle;
  if (!in.has_ns_coefficients_after()) return absl::OkStatus();
  absl::StatusOr<int> after = optim::ChoiceIndex("ns_coefficients_after", in.ns_coefficients_after());
  if (!after.ok()) return InvalidField(field + ".ns_coefficients_after", after.status().message());
  out.ns_schedule.after = static_cast<optim::CoefficientsAfter>(*after);
  return absl::OkStatus();
}

// A ValidateOptions error with the wire's path: `field` prefixed; a custom list is
// ns_custom_coefficients on the wire; betas[i] are beta1 and beta2 there.
absl::Status WithWirePath(const absl::Status& status, const std::string& field, bool custom) {
  std::string message(status.message());
  for (const auto& [kernel, wire] : {std::pair{"betas[0]", "beta1 (betas[0])"}, {"betas[1]", "beta2 (betas[1])"}}) {
    if (absl::StartsWith(message, kernel)) message = absl::StrCat(wire, message.substr(std::string(kernel).size()));
  }
  if (custom && absl::StartsWith(message, "ns_coefficients[")) message = absl::StrCat("ns_custom_", message.substr(3));
  return absl::InvalidArgumentError(absl::StrCat(field, ".", message));
}

}  // namespace

absl::StatusOr<optim::GroupOptions> ParseGroupOptions(const v1::GroupOptions& in, const std::string& field) {
  MUOND_ASSIGN_OR_RETURN(OptimizerKind kind, ParseOptimizer(in.optimizer(), field));
  optim::GroupOptions out = optim::DefaultOptions(kind);
  MUOND_RETURN_IF_ERROR(CopyValues(in, field, out));
  MUOND_RETURN_IF_ERROR(ParseCoefficients(in, field, out));
  // What a choice brings when the group leaves it unset (Turbo-Muon's set and steps with AOL).
  optim::ApplyChoiceDefaults(out, [&](std::string_view name) {
    if (name == "ns_coefficients") return in.has_ns_coefficients() || in.ns_custom_coefficients_size() > 0;
    const google::protobuf::FieldDescriptor* f = in.GetDescriptor()->FindFieldByName(std::string(name));
    return f != nullptr && in.GetReflection()->HasField(in, f);
  });
  // Refuse options this group does not read, naming the first one set, rather than ignore them.
  std::vector<const google::protobuf::FieldDescriptor*> set_fields;
  in.GetReflection()->ListFields(in, &set_fields);
  for (const google::protobuf::FieldDescriptor* f : set_fields) {
    if (!optim::IsGroupOption(f->name())) continue;
    if (absl::Status applies = optim::CheckOptionApplies(out, f->name()); !applies.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", applies.message()));
    }
  }
  absl::Status valid = optim::ValidateOptions(out);
  if (!valid.ok()) return WithWirePath(valid, field, in.ns_custom_coefficients_size() > 0);
  return out;
}

}  // namespace muond::rpc
