#include "server/transport/api_codec/bulk_codec.h"

#include <algorithm>
#include <vector>

#include "common/compute_pool.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/api_codec/tensor_decode.h"

namespace muond::transport {
namespace {

// From this many bytes written in one call, stores stream around the caches: what the next pass reads
// would have been evicted by the rest of the copy anyway.
constexpr size_t kStreamingBytes = size_t{16} << 20;

template <typename Body>
void Run(ComputePool* pool, size_t count, const Body& body) {
  if (pool != nullptr) {
    pool->Run(count, body);
  } else if (count > 0) {
    body(0, count);
  }
}

}  // namespace

void DecodeAll(std::span<DecodeItem> items, ComputePool* pool) {
  // Every segment of every item, numbered by its first element among the items' elements laid end to
  // end; the pool's ranges split those elements, and each range decodes the segments starting in it.
  struct Segment {
    size_t item;
    size_t begin;  // in the item
    size_t count;
    size_t start;  // among all items' elements
  };
  std::vector<Segment> segments;
  size_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t n = items[i].out.size();
    const size_t per = kSegmentBytes / wire::ElementSize(items[i].dtype);
    for (size_t begin = 0; begin < n; begin += per)
      segments.push_back({i, begin, std::min(per, n - begin), total + begin});
    total += n;
  }
  const bool streaming = total * sizeof(float) >= kStreamingBytes;
  std::vector<double> sums(segments.size());
  Run(pool, total, [&](size_t begin, size_t end) {
    auto it = std::lower_bound(segments.begin(), segments.end(), begin,
                               [](const Segment& s, size_t at) { return s.start < at; });
    for (; it != segments.end() && it->start < end; ++it) {
      const DecodeItem& item = items[it->item];
      const std::span<float> out = item.out.subspan(it->begin, it->count);
      const size_t element = wire::ElementSize(item.dtype);
      const char* src = item.src + element * it->begin;
      sums[static_cast<size_t>(it - segments.begin())] =
          item.dtype == v1::DTYPE_FP32 ? CopySumSquaresFp32(src, out, streaming)
                                       : DecodeSumSquares(item.dtype, absl::string_view(src, element * it->count), out);
    }
  });
  for (size_t k = 0; k < segments.size(); ++k) items[segments[k].item].sum_squares += sums[k];  // in order
}

void EncodeAll(std::span<const EncodeItem> items, ComputePool* pool) {
  std::vector<size_t> starts;  // each item's first element among all items' elements
  size_t total = 0;
  for (const EncodeItem& item : items) {
    starts.push_back(total);
    total += item.values.size();
  }
  size_t bytes = 0;
  for (const EncodeItem& item : items) bytes += item.values.size() * wire::ElementSize(item.dtype);
  const bool streaming = bytes >= kStreamingBytes;
  Run(pool, total, [&](size_t begin, size_t end) {
    // The last item starting at or before `begin` (an empty item before it starts there too).
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    for (; i < items.size() && starts[i] < end; ++i) {
      const EncodeItem& item = items[i];
      const size_t from = std::max(begin, starts[i]) - starts[i];
      const size_t to = std::min(end, starts[i] + item.values.size()) - starts[i];
      if (from >= to) continue;
      const std::span<const float> values = item.values.subspan(from, to - from);
      char* dst = item.dst + wire::ElementSize(item.dtype) * from;
      if (item.dtype == v1::DTYPE_FP32) {
        CopyFp32(values, dst, streaming);
      } else {
        wire::EncodeTo(item.dtype, values, dst);
      }
    }
  });
}

}  // namespace muond::transport
