// Partitions: which elements of a parameter each rank of a multi-rank session holds, when the
// trainer shards its parameters (FSDP, ZeRO, DTensor) and each rank sends only its part of the
// reduced gradient and gets back only its part of the new parameters (docs/ranks.md, Ranks that
// hold parts). A rank holds one contiguous range of each parameter (possibly empty); the ranges of
// the N shards cover every element exactly once. The rules:
//
//   rows      shard s holds rows [s·c, min(m, (s+1)·c)) of m rows, c = ⌈m/N⌉ (torch.chunk on dim 0)
//   flat      the group's parameters flattened in spec order, each padded to a multiple of the
//             alignment, the whole padded to a multiple of N, cut into N equal ranges
//   explicit  the ranges the spec lists, checked to cover each parameter once
//
// Without replicas every rank is its own shard (N = world_size). With R replicas (HSDP), N =
// world_size / R and rank r holds shard r mod N: the R ranks holding a shard are its replicas.
// LayOutParts computes SessionConfig::parts once, at creation; everything else reads them. The
// daemon assembles the whole gradient from the parts (an element with one holder is copied, one
// with replicas is their weighted average) and runs the step on whole matrices. Plain functions
// over an immutable config: thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/host_tensor.h"
#include "server/session/session_config.h"
#include "server/session/step_types.h"

namespace muond::session {

// A group's partition as the spec gives it; `field` names it in refusals ("spec.groups[1].partition").
struct PartitionRule {
  struct Range {
    size_t parameter = 0;  // index into SessionConfig::parameters
    ElementRange range;
    std::string field;  // where the spec lists it
  };
  PartitionKind kind = PartitionKind::kReplicated;
  int64_t alignment = 1;                  // flat
  int replicas = 1;                       // HSDP: copies of the partition over the ranks
  std::vector<std::vector<Range>> ranks;  // explicit: one list per shard
  std::string field;
};

// Fills config.parts from rules[g] for each group g (the parameters, groups and world size already
// parsed). INVALID_ARGUMENT naming the field for a rule that cannot hold: replicas that do not
// divide the world size, explicit ranges outside their parameter, overlapping, leaving elements to
// no rank, or listed for the wrong group.
absl::Status LayOutParts(const std::vector<PartitionRule>& rules, SessionConfig& config);

bool IsPartitioned(const SessionConfig& config, size_t index);
// "rank 2" or "ranks 0, 1", for refusals that name ranks.
std::string RanksText(const std::vector<int>& ranks);
// Whether any parameter of the session is partitioned.
bool AnyPartitioned(const SessionConfig& config);
// The range of parameter `index` that `rank` holds: the whole parameter when it is replicated.
ElementRange PartOf(const SessionConfig& config, size_t index, int rank);
// The elements `rank` sends and receives of parameter `index`.
int64_t PartElements(const SessionConfig& config, size_t index, int rank);
// The ranks holding the same elements of partitioned parameter `index` as `rank`, itself included,
// in rank order: the replicas of its shard under HSDP, `rank` alone otherwise (none when it holds
// nothing of it).
std::vector<int> SameHolders(const SessionConfig& config, size_t index, int rank);
// By rank: the lowest rank holding the same elements of every partitioned parameter (under HSDP the
// rank's replica in the first copy; the rank itself otherwise). Ranks that map to one rank are
// interchangeable for what each holds.
std::vector<int> ReplicaOf(const SessionConfig& config);

// The elements of a tensor of shape `shape` as a sender wrote it; -1 for a negative dimension or a
// count beyond int64. A part travels in any shape of its element count (a row block, a flat range).
int64_t ShapeElements(std::span<const int64_t> shape);

// The range of a state tensor of parameter `index` with `numel` elements that `rank` holds: its
// part when the parameter is partitioned and the tensor is of the parameter's size (the master, an
// element-wise slot); otherwise the whole tensor [0, numel).
ElementRange StatePartOf(const SessionConfig& config, size_t index, size_t numel, int rank);

// `rank`'s gradients against its parts: a partitioned parameter of which the rank holds elements is
// there with exactly its part's size or absent (no gradient this step: CheckPartsAgree then wants
// every rank holding a part of it to leave it out), one of which it holds none is absent.
// INVALID_ARGUMENT naming the parameter, the expected range and what came, otherwise.
absl::Status CheckRankParts(const SessionConfig& config, int rank, const std::vector<HostTensor>& gradients);

// Every rank's gradients of one step (by_rank[r], all present under lock-step): each partitioned
// parameter comes from every rank holding a part of it, or from none (a parameter unused this step,
// left without a gradient as a replicated one would be). INVALID_ARGUMENT naming the parameter and
// the ranks that sent their parts and those that did not, otherwise.
absl::Status CheckPartsAgree(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank);

// Whether the ranks present in by_rank (non-null) hold every element of every partitioned parameter
// between them: with HSDP replicas, a quorum step may go on without some replicas, never without a
// shard.
bool PartsCovered(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank);

// Writes the whole gradient of each partitioned parameter into out[p] from the ranks' parts
// (by_rank[r] is rank r's gradients, all present under lock-step), with its fp64 sum of squares
// taken in element order. A part one rank holds is multiplied by its rank's rescale[r] (in fp64,
// rounded once to fp32; a factor of 1 copies the values as they are). A part held by replicas is
// their average as a replicated parameter's: Σ weight[r]·rescale[r]·g_r / Σ weight[r] over its
// holders, in fp64 in rank order, rounded once. Replicated parameters, and partitioned ones no rank
// sent, are left alone.
void AssembleParts(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank,
                   const std::vector<double>& weight, const std::vector<double>& rescale, std::vector<HostTensor>& out);

// The answer `rank` gets: the same result, each parameter's values narrowed to the rank's part
// (views into `snapshot`, which the returned one keeps alive). `snapshot` itself when nothing is
// partitioned.
std::shared_ptr<const ParameterSnapshot> RankView(const SessionConfig& config,
                                                  std::shared_ptr<const ParameterSnapshot> snapshot, int rank);

}  // namespace muond::session
