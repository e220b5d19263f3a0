// CpuBackend: the Backend on the host CPU. Buffers are 64-byte aligned host memory; GEMMs go to
// OpenBLAS (cblas_sgemm, one call per matrix of a strided batch), except bf16 ones on a CPU with bf16
// dot products, which go to oneDNN (onednn_bf16_gemm.h; elsewhere bf16, like tf32, computes in fp32
// and the first bf16 request logs why); element-wise steps are loops over
// the shared formulas of kernels/elementwise.h, vectorized by the compiler and split over the
// backend's ComputePool; reductions accumulate in fp64, in order.
//
// Ownership: the caller owns the backend and every buffer it allocates; a buffer must not outlive it.
// Thread-safety: primitives may be called concurrently on distinct buffers. Compute (GEMMs,
// element-wise steps, reductions) passes one call at a time through the pool's gate, so sessions
// stepping at once share the --threads cores rather than oversubscribing them; copies do not wait
// for it. OpenBLAS's global thread count is set once at creation; oneDNN's OpenMP teams get the same
// count on every call.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace muond {
class ComputePool;  // common/compute_pool.h
}  // namespace muond

namespace muond::kernels {

// threads > 0 sets OpenBLAS's thread count (process-wide); threads <= 0 keeps OpenBLAS's default
// (OPENBLAS_NUM_THREADS or the number of cores). host_addressable = false makes the backend report
// its memory as not the host's (Backend::HostAddressable), so that the code paths of a device
// backend (gradients staged into backend buffers, answers read back into host copies) run, and are
// tested, on the CPU.
std::unique_ptr<Backend> NewCpuBackend(int threads, bool host_addressable = true);

// OK when the process has room to map what each of the `threads` (as NewCpuBackend takes them)
// needs as the backend starts: a 128 MiB OpenBLAS work buffer (the first product maps the calling
// thread's and those of OpenBLAS threads it starts; OpenBLAS retries a failed map for ever, so under
// an address-space limit too tight for them the construction would never return), a malloc arena
// and a stack. What is mapped already is not counted as part of it, so it may ask for a little more
// than is needed. RESOURCE_EXHAUSTED naming the limit otherwise.
absl::Status CheckBlasBufferRoom(int threads);
// The address space this process has mapped (VmSize, from /proc/self/statm); 0 when unreadable.
int64_t MappedBytes();

// The threads and gate of a backend NewCpuBackend made, or null for any other backend: host work
// that should share the cores with compute, one call at a time (the shm transport's copies), runs
// on it. Lives as long as the backend.
ComputePool* CpuComputePool(Backend& backend);

}  // namespace muond::kernels
