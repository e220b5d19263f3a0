// Options of one parameter group, and their validation. Their names, defaults, choices and ranges are
// the option table's (option_table.h, proto/muond/v1/group_options.json); each row's member is
// named in option_fields.h. A plain value type: copy freely; no shared state.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::optim {

enum class OptimizerKind { kMuon, kAdamW, kLion, kSgd, kDion2 };
// muon: all four; adamw: kDecoupled (AdamW) or kL2 (Adam with coupled L2). kCautious is the
// decoupled decay applied only where the update and the weight agree in sign.
enum class WeightDecayMode { kDecoupled, kIndependent, kL2, kCautious };
// Muon's adaptive second moment on the orthogonalized update: none (plain Muon), adamuon (an
// element-wise moment, as Adam's), normuon (one moment per row or column, norm preserving), namo
// (one scalar step size per matrix from ‖M̃‖ and a moment of ‖G‖²), namo_d (one per column, clamped
// toward their mean).
enum class Moment2Method { kNone, kAdamuon, kNormuon, kNamo, kNamoD };
// Which lines of a matrix Dion2 chooses from: the shorter side's (auto: rows when rows ≤ cols, as
// microsoft/dion's dion2.py), the rows, or the columns.
enum class Dion2Select { kAuto, kRows, kCols };
enum class ScaleMode { kShapeScaling, kSpectral, kUnitRmsNorm };
enum class CoefficientsAfter { kCycle, kRepeatLast };
// How Newton–Schulz is computed: on the iterate X (standard) or on the Gram matrix X·Xᵀ (gram,
// Dao-AILab's Gram Newton–Schulz; square matrices fall back to standard), or per shape, whichever
// the backend's cost rule expects to be faster (auto: optim::PreferGram).
enum class NsAlgorithm { kStandard, kGram, kAuto };
// MuonEq (docs/algorithms.md, MuonEq): the momentum U's rows, columns, or both (each scale taken
// from the same U) at unit L2 norm before Newton–Schulz.
enum class MomentumNormalization { kNone, kRow, kCol, kRowCol };
// Muon+ (docs/algorithms.md, Muon+): the orthogonalized update's rows and/or columns at unit L2
// norm, one after the other; muon_plus is row then column.
enum class PostNormalization { kNone, kMuonPlus, kRow, kCol, kRowCol, kColRow };
// How Newton–Schulz's input is scaled (docs/algorithms.md, Turbo-Muon): by its Frobenius norm, or
// by AOL's per-row scales of |X·Xᵀ| with the first iteration reusing X·Xᵀ.
enum class NsPreconditioner { kFrobenius, kAol };
// How a group's gradients are clipped (docs/algorithms.md, Clipping): counted in the global norm and
// scaled by the global coefficient (global), clipped by their own norm against the group's own
// max_grad_norm (group), or neither (none).
enum class ClipScope { kGlobal, kGroup, kNone };

struct NsCoefficient {
  double a = 0, b = 0, c = 0;
};

// A Newton–Schulz coefficient schedule: coefficients(t) for step t.
struct NsSchedule {
  // The `simple` set, so that a default-constructed GroupOptions is valid as it stands (DefaultOptions
  // takes the table's default set).
  std::string name = "simple";  // "simple", "quintic", "polar_express", "cans", "aol" or "custom"
  std::vector<NsCoefficient> tuples = {{3.4445, -4.7750, 2.0315}};
  CoefficientsAfter after = CoefficientsAfter::kCycle;
  // ns_algorithm gram: the iterations before which the Gram iteration restarts from X (a set's own
  // schedule; gram_polar_express restarts before iteration 2).
  std::vector<int> gram_restarts = {};

  NsCoefficient At(int step) const;
};

// The named sets of the option table (coefficient_sets); NOT_FOUND-free: an unknown name is
// INVALID_ARGUMENT naming `ns_coefficients`.
absl::StatusOr<NsSchedule> NamedSchedule(std::string_view name);
std::vector<std::string> NamedScheduleNames();

struct GroupOptions {
  OptimizerKind optimizer = OptimizerKind::kMuon;
  double lr = 0.02;
  double weight_decay = 0.0;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kDecoupled;
  double momentum = 0.95;
  bool nesterov = true;
  int nesterov_delay = 1;            // sgd: delayed Nesterov's N (1: plain Nesterov)
  double momentum_activation = 0.0;  // sgd: delayed Nesterov's c
  bool heloco = false;               // sgd: HeLoCo's correction against the momentum (momentum_alignment.h)
  double heloco_keep_cosine = 0.1;   // its c_ok
  double heloco_shrink = 1.0;        // its k_s
  double heloco_shrink_max = 1.0;    // its β_max
  double heloco_reorient = 1.0;      // its k_d
  double heloco_kappa = 1.0;         // its κ
  kernels::MomentumStyle momentum_style = kernels::MomentumStyle::kEma;
  int ns_steps = 5;
  NsSchedule ns_schedule;  // default: simple
  NsAlgorithm ns_algorithm = NsAlgorithm::kStandard;
  NsPreconditioner ns_preconditioner = NsPreconditioner::kFrobenius;
  double ns_eps = 1e-7;
  double ns_norm_safety = 1.0;
  ScaleMode scale_mode = ScaleMode::kShapeScaling;
  double extra_scale_factor = 1.0;
  kernels::MatmulPrecision matmul_precision = kernels::MatmulPrecision::kFp32;
  double qk_clip_threshold = 100.0;
  double qk_clip_alpha = 0.5;
  Moment2Method moment2_method = Moment2Method::kNone;                          // muon
  MomentumNormalization momentum_normalization = MomentumNormalization::kNone;  // muon
  PostNormalization post_normalization = PostNormalization::kNone;              // muon
  int num_heads = 1;                  // muon: each 2-D parameter's rows cut into this many heads (Shapes)
  double beta1 = 0.9, beta2 = 0.999;  // muon with a moment2_method: beta2 (default 0.95)
  double eps = 1e-8;                  // adamw; muon with a moment2_method
  double namo_clamp = 0.75;           // muon with moment2_method namo_d: the columns' clamp c
  double dion2_fraction = 0.25;       // dion2: the share of lines orthogonalized each step
  Dion2Select dion2_select = Dion2Select::kAuto;
  double dion2_ef_decay = 0.95;  // dion2: the chosen lines' momentum is multiplied by it
  // Storage formats (the precision-aware optimizer); the arithmetic is fp32 whatever they are.
  kernels::StorageDtype master_dtype = kernels::StorageDtype::kFp32;      // every optimizer
  kernels::StorageDtype momentum_dtype = kernels::StorageDtype::kFp32;    // muon, sgd
  kernels::StorageDtype exp_avg_dtype = kernels::StorageDtype::kFp32;     // adamw, lion
  kernels::StorageDtype exp_avg_sq_dtype = kernels::StorageDtype::kFp32;  // adamw; muon's moment2
  ClipScope clip_scope = ClipScope::kGlobal;
  std::optional<double> max_grad_norm;  // clip_scope group: the group's own limit; unset: the step's
  // Telemetry and health warnings (docs/algorithms.md, Telemetry; docs/operations.md, Warnings).
  bool telemetry = true;          // measure the update and the orthogonality residual
  double warn_clip_below = 0.01;  // muon: a clip coefficient below this ...
  int warn_clip_steps = 10;       // ... for this many steps in a row warns
  int warn_stale_steps = 100;     // a parameter without a gradient for this many steps warns
  // muon: an orthogonality residual above this warns; unset: NsResidualThreshold of the group's
  // Newton–Schulz (ResidualThreshold).
  std::optional<double> warn_residual_above;
};

// The option table's defaults for `kind` (lr, weight decay, momentum, nesterov, betas differ).
GroupOptions DefaultOptions(OptimizerKind kind);

// The options a choice brings (the table's choice_defaults: ns_preconditioner aol sets the aol
// coefficients and 4 steps) into `o`, together: none when `given(name)` says the group set any of
// them itself.
void ApplyChoiceDefaults(GroupOptions& o, absl::FunctionRef<bool(std::string_view)> given);

// The largest NsSingularValueBound a group's iteration may have (the ranges of single options are
// the table's).
inline constexpr double kMaxNsGrowth = 1000;

// Checks the table's range of every option (lr in [0, 100], momentum in [0, 1), ns_steps >= 1, …)
// and the rules that tie options together. The message names the option, e.g.
// "ns_steps must be >= 1, got 0"; callers prefix the path of the group.
absl::Status ValidateOptions(const GroupOptions& options);

// The ranges of the hyperparameters a step may override (lr, momentum, weight_decay), checked
// against the group's other options (the decay factor 1 − lr·weight_decay must stay in [0, 1]).
// ValidateOptions applies it to the group's own values; the step planner to each override.
absl::Status ValidateStepHyper(const GroupOptions& options, double lr, double momentum, double weight_decay);

// How far rounding can carry Newton–Schulz's singular values (docs/algorithms.md, Finite steps):
// the normalized input's largest one up to a factor 1 + `input` above 1/norm_safety (its products'
// operands keep 8 bits in bf16, 11 in tf32, and fp32 sums over the long side drift by about √n·2⁻²⁴,
// 2⁻¹⁶ for the widest layers), then each step's result by up to 1 + `step` (2⁻²⁰: a handful of fp32
// roundings).
struct NsRounding {
  double input = 0;
  double step = 0;
};
NsRounding NsRoundingOf(kernels::MatmulPrecision precision);

// An estimate of the largest singular value any Newton–Schulz iterate reaches: the scalar map
// σ ← (aσ + bσ³ + cσ⁵)·(1 + rounding.step) of each of `steps` steps applied to 4097 points of
// [0, (1 + rounding.input)/norm_safety] (the range NewtonSchulz's normalization leaves, widened by
// rounding), times 2 for the points between. Infinity when the iteration overflows. Sets tuned to
// take their whole input range to the top (cans, gram_polar_express) are sensitive just above it.
double NsSingularValueBound(const NsSchedule& schedule, int steps, double norm_safety, NsRounding rounding);
// The bound of a Muon or Dion2 group's own iteration (its set, steps, input safety and precision).
double NsSingularValueBound(const GroupOptions& options);

// Where the iteration puts the directions a momentum has (docs/algorithms.md, Telemetry): the range
// [lo, hi] of |σ| after `steps` steps for inputs σ in [2⁻⁷, 1]/norm_safety — the largest singular
// value of a normalized momentum of fewer than 2¹⁴ rows or columns lies there — evaluated on 4097
// points of a log scale.
struct NsBand {
  double lo = 0;
  double hi = 0;
};
NsBand NsOutputBand(const NsSchedule& schedule, int steps, double norm_safety);

// The orthogonality residual a healthy step of this iteration stays under: with b = max(1 − lo²,
// hi² − 1), the worst |σ² − 1| inside the band, halfway from b to 1 (what an iteration that did
// nothing leaves on a full-rank matrix), and at most kMaxResidualThreshold, so that an iteration
// that cannot orthogonalize at all is still told.
inline constexpr double kMaxResidualThreshold = 0.9;
double NsResidualThreshold(const NsSchedule& schedule, int steps, double norm_safety);
// The factor Newton–Schulz's input lies under 1 by: ns_norm_safety after the Frobenius scaling; 1
// after AOL's (its scaled X has spectral norm at most 1).
double NsInputSafety(const GroupOptions& options);

// Muon's and Dion2's scale of an orthogonalized update of a rows × cols matrix: `scale_mode`'s
// formula times `extra_scale_factor` (docs/algorithms.md, Muon step 3).
double UpdateScale(const GroupOptions& options, int64_t rows, int64_t cols);
// The group's own warn_residual_above, else NsResidualThreshold of its Newton–Schulz.
double ResidualThreshold(const GroupOptions& options);

// What a group's 16-bit state cannot hold, in words, one line per problem (empty when none): an fp16
// exp_avg_sq loses every (1−β2)·g² below fp16's smallest value, and a 16-bit moment whose decay
// factor is too close to 1 cannot decay at all (β·v rounds back to v). Valid options, not refused:
// the daemon logs these when a session is created.
std::vector<std::string> PrecisionCaveats(const GroupOptions& options);

// Which optimizers read each option the wire's GroupOptions carries, by the option's API name (the
// option table's rows of carrier group).
struct OptionUse {
  std::string_view name;
  std::vector<OptimizerKind> applies_to;
};
const std::vector<OptionUse>& GroupOptionUses();
// Whether `option` names an entry of GroupOptionUses.
bool IsGroupOption(std::string_view option);
// Whether `option` applies to optimizer `kind`; unknown names do not.
bool OptionApplies(OptimizerKind kind, std::string_view option);
// OK when a group with `options` reads `option` (an option its client set); otherwise
// INVALID_ARGUMENT "<option>: does not apply to optimizer adamw", or, for what a Muon group reads only
// with a second moment (beta2, eps, exp_avg_sq_dtype), "<option>: applies to a muon group only with
// moment2_method adamuon or normuon". Unknown names are the caller's to refuse.
absl::Status CheckOptionApplies(const GroupOptions& options, std::string_view option);
// OK unless an option the group reads only with another one's value (the table's read_with:
// heloco_* with heloco true, namo_clamp with moment2_method namo_d) holds other than its default
// while that one has another value: INVALID_ARGUMENT naming both. A default value passes, as the
// clients send every option's. So for an option only QK-clip reads (the table's read_for qk_clip:
// qk_clip_threshold, qk_clip_alpha) when `qk_clip_reads` is false: the session names no QK-clip pair
// (a shard of a sharded session, which sees only its own pairs, passes true). For a new session's
// spec (a session created before this check keeps what it was created with).
absl::Status CheckOptionsAreRead(const GroupOptions& options, bool qk_clip_reads);

// Names used on the wire and in logs.
std::string_view OptimizerName(OptimizerKind kind);
// Every optimizer's name, in the order of OptimizerKind (what GetServerInfo lists).
std::vector<std::string> OptimizerNames();

}  // namespace muond::optim
