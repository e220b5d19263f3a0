#include "client/shard_placement.h"

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/partition_rules.h"

namespace muond::client {

std::vector<int> Placement::ParametersOf(int shard) const {
  std::vector<int> out;
  for (size_t i = 0; i < shard_of.size(); ++i) {
    if (shard_of[i] == shard) out.push_back(static_cast<int>(i));
  }
  return out;
}

double Placement::Imbalance() const {
  if (loads.empty()) return 1.0;
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / static_cast<double>(loads.size());
  return mean > 0 ? *std::max_element(loads.begin(), loads.end()) / mean : 1.0;
}

namespace {

bool IsMuon(const v1::SessionSpec& spec, const std::string& group) {
  for (const v1::ParameterGroup& g : spec.groups()) {
    if (g.name() == group) {
      return g.options().optimizer() == v1::OPTIMIZER_UNSPECIFIED || g.options().optimizer() == v1::OPTIMIZER_MUON ||
             g.options().optimizer() == v1::OPTIMIZER_DION2;
    }
  }
  return false;
}

// A group's partition as the shard holding the parameters `held` is given it (docs/ranks.md, Over
// several daemons), as the Python client gives it (the specs of ranks attaching must be identical):
// a flat or explicit one as the explicit ranges of its parameters in the whole group, each shard's
// in the group's order, empty ones left out; rows stay (each parameter's own rule). A range naming
// a parameter outside the group stays, for the daemon to refuse naming it.
void HoldOnShard(const v1::SessionSpec& whole, const std::string& group, const std::set<std::string>& held,
                 v1::Partition& partition) {
  auto is_held = [&](const std::string& name) { return held.contains(name); };
  const int world_size = std::max(1, whole.world_size());
  const int shards = ShardCount(world_size, partition.replicas());
  // Replicas that do not divide world_size stay as given: the daemon refuses them naming the field.
  if (shards < 1 || (partition.replicas() > 1 && world_size % partition.replicas() != 0)) return;
  std::map<std::string, size_t> position;  // in the group
  std::vector<std::string> names;          // the group's, in order
  std::vector<int64_t> numels;
  for (const v1::ParameterSpec& p : whole.parameters()) {
    if (p.group() != group) continue;
    position.emplace(p.name(), names.size());
    names.push_back(p.name());
    numels.push_back(std::accumulate(p.shape().begin(), p.shape().end(), int64_t{1}, std::multiplies<>()));
  }
  v1::Partition given;
  given.set_kind(v1::PARTITION_KIND_EXPLICIT);
  given.set_replicas(partition.replicas());
  if (partition.kind() == v1::PARTITION_KIND_FLAT) {
    const std::vector<std::vector<ElementRange>> parts =
        FlatParts(numels, std::max<int64_t>(1, partition.alignment()), shards);
    for (int r = 0; r < shards; ++r) {
      v1::RankRanges* entry = given.add_ranks();
      for (size_t k = 0; k < names.size(); ++k) {
        const ElementRange range = parts[k][static_cast<size_t>(r)];
        if (!is_held(names[k]) || range.size() == 0) continue;
        v1::ParameterRange* out = entry->add_ranges();
        out->set_parameter(names[k]);
        out->set_begin(range.begin);
        out->set_end(range.end);
      }
    }
  } else if (partition.kind() == v1::PARTITION_KIND_EXPLICIT) {
    for (const v1::RankRanges& rank : partition.ranks()) {
      v1::RankRanges* entry = given.add_ranks();
      for (const v1::ParameterRange& range : rank.ranges()) {
        const bool known = position.contains(range.parameter());
        if ((known && !is_held(range.parameter())) || range.begin() == range.end()) continue;
        *entry->add_ranges() = range;
      }
      // In the group's order, as the Python client lists them; unknown names last, as given.
      std::stable_sort(entry->mutable_ranges()->begin(), entry->mutable_ranges()->end(),
                       [&](const v1::ParameterRange& a, const v1::ParameterRange& b) {
                         auto at = [&](const v1::ParameterRange& x) {
                           auto it = position.find(x.parameter());
                           return it == position.end() ? names.size() : it->second;
                         };
                         return at(a) < at(b);
                       });
    }
  } else {
    return;
  }
  partition = std::move(given);
}

}  // namespace

double PlacementCost(const v1::SessionSpec& spec, int index) {
  const v1::ParameterSpec& p = spec.parameters(index);
  int64_t numel = 1;
  for (int64_t d : p.shape()) numel *= d;
  if (!IsMuon(spec, p.group()) || p.shape_size() < 2) return 4.0 * static_cast<double>(numel);
  const int64_t cols = numel / p.shape(0);
  std::vector<int64_t> rows;
  if (p.qkv_split_size() == 3) {
    for (int g = 0; g < std::max(p.num_query_groups(), 1); ++g) {
      for (int64_t r : p.qkv_split()) {
        if (r > 0) rows.push_back(r);
      }
    }
  } else {
    rows.push_back(p.shape(0));
  }
  int64_t total = 0;  // summed exactly, then rounded once (as the Python client does)
  for (int64_t r : rows) {
    const int64_t small = std::min(r, cols);
    total += std::max(r, cols) * small * small;
  }
  return static_cast<double>(total);
}

absl::StatusOr<Placement> PlaceSpec(const v1::SessionSpec& spec, int num_daemons) {
  if (num_daemons < 1) return absl::InvalidArgumentError("endpoints: needs at least one daemon");
  const int n = spec.parameters_size();
  std::map<std::string, int> index;
  for (int i = 0; i < n; ++i) index[spec.parameters(i).name()] = i;
  // Union the QK-clip pairs into units, each named by its lowest index.
  std::vector<int> unit_of(n);
  std::iota(unit_of.begin(), unit_of.end(), 0);
  auto root = [&](int i) {
    while (unit_of[i] != i) i = unit_of[i];
    return i;
  };
  for (int k = 0; k < spec.qk_clip_size(); ++k) {
    auto q = index.find(spec.qk_clip(k).query());
    auto key = index.find(spec.qk_clip(k).key());
    if (q == index.end() || key == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.qk_clip[", k, "]: names an unknown parameter"));
    }
    const int a = root(q->second), b = root(key->second);
    if (a != b) unit_of[std::max(a, b)] = std::min(a, b);
  }
  std::map<int, std::vector<int>> members;
  for (int i = 0; i < n; ++i) members[root(i)].push_back(i);
  std::vector<std::tuple<double, int, std::vector<int>>> units;
  for (auto& [first, m] : members) {
    double cost = 0;
    for (int i : m) cost += PlacementCost(spec, i);
    units.emplace_back(cost, first, m);
  }
  std::sort(units.begin(), units.end(), [](const auto& a, const auto& b) {
    return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) > std::get<0>(b) : std::get<1>(a) < std::get<1>(b);
  });
  Placement placement;
  placement.loads.assign(num_daemons, 0.0);
  placement.shard_of.assign(n, 0);
  for (const auto& [cost, first, m] : units) {
    const int target = static_cast<int>(std::min_element(placement.loads.begin(), placement.loads.end()) -
                                        placement.loads.begin());  // the first of the least loaded
    placement.loads[target] += cost;
    for (int i : m) placement.shard_of[i] = target;
  }
  return placement;
}

v1::SessionSpec ShardSpec(const v1::SessionSpec& whole, const Placement& placement,
                          const std::vector<std::string>& endpoints, int shard) {
  if (endpoints.size() == 1) return whole;
  v1::SessionSpec spec;
  spec.set_world_size(whole.world_size());
  spec.set_return_dtype(whole.return_dtype());
  *spec.mutable_groups() = whole.groups();
  const std::vector<int> mine = placement.ParametersOf(shard);
  std::vector<std::string> names;
  for (int i : mine) {
    *spec.add_parameters() = whole.parameters(i);
    names.push_back(whole.parameters(i).name());
  }
  const std::set<std::string> held(names.begin(), names.end());
  for (v1::ParameterGroup& group : *spec.mutable_groups()) {
    if (group.has_partition()) HoldOnShard(whole, group.name(), held, *group.mutable_partition());
  }
  for (const v1::QkClipPair& pair : whole.qk_clip()) {
    if (std::find(names.begin(), names.end(), pair.query()) != names.end()) *spec.add_qk_clip() = pair;
  }
  // Every shard is told how the ranks synchronize: a daemon refuses what a sharded session cannot do.
  if (whole.has_sync()) *spec.mutable_sync() = whole.sync();
  // Every shard keeps the same scaler: each sees the same commit decisions, so their scales agree.
  if (whole.has_loss_scaler()) *spec.mutable_loss_scaler() = whole.loss_scaler();
  *spec.mutable_labels() = whole.labels();
  v1::ShardPlacement* out = spec.mutable_shard();
  for (const std::string& e : endpoints) out->add_endpoints(e);
  out->set_index(shard);
  out->set_num_parameters(whole.parameters_size());
  for (int i : mine) out->add_parameters(i);
  out->set_qk_clip_pairs(whole.qk_clip_size());
  return spec;
}

}  // namespace muond::client
