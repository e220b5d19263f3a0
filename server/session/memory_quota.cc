#include "server/session/memory_quota.h"

#include "absl/strings/str_cat.h"

namespace muond::session {

int OptimizerSlotCount(optim::OptimizerKind kind) {
  switch (kind) {
    case optim::OptimizerKind::kAdamW:
      return 2;
    case optim::OptimizerKind::kMuon:
    case optim::OptimizerKind::kLion:
    case optim::OptimizerKind::kSgd:
      return 1;
  }
  return 2;  // unknown: the largest count
}

int64_t EstimateSessionBytes(const SessionConfig& config) {
  int64_t bytes = 0;
  for (const ParameterConfig& param : config.parameters) {
    const int buffers = 2 + OptimizerSlotCount(config.groups[param.group].options.optimizer);
    bytes += param.numel * int64_t{4} * buffers;
  }
  return bytes;
}

absl::Status CheckMemoryQuota(const std::string& session_id, int64_t session_bytes, int64_t held_bytes,
                              const MemoryLimits& limits) {
  if (limits.max_session_bytes > 0 && session_bytes > limits.max_session_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session_id '", session_id, "': the spec needs ", session_bytes,
        " bytes of optimizer memory (fp32 masters, gradients and optimizer state), more than --max-session-bytes ",
        limits.max_session_bytes));
  }
  if (limits.max_total_bytes > 0 && held_bytes + session_bytes > limits.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session_id '", session_id, "': the spec needs ", session_bytes, " bytes of optimizer memory and the daemon ",
        "holds ", held_bytes, " bytes already; together more than --max-total-bytes ", limits.max_total_bytes,
        " (close a session first)"));
  }
  return absl::OkStatus();
}

}  // namespace muond::session
