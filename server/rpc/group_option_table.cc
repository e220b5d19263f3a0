// The muond.v1 names of a group's named option values (group_option_table.h).
#include "server/rpc/group_option_table.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace muond::rpc {

const std::vector<OptionChoices>& GroupOptionTable() {
  const std::vector<std::string_view> dtypes = {"fp32", "bf16", "fp16"};  // kernels::StorageDtype's order
  static const std::vector<OptionChoices>* const table = new std::vector<OptionChoices>{
      {"optimizer", {"muon", "adamw", "lion", "sgd"}},  // OptimizerKind's order
      {"weight_decay_mode", {"decoupled", "independent", "l2", "cautious"}},
      {"momentum_style", {"ema", "sum"}},
      {"ns_coefficients_after", {"cycle", "repeat_last"}},
      {"ns_algorithm", {"standard", "gram", "auto"}},  // optim::NsAlgorithm's order
      {"scale_mode", {"shape_scaling", "spectral", "unit_rms_norm"}},
      {"matmul_precision", {"fp32", "tf32", "bf16"}},  // kernels::MatmulPrecision's order
      {"moment2_method", {"none", "adamuon", "normuon"}},
      {"master_dtype", dtypes},
      {"momentum_dtype", dtypes},
      {"exp_avg_dtype", dtypes},
      {"exp_avg_sq_dtype", dtypes},
      {"clip_scope", {"global", "group", "none"}},  // optim::ClipScope's order
  };
  return *table;
}

const std::vector<std::string_view>* ChoicesOf(std::string_view option) {
  for (const OptionChoices& entry : GroupOptionTable()) {
    if (entry.name == option) return &entry.choices;
  }
  return nullptr;
}

absl::StatusOr<int> ChoiceIndex(std::string_view option, std::string_view value) {
  const std::vector<std::string_view>* choices = ChoicesOf(option);
  if (choices != nullptr) {
    for (size_t i = 0; i < choices->size(); ++i) {
      if (value == (*choices)[i]) return static_cast<int>(i);
    }
  }
  std::string known;
  for (std::string_view name : choices == nullptr ? std::vector<std::string_view>{} : *choices) {
    absl::StrAppend(&known, known.empty() ? "" : ", ", std::string(name));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown value '", Echo(std::string(value)), "'; expected one of ", known));
}

}  // namespace muond::rpc
