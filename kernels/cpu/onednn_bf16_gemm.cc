#include "kernels/cpu/onednn_bf16_gemm.h"

#ifdef MUOND_HAVE_DNNL
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <omp.h>

#include <algorithm>
#include <exception>
#include <oneapi/dnnl/dnnl.hpp>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace muond::kernels {
namespace {

using dnnl::memory;

// What CPUID says, for the reason given when oneDNN's choice is not a bf16 kernel.
bool CpuHasBf16DotProducts() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  bool avx512_bf16 = false, amx_bf16 = false;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) avx512_bf16 = (eax >> 5) & 1u;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) amx_bf16 = (edx >> 22) & 1u;
  return avx512_bf16 || amx_bf16;
#else
  return false;  // oneDNN 2.x has bf16 matmul kernels for x86 only
#endif
}

const char* IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);  // lives for the process
  return *engine;
}

Bf16Support Probe() {
  Bf16Support s;
  const dnnl_version_t* v = dnnl_version();
  s.library = absl::StrCat("oneDNN ", v->major, ".", v->minor, ".", v->patch);
  const bool cpu_has = CpuHasBf16DotProducts();
  try {
    const memory::dim n = 64;
    const memory::desc a({n, n}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc c({n, n}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), Engine());
    s.kernel = pd.impl_info_str();
  } catch (const std::exception& e) {
    s.reason = absl::StrCat(s.library, " has no bf16 matmul on this CPU (", e.what(), ")");
    return s;
  }
  // oneDNN names its kernels after the ISA they need: "brg:avx512_core_bf16", "brg:avx512_core_amx".
  s.available = absl::StrContains(s.kernel, "bf16") || absl::StrContains(s.kernel, "amx");
  if (!s.available) {
    const char* isa = IsaName(dnnl::get_effective_cpu_isa());
    s.reason = cpu_has ? absl::StrCat(s.library, " runs bf16 matmuls with ", s.kernel, " (ISA capped at ", isa,
                                      ", e.g. by ONEDNN_MAX_CPU_ISA), not with bf16 dot products")
                       : absl::StrCat("the CPU has no bf16 dot-product instructions (AVX512-BF16 or AMX-BF16); ",
                                      s.library, " would emulate them with ", s.kernel);
  }
  return s;
}

}  // namespace

const Bf16Support& Bf16GemmSupport() {
  static const Bf16Support support = Probe();
  return support;
}

// A matmul over packed bf16 operands, and the reorders that round the caller's fp32 operands into
// them (B's only when it is not A's storage).
struct OnednnBf16Gemm::Primitive {
  memory::desc a32, b32, a, b, c;
  dnnl::reorder to_a, to_b;
  dnnl::matmul matmul;
};

OnednnBf16Gemm::OnednnBf16Gemm(int threads) : threads_(std::max(threads, 1)) {}
OnednnBf16Gemm::~OnednnBf16Gemm() = default;

bool OnednnBf16Gemm::Run(const GemmShape& s, float alpha, const float* a, const float* b, float beta, float* c) {
  if (s.batch > 1 && s.stride_c < s.m * s.ldc) return false;  // C matrices overlap: not a matmul's dst
  // This thread's OpenMP teams, oneDNN's: before any primitive is made, as oneDNN sizes a primitive's
  // work split (and the team it runs on) by the thread count when it is created.
  omp_set_num_threads(threads_);
  // Custom coefficient lists could make many (α, β) pairs: keep the cache bounded.
  if (primitives_.size() >= 256) primitives_.clear();
  const bool ta = s.trans_a == Transpose::kYes, tb = s.trans_b == Transpose::kYes;
  // Stored shapes: op(A) is m×k, stored k×m when transposed; op(B) k×n, stored n×k when transposed.
  const int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
  const int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
  // A batch stride of 0 broadcasts one matrix to the whole batch.
  const int64_t a_batch = s.stride_a == 0 ? 1 : s.batch, b_batch = s.stride_b == 0 ? 1 : s.batch;
  const bool shared = a == b && a_rows == b_rows && a_cols == b_cols && s.lda == s.ldb && s.stride_a == s.stride_b;
  const size_t a_size = static_cast<size_t>(a_batch * a_rows * a_cols);
  const size_t b_size = shared ? 0 : static_cast<size_t>(b_batch * b_rows * b_cols);

  const Key key{static_cast<int>(ta),
                static_cast<int>(tb),
                static_cast<int>(shared),
                s.m,
                s.n,
                s.k,
                s.lda,
                s.ldb,
                s.ldc,
                s.stride_a,
                s.stride_b,
                s.stride_c,
                s.batch,
                alpha,
                beta};
  std::unique_ptr<Primitive>& entry = primitives_[key];
  if (entry == nullptr) {
    auto p = std::make_unique<Primitive>();
    p->a = memory::desc({a_batch, s.m, s.k}, memory::data_type::bf16,
                        ta ? memory::dims{s.m * s.k, 1, s.m} : memory::dims{s.m * s.k, s.k, 1});
    p->b = memory::desc({b_batch, s.k, s.n}, memory::data_type::bf16,
                        tb ? memory::dims{s.k * s.n, 1, s.k} : memory::dims{s.k * s.n, s.n, 1});
    p->c = memory::desc({s.batch, s.m, s.n}, memory::data_type::f32, memory::dims{s.stride_c, s.ldc, 1});
    // The caller's operands as stored (row stride ld, batch stride), read by the rounding reorders.
    // A broadcast matrix's batch stride (0) is given as a whole matrix's: its dimension is 1 anyway.
    const int64_t sa = a_batch == 1 ? a_rows * s.lda : s.stride_a, sb = b_batch == 1 ? b_rows * s.ldb : s.stride_b;
    p->a32 = memory::desc({a_batch, s.m, s.k}, memory::data_type::f32,
                          ta ? memory::dims{sa, 1, s.lda} : memory::dims{sa, s.lda, 1});
    p->b32 = memory::desc({b_batch, s.k, s.n}, memory::data_type::f32,
                          tb ? memory::dims{sb, 1, s.ldb} : memory::dims{sb, s.ldb, 1});
    dnnl::primitive_attr attr;
    // Constant scales: a runtime scale would send oneDNN 2.6 to its slower non-brgemm kernel. The
    // few (α, β) pairs of a coefficient set each get a primitive, kept in primitives_.
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);  // C = α·A·B + β·C
      attr.set_post_ops(ops);
    }
    try {
      p->matmul = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(p->a, p->b, p->c), attr, Engine()));
      p->to_a = dnnl::reorder(dnnl::reorder::primitive_desc(Engine(), p->a32, Engine(), p->a));
      if (!shared) p->to_b = dnnl::reorder(dnnl::reorder::primitive_desc(Engine(), p->b32, Engine(), p->b));
    } catch (const std::exception&) {
      primitives_.erase(key);
      return false;
    }
    entry = std::move(p);
  }
  Primitive& prim = *entry;

  if (scratch_.size() < a_size + b_size) {
    scratch_.clear();
    scratch_.shrink_to_fit();  // free the old scratch first so peak memory is not old + new
    scratch_.resize(a_size + b_size);
  }
  uint16_t* a16 = scratch_.data();
  uint16_t* b16 = shared ? a16 : a16 + a_size;
  dnnl::stream stream(Engine());
  memory a32(prim.a32, Engine(), const_cast<float*>(a)), a_mem(prim.a, Engine(), a16);
  memory b_mem(prim.b, Engine(), b16), c_mem(prim.c, Engine(), c);
  prim.to_a.execute(stream, a32, a_mem);
  if (!shared) {
    memory b32(prim.b32, Engine(), const_cast<float*>(b));
    prim.to_b.execute(stream, b32, b_mem);
  }
  prim.matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
  stream.wait();
  return true;
}

}  // namespace muond::kernels
#else  // built without oneDNN 2.x: every bf16 GEMM is the fp32 one.

namespace muond::kernels {

const Bf16Support& Bf16GemmSupport() {
  static const Bf16Support support{.reason =
                                       "muond was built without oneDNN 2.x (libdnnl-dev), which it needs for them"};
  return support;
}

struct OnednnBf16Gemm::Primitive {};
OnednnBf16Gemm::OnednnBf16Gemm(int threads) : threads_(threads) {}
OnednnBf16Gemm::~OnednnBf16Gemm() = default;
bool OnednnBf16Gemm::Run(const GemmShape&, float, const float*, const float*, float, float*) { return false; }

}  // namespace muond::kernels
#endif
