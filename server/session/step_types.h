// The session layer's own types for one step: what a trainer asks (StepRequest), what the daemon
// answers (StepResult with the parameters after the step), and the parameter snapshots answers are
// encoded from. Transports convert their messages to and from these; the session never sees a
// wire message. Plain value types; a published ParameterSnapshot is immutable and may be read from
// any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muond::session {

// Per-step hyperparameters of one group, overriding the group's options for this step only.
struct GroupOverride {
  std::string group;
  std::optional<double> lr;
  std::optional<double> momentum;
  std::optional<double> weight_decay;
  std::optional<double> beta1, beta2;  // adamw, lion
};

// The per-head maximum attention logits of one QK-clip pair, named by its query weight.
struct QkLogits {
  std::string query;
  std::vector<double> max_logits;
};

// How a step travels on a sharded session (docs/sharding.md): whole (the default), or prepared on every
// shard and then committed on every shard with the decision taken over all of them.
enum class StepPhase { kWhole = 0, kPrepare = 1, kCommit = 2 };

// A commit's decision: the global gradient norm clipping uses, and why the step is skipped (empty:
// applied).
struct ShardDecision {
  double grad_norm = 0;
  std::string skip_reason;
};

struct StepRequest {
  std::string session_id;
  int64_t step = 0;
  int rank = 0;
  std::vector<GroupOverride> overrides;
  std::optional<double> max_grad_norm;
  std::vector<QkLogits> qk_logits;
  StepPhase phase = StepPhase::kWhole;
  std::optional<ShardDecision> decision;  // kCommit only
  bool count_zeros = false;               // log_num_zeros_in_grad: StepResult::num_zeros_in_grad is filled
  // A static loss scale the gradients are divided by (with a session loss scaler: must equal its
  // current scale when given).
  std::optional<double> grad_scale;
  // This rank's weight in a multi-rank average (> 0, finite).
  double weight = 1;
  // Set when the ranks' gradients are gathered (RankGather::TakeAverage), and journaled with the
  // step: the ranks the step used, ascending, and the sum of their weights. Empty: every rank.
  std::vector<int> contributors;
  double total_weight = 0;
  // Asynchronous sessions: `step` numbers this rank's pushes; base_step is the global step its
  // gradients were computed on. Set when the push is taken, and journaled: the global step it
  // becomes and its staleness.
  std::optional<int64_t> base_step;
  int64_t global_step = 0;
  int64_t staleness = 0;
  // The transport answers from backend memory (CUDA IPC, NCCL): the parameters after the step need
  // not be read back to the host (ParameterSnapshot::on_device). Not journaled.
  bool device_answer = false;
};

struct StepResult {
  int64_t step = 0;
  bool applied = false;
  std::string skip_reason;  // set when the step was skipped (a non-finite gradient)
  double grad_norm = 0;
  double compute_seconds = 0;
  bool replayed = false;  // a retry of the last step, answered without a second update
  // A prepare's answer: nothing applied; each parameter's sum of squares (0 when absent), and in
  // skip_reason why this shard alone would skip the step.
  bool prepared = false;
  std::vector<double> sum_squares;
  int64_t num_zeros_in_grad = 0;  // when the request counted zeros
  double loss_scale = 0;          // the session loss scaler's scale after the step; 0 without one
  // The ranks the step used (ascending) and the sum of their weights; whether the asking rank's
  // gradients were among them (set per answer).
  std::vector<int> contributors;
  double total_weight = 0;
  bool included = true;
  int64_t global_step = 0;  // asynchronous sessions: the global step the push became
  int64_t staleness = 0;    // and its staleness
  // Each group's clipping (in spec order): its gradients' norm and the coefficient applied.
  struct GroupClip {
    std::string group;
    double grad_norm = 0;
    double coefficient = 1;
  };
  std::vector<GroupClip> group_clips;
  // Each group's telemetry (in spec order) on an applied step (docs/algorithms.md, Telemetry), and
  // the health warnings the step raised (docs/operations.md, Warnings; health_watch.h).
  struct GroupTelemetry {
    std::string group;
    std::optional<double> update_rms, update_ratio;               // with the telemetry option
    std::optional<double> momentum_norm, smallest_momentum_norm;  // muon
    std::optional<double> residual;                               // muon, with the telemetry option
    std::string residual_parameter;
    int64_t stale_parameters = 0;
    std::vector<std::string> warnings;  // kinds raised this step
    // SGD with heloco: its parameters whose gradient HeLoCo kept, reoriented, shrunk.
    struct HelocoCounts {
      int64_t kept = 0, reoriented = 0, shrunk = 0;
    };
    std::optional<HelocoCounts> heloco;
  };
  std::vector<GroupTelemetry> group_telemetry;
  struct HealthWarning {
    std::string kind;  // one of kHealthWarningKinds (health_watch.h)
    std::string group;
    std::string detail;  // what crossed which threshold, in words
  };
  std::vector<HealthWarning> warnings;
};

// The global step `request` is or became: its step, or for an asynchronous push the global step
// it was taken as.
inline int64_t GlobalStepOf(const StepRequest& request) {
  return request.global_step > 0 ? request.global_step : request.step;
}

// An asynchronous session's record of one rank's last push: what a resend of it is answered.
struct PushRecord {
  int64_t push = 0;         // 0: none yet
  int64_t global_step = 0;  // 0: not known (SetState replaced the state since)
  int64_t staleness = 0;
  bool applied = true;  // false: skipped (a non-finite gradient, the fp32 guard)
  std::string skip_reason;
};

// Every parameter after some step, as answers read it: one span per parameter. On a backend with
// device memory the spans are host copies owned here, never modified once published. On a backend
// whose memory is the host's they are the masters themselves, not copied, and hold only while the
// session has not changed them since: read them through a ParameterReader (Session::OpenParameters).
struct ParameterSnapshot {
  int64_t step = 0;
  std::vector<std::span<const float>> values;  // indexed like SessionConfig::parameters
  std::vector<std::vector<float>> copies;      // the memory `values` point into, when copies
  bool views = false;                          // `values` are the masters
  uint64_t generation = 0;                     // views, on_device: the version of the masters they show
  // Nothing read back: the answer of a GPU transport, which writes the masters (of version
  // `generation`) from backend memory straight to the client's (Session::CopyParameterOnDevice).
  // `values` is empty; the session reads a host copy back when anything else asks for them.
  bool on_device = false;
};

// The values of `snapshot` copied out (through a held ParameterReader when they are views; tests).
std::vector<std::vector<float>> CopyValues(const ParameterSnapshot& snapshot);

struct StepOutcome {
  StepResult result;
  std::shared_ptr<const ParameterSnapshot> parameters;  // null for a prepare: no parameters go back
};

// A request as bytes and back, for the step journal (JSON; doubles round-trip exactly).
std::string EncodeStepRequest(const StepRequest& request);
absl::StatusOr<StepRequest> DecodeStepRequest(absl::string_view bytes);
// Group overrides as bytes and back (a JSON array of the journal's "overrides" entries), for the
// checkpoint's record of the last step's (SessionState::last_overrides). DATA_LOSS when not such an array.
std::string EncodeOverrides(const std::vector<GroupOverride>& overrides);
absl::StatusOr<std::vector<GroupOverride>> DecodeOverrides(absl::string_view bytes);

}  // namespace muond::session
