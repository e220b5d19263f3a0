// Kernels of the CUDA backend. Everything here is memory-bound, so the kernels favour obvious
// correctness over tuning: grid-stride loops with 64-bit indices, a fixed block size, shared-memory
// tiles for the transpose and a plain tree reduction for sums.
#include <algorithm>

#include "common/half_float.h"
#include "kernels/cuda/cuda_kernels.cuh"

namespace muond::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a power of two: BlockSum relies on it
// Enough blocks to fill any current GPU several times over; larger ranges loop inside the kernel.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

unsigned BlocksFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// The first index of this thread and the stride of a grid-stride loop, in 64 bits so that ranges
// beyond 2³¹ elements do not wrap.
__device__ int64_t FirstIndex() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ int64_t GridStride() { return static_cast<int64_t>(blockDim.x) * gridDim.x; }

__global__ void FillKernel(float* x, int64_t n, float value) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) x[i] = value;
}

__global__ void AddToDiagonalKernel(float* a, int64_t m, int64_t n, float value) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const int64_t b = i / m, j = i % m;
    a[(b * m + j) * m + j] += value;
  }
}

// The state arguments (StoredRef) are loaded as fp32 and stored rounded to their format
// (LoadElement / StoreElement); the branch on the format is the same for every thread.
__global__ void AxpbyKernel(float alpha, StoredRef x, float beta, StoredRef y, int64_t n) {
  // The same expression as the CPU loop; with -fmad=false it rounds the same way.
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    StoreElement(y, i, alpha * LoadElement(x, i) + beta * LoadElement(y, i));
  }
}

__global__ void ScaleBatchedKernel(float* x, int64_t count, int64_t total, const float* scales) {
  for (int64_t i = FirstIndex(); i < total; i += GridStride()) x[i] *= scales[i / count];
}

__global__ void ScaleBatchedInlineKernel(float* x, int64_t count, int64_t total, InlineScales scales) {
  for (int64_t i = FirstIndex(); i < total; i += GridStride()) x[i] *= scales.v[i / count];
}

__global__ void InverseNormScalesKernel(const double* sums, int64_t batch, double eps, double norm_safety,
                                        float* scales) {
  for (int64_t b = FirstIndex(); b < batch; b += GridStride()) scales[b] = InverseNormScale(sums[b], eps, norm_safety);
}

__global__ void ScaleMatricesKernel(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride, int64_t total,
                                    float beta) {
  for (int64_t i = FirstIndex(); i < total; i += GridStride()) {
    const int64_t b = i / (m * n), rem = i % (m * n);
    float& v = c[b * stride + (rem / n) * ldc + rem % n];
    v = beta == 0.0f ? 0.0f : beta * v;
  }
}

__global__ void ToBf16Kernel(const float* in, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = __float2bfloat16_rn(in[i]);
}

// One 32×32 tile per block, blockDim (32, 8): coalesced reads of a row strip and coalesced writes
// of a column strip; the +1 column keeps the shared-memory accesses free of bank conflicts.
constexpr int kTile = 32, kTileRows = 8;
__global__ void TransposeKernel(const float* in, float* out, int64_t rows, int64_t cols) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t matrix = static_cast<int64_t>(blockIdx.z) * rows * cols;
  in += matrix;
  out += matrix;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // tile[j][tx] = in(row0 + j, col0 + tx)
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const int64_t r = row0 + j, c = col0 + threadIdx.x;
    if (r < rows && c < cols) tile[j][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  // out is cols×rows: out(col0 + j, row0 + tx) = in(row0 + tx, col0 + j) = tile[tx][j]
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const int64_t c = col0 + j, r = row0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][j];
  }
}

// Sum of `value` over the block; the result is valid in thread 0. Every thread must call it.
__device__ double BlockSum(double value) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  return partial[0];
}

// Block blockIdx.x = b·chunks + chunk sums the elements chunk·kThreads + tid + j·chunks·kThreads
// of item b, so the blocks of one item interleave and together cover it exactly once.
// kAbsolute: Σ |x| instead of Σ x² (Backend::SumAbs).
template <bool kAbsolute>
__global__ void SumSquaresPartialKernel(const float* x, int64_t count, int chunks, double* partials) {
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const float* item = x + b * count;
  double acc = 0.0;
  for (int64_t i = chunk * kThreads + threadIdx.x; i < count; i += static_cast<int64_t>(chunks) * kThreads) {
    const double v = item[i];
    acc += kAbsolute ? fabs(v) : v * v;
  }
  const double sum = BlockSum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// One block per item: sums[b] = Σ_chunk partials[b·chunks + chunk].
__global__ void SumPartialsKernel(const double* partials, int chunks, double* sums) {
  const double* item = partials + static_cast<int64_t>(blockIdx.x) * chunks;
  double acc = 0.0;
  for (int i = threadIdx.x; i < chunks; i += kThreads) acc += item[i];
  const double sum = BlockSum(acc);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

// One block for one matrix's lines (Backend::NormuonScales). Pass 1 adds up Σ sum and Σ s²·sum
// (per thread over its lines, then BlockSum: a fixed order, so the same bits run after run); pass 2
// recomputes each line's moment and scale from the untouched moment, stores the moment and writes
// the scale. Each thread's pass-2 lines are its pass-1 lines, so no thread stores a moment another
// still has to read.
__global__ void NormuonScalesKernel(const double* line_sums, int64_t length, double count, float weight, double eps,
                                    StoredRef moment2, float* scales) {
  double norm2 = 0.0, scaled_norm2 = 0.0;
  for (int64_t j = threadIdx.x; j < length; j += blockDim.x) {
    const double sum = line_sums[j];
    const double s = NormuonLineScale(NormuonMoment(sum, count, weight, LoadElement(moment2, j)), eps);
    norm2 += sum;
    scaled_norm2 += s * s * sum;
  }
  __shared__ double totals[2];
  const double total = BlockSum(norm2);
  if (threadIdx.x == 0) totals[0] = total;  // thread 0 reads its sum before the next BlockSum writes
  const double scaled_total = BlockSum(scaled_norm2);
  if (threadIdx.x == 0) totals[1] = scaled_total;
  __syncthreads();
  const double ratio = totals[1] > 0 ? sqrt(totals[0] / totals[1]) : 0.0;
  for (int64_t j = threadIdx.x; j < length; j += blockDim.x) {
    const float m = NormuonMoment(line_sums[j], count, weight, LoadElement(moment2, j));
    StoreElement(moment2, j, m);
    scales[j] = static_cast<float>(NormuonLineScale(m, eps) * ratio);
  }
}

// One block for one matrix's lines (Backend::NamoScales). Pass 1 adds up the unclamped scales
// (per thread over its lines, then BlockSum: a fixed order); pass 2 recomputes each line's moment
// and scale from the untouched moment, stores the moment and writes the clamped scale. Each
// thread's pass-2 lines are its pass-1 lines, so no thread stores a moment another still reads.
__global__ void NamoScalesKernel(NamoArgs args, const double* grad_sums, const double* update_sums, int64_t lines,
                                 StoredRef moment2, float* scales) {
  double total = 0.0;
  for (int64_t j = threadIdx.x; j < lines; j += blockDim.x) {
    total +=
        NamoLineScale(args, update_sums[j], NormuonMoment(grad_sums[j], 1.0, args.weight, LoadElement(moment2, j)));
  }
  __shared__ double mean;
  const double sum = BlockSum(total);
  if (threadIdx.x == 0) mean = sum / static_cast<double>(lines);
  __syncthreads();
  for (int64_t j = threadIdx.x; j < lines; j += blockDim.x) {
    const float v = NormuonMoment(grad_sums[j], 1.0, args.weight, LoadElement(moment2, j));
    StoreElement(moment2, j, v);
    scales[j] = static_cast<float>(NamoClamped(NamoLineScale(args, update_sums[j], v), mean, args.clamp));
  }
}

// Backend::InverseRootScales: one thread per line.
__global__ void InverseRootScalesKernel(const double* sums, int64_t length, double eps, float* scales) {
  for (int64_t j = FirstIndex(); j < length; j += GridStride())
    scales[j] = static_cast<float>(1.0 / sqrt(sums[j] + eps));
}

// Backend::AolScales: one thread per row of the batch's Gram matrices.
__global__ void AolScalesKernel(const float* gram, int64_t m, int64_t rows, double floor, float* scales) {
  for (int64_t row = FirstIndex(); row < rows; row += GridStride()) {
    double sum = 0.0;
    for (int64_t j = 0; j < m; ++j) sum += fabs(static_cast<double>(gram[row * m + j]));
    // Not fmax, which drops a NaN: the CPU's std::max keeps it (a NaN row stays NaN there).
    scales[row] = static_cast<float>(1.0 / sqrt(sum < floor ? floor : sum));
  }
}

__global__ void FlagNonFiniteKernel(const float* x, int64_t n, int* flag) {
  // Every writer stores the same value, so the race between writers is harmless.
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    if (!isfinite(x[i])) *flag = 1;
  }
}

__global__ void MomentumKernel(MomentumArgs args, StoredRef momentum, const float* grad, float* update, int64_t n) {
  // grad[i] is read (by value) before update[i] is written, so the two may alias.
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float m = LoadElement(momentum, i);
    MomentumElement(args, m, grad[i], update[i]);
    StoreElement(momentum, i, m);
  }
}

__global__ void AdamWKernel(AdamWArgs args, StoredRef param, const float* grad, StoredRef exp_avg, StoredRef exp_avg_sq,
                            int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float p = LoadElement(param, i), m = LoadElement(exp_avg, i), v = LoadElement(exp_avg_sq, i);
    AdamWElement(args, p, grad[i], m, v);
    StoreElement(param, i, p);
    StoreElement(exp_avg, i, m);
    StoreElement(exp_avg_sq, i, v);
  }
}

__global__ void LionKernel(LionArgs args, StoredRef param, const float* grad, StoredRef exp_avg, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float p = LoadElement(param, i), m = LoadElement(exp_avg, i);
    LionElement(args, p, grad[i], m);
    StoreElement(param, i, p);
    StoreElement(exp_avg, i, m);
  }
}

template <bool kBf16>
__global__ void WidenKernel(const uint16_t* packed, float* out, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    out[i] = kBf16 ? Bf16ToFloat(packed[i]) : Fp16ToFloat(packed[i]);
  }
}

template <bool kBf16>
__global__ void NarrowKernel(const float* in, uint16_t* packed, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    packed[i] = kBf16 ? FloatToBf16(in[i]) : FloatToFp16(in[i]);
  }
}

__global__ void AdamuonKernel(AdamuonArgs args, StoredRef moment2, float* update, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float v = LoadElement(moment2, i);
    AdamuonElement(args, v, update[i]);
    StoreElement(moment2, i, v);
  }
}

__global__ void CautiousUpdateKernel(CautiousArgs args, const float* update, StoredRef param, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float p = LoadElement(param, i);
    CautiousUpdateElement(args, update[i], p);
    StoreElement(param, i, p);
  }
}

__global__ void SgdKernel(SgdArgs args, StoredRef param, const float* grad, StoredRef momentum_buffer, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float p = LoadElement(param, i), b = LoadElement(momentum_buffer, i);
    SgdElement(args, p, grad[i], b);
    StoreElement(param, i, p);
    StoreElement(momentum_buffer, i, b);
  }
}

}  // namespace

cudaError_t LaunchFill(float* x, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchAddToDiagonal(float* a, int64_t m, int64_t batch, float value, cudaStream_t stream) {
  const int64_t n = m * batch;
  if (n <= 0) return cudaSuccess;
  AddToDiagonalKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, m, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchAxpby(float alpha, StoredRef x, float beta, StoredRef y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AxpbyKernel<<<BlocksFor(n), kThreads, 0, stream>>>(alpha, x, beta, y, n);
  return cudaGetLastError();
}

cudaError_t LaunchScaleBatched(float* x, int64_t count, int64_t batch, const float* scales, cudaStream_t stream) {
  const int64_t total = count * batch;
  if (total <= 0) return cudaSuccess;
  ScaleBatchedKernel<<<BlocksFor(total), kThreads, 0, stream>>>(x, count, total, scales);
  return cudaGetLastError();
}

cudaError_t LaunchScaleBatchedInline(float* x, int64_t count, int64_t batch, const InlineScales& scales,
                                     cudaStream_t stream) {
  const int64_t total = count * batch;
  if (total <= 0) return cudaSuccess;
  if (batch > kInlineScales) return cudaErrorInvalidValue;
  ScaleBatchedInlineKernel<<<BlocksFor(total), kThreads, 0, stream>>>(x, count, total, scales);
  return cudaGetLastError();
}

cudaError_t LaunchInverseNormScales(const double* sums, int64_t batch, double eps, double norm_safety, float* scales,
                                    cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  InverseNormScalesKernel<<<BlocksFor(batch), kThreads, 0, stream>>>(sums, batch, eps, norm_safety, scales);
  return cudaGetLastError();
}

cudaError_t LaunchScaleMatrices(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride, int64_t batch, float beta,
                                cudaStream_t stream) {
  const int64_t total = m * n * batch;
  if (total <= 0) return cudaSuccess;
  ScaleMatricesKernel<<<BlocksFor(total), kThreads, 0, stream>>>(c, m, n, ldc, stride, total, beta);
  return cudaGetLastError();
}

cudaError_t LaunchToBf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ToBf16Kernel<<<BlocksFor(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchTranspose(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch,
                            cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || batch <= 0) return cudaSuccess;
  if (rows > kTransposeMaxRows) return cudaErrorInvalidValue;
  const int64_t matrix = rows * cols;
  // gridDim.z is limited to 65535: larger batches go in slices.
  constexpr int64_t kMaxZ = 65535;
  for (int64_t first = 0; first < batch; first += kMaxZ) {
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>((rows + kTile - 1) / kTile),
                    static_cast<unsigned>(std::min(kMaxZ, batch - first)));
    TransposeKernel<<<grid, dim3(kTile, kTileRows), 0, stream>>>(in + first * matrix, out + first * matrix, rows, cols);
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

int SumSquaresChunks(int64_t count) {
  // About 16 elements per thread per block, at most 1024 blocks per item (then each block simply
  // loops further); at least one block so that an empty item still writes its zero.
  constexpr int64_t kPerBlock = int64_t{kThreads} * 16;
  return static_cast<int>(std::clamp<int64_t>((count + kPerBlock - 1) / kPerBlock, 1, 1024));
}

cudaError_t LaunchSumSquares(const float* x, int64_t count, int64_t batch, int chunks, double* partials, double* sums,
                             cudaStream_t stream, bool absolute) {
  if (batch <= 0) return cudaSuccess;
  if (absolute) {
    SumSquaresPartialKernel<true>
        <<<static_cast<unsigned>(batch * chunks), kThreads, 0, stream>>>(x, count, chunks, partials);
  } else {
    SumSquaresPartialKernel<false>
        <<<static_cast<unsigned>(batch * chunks), kThreads, 0, stream>>>(x, count, chunks, partials);
  }
  if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  SumPartialsKernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(partials, chunks, sums);
  return cudaGetLastError();
}

cudaError_t LaunchNormuonScales(const double* line_sums, int64_t length, int64_t count, float weight, double eps,
                                StoredRef moment2, float* scales, cudaStream_t stream) {
  if (length <= 0) return cudaSuccess;
  NormuonScalesKernel<<<1, kThreads, 0, stream>>>(line_sums, length, static_cast<double>(count), weight, eps, moment2,
                                                  scales);
  return cudaGetLastError();
}

cudaError_t LaunchNamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums, int64_t lines,
                             StoredRef moment2, float* scales, cudaStream_t stream) {
  if (lines <= 0) return cudaSuccess;
  NamoScalesKernel<<<1, kThreads, 0, stream>>>(args, grad_sums, update_sums, lines, moment2, scales);
  return cudaGetLastError();
}

cudaError_t LaunchInverseRootScales(const double* sums, int64_t length, double eps, float* scales,
                                    cudaStream_t stream) {
  if (length <= 0) return cudaSuccess;
  InverseRootScalesKernel<<<BlocksFor(length), kThreads, 0, stream>>>(sums, length, eps, scales);
  return cudaGetLastError();
}

cudaError_t LaunchAolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales,
                            cudaStream_t stream) {
  const int64_t rows = m * batch;
  if (rows <= 0) return cudaSuccess;
  AolScalesKernel<<<BlocksFor(rows), kThreads, 0, stream>>>(gram, m, rows, floor, scales);
  return cudaGetLastError();
}

cudaError_t LaunchFlagNonFinite(const float* x, int64_t n, int* flag, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FlagNonFiniteKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, n, flag);
  return cudaGetLastError();
}

cudaError_t LaunchMomentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update, int64_t n,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MomentumKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, momentum, grad, update, n);
  return cudaGetLastError();
}

cudaError_t LaunchAdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                        StoredRef exp_avg_sq, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AdamWKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, param, grad, exp_avg, exp_avg_sq, n);
  return cudaGetLastError();
}

cudaError_t LaunchLion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg, int64_t n,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  LionKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, param, grad, exp_avg, n);
  return cudaGetLastError();
}

cudaError_t LaunchSgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer, int64_t n,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  SgdKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, param, grad, momentum_buffer, n);
  return cudaGetLastError();
}

cudaError_t LaunchWiden(StorageDtype dtype, const uint16_t* packed, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dtype == StorageDtype::kBf16) {
    WidenKernel<true><<<BlocksFor(n), kThreads, 0, stream>>>(packed, out, n);
  } else {
    WidenKernel<false><<<BlocksFor(n), kThreads, 0, stream>>>(packed, out, n);
  }
  return cudaGetLastError();
}

cudaError_t LaunchNarrow(StorageDtype dtype, const float* in, uint16_t* packed, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dtype == StorageDtype::kBf16) {
    NarrowKernel<true><<<BlocksFor(n), kThreads, 0, stream>>>(in, packed, n);
  } else {
    NarrowKernel<false><<<BlocksFor(n), kThreads, 0, stream>>>(in, packed, n);
  }
  return cudaGetLastError();
}

cudaError_t LaunchAdamuon(const AdamuonArgs& args, StoredRef moment2, float* update, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AdamuonKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, moment2, update, n);
  return cudaGetLastError();
}

cudaError_t LaunchCautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, int64_t n,
                                 cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  CautiousUpdateKernel<<<BlocksFor(n), kThreads, 0, stream>>>(args, update, param, n);
  return cudaGetLastError();
}

}  // namespace muond::kernels::cuda
