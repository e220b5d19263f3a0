// Backend: the compute primitives the optimizer math in kernels/optim/ is written against.
//
// A backend owns a compute device (the host CPU through OpenBLAS, or a CUDA GPU) and hands out
// fp32 buffers living in that device's memory. Every pointer passed to a primitive is a pointer into
// such a buffer (a "device pointer"), except arguments documented as host values. Matrices are
// row-major. Primitives are enqueued in order; results read back to the host (CopyToHost, SumSquares,
// AllFinite) are complete when the call returns.
//
// What a backend offers the GPU transports (peer memory, events and NCCL channels) is its
// PeerPrimitives side (kernels/peer_primitives.h), apart from the compute primitives here.
//
// Ownership: buffers are owned by whoever holds the unique_ptr; a buffer must not outlive its backend.
// Thread-safety: a backend may be shared by sessions; every primitive is safe to call concurrently on
// distinct buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/elementwise.h"
#include "kernels/peer_primitives.h"
#include "kernels/storage_dtype.h"

namespace muond::kernels {

// fp32 storage in a backend's memory.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual float* data() = 0;
  virtual const float* data() const = 0;
  virtual size_t size() const = 0;  // in elements
};

// A DeviceBuffer over memory it does not own: host memory lent to a backend whose memory is the
// host's (Backend::HostAddressable), e.g. a step's decoded gradients that the optimizer reads in
// place. Must not outlive that memory.
class BorrowedBuffer : public DeviceBuffer {
 public:
  BorrowedBuffer(float* data, size_t size) : data_(data), size_(size) {}
  float* data() override { return data_; }
  const float* data() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* data_;
  size_t size_;
};

// A host→device transfer for data that arrives in pieces (gradients read from the network): each
// piece is on its way to the device while the caller receives the next. The CUDA backend stages the
// pieces through a ring of pinned host buffers on a copy stream of its own; the default copies
// synchronously. A transfer is ordered after all work enqueued on its backend before it was created.
// Used by one thread at a time; it must not outlive its backend.
class HostToDevice {
 public:
  virtual ~HostToDevice() = default;
  // Starts copying host[0, count) to device[0, count); `host` may be reused as soon as this returns.
  virtual absl::Status Enqueue(const float* host, float* device, size_t count) = 0;
  // Returns once every copy enqueued so far has landed, reporting the first that failed.
  virtual absl::Status Wait() = 0;
};

// The reverse, for reading parameters back: pieces are copied out of the device into pinned buffers
// while earlier ones are copied on to their destination. Same ordering and threading as HostToDevice.
class DeviceToHost {
 public:
  virtual ~DeviceToHost() = default;
  // Starts copying device[0, count) to host[0, count); `host` holds the values once Wait() returns.
  virtual absl::Status Enqueue(const float* device, float* host, size_t count) = 0;
  virtual absl::Status Wait() = 0;
};

enum class Transpose { kNo, kYes };

// Precision of the matrix products in Newton–Schulz. The CPU backend computes kBf16 in bf16 only where
// the CPU has bf16 dot products (kernels/cpu/onednn_bf16_gemm.h), and kTf32 always in fp32.
enum class MatmulPrecision { kFp32, kTf32, kBf16 };

// Shape of a strided batch of row-major GEMMs: C_i = alpha·op(A_i)·op(B_i) + beta·C_i, i < batch,
// with op(A_i) m×k, op(B_i) k×n, C_i m×n, and X_i = X + i·stride_x.
struct GemmShape {
  Transpose trans_a = Transpose::kNo;
  Transpose trans_b = Transpose::kNo;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  int64_t batch = 1;
};

class Backend : public PeerPrimitives {
 public:
  virtual ~Backend() = default;

  // One object of type T per backend, made on first use: scratch that every session of the backend
  // shares instead of holding its own (Newton–Schulz's workspace). Obtaining it is thread-safe; its
  // users synchronize their use of it. It is destroyed by ReleaseShared, which a backend's destructor
  // calls first, while the buffers such objects hold can still be freed.
  template <typename T>
  T& Shared() {
    std::lock_guard<std::mutex> lock(shared_mu_);
    std::shared_ptr<void>& slot = shared_[std::type_index(typeid(T))];
    if (!slot) slot = std::make_shared<T>();
    return *static_cast<T*>(slot.get());
  }

  std::string Name() const override = 0;  // "cpu", "cuda"
  // Whether buffers are host memory a caller may read and write directly (the CPU backend), so that
  // answers can be encoded from the masters themselves and host values (BorrowedBuffer) given to
  // the backend's operations without a copy.
  virtual bool HostAddressable() const { return false; }
  // Whether AdamW, Lion and Sgd measure their own update (docs/algorithms.md, Telemetry): with an
  // fp32 master and args.measure set, they write Σ W_before² and Σ ΔW² (fp64) of the elements they
  // update to measure[0] and measure[1], in the update's own pass. Otherwise args.measure is ignored
  // and the update is measured around the call (optim::UpdateMeter).
  virtual bool MeasuresUpdatesInPass() const { return false; }
  virtual std::string Detail() const = 0;  // library versions, device name, threads

  // Memory the backend's buffers take now: in use (held by buffers and scratch) and reserved (also
  // cached for reuse). Thread-safe; for metrics.
  struct MemoryUse {
    int64_t in_use_bytes = 0;
    int64_t reserved_bytes = 0;
  };
  virtual MemoryUse Memory() const = 0;

  // Memory.
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t count) = 0;
  virtual absl::Status CopyToDevice(const float* host, float* device, size_t count) = 0;
  virtual absl::Status CopyToHost(const float* device, float* host, size_t count) = 0;
  virtual absl::Status CopyOnDevice(const float* src, float* dst, size_t count) = 0;
  virtual absl::Status Fill(float* x, size_t count, float value) = 0;
  // Conversions between fp32 and the storage formats (StorageDtype): `packed` points at `count`
  // elements of `dtype` in backend memory (a 16-bit tensor lives in a buffer of ⌈n/2⌉ fp32 words, see
  // optim::StoredTensor). Narrow rounds to nearest even (common/half_float.h); for kFp32 both copy.
  // On a HostAddressable backend the fp32 side may be host memory.
  virtual absl::Status Widen(StorageDtype dtype, const void* packed, float* out, size_t count) = 0;
  virtual absl::Status Narrow(StorageDtype dtype, const float* in, void* packed, size_t count) = 0;
  // Pipelined transfers (see HostToDevice, DeviceToHost). The defaults copy synchronously through
  // CopyToDevice and CopyToHost.
  virtual absl::StatusOr<std::unique_ptr<HostToDevice>> NewHostToDevice();
  virtual absl::StatusOr<std::unique_ptr<DeviceToHost>> NewDeviceToHost();

  // Linear algebra.
  virtual absl::Status Gemm(const GemmShape& shape, float alpha, const float* a, const float* b, float beta, float* c,
                            MatmulPrecision precision) = 0;
  // Whether Gemm at `precision` may be given a C that shares storage with A or B, for an update in
  // place (X ← a·X + B·X, B ← c·A·A + b·A): true where the backend reads its operands from copies it
  // makes before C is written (its bf16 GEMMs round them into scratch first). The default, false,
  // asks callers for a C of its own, preloaded where beta ≠ 0.
  virtual bool GemmMayWriteAnOperand(MatmulPrecision precision) const { return false; }
  // out_i = in_iᵀ for a batch of rows×cols matrices stored back to back.
  virtual absl::Status Transpose2D(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch) = 0;
  // a_i[j][j] += value, j < m, for a batch of m×m matrices stored back to back (X·Xᵀ − I without
  // an identity uploaded). The CPU and CUDA backends have it; the default refuses.
  virtual absl::Status AddToDiagonal(float* a, int64_t m, int64_t batch, float value);

  // Reductions, accumulated in fp64 and returned to the host.
  // sums[i] = Σ x[i·count + j]², j < count, for i < batch. `sums` is a host array of `batch` values.
  virtual absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) = 0;
  virtual absl::StatusOr<bool> AllFinite(const float* x, size_t count) = 0;
  // sums[i] = Σ |x[i·count + j]|, j < count, in fp64, like SumSquares (Dion2's line norms). The
  // CUDA backend sums on the device and waits once; the default needs a HostAddressable backend.
  virtual absl::Status SumAbs(const float* x, size_t count, size_t batch, double* sums);
  // *dot = Σ x[j]·y[j], j < count, accumulated in fp64 (HeLoCo's cosine, momentum_alignment.h). The
  // CPU backend sums the products in order. The default, for device backends, goes through
  // primitives they have: |x + y|² − |x|² − |y|², halved, with x + y rounded to fp32 per element
  // (its error is about 2⁻²⁴·(|x|² + |y|²)). `dot` is a host double.
  virtual absl::Status Dot(const float* x, const float* y, size_t count, double* dot);
  // sums[i] = Σ tensors[i]², each accumulated like SumSquares, with one wait for them all (the
  // default calls SumSquares for each). `sums` is a host array of tensors.size() values.
  struct Slice {
    const float* data = nullptr;
    size_t count = 0;
  };
  virtual absl::Status SumSquaresEach(std::span<const Slice> tensors, double* sums);

  // Element-wise. x_i *= scales[i] over a batch of `count`-sized slices; `scales` is a host array.
  virtual absl::Status ScaleBatched(float* x, size_t count, size_t batch, const float* scales) = 0;
  // Scales each `count`-sized slice x_i of a batch to (about) unit Frobenius norm, Newton–Schulz's
  // first step: s_i = Σ x_i² accumulated like SumSquares, d_i = norm_safety·√s_i + eps in fp64, and
  // x_i *= InverseNormScale (elementwise.h): fp32(1/d_i), or 0 where d_i ≤ 0 or 1/d_i passes fp32's
  // largest value (a zero or all-subnormal slice with eps = 0 becomes zero, never inf or NaN).
  // With `sums` (backend memory for `batch` doubles) the s_i are also written there, in order with
  // the other primitives like any result in backend memory; a caller reads them back when it needs
  // them (CopyBytes), e.g. once per step. The CUDA backend computes the sums and the scales and
  // applies them on the device, and waits for nothing. The default is SumSquares, the scales on the
  // host, ScaleBatched, and CopyBytes of the sums.
  virtual absl::Status NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                        double* sums = nullptr);
  // The same with the sums and scales in backend memory, for reductions whose results the device
  // consumes: sums[i] (`batch` doubles) = Σ x[i·count + j]² accumulated like SumSquares, and
  // x_i *= scales[i] (`batch` floats). Neither waits for a device on the CUDA backend. The defaults
  // go through SumSquares, ScaleBatched and CopyBytes.
  virtual absl::Status SumSquaresTo(const float* x, size_t count, size_t batch, double* sums);
  virtual absl::Status ScaleBatchedBy(float* x, size_t count, size_t batch, const float* scales);
  // NorMuon's line scales of one matrix (docs/algorithms.md, moment2 normuon) from the sums of
  // squares of its `length` lines of `count` elements each (`line_sums`, backend memory): per line
  // v̄ = fp32(sum/count), m ← m + weight·(v̄ − m) in fp32 (stored into `moment2` rounded to its
  // format; the scales use the fp32 value), s = 1/√max(m, eps) in fp64; then, summed in line order
  // in fp64, ratio = √(Σ sum / Σ s²·sum), 0 when the latter is 0, and scales[j] = fp32(s_j·ratio)
  // (backend memory, `length` floats). The CUDA backend computes it on the device and waits for
  // nothing; the default (the CPU backend's) needs a HostAddressable backend.
  struct NormuonArgs {
    size_t count = 0;  // elements per line
    float weight = 0;  // 1 − β2
    double eps = 0;
  };
  virtual absl::Status NormuonScales(const NormuonArgs& args, const double* line_sums, StoredRef moment2, float* scales,
                                     size_t length);
  // The scales that bring lines to unit L2 norm (MuonEq's and Muon+'s, docs/algorithms.md) from their
  // sums of squares: scales[j] = fp32(1/√(sums[j] + eps)) computed in fp64, for `length` lines (both
  // in backend memory); eps > 0 keeps a zero line zero. The CUDA backend computes them on the device
  // and waits for nothing; the default (the CPU backend's) needs a HostAddressable backend.
  virtual absl::Status InverseRootScales(const double* sums, float* scales, size_t length, double eps);
  // NAMO's and NAMO-D's scales of one matrix of `lines` lines (docs/algorithms.md, NAMO and NAMO-D):
  // per line j, from the raw gradient's Σ G² (`grad_sums`) and the momentum's Σ M̃² (`update_sums`)
  // over the line (both `lines` doubles in backend memory), v_j ← NamoMoment (stored into
  // `moment2` rounded to its format; the scales use the fp32 value), d_j = NamoLineScale; then
  // with the mean d̄ of the d_j summed in line order in fp64, scales[j] = fp32(NamoClamped(d_j,
  // d̄, clamp)) (backend memory, `lines` floats). The CUDA backend computes it on the device and
  // waits for nothing; the default (the CPU backend's) needs a HostAddressable backend.
  virtual absl::Status NamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums,
                                  StoredRef moment2, float* scales, size_t lines);
  // Turbo-Muon's AOL scales of `batch` m×m Gram matrices A (backend memory, back to back): per row i,
  // scales[i] = fp32((max(Σ_j |A_ij|, floor))^(-1/2)), the sum in fp64. The CUDA backend computes
  // them on the device and waits for nothing; the default (the CPU backend's) needs a
  // HostAddressable backend.
  virtual absl::Status AolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales);
  // y = alpha·x + beta·y. x and y may be 16-bit state (StoredRef), read as fp32 and y rounded when
  // stored.
  virtual absl::Status Axpby(float alpha, StoredRef x, float beta, StoredRef y, size_t count) = 0;

  // Optimizer element-wise steps; the formulas live in kernels/elementwise.h and are shared with
  // the CUDA kernels. The optimizer state (StoredRef arguments: masters, momenta, moments) may be
  // stored in 16 bits: each element is loaded as fp32, the formula computes in fp32, and what it
  // writes is rounded to the tensor's format (nearest even) — the same bits as the fp32 step on the
  // widened state, rounded afterwards. Gradients and updates are fp32.
  virtual absl::Status Momentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update,
                                size_t count) = 0;
  virtual absl::Status AdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                             StoredRef exp_avg_sq, size_t count) = 0;
  virtual absl::Status Lion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                            size_t count) = 0;
  virtual absl::Status Sgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer,
                           size_t count) = 0;
  // Muon's adaptive second moment (AdamuonElement) over an orthogonalized update, in place.
  virtual absl::Status Adamuon(const AdamuonArgs& args, StoredRef moment2, float* update, size_t count) = 0;
  // Muon's update with cautious weight decay (CautiousUpdateElement).
  virtual absl::Status CautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, size_t count) = 0;

  // Copies `bytes` bytes between any two of: this backend's memory, peer memory (PeerPrimitives),
  // host memory; after the work enqueued before, complete when it returns. The default copies with
  // memcpy (a backend whose memory is the process's own).
  virtual absl::Status CopyBytes(const void* src, void* dst, size_t bytes);
  // Returns once every operation enqueued so far has completed, reporting a fault of any of them.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

 protected:
  void ReleaseShared() {
    std::lock_guard<std::mutex> lock(shared_mu_);
    shared_.clear();
  }

 private:
  std::mutex shared_mu_;
  std::unordered_map<std::type_index, std::shared_ptr<void>> shared_;
};

}  // namespace muond::kernels
