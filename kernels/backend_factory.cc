#include "kernels/backend_factory.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "kernels/cpu/cpu_backend.h"

#if MUOND_HAVE_CUDA
#include "kernels/cuda_library.h"
#endif

namespace muond::kernels {

namespace {

absl::StatusOr<BackendSelection> Cpu(int threads, std::string note) {
  if (absl::Status room = CheckBlasBufferRoom(threads); !room.ok()) return room;
  return BackendSelection{NewCpuBackend(threads), std::move(note)};
}

}  // namespace

absl::StatusOr<BackendSelection> CreateBackend(std::string_view kind, int device, int threads) {
  if (kind != "cpu" && kind != "cuda" && kind != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be one of auto, cpu, cuda; got \"", std::string(kind), "\""));
  }
  if (kind == "cpu") {
    return Cpu(threads, "");
  }
#if MUOND_HAVE_CUDA
  // The CUDA libraries are loaded only when a driver is there to use them.
  absl::StatusOr<std::unique_ptr<Backend>> cuda =
      absl::FailedPreconditionError("no CUDA driver: libcuda.so.1 cannot be loaded");
  if (CudaDriverPresent()) {
    absl::StatusOr<NewCudaBackendEntry> entry = LoadCudaLibrary();
    if (entry.ok()) {
      (*entry)(device, &cuda);
    } else {
      cuda = entry.status();
    }
  }
  if (cuda.ok()) return BackendSelection{std::move(*cuda), ""};
  if (kind == "cuda") {
    // Whatever went wrong (no driver, no device, out of memory for cuBLAS), the daemon cannot run
    // as asked: one code, the library's reason in the message.
    return absl::FailedPreconditionError(cuda.status().message());
  }
  return Cpu(threads, absl::StrCat("CUDA not usable (", cuda.status().message(), "); using the CPU backend"));
#else
  (void)device;
  if (kind == "cuda") {
    return absl::FailedPreconditionError("this muond was built without the CUDA backend");
  }
  return Cpu(threads, "CUDA backend not built; using CPU");
#endif
}

}  // namespace muond::kernels
