// NcclLibrary: the NCCL entry points the CUDA backend uses, resolved from libnccl.so.2 with dlopen
// at first use instead of linked, so that libmuond_cuda.so loads and the CUDA backend runs where
// NCCL is missing; every NCCL refusal then says why (the loader's error). The CUDA toolkit's (or
// the system's) nccl.h gives the types at build time; the library found at run time must be NCCL 2.x
// (the soname libnccl.so.2; $MUOND_NCCL_LIBRARY names another file).
//
// Loaded once (thread-safe); the table is immutable afterwards.
#pragma once

#include <nccl.h>

#include "absl/status/statusor.h"

namespace muond::kernels::cuda {

struct NcclLibrary {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
};

// NCCL, loaded on the first call; FAILED_PRECONDITION saying what is missing when it cannot be.
absl::StatusOr<const NcclLibrary*> LoadNccl();

}  // namespace muond::kernels::cuda
