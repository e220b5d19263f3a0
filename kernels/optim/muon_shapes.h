// Muon's matrices of a parameter (docs/algorithms.md, Shapes): which matrices Newton–Schulz sees in
// it (ForEachMatrix: heads, tensor-parallel blocks, fused QKV blocks, experts, flattened filters),
// whether it is worked on transposed, and the checks of its shape against tp_blocks, qkv_split and
// num_heads. Stateless functions over a ParamState the caller owns.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/optim/param_state.h"

namespace muond::optim {

// Calls visit(offset, rows, cols, transposed) for each matrix Newton–Schulz orthogonalizes in `p`,
// rows × cols being its own shape. It lies at `offset` of the working buffer as a row-major
// rows × cols matrix, or, when `transposed`, as its cols × rows transpose (the column blocks of a
// tensor-parallel row-parallel weight, which are rows of the transposed parameter). Together they
// cover the whole parameter exactly once, so the decay factor folded into each matrix's update
// decays all of W once.
//
// With `heads` > 1 (num_heads), each matrix of a 2-D parameter is cut into heads of its rows: a plain
// matrix into `heads` equal blocks; a fused QKV weight into blocks of the query heads' size
// (q / (heads / num_query_groups) rows), its k and v blocks too (CheckHeads refuses what does not
// divide).
template <typename Visit>
void ForEachMatrix(const ParamState& p, Visit&& visit, int64_t heads = 1) {
  const std::vector<int64_t>& s = p.shape;
  if (p.numel == 0) return;
  if (heads > 1 && s.size() == 2 && !p.tp.enabled()) {
    const int64_t n = s[1];
    const int64_t head_rows = p.qkv.enabled() ? p.qkv.q / (heads / p.qkv.num_query_groups) : s[0] / heads;
    if (head_rows < 1) return;  // refused by CheckHeads
    for (int64_t row = 0; row + head_rows <= s[0]; row += head_rows) visit(row * n, head_rows, n, false);
    return;
  }
  if (s.size() == 2 && p.tp.enabled()) {
    const int64_t blocks = p.tp.blocks;
    if (p.tp.dim == 0) {
      const int64_t rows = s[0] / blocks;  // contiguous row blocks
      for (int64_t b = 0; b < blocks; ++b) visit(b * rows * s[1], rows, s[1], false);
    } else {
      const int64_t cols = s[1] / blocks;  // row blocks of the transposed (n × m) parameter
      for (int64_t b = 0; b < blocks; ++b) visit(b * cols * s[0], s[0], cols, true);
    }
  } else if (s.size() == 2 && p.qkv.enabled()) {
    // (groups, q+k+v, n): each block of a group is contiguous rows of the row-major parameter.
    const int64_t n = s[1];
    int64_t row = 0;
    for (int64_t g = 0; g < p.qkv.num_query_groups; ++g) {
      for (int64_t block : {p.qkv.q, p.qkv.k, p.qkv.v}) {
        visit(row * n, block, n, false);
        row += block;
      }
    }
  } else if (s.size() == 3) {
    // Experts (E, m, n): one matrix per expert.
    for (int64_t e = 0; e < s[0]; ++e) visit(e * s[1] * s[2], s[1], s[2], false);
  } else {
    // 2-D as is; 4-D convolution (O, I, kh, kw) and higher ranks flattened to (O, I·kh·kw), scaled
    // by the flattened shape.
    visit(0, s[0], p.numel / s[0], false);
  }
}

// Whether the working buffer holds the parameter transposed while Newton–Schulz runs (column
// blocks): the update is then applied to the whole parameter after it is transposed back.
inline bool WorksTransposed(const ParamState& p) { return p.shape.size() == 2 && p.tp.enabled() && p.tp.dim == 1; }

// A Muon parameter against its options: at least 2-D; tp_blocks, qkv_split and num_heads (`heads`)
// that fit its shape and one another. INVALID_ARGUMENT naming the problem.
absl::Status CheckMuonParameter(const ParamState& param, int64_t heads);

}  // namespace muond::optim
