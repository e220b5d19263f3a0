#include "server/session/step_types.h"

#include <limits>

#include "absl/base/casts.h"
#include "nlohmann/json.hpp"

namespace muond::session {
namespace {

using nlohmann::json;

template <typename T>
void PutOptional(json& out, const char* key, const std::optional<T>& value) {
  if (value.has_value()) out[key] = *value;
}

template <typename T>
std::optional<T> GetOptional(const json& in, const char* key) {
  if (!in.contains(key)) return std::nullopt;
  return in.at(key).get<T>();
}

json OverridesToJson(const std::vector<GroupOverride>& overrides) {
  json out = json::array();
  for (const GroupOverride& o : overrides) {
    json entry = {{"group", o.group}};
    PutOptional(entry, "lr", o.lr);
    PutOptional(entry, "momentum", o.momentum);
    PutOptional(entry, "weight_decay", o.weight_decay);
    PutOptional(entry, "beta1", o.beta1);
    PutOptional(entry, "beta2", o.beta2);
    out.push_back(std::move(entry));
  }
  return out;
}

// Throws json::exception on a value of the wrong shape (the callers turn it into a status).
std::vector<GroupOverride> OverridesFromJson(const json& in) {
  std::vector<GroupOverride> out;
  for (const json& entry : in) {
    GroupOverride o;
    o.group = entry.at("group").get<std::string>();
    o.lr = GetOptional<double>(entry, "lr");
    o.momentum = GetOptional<double>(entry, "momentum");
    o.weight_decay = GetOptional<double>(entry, "weight_decay");
    o.beta1 = GetOptional<double>(entry, "beta1");  // absent in older records
    o.beta2 = GetOptional<double>(entry, "beta2");
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace

std::string EncodeOverrides(const std::vector<GroupOverride>& overrides) { return OverridesToJson(overrides).dump(); }

absl::StatusOr<std::vector<GroupOverride>> DecodeOverrides(absl::string_view bytes) {
  const json in = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (!in.is_array()) return absl::DataLossError("not a JSON array of group overrides");
  try {
    return OverridesFromJson(in);
  } catch (const json::exception& e) {
    return absl::DataLossError(std::string("the group overrides do not decode: ") + e.what());
  }
}

std::string EncodeStepRequest(const StepRequest& request) {
  json out = {{"session_id", request.session_id}, {"step", request.step}, {"rank", request.rank}};
  out["overrides"] = OverridesToJson(request.overrides);
  PutOptional(out, "max_grad_norm", request.max_grad_norm);
  PutOptional(out, "grad_scale", request.grad_scale);
  json logits = json::array();
  for (const QkLogits& l : request.qk_logits) logits.push_back({{"query", l.query}, {"max_logits", l.max_logits}});
  out["qk_logits"] = std::move(logits);
  out["phase"] = static_cast<int>(request.phase);
  if (request.count_zeros) out["count_zeros"] = true;
  if (request.weight != 1) out["weight"] = request.weight;
  if (!request.contributors.empty()) {
    out["contributors"] = request.contributors;
    out["total_weight"] = request.total_weight;
  }
  PutOptional(out, "base_step", request.base_step);
  if (request.global_step != 0) {
    out["global_step"] = request.global_step;
    out["staleness"] = request.staleness;
  }
  if (request.decision.has_value()) {
    // The norm travels as its bits: it may be inf or nan (a skipped step), which JSON cannot hold.
    out["decision"] = {{"grad_norm_bits", absl::bit_cast<uint64_t>(request.decision->grad_norm)},
                       {"skip_reason", request.decision->skip_reason}};
  }
  return out.dump();
}

absl::StatusOr<StepRequest> DecodeStepRequest(absl::string_view bytes) {
  const json in = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (!in.is_object()) return absl::DataLossError("the step request is not a JSON object");
  // Type mismatches throw inside nlohmann; they are turned into a status here, at the boundary.
  try {
    StepRequest request;
    request.session_id = in.at("session_id").get<std::string>();
    request.step = in.at("step").get<int64_t>();
    request.rank = in.at("rank").get<int>();
    request.overrides = OverridesFromJson(in.at("overrides"));
    request.max_grad_norm = GetOptional<double>(in, "max_grad_norm");
    request.grad_scale = GetOptional<double>(in, "grad_scale");  // absent in older records
    for (const json& entry : in.at("qk_logits")) {
      // JSON has no inf or NaN: a non-finite logit (a head QK-clip leaves alone, whichever it was)
      // is written as null and read back as NaN, which QK-clip leaves alone the same way.
      std::vector<double> logits;
      for (const json& value : entry.at("max_logits")) {
        logits.push_back(value.is_null() ? std::numeric_limits<double>::quiet_NaN() : value.get<double>());
      }
      request.qk_logits.push_back({entry.at("query").get<std::string>(), std::move(logits)});
    }
    // Records written before sharded steps existed have neither field: whole steps.
    const int phase = in.value("phase", 0);
    if (phase < 0 || phase > static_cast<int>(StepPhase::kCommit)) {
      return absl::DataLossError("the step request has an unknown phase");
    }
    request.phase = static_cast<StepPhase>(phase);
    request.count_zeros = in.value("count_zeros", false);  // absent in older records
    request.weight = in.value("weight", 1.0);              // absent: 1, and in older records
    if (in.contains("contributors")) {
      request.contributors = in.at("contributors").get<std::vector<int>>();
      request.total_weight = in.at("total_weight").get<double>();
    }
    request.base_step = GetOptional<int64_t>(in, "base_step");
    if (in.contains("global_step")) {
      request.global_step = in.at("global_step").get<int64_t>();
      request.staleness = in.at("staleness").get<int64_t>();
    }
    if (in.contains("decision")) {
      const json& decision = in.at("decision");
      request.decision = ShardDecision{absl::bit_cast<double>(decision.at("grad_norm_bits").get<uint64_t>()),
                                       decision.at("skip_reason").get<std::string>()};
    }
    return request;
  } catch (const json::exception& e) {
    return absl::DataLossError(std::string("the step request does not decode: ") + e.what());
  }
}

std::vector<std::vector<float>> CopyValues(const ParameterSnapshot& snapshot) {
  std::vector<std::vector<float>> out;
  out.reserve(snapshot.values.size());
  for (std::span<const float> v : snapshot.values) out.emplace_back(v.begin(), v.end());
  return out;
}

}  // namespace muond::session
