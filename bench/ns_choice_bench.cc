// ns_choice_bench: the crossover of ns_algorithm = auto. Times NewtonSchulz and GramNewtonSchulz
// (the `simple` set, 5 steps, fp32 unless --precision) on a grid of wide shapes m × n and prints, per
// shape, both times, Gram's time over the standard one's, the cost rule's prediction of that ratio
// (optim::StandardNsWork / GramNsWork with the backend's square weight), what auto picks, and
// whether that pick was the faster one. The last column is the square weight w at which the rule's
// ratio equals the measured one, (W_g − r·W_s)/(r·S_s − S_g) with W the wide and S the square
// multiply-adds; their median over the shapes near the crossover is what kCpuSquareWeight is
// fitted to (docs/algorithms.md, Muon step 2). The floor printed with each shape is the time the
// cheaper variant's multiply-adds take at the backend's measured GEMM peak (one 2048³ product of the
// same BLAS and precision, the best of those timed before each shape).
//
//   ns_choice_bench --backend cpu [--threads 2] [--reps 3] [--quick]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_common.h"
#include "kernels/optim/newton_schulz.h"

namespace muond::bench {
namespace {

struct Flags {
  std::string backend = "cpu";
  std::string precision;
  bool quick = false;
  int warmup = 1;
  int reps = 3;
  int threads = 0;
};

struct ChoiceShape {
  int64_t m, n, batch;
};

std::vector<ChoiceShape> Shapes(bool quick) {
  std::vector<ChoiceShape> shapes;
  const std::vector<int64_t> ms = quick ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{256, 512, 1024};
  for (int64_t m : ms) {
    for (double ratio : {1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 4.0}) {
      shapes.push_back({m, static_cast<int64_t>(std::lround(m * ratio)), 1});
    }
  }
  if (!quick) {
    shapes.push_back({1024, 2752, 1});  // an MLP projection of a d = 1024 model
    shapes.push_back({192, 768, 6});    // six small heads' projections, batched
  }
  return shapes;
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie(flags.backend, flags.threads);
  const std::string precision_name = flags.precision.empty() ? "fp32" : flags.precision;
  const kernels::MatmulPrecision precision = ParsePrecision(precision_name);
  const double weight = backend->Name() == "cpu" ? optim::kCpuSquareWeight : optim::kCudaSquareWeight;
  const optim::NsSchedule schedule = *optim::NamedSchedule("simple");
  const int steps = 5;
  std::printf(
      "ns_algorithm auto: Gram against standard Newton-Schulz on %s (%s), %s GEMMs, simple set, %d steps, "
      "%d timed reps, square weight %.2f\n",
      backend->Name().c_str(), backend->Detail().c_str(), precision_name.c_str(), steps, flags.reps, weight);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> fitted;
  int right = 0, total = 0;
  // The GEMM peak: multiply-adds per second of a 2048 × 2048 × 2048 product, the best of the
  // timings taken before each shape (the machine's load moves it; the best is the floor's).
  const int64_t k = 2048;
  auto peak_a = backend->Allocate(static_cast<size_t>(k * k));
  auto peak_c = backend->Allocate(static_cast<size_t>(k * k));
  CheckOk(peak_a.status(), "allocate");
  CheckOk(peak_c.status(), "allocate");
  CheckOk(backend->Fill((*peak_a)->data(), static_cast<size_t>(k * k), 0.5f), "fill");
  double rate = 0;
  const auto time_peak = [&] {
    const kernels::GemmShape square{.m = k, .n = k, .k = k, .lda = k, .ldb = k, .ldc = k};
    const double start = NowSeconds();
    CheckOk(backend->Gemm(square, 1.0f, (*peak_a)->data(), (*peak_a)->data(), 0.0f, (*peak_c)->data(), precision),
            "gemm");
    Sync(*backend, (*peak_c)->data());
    rate = std::max(rate, static_cast<double>(k * k * k) / (NowSeconds() - start));
  };
  for (int i = 0; i < flags.warmup + flags.reps; ++i) time_peak();
  std::printf("%-14s %5s %10s %10s %7s %7s %7s %6s %6s %10s %8s\n", "shape", "n/m", "std ms", "gram ms", "gram/",
              "rule", "flops", "auto", "right", "floor ms", "fit w");
  std::printf("%-14s %5s %10s %10s %7s %7s %7s %6s %6s %10s %8s\n", "", "", "", "", "std", "ratio", "ratio", "picks",
              "", "", "");
  for (const ChoiceShape& shape : Shapes(flags.quick)) {
    const size_t count = static_cast<size_t>(shape.m * shape.n * shape.batch);
    std::vector<float> host(count);
    for (float& x : host) x = normal(rng);
    auto in = backend->Allocate(count);
    auto out = backend->Allocate(count);
    CheckOk(in.status(), "allocate input");
    CheckOk(out.status(), "allocate output");
    CheckOk(backend->CopyToDevice(host.data(), (*in)->data(), count), "upload");
    optim::NsWorkspace ws;
    const auto time = [&](bool gram) {
      const auto call = [&] {
        if (gram) {
          CheckOk(optim::GramNewtonSchulz(*backend, schedule, steps, {}, 1e-7, 1.0, precision, (*in)->data(),
                                          (*out)->data(), shape.m, shape.n, shape.batch, ws),
                  "GramNewtonSchulz");
        } else {
          CheckOk(optim::NewtonSchulz(*backend, schedule, steps, 1e-7, 1.0, precision, (*in)->data(), (*out)->data(),
                                      shape.m, shape.n, shape.batch, ws),
                  "NewtonSchulz");
        }
      };
      for (int i = 0; i < flags.warmup; ++i) call();
      Sync(*backend, (*out)->data());
      std::vector<double> seconds;
      for (int i = 0; i < flags.reps; ++i) {
        const double start = NowSeconds();
        call();
        Sync(*backend, (*out)->data());
        seconds.push_back(NowSeconds() - start);
      }
      return Median(seconds);
    };
    time_peak();
    const double t_std = time(false), t_gram = time(true);
    const optim::NsWork s = optim::StandardNsWork(shape.m, shape.n, schedule, steps);
    const optim::NsWork g = optim::GramNsWork(shape.m, shape.n, schedule, steps, {});
    const double b = static_cast<double>(shape.batch);
    const double ratio = t_gram / t_std;
    const double rule = (g.wide + weight * g.square) / (s.wide + weight * s.square);
    const double flops = (g.wide + g.square) / (s.wide + s.square);
    const bool picks_gram = optim::PreferGram(shape.m, shape.n, schedule, steps, {}, weight);
    const bool is_right = picks_gram == (t_gram < t_std);
    const double w = (g.wide - ratio * s.wide) / (ratio * s.square - g.square);
    const double floor = b * std::min(s.wide + s.square, g.wide + g.square) / rate;
    // Shapes whose measured ratio is within 25% of 1 pin the weight; far from the crossover the
    // ratio barely depends on it.
    if (std::abs(ratio - 1) < 0.25 && w > 0) fitted.push_back(w);
    right += is_right;
    ++total;
    char name[32];
    std::snprintf(name, sizeof(name), "%s%lldx%lld", shape.batch > 1 ? (std::to_string(shape.batch) + "x").c_str() : "",
                  static_cast<long long>(shape.m), static_cast<long long>(shape.n));
    std::printf("%-14s %5.2f %10.2f %10.2f %7.3f %7.3f %7.3f %6s %6s %10.2f %8.2f\n", name,
                static_cast<double>(shape.n) / shape.m, t_std * 1e3, t_gram * 1e3, ratio, rule, flops,
                picks_gram ? "gram" : "std", is_right ? "yes" : "NO", floor * 1e3, w);
    std::fflush(stdout);
  }
  std::printf("GEMM peak (2048^3, %s, best of the run): %.3f TFLOP/s\n", precision_name.c_str(), 2 * rate / 1e12);
  std::printf(
      "auto picked the faster variant on %d of %d shapes; fitted square weight (median of %zu shapes near "
      "the crossover): %.2f\n",
      right, total, fitted.size(), fitted.empty() ? 0.0 : Median(fitted));
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::StartOnTheDaemonsBlasKernel(argv);
  muond::bench::Flags flags;
  CLI::App app{"The crossover of ns_algorithm auto: Gram against standard Newton-Schulz per shape"};
  app.add_option("--backend", flags.backend, "cpu, cuda or auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--precision", flags.precision, "GEMM precision: bf16, tf32, fp32 (default fp32)")
      ->check(CLI::IsMember({"bf16", "tf32", "fp32"}));
  app.add_flag("--quick", flags.quick, "small shapes only");
  app.add_option("--warmup", flags.warmup, "untimed calls per shape and variant")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", flags.reps, "timed calls per shape and variant (the median is printed)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "CPU backend threads (0: OpenBLAS default)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
