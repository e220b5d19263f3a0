// Muon (docs/algorithms.md, Muon step and Shapes): momentum → Newton–Schulz → scale → weight
// decay → update, for every parameter of a step, with same-shape matrices orthogonalized together.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/optim/line_normalization.h"
#include "kernels/optim/muon_jobs.h"
#include "kernels/optim/muon_shapes.h"
#include "kernels/optim/namo.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer_impls.h"

namespace muond::optim {
namespace {

using kernels::Backend;

// Caps the floats gathered for one batched Newton–Schulz call (256 MiB of fp32) so that many large
// same-shape parameters do not double the memory footprint at once; always at least one matrix.
// (The gather buffer and Newton–Schulz's two iterates each hold this much: 768 MiB at most.)
constexpr size_t kMaxBatchFloats = size_t{1} << 26;

// `buffer` holding at least `floats` floats.
absl::Status Grow(Backend& backend, std::unique_ptr<kernels::DeviceBuffer>& buffer, size_t floats) {
  if (buffer != nullptr && buffer->size() >= floats) return absl::OkStatus();
  buffer.reset();
  MUOND_ASSIGN_OR_RETURN(buffer, backend.Allocate(floats));
  return absl::OkStatus();
}

// NorMuon keeps one second-moment value per line along the longer dimension: per row when
// rows ≥ cols (a mean over each row), per column otherwise.
int64_t NormuonLength(int64_t rows, int64_t cols) { return std::max(rows, cols); }

class Muon final : public Optimizer {
 public:
  explicit Muon(GroupOptions options) : Optimizer(std::move(options)), ns_bound_(NsSingularValueBound(options_)) {}

  std::vector<std::string> SlotNames() const override {
    if (options_.moment2_method == Moment2Method::kNone) return {kMomentumSlot};
    return {kMomentumSlot, kMoment2Slot};
  }

  std::vector<int64_t> SlotShape(const ParamState& param, std::string_view slot) const override;

  bool SlotIsNonNegative(std::string_view slot) const override { return slot == kMoment2Slot; }

  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double grad_bound) const override;

  absl::Status CheckParameter(const ParamState& param) const override {
    return CheckMuonParameter(param, options_.num_heads);
  }

  absl::Status Step(Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) override;

  WorkspaceNeed LeastWorkspace(const Backend& backend, std::span<const ParamState* const> params) const override;

 private:
  double Scale(int64_t rows, int64_t cols) const;
  // Whether MuonEq's or Muon+'s normalization scales columns of a matrix stored as its own shape or
  // (`transposed`) as its transpose: they go through a transposed copy in kNormuonSlot.
  bool CopiesForLines(bool transposed) const {
    return ScalesColumns(OrderOf(options_.momentum_normalization, transposed)) ||
           ScalesColumns(OrderOf(options_.post_normalization, transposed));
  }
  // The line scratch of a batch of `floats` floats normalized in `order`: StepScratch's line buffers
  // (grown by Step) and, when columns are scaled, the kNormuonSlot copy (reserved by PlanBatches).
  static absl::StatusOr<LineScratch> LineScratchOf(Backend& backend, NsWorkspace& ws, size_t floats, LineOrder order);
  float DecayFactor(const StepHyper& hyper) const;
  void AppendMatrices(ParamState& p, const StepHyper& hyper, std::vector<MatrixJob>& jobs) const;
  // `input_sums`: backend memory for jobs.size() doubles, each job's Newton–Schulz input Σ U²
  // (telemetry), or null. `namo_grad_sums`: NAMO's raw-gradient sums of the batch's lines.
  absl::Status Orthogonalize(Backend& backend, const StepHyper& hyper, std::span<const MatrixJob> jobs, NsWorkspace& ws,
                             double* input_sums, const double* namo_grad_sums);
  // Whether a batch of rows × cols matrices goes through GramNewtonSchulz: ns_algorithm gram, or
  // auto where PreferGram says so with the backend's square weight.
  bool UsesGram(const Backend& backend, int64_t rows, int64_t cols) const;
  // Cuts each shape's jobs into batches of `per_batch[i].second` (in `batches`) and returns the
  // workspace floats per slot the step needs for them: NewtonSchulz's slots at the largest batch
  // of each, the gather buffer, NorMuon's copy and the column-block transpose (transposed_floats).
  std::vector<size_t> PlanBatches(const Backend& backend,
                                  std::span<const std::pair<const std::vector<MatrixJob>*, size_t>> per_batch,
                                  size_t transposed_floats, std::vector<std::span<const MatrixJob>>& batches) const;
  // `scratch`: StepScratch's line buffers, grown for this batch.
  absl::Status ReduceVariance(Backend& backend, std::span<const MatrixJob> jobs, float* work, NsWorkspace& ws,
                              StepScratch& scratch) const;
  // Column-blocked parameters: their U transposed in place (m × n → n × m, through workspace), so that
  // each column block is a contiguous row block.
  absl::Status TransposeInPlace(Backend& backend, std::span<ParamState* const> params, bool to_blocks,
                                NsWorkspace& ws) const;
  // W ← β·W − η·D over `count` elements of O at `o` for `job`: D = scale·O, or AdaMuon's
  // x/(√V + ε) with x = scale·O; with cautious decay the decay is per element.
  absl::Status ApplyUpdate(Backend& backend, const MatrixJob& job, float* o, size_t count);
  // ApplyUpdate on elements [0, count) of `job`'s region, unmeasured (its element-wise part: AdaMuon's
  // moment, the decay, the update).
  absl::Status ApplyUpdateRange(Backend& backend, const MatrixJob& job, float* o, size_t count);
  // Transposes a column-blocked parameter's O back and applies the update to all of it at once
  // (every block has the same shape, so one scale).
  absl::Status ApplyTransposed(Backend& backend, const StepHyper& hyper, ParamState& p, NsWorkspace& ws);
  // Telemetry: the orthogonality residual of a batch's output when it holds the matrix measured
  // this step (residual_job_), into residual_sum_.
  absl::Status Observe(Backend& backend, std::span<const MatrixJob> jobs, const float* work, NsWorkspace& ws);
  // Telemetry: backend memory in the step's pending sums (read back once, at the step's end) for
  // the Σ U² of each Newton–Schulz input of `batches`, in the order the batches run, followed by
  // the residual's two sums when residual_job_ is set (residual_sum_); reserved before the step
  // changes any state.
  absl::StatusOr<double*> ReserveTelemetrySums(Backend& backend, std::span<const std::span<const MatrixJob>> batches);

  const double ns_bound_;                    // NsSingularValueBound of this group's iteration
  const MatrixJob* residual_job_ = nullptr;  // the matrix whose residual this step measures
  double* residual_sum_ = nullptr;           // where its ‖G² − G‖² and ‖G‖² go (backend memory)
};

double Muon::Scale(int64_t rows, int64_t cols) const { return UpdateScale(options_, rows, cols); }

float Muon::DecayFactor(const StepHyper& hyper) const {
  switch (options_.weight_decay_mode) {
    case WeightDecayMode::kDecoupled:
      return static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);  // the unscaled η
    case WeightDecayMode::kIndependent:
      return static_cast<float>(1.0 - hyper.weight_decay);
    case WeightDecayMode::kL2:
      return 1.0f;  // folded into the gradient before momentum
    case WeightDecayMode::kCautious:
      return 1.0f;  // applied element by element with the update (CautiousUpdate)
  }
  return 1.0f;
}

std::vector<int64_t> Muon::SlotShape(const ParamState& param, std::string_view slot) const {
  if (slot == kMoment2Slot && IsNamo(options_.moment2_method)) {
    // One value per matrix (NAMO; Emerging-Optimizers' shape [1] for a lone matrix) or per column
    // of each (NAMO-D; the authors' [n]).
    int64_t length = 0;
    ForEachMatrix(
        param, [&](int64_t, int64_t, int64_t cols, bool) { length += NamoLines(options_.moment2_method, cols); },
        options_.num_heads);
    return {length};
  }
  if (slot != kMoment2Slot || options_.moment2_method != Moment2Method::kNormuon) return param.shape;
  const std::vector<int64_t>& s = param.shape;
  if (s.size() == 2 && !param.qkv.enabled() && !param.tp.enabled() && options_.num_heads == 1) {
    // One matrix: torch's keepdim shape, (rows, 1) or (1, cols), as Megatron-Core stores it.
    return s[0] >= s[1] ? std::vector<int64_t>{s[0], 1} : std::vector<int64_t>{1, s[1]};
  }
  int64_t length = 0;
  ForEachMatrix(
      param, [&](int64_t, int64_t rows, int64_t cols, bool) { length += NormuonLength(rows, cols); },
      options_.num_heads);
  return {length};
}

void Muon::AppendMatrices(ParamState& p, const StepHyper& hyper, std::vector<MatrixJob>& jobs) const {
  float* u = p.grad->data();
  StoredTensor* moment2 = options_.moment2_method == Moment2Method::kNone ? nullptr : p.Slot(kMoment2Slot);
  const float beta = DecayFactor(hyper);
  const float decay = options_.weight_decay_mode == WeightDecayMode::kCautious
                          ? static_cast<float>(hyper.lr * hyper.weight_decay)
                          : 0.0f;
  int64_t line = 0;  // NorMuon: where this matrix's lines start in the slot
  ForEachMatrix(
      p,
      [&](int64_t offset, int64_t rows, int64_t cols, bool transposed) {
        size_t m2 = 0;
        if (options_.moment2_method == Moment2Method::kAdamuon) m2 = static_cast<size_t>(offset);
        if (options_.moment2_method == Moment2Method::kNormuon) {
          m2 = static_cast<size_t>(line);
          line += NormuonLength(rows, cols);
        }
        if (IsNamo(options_.moment2_method)) {
          m2 = static_cast<size_t>(line);
          line += NamoLines(options_.moment2_method, cols);
        }
        // NorMuon's lines run along the longer side, per row of a square matrix: in the stored
        // transpose a row of the block is a column.
        const bool per_column = transposed ? rows >= cols : rows < cols;
        jobs.push_back(MatrixJob{u + offset, &p.master, static_cast<size_t>(offset), moment2, m2,
                                 transposed ? cols : rows, transposed ? rows : cols, hyper.lr, Scale(rows, cols), beta,
                                 decay, transposed, per_column});
        jobs.back().param = &p;
      },
      options_.num_heads);
}

// Momentum (kernels::MomentumElement) then W ← β·W − η·scale·O, where every singular value of O,
// and so every element, stays below NsSingularValueBound; the momentum's magnitude does not reach
// W, since Newton–Schulz normalizes its input.
StepBounds Muon::BoundStep(const StepHyper& hyper, const ParamState& param, double g) const {
  const double mu = hyper.momentum;
  const double m = SlotBound(param, kMomentumSlot);
  const double g_decayed = options_.weight_decay_mode == WeightDecayMode::kL2
                               ? (g + hyper.weight_decay * param.master_bound) * kBoundRounding
                               : g;
  double m_next, u;
  if (options_.momentum_style == kernels::MomentumStyle::kEma) {
    m_next = (mu * m + (1 - mu) * g_decayed) * kBoundRounding;
    u = options_.nesterov ? (g_decayed + mu * (m_next + g_decayed)) * kBoundRounding : m_next;
  } else {
    m_next = (mu * m + g_decayed) * kBoundRounding;
    u = options_.nesterov ? (g_decayed + mu * m_next) * kBoundRounding : m_next;
  }
  double scale = 0;
  ForEachMatrix(
      param, [&](int64_t, int64_t rows, int64_t cols, bool) { scale = std::max(scale, Scale(rows, cols)); },
      options_.num_heads);
  // The largest element of the update W moves along, over η: scale·O for plain Muon (|O_ij| ≤ σ_max).
  // Muon+'s lines at unit norm hold elements below 1.
  double step =
      scale * (options_.post_normalization != PostNormalization::kNone ? std::max(ns_bound_, 1.0) : ns_bound_);
  double moment2 = 0, moment2_peak = 0;
  const double v = SlotBound(param, kMoment2Slot);
  int64_t min_dim = 0, most_rows = 0, most_elements = 0;
  ForEachMatrix(
      param,
      [&](int64_t, int64_t rows, int64_t cols, bool) {
        min_dim = std::max(min_dim, std::min(rows, cols));
        most_rows = std::max(most_rows, rows);
        most_elements = std::max(most_elements, rows * cols);
      },
      options_.num_heads);
  switch (options_.moment2_method) {
    case Moment2Method::kNone:
      break;
    case Moment2Method::kAdamuon: {
      // v' ≥ (1−β2)·x², so |x/(√v' + ε)| ≤ 1/√(1−β2).
      const double x2 = step * step * kBoundRounding;
      moment2 = std::max(v, x2) * kBoundRounding;
      moment2_peak = x2;
      step = kBoundRounding / std::sqrt(1.0 - options_.beta2);
      break;
    }
    case Moment2Method::kNormuon:
      // A line's mean of O² is at most σ_max²; the result keeps ‖O‖_F ≤ √min(m, n)·σ_max, which
      // bounds every element (the intermediate O·s is never stored: s carries the norm ratio).
      moment2 = std::max(v, ns_bound_ * ns_bound_) * kBoundRounding;
      moment2_peak = moment2;
      step *= std::sqrt(static_cast<double>(min_dim)) * kBoundRounding;
      break;
    case Moment2Method::kNamo:
    case Moment2Method::kNamoD: {
      // v' ≤ max(v, Σ G²) over the largest line. A step size is √ΣM̃²/(√v' + ε) ≤ √n·u/ε (NAMO, n
      // elements of a matrix) or bias·√rows·u/√ε (NAMO-D, bias ≤ 1/(1 − β1)); the clamp keeps each
      // between the smallest and the largest of them. Loose where v' is small, as it must be for a
      // state restored from anywhere.
      const bool diagonal = options_.moment2_method == Moment2Method::kNamoD;
      const double line = static_cast<double>(diagonal ? most_rows : most_elements);
      moment2 = std::max(v, line * g * g) * kBoundRounding;
      moment2_peak = moment2;
      const double size = std::sqrt(line) * u;
      const double alpha = diagonal ? size / std::sqrt(options_.eps) / std::max(1.0 - mu, 1e-300) : size / options_.eps;
      step *= alpha * kBoundRounding;
      break;
    }
  }
  StepBounds out;
  out.master =
      (std::abs(static_cast<double>(DecayFactor(hyper))) * param.master_bound + hyper.lr * step) * kBoundRounding;
  out.slots = {m_next};
  if (options_.moment2_method != Moment2Method::kNone) out.slots.push_back(moment2);
  // MuonEq's lines at unit norm: elements below 1 whatever the momentum's size.
  const double normalized = options_.momentum_normalization != MomentumNormalization::kNone ? 1.0 : 0.0;
  // Turbo-Muon's AOL forms the Gram matrix of Newton–Schulz's input itself, unscaled.
  double gram = 0;
  if (options_.ns_preconditioner == NsPreconditioner::kAol) {
    const double input = normalized > 0 ? 1.0 : u;
    ForEachMatrix(
        param,
        [&](int64_t, int64_t rows, int64_t cols, bool) { gram = std::max(gram, AolGramBound(rows, cols, input)); },
        options_.num_heads);
  }
  out.peak = std::max({out.master, m_next, u, g_decayed + m, moment2_peak, step, normalized, gram});
  return out;
}

// Matrices already back to back in one parameter's buffer (its experts, a lone matrix) are
// orthogonalized where they lie; others are gathered into workspace first. Two parameters' buffers
// are separate allocations even when one happens to end where the other begins (a device allocator
// often places them so), and one copy or kernel may not span two allocations.
bool Contiguous(std::span<const MatrixJob> jobs) {
  const size_t mat = static_cast<size_t>(jobs[0].rows * jobs[0].cols);
  for (size_t i = 1; i < jobs.size(); ++i) {
    if (jobs[i].param != jobs[0].param || jobs[i].update != jobs[0].update + i * mat) return false;
  }
  return true;
}

bool Muon::UsesGram(const Backend& backend, int64_t rows, int64_t cols) const {
  if (options_.ns_preconditioner == NsPreconditioner::kAol) return false;  // AOL's first step is standard's
  switch (options_.ns_algorithm) {
    case NsAlgorithm::kStandard:
      return false;
    case NsAlgorithm::kGram:
      return true;
    case NsAlgorithm::kAuto:
      return PreferGram(rows, cols, options_.ns_schedule, options_.ns_steps, options_.ns_schedule.gram_restarts,
                        backend.Name() == "cpu" ? kCpuSquareWeight : kCudaSquareWeight);
  }
  return false;
}

std::vector<size_t> Muon::PlanBatches(const Backend& backend,
                                      std::span<const std::pair<const std::vector<MatrixJob>*, size_t>> per_batch,
                                      size_t transposed_floats,
                                      std::vector<std::span<const MatrixJob>>& batches) const {
  batches.clear();
  std::vector<size_t> need(kTransposeSlot + 1, 0);
  for (const auto& [jobs, size] : per_batch) {
    const int64_t rows = jobs->front().rows, cols = jobs->front().cols;
    const size_t mat = static_cast<size_t>(rows * cols);
    const bool gram = UsesGram(backend, rows, cols);
    for (size_t start = 0; start < jobs->size(); start += size) {
      const std::span<const MatrixJob> batch = std::span(*jobs).subspan(start, std::min(size, jobs->size() - start));
      batches.push_back(batch);
      const auto ns = NsSlotFloats(rows, cols, static_cast<int64_t>(batch.size()), NsUseOf(backend, options_, gram));
      for (size_t slot = 0; slot < ns.size(); ++slot) need[slot] = std::max(need[slot], ns[slot]);
      if (!Contiguous(batch))
        need[NsWorkspace::kFirstFreeSlot] = std::max(need[NsWorkspace::kFirstFreeSlot], batch.size() * mat);
      if ((options_.moment2_method == Moment2Method::kNormuon && batch[0].lines_per_column) ||
          CopiesForLines(batch[0].deferred) || NamoCopies(options_.moment2_method, batch[0].deferred)) {
        // NorMuon's copy of wide matrices, or the transposed copy that scales columns.
        need[kNormuonSlot] = std::max(need[kNormuonSlot], batch.size() * mat);
      }
    }
  }
  need[kTransposeSlot] = transposed_floats;
  return need;
}

// PlanBatches with every batch one matrix, from the shapes alone: a lone matrix is orthogonalized
// where it lies, so no gather buffer.
Optimizer::WorkspaceNeed Muon::LeastWorkspace(const Backend& backend, std::span<const ParamState* const> params) const {
  std::vector<size_t> need(kTransposeSlot + 1, 0);
  WorkspaceNeed out;
  for (const ParamState* p : params) {
    if (!CheckParameter(*p).ok()) continue;  // refused when the session is made
    std::vector<size_t> own(need.size(), 0);
    ForEachMatrix(
        *p,
        [&](int64_t, int64_t rows, int64_t cols, bool transposed) {
          const int64_t r = transposed ? cols : rows, c = transposed ? rows : cols;  // as it lies in the buffer
          const auto ns = NsSlotFloats(r, c, 1, NsUseOf(backend, options_, UsesGram(backend, r, c)));
          for (size_t slot = 0; slot < ns.size(); ++slot) own[slot] = std::max(own[slot], ns[slot]);
          const bool per_column = transposed ? rows >= cols : rows < cols;
          if ((options_.moment2_method == Moment2Method::kNormuon && per_column) || CopiesForLines(transposed) ||
              NamoCopies(options_.moment2_method, transposed)) {
            own[kNormuonSlot] = std::max(own[kNormuonSlot], static_cast<size_t>(rows * cols));
          }
        },
        options_.num_heads);
    if (WorksTransposed(*p)) own[kTransposeSlot] = static_cast<size_t>(p->numel);
    size_t own_total = 0;
    for (size_t slot = 0; slot < need.size(); ++slot) {
      need[slot] = std::max(need[slot], own[slot]);
      own_total += own[slot];
    }
    if (out.largest == nullptr || own_total > out.largest_floats) {
      out.largest = p;
      out.largest_floats = own_total;
    }
  }
  for (size_t n : need) out.floats += n;
  return out;
}

// Orthogonalizes one batch of same-shape jobs and applies W ← β·W − η·scale·O to each.
absl::Status Muon::Orthogonalize(Backend& backend, const StepHyper& hyper, std::span<const MatrixJob> jobs,
                                 NsWorkspace& ws, double* input_sums, const double* namo_grad_sums) {
  const int64_t rows = jobs[0].rows, cols = jobs[0].cols;
  const size_t mat = static_cast<size_t>(rows * cols);
  const size_t batch = jobs.size();
  float* work = jobs[0].update;
  if (!Contiguous(jobs)) {
    MUOND_ASSIGN_OR_RETURN(work, ws.Get(backend, NsWorkspace::kFirstFreeSlot, mat * batch));
    for (size_t i = 0; i < batch; ++i) {
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(jobs[i].update, work + i * mat, mat));
    }
  }
  const bool transposed = jobs[0].deferred;
  const NamoBatch shape{
      .stored_rows = rows, .stored_cols = cols, .batch = static_cast<int64_t>(batch), .transposed = transposed};
  if (IsNamo(options_.moment2_method)) {
    // ‖M̃‖ of each line, before MuonEq's normalization changes it.
    float* copy = nullptr;
    if (NamoCopies(options_.moment2_method, transposed)) {
      MUOND_ASSIGN_OR_RETURN(copy, ws.Get(backend, kNormuonSlot, mat * batch));
    }
    MUOND_RETURN_IF_ERROR(
        NamoLineSums(backend, options_.moment2_method, work, shape, copy,
                     reinterpret_cast<double*>(backend.Shared<StepScratch>().namo_update_sums->data())));
  }
  if (const LineOrder before = OrderOf(options_.momentum_normalization, transposed); before != LineOrder::kNone) {
    MUOND_ASSIGN_OR_RETURN(const LineScratch lines, LineScratchOf(backend, ws, mat * batch, before));
    MUOND_RETURN_IF_ERROR(NormalizeLines(backend, before, kMomentumNormalizationEps, work, rows, cols,
                                         static_cast<int64_t>(batch), lines));
  }
  if (UsesGram(backend, rows, cols)) {
    MUOND_RETURN_IF_ERROR(GramNewtonSchulz(backend, options_.ns_schedule, options_.ns_steps,
                                           options_.ns_schedule.gram_restarts, options_.ns_eps, options_.ns_norm_safety,
                                           options_.matmul_precision, work, work, rows, cols,
                                           static_cast<int64_t>(batch), ws, input_sums));
  } else {
    MUOND_RETURN_IF_ERROR(NewtonSchulz(backend, options_.ns_schedule, options_.ns_steps, options_.ns_eps,
                                       options_.ns_norm_safety, options_.matmul_precision, work, work, rows, cols,
                                       static_cast<int64_t>(batch), ws, input_sums, options_.ns_preconditioner,
                                       transposed));
  }
  if (telemetry_ != nullptr) MUOND_RETURN_IF_ERROR(Observe(backend, jobs, work, ws));
  if (const LineOrder after = OrderOf(options_.post_normalization, transposed); after != LineOrder::kNone) {
    MUOND_ASSIGN_OR_RETURN(const LineScratch lines, LineScratchOf(backend, ws, mat * batch, after));
    MUOND_RETURN_IF_ERROR(
        NormalizeLines(backend, after, kPostNormalizationEps, work, rows, cols, static_cast<int64_t>(batch), lines));
  }
  if (options_.moment2_method == Moment2Method::kNormuon) {
    MUOND_RETURN_IF_ERROR(ReduceVariance(backend, jobs, work, ws, backend.Shared<StepScratch>()));
  }
  if (IsNamo(options_.moment2_method)) {
    MUOND_RETURN_IF_ERROR(ApplyNamo(backend, options_, hyper, jobs, work, ws, namo_grad_sums));
  }
  if (jobs[0].deferred) {
    // Column blocks: O goes back where the block's U was; ApplyTransposed updates the parameter.
    if (work != jobs[0].update) {
      for (size_t i = 0; i < batch; ++i)
        MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(work + i * mat, jobs[i].update, mat));
    }
    return absl::OkStatus();
  }
  for (size_t i = 0; i < batch; ++i) MUOND_RETURN_IF_ERROR(ApplyUpdate(backend, jobs[i], work + i * mat, mat));
  return absl::OkStatus();
}

absl::StatusOr<double*> Muon::ReserveTelemetrySums(Backend& backend,
                                                   std::span<const std::span<const MatrixJob>> batches) {
  StepTelemetry* telemetry = telemetry_;
  const bool residual = residual_job_ != nullptr;
  // Matrices whose gradient is all zero this step: their momentum only decays.
  std::vector<bool> idle;
  for (std::span<const MatrixJob> batch : batches) {
    for (const MatrixJob& job : batch) idle.push_back(job.param != nullptr && job.param->grad_is_zero);
  }
  const size_t matrices = idle.size();
  MUOND_ASSIGN_OR_RETURN(double* sums, telemetry->pending.Reserve(backend, matrices + (residual ? 2 : 0),
                                                                  [telemetry, idle = std::move(idle),
                                                                   residual](std::span<const double> values) {
                                                                    telemetry->AddNsInputs(values, idle, residual);
                                                                  }));
  residual_sum_ = residual ? sums + matrices : nullptr;
  return sums;
}

absl::Status Muon::Observe(Backend& backend, std::span<const MatrixJob> jobs, const float* work, NsWorkspace& ws) {
  size_t i = 0;
  while (i < jobs.size() && &jobs[i] != residual_job_) ++i;
  // Measured in another batch, or not this step.
  if (i == jobs.size() || residual_sum_ == nullptr) return absl::OkStatus();
  const size_t mat = static_cast<size_t>(jobs[0].rows * jobs[0].cols);
  MUOND_RETURN_IF_ERROR(
      OrthogonalitySumSquares(backend, work + i * mat, jobs[0].rows, jobs[0].cols, ws, residual_sum_));
  telemetry_->residual_parameter = residual_job_->param->name;
  telemetry_->residual_offset = residual_job_->master_offset;
  return absl::OkStatus();
}

absl::Status Muon::ApplyUpdate(Backend& backend, const MatrixJob& job, float* o, size_t count) {
  return UpdateMeter::Measure(
      backend, job.master->Ref(job.master_offset), count,
      [&](size_t offset, size_t n, double*) {
        MatrixJob part = job;
        part.master_offset += offset;
        if (options_.moment2_method == Moment2Method::kAdamuon) part.moment2_offset += offset;
        return ApplyUpdateRange(backend, part, o + offset, n);
      },
      telemetry_, /*in_pass=*/false);  // several kernels apply Muon's update: measured around them
}

absl::Status Muon::ApplyUpdateRange(Backend& backend, const MatrixJob& job, float* o, size_t count) {
  double step = job.lr * job.scale;
  if (options_.moment2_method == Moment2Method::kAdamuon) {
    // Megatron-Core's adamuon takes the scaled update: the scale moves into the moment.
    const kernels::AdamuonArgs args{.scale = static_cast<float>(job.scale),
                                    .one_minus_beta2 = static_cast<float>(1.0 - options_.beta2),
                                    .eps = static_cast<float>(options_.eps)};
    MUOND_RETURN_IF_ERROR(backend.Adamuon(args, job.moment2->Ref(job.moment2_offset), o, count));
    step = job.lr;
  }
  const kernels::StoredRef w = job.master->Ref(job.master_offset);
  if (options_.weight_decay_mode == WeightDecayMode::kCautious) {
    const kernels::CautiousArgs args{.alpha = static_cast<float>(-step), .decay = job.decay};
    return backend.CautiousUpdate(args, o, w, count);
  }
  return backend.Axpby(static_cast<float>(-step), o, job.beta, w, count);
}

// NorMuon's variance reduction (modded-nanogpt's _apply_normuon_variance_reduction) on each
// orthogonalized O of the batch, in place: per line (row when rows ≥ cols, else column)
// v̄ = mean(O²) over the line; m2 ← lerp(m2, v̄, 1−β2); s = 1/√max(m2, ε); O ← O·s·‖O‖_F/‖O·s‖_F, so
// the update keeps O's Frobenius norm. An all-zero O (a zero gradient and momentum) stays zero
// rather than 0/0. The lines' sums of squares, the per-line values (Backend::NormuonScales, the
// norm ratio folded into the line scales, so O is scaled once) and the scaling all stay in backend
// memory: on the CUDA backend nothing here waits for the device.
absl::StatusOr<LineScratch> Muon::LineScratchOf(Backend& backend, NsWorkspace& ws, size_t floats, LineOrder order) {
  StepScratch& scratch = backend.Shared<StepScratch>();
  if (scratch.line_sums == nullptr || scratch.line_scales == nullptr) {
    return absl::InternalError("muon: the line scratch was not grown before the step");
  }
  LineScratch out{.sums = reinterpret_cast<double*>(scratch.line_sums->data()), .scales = scratch.line_scales->data()};
  if (ScalesColumns(order)) {
    MUOND_ASSIGN_OR_RETURN(out.copy, ws.Get(backend, kNormuonSlot, floats));
  }
  return out;
}

absl::Status Muon::ReduceVariance(Backend& backend, std::span<const MatrixJob> jobs, float* work, NsWorkspace& ws,
                                  StepScratch& scratch) const {
  const int64_t rows = jobs[0].rows, cols = jobs[0].cols;
  const size_t mat = static_cast<size_t>(rows * cols), batch = jobs.size();
  const bool per_column = jobs[0].lines_per_column;
  const size_t length = static_cast<size_t>(NormuonLength(rows, cols));
  const size_t count = mat / length;  // elements per line
  float* lines = work;
  if (per_column) {
    MUOND_ASSIGN_OR_RETURN(lines, ws.Get(backend, kNormuonSlot, mat * batch));
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(work, lines, rows, cols, static_cast<int64_t>(batch)));
  }
  double* sums = reinterpret_cast<double*>(scratch.line_sums->data());
  float* scales = scratch.line_scales->data();
  MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(lines, count, length * batch, sums));
  const kernels::Backend::NormuonArgs args{
      .count = count, .weight = static_cast<float>(1.0 - options_.beta2), .eps = options_.eps};
  for (size_t i = 0; i < batch; ++i) {
    // Rounded to the slot's format on the way (exp_avg_sq_dtype); the scales use the fp32 values.
    MUOND_RETURN_IF_ERROR(backend.NormuonScales(args, sums + i * length, jobs[i].moment2->Ref(jobs[i].moment2_offset),
                                                scales + i * length, length));
  }
  MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(lines, count, length * batch, scales));
  if (per_column) {
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(lines, work, cols, rows, static_cast<int64_t>(batch)));
  }
  return absl::OkStatus();
}

absl::Status Muon::TransposeInPlace(Backend& backend, std::span<ParamState* const> params, bool to_blocks,
                                    NsWorkspace& ws) const {
  for (ParamState* p : params) {
    const size_t n = static_cast<size_t>(p->numel);
    MUOND_ASSIGN_OR_RETURN(float* scratch, ws.Get(backend, kTransposeSlot, n));
    const int64_t rows = to_blocks ? p->shape[0] : p->shape[1], cols = to_blocks ? p->shape[1] : p->shape[0];
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(p->grad->data(), scratch, rows, cols, 1));
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(scratch, p->grad->data(), n));
  }
  return absl::OkStatus();
}

absl::Status Muon::ApplyTransposed(Backend& backend, const StepHyper& hyper, ParamState& p, NsWorkspace& ws) {
  ParamState* const one[] = {&p};
  MUOND_RETURN_IF_ERROR(TransposeInPlace(backend, one, /*to_blocks=*/false, ws));
  // Every block has the same shape, so the whole parameter is one job with the blocks' scale.
  const MatrixJob whole{.update = p.grad->data(),
                        .master = &p.master,
                        .master_offset = 0,
                        .moment2 = options_.moment2_method == Moment2Method::kAdamuon ? p.Slot(kMoment2Slot) : nullptr,
                        .moment2_offset = 0,
                        .rows = p.shape[0],
                        .cols = p.shape[1],
                        .lr = hyper.lr,
                        .scale = Scale(p.shape[0], p.shape[1] / p.tp.blocks),
                        .beta = DecayFactor(hyper),
                        .decay = options_.weight_decay_mode == WeightDecayMode::kCautious
                                     ? static_cast<float>(hyper.lr * hyper.weight_decay)
                                     : 0.0f};
  return ApplyUpdate(backend, whole, whole.update, static_cast<size_t>(p.numel));
}

// The matrix whose orthogonality residual a step measures: the group's matrices in turn, in the
// order the step orthogonalizes them (by shape, then parameter order), the k-th at the group's step
// k (the step count of its first parameter with a gradient, kept in checkpoints). None when that
// matrix's gradient is all zero: its momentum only decays, and Newton–Schulz rightly stops
// normalizing it once it is under ns_eps.
template <typename ByShape>
const MatrixJob* ResidualJob(const ByShape& by_shape, std::span<ParamState* const> params) {
  size_t total = 0;
  for (const auto& entry : by_shape) total += entry.second.size();
  const ParamState* first = nullptr;
  for (const ParamState* p : params) {
    if (p->has_grad && first == nullptr) first = p;
  }
  if (total == 0 || first == nullptr) return nullptr;
  size_t k = static_cast<size_t>(first->step_count) % total;
  for (const auto& entry : by_shape) {
    if (k < entry.second.size()) return entry.second[k].param->grad_is_zero ? nullptr : &entry.second[k];
    k -= entry.second.size();
  }
  return nullptr;
}

absl::Status Muon::Step(Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) {
  // Check everything first so that a rejected step leaves every parameter untouched.
  for (ParamState* p : params) {
    if (!p->has_grad) continue;
    MUOND_RETURN_IF_ERROR(CheckParameter(*p));
    MUOND_RETURN_IF_ERROR(CheckStepInputs(*p));
  }
  // Plan: same-shape matrices across parameters, keyed by (rows, cols) (std::map keeps the order
  // stable), cut into batches of at most kMaxBatchFloats.
  // Column blocks (deferred) batch apart: they are applied to their parameter afterwards.
  std::map<std::tuple<int64_t, int64_t, bool, bool>, std::vector<MatrixJob>> by_shape;
  std::vector<ParamState*> transposed;  // column-blocked parameters, worked on transposed
  size_t transposed_floats = 0;
  for (ParamState* p : params) {
    if (!p->has_grad) continue;
    std::vector<MatrixJob> jobs;
    AppendMatrices(*p, hyper, jobs);
    for (const MatrixJob& job : jobs) by_shape[{job.rows, job.cols, job.deferred, job.lines_per_column}].push_back(job);
    if (WorksTransposed(*p)) {
      transposed.push_back(p);
      transposed_floats = std::max(transposed_floats, static_cast<size_t>(p->numel));
    }
  }
  residual_job_ = telemetry_ != nullptr && telemetry_->measure ? ResidualJob(by_shape, params) : nullptr;
  residual_sum_ = nullptr;
  // Newton-Schulz's workspace is held from here to the last batch, so what is reserved below is
  // there when the batches run.
  SharedNsWorkspace& shared = BackendNsWorkspace(backend);
  std::lock_guard<std::mutex> lock(shared.mu);
  NsWorkspace& ws = shared.ws;
  // Batches of at most kMaxBatchFloats per matrix buffer; while the scratch of the whole step
  // (every slot at its largest batch's size) exceeds the workspace bound, the shape with the largest
  // batches has them halved. Each matrix is computed on its own, so this changes no result.
  std::vector<std::pair<const std::vector<MatrixJob>*, size_t>> per_batch;
  for (const auto& [key, jobs] : by_shape) {
    const size_t mat = static_cast<size_t>(std::get<0>(key) * std::get<1>(key));
    per_batch.emplace_back(&jobs,
                           std::min(jobs.size(), std::max<size_t>(1, kMaxBatchFloats / std::max<size_t>(mat, 1))));
  }
  std::vector<std::span<const MatrixJob>> batches;
  std::vector<size_t> need;
  for (;;) {
    need = PlanBatches(backend, per_batch, transposed_floats, batches);
    size_t total = 0;
    for (size_t n : need) total += n;
    if (ws.limit() == 0 || total <= ws.limit()) break;
    std::pair<const std::vector<MatrixJob>*, size_t>* largest = nullptr;
    size_t largest_floats = 0;
    for (auto& entry : per_batch) {
      const MatrixJob& job = entry.first->front();
      const size_t floats = entry.second * static_cast<size_t>(job.rows * job.cols);
      if (entry.second > 1 && floats > largest_floats) {
        largest = &entry;
        largest_floats = floats;
      }
    }
    if (largest == nullptr) break;  // one matrix per batch already: Fit refuses the step
    largest->second = (largest->second + 1) / 2;
  }
  // Allocate all scratch before touching any state, so running out of memory (or of the bound)
  // rejects the step cleanly instead of leaving momentum advanced and weights not.
  MUOND_RETURN_IF_ERROR(ws.Fit(backend, need));
  size_t matrices = 0;
  for (std::span<const MatrixJob> batch : batches) matrices += batch.size();
  StepScratch& scratch = backend.Shared<StepScratch>();
  double* input_sums = nullptr;
  if (telemetry_ != nullptr && matrices > 0) {
    MUOND_ASSIGN_OR_RETURN(input_sums, ReserveTelemetrySums(backend, batches));
  }
  const bool normalizes_lines = options_.momentum_normalization != MomentumNormalization::kNone ||
                                options_.post_normalization != PostNormalization::kNone;
  if (options_.moment2_method == Moment2Method::kNormuon || normalizes_lines) {
    size_t lines = 0;
    for (std::span<const MatrixJob> batch : batches) {
      const int64_t rows = batch[0].rows, cols = batch[0].cols, count = static_cast<int64_t>(batch.size());
      lines = std::max(lines, normalizes_lines ? LineCount(rows, cols, count)
                                               : static_cast<size_t>(NormuonLength(rows, cols)) * batch.size());
    }
    MUOND_RETURN_IF_ERROR(Grow(backend, scratch.line_sums, 2 * lines));
    MUOND_RETURN_IF_ERROR(Grow(backend, scratch.line_scales, lines));
  }
  double* namo_grad_sums = nullptr;
  if (IsNamo(options_.moment2_method)) {
    size_t total = 0, most = 0;
    for (std::span<const MatrixJob> batch : batches) {
      const NamoBatch shape{.stored_rows = batch[0].rows,
                            .stored_cols = batch[0].cols,
                            .batch = static_cast<int64_t>(batch.size()),
                            .transposed = batch[0].deferred};
      const size_t lines = static_cast<size_t>(shape.Lines(options_.moment2_method)) * batch.size();
      total += lines;
      most = std::max(most, lines);
    }
    MUOND_RETURN_IF_ERROR(Grow(backend, scratch.namo_grad_sums, 2 * std::max<size_t>(total, 1)));
    MUOND_RETURN_IF_ERROR(Grow(backend, scratch.namo_update_sums, 2 * std::max<size_t>(most, 1)));
    MUOND_RETURN_IF_ERROR(Grow(backend, scratch.namo_scales, std::max<size_t>(most, 1)));
    namo_grad_sums = reinterpret_cast<double*>(scratch.namo_grad_sums->data());
    MUOND_RETURN_IF_ERROR(NamoGradientSums(backend, options_.moment2_method, params, batches, ws, namo_grad_sums));
  }

  const kernels::MomentumArgs momentum{
      .beta = static_cast<float>(hyper.momentum), .style = options_.momentum_style, .nesterov = options_.nesterov};
  for (ParamState* p : params) {
    if (!p->has_grad) continue;
    const size_t n = static_cast<size_t>(p->numel);
    float* g = p->grad->data();
    if (options_.weight_decay_mode == WeightDecayMode::kL2 && hyper.weight_decay != 0) {
      MUOND_RETURN_IF_ERROR(backend.Axpby(static_cast<float>(hyper.weight_decay), p->master.Ref(), 1.0f, g, n));
    }
    // U overwrites the gradient: it is scratch from here on.
    MUOND_RETURN_IF_ERROR(backend.Momentum(momentum, p->Slot(kMomentumSlot)->Ref(), g, g, n));
  }
  MUOND_RETURN_IF_ERROR(TransposeInPlace(backend, transposed, /*to_blocks=*/true, ws));
  size_t done = 0, namo_done = 0;
  for (std::span<const MatrixJob> batch : batches) {
    MUOND_RETURN_IF_ERROR(Orthogonalize(backend, hyper, batch, ws, input_sums != nullptr ? input_sums + done : nullptr,
                                        namo_grad_sums != nullptr ? namo_grad_sums + namo_done : nullptr));
    done += batch.size();
    if (namo_grad_sums != nullptr) {
      namo_done +=
          static_cast<size_t>(NamoLines(options_.moment2_method, batch[0].deferred ? batch[0].rows : batch[0].cols)) *
          batch.size();
    }
  }
  for (ParamState* p : transposed) MUOND_RETURN_IF_ERROR(ApplyTransposed(backend, hyper, *p, ws));
  for (ParamState* p : params) {
    if (p->has_grad) ++p->step_count;
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Optimizer> NewMuon(const GroupOptions& options) { return std::make_unique<Muon>(options); }

}  // namespace muond::optim
