// Which of OpenBLAS's kernels the CPU backend's fp32 GEMMs run, and whether a better one exists.
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels as it loads, from the CPU's model
// number, and may fall back to its oldest (Prescott, SSE3) for a model newer than it knows: Debian
// 12's 0.3.21 did so on an Emerald Rapids Xeon (family 6, model 207), where its own AVX-512 kernels
// ran GEMMs about five times faster. OPENBLAS_CORETYPE overrides the choice, read only
// as the library loads; the programs that run the CPU backend (the daemon, muondctl's offline
// restores) therefore start themselves again under it (StartOnTheBestBlasKernel) when the choice
// falls below what the CPU runs, and never when OPENBLAS_CORETYPE is already set.
//
// Free functions over the loaded library, the CPU and the process's environment; InspectBlasKernel
// and the pure ones are thread-safe, the other two are for main()'s first lines.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace muond::kernels {

// Vector instruction tiers, as OpenBLAS's x86-64 kernels use them.
enum class SimdTier { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };

// The tier of an OpenBLAS kernel by its name (openblas_get_corename's, any case): "Prescott" SSE,
// "Sandybridge" AVX, "Haswell" or "Zen" AVX2, "SkylakeX" or "Cooperlake" AVX-512; nullopt for a name
// not known here (a newer OpenBLAS's), which is then left alone.
std::optional<SimdTier> KernelTier(std::string_view kernel);

// The OpenBLAS kernel to force (an OPENBLAS_CORETYPE value) when `chosen` ranks below the CPU's
// tier: "Cooperlake" (AVX-512 with bf16 dot products), "SkylakeX", "Haswell" or "Sandybridge".
// nullopt when `chosen` is as good, or not known here.
std::optional<std::string> KernelToForce(std::string_view chosen, SimdTier cpu, bool cpu_has_avx512_bf16);

struct BlasKernel {
  std::string chosen;  // openblas_get_corename(): the kernels the fp32 GEMMs run
  std::string config;  // openblas_get_config(): version and build options
  // The kernel this CPU should run instead, when the chosen one ranks below it (KernelToForce).
  std::optional<std::string> better;
};

// The loaded OpenBLAS's choice on this CPU (on a CPU that is not x86-64, `better` is never set).
BlasKernel InspectBlasKernel();

// When OPENBLAS_CORETYPE is unset and InspectBlasKernel() has a better kernel: starts this program
// again (execv of /proc/self/exe, same arguments; the process keeps its id) under OPENBLAS_CORETYPE
// naming it, so that the daemon and muondctl run the same kernels and an offline restore sums as the
// daemon did. Call it first in main(), before anything is opened. Returns only when there was nothing
// to do (0) or the exec failed (its errno).
int StartOnTheBestBlasKernel(char** argv);

// What a program that called StartOnTheBestBlasKernel should log about its kernels: that it started
// again (and under which kernels it runs), that it could not (`exec_errno`: a warning), or that an
// OPENBLAS_CORETYPE given from outside ranks below the CPU; empty when there is nothing to say.
struct BlasKernelNote {
  bool warning = false;
  std::string text;
};
BlasKernelNote DescribeBlasKernel(int exec_errno);

}  // namespace muond::kernels
