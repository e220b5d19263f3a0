#include "server/session/memory_quota.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer.h"
#include "server/session/partition.h"

namespace muond::session {

int64_t EstimateSessionBytes(const SessionConfig& config) {
  // The optimizers say how large each slot is (reduced state such as NorMuon's is smaller) and how
  // it is stored.
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
  for (const GroupConfig& group : config.groups) {
    absl::StatusOr<std::unique_ptr<optim::Optimizer>> optimizer = optim::Optimizer::Create(group.options);
    optimizers.push_back(optimizer.ok() ? *std::move(optimizer) : nullptr);
  }
  // Lock-step and quorum sessions of several ranks hold each rank's gradients (or its parts) until
  // the step is taken, beside the averaged one.
  const bool gathers = config.world_size > 1 && config.sync.mode != SyncMode::kAsync;
  int64_t bytes = 0;
  for (size_t index = 0; index < config.parameters.size(); ++index) {
    const ParameterConfig& param = config.parameters[index];
    const optim::ParamState shape_only = ParamStateOf(param);
    const optim::Optimizer* optimizer = optimizers[param.group].get();
    bytes += 4 * param.numel;  // gradient
    for (int rank = 0; gathers && rank < config.world_size; ++rank) bytes += 4 * PartElements(config, index, rank);
    if (optimizer == nullptr) {
      bytes += 3 * 4 * param.numel;  // options no optimizer accepts: an fp32 master and the largest state of any
      continue;
    }
    const kernels::StorageDtype master = optimizer->options().master_dtype;
    bytes += 4 * static_cast<int64_t>(optim::StoredWords(master, static_cast<size_t>(param.numel)));
    for (const std::string& slot : optimizer->SlotNames()) {
      const auto numel = static_cast<int64_t>(optimizer->SlotNumel(shape_only, slot));
      bytes += 4 * static_cast<int64_t>(optim::StoredWords(optimizer->SlotDtype(slot), static_cast<size_t>(numel)));
    }
  }
  return bytes;
}

absl::Status CheckMemoryQuota(const std::string& session_id, int64_t session_bytes, int64_t held_bytes,
                              const MemoryLimits& limits) {
  if (limits.max_session_bytes > 0 && session_bytes > limits.max_session_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session_id '", Echo(session_id), "': the spec needs ", session_bytes,
        " bytes of optimizer memory (masters, gradients and optimizer state), more than --max-session-bytes ",
        limits.max_session_bytes));
  }
  if (limits.max_total_bytes > 0 && held_bytes + session_bytes > limits.max_total_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session_id '", Echo(session_id), "': the spec needs ", session_bytes,
                     " bytes of optimizer memory and the daemon ", "holds ", held_bytes,
                     " bytes already; together more than --max-total-bytes ", limits.max_total_bytes,
                     " (close a session first; a closed session counts until the calls using it end)"));
  }
  return absl::OkStatus();
}

absl::Status CheckNsWorkspace(const std::string& session_id, const SessionConfig& config, kernels::Backend& backend) {
  const optim::NsWorkspace& ws = optim::BackendNsWorkspace(backend).ws;
  const size_t limit = ws.limit();
  if (limit == 0 || !ws.hard()) return absl::OkStatus();  // a soft bound refuses nothing
  for (size_t g = 0; g < config.groups.size(); ++g) {
    absl::StatusOr<std::unique_ptr<optim::Optimizer>> optimizer = optim::Optimizer::Create(config.groups[g].options);
    if (!optimizer.ok()) continue;  // refused elsewhere
    std::vector<optim::ParamState> states;
    for (const ParameterConfig& param : config.parameters) {
      if (param.group == g) states.push_back(ParamStateOf(param));
    }
    std::vector<const optim::ParamState*> params;
    for (const optim::ParamState& state : states) params.push_back(&state);
    const optim::Optimizer::WorkspaceNeed need = (*optimizer)->LeastWorkspace(backend, params);
    if (need.floats <= limit) continue;
    return absl::ResourceExhaustedError(
        absl::StrCat("session_id '", Echo(session_id), "': group '", Echo(config.groups[g].name), "' needs ",
                     4 * need.floats, " bytes of Newton-Schulz workspace with one matrix per batch (parameter '",
                     Echo(need.largest->name), "' of shape [", absl::StrJoin(need.largest->shape, ", "), "] alone ",
                     4 * need.largest_floats, "), more than --ns-workspace-bytes ", 4 * limit));
  }
  return absl::OkStatus();
}

}  // namespace muond::session
