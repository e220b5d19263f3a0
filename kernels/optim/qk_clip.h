// QK-clip (MuonClip): after an update, rescales the query and key weights of attention heads whose
// maximum logit S_h exceeded the threshold τ, so that the next forward pass's logits stay ≤ τ.
// For each such head γ = τ/S_h; its query rows are multiplied by γ^α and its key rows by γ^(1−α).
//
// Stateless functions over backend buffers; the caller serializes access to the buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "common/status_macros.h"

namespace muond::optim {

// Per-head factors for one side: γ_h^exponent where S_h > τ, else 1. Non-finite or non-positive
// logits leave their head alone (they carry no usable bound).
inline std::vector<float> QkClipFactors(std::span<const double> max_logits, double threshold, double exponent) {
  std::vector<float> factors(max_logits.size(), 1.0f);
  for (size_t h = 0; h < max_logits.size(); ++h) {
    const double s = max_logits[h];
    if (std::isfinite(s) && s > threshold && s > 0) {
      factors[h] = static_cast<float>(std::pow(threshold / s, exponent));
    }
  }
  return factors;
}

// query and key are (num_heads·head_dim_q, cols_q) and (num_heads·head_dim_k, cols_k) row-major
// device buffers of query_numel and key_numel elements; the heads are contiguous row blocks.
inline absl::Status ApplyQkClip(kernels::Backend& backend, float* query, int64_t query_numel, float* key,
                                int64_t key_numel, std::span<const double> max_logits, double threshold,
                                double alpha) {
  const size_t heads = max_logits.size();
  if (heads == 0) return absl::OkStatus();
  const std::vector<float> q = QkClipFactors(max_logits, threshold, alpha);
  const std::vector<float> k = QkClipFactors(max_logits, threshold, 1.0 - alpha);
  MUOND_RETURN_IF_ERROR(backend.ScaleBatched(query, query_numel / heads, heads, q.data()));
  return backend.ScaleBatched(key, key_numel / heads, heads, k.data());
}

}  // namespace muond::optim
