// OnednnBf16Gemm: the CPU backend's GEMMs for matmul_precision = bf16, through oneDNN's matmul on
// CPUs with bf16 dot-product instructions (AVX512-BF16's vdpbf16ps, or AMX-BF16 tiles).
//
// Semantics are the CUDA backend's: each operand is rounded to the nearest bf16 (ties to even; the
// bf16 instructions treat subnormal inputs as zero), the products are accumulated in fp32 and C
// stays fp32, so C = α·op(A)·op(B) + β·C with only the operands narrowed. The iterate of
// Newton–Schulz therefore stays fp32 between GEMMs. oneDNN reorders round the operands into bf16
// scratch packed densely (leading dimensions and batch strides dropped), once when A and B are the
// same storage (X·Xᵀ, A·A); then one batched oneDNN matmul writes C in place.
//
// Bf16GemmSupport() decides once per process whether the path is used: it asks oneDNN for a bf16
// matmul and accepts it only when oneDNN picks a kernel that runs on bf16 dot-product instructions
// (an implementation named for avx512_core_bf16 or AMX). Otherwise `reason` says why (the CPU lacks
// the instructions; oneDNN capped below them, e.g. by ONEDNN_MAX_CPU_ISA; no bf16 matmul at all; a
// build without oneDNN 2.x, where Run always declines), and the CPU backend computes such GEMMs in
// fp32.
//
// Threads: oneDNN runs on OpenMP (Debian's build: libgomp); Run sets the calling thread's OpenMP
// thread count to the count given at construction (the daemon's --threads) before each call, so the
// reorders and the matmul never use more.
//
// Ownership: the object owns its bf16 scratch and its cached oneDNN primitives. Thread-safety:
// Bf16GemmSupport() is thread-safe; an OnednnBf16Gemm is not — the CPU backend calls Run under its
// compute gate, one call at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"

namespace muond::kernels {

struct Bf16Support {
  bool available = false;
  std::string kernel;   // oneDNN's implementation for a bf16 matmul, e.g. "brg:avx512_core_bf16"
  std::string library;  // "oneDNN 2.6.3"
  std::string reason;   // why not, when !available
};

// Probed on first call, then fixed for the process.
const Bf16Support& Bf16GemmSupport();

class OnednnBf16Gemm {
 public:
  explicit OnednnBf16Gemm(int threads);
  ~OnednnBf16Gemm();
  OnednnBf16Gemm(const OnednnBf16Gemm&) = delete;
  OnednnBf16Gemm& operator=(const OnednnBf16Gemm&) = delete;

  // C = alpha·op(A)·op(B) + beta·C as described above, for k > 0 (the caller handles empty
  // products). Returns false, having done nothing, when oneDNN cannot express the shape (C matrices
  // of a batch sharing storage); the caller then computes in fp32.
  bool Run(const GemmShape& shape, float alpha, const float* a, const float* b, float beta, float* c);

  // Bytes of bf16 scratch held.
  int64_t scratch_bytes() const { return static_cast<int64_t>(scratch_.capacity() * sizeof(uint16_t)); }

 private:
  struct Primitive;
  // (trans_a, trans_b, A is B, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch, alpha, beta)
  using Key = std::tuple<int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, float, float>;

  const int threads_;
  std::vector<uint16_t> scratch_;  // bf16 A, then bf16 B when it is not A's storage
  std::map<Key, std::unique_ptr<Primitive>> primitives_;
};

}  // namespace muond::kernels
