// The CUDA backend as a library loaded on first use: libmuond_cuda.so holds every CUDA kernel and
// links the CUDA runtime and cuBLAS, so a daemon that never uses the GPU never maps them (cuBLAS
// alone adds about 150 MiB of resident memory when loaded). CreateBackend is its user; the tests
// load it directly to check that it resolves.
//
// Thread-safe: the library is loaded once, under a static initializer; later calls return the same
// entry point. Only built with the CUDA backend (MUOND_HAVE_CUDA).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::kernels {

// What libmuond_cuda.so exports, with C linkage so dlsym finds it by name: NewCudaBackend(device)
// into *out.
using NewCudaBackendEntry = void (*)(int device, absl::StatusOr<std::unique_ptr<Backend>>* out);
inline constexpr char kNewCudaBackendSymbol[] = "muond_new_cuda_backend";

// Whether the CUDA driver library (libcuda.so.1) can be loaded: without it no device is usable, and
// the backend library is not worth loading.
bool CudaDriverPresent();

// Loads libmuond_cuda.so — next to the running executable, then in ../lib/muond beside it (an
// installed tree), then where this build wrote it — and returns its entry point. FAILED_PRECONDITION
// with dlopen's reason for each place tried when none loads.
absl::StatusOr<NewCudaBackendEntry> LoadCudaLibrary();

}  // namespace muond::kernels
