// The matrices of a Muon step as muon.cc plans them (MatrixJob), the workspace slots past Newton–Schulz's
// it uses, and its per-backend scratch (StepScratch). Internal to kernels/optim/muon.cc and the
// passes it calls into (namo.cc); the types only describe memory the step owns for its duration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/backend.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/param_state.h"
#include "kernels/optim/stored_tensor.h"

namespace muond::optim {

// One matrix Newton–Schulz sees: a view into a parameter's update (the gradient buffer, which holds
// U after momentum) and the matching regions of its master and second moment (in their storage
// formats).
struct MatrixJob {
  float* update;
  StoredTensor* master;
  size_t master_offset;
  StoredTensor* moment2;  // null without a moment2_method
  size_t moment2_offset;  // where this matrix's region (adamuon) or lines (normuon, namo) start
  int64_t rows, cols;     // as it lies in `update` (the transpose of its own shape when `deferred`)
  double lr;              // η of this step
  double scale;           // the Muon scale, computed on this matrix's own shape
  float beta;             // the weight decay factor applied to the master region (1 for cautious decay)
  float decay;            // cautious decay only: η·λ, applied where the update and the weight agree in sign
  // A column block of a tensor-parallel weight, orthogonalized as a row block of the transposed
  // parameter: O goes back into `update`, and the whole parameter is updated once it is transposed
  // back (ApplyTransposed).
  bool deferred = false;
  bool lines_per_column = false;      // NorMuon: its lines are columns of the stored matrix
  const ParamState* param = nullptr;  // whose matrix it is (for telemetry)
};

// Workspace slot of NorMuon's transposed copy of a batch (wide matrices), after the gather buffer,
// and the slot a column-blocked parameter is transposed through.
constexpr int kNormuonSlot = NsWorkspace::kFirstFreeSlot + 1;
constexpr int kTransposeSlot = NsWorkspace::kFirstFreeSlot + 2;

// A step's small device-side values, one set per backend, used under SharedNsWorkspace::mu like
// the workspace and grown before the step changes any state: NorMuon's per-line sums and scales of
// a batch, which never leave the device. Doubles take two floats of a buffer.
struct StepScratch {
  std::unique_ptr<kernels::DeviceBuffer> line_sums, line_scales;
  // NAMO: the raw gradient's Σ G² of each line of the step, in batch order (taken before the
  // momentum overwrites it), and a batch's Σ M̃² and step sizes.
  std::unique_ptr<kernels::DeviceBuffer> namo_grad_sums, namo_update_sums, namo_scales;
};

}  // namespace muond::optim
