// Entry point of the CUDA backend for code outside kernels/cuda/. Deliberately free of CUDA
// headers, so the backend factory (and anything else) can ask for a CUDA backend while compiling
// with the host compiler alone. Only linked when the build has the CUDA backend (MUOND_HAVE_CUDA).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::kernels {

// A Backend on CUDA device `device` (an ordinal as CUDA numbers them, respecting
// CUDA_VISIBLE_DEVICES). The caller owns it.
// FAILED_PRECONDITION, with the reason in the message, when no device is usable: the runtime finds
// no driver or no device, `device` is out of range, or the device is older than compute capability
// 8.0 (this build's kernels and bf16 GEMMs need sm_80). Other CUDA or cuBLAS failures while setting
// up (out of memory for the cuBLAS workspace, …) come back with their own codes.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device);

// The device-memory pool of a CUDA backend, for tests and benchmarks that check that a steady-state
// step allocates nothing (device_allocations stays flat). nullopt for a backend that is not CUDA.
struct CudaPoolStats {
  size_t bytes_reserved = 0;      // obtained from cudaMalloc, borrowed or cached
  size_t bytes_in_use = 0;        // borrowed (buffers, scratch, cuBLAS workspace)
  size_t device_allocations = 0;  // cudaMalloc calls so far
};
std::optional<CudaPoolStats> GetCudaPoolStats(const Backend& backend);

}  // namespace muond::kernels
