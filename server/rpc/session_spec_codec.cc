#include "server/rpc/session_spec_codec.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/partition.h"

namespace muond::rpc {
namespace {

using session::ParameterConfig;
using session::QkClipConfig;
using session::SessionConfig;
using session::SpecLimits;
using session::StalenessScaling;
using session::SyncConfig;
using session::SyncMode;
using session::TensorDType;

using optim::OptimizerKind;

// Parameter and group names: 1 to 256 bytes of UTF-8 (protobuf checks the encoding) without
// control characters (U+0000–U+001F, U+007F), which no name is meant to hold and which would garble
// logs and error messages.
bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  return std::none_of(name.begin(), name.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return byte < 0x20 || byte == 0x7f;
  });
}

// spec.labels: few, with short keys of a plain alphabet and values without control characters (a
// label is echoed in the refusal of an attach that disagrees with it). Keys in sorted order, so that
// a spec with several bad labels is refused the same way every time.
absl::Status CheckLabels(const v1::SessionSpec& spec) {
  constexpr int kMaxLabels = 16;
  constexpr size_t kMaxKeyBytes = 64, kMaxValueBytes = 256;
  if (spec.labels_size() > kMaxLabels) {
    return InvalidField("spec.labels", absl::StrCat(spec.labels_size(), " labels exceed the limit of ", kMaxLabels));
  }
  const std::map<std::string, std::string> labels(spec.labels().begin(), spec.labels().end());
  for (const auto& [key, value] : labels) {
    const bool plain = std::all_of(key.begin(), key.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    });
    if (key.empty() || key.size() > kMaxKeyBytes || !plain) {
      return InvalidField("spec.labels", absl::StrCat("key '", Echo(key), "': must be 1 to ", kMaxKeyBytes,
                                                      " bytes of a-z, 0-9, '.', '_' and '-'"));
    }
    if (value.size() > kMaxValueBytes || (!value.empty() && !ValidName(value))) {
      return InvalidField(absl::StrCat("spec.labels['", key, "']"),
                          absl::StrCat("must be at most ", kMaxValueBytes, " bytes without control characters"));
    }
  }
  return absl::OkStatus();
}

// How two specs' labels differ, in words; empty when they agree or either has none.
std::string LabelDifference(const v1::SessionSpec& existing, const v1::SessionSpec& requested) {
  if (existing.labels().empty() || requested.labels().empty()) return "";
  const std::map<std::string, std::string> have(existing.labels().begin(), existing.labels().end());
  const std::map<std::string, std::string> want(requested.labels().begin(), requested.labels().end());
  for (const auto& [key, value] : have) {
    auto other = want.find(key);
    if (other == want.end()) {
      return absl::StrCat("spec.labels['", Echo(key), "']: the session's is '", Echo(value),
                          "', this request has none");
    }
    if (other->second != value) {
      return absl::StrCat("spec.labels['", Echo(key), "']: the session's is '", Echo(value), "', this request's '",
                          Echo(other->second), "'");
    }
  }
  for (const auto& [key, value] : want) {
    if (!have.contains(key)) {
      return absl::StrCat("spec.labels['", Echo(key), "']: the session has none, this request's is '", Echo(value),
                          "'");
    }
  }
  return "";
}

// spec.qk_clip: both weights exist, are matrices in Muon groups, and split evenly into the heads.
absl::Status ParseQkClip(const v1::SessionSpec& spec, SessionConfig& config) {
  absl::flat_hash_map<size_t, int> used;  // parameter → pair index, to refuse reuse
  for (int i = 0; i < spec.qk_clip_size(); ++i) {
    const v1::QkClipPair& pair = spec.qk_clip(i);
    const std::string field = absl::StrCat("spec.qk_clip[", i, "]");
    if (pair.num_heads() < 1) {
      return InvalidField(field + ".num_heads",
                          absl::StrCat("must be >= 1, got ", pair.num_heads(), " (QK-clip needs the attention heads)"));
    }
    QkClipConfig clip;
    clip.num_heads = pair.num_heads();
    for (const auto& [role, name, index] :
         {std::tuple<const char*, const std::string&, size_t*>{"query", pair.query(), &clip.query},
          {"key", pair.key(), &clip.key}}) {
      auto it = config.parameter_index.find(name);
      if (it == config.parameter_index.end()) {
        return InvalidField(absl::StrCat(field, ".", role), absl::StrCat("unknown parameter '", Echo(name), "'"));
      }
      const ParameterConfig& param = config.parameters[it->second];
      if (config.groups[param.group].options.optimizer != OptimizerKind::kMuon || param.shape.size() != 2) {
        return InvalidField(absl::StrCat(field, ".", role),
                            absl::StrCat("'", Echo(name), "' must be a matrix in a Muon group"));
      }
      if (param.shape[0] % clip.num_heads != 0) {
        return InvalidField(field + ".num_heads", absl::StrCat("'", Echo(name), "' has ", param.shape[0],
                                                               " rows, not a multiple of ", clip.num_heads, " heads"));
      }
      if (pair.has_mla()) {
        const v1::MlaLayout& mla = pair.mla();
        if (mla.qk_nope_head_dim() < 1 || mla.qk_rope_head_dim() < 0 || mla.v_head_dim() < 0) {
          return InvalidField(
              field + ".mla",
              absl::StrCat("qk_nope_head_dim must be >= 1 and qk_rope_head_dim, v_head_dim "
                           ">= 0, got (",
                           mla.qk_nope_head_dim(), ", ", mla.qk_rope_head_dim(), ", ", mla.v_head_dim(), ")"));
        }
        // Compared against the rows each head has (never multiplied or added: no overflow).
        const bool is_query = std::string(role) == "query";
        const int64_t rows_per_head = param.shape[0] / clip.num_heads;
        const int64_t rest = is_query ? mla.qk_rope_head_dim() : mla.v_head_dim();
        if (mla.qk_nope_head_dim() > rows_per_head || rest != rows_per_head - mla.qk_nope_head_dim()) {
          return InvalidField(
              field + ".mla",
              absl::StrCat("'", Echo(name), "' has ", param.shape[0], " rows (", clip.num_heads, " heads of ",
                           rows_per_head, "); the MLA layout does not add up to it",
                           is_query ? " (qk_nope_head_dim + qk_rope_head_dim)" : " (qk_nope_head_dim + v_head_dim)"));
        }
        clip.mla = optim::MlaLayout{mla.qk_nope_head_dim(), mla.qk_rope_head_dim(), mla.v_head_dim()};
      }
      if (!used.emplace(it->second, i).second) {
        return InvalidField(absl::StrCat(field, ".", role),
                            absl::StrCat("'", Echo(name), "' is already in a qk_clip pair"));
      }
      *index = it->second;
    }
    config.qk_clip.push_back(clip);
  }
  return absl::OkStatus();
}

// spec.loss_scaler: Megatron-Core's defaults for the fields left unset, then the ranges.
absl::Status ParseLossScaler(const v1::SessionSpec& spec, SessionConfig& config) {
  if (!spec.has_loss_scaler()) return absl::OkStatus();
  const v1::LossScaler& in = spec.loss_scaler();
  optim::LossScalerOptions out;
  if (in.has_initial_scale()) out.initial_scale = in.initial_scale();
  if (in.has_min_scale()) out.min_scale = in.min_scale();
  if (in.has_growth_factor()) out.growth_factor = in.growth_factor();
  if (in.has_backoff_factor()) out.backoff_factor = in.backoff_factor();
  if (in.has_window()) out.window = in.window();
  if (in.has_hysteresis()) out.hysteresis = in.hysteresis();
  if (absl::Status valid = optim::ValidateLossScaler(out); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.loss_scaler.", valid.message()));
  }
  config.loss_scaler = out;
  return absl::OkStatus();
}

// spec.shard: a placement that names this daemon's place and maps each parameter into the whole
// session.
absl::Status ParseShard(const v1::SessionSpec& spec, SessionConfig& config) {
  if (!spec.has_shard()) return absl::OkStatus();
  const v1::ShardPlacement& shard = spec.shard();
  constexpr int kMaxShards = 1024;
  if (shard.endpoints_size() < 1 || shard.endpoints_size() > kMaxShards) {
    return InvalidField("spec.shard.endpoints",
                        absl::StrCat("needs 1 to ", kMaxShards, " daemons, got ", shard.endpoints_size()));
  }
  for (int i = 0; i < shard.endpoints_size(); ++i) {
    if (shard.endpoints(i).empty() || shard.endpoints(i).size() > 1024) {
      return InvalidField(absl::StrCat("spec.shard.endpoints[", i, "]"), "must be 1 to 1024 characters");
    }
  }
  if (shard.index() < 0 || shard.index() >= shard.endpoints_size()) {
    return InvalidField("spec.shard.index",
                        absl::StrCat("must be in [0, ", shard.endpoints_size(), "), got ", shard.index()));
  }
  if (shard.parameters_size() != spec.parameters_size()) {
    return InvalidField("spec.shard.parameters", absl::StrCat("needs one index per parameter (", spec.parameters_size(),
                                                              "), got ", shard.parameters_size()));
  }
  if (shard.num_parameters() < spec.parameters_size()) {
    return InvalidField("spec.shard.num_parameters",
                        absl::StrCat("must be at least this shard's ", spec.parameters_size(), " parameters, got ",
                                     shard.num_parameters()));
  }
  for (int i = 0; i < shard.parameters_size(); ++i) {
    const int index = shard.parameters(i);
    const int previous = i == 0 ? -1 : shard.parameters(i - 1);
    if (index <= previous || index >= shard.num_parameters()) {
      return InvalidField(
          absl::StrCat("spec.shard.parameters[", i, "]"),
          absl::StrCat("must increase and stay below num_parameters (", shard.num_parameters(), "), got ", index));
    }
  }
  config.shard = {shard.index(), shard.endpoints_size()};
  if (shard.has_qk_clip_pairs()) {
    if (shard.qk_clip_pairs() < spec.qk_clip_size() || shard.qk_clip_pairs() > shard.num_parameters()) {
      return InvalidField(
          "spec.shard.qk_clip_pairs",
          absl::StrCat("must be at least this shard's ", spec.qk_clip_size(), " pairs and at most num_parameters (",
                       shard.num_parameters(), "), got ", shard.qk_clip_pairs()));
    }
    config.shard.qk_clip_pairs = shard.qk_clip_pairs();
  }
  return absl::OkStatus();
}

// How two placements differ, in words; empty when they do not.
std::string ShardDifference(const v1::SessionSpec& existing, const v1::SessionSpec& requested) {
  if (!existing.has_shard() && !requested.has_shard()) return "";
  auto list = [](const v1::ShardPlacement& p) { return absl::StrCat("[", absl::StrJoin(p.endpoints(), ", "), "]"); };
  if (existing.has_shard() != requested.has_shard()) {
    if (!existing.has_shard()) return "spec.shard: the session is not sharded; this request places it as a shard";
    // A client given one endpoint sends no placement at all.
    return absl::StrCat("spec.shard: the session is shard ", existing.shard().index(), " of a session placed on ",
                        existing.shard().endpoints_size(), " daemons ", list(existing.shard()),
                        "; this request is not sharded: give the endpoints in the order the session was created with");
  }
  const v1::ShardPlacement& a = existing.shard();
  const v1::ShardPlacement& b = requested.shard();
  if (a.endpoints_size() != b.endpoints_size() ||
      !std::equal(a.endpoints().begin(), a.endpoints().end(), b.endpoints().begin())) {
    return absl::StrCat("spec.shard.endpoints: the session was placed on ", a.endpoints_size(), " daemons ", list(a),
                        " (this daemon is shard ", a.index(), "); this request names ", b.endpoints_size(), " ",
                        list(b), " and places this daemon as shard ", b.index(),
                        ": give the endpoints in the order the session was created with");
  }
  if (a.index() != b.index()) {
    return absl::StrCat("spec.shard.index: this daemon holds shard ", a.index(), ", the request says ", b.index());
  }
  return "";
}

absl::Status CheckNoAsyncFields(const v1::SyncSpec& sync) {
  if (sync.max_staleness() != 0) return InvalidField("spec.sync.max_staleness", "applies to mode async only");
  if (sync.staleness_scaling() != v1::STALENESS_SCALING_UNSPECIFIED) {
    return InvalidField("spec.sync.staleness_scaling", "applies to mode async only");
  }
  if (sync.staleness_a() != 0) return InvalidField("spec.sync.staleness_a", "applies to mode async only");
  if (sync.staleness_b() != 0) return InvalidField("spec.sync.staleness_b", "applies to mode async only");
  return absl::OkStatus();
}

// spec.sync: lock-step unless asked; a quorum's Q and G in range. Needs world_size and shard set.
absl::Status ParseSync(const v1::SyncSpec& sync, SessionConfig& config) {
  switch (sync.mode()) {
    case v1::SYNC_MODE_UNSPECIFIED:
    case v1::SYNC_MODE_LOCKSTEP:
      if (sync.min_ranks() != 0) return InvalidField("spec.sync.min_ranks", "applies to mode quorum only");
      if (sync.grace_seconds() != 0) return InvalidField("spec.sync.grace_seconds", "applies to mode quorum only");
      MUOND_RETURN_IF_ERROR(CheckNoAsyncFields(sync));
      config.sync.mode = SyncMode::kLockstep;
      return absl::OkStatus();
    case v1::SYNC_MODE_ASYNC: {
      if (config.shard.count > 0) {
        return InvalidField("spec.sync.mode",
                            "asynchronous steps are not available on a sharded session (lock-step only)");
      }
      if (sync.min_ranks() != 0) return InvalidField("spec.sync.min_ranks", "applies to mode quorum only");
      if (sync.grace_seconds() != 0) return InvalidField("spec.sync.grace_seconds", "applies to mode quorum only");
      if (sync.max_staleness() < 0) {
        return InvalidField("spec.sync.max_staleness", absl::StrCat("must be >= 0, got ", sync.max_staleness()));
      }
      StalenessScaling scaling;
      switch (sync.staleness_scaling()) {
        case v1::STALENESS_SCALING_UNSPECIFIED:
        case v1::STALENESS_SCALING_NONE:
          scaling = StalenessScaling::kNone;
          break;
        case v1::STALENESS_SCALING_INVERSE:
          scaling = StalenessScaling::kInverse;
          break;
        case v1::STALENESS_SCALING_POLYNOMIAL:
          scaling = StalenessScaling::kPolynomial;
          break;
        case v1::STALENESS_SCALING_HINGE:
          scaling = StalenessScaling::kHinge;
          break;
        default:
          return InvalidField("spec.sync.staleness_scaling",
                              absl::StrCat("unknown scaling ", static_cast<int>(sync.staleness_scaling())));
      }
      const bool uses_a = scaling == StalenessScaling::kPolynomial || scaling == StalenessScaling::kHinge;
      if (uses_a && !(std::isfinite(sync.staleness_a()) && sync.staleness_a() > 0)) {
        return InvalidField(
            "spec.sync.staleness_a",
            absl::StrCat("must be finite and > 0 with this staleness_scaling, got ", sync.staleness_a()));
      }
      if (!uses_a && sync.staleness_a() != 0) {
        return InvalidField("spec.sync.staleness_a", "applies to staleness_scaling polynomial and hinge only");
      }
      if (scaling == StalenessScaling::kHinge && sync.staleness_b() < 0) {
        return InvalidField("spec.sync.staleness_b", absl::StrCat("must be >= 0, got ", sync.staleness_b()));
      }
      if (scaling != StalenessScaling::kHinge && sync.staleness_b() != 0) {
        return InvalidField("spec.sync.staleness_b", "applies to staleness_scaling hinge only");
      }
      config.sync = SyncConfig{.mode = SyncMode::kAsync,
                               .min_ranks = 0,
                               .grace_seconds = 0,
                               .max_staleness = sync.max_staleness(),
                               .staleness_scaling = scaling,
                               .staleness_a = sync.staleness_a(),
                               .staleness_b = sync.staleness_b()};
      return absl::OkStatus();
    }
    case v1::SYNC_MODE_QUORUM: {
      MUOND_RETURN_IF_ERROR(CheckNoAsyncFields(sync));
      if (config.shard.count > 0) {
        return InvalidField("spec.sync.mode", "quorum steps are not available on a sharded session (lock-step only)");
      }
      const int q = sync.min_ranks() == 0 ? config.world_size : sync.min_ranks();
      if (q < 1 || q > config.world_size) {
        return InvalidField("spec.sync.min_ranks",
                            absl::StrCat("must be between 1 and world_size (", config.world_size, "), got ", q));
      }
      if (!std::isfinite(sync.grace_seconds()) || sync.grace_seconds() < 0) {
        return InvalidField("spec.sync.grace_seconds",
                            absl::StrCat("must be finite and >= 0, got ", sync.grace_seconds()));
      }
      config.sync = SyncConfig{.mode = SyncMode::kQuorum, .min_ranks = q, .grace_seconds = sync.grace_seconds()};
      return absl::OkStatus();
    }
    default:
      return InvalidField("spec.sync.mode", absl::StrCat("unknown mode ", static_cast<int>(sync.mode())));
  }
}

// spec.groups[g].partition: each group's rule, laid out into config.parts (session/partition.h).
// Needs the parameters, world_size, sync and shard parsed.
absl::Status ParsePartitions(const v1::SessionSpec& spec, SessionConfig& config) {
  std::vector<session::PartitionRule> rules(static_cast<size_t>(spec.groups_size()));
  std::string first_partitioned, first_unreplicated;
  for (int g = 0; g < spec.groups_size(); ++g) {
    const v1::Partition& given = spec.groups(g).partition();
    session::PartitionRule& rule = rules[static_cast<size_t>(g)];
    rule.field = absl::StrCat("spec.groups[", g, "].partition");
    switch (given.kind()) {
      case v1::PARTITION_KIND_UNSPECIFIED:
      case v1::PARTITION_KIND_REPLICATED:
        rule.kind = session::PartitionKind::kReplicated;
        break;
      case v1::PARTITION_KIND_ROWS:
        rule.kind = session::PartitionKind::kRows;
        break;
      case v1::PARTITION_KIND_FLAT:
        rule.kind = session::PartitionKind::kFlat;
        break;
      case v1::PARTITION_KIND_EXPLICIT:
        rule.kind = session::PartitionKind::kExplicit;
        break;
      default:
        return InvalidField(rule.field + ".kind", absl::StrCat("unknown kind ", static_cast<int>(given.kind())));
    }
    if (given.alignment() != 0 && rule.kind != session::PartitionKind::kFlat) {
      return InvalidField(rule.field + ".alignment", "applies to kind flat only");
    }
    if (given.alignment() < 0) {
      return InvalidField(rule.field + ".alignment", absl::StrCat("must be >= 0, got ", given.alignment()));
    }
    rule.alignment = std::max<int64_t>(1, given.alignment());
    if (given.replicas() < 0) {
      return InvalidField(rule.field + ".replicas", absl::StrCat("must be >= 0, got ", given.replicas()));
    }
    if (given.replicas() > 1 && rule.kind == session::PartitionKind::kReplicated) {
      return InvalidField(rule.field + ".replicas", "applies to kinds rows, flat and explicit only");
    }
    rule.replicas = std::max(1, given.replicas());
    if (given.ranks_size() > 0 && rule.kind != session::PartitionKind::kExplicit) {
      return InvalidField(rule.field + ".ranks", "applies to kind explicit only");
    }
    for (int r = 0; r < given.ranks_size(); ++r) {
      std::vector<session::PartitionRule::Range>& ranges = rule.ranks.emplace_back();
      for (int i = 0; i < given.ranks(r).ranges_size(); ++i) {
        const v1::ParameterRange& range = given.ranks(r).ranges(i);
        const std::string at = absl::StrCat(rule.field, ".ranks[", r, "].ranges[", i, "]");
        auto it = config.parameter_index.find(range.parameter());
        if (it == config.parameter_index.end()) {
          return InvalidField(at + ".parameter", absl::StrCat("unknown parameter '", Echo(range.parameter()), "'"));
        }
        ranges.push_back({it->second, {range.begin(), range.end()}, at});
      }
    }
    if (rule.kind != session::PartitionKind::kReplicated && first_partitioned.empty()) first_partitioned = rule.field;
    if (rule.kind != session::PartitionKind::kReplicated && rule.replicas < 2 && first_unreplicated.empty()) {
      first_unreplicated = rule.field;
    }
  }
  if (first_partitioned.empty()) return absl::OkStatus();
  // A missing rank's part is a missing piece of the gradient, unless another replica holds it (HSDP):
  // quorum steps then go on without whole replicas, never without a shard (Session::QuorumReachedLocked).
  const bool quorum_over_replicas = config.sync.mode == SyncMode::kQuorum && first_unreplicated.empty();
  if (config.sync.mode != SyncMode::kLockstep && !quorum_over_replicas) {
    return InvalidField(
        "spec.sync.mode",
        absl::StrCat("lock-step only with partitioned groups (",
                     first_unreplicated.empty() ? first_partitioned : first_unreplicated,
                     "): a missing rank's part is a missing piece of the gradient, not a smaller batch",
                     config.sync.mode == SyncMode::kQuorum ? " (quorum needs replicas of every partition, HSDP)" : ""));
  }
  // The rules' own checks first (replicas that do not divide the ranks, bad explicit ranges).
  MUOND_RETURN_IF_ERROR(session::LayOutParts(rules, config));
  // A shard holds some of a group's parameters: rows and explicit ranges are per parameter, but a flat
  // partition cuts through all of them in order, so a shard is given its ranges as explicit ones.
  if (config.shard.count > 0) {
    for (const session::PartitionRule& rule : rules) {
      if (rule.kind != session::PartitionKind::kFlat) continue;
      return InvalidField(rule.field + ".kind",
                          "flat cuts through the whole group's parameters, which a shard of a sharded session holds "
                          "only some of: give each shard its ranges as an explicit partition (the clients do)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SessionConfig> ParseSessionSpec(const v1::SessionSpec& spec, const SpecLimits& limits) {
  SessionConfig config;
  config.world_size = spec.world_size() == 0 ? 1 : spec.world_size();
  if (config.world_size < 1 || config.world_size > limits.max_world_size) {
    return InvalidField("spec.world_size", absl::StrCat("must be between 1 and ", limits.max_world_size,
                                                        " on this daemon, got ", spec.world_size()));
  }
  config.straggler_timeout_seconds = limits.straggler_timeout_seconds;
  const v1::DType return_dtype = spec.return_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : spec.return_dtype();
  config.return_dtype = static_cast<TensorDType>(return_dtype);
  if (!wire::IsConcrete(return_dtype)) {
    return InvalidField("spec.return_dtype", absl::StrCat("unknown dtype ", static_cast<int>(spec.return_dtype())));
  }

  // The counts first: a spec refused for them costs nothing to check further.
  if (spec.parameters_size() == 0) return InvalidField("spec.parameters", "at least one parameter is required");
  if (spec.parameters_size() > limits.max_parameters) {
    return InvalidField("spec.parameters", absl::StrCat(spec.parameters_size(), " parameters exceed the limit of ",
                                                        limits.max_parameters));
  }
  if (spec.groups_size() == 0) return InvalidField("spec.groups", "at least one group is required");
  if (spec.groups_size() > limits.max_groups) {
    return InvalidField("spec.groups",
                        absl::StrCat(spec.groups_size(), " groups exceed the limit of ", limits.max_groups));
  }
  for (int i = 0; i < spec.groups_size(); ++i) {
    const auto& group = spec.groups(i);
    const std::string field = absl::StrCat("spec.groups[", i, "]");
    if (!ValidName(group.name()))
      return InvalidField(field + ".name", "must be 1 to 256 bytes without control characters");
    if (!config.group_index.emplace(group.name(), config.groups.size()).second) {
      return InvalidField(field + ".name", absl::StrCat("duplicate group '", Echo(group.name()), "'"));
    }
    MUOND_ASSIGN_OR_RETURN(optim::GroupOptions options, ParseGroupOptions(group.options(), field + ".options"));
    config.groups.push_back({group.name(), std::move(options)});
  }

  for (int i = 0; i < spec.parameters_size(); ++i) {
    const auto& p = spec.parameters(i);
    const std::string field = absl::StrCat("spec.parameters[", i, "]");
    ParameterConfig param;
    param.name = p.name();
    if (!ValidName(p.name())) return InvalidField(field + ".name", "must be 1 to 256 bytes without control characters");
    if (config.parameter_index.contains(p.name())) {
      return InvalidField(field + ".name", absl::StrCat("duplicate parameter '", Echo(p.name()), "'"));
    }
    if (p.shape_size() > limits.max_rank) {
      return InvalidField(field + ".shape", absl::StrCat("rank ", p.shape_size(), " exceeds the limit of ",
                                                         limits.max_rank, " (--max-tensor-rank)"));
    }
    param.numel = 1;
    for (int d = 0; d < p.shape_size(); ++d) {
      if (p.shape(d) <= 0) {
        return InvalidField(field + ".shape", absl::StrCat("dimension ", d, " is ", p.shape(d), "; must be positive"));
      }
      if (param.numel > limits.max_tensor_elements / p.shape(d)) {
        return InvalidField(field + ".shape", absl::StrCat("more than ", limits.max_tensor_elements,
                                                           " elements (--max-tensor-elements)"));
      }
      param.numel *= p.shape(d);
      param.shape.push_back(p.shape(d));
    }
    const v1::DType wire_dtype = p.wire_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : p.wire_dtype();
    param.wire_dtype = static_cast<TensorDType>(wire_dtype);
    if (!wire::IsConcrete(wire_dtype)) {
      return InvalidField(field + ".wire_dtype", absl::StrCat("unknown dtype ", static_cast<int>(p.wire_dtype())));
    }
    auto group = config.group_index.find(p.group());
    if (group == config.group_index.end()) {
      return InvalidField(field + ".group", absl::StrCat("unknown group '", Echo(p.group()), "'"));
    }
    param.group = group->second;
    if (p.qkv_split_size() != 0) {
      if (p.qkv_split_size() != 3) {
        return InvalidField(field + ".qkv_split", absl::StrCat("needs 3 sizes (q, k, v), got ", p.qkv_split_size()));
      }
      param.qkv = {p.qkv_split(0), p.qkv_split(1), p.qkv_split(2),
                   p.num_query_groups() == 0 ? 1 : p.num_query_groups()};
      if (param.qkv.q <= 0 || param.qkv.k <= 0 || param.qkv.v <= 0 || param.qkv.num_query_groups <= 0) {
        return InvalidField(field + ".qkv_split", "sizes and num_query_groups must be positive");
      }
      // Bounded by the rows before anything multiplies them (the optimizer checks the exact sum).
      const int64_t rows = param.shape.empty() ? 0 : param.shape[0];
      if (param.qkv.q > rows || param.qkv.k > rows || param.qkv.v > rows || param.qkv.num_query_groups > rows) {
        return InvalidField(field + ".qkv_split",
                            absl::StrCat("sizes and num_query_groups must be at most the ", rows, " rows"));
      }
    } else if (p.num_query_groups() != 0) {
      return InvalidField(field + ".num_query_groups", "applies only with qkv_split");
    }
    if (p.tp_blocks() < 0) return InvalidField(field + ".tp_blocks", absl::StrCat("must be >= 0, got ", p.tp_blocks()));
    if (p.tp_block_dim() != 0 && p.tp_blocks() <= 1) {
      return InvalidField(field + ".tp_block_dim", "applies only with tp_blocks > 1");
    }
    if (p.tp_blocks() > 1) {
      if (param.shape.size() != 2 || (p.tp_block_dim() != 0 && p.tp_block_dim() != 1)) {
        return InvalidField(field + ".tp_blocks", "needs a 2-D parameter and tp_block_dim 0 or 1");
      }
      const int64_t extent = param.shape[static_cast<size_t>(p.tp_block_dim())];
      if (p.tp_blocks() > extent || extent % p.tp_blocks() != 0) {
        return InvalidField(field + ".tp_blocks",
                            absl::StrCat("tp_blocks ", p.tp_blocks(), " does not divide dimension ", p.tp_block_dim(),
                                         " (", extent, ")"));
      }
    }
    param.tp = {std::max<int64_t>(p.tp_blocks(), 1), p.tp_block_dim()};
    config.total_elements += param.numel;
    config.parameter_index.emplace(param.name, config.parameters.size());
    config.parameters.push_back(std::move(param));
  }
  MUOND_RETURN_IF_ERROR(CheckLabels(spec));
  MUOND_RETURN_IF_ERROR(ParseQkClip(spec, config));
  MUOND_RETURN_IF_ERROR(ParseShard(spec, config));
  MUOND_RETURN_IF_ERROR(ParseLossScaler(spec, config));
  MUOND_RETURN_IF_ERROR(ParseSync(spec.sync(), config));
  MUOND_RETURN_IF_ERROR(ParsePartitions(spec, config));
  if (config.shard.count > 0) {
    // A shard sees its own groups' norms only; the global norm comes decided over every shard.
    for (size_t g = 0; g < config.groups.size(); ++g) {
      if (config.groups[g].options.clip_scope != optim::ClipScope::kGlobal) {
        return InvalidField(absl::StrCat("spec.groups[", g, "].options.clip_scope"),
                            "only global on a sharded session (each shard sees its own part of a group)");
      }
    }
  }
  return config;
}

absl::Status CheckSameSpec(const v1::SessionSpec& existing, const v1::SessionSpec& requested) {
  // An attach is not parsed as a creation is: its labels are checked here (their words are echoed).
  MUOND_RETURN_IF_ERROR(CheckLabels(requested));
  google::protobuf::util::MessageDifferencer differencer;
  std::string differences;
  differencer.ReportDifferencesToString(&differences);
  // Labels are compared on their own (LabelDifference), and not at all when either side has none.
  differencer.IgnoreField(v1::SessionSpec::descriptor()->FindFieldByName("labels"));
  // A shard's count of the whole session's QK-clip pairs is compared only when both sides give it:
  // a session an earlier client placed has none, and a client of either version attaches to it.
  if (!existing.shard().has_qk_clip_pairs() || !requested.shard().has_qk_clip_pairs()) {
    differencer.IgnoreField(v1::ShardPlacement::descriptor()->FindFieldByName("qk_clip_pairs"));
  }
  const std::string labels = LabelDifference(existing, requested);
  if (differencer.Compare(existing, requested) && labels.empty()) return absl::OkStatus();
  // A different placement explains every other difference of a shard's spec: name it first.
  if (std::string shard = ShardDifference(existing, requested); !shard.empty()) {
    return absl::AlreadyExistsError(absl::StrCat("session exists with a different spec (", shard, ")"));
  }
  if (!labels.empty()) {
    return absl::AlreadyExistsError(absl::StrCat("session exists with a different spec (", labels,
                                                 "); every client of the session must agree on its labels"));
  }
  // Keep the message to the first difference: it is what a user needs to fix.
  const size_t end = differences.find('\n');
  return absl::AlreadyExistsError(absl::StrCat("session exists with a different spec (", differences.substr(0, end),
                                               "); attach with the identical spec, or use another session_id"));
}

}  // namespace muond::rpc

namespace muond::rpc {

absl::StatusOr<v1::SessionSpec> SpecFromJson(absl::string_view json) {
  v1::SessionSpec spec;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &spec).ok()) {
    return absl::InvalidArgumentError("spec: does not parse as a muond.v1.SessionSpec");
  }
  return spec;
}

std::string SpecToJson(const v1::SessionSpec& spec) {
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  // Printing a message the daemon holds cannot fail (no Any fields to resolve).
  (void)google::protobuf::util::MessageToJsonString(spec, &json, print);
  return json;
}

absl::StatusOr<session::SessionConfig> ProtoSpecCodec::Parse(absl::string_view spec_json,
                                                             const session::SpecLimits& limits) const {
  MUOND_ASSIGN_OR_RETURN(v1::SessionSpec spec, SpecFromJson(spec_json));
  MUOND_ASSIGN_OR_RETURN(session::SessionConfig config, ParseSessionSpec(spec, limits));
  config.spec_json = std::string(spec_json);
  return config;
}

absl::Status ProtoSpecCodec::CheckSame(absl::string_view existing_json, absl::string_view requested_json) const {
  MUOND_ASSIGN_OR_RETURN(v1::SessionSpec existing, SpecFromJson(existing_json));
  MUOND_ASSIGN_OR_RETURN(v1::SessionSpec requested, SpecFromJson(requested_json));
  return CheckSameSpec(existing, requested);
}

}  // namespace muond::rpc
