// Dion2 (docs/algorithms.md, Dion2): per matrix, the momentum accumulates the gradient; the
// ⌈fraction·lines⌉ rows or columns of largest L1 norm are orthogonalized together and applied, and
// their momentum lines decay by dion2_ef_decay (error feedback); the other lines keep theirs whole
// for later steps. Written from microsoft/dion's dion/dion2.py (single device, flatten=False).
// Telemetry as Muon's (docs/algorithms.md, Telemetry): the norm of each matrix's chosen lines, the
// input Newton–Schulz normalizes, and one output's orthogonality residual a step, in turn.
//
// Thread-safety: as every Optimizer, one step at a time; the Newton–Schulz workspace is the
// backend's shared one, held for the step.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer_impls.h"
#include "kernels/optim/step_telemetry.h"

namespace muond::optim {
namespace {

using kernels::Backend;

// Workspace past Newton–Schulz's slots: the chosen lines (orthogonalized in place), and the
// transposed copy through which columns are chosen.
constexpr int kChosenSlot = NsWorkspace::kFirstFreeSlot;
constexpr int kLinesSlot = NsWorkspace::kFirstFreeSlot + 1;

// The matrices of a parameter: a 3-D stack is its experts, back to back; anything else one
// (rows, rest) matrix, a filter flattened as Muon's.
struct Matrices {
  int64_t rows = 0, cols = 0, batch = 1;
};
Matrices MatricesOf(const ParamState& p) {
  if (p.shape.size() == 3) return {p.shape[1], p.shape[2], p.shape[0]};
  return {p.shape[0], p.shape[0] > 0 ? p.numel / p.shape[0] : 0, 1};
}

// The lines one matrix chooses from, as rows of a row-major lines × length matrix (the matrix
// itself, or its transpose when columns are chosen).
struct Lines {
  bool columns = false;
  int64_t lines = 0, length = 0, chosen = 0;
};

class Dion2 final : public Optimizer {
 public:
  explicit Dion2(GroupOptions options) : Optimizer(std::move(options)), ns_bound_(NsSingularValueBound(options_)) {}

  std::vector<std::string> SlotNames() const override { return {kMomentumSlot}; }

  absl::Status CheckParameter(const ParamState& param) const override {
    if (param.shape.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat("dion2 needs a parameter with at least 2 dimensions, got shape [",
                                                     absl::StrJoin(param.shape, ", "), "]"));
    }
    if (param.qkv.enabled()) return absl::InvalidArgumentError("qkv_split applies to muon only, not to dion2");
    if (param.tp.enabled()) return absl::InvalidArgumentError("tp_blocks applies to muon only, not to dion2");
    return absl::OkStatus();
  }

  // M′ = M + G; the update's elements are scale·O's, below scale·σ (NsSingularValueBound); the
  // lines not chosen move by the decay only.
  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double g) const override {
    const double m_next = (SlotBound(param, kMomentumSlot) + g) * kBoundRounding;
    const Matrices mat = MatricesOf(param);
    const double step = UpdateScale(options_, mat.rows, mat.cols) * ns_bound_ * kBoundRounding;
    StepBounds out;
    out.master =
        (std::abs(static_cast<double>(DecayFactor(hyper))) * param.master_bound + hyper.lr * step) * kBoundRounding;
    out.slots = {m_next};
    // Turbo-Muon's AOL forms the Gram matrix of the chosen lines of M′ itself, unscaled.
    const double gram =
        options_.ns_preconditioner == NsPreconditioner::kAol ? AolGramBound(mat.rows, mat.cols, m_next) : 0.0;
    out.peak = std::max({out.master, m_next, step, gram});
    return out;
  }

  WorkspaceNeed LeastWorkspace(const Backend& backend, std::span<const ParamState* const> params) const override {
    WorkspaceNeed out;
    std::vector<size_t> need(kLinesSlot + 1, 0);
    for (const ParamState* p : params) {
      if (!CheckParameter(*p).ok()) continue;
      const std::vector<size_t> own = Need(backend, *p);
      size_t total = 0;
      for (size_t s = 0; s < need.size(); ++s) {
        need[s] = std::max(need[s], own[s]);
        total += own[s];
      }
      if (out.largest == nullptr || total > out.largest_floats) {
        out.largest = p;
        out.largest_floats = total;
      }
    }
    (void)backend;
    for (size_t n : need) out.floats += n;
    return out;
  }

  absl::Status Step(Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) override {
    std::vector<size_t> need(kLinesSlot + 1, 0);
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      MUOND_RETURN_IF_ERROR(CheckParameter(*p));
      MUOND_RETURN_IF_ERROR(CheckStepInputs(*p));
      const std::vector<size_t> own = Need(backend, *p);
      for (size_t s = 0; s < need.size(); ++s) need[s] = std::max(need[s], own[s]);
    }
    SharedNsWorkspace& shared = BackendNsWorkspace(backend);
    std::lock_guard<std::mutex> lock(shared.mu);
    // All scratch before any state changes, so that running out of memory rejects the step cleanly.
    MUOND_RETURN_IF_ERROR(shared.ws.Fit(backend, need));
    MUOND_ASSIGN_OR_RETURN(Measured measured, ReserveTelemetry(backend, params));
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      MUOND_RETURN_IF_ERROR(StepParameter(backend, hyper, *p, shared.ws, measured));
      // As ReserveTelemetry counted them: the matrices of parameters with elements.
      if (measured.input_sums != nullptr && p->numel > 0) measured.input_sums += MatricesOf(*p).batch;
      ++p->step_count;
    }
    return absl::OkStatus();
  }

 private:
  Lines LinesOf(const Matrices& mat) const {
    bool columns = false;
    switch (options_.dion2_select) {
      case Dion2Select::kAuto:
        columns = mat.rows > mat.cols;  // dion: the rows when rows ≤ cols
        break;
      case Dion2Select::kRows:
        break;
      case Dion2Select::kCols:
        columns = true;
        break;
    }
    Lines out{.columns = columns, .lines = columns ? mat.cols : mat.rows, .length = columns ? mat.rows : mat.cols};
    const double wanted = std::ceil(options_.dion2_fraction * static_cast<double>(out.lines));
    out.chosen = std::clamp<int64_t>(static_cast<int64_t>(wanted), 1, std::max<int64_t>(out.lines, 1));
    return out;
  }

  // Workspace floats per slot for one parameter: Newton–Schulz on its chosen lines, the chosen
  // lines, and the transposed copy when columns are chosen.
  std::vector<size_t> Need(const Backend& backend, const ParamState& p) const {
    std::vector<size_t> need(kLinesSlot + 1, 0);
    const Matrices mat = MatricesOf(p);
    if (p.numel == 0 || mat.cols == 0) return need;
    const Lines l = LinesOf(mat);
    const auto ns = NsSlotFloats(l.chosen, l.length, mat.batch, NsUseOf(backend, options_, /*gram=*/false));
    for (size_t s = 0; s < ns.size(); ++s) need[s] = ns[s];
    need[kChosenSlot] = static_cast<size_t>(l.chosen * l.length * mat.batch);
    if (l.columns) need[kLinesSlot] = static_cast<size_t>(p.numel);
    return need;
  }

  float DecayFactor(const StepHyper& hyper) const {
    if (options_.weight_decay_mode == WeightDecayMode::kIndependent) {
      return static_cast<float>(1.0 - hyper.weight_decay);
    }
    return static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);  // decoupled, with the unscaled η
  }

  // Each matrix's chosen lines, ascending: the `chosen` of largest L1 norm (ties to the lower
  // index; torch.topk leaves ties unspecified), from the norms of all batch·lines lines.
  static std::vector<int64_t> Choose(const std::vector<double>& norms, const Lines& l, int64_t batch) {
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(l.chosen * batch));
    std::vector<int64_t> order(static_cast<size_t>(l.lines));
    for (int64_t e = 0; e < batch; ++e) {
      const double* own = norms.data() + e * l.lines;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + l.chosen, order.end(),
                        [own](int64_t a, int64_t b) { return own[a] > own[b] || (own[a] == own[b] && a < b); });
      std::sort(order.begin(), order.begin() + l.chosen);
      for (int64_t i = 0; i < l.chosen; ++i) out.push_back(e * l.lines + order[static_cast<size_t>(i)]);
    }
    return out;
  }

  // Where a step's telemetry goes (backend memory, StepTelemetry::pending): each matrix's Σ U² of
  // its chosen lines in step order, from `input_sums` on; and the residual's two sums of matrix
  // `residual_matrix` of parameter `residual_param`, the group's matrices measured in turn as Muon's.
  struct Measured {
    double* input_sums = nullptr;
    const ParamState* residual_param = nullptr;
    int64_t residual_matrix = 0;
    double* residual_sums = nullptr;
  };

  absl::StatusOr<Measured> ReserveTelemetry(Backend& backend, std::span<ParamState* const> params) {
    Measured out;
    StepTelemetry* telemetry = telemetry_;
    if (telemetry == nullptr) return out;
    std::vector<bool> idle;  // by matrix: its gradient is all zero this step, its momentum only decays
    const ParamState* first = nullptr;
    for (const ParamState* p : params) {
      if (!p->has_grad || p->numel == 0) continue;
      if (first == nullptr) first = p;
      idle.insert(idle.end(), static_cast<size_t>(MatricesOf(*p).batch), p->grad_is_zero);
    }
    if (idle.empty()) return out;
    if (telemetry->measure) {
      int64_t k = first->step_count % static_cast<int64_t>(idle.size());
      for (const ParamState* p : params) {
        if (!p->has_grad || p->numel == 0) continue;
        const int64_t batch = MatricesOf(*p).batch;
        if (k < batch) {
          if (!p->grad_is_zero) out.residual_param = p;
          out.residual_matrix = k;
          break;
        }
        k -= batch;
      }
    }
    const bool residual = out.residual_param != nullptr;
    const size_t matrices = idle.size();
    MUOND_ASSIGN_OR_RETURN(out.input_sums, telemetry->pending.Reserve(backend, matrices + (residual ? 2 : 0),
                                                                      [telemetry, idle = std::move(idle),
                                                                       residual](std::span<const double> values) {
                                                                        telemetry->AddNsInputs(values, idle, residual);
                                                                      }));
    if (residual) out.residual_sums = out.input_sums + matrices;
    return out;
  }

  absl::Status StepParameter(Backend& backend, const StepHyper& hyper, ParamState& p, NsWorkspace& ws,
                             const Measured& measured) {
    const size_t n = static_cast<size_t>(p.numel);
    if (n == 0) return absl::OkStatus();
    const Matrices mat = MatricesOf(p);
    const Lines l = LinesOf(mat);
    kernels::StoredRef momentum = p.Slot(kMomentumSlot)->Ref();
    float* u = p.grad->data();
    // M ← M + G (rounded to M's format), then U ← M: the gradient buffer is scratch from here on.
    MUOND_RETURN_IF_ERROR(backend.Axpby(1.0f, u, 1.0f, momentum, n));
    MUOND_RETURN_IF_ERROR(backend.Axpby(1.0f, momentum, 0.0f, u, n));
    float* lines = u;
    if (l.columns) {
      MUOND_ASSIGN_OR_RETURN(lines, ws.Get(backend, kLinesSlot, n));
      MUOND_RETURN_IF_ERROR(backend.Transpose2D(u, lines, mat.rows, mat.cols, mat.batch));
    }
    const size_t all_lines = static_cast<size_t>(l.lines * mat.batch), length = static_cast<size_t>(l.length);
    std::vector<double> norms(all_lines);
    MUOND_RETURN_IF_ERROR(backend.SumAbs(lines, length, all_lines, norms.data()));
    const std::vector<int64_t> chosen = Choose(norms, l, mat.batch);
    MUOND_ASSIGN_OR_RETURN(float* picked, ws.Get(backend, kChosenSlot, chosen.size() * length));
    for (size_t i = 0; i < chosen.size(); ++i) {
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(lines + chosen[i] * l.length, picked + i * length, length));
    }
    // Error feedback: the chosen lines of M decay, the others stay whole.
    std::vector<float> factors(all_lines, 1.0f);
    for (int64_t line : chosen) factors[static_cast<size_t>(line)] = static_cast<float>(options_.dion2_ef_decay);
    MUOND_RETURN_IF_ERROR(backend.ScaleBatched(lines, length, all_lines, factors.data()));
    if (l.columns) MUOND_RETURN_IF_ERROR(backend.Transpose2D(lines, u, mat.cols, mat.rows, mat.batch));
    MUOND_RETURN_IF_ERROR(backend.Axpby(1.0f, u, 0.0f, momentum, n));
    // O of each matrix's chosen lines, together: batch matrices of chosen × length.
    MUOND_RETURN_IF_ERROR(NewtonSchulz(backend, options_.ns_schedule, options_.ns_steps, options_.ns_eps,
                                       options_.ns_norm_safety, options_.matmul_precision, picked, picked, l.chosen,
                                       l.length, mat.batch, ws, measured.input_sums, options_.ns_preconditioner,
                                       /*stored_transposed=*/l.columns));
    if (measured.residual_param == &p) {
      const size_t lines_of_one = chosen.size() / static_cast<size_t>(mat.batch);
      MUOND_RETURN_IF_ERROR(OrthogonalitySumSquares(
          backend, picked + static_cast<size_t>(measured.residual_matrix) * lines_of_one * length, l.chosen, l.length,
          ws, measured.residual_sums));
      telemetry_->residual_parameter = p.name;
      telemetry_->residual_offset = static_cast<size_t>(measured.residual_matrix * mat.rows * mat.cols);
    }
    // The update: O on the chosen lines, 0 elsewhere.
    MUOND_RETURN_IF_ERROR(backend.Fill(lines, n, 0.0f));
    for (size_t i = 0; i < chosen.size(); ++i) {
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(picked + i * length, lines + chosen[i] * l.length, length));
    }
    if (l.columns) MUOND_RETURN_IF_ERROR(backend.Transpose2D(lines, u, mat.cols, mat.rows, mat.batch));
    // W ← β·W − η·scale·U, the scale on the whole matrix's shape (dion's adjust_lr takes X's shape).
    const float alpha = static_cast<float>(-hyper.lr * UpdateScale(options_, mat.rows, mat.cols));
    const float beta = DecayFactor(hyper);
    return UpdateMeter::Measure(
        backend, p.master.Ref(), n,
        [&](size_t offset, size_t count, double*) {
          return backend.Axpby(alpha, u + offset, beta, p.master.Ref(offset), count);
        },
        telemetry_, /*in_pass=*/false);
  }

  const double ns_bound_;  // NsSingularValueBound of this group's iteration
};

}  // namespace

std::unique_ptr<Optimizer> NewDion2(const GroupOptions& options) { return std::make_unique<Dion2>(options); }

}  // namespace muond::optim
