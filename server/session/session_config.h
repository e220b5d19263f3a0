// SessionConfig: the validated, typed description of a session — its parameters with their element
// counts and groups, each group's optimizer options with defaults filled in, world size, answer
// dtype and QK-clip pairs. Built once when a session is created (by a SpecCodec from the API's
// spec) and immutable afterwards, so it may be read from any thread.
//
// The session layer's own types: nothing here refers to the wire API. `spec_json` keeps the spec as
// the API carried it, opaque to this layer, so that attaches can be compared with it and checkpoints
// can store it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/partition_rules.h"
#include "kernels/optim/loss_scaler.h"
#include "kernels/optim/options.h"
#include "kernels/optim/param_state.h"
#include "kernels/optim/qk_clip.h"

namespace muond::session {

// Element type of tensor bytes on a transport. The numbering is the API's (docs/protocol.md).
enum class TensorDType : int { kUnspecified = 0, kFp32 = 1, kBf16 = 2, kFp16 = 3 };

// Bounds on what one session may ask for; requests beyond them are refused at creation.
struct SpecLimits {
  int max_rank = 8;
  int64_t max_tensor_elements = int64_t{1} << 32;
  int max_parameters = 100000;
  int max_groups = 4096;  // each Muon group's iteration is checked at creation: up to milliseconds
  int max_world_size = 1024;
  double straggler_timeout_seconds = 120;  // how long a multi-rank step waits for its last rank
};

struct ParameterConfig {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  TensorDType wire_dtype = TensorDType::kFp32;
  size_t group = 0;  // index into SessionConfig::groups
  optim::QkvSplit qkv;
  optim::TpBlocks tp;
};

// An optimizer's view of parameter `pc` before it has buffers: name, shape, QKV split and
// tensor-parallel blocks (what CheckParameter, SlotShape and SlotNumel read).
inline optim::ParamState ParamStateOf(const ParameterConfig& pc) {
  optim::ParamState state;
  state.name = pc.name;
  state.shape = pc.shape;
  state.numel = pc.numel;
  state.qkv = pc.qkv;
  state.tp = pc.tp;
  return state;
}

// Which elements of a group's parameters each rank of a multi-rank session sends and gets back
// (docs/ranks.md, Ranks that hold parts; the rules are in session/partition.h).
enum class PartitionKind { kReplicated, kRows, kFlat, kExplicit };

using ElementRange = muond::ElementRange;  // common/partition_rules.h

struct GroupConfig {
  std::string name;
  optim::GroupOptions options;
  PartitionKind partition = PartitionKind::kReplicated;
};

// A query/key pair of the spec's qk_clip list, by parameter index.
struct QkClipConfig {
  size_t query = 0;
  size_t key = 0;
  int num_heads = 0;
  std::optional<optim::MlaLayout> mla;  // multi-head latent attention's row layout
};

// A session that is one shard of a session spread over several daemons (docs/sharding.md): its steps
// are prepared and committed. The placement itself lives in spec_json.
struct ShardConfig {
  int index = 0;
  int count = 0;  // 0: not a shard
  // The whole session's QK-clip pairs (spec.shard.qk_clip_pairs); -1 when the client did not say.
  int qk_clip_pairs = -1;
};

// How the ranks of a multi-rank session make a step (docs/ranks.md).
enum class SyncMode { kLockstep, kQuorum, kAsync };
enum class StalenessScaling { kNone, kInverse, kPolynomial, kHinge };

struct SyncConfig {
  SyncMode mode = SyncMode::kLockstep;
  int min_ranks = 0;          // quorum: Q, 1..world_size
  double grace_seconds = 0;   // quorum: how long after the Q-th rank arrived the step waits for the rest
  int64_t max_staleness = 0;  // async: the most global steps a push's base_step may be behind
  StalenessScaling staleness_scaling = StalenessScaling::kNone;  // async
  double staleness_a = 0;                                        // async, polynomial and hinge: a > 0
  int64_t staleness_b = 0;                                       // async, hinge: b >= 0
};

// The factor on an asynchronous push's lrs at staleness s (docs/ranks.md, Asynchronous).
inline double StalenessFactor(const SyncConfig& sync, int64_t staleness) {
  const double s = static_cast<double>(staleness);
  switch (sync.staleness_scaling) {
    case StalenessScaling::kInverse:
      return 1.0 / (1.0 + s);
    case StalenessScaling::kPolynomial:
      return std::pow(1.0 + s, -sync.staleness_a);
    case StalenessScaling::kHinge:
      return staleness <= sync.staleness_b
                 ? 1.0
                 : 1.0 / (sync.staleness_a * static_cast<double>(staleness - sync.staleness_b) + 1.0);
    case StalenessScaling::kNone:
      break;
  }
  return 1.0;
}

struct SessionConfig {
  std::vector<ParameterConfig> parameters;
  std::vector<GroupConfig> groups;
  int world_size = 1;
  double straggler_timeout_seconds = 120;
  SyncConfig sync;
  TensorDType return_dtype = TensorDType::kFp32;
  std::vector<QkClipConfig> qk_clip;
  ShardConfig shard;
  std::optional<optim::LossScalerOptions> loss_scaler;  // a daemon-side dynamic loss scaler
  // parts[p][r]: the range of parameter p that rank r holds, for parameters of partitioned groups;
  // parts[p] is empty for a replicated parameter, and parts is empty when no group is partitioned.
  std::vector<std::vector<ElementRange>> parts;
  int64_t total_elements = 0;
  absl::flat_hash_map<std::string, size_t> parameter_index;
  absl::flat_hash_map<std::string, size_t> group_index;
  std::string spec_json;  // the spec in the API's JSON form (SpecCodec); opaque here
};

}  // namespace muond::session
