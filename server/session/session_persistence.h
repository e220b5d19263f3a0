// What a session hands to durable storage, and the interface through which it does so.
//
// SessionState is the whole optimizer state of a session as host tensors: every master and
// optimizer slot, the step counters. It is what GetState/SetState carry and what a checkpoint holds.
// SessionPersistence is where a session's durable state goes (its folder of --state-dir, see
// server/session/state_dir.h); the session calls it under its own lock, so implementations need no
// locking of their own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/host_tensor.h"
#include "kernels/optim/loss_scaler.h"
#include "kernels/storage_dtype.h"
#include "server/session/part_load.h"
#include "server/session/step_types.h"

namespace muond::session {

// A slot of the exported state: "master" or an optimizer slot, with its fp32 values.
struct StateTensor {
  size_t parameter = 0;
  std::string slot;
  std::vector<float> values;  // widened from `dtype` (exactly) on export; rounded to the tensor's on import
  kernels::StorageDtype dtype = kernels::StorageDtype::kFp32;  // how the session stores it
};

inline constexpr char kMasterSlot[] = "master";

// How the session's last step went, which a resend of it is answered with (a sharded session's
// shards take their decision from it, docs/sharding.md): applied or skipped, and the gradient norm it
// was clipped by.
struct LastDecision {
  bool applied = true;
  double grad_norm = 0;
  std::string skip_reason;
};

// Who took part in one of the session's steps: the ranks whose gradients it used (ascending) and
// the sum of their weights.
struct StepContributors {
  int64_t step = 0;
  std::vector<int> ranks;
  double total_weight = 0;
};

struct SessionState {
  int64_t last_step = 0;
  std::vector<int64_t> step_counts;  // per parameter
  std::vector<StateTensor> tensors;
  // The loss scaler's state, for a session with one. On import, absent keeps the current state.
  std::optional<optim::LossScalerState> loss_scaler;
  // An asynchronous session's push records, by rank (empty otherwise). On import, empty keeps them.
  std::vector<PushRecord> pushes;
  // A session with partitioned groups: the parts its ranks write (part_load.h), once any has. Kept
  // by checkpoints, not carried by GetState/SetState; on import, absent leaves no record.
  std::optional<PartsWritten> parts_written;
  // The last step's decision, once a step was taken or restored with it. Kept by checkpoints, not
  // carried by GetState/SetState; on import, absent leaves it unknown.
  std::optional<LastDecision> last_decision;
  // The overrides the last step ran with, one entry per group that had any (OverridesByGroup), once a
  // step was taken or restored with them; empty at step 0. Kept by checkpoints, not carried by
  // GetState/SetState; on import, absent leaves them unknown.
  std::optional<std::vector<GroupOverride>> last_overrides;
  // A session of several gathering ranks: the contributors of its last steps, oldest first (at most
  // Session::kRememberedSteps). Kept by checkpoints, not carried by GetState/SetState; on import,
  // absent leaves them unknown (a quorum session then answers a resend of those steps `included`
  // false).
  std::optional<std::vector<StepContributors>> contributors;
};

class SessionPersistence {
 public:
  virtual ~SessionPersistence() = default;
  // Before step `request.step` changes any state: an error refuses the step (journal mode makes it
  // durable here). `gradients` are the ones the step will apply (averaged over ranks).
  virtual absl::Status RecordStep(const StepRequest& request, const std::vector<HostTensor>& gradients) = 0;
  // The step RecordStep recorded last failed before it changed any state: journal mode removes its
  // record durably, so that neither a restore nor the step's resend applies it twice. On an error the
  // record may remain (a restore would apply the step).
  virtual absl::Status WithdrawStep() = 0;
  // Writes a checkpoint of `state` (taken over: its values move into the file's buffers); steps
  // recorded before it are no longer needed.
  virtual absl::Status SaveCheckpoint(SessionState state) = 0;
  // Whether a checkpoint is due after step `last_step` was applied: every --checkpoint-every steps,
  // and in journal mode once the records since the last checkpoint hold about as many bytes as the
  // session's state (a restore then reads at most about that much journal, and the journal's disk
  // stays bounded, whatever --checkpoint-every says; StateDirOptions::journal_floor_bytes).
  virtual bool CheckpointDue(int64_t last_step) const = 0;
  // Whether RecordStep writes the gradients (journal mode): they must then reach it on the host.
  virtual bool records_gradients() const = 0;
  virtual void Discard() = 0;  // the session was closed: remove its files
};

}  // namespace muond::session
