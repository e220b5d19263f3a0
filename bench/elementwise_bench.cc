// elementwise_bench: throughput of muond's element-wise optimizer steps (AdamW, Lion, SGD with
// momentum 0.9) through Optimizer::Step on a backend, over 8 tensors holding --params parameters in
// all, and the memory's bandwidth limit beside them: on a host backend a STREAM-style triad (a = b +
// s·c, fp32, 12 bytes per element, split over the same number of std::threads); on a device backend
// (a GPU) a device-to-device copy through the backend (8 bytes per element), the floor its steps
// move their bytes against. elementwise_torch.py times torch's
// optimizers on the same tensors; run_elementwise_bench.sh prints them side by side.
//
// Bytes per parameter, as STREAM counts them (reads + writes, no write-allocate): AdamW reads p, g,
// m, v and writes p, m, v (28); Lion and SGD with momentum read p, g, m and write p, m (20).
// --state-dtype bf16 or fp16 stores the optimizer slots in 16 bits (the precision-aware options):
// the counts then take 2 bytes for each slot read and write (AdamW 20, Lion and SGD 16); the loops
// widen and round them block by block in L1.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_common.h"
#include "kernels/optim/optimizer.h"

namespace muond::bench {
namespace {

struct Flags {
  std::string backend = "cpu";
  std::vector<int64_t> params = {16'000'000, 64'000'000};
  int threads = 0;
  int reps = 10;
  bool json = false;
  std::string state_dtype = "fp32";
};

constexpr int kTensors = 8;

struct Case {
  const char* name;
  optim::OptimizerKind kind;
  double bytes_per_param;
};

double TimeStep(kernels::Backend& backend, optim::Optimizer& optimizer, std::vector<optim::ParamState>& params,
                int reps) {
  std::vector<optim::ParamState*> pointers;
  for (optim::ParamState& p : params) pointers.push_back(&p);
  const optim::StepHyper hyper = optimizer.DefaultHyper();
  std::vector<double> seconds;
  for (int r = 0; r < reps + 1; ++r) {  // the first is warm-up
    const double start = NowSeconds();
    CheckOk(optimizer.Step(backend, hyper, pointers), "step");
    Sync(backend, params[0].master.fp32());
    if (r > 0) seconds.push_back(NowSeconds() - start);
  }
  return Median(seconds);
}

// a[i] = b[i] + s·c[i] over `threads` contiguous ranges, each thread touching its own pages first.
double Triad(int64_t n, int threads, int reps) {
  std::vector<float> a(n), b(n), c(n);
  auto run = [&](auto&& body) {
    std::vector<std::thread> pool;
    const int64_t per = (n + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] { body(t * per, std::min(n, (t + 1) * per)); });
    }
    for (std::thread& th : pool) th.join();
  };
  run([&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = 0, b[i] = 1, c[i] = 2;
  });
  std::vector<double> seconds;
  const float s = 3;
  for (int r = 0; r < reps + 1; ++r) {
    const double start = NowSeconds();
    run([&](int64_t begin, int64_t end) {
      float* __restrict pa = a.data();
      const float* __restrict pb = b.data();
      const float* __restrict pc = c.data();
      for (int64_t i = begin; i < end; ++i) pa[i] = pb[i] + s * pc[i];
    });
    if (r > 0) seconds.push_back(NowSeconds() - start);
  }
  if (a[n / 2] != 7) std::fprintf(stderr, "triad: wrong result\n");
  return 12.0 * n / Median(seconds) / 1e9;
}

// A device-to-device copy of n fp32 elements through the backend: GB/s counting the read and the
// write (8 bytes per element), the median of `reps` after one warm-up.
double DeviceCopy(kernels::Backend& backend, int64_t n, int reps) {
  auto src = backend.Allocate(n);
  auto dst = backend.Allocate(n);
  CheckOk(src.status(), "allocate");
  CheckOk(dst.status(), "allocate");
  CheckOk(backend.Fill((*src)->data(), n, 1.0f), "fill");
  std::vector<double> seconds;
  for (int r = 0; r < reps + 1; ++r) {
    const double start = NowSeconds();
    CheckOk(backend.CopyOnDevice((*src)->data(), (*dst)->data(), n), "copy");
    Sync(backend, (*dst)->data());
    if (r > 0) seconds.push_back(NowSeconds() - start);
  }
  return 8.0 * n / Median(seconds) / 1e9;
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie(flags.backend, flags.threads);
  const int threads = flags.threads > 0 ? flags.threads : static_cast<int>(std::thread::hardware_concurrency());
  const bool half = flags.state_dtype != "fp32";
  const kernels::StorageDtype slots = flags.state_dtype == "bf16"   ? kernels::StorageDtype::kBf16
                                      : flags.state_dtype == "fp16" ? kernels::StorageDtype::kFp16
                                                                    : kernels::StorageDtype::kFp32;
  const Case cases[] = {{"sgd", optim::OptimizerKind::kSgd, half ? 16.0 : 20.0},
                        {"adamw", optim::OptimizerKind::kAdamW, half ? 20.0 : 28.0},
                        {"lion", optim::OptimizerKind::kLion, half ? 16.0 : 20.0}};
  if (!flags.json) {
    std::printf("%s backend (%s), %d tensors per run, %s optimizer state\n", backend->Name().c_str(),
                backend->Detail().c_str(), kTensors, flags.state_dtype.c_str());
    std::printf("%-8s %12s %12s %12s\n", "step", "params", "Gparam/s", "GB/s");
  }
  for (int64_t total : flags.params) {
    const bool host = backend->HostAddressable();
    const char* floor_name = host ? "triad" : "d2d-copy";
    const double floor = host ? Triad(total, threads, flags.reps) : DeviceCopy(*backend, total, flags.reps);
    if (flags.json) {
      std::printf("{\"bench\": \"%s\", \"params\": %lld, \"threads\": %d, \"gbps\": %.3f}\n", floor_name,
                  static_cast<long long>(total), threads, floor);
    } else {
      std::printf("%-8s %12lld %12s %12.2f\n", floor_name, static_cast<long long>(total), "", floor);
    }
    for (const Case& c : cases) {
      optim::GroupOptions options = optim::DefaultOptions(c.kind);
      if (c.kind == optim::OptimizerKind::kSgd) options.momentum = 0.9;
      options.momentum_dtype = options.exp_avg_dtype = options.exp_avg_sq_dtype = slots;
      absl::StatusOr<std::unique_ptr<optim::Optimizer>> optimizer = optim::Optimizer::Create(options);
      CheckOk(optimizer.status(), "optimizer");
      std::vector<optim::ParamState> params(kTensors);
      for (int t = 0; t < kTensors; ++t) {
        optim::ParamState& p = params[t];
        p.name = "p" + std::to_string(t);
        p.numel = total / kTensors;
        p.shape = {p.numel};
        p.has_grad = true;
        auto master = backend->Allocate(p.numel);
        auto grad = backend->Allocate(p.numel);
        CheckOk(master.status(), "allocate");
        CheckOk(grad.status(), "allocate");
        p.master = *std::move(master);
        p.grad = *std::move(grad);
        CheckOk(backend->Fill(p.master.fp32(), p.numel, 0.5f), "fill");
        CheckOk(backend->Fill(p.grad->data(), p.numel, 0.01f), "fill");
        CheckOk((*optimizer)->InitState(*backend, p), "init");
      }
      const double seconds = TimeStep(*backend, **optimizer, params, flags.reps);
      const double gparams = static_cast<double>(total) / seconds / 1e9;
      const double gbps = gparams * c.bytes_per_param;
      if (flags.json) {
        std::printf(
            "{\"bench\": \"step\", \"optimizer\": \"%s\", \"params\": %lld, \"ms_median\": %.3f, "
            "\"gparams\": %.4f, \"gbps\": %.3f, \"bytes_per_param\": %.0f, \"state_dtype\": \"%s\"}\n",
            c.name, static_cast<long long>(total), seconds * 1e3, gparams, gbps, c.bytes_per_param,
            flags.state_dtype.c_str());
      } else {
        std::printf("%-8s %12lld %12.3f %12.2f\n", c.name, static_cast<long long>(total), gparams, gbps);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::Flags flags;
  CLI::App app{"muond element-wise optimizer step throughput against a STREAM-style triad"};
  app.add_option("--backend", flags.backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--params", flags.params, "Parameter counts to time (all tensors together)");
  app.add_option("--threads", flags.threads, "CPU threads of the backend and the triad (0: one per core)");
  app.add_option("--reps", flags.reps, "Timed repetitions (median reported)")->check(CLI::PositiveNumber);
  app.add_flag("--json", flags.json, "One JSON object per line");
  app.add_option("--state-dtype", flags.state_dtype, "Storage of the optimizer slots: fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
