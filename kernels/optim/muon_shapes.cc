#include "kernels/optim/muon_shapes.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace muond::optim {
namespace {

// num_heads against a parameter: 2-D, not with tp_blocks, and heads of whole rows (with a fused
// QKV weight: num_query_groups divides num_heads, and the query heads' size divides q, k and v).
absl::Status CheckHeads(const ParamState& param, int64_t heads) {
  if (heads == 1) return absl::OkStatus();
  const std::string shape = absl::StrJoin(param.shape, ", ");
  if (param.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads needs 2-D parameters, got shape [", shape, "]"));
  }
  if (param.tp.enabled()) return absl::InvalidArgumentError("num_heads and tp_blocks cannot be combined");
  const QkvSplit& s = param.qkv;
  if (!s.enabled()) {
    if (param.shape[0] % heads == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads ", heads, " does not divide the ", param.shape[0], " rows of shape [", shape, "]"));
  }
  if (s.num_query_groups < 1 || heads % s.num_query_groups != 0 || s.q % (heads / s.num_query_groups) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads ", heads, " with qkv_split (", s.q, ", ", s.k, ", ", s.v,
                                                   ") and num_query_groups ", s.num_query_groups,
                                                   ": each query group's q rows must hold num_heads / "
                                                   "num_query_groups heads of equal size"));
  }
  const int64_t head_rows = s.q / (heads / s.num_query_groups);
  if (s.k % head_rows != 0 || s.v % head_rows != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads ", heads, " gives heads of ", head_rows,
                                                   " rows, which do not divide qkv_split's k ", s.k, " and v ", s.v));
  }
  return absl::OkStatus();
}

absl::Status CheckTpBlocks(const ParamState& param) {
  const TpBlocks& tp = param.tp;
  if (tp.blocks < 1) return absl::InvalidArgumentError(absl::StrCat("tp_blocks must be >= 1, got ", tp.blocks));
  if (!tp.enabled()) return absl::OkStatus();
  if (param.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp_blocks needs a 2-D parameter, got shape [", absl::StrJoin(param.shape, ", "), "]"));
  }
  if (param.qkv.enabled()) return absl::InvalidArgumentError("tp_blocks and qkv_split cannot be combined");
  if (tp.dim != 0 && tp.dim != 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp_block_dim must be 0 or 1, got ", tp.dim));
  }
  if (param.shape[tp.dim] % tp.blocks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp_blocks ", tp.blocks, " does not divide dimension ", tp.dim,
                                                   " of shape [", absl::StrJoin(param.shape, ", "), "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckMuonParameter(const ParamState& param, int64_t heads) {
  if (param.shape.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("muon needs a parameter with at least 2 dimensions, got shape [",
                                                   absl::StrJoin(param.shape, ", "), "]"));
  }
  MUOND_RETURN_IF_ERROR(CheckTpBlocks(param));
  MUOND_RETURN_IF_ERROR(CheckHeads(param, heads));
  const QkvSplit& s = param.qkv;
  if (!s.enabled()) return absl::OkStatus();
  if (param.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("qkv_split needs a 2-D parameter, got shape [", absl::StrJoin(param.shape, ", "), "]"));
  }
  if (s.q < 1 || s.k < 1 || s.v < 1 || s.num_query_groups < 1) {
    return absl::InvalidArgumentError(absl::StrCat("qkv_split (", s.q, ", ", s.k, ", ", s.v, ") and num_query_groups ",
                                                   s.num_query_groups, " must all be >= 1"));
  }
  if (s.num_query_groups * (s.q + s.k + s.v) != param.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qkv_split (", s.q, ", ", s.k, ", ", s.v, ") times num_query_groups ", s.num_query_groups, " gives ",
        s.num_query_groups * (s.q + s.k + s.v), " rows, but the parameter has ", param.shape[0]));
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
