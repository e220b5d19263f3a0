#include "kernels/cuda/nccl_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond::kernels::cuda {
namespace {

struct Loaded {
  NcclLibrary library{};
  absl::Status status;
};

// Resolves `name` into `slot`; false (with the loader's error in `why`) when it is missing.
template <typename Fn>
bool Resolve(void* handle, const char* name, Fn& slot, std::string& why) {
  dlerror();
  slot = reinterpret_cast<Fn>(dlsym(handle, name));
  if (slot != nullptr) return true;
  const char* error = dlerror();
  why = absl::StrCat(name, ": ", error != nullptr ? error : "not found");
  return false;
}

Loaded Load() {
  Loaded loaded;
  const char* given = std::getenv("MUOND_NCCL_LIBRARY");
  const std::string file = given != nullptr && given[0] != '\0' ? given : "libnccl.so.2";
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    loaded.status = absl::FailedPreconditionError(
        absl::StrCat("NCCL cannot be loaded (", error != nullptr ? error : file,
                     "): the NCCL channel is unavailable; install NCCL 2.x where the loader finds it (or set "
                     "MUOND_NCCL_LIBRARY), or use another transport"));
    return loaded;
  }
  NcclLibrary& l = loaded.library;
  std::string why;
  const bool all =
      Resolve(handle, "ncclGetVersion", l.GetVersion, why) && Resolve(handle, "ncclGetUniqueId", l.GetUniqueId, why) &&
      Resolve(handle, "ncclGetErrorString", l.GetErrorString, why) &&
      Resolve(handle, "ncclGetLastError", l.GetLastError, why) &&
      Resolve(handle, "ncclCommInitRankConfig", l.CommInitRankConfig, why) &&
      Resolve(handle, "ncclCommGetAsyncError", l.CommGetAsyncError, why) &&
      Resolve(handle, "ncclCommFinalize", l.CommFinalize, why) &&
      Resolve(handle, "ncclCommDestroy", l.CommDestroy, why) && Resolve(handle, "ncclCommAbort", l.CommAbort, why) &&
      Resolve(handle, "ncclGroupStart", l.GroupStart, why) && Resolve(handle, "ncclGroupEnd", l.GroupEnd, why) &&
      Resolve(handle, "ncclSend", l.Send, why) && Resolve(handle, "ncclRecv", l.Recv, why);
  if (!all) {
    dlclose(handle);
    loaded.status = absl::FailedPreconditionError(
        absl::StrCat("the NCCL library ", file, " lacks an entry point the CUDA backend needs (", why,
                     "; NCCL 2.18 or later has them all): the NCCL channel is unavailable"));
  }
  return loaded;  // the handle stays open for the daemon's life
}

}  // namespace

absl::StatusOr<const NcclLibrary*> LoadNccl() {
  static const Loaded* const loaded = new Loaded(Load());
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->library;
}

}  // namespace muond::kernels::cuda
