// The rules that cut a parameter over the ranks of a session whose group is partitioned
// (docs/ranks.md, Ranks that hold parts): which contiguous range of its row-major flattening each
// rank holds. One source for the daemon (server/session/partition.cc, which also checks explicit
// ranges) and the C++ client (client::Session::HoldParts); the Python client's copy is
// python/muond/partition.py, held to the same results by tests/python/test_partition.py.
//
// Header-only, standard C++ only: plain functions, thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace muond {

// Elements [begin, end) of a parameter's row-major flattening.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const ElementRange&) const = default;
};

// HSDP (docs/ranks.md): a partition repeated over `replicas` groups of world_size / replicas ranks,
// the shards; rank r holds shard r mod shards, as a (replicate, shard) device mesh numbers its ranks.
// `replicas` 0 or 1: one copy, every rank its own shard. `replicas` divides world_size (checked by
// the daemon).
inline int ShardCount(int world_size, int replicas) { return replicas > 1 ? world_size / replicas : world_size; }
inline int ShardOf(int rank, int world_size, int replicas) { return rank % ShardCount(world_size, replicas); }

// rows: rank r of `world_size` holds rows [r·c, min(m, (r+1)·c)) of m = shape[0] rows (one row for
// a scalar), c = ⌈m/N⌉ — torch.chunk on dim 0, as DTensor Shard(0) and FSDP2 cut.
inline std::vector<ElementRange> RowParts(const std::vector<int64_t>& shape, int world_size) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const int64_t row = rows == 0 ? 0 : numel / rows;
  const int64_t c = (rows + world_size - 1) / world_size;
  std::vector<ElementRange> parts;
  for (int64_t r = 0; r < world_size; ++r) {
    parts.push_back({std::min(rows, r * c) * row, std::min(rows, (r + 1) * c) * row});
  }
  return parts;
}

// flat: the parameters of `numels` flattened in order, each padded to a multiple of `alignment`
// (>= 1), the whole padded to a multiple of N and cut into N equal ranges; parts[k][r] is where
// rank r's range overlaps parameter k (possibly empty).
inline std::vector<std::vector<ElementRange>> FlatParts(const std::vector<int64_t>& numels, int64_t alignment,
                                                        int world_size) {
  std::vector<int64_t> starts;
  int64_t end = 0;
  for (int64_t n : numels) {
    starts.push_back(end);
    end = (end + n + alignment - 1) / alignment * alignment;
  }
  const int64_t chunk = (end + world_size - 1) / world_size;
  std::vector<std::vector<ElementRange>> parts;
  for (size_t k = 0; k < numels.size(); ++k) {
    std::vector<ElementRange>& ranks = parts.emplace_back();
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t first = std::clamp(r * chunk - starts[k], int64_t{0}, numels[k]);
      const int64_t last = std::clamp((r + 1) * chunk - starts[k], int64_t{0}, numels[k]);
      ranks.push_back({first, std::max(first, last)});
    }
  }
  return parts;
}

}  // namespace muond
