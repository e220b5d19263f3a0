// Placement of a session's parameters on K daemons (docs/sharding.md, Placement): whole tensors,
// balanced by optimizer cost — a Muon matrix max(m, n)·min(m, n)² per orthogonalized block (each
// q, k, v block of a fused QKV weight on its own), an element-wise parameter its fp32 bytes — with
// the two weights of a QK-clip pair on one daemon. Longest-processing-time first (cost descending,
// then spec order) onto the least-loaded daemon (the lowest index among equals): deterministic, and
// the same placement as the Python client's muond.placement, so either client attaches to a
// session the other created.
//
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"

namespace muond::client {

struct Placement {
  std::vector<int> shard_of;  // per parameter of the spec
  std::vector<double> loads;  // per daemon: the summed cost placed there

  std::vector<int> ParametersOf(int shard) const;
  // max/mean load; 1.0 is a perfect balance.
  double Imbalance() const;
};

// The optimizer cost of parameter `index` of `spec` (see the header comment).
double PlacementCost(const v1::SessionSpec& spec, int index);

// Places the parameters of `spec` on `num_daemons`. INVALID_ARGUMENT naming the field for a spec
// whose groups or QK-clip pairs name unknown parameters or groups, or fewer than one daemon.
absl::StatusOr<Placement> PlaceSpec(const v1::SessionSpec& spec, int num_daemons);

// The spec of daemon `shard`'s session: its parameters (in spec order), every group (a flat or
// explicit partition as the explicit ranges of its parameters), its QK-clip pairs, and the placement
// in spec.shard.
v1::SessionSpec ShardSpec(const v1::SessionSpec& whole, const Placement& placement,
                          const std::vector<std::string>& endpoints, int shard);

}  // namespace muond::client
