#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_status.h"

namespace muond::kernels::cuda {
namespace {

// cuBLAS's recommended workspace on Hopper; also enough for Ampere (which asks for 4 MiB).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// A view of pool memory; gives its block back to the pool when destroyed.
class CudaBuffer final : public DeviceBuffer {
 public:
  CudaBuffer(CudaMemoryPool* pool, float* data, size_t size) : pool_(pool), data_(data), size_(size) {}
  ~CudaBuffer() override { pool_->Release(data_); }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  float* data() override { return data_; }
  const float* data() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  CudaMemoryPool* pool_;
  float* data_;
  size_t size_;
};

// Elements spanned by a strided batch of row-major rows×cols matrices with leading dimension ld.
int64_t Extent(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

// Elements of the bf16 copies a kBf16 GEMM makes of its operands: A's (A and B's together when
// they are the same matrix — Newton–Schulz multiplies one by itself, X·Xᵀ and A·A, and converts it
// once) and B's (0 when shared).
struct Bf16Extents {
  int64_t a = 0, b = 0;
};
Bf16Extents Bf16ExtentsOf(const GemmShape& s, bool shared) {
  const bool ta = s.trans_a == Transpose::kYes, tb = s.trans_b == Transpose::kYes;
  const int64_t extent_a = Extent(ta ? s.k : s.m, ta ? s.m : s.k, s.lda, s.stride_a, s.batch);
  const int64_t extent_b = Extent(tb ? s.n : s.k, tb ? s.k : s.n, s.ldb, s.stride_b, s.batch);
  if (shared) return {std::max(extent_a, extent_b), 0};
  return {extent_a, extent_b};
}

absl::Status CheckGemmShape(const GemmShape& s) {
  if (s.m < 0 || s.n < 0 || s.k < 0 || s.batch < 0 || s.lda < 0 || s.ldb < 0 || s.ldc < 0 || s.stride_a < 0 ||
      s.stride_b < 0 || s.stride_c < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: negative size or stride, m=", s.m, " n=", s.n, " k=", s.k, " batch=", s.batch));
  }
  // cuBLAS takes int dimensions, leading dimensions and batch count.
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (s.m > kMax || s.n > kMax || s.k > kMax || s.lda > kMax || s.ldb > kMax || s.ldc > kMax || s.batch > kMax) {
    return absl::InvalidArgumentError("Gemm: a dimension exceeds the cuBLAS int range");
  }
  return absl::OkStatus();
}

cublasOperation_t ToCublas(Transpose t) { return t == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N; }

// "GPU-" and the device's UUID in 8-4-4-4-12 lower-case hex, as nvidia-smi -L prints it.
std::string FormatUuid(const cudaUUID_t& uuid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    const auto byte = static_cast<unsigned char>(uuid.bytes[i]);
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xf]);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    cudaGetLastError();  // clear it, so it does not resurface in an unrelated later call
    std::string hint;
    if (error == cudaErrorInsufficientDriver) {
      // The runtime's text reads as a version problem even when there is no driver at all.
      int runtime = 0;
      cudaRuntimeGetVersion(&runtime);
      hint = absl::StrCat(" (no NVIDIA driver is loaded, or it is older than CUDA runtime ", runtime / 1000, ".",
                          runtime % 1000 / 10, " needs)");
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cudaGetDeviceCount failed: ", cudaGetErrorName(error), ": ", cudaGetErrorString(error), hint));
  }
  if (count == 0) return absl::FailedPreconditionError("the CUDA runtime sees no device");
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " is out of range: ", count, " device(s) visible"));
  }
  cudaDeviceProp prop{};
  MUOND_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 8) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " (", prop.name,
                                                      ") has compute capability ", prop.major, ".", prop.minor,
                                                      "; this build needs 8.0 or newer"));
  }

  // From here on the destructor cleans up whatever was created before a failure.
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device));
  backend->uuid_ = FormatUuid(prop.uuid);
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&backend->stream_, cudaStreamNonBlocking));
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasCreate(&backend->cublas_));
  // cublasSetStream resets the workspace to cuBLAS's default pool, so the workspace comes after.
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasSetStream(backend->cublas_, backend->stream_));
  MUOND_ASSIGN_OR_RETURN(backend->cublas_workspace_, backend->pool_.Acquire(kCublasWorkspaceBytes));
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(backend->cublas_, backend->cublas_workspace_, kCublasWorkspaceBytes));

  int runtime = 0, driver = 0, cublas = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  cublasGetVersion(backend->cublas_, &cublas);
  backend->detail_ =
      absl::StrCat("device ", device, ": ", prop.name, " (sm_", prop.major, prop.minor, ", ", prop.totalGlobalMem >> 20,
                   " MiB), CUDA runtime ", runtime / 1000, ".", runtime % 1000 / 10, ", driver ", driver / 1000, ".",
                   driver % 1000 / 10, ", cuBLAS ", cublas);
  return backend;
}

CudaBackend::~CudaBackend() {
  // Errors cannot be reported from here; pending work must finish before its memory goes away.
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  ReleaseShared();  // shared scratch returns its buffers to pool_ while it exists
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  for (ScratchBlock& block : scratch_) pool_.Release(block.ptr);
  pool_.Release(cublas_workspace_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  // pool_ frees the device memory after this body.
}

absl::Status CudaBackend::Activate() {
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaBackend::GetScratch(Scratch slot, size_t bytes) {
  ScratchBlock& block = scratch_[slot];
  if (block.ptr == nullptr || block.bytes < bytes) {
    // Given back first so that, if the device is short of memory, the pool can free it before
    // retrying; work still pending on it is ordered before any new owner's (one stream).
    pool_.Release(block.ptr);
    block = ScratchBlock{};
    MUOND_ASSIGN_OR_RETURN(void* ptr, pool_.Acquire(bytes));
    block = ScratchBlock{ptr, bytes};
  }
  return block.ptr;
}

absl::StatusOr<std::unique_lock<std::mutex>> CudaBackend::LockWithScratch(std::initializer_list<ScratchNeed> needs) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  for (;;) {
    const ScratchNeed* short_one = nullptr;
    for (const ScratchNeed& need : needs) {
      if (scratch_[need.slot].bytes < need.bytes) {
        short_one = &need;
        break;
      }
    }
    if (short_one == nullptr) return lock;
    // Grown with mu_ released: other callers keep enqueueing meanwhile (and may grow this or
    // another block), so everything is checked again once mu_ is back.
    lock.unlock();
    absl::StatusOr<void*> block = pool_.Acquire(short_one->bytes);
    lock.lock();
    ScratchBlock& slot = scratch_[short_one->slot];
    if (!block.ok()) {
      if (slot.ptr == nullptr) return block.status();
      // The device may be short of memory: give the old block back, so that the pool can free
      // it, and try once more (work still pending on it runs before any new owner's: one stream).
      pool_.Release(slot.ptr);
      slot = ScratchBlock{};
      continue;
    }
    if (slot.bytes < short_one->bytes) {
      pool_.Release(slot.ptr);
      slot = ScratchBlock{*block, short_one->bytes};
    } else {
      pool_.Release(*block);  // another caller grew it meanwhile
    }
  }
}

absl::Status CudaBackend::FinishReadBack(std::unique_lock<std::mutex>& lock, PinnedBlocks::Lease& pinned,
                                         const void* src, void* dst, size_t bytes) {
  // cudaMemcpyDefault: CopyBytes also reads back from pinned host or managed memory, for which an
  // explicit device-to-host kind would not match the source.
  MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinned.data(), src, bytes, cudaMemcpyDefault, stream_));
  if (absl::Status status = SyncUnlocking(lock); !status.ok()) {
    pinned.Discard();  // the copy into it may not have finished
    return status;
  }
  std::memcpy(dst, pinned.data(), bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::SyncUnlocking(std::unique_lock<std::mutex>& lock) {
  // An event marks the end of the work enqueued so far; the wait for it runs without mu_, so other
  // callers keep enqueueing meanwhile, and it covers exactly this caller's work and what came
  // before it (a stream synchronize would also wait for theirs). Faults of earlier kernels are
  // sticky and reported by the event's wait as by a stream synchronize.
  cudaEvent_t done = nullptr;
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  if (const cudaError_t error = cudaEventRecord(done, stream_); error != cudaSuccess) {
    cudaEventDestroy(done);
    return CudaStatus(error, "cudaEventRecord");
  }
  lock.unlock();
  const cudaError_t error = cudaEventSynchronize(done);
  cudaEventDestroy(done);
  return error == cudaSuccess ? absl::OkStatus() : CudaStatus(error, "cudaEventSynchronize");
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CudaBackend::Allocate(size_t count) {
  if (count > std::numeric_limits<size_t>::max() / sizeof(float) / 2) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", count, " floats"));
  }
  // From the pool before mu_ is taken: it may call cudaMalloc, which waits for the device.
  MUOND_ASSIGN_OR_RETURN(void* block, pool_.Acquire(count * sizeof(float)));
  std::unique_lock<std::mutex> lock(mu_);
  if (absl::Status status = Activate(); !status.ok()) {
    pool_.Release(block);
    return status;
  }
  // Zeroed like the CPU backend's buffers, so a reused block never shows its previous owner's data.
  if (const cudaError_t error = cudaMemsetAsync(block, 0, count * sizeof(float), stream_); error != cudaSuccess) {
    pool_.Release(block);
    return CudaStatus(error, "cudaMemsetAsync");
  }
  return std::unique_ptr<DeviceBuffer>(new CudaBuffer(&pool_, static_cast<float*>(block), count));
}

// Host memory is the caller's pageable memory: a copy from or to it directly would wait for the
// device under mu_, so both go through a pinned ring, whose waits take no lock of the backend.
absl::Status CudaBackend::CopyToDevice(const float* host, float* device, size_t count) {
  if (count == 0) return absl::OkStatus();
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<HostToDevice> transfer, NewHostToDevice());
  MUOND_RETURN_IF_ERROR(transfer->Enqueue(host, device, count));
  return transfer->Wait();
}

absl::Status CudaBackend::CopyToHost(const float* device, float* host, size_t count) {
  if (count == 0) return absl::OkStatus();
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<DeviceToHost> transfer, NewDeviceToHost());
  MUOND_RETURN_IF_ERROR(transfer->Enqueue(device, host, count));
  return transfer->Wait();
}

namespace {

// Whether `ptr` is host memory the CUDA driver has not pinned (a copy to or from it is not
// asynchronous).
bool IsPageableHost(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();  // older drivers report unknown host pointers as an error
    return true;
  }
  return attributes.type == cudaMemoryTypeUnregistered;
}

}  // namespace

absl::Status CudaBackend::CopyBytes(const void* src, void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  // The device current first: on a fresh thread cudaPointerGetAttributes would otherwise start a
  // context on device 0.
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const bool from_host = IsPageableHost(src), to_host = IsPageableHost(dst);
  if (!from_host && !to_host) {
    std::unique_lock<std::mutex> lock(mu_);
    MUOND_RETURN_IF_ERROR(Activate());
    MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    return SyncUnlocking(lock);
  }
  if (from_host && to_host) {
    MUOND_RETURN_IF_ERROR(Synchronize());
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  // One side pageable. Past one pinned block, whole floats go through a transfer's ring, whose
  // pieces overlap their copies and wait for nothing under mu_.
  if (bytes > PinnedBlocks::kMaxBlockBytes && bytes % sizeof(float) == 0) {
    const size_t count = bytes / sizeof(float);
    if (to_host) {
      MUOND_ASSIGN_OR_RETURN(std::unique_ptr<DeviceToHost> transfer, NewDeviceToHost());
      MUOND_RETURN_IF_ERROR(transfer->Enqueue(static_cast<const float*>(src), static_cast<float*>(dst), count));
      return transfer->Wait();
    }
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<HostToDevice> transfer, NewHostToDevice());
    MUOND_RETURN_IF_ERROR(transfer->Enqueue(static_cast<const float*>(src), static_cast<float*>(dst), count));
    return transfer->Wait();
  }
  // Otherwise piece by piece through a pinned block, each piece queued under mu_ and waited for
  // without it.
  const size_t piece = std::min(bytes, PinnedBlocks::kMaxBlockBytes);
  MUOND_ASSIGN_OR_RETURN(PinnedBlocks::Lease pinned, pinned_.Take(piece));
  const auto* in = static_cast<const char*>(src);
  auto* out = static_cast<char*>(dst);
  for (size_t done = 0; done < bytes; done += piece) {
    const size_t n = std::min(piece, bytes - done);
    if (!to_host) std::memcpy(pinned.data(), in + done, n);  // before mu_: the last piece's copy is done
    std::unique_lock<std::mutex> lock(mu_);
    MUOND_RETURN_IF_ERROR(Activate());
    if (to_host) {
      MUOND_RETURN_IF_ERROR(FinishReadBack(lock, pinned, in + done, out + done, n));
      continue;
    }
    MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + done, pinned.data(), n, cudaMemcpyDefault, stream_));
    if (absl::Status status = SyncUnlocking(lock); !status.ok()) {
      pinned.Discard();
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return SyncUnlocking(lock);
}

// The ring is taken before mu_: a new one pins memory, which may wait for the device.
absl::StatusOr<std::unique_ptr<HostToDevice>> CudaBackend::NewHostToDevice() {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<PinnedRing> ring, rings_.Take());
  std::unique_lock<std::mutex> lock(mu_);
  if (absl::Status status = Activate(); !status.ok()) {
    rings_.Give(std::move(ring));
    return status;
  }
  return NewPinnedHostToDevice(&rings_, std::move(ring), stream_);
}

absl::StatusOr<std::unique_ptr<DeviceToHost>> CudaBackend::NewDeviceToHost() {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<PinnedRing> ring, rings_.Take());
  std::unique_lock<std::mutex> lock(mu_);
  if (absl::Status status = Activate(); !status.ok()) {
    rings_.Give(std::move(ring));
    return status;
  }
  return NewPinnedDeviceToHost(&rings_, std::move(ring), stream_);
}

absl::Status CudaBackend::CopyOnDevice(const float* src, float* dst, size_t count) {
  if (count == 0 || src == dst) return absl::OkStatus();
  const size_t bytes = count * sizeof(float);
  const bool overlap = src < dst + count && dst < src + count;
  if (!overlap) {
    std::unique_lock<std::mutex> lock(mu_);
    MUOND_RETURN_IF_ERROR(Activate());
    MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock, LockWithScratch({{kStaging, bytes}}));
  // cudaMemcpy leaves overlapping ranges undefined; the CPU backend has memmove semantics, so go
  // through a staging block.
  MUOND_ASSIGN_OR_RETURN(void* staging, GetScratch(kStaging, bytes));
  MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, staging, bytes, cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill(float* x, size_t count, float value) {
  std::unique_lock<std::mutex> lock(mu_);
  MUOND_RETURN_IF_ERROR(Activate());
  return CudaStatus(LaunchFill(x, static_cast<int64_t>(count), value, stream_), "Fill kernel");
}

absl::Status CudaBackend::Gemm(const GemmShape& s, float alpha, const float* a, const float* b, float beta, float* c,
                               MatmulPrecision precision) {
  MUOND_RETURN_IF_ERROR(CheckGemmShape(s));
  if (s.m == 0 || s.n == 0 || s.batch == 0) return absl::OkStatus();
  if (precision != MatmulPrecision::kBf16 || s.k == 0) {
    std::unique_lock<std::mutex> lock(mu_);
    MUOND_RETURN_IF_ERROR(Activate());
    return GemmLocked(s, alpha, a, b, beta, c, precision);
  }
  const Bf16Extents extents = Bf16ExtentsOf(s, a == b);
  MUOND_ASSIGN_OR_RETURN(std::unique_lock<std::mutex> lock,
                         LockWithScratch({{kBf16A, static_cast<size_t>(extents.a) * sizeof(__nv_bfloat16)},
                                          {kBf16B, static_cast<size_t>(extents.b) * sizeof(__nv_bfloat16)}}));
  return GemmLocked(s, alpha, a, b, beta, c, precision);
}

absl::Status CudaBackend::GemmLocked(const GemmShape& s, float alpha, const float* a, const float* b, float beta,
                                     float* c, MatmulPrecision precision) {
  if (s.k == 0) {
    // An empty product: C ← beta·C, spelled out rather than trusting every BLAS to do it.
    return CudaStatus(LaunchScaleMatrices(c, s.m, s.n, s.ldc, s.stride_c, s.batch, beta, stream_),
                      "ScaleMatrices kernel");
  }
  const void* a_op = a;
  const void* b_op = b;
  cudaDataType input_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  switch (precision) {
    case MatmulPrecision::kFp32:
      break;
    case MatmulPrecision::kTf32:
      compute = CUBLAS_COMPUTE_32F_FAST_TF32;
      break;
    case MatmulPrecision::kBf16: {
      // Round the stored range of each operand (gaps between rows included) into bf16 scratch at
      // the same offsets, so leading dimensions and strides carry over unchanged.
      const Bf16Extents extents = Bf16ExtentsOf(s, a == b);
      MUOND_ASSIGN_OR_RETURN(void* a16, GetScratch(kBf16A, extents.a * sizeof(__nv_bfloat16)));
      MUOND_RETURN_IF_ERROR(
          CudaStatus(LaunchToBf16(a, static_cast<__nv_bfloat16*>(a16), extents.a, stream_), "ToBf16 kernel"));
      a_op = b_op = a16;
      if (a != b) {
        MUOND_ASSIGN_OR_RETURN(void* b16, GetScratch(kBf16B, extents.b * sizeof(__nv_bfloat16)));
        MUOND_RETURN_IF_ERROR(
            CudaStatus(LaunchToBf16(b, static_cast<__nv_bfloat16*>(b16), extents.b, stream_), "ToBf16 kernel"));
        b_op = b16;
      }
      input_type = CUDA_R_16BF;  // with CUBLAS_COMPUTE_32F and fp32 C: fp32 accumulation
      break;
    }
  }
  // cuBLAS is column-major, and a row-major matrix read column-major is its transpose. So the
  // row-major C = op(A)·op(B) is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B goes first and
  // A second, m and n swap, and each operand keeps its own transpose flag.
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      cublas_, ToCublas(s.trans_b), ToCublas(s.trans_a), static_cast<int>(s.n), static_cast<int>(s.m),
      static_cast<int>(s.k), &alpha, b_op, input_type, static_cast<int>(s.ldb), s.stride_b, a_op, input_type,
      static_cast<int>(s.lda), s.stride_a, &beta, c, CUDA_R_32F, static_cast<int>(s.ldc), s.stride_c,
      static_cast<int>(s.batch), compute, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace muond::kernels::cuda
