#include "kernels/cpu/blas_kernel.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muond::kernels {
namespace {

// OpenBLAS's x86-64 kernel names (driver/others/dynamic.c) by tier, lower case.
constexpr std::array<std::pair<std::string_view, SimdTier>, 26> kKernels = {{
    {"katmai", SimdTier::kSse},        {"coppermine", SimdTier::kSse},
    {"northwood", SimdTier::kSse},     {"prescott", SimdTier::kSse},
    {"banias", SimdTier::kSse},        {"atom", SimdTier::kSse},
    {"core2", SimdTier::kSse},         {"penryn", SimdTier::kSse},
    {"dunnington", SimdTier::kSse},    {"nehalem", SimdTier::kSse},
    {"athlon", SimdTier::kSse},        {"opteron", SimdTier::kSse},
    {"opteron_sse3", SimdTier::kSse},  {"barcelona", SimdTier::kSse},
    {"bobcat", SimdTier::kSse},        {"nano", SimdTier::kSse},
    {"sandybridge", SimdTier::kAvx},   {"bulldozer", SimdTier::kAvx},
    {"piledriver", SimdTier::kAvx},    {"steamroller", SimdTier::kAvx},
    {"haswell", SimdTier::kAvx2},      {"zen", SimdTier::kAvx2},
    {"excavator", SimdTier::kAvx2},    {"skylakex", SimdTier::kAvx512},
    {"cooperlake", SimdTier::kAvx512}, {"sapphirerapids", SimdTier::kAvx512},
}};

// Set by StartOnTheBestBlasKernel for the program it starts again: the kernel OpenBLAS had chosen.
constexpr char kOpenBlasChose[] = "MUOND_OPENBLAS_CHOSE";

std::string Lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

std::optional<SimdTier> KernelTier(std::string_view kernel) {
  const std::string name = Lower(kernel);
  for (const auto& [known, tier] : kKernels) {
    if (name == known) return tier;
  }
  return std::nullopt;
}

std::optional<std::string> KernelToForce(std::string_view chosen, SimdTier cpu, bool cpu_has_avx512_bf16) {
  const std::optional<SimdTier> tier = KernelTier(chosen);
  if (!tier.has_value() || *tier >= cpu) return std::nullopt;
  switch (cpu) {
    case SimdTier::kAvx512:
      return cpu_has_avx512_bf16 ? "Cooperlake" : "SkylakeX";
    case SimdTier::kAvx2:
      return "Haswell";
    case SimdTier::kAvx:
      return "Sandybridge";
    case SimdTier::kSse:
      break;
  }
  return std::nullopt;
}

BlasKernel InspectBlasKernel() {
  BlasKernel kernel;
  kernel.chosen = openblas_get_corename();
  kernel.config = openblas_get_config();
#if defined(__x86_64__)
  // libgcc's checks include the OS's support (XGETBV) for the AVX and AVX-512 registers.
  SimdTier cpu = SimdTier::kSse;
  if (__builtin_cpu_supports("avx")) cpu = SimdTier::kAvx;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) cpu = SimdTier::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd")) {
    cpu = SimdTier::kAvx512;
  }
  kernel.better = KernelToForce(kernel.chosen, cpu, __builtin_cpu_supports("avx512bf16"));
#endif
  return kernel;
}

int StartOnTheBestBlasKernel(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return 0;  // chosen by whoever started the program
  const BlasKernel kernel = InspectBlasKernel();
  if (!kernel.better) return 0;
  setenv("OPENBLAS_CORETYPE", kernel.better->c_str(), 1);
  setenv(kOpenBlasChose, kernel.chosen.c_str(), 1);
  execv("/proc/self/exe", argv);  // returns only when it failed
  const int failed = errno;
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kOpenBlasChose);
  return failed;
}

BlasKernelNote DescribeBlasKernel(int exec_errno) {
  const BlasKernel kernel = InspectBlasKernel();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (const char* chose = std::getenv(kOpenBlasChose); chose != nullptr) {
    BlasKernelNote note{.text = absl::StrCat("OpenBLAS chose its ", chose,
                                             " kernels, below what this CPU runs; started again under "
                                             "OPENBLAS_CORETYPE=",
                                             forced == nullptr ? "" : forced, ", its GEMMs run the ", kernel.chosen,
                                             " kernels (set OPENBLAS_CORETYPE to choose)")};
    unsetenv(kOpenBlasChose);  // not for the program's own children
    return note;
  }
  if (!kernel.better) return {};
  if (exec_errno != 0) {
    return {.warning = true,
            .text = absl::StrCat("OpenBLAS chose its ", kernel.chosen, " kernels, below this CPU's ", *kernel.better,
                                 ", and the program could not start again under OPENBLAS_CORETYPE=", *kernel.better,
                                 " (", std::strerror(exec_errno), "): its GEMMs run the slower kernels")};
  }
  return {.text = absl::StrCat(forced == nullptr ? std::string("OpenBLAS chose its")
                                                 : absl::StrCat("OPENBLAS_CORETYPE=", forced, " runs OpenBLAS's"),
                               " ", kernel.chosen, " kernels; this CPU runs its ", *kernel.better, " ones")};
}

}  // namespace muond::kernels
