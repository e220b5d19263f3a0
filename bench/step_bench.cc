// step_bench: wall time of one whole optimizer step of muond (Optimizer::Step of a Muon group and
// an AdamW group) over a GPT-2-small-sized parameter set (~124M parameters): per layer the
// attention qkv 768×2304, projection 768×768, MLP 768×3072 and 3072×768 go to Muon; token and
// position embeddings, layer norms and biases to AdamW. --quick shrinks it (2 layers, width 192,
// vocabulary 2048, context 256) for a CPU smoke run. ns_throughput.py --mode step times the same
// parameter set with a pure-torch Muon + AdamW step.
//
// Each timed step starts from fresh gradients (restored on the device, untimed, because Muon uses
// the gradient buffer as scratch) and ends with a backend sync.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_common.h"
#include "common/config.h"
#include "kernels/optim/optimizer.h"
#if MUOND_HAVE_CUDA
#include "kernels/cuda/cuda_backend_factory.h"
#endif

namespace muond::bench {
namespace {

struct Flags {
  std::string backend = "cuda";
  std::string precision;
  bool quick = false;
  bool json = false;
  int warmup = 2;
  int reps = 5;
  int threads = 0;
};

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  bool muon;
};

// GPT-2 small (or its --quick miniature); ns_throughput.py's gpt2_params() is the same list.
std::vector<Param> Gpt2Params(bool quick) {
  const int64_t layers = quick ? 2 : 12, d = quick ? 192 : 768;
  const int64_t vocab = quick ? 2048 : 50257, context = quick ? 256 : 1024;
  std::vector<Param> params = {{"wte", {vocab, d}, false}, {"wpe", {context, d}, false}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    params.push_back({p + "attn.c_attn.weight", {d, 3 * d}, true});
    params.push_back({p + "attn.c_proj.weight", {d, d}, true});
    params.push_back({p + "mlp.c_fc.weight", {d, 4 * d}, true});
    params.push_back({p + "mlp.c_proj.weight", {4 * d, d}, true});
    for (const char* v :
         {"ln_1.weight", "ln_1.bias", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias"}) {
      params.push_back({p + v, {d}, false});
    }
    params.push_back({p + "attn.c_attn.bias", {3 * d}, false});
    params.push_back({p + "mlp.c_fc.bias", {4 * d}, false});
  }
  params.push_back({"ln_f.weight", {d}, false});
  params.push_back({"ln_f.bias", {d}, false});
  return params;
}

int Run(const Flags& flags) {
  std::unique_ptr<kernels::Backend> backend = BackendOrDie(flags.backend, flags.threads);
  const std::string precision_name = flags.precision.empty() ? DefaultPrecision(*backend) : flags.precision;
  optim::GroupOptions muon_options = optim::DefaultOptions(optim::OptimizerKind::kMuon);
  muon_options.matmul_precision = ParsePrecision(precision_name);
  const optim::GroupOptions adamw_options = optim::DefaultOptions(optim::OptimizerKind::kAdamW);
  auto muon = optim::Optimizer::Create(muon_options);
  auto adamw = optim::Optimizer::Create(adamw_options);
  CheckOk(muon.status(), "muon");
  CheckOk(adamw.status(), "adamw");

  const std::vector<Param> specs = Gpt2Params(flags.quick);
  std::vector<optim::ParamState> states(specs.size());
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> saved_grads;
  std::vector<optim::ParamState*> muon_params, adamw_params;
  int64_t total = 0, muon_total = 0;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i < specs.size(); ++i) {
    optim::ParamState& p = states[i];
    p.name = specs[i].name;
    p.shape = specs[i].shape;
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    total += p.numel;
    std::vector<float> host(p.numel);
    for (float& x : host) x = normal(rng);
    auto master = backend->Allocate(p.numel), grad = backend->Allocate(p.numel), saved = backend->Allocate(p.numel);
    CheckOk(master.status(), "allocate");
    CheckOk(grad.status(), "allocate");
    CheckOk(saved.status(), "allocate");
    p.master = std::move(*master);
    p.grad = std::move(*grad);
    CheckOk(backend->CopyToDevice(host.data(), p.master.fp32(), host.size()), "upload");
    for (float& x : host) x = normal(rng);
    CheckOk(backend->CopyToDevice(host.data(), (*saved)->data(), host.size()), "upload");
    saved_grads.push_back(std::move(*saved));
    optim::Optimizer& opt = specs[i].muon ? **muon : **adamw;
    CheckOk(opt.InitState(*backend, p), "init state");
    (specs[i].muon ? muon_params : adamw_params).push_back(&p);
    if (specs[i].muon) muon_total += p.numel;
  }

  auto step = [&](double* seconds) {
    for (size_t i = 0; i < states.size(); ++i) {
      CheckOk(backend->CopyOnDevice(saved_grads[i]->data(), states[i].grad->data(), states[i].numel), "restore grad");
      states[i].has_grad = true;
    }
    Sync(*backend, states[0].master.fp32());
    const double start = NowSeconds();
    CheckOk((*muon)->Step(*backend, (*muon)->DefaultHyper(), muon_params), "muon step");
    CheckOk((*adamw)->Step(*backend, (*adamw)->DefaultHyper(), adamw_params), "adamw step");
    Sync(*backend, states[0].master.fp32());
    *seconds = NowSeconds() - start;
  };
  double seconds = 0;
  for (int i = 0; i < flags.warmup; ++i) step(&seconds);
#if MUOND_HAVE_CUDA
  const auto pool_before = kernels::GetCudaPoolStats(*backend);
#endif
  std::vector<double> times;
  for (int i = 0; i < flags.reps; ++i) {
    step(&seconds);
    times.push_back(seconds * 1e3);
  }
  double mean = 0;
  for (double t : times) mean += t / times.size();
  std::string pool_note;
#if MUOND_HAVE_CUDA
  if (const auto pool_after = kernels::GetCudaPoolStats(*backend); pool_before && pool_after) {
    pool_note = ", cudaMalloc calls during timed steps: " +
                std::to_string(pool_after->device_allocations - pool_before->device_allocations);
  }
#endif
  const char* model = flags.quick ? "gpt2-quick" : "gpt2-small";
  if (flags.json) {
    std::printf(
        "{\"bench\": \"step\", \"impl\": \"muond\", \"model\": \"%s\", \"backend\": \"%s\", "
        "\"precision\": \"%s\", \"params\": %lld, \"muon_params\": %lld, \"ms_median\": %.3f, "
        "\"ms_mean\": %.3f}\n",
        model, backend->Name().c_str(), precision_name.c_str(), static_cast<long long>(total),
        static_cast<long long>(muon_total), Median(times), mean);
  } else {
    std::printf(
        "muond step, %s (%lld params, %lld in Muon), %s backend (%s), Muon GEMMs %s:\n"
        "  median %.3f ms, mean %.3f ms over %d steps%s\n",
        model, static_cast<long long>(total), static_cast<long long>(muon_total), backend->Name().c_str(),
        backend->Detail().c_str(), precision_name.c_str(), Median(times), mean, flags.reps, pool_note.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace muond::bench

int main(int argc, char** argv) {
  muond::bench::StartOnTheDaemonsBlasKernel(argv);
  muond::bench::Flags flags;
  CLI::App app{"Whole optimizer step (Muon + AdamW) of muond on a GPT-2-small parameter set"};
  app.add_option("--backend", flags.backend, "cpu, cuda or auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--precision", flags.precision, "Muon GEMM precision: bf16, tf32, fp32")
      ->check(CLI::IsMember({"bf16", "tf32", "fp32"}));
  app.add_flag("--quick", flags.quick, "a miniature model (2 layers, width 192) for a CPU smoke run");
  app.add_flag("--json", flags.json, "one JSON object");
  app.add_option("--warmup", flags.warmup, "untimed steps")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", flags.reps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "CPU backend threads (0: OpenBLAS default)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  return muond::bench::Run(flags);
}
