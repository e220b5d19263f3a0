// CudaBackend's transpose, reduction (SumSquares, SumSquaresEach, AllFinite) and element-wise
// primitives (cuda_backend.cu holds creation, memory and GEMM), plus NewCudaBackend. Each one takes
// the backend's lock, makes the device current and enqueues kernels from cuda_kernels.cu on the
// backend's stream.
#include <algorithm>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_backend_factory.h"
#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_status.h"

namespace muond::kernels {

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaBackend> backend, cuda::CudaBackend::Create(device));
  return std::unique_ptr<Backend>(std::move(backend));
}

// The entry point CreateBackend finds with dlsym (kernels/cuda_library.h).
extern "C" __attribute__((visibility("default"))) void muond_new_cuda_backend(
    int device, absl::StatusOr<std::unique_ptr<Backend>>* out) {
  // The cast: in C++20 mode nvcc takes StatusOr's [[nodiscard]] to cover operator='s reference.
  static_cast<void>(*out = NewCudaBackend(device));
}

std::optional<CudaPoolStats> GetCudaPoolStats(const Backend& backend) {
  const auto* cuda = dynamic_cast<const cuda::CudaBackend*>(&backend);
  if (cuda == nullptr) return std::nullopt;
  return CudaPoolStats{cuda->pool().bytes_reserved(), cuda->pool().bytes_in_use(), cuda->pool().device_allocations()};
}

namespace cuda {

absl::Status CudaBackend::Transpose2D(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch) {
  if (rows < 0 || cols < 0 || batch < 0) {
    return absl::InvalidArgumentError("Transpose2D: negative size");
  }
  if (rows > kTransposeMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transpose2D: ", rows, " rows exceed the CUDA grid limit of ", kTransposeMaxRows));
  }
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchTranspose(in, out, rows, cols, batch, stream_), "Transpose kernel");
}

absl::Status CudaBackend::AddToDiagonal(float* a, int64_t m, int64_t batch, float value) {
  if (m < 0 || batch < 0) return absl::InvalidArgumentError("AddToDiagonal: negative size");
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchAddToDiagonal(a, m, batch, value, stream_), "AddToDiagonal kernel");
}

namespace {

// Bytes of partial sums SumSquares' first pass writes for `batch` slices of `count` elements,
// after checking the pass can launch (batch·chunks blocks on a one-dimensional grid).
absl::StatusOr<size_t> PartialsBytes(size_t count, size_t batch) {
  const int chunks = SumSquaresChunks(static_cast<int64_t>(count));
  if (batch > static_cast<size_t>(std::numeric_limits<int>::max() / chunks)) {
    return absl::InvalidArgumentError(absl::StrCat("SumSquares: batch ", batch, " is too large"));
  }
  return batch * chunks * sizeof(double);
}

}  // namespace

absl::Status CudaBackend::SumSquaresLocked(const float* x, size_t count, size_t batch, double* sums, bool absolute) {
  const int chunks = SumSquaresChunks(static_cast<int64_t>(count));
  MUOND_ASSIGN_OR_RETURN(const size_t partials_bytes, PartialsBytes(count, batch));
  MUOND_ASSIGN_OR_RETURN(void* partials, GetScratch(kPartials, partials_bytes));
  return CudaStatus(LaunchSumSquares(x, static_cast<int64_t>(count), static_cast<int64_t>(batch), chunks,
                                     static_cast<double*>(partials), sums, stream_, absolute),
                    "SumSquares kernels");
}

absl::Status CudaBackend::SumSquares(const float* x, size_t count, size_t batch, double* sums) {
  return SumReadBack(x, count, batch, sums, /*absolute=*/false);
}

absl::Status CudaBackend::SumAbs(const float* x, size_t count, size_t batch, double* sums) {
  return SumReadBack(x, count, batch, sums, /*absolute=*/true);
}

absl::Status CudaBackend::SumReadBack(const float* x, size_t count, size_t batch, double* sums, bool absolute) {
  if (batch == 0) return absl::OkStatus();
  const size_t bytes = batch * sizeof(double);
  MUOND_ASSIGN_OR_RETURN(const size_t partials_bytes, PartialsBytes(count, batch));
  MUOND_ASSIGN_OR_RETURN(PinnedBlocks::Lease pinned, pinned_.Take(bytes));
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock,
                         LockWithScratch({{kSums, bytes}, {kPartials, partials_bytes}}));
  MUOND_ASSIGN_OR_RETURN(void* device_sums, GetScratch(kSums, bytes));
  MUOND_RETURN_IF_ERROR(SumSquaresLocked(x, count, batch, static_cast<double*>(device_sums), absolute));
  return FinishReadBack(lock, pinned, device_sums, sums, bytes);
}

// SumSquares' two kernels with batch 1 for each tensor, so each sum has the bits SumSquares gives
// it; the tensors share one partials block (the stream runs them one after another) and one
// device array of sums, copied back once.
absl::Status CudaBackend::SumSquaresEach(std::span<const Slice> tensors, double* sums) {
  if (tensors.empty()) return absl::OkStatus();
  int max_chunks = 1;
  for (const Slice& tensor : tensors) {
    max_chunks = std::max(max_chunks, SumSquaresChunks(static_cast<int64_t>(tensor.count)));
  }
  const size_t bytes = tensors.size() * sizeof(double), partials_bytes = max_chunks * sizeof(double);
  MUOND_ASSIGN_OR_RETURN(PinnedBlocks::Lease pinned, pinned_.Take(bytes));
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock,
                         LockWithScratch({{kSums, bytes}, {kPartials, partials_bytes}}));
  MUOND_ASSIGN_OR_RETURN(void* partials, GetScratch(kPartials, partials_bytes));
  MUOND_ASSIGN_OR_RETURN(void* device_sums, GetScratch(kSums, bytes));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t count = static_cast<int64_t>(tensors[i].count);
    MUOND_RETURN_IF_ERROR(
        CudaStatus(LaunchSumSquares(tensors[i].data, count, 1, SumSquaresChunks(count), static_cast<double*>(partials),
                                    static_cast<double*>(device_sums) + i, stream_),
                   "SumSquares kernels"));
  }
  return FinishReadBack(lock, pinned, device_sums, sums, bytes);
}

absl::StatusOr<bool> CudaBackend::AllFinite(const float* x, size_t count) {
  if (count == 0) return true;
  MUOND_ASSIGN_OR_RETURN(PinnedBlocks::Lease pinned, pinned_.Take(sizeof(int)));
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock, LockWithScratch({{kFlag, sizeof(int)}}));
  MUOND_ASSIGN_OR_RETURN(void* flag, GetScratch(kFlag, sizeof(int)));
  MUOND_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(int), stream_));
  MUOND_RETURN_IF_ERROR(CudaStatus(
      LaunchFlagNonFinite(x, static_cast<int64_t>(count), static_cast<int*>(flag), stream_), "FlagNonFinite kernel"));
  int host_flag = 1;
  MUOND_RETURN_IF_ERROR(FinishReadBack(lock, pinned, flag, &host_flag, sizeof(int)));
  return host_flag == 0;
}

absl::Status CudaBackend::ScaleBatched(float* x, size_t count, size_t batch, const float* scales) {
  if (count == 0 || batch == 0) return absl::OkStatus();
  // The scales travel in the launches themselves, kInlineScales at a time: no copy from the host,
  // so nothing for the host to wait on however many there are.
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  for (size_t first = 0; first < batch; first += kInlineScales) {
    const size_t n = std::min(batch - first, static_cast<size_t>(kInlineScales));
    InlineScales inline_scales{};
    std::copy(scales + first, scales + first + n, inline_scales.v);
    MUOND_RETURN_IF_ERROR(CudaStatus(LaunchScaleBatchedInline(x + first * count, static_cast<int64_t>(count),
                                                              static_cast<int64_t>(n), inline_scales, stream_),
                                     "ScaleBatched kernel"));
  }
  return absl::OkStatus();
}

// SumSquares' kernels, the scales from the sums and the scaling, all on the stream, nothing waited
// for: the sums (in `sums`, or else the kSums scratch) and the scales (kScales) are read by the
// next kernels on the same stream, and the next user of those scratch blocks reaches them only
// after these kernels, since one stream orders every primitive.
absl::Status CudaBackend::NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                           double* sums) {
  if (batch == 0) return absl::OkStatus();
  MUOND_ASSIGN_OR_RETURN(const size_t partials_bytes, PartialsBytes(count, batch));
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock,
                         LockWithScratch({{kSums, sums == nullptr ? batch * sizeof(double) : 0},
                                          {kScales, batch * sizeof(float)},
                                          {kPartials, partials_bytes}}));
  double* device_sums = sums;
  if (device_sums == nullptr) {
    MUOND_ASSIGN_OR_RETURN(void* scratch, GetScratch(kSums, batch * sizeof(double)));
    device_sums = static_cast<double*>(scratch);
  }
  MUOND_ASSIGN_OR_RETURN(void* device_scales, GetScratch(kScales, batch * sizeof(float)));
  MUOND_RETURN_IF_ERROR(SumSquaresLocked(x, count, batch, device_sums));
  const auto n = static_cast<int64_t>(count), b = static_cast<int64_t>(batch);
  MUOND_RETURN_IF_ERROR(
      CudaStatus(LaunchInverseNormScales(device_sums, b, eps, norm_safety, static_cast<float*>(device_scales), stream_),
                 "InverseNormScales kernel"));
  return CudaStatus(LaunchScaleBatched(x, n, b, static_cast<const float*>(device_scales), stream_),
                    "ScaleBatched kernel");
}

absl::Status CudaBackend::SumSquaresTo(const float* x, size_t count, size_t batch, double* sums) {
  if (batch == 0) return absl::OkStatus();
  MUOND_ASSIGN_OR_RETURN(const size_t partials_bytes, PartialsBytes(count, batch));
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock, LockWithScratch({{kPartials, partials_bytes}}));
  return SumSquaresLocked(x, count, batch, sums);
}

absl::Status CudaBackend::ScaleBatchedBy(float* x, size_t count, size_t batch, const float* scales) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchScaleBatched(x, static_cast<int64_t>(count), static_cast<int64_t>(batch), scales, stream_),
                    "ScaleBatched kernel");
}

absl::Status CudaBackend::NormuonScales(const NormuonArgs& args, const double* line_sums, StoredRef moment2,
                                        float* scales, size_t length) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchNormuonScales(line_sums, static_cast<int64_t>(length), static_cast<int64_t>(args.count),
                                        args.weight, args.eps, moment2, scales, stream_),
                    "NormuonScales kernel");
}

absl::Status CudaBackend::NamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums,
                                     StoredRef moment2, float* scales, size_t lines) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(
      LaunchNamoScales(args, grad_sums, update_sums, static_cast<int64_t>(lines), moment2, scales, stream_),
      "NamoScales kernel");
}

absl::Status CudaBackend::InverseRootScales(const double* sums, float* scales, size_t length, double eps) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchInverseRootScales(sums, static_cast<int64_t>(length), eps, scales, stream_),
                    "InverseRootScales kernel");
}

absl::Status CudaBackend::AolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchAolScales(gram, m, batch, floor, scales, stream_), "AolScales kernel");
}

absl::Status CudaBackend::Widen(StorageDtype dtype, const void* packed, float* out, size_t count) {
  if (dtype == StorageDtype::kFp32) return CopyOnDevice(static_cast<const float*>(packed), out, count);
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchWiden(dtype, static_cast<const uint16_t*>(packed), out, static_cast<int64_t>(count), stream_),
                    "Widen kernel");
}

absl::Status CudaBackend::Narrow(StorageDtype dtype, const float* in, void* packed, size_t count) {
  if (dtype == StorageDtype::kFp32) return CopyOnDevice(in, static_cast<float*>(packed), count);
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchNarrow(dtype, in, static_cast<uint16_t*>(packed), static_cast<int64_t>(count), stream_),
                    "Narrow kernel");
}

absl::Status CudaBackend::Axpby(float alpha, StoredRef x, float beta, StoredRef y, size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchAxpby(alpha, x, beta, y, static_cast<int64_t>(count), stream_), "Axpby kernel");
}

absl::Status CudaBackend::Momentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update,
                                   size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchMomentum(args, momentum, grad, update, static_cast<int64_t>(count), stream_),
                    "Momentum kernel");
}

absl::Status CudaBackend::AdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                                StoredRef exp_avg_sq, size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchAdamW(args, param, grad, exp_avg, exp_avg_sq, static_cast<int64_t>(count), stream_),
                    "AdamW kernel");
}

absl::Status CudaBackend::Lion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                               size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchLion(args, param, grad, exp_avg, static_cast<int64_t>(count), stream_), "Lion kernel");
}

absl::Status CudaBackend::Sgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer,
                              size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchSgd(args, param, grad, momentum_buffer, static_cast<int64_t>(count), stream_), "Sgd kernel");
}

absl::Status CudaBackend::Adamuon(const AdamuonArgs& args, StoredRef moment2, float* update, size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchAdamuon(args, moment2, update, static_cast<int64_t>(count), stream_), "Adamuon kernel");
}

absl::Status CudaBackend::CautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, size_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchCautiousUpdate(args, update, param, static_cast<int64_t>(count), stream_),
                    "CautiousUpdate kernel");
}

}  // namespace cuda
}  // namespace muond::kernels
