// Gradients for the multi-rank tests: two small tensors ("w" 8x4, "b" 4) from a phase, and the
// weighted mean the daemon computes (sum(w_r * g_r) / sum(w_r) in fp64, rounded once). Header-only.
#pragma once

#include <cmath>
#include <utility>
#include <vector>

#include "client/muond_client.h"

namespace muond::testing {

struct Grads {
  std::vector<float> w, b;
  std::vector<client::TensorView> views() const { return {{"w", {8, 4}, w}, {"b", {4}, b}}; }
};

inline Grads GradsOf(float phase) {
  Grads g{std::vector<float>(32), std::vector<float>(4)};
  for (size_t i = 0; i < 32; ++i) g.w[i] = std::sin(phase + 0.37f * i);
  for (size_t i = 0; i < 4; ++i) g.b[i] = std::cos(phase + 0.11f * i);
  return g;
}

// sum(w_r * g_r) / sum(w_r) in fp64, rounded once (the daemon's rule).
inline Grads WeightedMean(const std::vector<std::pair<double, Grads>>& parts) {
  Grads mean{std::vector<float>(32), std::vector<float>(4)};
  auto average = [&](auto member, std::vector<float>& out) {
    for (size_t i = 0; i < out.size(); ++i) {
      double sum = 0, weights = 0;
      for (const auto& [w, g] : parts) {
        sum += w * (g.*member)[i];
        weights += w;
      }
      out[i] = static_cast<float>(sum / weights);
    }
  };
  average(&Grads::w, mean.w);
  average(&Grads::b, mean.b);
  return mean;
}

}  // namespace muond::testing
