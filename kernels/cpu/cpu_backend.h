// CpuBackend: the Backend on the host CPU. Buffers are 64-byte aligned host memory; GEMMs go to
// OpenBLAS (cblas_sgemm, one call per matrix of a strided batch); element-wise steps are plain loops
// over the shared formulas of kernels/elementwise.h; reductions accumulate in fp64.
//
// Ownership: the caller owns the backend and every buffer it allocates; a buffer must not outlive it.
// Thread-safety: stateless apart from OpenBLAS's global thread count, which is set once at creation;
// primitives may run concurrently on distinct buffers (OpenBLAS is built thread-safe).
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace muond::kernels {

// threads > 0 sets OpenBLAS's thread count (process-wide); threads <= 0 keeps OpenBLAS's default
// (OPENBLAS_NUM_THREADS or the number of cores).
std::unique_ptr<Backend> NewCpuBackend(int threads);

}  // namespace muond::kernels
