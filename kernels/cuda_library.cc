#include "kernels/cuda_library.h"

#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::kernels {
namespace {

constexpr char kLibraryName[] = "libmuond_cuda.so";

std::vector<std::string> Candidates() {
  std::vector<std::string> places;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    places.push_back((exe.parent_path() / kLibraryName).string());
    places.push_back((exe.parent_path().parent_path() / "lib" / "muond" / kLibraryName).string());
  }
  places.emplace_back(MUOND_CUDA_LIBRARY_BUILD_PATH);
  return places;
}

absl::StatusOr<NewCudaBackendEntry> Load() {
  std::vector<std::string> failures;
  for (const std::string& place : Candidates()) {
    if (!std::filesystem::exists(place)) {
      failures.push_back(absl::StrCat(place, ": not found"));
      continue;
    }
    // RTLD_LOCAL keeps the CUDA libraries' symbols to the backend; never unloaded (CUDA's runtime
    // registers exit handlers).
    void* handle = dlopen(place.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failures.push_back(dlerror());
      continue;
    }
    void* entry = dlsym(handle, kNewCudaBackendSymbol);
    if (entry == nullptr) {
      failures.push_back(absl::StrCat(place, ": no symbol ", kNewCudaBackendSymbol));
      continue;
    }
    return reinterpret_cast<NewCudaBackendEntry>(entry);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cannot load the CUDA backend library ", kLibraryName, " (", absl::StrJoin(failures, "; "), ")"));
}

}  // namespace

bool CudaDriverPresent() {
  static const bool present = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver == nullptr) return false;
    dlclose(driver);
    return true;
  }();
  return present;
}

absl::StatusOr<NewCudaBackendEntry> LoadCudaLibrary() {
  static const absl::StatusOr<NewCudaBackendEntry>* const entry = new absl::StatusOr<NewCudaBackendEntry>(Load());
  return *entry;
}

}  // namespace muond::kernels
