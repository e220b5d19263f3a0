// The daemon-side state of one parameter: its master, this step's fp32 gradient, and the optimizer's
// state slots, all in backend memory; the master and the slots in their storage formats (fp32 unless
// the group's master_dtype / *_dtype options say bf16 or fp16).
//
// Owned by the session that holds the parameter; the optimizer mutates it during Step. Not
// thread-safe: the owning session serializes steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/optim/stored_tensor.h"

namespace muond::optim {

// How a fused QKV weight is split: per query group, rows [0,q) are queries, [q,q+k) keys, the rest
// values. Empty when the parameter is not fused QKV.
struct QkvSplit {
  int64_t q = 0, k = 0, v = 0;
  int64_t num_query_groups = 1;
  bool enabled() const { return q + k + v > 0; }
};

// Megatron-Core's tensor-parallel blockwise mode (muon_tp_mode = blockwise): a 2-D parameter made of
// `blocks` equal tensor-parallel shards along dimension `dim` (0: row blocks, a column-parallel
// weight; 1: column blocks, a row-parallel one), each orthogonalized and scaled on its own shape.
// blocks ≤ 1: the whole matrix.
struct TpBlocks {
  int64_t blocks = 1;
  int dim = 0;
  bool enabled() const { return blocks > 1; }
};

// Slot names more than one optimizer uses (Muon and Dion2 keep a "momentum").
inline const std::string kMomentumSlot = "momentum";
inline const std::string kMoment2Slot = "moment2";  // Muon's second moment (NorMuon, NAMO, AdaMuon)

struct StateSlot {
  std::string name;  // "momentum", "exp_avg", "exp_avg_sq", "momentum_buffer"
  StoredTensor tensor;
  double bound = 0;  // no element's magnitude exceeds it (see ParamState::master_bound)
};

struct ParamState {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  QkvSplit qkv;
  TpBlocks tp;

  StoredTensor master;
  // An upper bound on |x| over the master's elements, kept by the owner (measured when values are
  // loaded, then advanced with Optimizer::BoundStep after each step) so that a step that could leave
  // the fp32 range is refused before it writes anything.
  double master_bound = 0;
  std::unique_ptr<kernels::DeviceBuffer> grad;  // filled by the caller before Step
  bool has_grad = false;                        // false: skipped this step (torch's grad=None)
  // The gradient is exactly zero everywhere (an expert no token reached): the step only decays the
  // momentum. Set by the caller with `grad`; telemetry reads it (a momentum decaying for want of
  // gradients is not one that clipping or a loss scale shrank).
  bool grad_is_zero = false;
  std::vector<StateSlot> slots;  // created by Optimizer::InitState
  int64_t step_count = 0;        // steps that updated this parameter

  StoredTensor* Slot(const std::string& slot_name);  // nullptr: no such slot
  const StoredTensor* Slot(const std::string& slot_name) const;
};

}  // namespace muond::optim
