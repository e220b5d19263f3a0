// dion2_step_bench: the time of one whole optimizer step (Optimizer::Step: momentum, Newton–Schulz,
// update) of one parameter, Dion2 at --fraction (default 0.25) against full Muon, on 1024x2752 and
// 4096x4096 (or --shapes). Both use the `simple` set and 5 steps, so the difference is what Dion2
// orthogonalizes and its choice of lines (L1 norms, copies). Each timed step starts from the same
// gradient, copied back into the gradient buffer (which a step uses as scratch) inside the timing
// for both, and the backend is synchronized after the last.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_common.h"
#include "kernels/optim/optimizer.h"

namespace muond::bench {
namespace {

struct Flags {
  std::string backend = "cuda";
  std::string precision;
  std::string shapes = "1024x2752,4096x4096";
  double fraction = 0.25;
  int warmup = 1;
  int reps = 3;
  int threads = 0;
};

double StepSeconds(kernels::Backend& backend, const optim::GroupOptions& options, int64_t rows, int64_t cols,
                   const Flags& flags) {
  absl::StatusOr<std::unique_ptr<optim::Optimizer>> opt = optim::Optimizer::Create(options);
  CheckOk(opt.status(), "optimizer");
  const size_t n = static_cast<size_t>(rows * cols);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> host(n);
  for (float& x : host) x = normal(rng);
  optim::ParamState p;
  p.name = "w";
  p.shape = {rows, cols};
  p.numel = static_cast<int64_t>(n);
  auto master = backend.Allocate(n);
  auto grad = backend.Allocate(n);
  auto saved = backend.Allocate(n);
  CheckOk(master.status(), "allocate");
  CheckOk(grad.status(), "allocate");
  CheckOk(saved.status(), "allocate");
  CheckOk(backend.CopyToDevice(host.data(), (*master)->data(), n), "upload");
  CheckOk(backend.CopyToDevice(host.data(), (*saved)->data(), n), "upload");
  p.master = optim::StoredTensor(std::move(*master));
  p.grad = std::move(*grad);
  CheckOk((*opt)->InitState(backend, p), "init");
  optim::ParamState* params[] = {&p};
  const optim::StepHyper hyper = (*opt)->DefaultHyper();
  auto step = [&] {
    CheckOk(backend.CopyOnDevice((*saved)->data(), p.grad->data(), n), "gradient");
    p.has_grad = true;
    CheckOk((*opt)->Step(backend, hyper, params), "step");
  };
  for (int i = 0; i < flags.warmup; ++i) step();
  Sync(backend, p.grad->data());
  const double start = NowSeconds();
  for (int i = 0; i < flags.reps; ++i) step();
  Sync(backend, p.grad->data());
  return (NowSeconds() - start) / flags.reps;
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie(flags.backend, flags.threads);
  const std::string precision_name = flags.precision.empty() ? DefaultPrecision(*backend) : flags.precision;
  std::printf("muond optimizer step of one parameter on %s (%s GEMMs), `simple` x5, %d timed steps\n",
              backend->Name().c_str(), precision_name.c_str(), flags.reps);
  std::printf("%-12s %14s %16s %10s\n", "shape", "muon ms/step", "dion2 ms/step", "muon/dion2");
  for (const NsShape& shape : ParseShapes(flags.shapes)) {
    const int64_t rows = shape.rows, cols = shape.cols;
    optim::GroupOptions muon = optim::DefaultOptions(optim::OptimizerKind::kMuon);
    optim::GroupOptions dion2 = optim::DefaultOptions(optim::OptimizerKind::kDion2);
    for (optim::GroupOptions* o : {&muon, &dion2}) {
      o->matmul_precision = ParsePrecision(precision_name);
      o->ns_schedule = *optim::NamedSchedule("simple");
      o->ns_steps = 5;
      o->telemetry = false;
    }
    dion2.dion2_fraction = flags.fraction;
    const double a = StepSeconds(*backend, muon, rows, cols, flags);
    const double b = StepSeconds(*backend, dion2, rows, cols, flags);
    std::printf("%-12s %14.2f %16.2f %9.2fx\n", shape.Name().c_str(), a * 1e3, b * 1e3, a / b);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::StartOnTheDaemonsBlasKernel(argv);
  muond::bench::Flags flags;
  CLI::App app{"One optimizer step: Dion2 at a fraction against full Muon"};
  app.add_option("--backend", flags.backend, "cpu, cuda or auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--precision", flags.precision,
                 "GEMM precision: bf16, tf32, fp32 (default: bf16 on CUDA, fp32 on the CPU)")
      ->check(CLI::IsMember({"bf16", "tf32", "fp32"}));
  app.add_option("--shapes", flags.shapes, "ROWSxCOLS,...");
  app.add_option("--fraction", flags.fraction, "dion2_fraction")->check(CLI::Range(0.0, 1.0));
  app.add_option("--warmup", flags.warmup, "untimed steps")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", flags.reps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "CPU backend threads (0: OpenBLAS default)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
