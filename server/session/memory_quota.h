// Memory quotas of the daemon: how many bytes a session's optimizer holds, and the check of a new
// session against --max-session-bytes and --max-total-bytes before anything is allocated.
//
// The estimate counts what a session allocates per parameter when it is created and keeps: the fp32
// master, the fp32 gradient buffer (on the CPU backend the host tensors steps decode into, which the
// optimizer reads in place; on a GPU the session's one GradientSet) and the optimizer's fp32 slots
// (Muon 1: momentum; AdamW 2: the two moments; Lion 1; SGD 1, its momentum buffer, which a per-step
// momentum override may need). A lock-step or quorum session of N > 1 ranks also holds each rank's
// fp32 gradients (of a partitioned parameter, its part) on the host until the step is taken, which
// count too: N whole gradients of a replicated parameter, one (one per replica under HSDP) of a
// partitioned one. Not counted: the gradients of a second step streaming into the same session at
// once, and an asynchronous session's pushes being decoded at once (transient), the host tensors a
// one-rank GPU session decodes into, the copies left to answers still being sent when the
// masters change (at most the parameters' fp32 bytes at once; ParameterReader), and the Newton–Schulz
// scratch, which is one per backend, shared by every session and sized by the largest matrix
// (README, "CPU performance", states the daemon's fixed overhead). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"
#include "server/session/session_config.h"

namespace muond::session {

struct MemoryLimits {
  int64_t max_session_bytes = 0;  // 0: no limit
  int64_t max_total_bytes = 0;    // over all sessions held at once; 0: no limit
};

// Bytes the session of `config` holds in backend memory.
int64_t EstimateSessionBytes(const SessionConfig& config);

// OK when a session of `session_bytes` may be added while `held_bytes` are held already;
// RESOURCE_EXHAUSTED naming the flag and the numbers otherwise.
absl::Status CheckMemoryQuota(const std::string& session_id, int64_t session_bytes, int64_t held_bytes,
                              const MemoryLimits& limits);

// OK when every Muon group of `config` can step within `backend`'s Newton–Schulz workspace bound
// (--ns-workspace-bytes) with its batches cut to one matrix; RESOURCE_EXHAUSTED naming the flag,
// the group and its parameter that needs the most otherwise. OK when the workspace is unbounded.
absl::Status CheckNsWorkspace(const std::string& session_id, const SessionConfig& config, kernels::Backend& backend);

}  // namespace muond::session
