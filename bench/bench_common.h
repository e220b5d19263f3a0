// Shared pieces of the C++ benchmarks (ns_bench, step_bench): the daemon's OpenBLAS kernels, backend
// creation from flags, a device sync, wall-clock timing, and the shapes, so that the torch script
// (ns_throughput.py) can mirror them exactly. Header-only; not thread-safe (one benchmark thread).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/blas_kernel.h"

namespace muond::bench {

// Call first in main(): the CPU backend's GEMMs then run the OpenBLAS kernels the daemon's would
// (kernels/cpu/blas_kernel.h: it starts again under a better kernel than OpenBLAS's own choice), so a
// CPU figure is the daemon's; what changed is said on standard error.
inline void StartOnTheDaemonsBlasKernel(char** argv) {
  const kernels::BlasKernelNote note = kernels::DescribeBlasKernel(kernels::StartOnTheBestBlasKernel(argv));
  if (!note.text.empty()) std::fprintf(stderr, "%s\n", note.text.c_str());
}

// One Newton–Schulz problem: `batch` matrices of rows×cols.
struct NsShape {
  int64_t rows, cols, batch;
  std::string Name() const {
    std::string name = std::to_string(rows) + "x" + std::to_string(cols);
    return batch == 1 ? name : std::to_string(batch) + "x(" + name + ")";
  }
  // FLOPs of `steps` iterations: per iteration X·Xᵀ (2·m²·n), A·A (2·m³) and B·X (2·m²·n) with
  // m = min(rows, cols), n = max(rows, cols) — the dion benchmark's 4·m²·n + 2·m³.
  double Flops(int steps) const {
    const double m = static_cast<double>(std::min(rows, cols));
    const double n = static_cast<double>(std::max(rows, cols));
    return static_cast<double>(steps) * static_cast<double>(batch) * (4 * m * m * n + 2 * m * m * m);
  }
};

// The shapes of the issue; --quick divides every dimension by 4 (batch 24 → 6) so a CPU run takes
// seconds. ns_throughput.py has the same two lists.
inline std::vector<NsShape> NsShapes(bool quick) {
  if (quick) return {{256, 256, 1}, {1024, 1024, 1}, {192, 768, 1}, {1024, 2752, 1}, {192, 768, 6}};
  return {{1024, 1024, 1}, {4096, 4096, 1}, {768, 3072, 1}, {1024, 2752, 1}, {4096, 11008, 1}, {768, 3072, 24}};
}

// The shapes of a --shapes list, "ROWSxCOLS,..." (batch 1 each); exits with the bad item otherwise.
inline std::vector<NsShape> ParseShapes(const std::string& list) {
  std::vector<NsShape> out;
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    const size_t x = item.find('x');
    if (x == std::string::npos || x == 0 || x + 1 == item.size() ||
        item.find_first_not_of("0123456789x") != std::string::npos) {
      std::fprintf(stderr, "--shapes: %s is not ROWSxCOLS\n", item.c_str());
      std::exit(2);
    }
    out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1)), 1});
  }
  return out;
}

inline kernels::MatmulPrecision ParsePrecision(const std::string& name) {
  if (name == "fp32") return kernels::MatmulPrecision::kFp32;
  if (name == "tf32") return kernels::MatmulPrecision::kTf32;
  return kernels::MatmulPrecision::kBf16;
}

// The benchmarks' default precision: bf16 on the GPU, fp32 on the CPU (whose bf16 needs bf16 dot
// products; cpu_precision_bench compares the two). The daemon itself uses fp32 unless a group asks
// otherwise (docs/algorithms.md, Matmul precision).
inline std::string DefaultPrecision(const kernels::Backend& backend) {
  return backend.Name() == "cuda" ? "bf16" : "fp32";
}

// Creates the backend or exits with the reason: a benchmark has nothing to do without one.
inline std::unique_ptr<kernels::Backend> BackendOrDie(const std::string& kind, int threads) {
  absl::StatusOr<kernels::BackendSelection> selection = kernels::CreateBackend(kind, 0, threads);
  if (!selection.ok()) {
    std::fprintf(stderr, "cannot create the %s backend: %s\n", kind.c_str(),
                 std::string(selection.status().message()).c_str());
    std::exit(1);
  }
  if (!selection->note.empty()) std::fprintf(stderr, "%s\n", selection->note.c_str());
  return std::move(selection->backend);
}

inline void CheckOk(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

// Waits for everything enqueued so far: copying one element back synchronizes the backend.
inline void Sync(kernels::Backend& backend, const float* any_device_pointer) {
  float sink = 0;
  CheckOk(backend.CopyToHost(any_device_pointer, &sink, 1), "sync");
}

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace muond::bench
