// cpu_precision_bench: Newton–Schulz on the CPU backend in fp32 and bf16 beside the GEMM peaks of
// the libraries under it, in one run: OpenBLAS's sgemm (muond's fp32 GEMMs), oneDNN's fp32 matmul
// and oneDNN's bf16 matmul with fp32 accumulation (muond's bf16 GEMMs, operands already bf16), each
// on the same GEMM shapes at the same thread count, then muond's optim::NewtonSchulz (5 steps, the
// default set, standard iteration) in both precisions, with the ratios bf16/fp32 and NS/peak.
//
// A GEMM's peak is the best of `reps` back-to-back calls (after a warm-up); NS is the mean of `reps`
// calls, as ns_bench counts it (4·m²·n + 2·m³ FLOPs per step). Not thread-safe; one run at a time:
// every figure is the whole machine's at --threads.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_common.h"
#include "kernels/cpu/onednn_bf16_gemm.h"
#include "kernels/optim/newton_schulz.h"

namespace muond::bench {
namespace {

struct Flags {
  int threads = 2;
  int reps = 5;
  bool quick = false;
};

struct GemmCase {
  int64_t m, n, k;
  std::string Name() const { return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k); }
  double Flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

template <typename F>
double BestSeconds(int reps, F&& call) {
  call();  // warm-up: JIT, page faults, thread start
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double start = NowSeconds();
    call();
    best = std::min(best, NowSeconds() - start);
  }
  return best;
}

double OpenBlasPeak(const GemmCase& g, int reps) {
  std::vector<float> a(g.m * g.k, 0.5f), b(g.k * g.n, 0.25f), c(g.m * g.n);
  const double s = BestSeconds(reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.m, g.n, g.k, 1.0f, a.data(), g.k, b.data(), g.n, 0.0f,
                c.data(), g.n);
  });
  return g.Flops() / s / 1e12;
}

// oneDNN's matmul with plain row-major operands of `type` and an fp32 result.
double OnednnPeak(const GemmCase& g, dnnl::memory::data_type type, int reps) {
  using dnnl::memory;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc a({g.m, g.k}, type, memory::format_tag::ab), b({g.k, g.n}, type, memory::format_tag::ab);
  const memory::desc c({g.m, g.n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::matmul matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), engine));
  memory am(a, engine), bm(b, engine), cm(c, engine);
  const size_t bytes = type == memory::data_type::bf16 ? 2 : 4;
  std::fill_n(static_cast<char*>(am.get_data_handle()), g.m * g.k * bytes, 0x3e);  // small finite values
  std::fill_n(static_cast<char*>(bm.get_data_handle()), g.k * g.n * bytes, 0x3e);
  const double s = BestSeconds(reps, [&] {
    matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
  });
  return g.Flops() / s / 1e12;
}

double NsTflops(kernels::Backend& backend, const NsShape& shape, kernels::MatmulPrecision precision, int reps) {
  const size_t total = static_cast<size_t>(shape.rows * shape.cols * shape.batch);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> host(total);
  for (float& x : host) x = normal(rng);
  auto in = backend.Allocate(total);
  auto out = backend.Allocate(total);
  CheckOk(in.status(), "allocate input");
  CheckOk(out.status(), "allocate output");
  CheckOk(backend.CopyToDevice(host.data(), (*in)->data(), total), "upload");
  optim::NsWorkspace ws;
  const optim::NsSchedule schedule;
  auto call = [&] {
    CheckOk(optim::NewtonSchulz(backend, schedule, 5, 1e-7, 1.0, precision, (*in)->data(), (*out)->data(), shape.rows,
                                shape.cols, shape.batch, ws),
            "NewtonSchulz");
  };
  call();
  const double start = NowSeconds();
  for (int i = 0; i < reps; ++i) call();
  return shape.Flops(5) / ((NowSeconds() - start) / reps) / 1e12;
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie("cpu", flags.threads);
  omp_set_num_threads(flags.threads);  // oneDNN's peaks on the backend's thread count
  const kernels::Bf16Support& bf16 = kernels::Bf16GemmSupport();
  std::printf("CPU backend: %s\n", backend->Detail().c_str());
  if (!bf16.available) std::printf("bf16 GEMMs fall back to fp32 here: %s\n", bf16.reason.c_str());
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  std::printf("oneDNN's OpenMP waits: %s\n",
              wait_policy != nullptr ? wait_policy : "libgomp's default (spin, then sleep; OMP_WAIT_POLICY unset)");

  // The NS GEMMs of 1024x2752 (X·Xᵀ, A·A, B·X) and a large square one.
  std::vector<GemmCase> gemms = {{1024, 1024, 2752}, {1024, 1024, 1024}, {1024, 2752, 1024}, {2048, 2048, 2048}};
  if (flags.quick) gemms = {{256, 256, 688}, {512, 512, 512}};
  std::printf("\nGEMM peak, TFLOP/s (best of %d, %d threads)\n", flags.reps, flags.threads);
  std::printf("%-18s %10s %10s %10s %10s\n", "m x n x k", "OpenBLAS", "oneDNN", "oneDNN", "bf16/");
  std::printf("%-18s %10s %10s %10s %10s\n", "", "fp32", "fp32", "bf16", "fp32");
  double blas_peak = 0, dnnl_fp32_peak = 0, bf16_peak = 0;
  for (const GemmCase& g : gemms) {
    const double blas = OpenBlasPeak(g, flags.reps);
    const double f32 = OnednnPeak(g, dnnl::memory::data_type::f32, flags.reps);
    const double b16 = OnednnPeak(g, dnnl::memory::data_type::bf16, flags.reps);
    blas_peak = std::max(blas_peak, blas);
    dnnl_fp32_peak = std::max(dnnl_fp32_peak, f32);
    bf16_peak = std::max(bf16_peak, b16);
    std::printf("%-18s %10.3f %10.3f %10.3f %9.2fx\n", g.Name().c_str(), blas, f32, b16, b16 / std::max(blas, f32));
    std::fflush(stdout);
  }
  const double fp32_peak = std::max(blas_peak, dnnl_fp32_peak);

  std::printf("\nmuond Newton-Schulz (5 steps, standard), TFLOP/s (mean of %d)\n", flags.reps);
  std::printf("%-18s %10s %10s %10s %10s %10s\n", "shape", "fp32", "bf16", "bf16/fp32", "fp32/peak", "bf16/peak");
  const std::vector<NsShape> shapes =
      flags.quick ? std::vector<NsShape>{{256, 688, 1}} : std::vector<NsShape>{{1024, 2752, 1}, {192, 768, 6}};
  for (const NsShape& shape : shapes) {
    const double f32 = NsTflops(*backend, shape, kernels::MatmulPrecision::kFp32, flags.reps);
    const double b16 = NsTflops(*backend, shape, kernels::MatmulPrecision::kBf16, flags.reps);
    std::printf("%-18s %10.3f %10.3f %9.2fx %9.0f%% %9.0f%%\n", shape.Name().c_str(), f32, b16, b16 / f32,
                100 * f32 / fp32_peak, 100 * b16 / bf16_peak);
    std::fflush(stdout);
  }
  std::printf("\npeaks: fp32 %.3f (best of OpenBLAS and oneDNN), bf16 %.3f (oneDNN): bf16/fp32 %.2fx\n", fp32_peak,
              bf16_peak, bf16_peak / fp32_peak);
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::StartOnTheDaemonsBlasKernel(argv);
  muond::bench::Flags flags;
  CLI::App app{"CPU GEMM peaks (OpenBLAS fp32, oneDNN fp32 and bf16) and muond's Newton-Schulz in fp32 and bf16"};
  app.add_option("--threads", flags.threads, "threads for the backend, OpenBLAS and oneDNN")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", flags.reps, "timed calls per figure")->check(CLI::PositiveNumber);
  app.add_flag("--quick", flags.quick, "small shapes, for a smoke run");
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
