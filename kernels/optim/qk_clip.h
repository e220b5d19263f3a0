// QK-clip (MuonClip): after an update, rescales the query and key weights of attention heads whose
// maximum logit S_h exceeded the threshold τ, so that the next forward pass's logits stay ≤ τ.
// For each such head γ = τ/S_h; its query rows are multiplied by γ^α and its key rows by γ^(1−α).
// With multi-head latent attention (MlaLayout, Kimi K2's MuonClip Algorithm 1) only the parts that
// meet in the logit move that way: q_nope by γ^α and k_nope by γ^(1−α); q_rope, which meets the
// shared k_rope that is not clipped, by γ; v not at all.
//
// Stateless functions over backend buffers; the caller serializes access to the buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "kernels/backend.h"

namespace muond::optim {

// The rows of one head of an MLA query, [q_nope, q_rope], and of its key (the key/value
// up-projection), [k_nope, v].
struct MlaLayout {
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t query_rows() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t key_rows() const { return qk_nope_head_dim + v_head_dim; }
};

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
                                int64_t key_numel, std::span<const double> max_logits, double threshold, double alpha) {
  const size_t heads = max_logits.size();
  if (heads == 0) return absl::OkStatus();
  const std::vector<float> q = QkClipFactors(max_logits, threshold, alpha);
  const std::vector<float> k = QkClipFactors(max_logits, threshold, 1.0 - alpha);
  MUOND_RETURN_IF_ERROR(backend.ScaleBatched(query, query_numel / heads, heads, q.data()));
  return backend.ScaleBatched(key, key_numel / heads, heads, k.data());
}

// The MLA form: one factor per row (ScaleBatched over rows of `cols` elements), q_nope rows γ^α,
// q_rope rows γ, k_nope rows γ^(1−α), v rows 1. query is (heads·query_rows, query_cols), key
// (heads·key_rows, key_cols).
inline absl::Status ApplyMlaQkClip(kernels::Backend& backend, float* query, int64_t query_cols, float* key,
                                   int64_t key_cols, const MlaLayout& mla, std::span<const double> max_logits,
                                   double threshold, double alpha) {
  const size_t heads = max_logits.size();
  if (heads == 0) return absl::OkStatus();
  const std::vector<float> nope_q = QkClipFactors(max_logits, threshold, alpha);
  const std::vector<float> rope_q = QkClipFactors(max_logits, threshold, 1.0);
  const std::vector<float> nope_k = QkClipFactors(max_logits, threshold, 1.0 - alpha);
  std::vector<float> q_rows, k_rows;
  for (size_t h = 0; h < heads; ++h) {
    q_rows.insert(q_rows.end(), static_cast<size_t>(mla.qk_nope_head_dim), nope_q[h]);
    q_rows.insert(q_rows.end(), static_cast<size_t>(mla.qk_rope_head_dim), rope_q[h]);
    k_rows.insert(k_rows.end(), static_cast<size_t>(mla.qk_nope_head_dim), nope_k[h]);
    k_rows.insert(k_rows.end(), static_cast<size_t>(mla.v_head_dim), 1.0f);
  }
  MUOND_RETURN_IF_ERROR(backend.ScaleBatched(query, static_cast<size_t>(query_cols), q_rows.size(), q_rows.data()));
  return backend.ScaleBatched(key, static_cast<size_t>(key_cols), k_rows.size(), k_rows.data());
}

}  // namespace muond::optim
