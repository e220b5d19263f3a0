// Checkpoints of a session in its folder of the state directory:
//   checkpoint-<step>.safetensors  every master and optimizer slot as F32 tensors named (or
//                                  checkpoint-<step>-<sha>.safetensors: WriteCheckpoint)
//                                  "<parameter>/<slot>" (slot: master, momentum, exp_avg, ...)
//   checkpoint.json                the spec, step counters, backend, and the SHA-256 of the tensors
//                                  file and of itself
// checkpoint.json is written last and atomically, so it is the commit point: a crash at any moment
// leaves either the previous checkpoint or the new one, never a mix. Reading verifies both digests
// and the tensors' framing, and refuses, naming the file, anything truncated or altered; whether the
// tensors fit a session is for the reader's caller to judge (CheckpointCorrupt names the file).
//
// Stateless functions over an Env; callers serialize writes to one folder. No gRPC and no session
// types: an offline tool can read a state directory with this alone.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/durability/env.h"

namespace muond::durability {

struct CheckpointTensor {
  std::string parameter;
  std::string slot;
  std::vector<int64_t> shape;
  std::vector<float> values;  // exactly representable in `dtype`
  // The safetensors dtype the tensor is written in: "F32", or "BF16" / "F16" for a tensor the
  // session stores in 16 bits (its values are written as such, losing nothing).
  std::string dtype = "F32";
};

// A session loss scaler's state, as checkpoint.json's "loss_scaler" holds it.
struct CheckpointLossScaler {
  double scale = 0;
  int64_t growth_tracker = 0;
  int64_t hysteresis_tracker = 0;
};

// An asynchronous session's record of one rank's last push (session::PushRecord).
struct CheckpointPush {
  int64_t push = 0;
  int64_t global_step = 0;  // 0: not known (the state was replaced since)
  int64_t staleness = 0;
  bool applied = true;      // false: skipped (skip_reason says why)
  std::string skip_reason;  // at most kMaxCheckpointSkipReason bytes
};
inline constexpr size_t kMaxCheckpointSkipReason = 4096;

// What the ranks of a session with partitioned groups were writing part by part when the checkpoint
// was taken (session::PartsWritten): their initial parameters, or a state of `last_step` with its
// per-parameter step counts; `ranks` have written theirs (checkpoint.json's "parts_written").
struct CheckpointPartsWritten {
  bool upload = false;
  int64_t last_step = 0;
  std::vector<std::pair<std::string, int64_t>> step_counts;  // parameter name → count; empty for an upload
  std::vector<int64_t> ranks;
};

// The decision the last step was taken with (session::LastDecision; checkpoint.json's
// "last_decision": {"applied", "grad_norm" (null when not finite), "skip_reason"}).
struct CheckpointLastDecision {
  bool applied = true;
  double grad_norm = 0;
  std::string skip_reason;  // at most kMaxCheckpointSkipReason bytes
};

// Who took part in one of a session's recent steps (session::StepContributors; checkpoint.json's
// "contributors": [[step, total_weight, [rank, ...]], ...], steps ascending): a resend of the step
// after a restore is told whether its gradients were used.
struct CheckpointContributors {
  int64_t step = 0;
  double total_weight = 0;
  std::vector<int> ranks;  // ascending, each in [0, kMaxCheckpointRank]
};
// The most steps a checkpoint names the contributors of, and the largest rank it can name.
inline constexpr size_t kMaxCheckpointContributorSteps = 64;
inline constexpr int kMaxCheckpointRank = (1 << 20) - 1;

struct CheckpointData {
  std::string session_id;
  std::string owner;      // the identity that created the session; empty without authentication
  std::string spec_json;  // the session's spec in the API's JSON form
  std::string backend;
  int64_t last_step = 0;
  // Counts the checkpoints the session has tried to write, this one included (0 in a checkpoint of an
  // earlier version); journal records name the generation they follow, so that records written before
  // this checkpoint are never replayed onto it, whatever their step (a SetState that moved the
  // session back, whose journal could not be emptied).
  uint64_t generation = 0;
  std::vector<std::pair<std::string, int64_t>> step_counts;  // parameter name → its step count
  std::vector<CheckpointTensor> tensors;
  std::optional<CheckpointLossScaler> loss_scaler;  // sessions with a loss scaler
  // Asynchronous sessions: per rank, its last push, the global step it became, its staleness and its
  // outcome (checkpoint.json's "pushes": [push, global_step, staleness] for an applied push, as
  // earlier versions wrote them, and [push, global_step, staleness, applied, skip_reason] for a
  // skipped one); empty otherwise.
  std::vector<CheckpointPush> pushes;
  // Sessions with partitioned groups, once a rank has written its parts.
  std::optional<CheckpointPartsWritten> parts_written;
  std::optional<CheckpointLastDecision> last_decision;  // absent in a checkpoint of an earlier version
  // The last step's group overrides (checkpoint.json's "last_overrides", an array, kept here as its
  // JSON text whatever it holds: session::DecodeOverrides reads it, as it reads journal records);
  // absent in a checkpoint of an earlier version.
  std::optional<std::string> last_overrides;
  // Sessions of several gathering ranks: the contributors of the last steps taken, oldest first
  // (at most kMaxCheckpointContributorSteps, none after last_step); empty in a checkpoint of an
  // earlier version and after a SetState.
  std::vector<CheckpointContributors> contributors;
};

inline constexpr char kCheckpointMetadataFile[] = "checkpoint.json";
// The most bytes of checkpoint.json a restore reads; WriteCheckpoint writes no more.
inline constexpr uint64_t kMaxCheckpointMetadataBytes = uint64_t{64} << 20;

// FAILED_PRECONDITION, writing nothing, when checkpoint.json would pass kMaxCheckpointMetadataBytes
// (CheckCheckpointRoom keeps sessions from getting there). The tensor file is checkpoint-<step>
// .safetensors, or checkpoint-<step>-<sha>.safetensors when that name is taken (by the checkpoint in
// place, of the same step): a failed write never spoils the checkpoint before it.
absl::Status WriteCheckpoint(Env* env, const std::string& dir, const CheckpointData& data);

// OK when every checkpoint of a session with this spec (its JSON, its parameters' names, its world
// size) and owner fits in kMaxCheckpointMetadataBytes, whatever its state: the spec, a step count per parameter
// (twice while ranks load their parts) and an asynchronous push record per rank, each at its largest.
// Otherwise INVALID_ARGUMENT naming `spec`: such a session could be checkpointed but never restored.
absl::Status CheckCheckpointRoom(absl::string_view spec_json, const std::vector<std::string>& names, int world_size,
                                 absl::string_view owner = "");

// The tensors of `data` as one safetensors file (F32 tensors "<parameter>/<slot>", and the session id,
// last step and backend in __metadata__): the bytes a checkpoint's tensors file holds.
std::string EncodeSafetensors(const CheckpointData& data);

// The most bytes the tensors file of a checkpoint whose metadata is `metadata` (its spec, read
// first) can hold; an error refuses the checkpoint as it is.
using TensorBytesBound = std::function<absl::StatusOr<uint64_t>(const CheckpointData& metadata)>;

// Reads and verifies the checkpoint in `dir`. DATA_LOSS naming the file when it is unusable (a
// tensors file declared larger than `bound` allows among it, refused before it is read); the
// errors of Env::ReadFile when it cannot be read. Without `bound`, the declared size bounds the read.
absl::StatusOr<CheckpointData> ReadCheckpoint(Env* env, const std::string& dir, const TensorBytesBound& bound = {});

// DATA_LOSS "checkpoint <file> is unusable: <why>", for callers that find a checkpoint's contents
// do not fit (`file` is the folder's metadata or tensors file).
absl::Status CheckpointCorrupt(const std::string& file, absl::string_view why);

}  // namespace muond::durability
