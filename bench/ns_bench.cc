// ns_bench: Newton–Schulz throughput of muond's optim::NewtonSchulz (or, with --algorithm gram,
// GramNewtonSchulz) on one backend, in TFLOP/s of the standard iteration's work (so the two
// algorithms compare by time), on the shapes of bench_common.h (5 steps, the `simple` coefficients,
// or with gram the `gram_polar_express` set and its restart, eps 1e-7). Warm-up calls
// grow the workspace first; the timed calls run back to back and the backend is synchronized once
// at the end, so the figure is the throughput of a stream of calls, as in a training loop.
//
// --preconditioner aol (Turbo-Muon) and --coefficients NAME pick the iteration's variant, --shapes
// the shapes (ROWSxCOLS, comma-separated), and each row also gives the orthogonality residual of
// the last output (docs/algorithms.md, Telemetry), measured after the timing.
//
// Output: a human-readable table, or with --json one JSON object per line (run_ns_bench.sh and
// run_ns_variants_bench.sh read those next to the torch figures of ns_throughput.py).
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
  std::string backend = "cuda";
  std::string precision;  // empty: the backend's default
  bool quick = false;
  bool json = false;
  int warmup = 2;
  int reps = 10;
  int threads = 0;
  int steps = 5;
  std::string algorithm = "standard";
  std::string preconditioner = "frobenius";
  std::string coefficients;  // empty: simple (standard) or gram_polar_express (gram)
  std::string shapes;        // empty: bench_common.h's
};

std::vector<NsShape> ShapesOf(const Flags& flags) {
  return flags.shapes.empty() ? NsShapes(flags.quick) : ParseShapes(flags.shapes);
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie(flags.backend, flags.threads);
  const std::string precision_name = flags.precision.empty() ? DefaultPrecision(*backend) : flags.precision;
  const kernels::MatmulPrecision precision = ParsePrecision(precision_name);
  if (!flags.json) {
    std::printf("muond Newton-Schulz (%s) on %s (%s), %s GEMMs, %d steps, %d timed reps\n", flags.algorithm.c_str(),
                backend->Name().c_str(), backend->Detail().c_str(), precision_name.c_str(), flags.steps, flags.reps);
    std::printf("%-20s %12s %10s %10s\n", "shape", "ms/call", "TFLOP/s", "residual");
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const bool aol = flags.preconditioner == "aol";
  for (const NsShape& shape : ShapesOf(flags)) {
    const size_t total = static_cast<size_t>(shape.rows * shape.cols * shape.batch);
    std::vector<float> host(total);
    for (float& x : host) x = normal(rng);
    auto in = backend->Allocate(total);
    auto out = backend->Allocate(total);
    CheckOk(in.status(), "allocate input");
    CheckOk(out.status(), "allocate output");
    CheckOk(backend->CopyToDevice(host.data(), (*in)->data(), total), "upload");
    optim::NsWorkspace ws;
    const bool gram = flags.algorithm == "gram";
    const std::string set = !flags.coefficients.empty() ? flags.coefficients : gram ? "gram_polar_express" : "simple";
    const absl::StatusOr<optim::NsSchedule> named = optim::NamedSchedule(set);
    CheckOk(named.status(), "--coefficients");
    const optim::NsSchedule schedule = *named;
    auto call = [&] {
      if (gram) {
        CheckOk(optim::GramNewtonSchulz(*backend, schedule, flags.steps, schedule.gram_restarts, 1e-7, 1.0, precision,
                                        (*in)->data(), (*out)->data(), shape.rows, shape.cols, shape.batch, ws),
                "GramNewtonSchulz");
        return;
      }
      CheckOk(optim::NewtonSchulz(*backend, schedule, flags.steps, 1e-7, 1.0, precision, (*in)->data(), (*out)->data(),
                                  shape.rows, shape.cols, shape.batch, ws, nullptr,
                                  aol ? optim::NsPreconditioner::kAol : optim::NsPreconditioner::kFrobenius),
              "NewtonSchulz");
    };
    for (int i = 0; i < flags.warmup; ++i) call();
    Sync(*backend, (*out)->data());
    const double start = NowSeconds();
    for (int i = 0; i < flags.reps; ++i) call();
    Sync(*backend, (*out)->data());
    const double seconds = (NowSeconds() - start) / flags.reps;
    const double tflops = shape.Flops(flags.steps) / seconds / 1e12;
    const absl::StatusOr<double> residual =
        optim::OrthogonalityResidual(*backend, (*out)->data(), shape.rows, shape.cols, ws);
    CheckOk(residual.status(), "residual");
    if (flags.json) {
      std::printf(
          "{\"bench\": \"ns\", \"impl\": \"muond\", \"algorithm\": \"%s\", \"preconditioner\": \"%s\", "
          "\"coefficients\": \"%s\", \"steps\": %d, \"shape\": \"%s\", \"backend\": \"%s\", "
          "\"precision\": \"%s\", \"ms\": %.4f, \"tflops\": %.4f, \"residual\": %.5f}\n",
          flags.algorithm.c_str(), flags.preconditioner.c_str(), set.c_str(), flags.steps, shape.Name().c_str(),
          backend->Name().c_str(), precision_name.c_str(), seconds * 1e3, tflops, *residual);
    } else {
      std::printf("%-20s %12.3f %10.3f %10.4f\n", shape.Name().c_str(), seconds * 1e3, tflops, *residual);
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::StartOnTheDaemonsBlasKernel(argv);
  muond::bench::Flags flags;
  CLI::App app{"Newton-Schulz throughput of muond's backends (TFLOP/s)"};
  app.add_option("--backend", flags.backend, "cpu, cuda or auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--precision", flags.precision,
                 "GEMM precision: bf16, tf32, fp32 (default: bf16 on "
                 "CUDA, fp32 on the CPU)")
      ->check(CLI::IsMember({"bf16", "tf32", "fp32"}));
  app.add_flag("--quick", flags.quick, "small shapes (every dimension / 4), for a CPU smoke run");
  app.add_flag("--json", flags.json, "one JSON object per shape");
  app.add_option("--warmup", flags.warmup, "untimed calls per shape")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", flags.reps, "timed calls per shape")->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "CPU backend threads (0: OpenBLAS default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", flags.steps, "Newton-Schulz iterations")->check(CLI::PositiveNumber);
  app.add_option("--algorithm", flags.algorithm,
                 "standard, or gram (GramNewtonSchulz with the "
                 "gram_polar_express set)")
      ->check(CLI::IsMember({"standard", "gram"}));
  app.add_option("--preconditioner", flags.preconditioner, "frobenius, or aol (Turbo-Muon; standard only)")
      ->check(CLI::IsMember({"frobenius", "aol"}));
  app.add_option("--coefficients", flags.coefficients,
                 "a named coefficient set (default: simple, or with gram "
                 "gram_polar_express)");
  app.add_option("--shapes", flags.shapes, "ROWSxCOLS,... (default: bench_common.h's shapes)");
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
