// CudaBackend: the Backend on one CUDA GPU.
//
// Memory comes from a per-backend caching pool (CudaMemoryPool), so a steady-state training step
// never calls cudaMalloc or cudaFree. All work is enqueued on one stream; GEMMs go to cuBLAS
// (cublasGemmStridedBatchedEx on that stream, with its own workspace), everything else to the
// kernels of cuda_kernels.cu. Primitives that return data to the host (CopyToHost, SumSquares,
// AllFinite, CopyBytes) and CopyToDevice wait for the device before they return, which is also
// where asynchronous faults of earlier kernels are reported. Results come back through pinned
// blocks (PinnedBlocks), CopyToHost and CopyToDevice through the pinned rings of the
// NewHostToDevice/NewDeviceToHost transfers, which run on copy streams of their own, ordered after
// the compute stream's work at their creation.
// The GPU transports (kernels/peer_exchange.h) live in cuda_peer.cc (CUDA IPC memory and events) and
// cuda_nccl.cc (the NCCL channel); they order their work with the stream through OnStream.
//
// Matmul precision per call: kFp32 → CUBLAS_COMPUTE_32F (true fp32); kTf32 →
// CUBLAS_COMPUTE_32F_FAST_TF32 (tensor cores, inputs rounded to tf32); kBf16 → both inputs are
// first converted (round to nearest) into bf16 scratch, and cuBLAS multiplies CUDA_R_16BF inputs
// with CUBLAS_COMPUTE_32F, writing fp32 C. So the iterate of Newton–Schulz stays fp32 between GEMMs
// and only the GEMM operands are rounded to bf16 — slightly more accurate than the seeds' all-bf16
// loop, at the cost of the conversion passes.
//
// Ownership: the backend owns its stream, cuBLAS handle, workspace, scratch and pool; buffers it
// hands out borrow pool memory and must be destroyed before the backend.
// Thread-safety: every primitive takes the backend's mutex, so concurrent calls are safe and run
// one after another on the single stream (the stream, the cuBLAS handle and the scratch are shared).
// No primitive waits for the device under the mutex: a read-back or Synchronize records an event
// under it and waits for the event without it (SyncUnlocking); memory that may need cudaMalloc or
// cudaMallocHost (a scratch block growing, a pinned block, a transfer's ring) is obtained with the
// mutex released (LockWithScratch, PinnedBlocks, RingCache).
// Each call also makes the backend's device current on the calling thread.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_memory_pool.h"
#include "kernels/cuda/cuda_transfer.h"
#include "kernels/cuda/pinned_blocks.h"

namespace muond::kernels::cuda {

class CudaBackend final : public Backend {
 public:
  // Checks the device (see NewCudaBackend for the errors), then creates the stream, the cuBLAS
  // handle and its workspace.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string Name() const override { return "cuda"; }
  std::string Detail() const override { return detail_; }
  std::string DeviceUuid() const override { return uuid_; }
  int NcclVersion() const override;  // cuda_nccl.cc
  MemoryUse Memory() const override {
    return {static_cast<int64_t>(pool_.bytes_in_use()), static_cast<int64_t>(pool_.bytes_reserved())};
  }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t count) override;
  absl::Status CopyToDevice(const float* host, float* device, size_t count) override;
  absl::Status CopyToHost(const float* device, float* host, size_t count) override;
  absl::Status CopyOnDevice(const float* src, float* dst, size_t count) override;
  absl::Status Fill(float* x, size_t count, float value) override;
  absl::Status Widen(StorageDtype dtype, const void* packed, float* out, size_t count) override;
  absl::Status Narrow(StorageDtype dtype, const float* in, void* packed, size_t count) override;
  // Through pinned host buffers on copy streams of their own (kernels/cuda/cuda_transfer.h).
  absl::StatusOr<std::unique_ptr<HostToDevice>> NewHostToDevice() override;
  absl::StatusOr<std::unique_ptr<DeviceToHost>> NewDeviceToHost() override;

  absl::Status Gemm(const GemmShape& shape, float alpha, const float* a, const float* b, float beta, float* c,
                    MatmulPrecision precision) override;
  // bf16 GEMMs read operands rounded into scratch on the stream before the product (GemmLocked).
  bool GemmMayWriteAnOperand(MatmulPrecision precision) const override { return precision == MatmulPrecision::kBf16; }
  absl::Status Transpose2D(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch) override;
  absl::Status AddToDiagonal(float* a, int64_t m, int64_t batch, float value) override;

  absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) override;
  absl::Status SumAbs(const float* x, size_t count, size_t batch, double* sums) override;
  absl::StatusOr<bool> AllFinite(const float* x, size_t count) override;
  absl::Status SumSquaresEach(std::span<const Slice> tensors, double* sums) override;

  // The scales go in the kernels' launch parameters, kInlineScales per launch: nothing waits.
  absl::Status ScaleBatched(float* x, size_t count, size_t batch, const float* scales) override;
  // Sums, scales and scaling on the stream; never waits.
  absl::Status NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                double* sums) override;
  // On the stream, reading and writing device memory only: nothing waits.
  absl::Status SumSquaresTo(const float* x, size_t count, size_t batch, double* sums) override;
  absl::Status ScaleBatchedBy(float* x, size_t count, size_t batch, const float* scales) override;
  absl::Status NormuonScales(const NormuonArgs& args, const double* line_sums, StoredRef moment2, float* scales,
                             size_t length) override;
  absl::Status NamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums, StoredRef moment2,
                          float* scales, size_t lines) override;
  absl::Status InverseRootScales(const double* sums, float* scales, size_t length, double eps) override;
  absl::Status AolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales) override;
  absl::Status Axpby(float alpha, StoredRef x, float beta, StoredRef y, size_t count) override;

  absl::Status Momentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update,
                        size_t count) override;
  absl::Status AdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg, StoredRef exp_avg_sq,
                     size_t count) override;
  absl::Status Lion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg, size_t count) override;
  absl::Status Sgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer,
                   size_t count) override;
  absl::Status Adamuon(const AdamuonArgs& args, StoredRef moment2, float* update, size_t count) override;
  absl::Status CautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, size_t count) override;

  // The GPU transports: cuda_peer.cc and cuda_nccl.cc.
  absl::StatusOr<std::unique_ptr<PeerMemory>> OpenPeerMemory(std::string_view handle, uint64_t byte_size) override;
  absl::StatusOr<std::unique_ptr<PeerEvent>> OpenPeerEvent(std::string_view handle) override;
  absl::StatusOr<NcclUniqueId> NewNcclUniqueId() override;
  absl::StatusOr<std::unique_ptr<PeerChannel>> OpenPeerChannel(const NcclUniqueId& id) override;
  // cudaMemcpyDefault on the stream (unified addressing tells the directions apart), then a wait;
  // pageable host memory on either side goes through pinned blocks, piece by piece.
  absl::Status CopyBytes(const void* src, void* dst, size_t bytes) override;
  absl::Status Synchronize() override;

  // For the transports in this directory: calls fn(stream) with the backend's mutex held and its
  // device current on the calling thread, so that what fn enqueues is ordered with every
  // primitive's work. fn should not wait long: it holds up every other caller.
  template <typename Fn>
  absl::Status OnStream(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status status = Activate(); !status.ok()) return status;
    return fn(stream_);
  }
  int device() const { return device_; }

  // Pool statistics, for tests and benchmarks that check the steady state allocates nothing.
  const CudaMemoryPool& pool() const { return pool_; }

 private:
  // Scratch blocks kept between calls, grown on demand from the pool.
  enum Scratch { kBf16A, kBf16B, kPartials, kSums, kScales, kFlag, kStaging, kNumScratch };

  struct ScratchNeed {
    Scratch slot;
    size_t bytes;
  };

  explicit CudaBackend(int device) : device_(device), pool_(device), rings_(device), pinned_(device) {}

  // Makes device_ current on the calling thread (CUDA's current device is per thread, and gRPC
  // handlers run on many). Requires mu_ held.
  absl::Status Activate();
  // Takes mu_ with the device current and every listed scratch block at least its size. A block
  // that must grow is taken from the pool with mu_ released (cudaMalloc may wait for the device),
  // and the check starts over, so all of them are in place, together, once it returns.
  absl::StatusOr<std::unique_lock<std::mutex>> LockWithScratch(std::initializer_list<ScratchNeed> needs = {});
  // Scratch `slot`, at least `bytes` bytes (reserved by LockWithScratch; a block that is not is
  // grown here, under mu_); contents unspecified. Requires mu_ held.
  absl::StatusOr<void*> GetScratch(Scratch slot, size_t bytes);
  // Enqueues a copy of `bytes` from device memory `src` into `pinned`, waits for it (and the work
  // before it) with `lock` released, then copies the bytes on to host memory `dst`. Requires `lock`
  // (on mu_) held.
  absl::Status FinishReadBack(std::unique_lock<std::mutex>& lock, PinnedBlocks::Lease& pinned, const void* src,
                              void* dst, size_t bytes);
  // Waits for the work enqueued so far and reports any fault of it. Requires `lock` (on mu_) held;
  // releases it before waiting, so no caller waits for the device under the backend's lock.
  absl::Status SyncUnlocking(std::unique_lock<std::mutex>& lock);
  // SumSquares' two kernels into `sums` (device memory for `batch` doubles), with its checks; the
  // partials in scratch. Requires mu_ held.
  absl::Status SumSquaresLocked(const float* x, size_t count, size_t batch, double* sums, bool absolute = false);
  // SumSquares (or with `absolute` SumAbs) into host `sums`, one wait.
  absl::Status SumReadBack(const float* x, size_t count, size_t batch, double* sums, bool absolute);
  // Gemm with the checks done. Requires mu_ held.
  absl::Status GemmLocked(const GemmShape& s, float alpha, const float* a, const float* b, float beta, float* c,
                          MatmulPrecision precision);

  const int device_;
  std::string detail_;
  std::string uuid_;  // "GPU-…", see DeviceUuid
  mutable std::mutex mu_;
  // Declared before everything that borrows from it, so it is destroyed last.
  CudaMemoryPool pool_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;
  struct ScratchBlock {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  ScratchBlock scratch_[kNumScratch];
  // Idle pinned rings of finished transfers (has its own lock).
  RingCache rings_;
  PinnedBlocks pinned_;  // read-backs and small host-side staging
};

}  // namespace muond::kernels::cuda
