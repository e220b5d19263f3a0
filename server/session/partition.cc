#include "server/session/partition.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::session {

namespace {

absl::Status Invalid(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

std::string RangeText(ElementRange r) { return absl::StrCat("[", r.begin, ", ", r.end, ")"); }

absl::Status FlatParts(const PartitionRule& rule, const std::vector<size_t>& members, int shards,
                       SessionConfig& config) {
  if (rule.alignment < 1 || rule.alignment > (int64_t{1} << 30)) {
    return Invalid(rule.field + ".alignment", absl::StrCat("must be between 0 and 2^30, got ", rule.alignment));
  }
  std::vector<int64_t> numels;
  for (size_t p : members) numels.push_back(config.parameters[p].numel);
  std::vector<std::vector<ElementRange>> parts = muond::FlatParts(numels, rule.alignment, shards);
  for (size_t k = 0; k < members.size(); ++k) config.parts[members[k]] = std::move(parts[k]);
  return absl::OkStatus();
}

absl::Status ExplicitParts(const PartitionRule& rule, const std::vector<size_t>& members, size_t group, int shards,
                           SessionConfig& config) {
  const int n = shards;
  if (static_cast<int>(rule.ranks.size()) != n) {
    return Invalid(rule.field + ".ranks",
                   n == config.world_size
                       ? absl::StrCat("needs one entry per rank (world_size ", n, "), got ", rule.ranks.size())
                       : absl::StrCat("needs one entry per shard (world_size ", config.world_size, " over ",
                                      rule.replicas, " replicas: ", n, "), got ", rule.ranks.size()));
  }
  for (size_t p : members) config.parts[p].assign(n, ElementRange{});
  // Entry r is rank r's, or under HSDP shard r's (held by ranks r, r + n, ...).
  const char* holder = n == config.world_size ? "rank" : "shard";
  std::vector<std::vector<bool>> listed(config.parameters.size(), std::vector<bool>(n, false));
  for (int r = 0; r < n; ++r) {
    for (const PartitionRule::Range& given : rule.ranks[r]) {
      const ParameterConfig& param = config.parameters[given.parameter];
      if (param.group != group) {
        return Invalid(given.field + ".parameter",
                       absl::StrCat("'", param.name, "' is in group '", config.groups[param.group].name,
                                    "', not in this one ('", config.groups[group].name, "')"));
      }
      if (given.range.begin < 0 || given.range.end < given.range.begin || given.range.end > param.numel) {
        return Invalid(given.field, absl::StrCat("range ", RangeText(given.range), " is outside '", param.name,
                                                 "', which has elements [0, ", param.numel, ")"));
      }
      if (listed[given.parameter][r]) {
        return Invalid(given.field + ".parameter", absl::StrCat(holder, " ", r, " lists '", param.name, "' twice; a ",
                                                                holder, " holds one contiguous range of a parameter"));
      }
      listed[given.parameter][r] = true;
      config.parts[given.parameter][r] = given.range;
    }
  }
  // Every element held by exactly one rank.
  for (size_t p : members) {
    const ParameterConfig& param = config.parameters[p];
    std::vector<std::pair<ElementRange, int>> held;
    for (int r = 0; r < n; ++r) {
      if (config.parts[p][r].size() > 0) held.emplace_back(config.parts[p][r], r);
    }
    std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
    int64_t covered = 0;
    int previous = -1;
    for (const auto& [range, r] : held) {
      if (range.begin < covered) {
        return Invalid(rule.field + ".ranks",
                       absl::StrCat(holder, "s ", previous, " and ", r, " both claim elements ",
                                    RangeText({range.begin, std::min(covered, range.end)}), " of '", param.name, "'"));
      }
      if (range.begin > covered) {
        return Invalid(rule.field + ".ranks", absl::StrCat("elements ", RangeText({covered, range.begin}), " of '",
                                                           param.name, "' are held by no ", holder));
      }
      covered = range.end;
      previous = r;
    }
    if (covered < param.numel) {
      return Invalid(rule.field + ".ranks", absl::StrCat("elements ", RangeText({covered, param.numel}), " of '",
                                                         param.name, "' are held by no ", holder));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LayOutParts(const std::vector<PartitionRule>& rules, SessionConfig& config) {
  config.parts.clear();
  bool any = false;
  for (const PartitionRule& rule : rules) any = any || rule.kind != PartitionKind::kReplicated;
  if (!any) return absl::OkStatus();
  config.parts.assign(config.parameters.size(), {});
  for (size_t g = 0; g < config.groups.size() && g < rules.size(); ++g) {
    const PartitionRule& rule = rules[g];
    config.groups[g].partition = rule.kind;
    std::vector<size_t> members;
    for (size_t p = 0; p < config.parameters.size(); ++p) {
      if (config.parameters[p].group == g) members.push_back(p);
    }
    if (rule.replicas < 1 || rule.replicas > config.world_size || config.world_size % rule.replicas != 0) {
      return Invalid(rule.field + ".replicas",
                     absl::StrCat("must divide world_size (", config.world_size, "), got ", rule.replicas));
    }
    // Laid out over the shards, then each shard's ranges given to its replicas.
    const int shards = muond::ShardCount(config.world_size, rule.replicas);
    switch (rule.kind) {
      case PartitionKind::kReplicated:
        break;
      case PartitionKind::kRows:
        for (size_t p : members) config.parts[p] = muond::RowParts(config.parameters[p].shape, shards);
        break;
      case PartitionKind::kFlat:
        if (absl::Status s = FlatParts(rule, members, shards, config); !s.ok()) return s;
        break;
      case PartitionKind::kExplicit:
        if (absl::Status s = ExplicitParts(rule, members, g, shards, config); !s.ok()) return s;
        break;
    }
    if (rule.kind == PartitionKind::kReplicated || shards == config.world_size) continue;
    for (size_t p : members) {
      std::vector<ElementRange>& parts = config.parts[p];
      for (int r = shards; r < config.world_size; ++r) parts.push_back(parts[static_cast<size_t>(r % shards)]);
    }
  }
  return absl::OkStatus();
}

bool IsPartitioned(const SessionConfig& config, size_t index) {
  return index < config.parts.size() && !config.parts[index].empty();
}

std::string RanksText(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

bool AnyPartitioned(const SessionConfig& config) {
  for (size_t i = 0; i < config.parts.size(); ++i) {
    if (IsPartitioned(config, i)) return true;
  }
  return false;
}

ElementRange PartOf(const SessionConfig& config, size_t index, int rank) {
  if (!IsPartitioned(config, index) || rank < 0 || rank >= static_cast<int>(config.parts[index].size())) {
    return {0, config.parameters[index].numel};
  }
  return config.parts[index][static_cast<size_t>(rank)];
}

int64_t PartElements(const SessionConfig& config, size_t index, int rank) { return PartOf(config, index, rank).size(); }

std::vector<int> SameHolders(const SessionConfig& config, size_t index, int rank) {
  std::vector<int> holders;
  const ElementRange part = PartOf(config, index, rank);
  if (!IsPartitioned(config, index) || part.size() == 0) return holders;
  for (size_t r = 0; r < config.parts[index].size(); ++r) {
    if (config.parts[index][r] == part) holders.push_back(static_cast<int>(r));
  }
  return holders;
}

std::vector<int> ReplicaOf(const SessionConfig& config) {
  std::map<std::vector<std::pair<int64_t, int64_t>>, int> first;
  std::vector<int> replica_of;
  for (int r = 0; r < config.world_size; ++r) {
    std::vector<std::pair<int64_t, int64_t>> held;
    for (size_t p = 0; p < config.parts.size(); ++p) {
      if (!IsPartitioned(config, p)) continue;
      const ElementRange part = PartOf(config, p, r);
      held.emplace_back(part.begin, part.end);
    }
    replica_of.push_back(first.try_emplace(std::move(held), r).first->second);
  }
  return replica_of;
}

int64_t ShapeElements(std::span<const int64_t> shape) {
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && elements > std::numeric_limits<int64_t>::max() / d)) return -1;
    elements *= d;
  }
  return elements;
}

ElementRange StatePartOf(const SessionConfig& config, size_t index, size_t numel, int rank) {
  const bool element_wise = static_cast<int64_t>(numel) == config.parameters[index].numel;
  if (rank < 0 || !element_wise || !IsPartitioned(config, index)) return {0, static_cast<int64_t>(numel)};
  return PartOf(config, index, rank);
}

absl::Status CheckRankParts(const SessionConfig& config, int rank, const std::vector<HostTensor>& gradients) {
  for (size_t p = 0; p < config.parts.size() && p < gradients.size(); ++p) {
    if (!IsPartitioned(config, p)) continue;
    const ElementRange part = PartOf(config, p, rank);
    const HostTensor& g = gradients[p];
    const std::string& name = config.parameters[p].name;
    if (part.size() == 0) {
      if (g.present()) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradients: rank ", rank, " holds no elements of '", name, "' but sent ", g.received));
      }
      continue;
    }
    if (!g.present()) continue;  // no gradient this step: CheckPartsAgree wants the other holders to agree
    if (g.received != part.size()) {
      return absl::InvalidArgumentError(absl::StrCat("gradients: rank ", rank, " sent ", g.received, " elements of '",
                                                     name, "'; its part ", RangeText(part), " has ", part.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPartsAgree(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank) {
  for (size_t p = 0; p < config.parts.size(); ++p) {
    if (!IsPartitioned(config, p)) continue;
    std::vector<int> sent, left_out;
    for (size_t r = 0; r < by_rank.size(); ++r) {
      if (by_rank[r] == nullptr || config.parts[p][r].size() == 0) continue;
      ((*by_rank[r])[p].present() ? sent : left_out).push_back(static_cast<int>(r));
    }
    if (!sent.empty() && !left_out.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradients: '", config.parameters[p].name, "': ", RanksText(sent), " sent ",
                       sent.size() == 1 ? "its" : "their", " part and ", RanksText(left_out),
                       " did not; a partitioned parameter's gradient comes from every rank holding "
                       "a part of it, or from none (unused this step); no update was applied"));
    }
  }
  return absl::OkStatus();
}

bool PartsCovered(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank) {
  for (size_t p = 0; p < config.parts.size(); ++p) {
    if (!IsPartitioned(config, p)) continue;
    std::set<std::pair<int64_t, int64_t>> held;
    for (size_t r = 0; r < by_rank.size() && r < config.parts[p].size(); ++r) {
      if (by_rank[r] != nullptr) held.emplace(config.parts[p][r].begin, config.parts[p][r].end);
    }
    for (const ElementRange& part : config.parts[p]) {
      if (part.size() > 0 && !held.contains({part.begin, part.end})) return false;
    }
  }
  return true;
}

void AssembleParts(const SessionConfig& config, const std::vector<const std::vector<HostTensor>*>& by_rank,
                   const std::vector<double>& weight, const std::vector<double>& rescale,
                   std::vector<HostTensor>& out) {
  for (size_t p = 0; p < config.parts.size(); ++p) {
    if (!IsPartitioned(config, p)) continue;
    bool sent = false;
    for (size_t r = 0; r < by_rank.size(); ++r) {
      sent = sent || (by_rank[r] != nullptr && config.parts[p][r].size() > 0 && (*by_rank[r])[p].present());
    }
    if (!sent) continue;  // unused this step: no gradient, as for a replicated parameter nobody sent
    HostTensor whole;
    whole.values.assign(static_cast<size_t>(config.parameters[p].numel), 0.0f);
    // Each part's holders in rank order (its replicas under HSDP), and those of them that arrived.
    std::map<std::pair<int64_t, int64_t>, std::pair<int, std::vector<int>>> parts;
    for (size_t r = 0; r < config.parts[p].size(); ++r) {
      const ElementRange part = config.parts[p][r];
      if (part.size() == 0) continue;
      auto& [holders, arrived] = parts[{part.begin, part.end}];
      ++holders;
      if (r < by_rank.size() && by_rank[r] != nullptr) arrived.push_back(static_cast<int>(r));
    }
    for (const auto& [range, holders_arrived] : parts) {
      const auto& [holders, arrived] = holders_arrived;
      if (arrived.empty()) continue;  // a quorum step has every part (PartsCovered); lock-step every rank
      const auto into = whole.values.begin() + range.first;
      const auto length = static_cast<size_t>(range.second - range.first);
      if (holders == 1) {  // one owner: its values, brought to the lowest rank's loss scale
        const int r = arrived.front();
        const HostTensor& g = (*by_rank[static_cast<size_t>(r)])[p];
        const double factor = rescale[static_cast<size_t>(r)];
        if (factor == 1.0) {
          std::copy(g.values.begin(), g.values.begin() + static_cast<std::ptrdiff_t>(length), into);
        } else {
          std::transform(g.values.begin(), g.values.begin() + static_cast<std::ptrdiff_t>(length), into,
                         [factor](float v) { return static_cast<float>(factor * v); });
        }
        continue;
      }
      // Replicas: each one's reduced gradient of its own batch, averaged by weight as whole
      // gradients of replicated ranks are (rank_gather.cc), however many of them arrived.
      std::vector<double> sum(length, 0.0);
      double weights = 0;
      for (int q : arrived) {
        const std::vector<float>& g = (*by_rank[static_cast<size_t>(q)])[p].values;
        const double scaled_w = weight[static_cast<size_t>(q)] * rescale[static_cast<size_t>(q)];
        for (size_t i = 0; i < length; ++i) sum[i] += scaled_w * g[i];
        weights += weight[static_cast<size_t>(q)];
      }
      for (size_t i = 0; i < length; ++i) into[static_cast<std::ptrdiff_t>(i)] = static_cast<float>(sum[i] / weights);
    }
    for (float v : whole.values) whole.sum_squares += static_cast<double>(v) * v;
    whole.received = config.parameters[p].numel;
    out[p] = std::move(whole);
  }
}

std::shared_ptr<const ParameterSnapshot> RankView(const SessionConfig& config,
                                                  std::shared_ptr<const ParameterSnapshot> snapshot, int rank) {
  if (config.parts.empty() || snapshot == nullptr || snapshot->values.empty()) return snapshot;
  struct Holder {
    std::shared_ptr<const ParameterSnapshot> whole;
    ParameterSnapshot view;
  };
  auto holder = std::make_shared<Holder>();
  holder->view.step = snapshot->step;
  holder->view.views = snapshot->views;
  holder->view.generation = snapshot->generation;
  holder->view.on_device = snapshot->on_device;
  for (size_t p = 0; p < snapshot->values.size(); ++p) {
    const ElementRange part = PartOf(config, p, rank);
    holder->view.values.push_back(
        snapshot->values[p].subspan(static_cast<size_t>(part.begin), static_cast<size_t>(part.size())));
  }
  holder->whole = std::move(snapshot);
  return std::shared_ptr<const ParameterSnapshot>(holder, &holder->view);
}

}  // namespace muond::session
