// HostTensor: one tensor's fp32 values gathered on the host — a step's gradient as it was decoded
// from a transport, an uploaded parameter, or a gradient read back from the step journal — with the
// bookkeeping the step needs. A plain value type shared by the session and durability layers;
// not thread-safe (one owner at a time).
#pragma once

#include <cstdint>
#include <vector>

namespace muond {

struct HostTensor {
  std::vector<float> values;  // empty until the first values arrive
  int64_t received = 0;       // elements so far
  double sum_squares = 0.0;   // fp64; inf/NaN when a value was not finite
  bool staged = false;        // the values are also in the step's backend gradient buffers
  bool device_only = false;   // staged, and `values` left empty: a GPU transport wrote the buffers
  bool present() const { return received > 0; }
};

}  // namespace muond
