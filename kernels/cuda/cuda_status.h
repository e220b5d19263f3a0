// CUDA runtime and cuBLAS results as absl::Status values.
//
// Every CUDA and cuBLAS call in kernels/cuda/ goes through these helpers so that a failure carries
// the library's own name and text for the error ("cudaErrorMemoryAllocation: out of memory") and
// the call that failed, instead of a bare number. Only files under kernels/cuda/ include this header
// (it pulls in the CUDA headers).
//
// MUOND_CUDA_RETURN_IF_ERROR(expr): expr is a cudaError_t; returns the Status from the enclosing
// function when it is not cudaSuccess. MUOND_CUBLAS_RETURN_IF_ERROR(expr): the same for a
// cublasStatus_t. Both name the failing expression in the message.
// Header-only, stateless, thread-safe.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muond::kernels::cuda {

// Out-of-memory becomes RESOURCE_EXHAUSTED (the caller may free something and retry); a missing or
// unusable driver or device FAILED_PRECONDITION; everything else INTERNAL.
//
// A failed runtime call also leaves its error as the calling thread's "last error", which the next
// kernel launch's cudaGetLastError would report as its own: the daemon's threads serve every
// session, so one refused call would fail later, unrelated steps. A non-sticky error is cleared
// here; a sticky one (the context is lost) stays, as it must.
inline absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoKernelImageForDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

inline absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cublasGetStatusName(status), ": ", cublasGetStatusString(status));
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace muond::kernels::cuda

#define MUOND_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                     \
    const cudaError_t muond_cuda_error_ = (expr);                          \
    if (muond_cuda_error_ != cudaSuccess) {                                \
      return ::muond::kernels::cuda::CudaStatus(muond_cuda_error_, #expr); \
    }                                                                      \
  } while (0)

#define MUOND_CUBLAS_RETURN_IF_ERROR(expr)                                      \
  do {                                                                          \
    const cublasStatus_t muond_cublas_status_ = (expr);                         \
    if (muond_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                        \
      return ::muond::kernels::cuda::CublasStatus(muond_cublas_status_, #expr); \
    }                                                                           \
  } while (0)
