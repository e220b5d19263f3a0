// The CUDA kernels of the CUDA backend, behind plain launcher functions.
//
// Each launcher enqueues its kernel on `stream` and returns the launch error (cudaGetLastError), so
// a bad launch configuration is reported at once; faults while the kernel runs surface at the next
// synchronizing call of the backend. Sizes are element counts; an empty range launches nothing.
// All pointers are device pointers unless named *_host. Element-wise kernels evaluate the shared
// formulas of kernels/elementwise.h, so they compute exactly what the CPU loops compute (the library
// is compiled with -fmad=false, see kernels/CMakeLists.txt).
//
// Stateless; thread-safe in the sense that launchers share nothing (the caller serializes use of a
// stream if it needs ordering).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/elementwise.h"
#include "kernels/storage_dtype.h"

namespace muond::kernels::cuda {

// x[i] = value
cudaError_t LaunchFill(float* x, int64_t n, float value, cudaStream_t stream);
// a_b[j][j] += value for a batch of m×m matrices stored back to back.
cudaError_t LaunchAddToDiagonal(float* a, int64_t m, int64_t batch, float value, cudaStream_t stream);
// y[i] = alpha·x[i] + beta·y[i] (x and y in their storage formats)
cudaError_t LaunchAxpby(float alpha, StoredRef x, float beta, StoredRef y, int64_t n, cudaStream_t stream);
// out[i] = widen(packed[i]) and packed[i] = round(in[i]) for a 16-bit StorageDtype (kBf16, kFp16),
// with common/half_float.h's conversions, the CPU backend's.
cudaError_t LaunchWiden(StorageDtype dtype, const uint16_t* packed, float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchNarrow(StorageDtype dtype, const float* in, uint16_t* packed, int64_t n, cudaStream_t stream);
// x[b·count + i] *= scales[b] (scales in device memory)
cudaError_t LaunchScaleBatched(float* x, int64_t count, int64_t batch, const float* scales, cudaStream_t stream);
// The same with at most kInlineScales scales passed by value in the launch's parameters, so that no
// copy from the host precedes the kernel (a pageable copy would stage through the driver).
constexpr int64_t kInlineScales = 64;
struct InlineScales {
  float v[kInlineScales];
};
cudaError_t LaunchScaleBatchedInline(float* x, int64_t count, int64_t batch, const InlineScales& scales,
                                     cudaStream_t stream);
// scales[b] = fp32(1 / d) with d = norm_safety·√sums[b] + eps in fp64, or 0 where d ≤ 0, b < batch:
// Backend::NormalizeBatched's scales, computed where the sums are. The same IEEE-rounded fp64
// operations in the same order as the host's (no contraction under -fmad=false), so the same
// sums give the same bits.
cudaError_t LaunchInverseNormScales(const double* sums, int64_t batch, double eps, double norm_safety, float* scales,
                                    cudaStream_t stream);
// The k = 0 GEMM: C_b ← beta·C_b for row-major m×n matrices with leading dimension ldc, C_b at
// c + b·stride; beta = 0 writes zeros without reading C (BLAS semantics: NaN in C does not survive).
cudaError_t LaunchScaleMatrices(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride, int64_t batch, float beta,
                                cudaStream_t stream);
// out[i] = bf16(in[i]), rounded to nearest even.
cudaError_t LaunchToBf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream);

// out_b = in_bᵀ for `batch` row-major rows×cols matrices stored back to back. `in` and `out` must
// not overlap. Needs ceil(rows / 32) ≤ 65535 (rows ≤ 2,097,120); the caller checks.
constexpr int64_t kTransposeMaxRows = int64_t{65535} * 32;
cudaError_t LaunchTranspose(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch,
                            cudaStream_t stream);

// sums[b] = Σ_i x[b·count + i]² in fp64, b < batch, in two passes: `chunks` blocks per batch item
// write partial sums to `partials` (batch·chunks doubles), then one block per item adds them up.
// Deterministic: the same input gives the same bits on the same device. `absolute`: Σ |x| instead.
int SumSquaresChunks(int64_t count);
cudaError_t LaunchSumSquares(const float* x, int64_t count, int64_t batch, int chunks, double* partials, double* sums,
                             cudaStream_t stream, bool absolute = false);

// Backend::NormuonScales for one matrix of `length` lines of `count` elements: one block, sums
// in a fixed order (deterministic on a device; not the CPU's order, so within rounding of it).
cudaError_t LaunchNormuonScales(const double* line_sums, int64_t length, int64_t count, float weight, double eps,
                                StoredRef moment2, float* scales, cudaStream_t stream);

// Backend::NamoScales for one matrix of `lines` lines: one block, the mean summed in a fixed
// order (deterministic on a device; not the CPU's order, so within rounding of it).
cudaError_t LaunchNamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums, int64_t lines,
                             StoredRef moment2, float* scales, cudaStream_t stream);

// Backend::InverseRootScales: scales[j] = fp32(1/√(sums[j] + eps)), one thread per line.
cudaError_t LaunchInverseRootScales(const double* sums, int64_t length, double eps, float* scales, cudaStream_t stream);

// Backend::AolScales, one thread per row.
cudaError_t LaunchAolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales,
                            cudaStream_t stream);

// Sets *flag = 1 when some x[i] is NaN or ±inf; never writes 0 (the caller zeroes the flag).
cudaError_t LaunchFlagNonFinite(const float* x, int64_t n, int* flag, cudaStream_t stream);

// The optimizer steps; one thread per element evaluates the matching *Element function, loading
// the state (StoredRef) as fp32 and storing it rounded to its format. `update` may alias `grad` in
// LaunchMomentum.
cudaError_t LaunchMomentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update, int64_t n,
                           cudaStream_t stream);
cudaError_t LaunchAdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                        StoredRef exp_avg_sq, int64_t n, cudaStream_t stream);
cudaError_t LaunchLion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg, int64_t n,
                       cudaStream_t stream);
cudaError_t LaunchSgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer, int64_t n,
                      cudaStream_t stream);
cudaError_t LaunchAdamuon(const AdamuonArgs& args, StoredRef moment2, float* update, int64_t n, cudaStream_t stream);
cudaError_t LaunchCautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, int64_t n,
                                 cudaStream_t stream);

}  // namespace muond::kernels::cuda
