// Backend selection: turns the daemon's `--backend`, `--device` and `--threads` flags into a Backend.
//
// The caller owns the returned backend. `note` says why the choice differs from what was asked
// (e.g. "auto" falling back to the CPU) so the caller can log it once; it is empty otherwise.
// Thread-safe: no shared state besides what the chosen backend sets up (OpenBLAS's thread count).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::kernels {

struct BackendSelection {
  std::unique_ptr<Backend> backend;
  std::string note;
};

// kind: "auto" (CUDA when usable, else CPU), "cpu" or "cuda". device: the CUDA device ordinal.
// threads: CPU threads for OpenBLAS, <= 0 for its default.
// "auto" falls back to the CPU when CUDA is not built or not usable, and says why in `note`.
// Errors: INVALID_ARGUMENT for an unknown kind (naming `--backend`); RESOURCE_EXHAUSTED when the CPU
// backend cannot map OpenBLAS's work buffer (CheckBlasBufferRoom); FAILED_PRECONDITION when "cuda"
// is asked for and cannot be had (not built, no usable device, setup failed), with the reason.
absl::StatusOr<BackendSelection> CreateBackend(std::string_view kind, int device, int threads);

}  // namespace muond::kernels
