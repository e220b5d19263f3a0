#include "kernels/backend_factory.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"

namespace muond::kernels {

absl::StatusOr<BackendSelection> CreateBackend(std::string_view kind, int device, int threads) {
  if (kind == "cpu") {
    return BackendSelection{NewCpuBackend(threads), ""};
  }
  if (kind == "cuda") {
    // The CUDA backend lives under kernels/cuda/ and is not part of this build yet.
    return absl::FailedPreconditionError("this muond was built without the CUDA backend");
  }
  if (kind == "auto") {
    return BackendSelection{NewCpuBackend(threads), "CUDA backend not built; using CPU"};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend must be one of auto, cpu, cuda; got \"", std::string(kind), "\""));
}

}  // namespace muond::kernels
