// Newton–Schulz's cost rule (ns_algorithm = auto: NsWork, PreferGram) and its bounded workspace
// (NsWorkspace limits, Muon's batches cut to fit, LeastWorkspace). That NsWork counts the GEMMs
// the iterations issue is checked in newton_schulz_test (NsWorkCountsTheGemmsIssued).
#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::StatusIs;

NsSchedule Named(const char* name) { return *NamedSchedule(name); }

// The closed forms of docs/algorithms.md for `simple` (quintic, 5 steps, no restart):
// standard 10·m²n + 5·m³, Gram 2·m²n + 17·m³.
TEST(NsWorkTest, SimpleClosedForms) {
  const NsSchedule s = Named("simple");
  const double m = 64, n = 160;
  EXPECT_EQ(StandardNsWork(64, 160, s, 5).wide, 10 * m * m * n);
  EXPECT_EQ(StandardNsWork(160, 64, s, 5).square, 5 * m * m * m);
  EXPECT_EQ(GramNsWork(64, 160, s, 5, {}).wide, 2 * m * m * n);
  EXPECT_EQ(GramNsWork(160, 64, s, 5, {}).square, 17 * m * m * m);
}

// The rule's choices. With square weight w the `simple` crossover is n/m = 1.5·w: 1.5 on FLOPs
// alone, 1.5·kCpuSquareWeight on the CPU.
TEST(PreferGramTest, ChoicesOnGivenShapes) {
  const NsSchedule s = Named("simple");
  const auto cpu = [&](int64_t r, int64_t c) { return PreferGram(r, c, s, 5, {}, kCpuSquareWeight); };
  const auto flops = [&](int64_t r, int64_t c) { return PreferGram(r, c, s, 5, {}, 1.0); };
  // Square shapes never (GramNewtonSchulz would hand them to NewtonSchulz anyway).
  EXPECT_FALSE(cpu(1024, 1024));
  EXPECT_FALSE(flops(4096, 4096));
  // FLOPs alone: the crossover is exactly n = 1.5·m, either orientation.
  EXPECT_FALSE(flops(1000, 1500));
  EXPECT_TRUE(flops(1000, 1501));
  EXPECT_TRUE(flops(1501, 1000));
  EXPECT_FALSE(flops(1000, 1499));
  // The CPU: the two shapes measured faster with Gram, and shapes just past 1.5 that are not.
  EXPECT_TRUE(cpu(1024, 2752));
  EXPECT_TRUE(cpu(2752, 1024));
  EXPECT_TRUE(cpu(192, 768));
  EXPECT_FALSE(cpu(1024, 1536));
  EXPECT_FALSE(cpu(768, 1152));
  const double crossover = 1.5 * kCpuSquareWeight;
  EXPECT_FALSE(cpu(1000, static_cast<int64_t>(1000 * crossover) - 1));
  EXPECT_TRUE(cpu(1000, static_cast<int64_t>(1000 * crossover) + 1));
  // gram_polar_express's restart before step 2 costs two wide products and saves three square
  // ones (4·m²n + 14·m³ against 10·m²n + 5·m³): the crossover stays at n = 1.5·m·w.
  const NsSchedule pe = Named("gram_polar_express");
  EXPECT_FALSE(PreferGram(1000, 1500, pe, 5, pe.gram_restarts, 1.0));
  EXPECT_TRUE(PreferGram(1000, 1501, pe, 5, pe.gram_restarts, 1.0));
  EXPECT_FALSE(PreferGram(0, 10, s, 5, {}, 1.0));
}

// ---- The workspace bound ----

TEST(NsWorkspaceTest, GetAndFitStayWithinTheLimit) {
  auto backend = kernels::NewCpuBackend(1);
  NsWorkspace ws;
  ws.set_limit(1000);
  ASSERT_OK(ws.Get(*backend, 0, 600).status());
  EXPECT_THAT(ws.Get(*backend, 1, 401).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "--ns-workspace-bytes 4000"));
  EXPECT_EQ(ws.held(), 600u);  // the refused call held nothing new
  ASSERT_OK(ws.Get(*backend, 1, 400).status());
  EXPECT_EQ(ws.held(), 1000u);
  // Growing slot 0 within the limit frees the old buffer first.
  ASSERT_OK(ws.Get(*backend, 0, 500).status());  // already large enough
  EXPECT_EQ(ws.held(), 1000u);
  // Fit: what does not fit beside the buffers held is made room for by dropping what is not needed.
  const std::vector<size_t> need = {100, 0, 700};
  ASSERT_OK(ws.Fit(*backend, need));
  EXPECT_EQ(ws.held(), 800u);
  ASSERT_OK_AND_ASSIGN(float* a, ws.Get(*backend, 2, 700));
  EXPECT_NE(a, nullptr);
  const std::vector<size_t> too_much = {600, 401};
  EXPECT_THAT(ws.Fit(*backend, too_much), StatusIs(absl::StatusCode::kResourceExhausted, "4004 bytes"));
  // Within the limit beside what is held: nothing is dropped.
  const std::vector<size_t> small = {50, 50, 100};
  ASSERT_OK(ws.Fit(*backend, small));
  EXPECT_EQ(ws.held(), 800u + 50u);
  ws.set_limit(0);  // unbounded
  ASSERT_OK(ws.Get(*backend, 3, 5000).status());
  ws.Release();
  EXPECT_EQ(ws.held(), 0u);
}

// A soft bound (the daemon's default) refuses nothing: what exceeds it is held, and a Fit over it
// still drops the buffers the call does not need first.
TEST(NsWorkspaceTest, ASoftBoundRefusesNothingButStillMakesRoom) {
  auto backend = kernels::NewCpuBackend(1);
  NsWorkspace ws;
  ws.set_limit(1000, /*hard=*/false);
  EXPECT_FALSE(ws.hard());
  ASSERT_OK(ws.Get(*backend, 0, 600).status());
  ASSERT_OK(ws.Get(*backend, 1, 900).status());  // past the bound: held all the same
  EXPECT_EQ(ws.held(), 1500u);
  const std::vector<size_t> need = {0, 0, 1200};
  ASSERT_OK(ws.Fit(*backend, need));  // slots 0 and 1 are not needed: dropped to make room
  EXPECT_EQ(ws.held(), 1200u);
  ws.set_limit(1000);  // hard again
  EXPECT_TRUE(ws.hard());
  EXPECT_THAT(ws.Get(*backend, 3, 100).status(), StatusIs(absl::StatusCode::kResourceExhausted, ""));
}

// A Muon group's parameters (several of each shape, so they batch) with seeded gradients.
struct Group {
  std::vector<std::unique_ptr<ParamState>> params;
  std::vector<ParamState*> ptrs;
};
Group MakeGroup(kernels::Backend& backend, const Optimizer& opt, const std::vector<std::vector<int64_t>>& shapes) {
  Group g;
  std::mt19937 rng(11);
  for (const std::vector<int64_t>& shape : shapes) {
    auto p = std::make_unique<ParamState>();
    p->shape = shape;
    p->numel = 1;
    for (int64_t d : shape) p->numel *= d;
    const int64_t rows = shape[0], cols = p->numel / rows;
    p->master = testing::Upload(backend, testing::ToFloat(testing::RandomMat(rng, rows, cols, 0.1).v));
    p->grad = testing::Upload(backend, std::vector<float>(static_cast<size_t>(p->numel)));
    p->has_grad = true;
    EXPECT_OK(opt.InitState(backend, *p));
    g.ptrs.push_back(p.get());
    g.params.push_back(std::move(p));
  }
  return g;
}

// Runs `steps` steps of `options` on fresh parameters of `shapes` (the same gradients every time)
// on a CPU backend whose workspace is bounded to `limit` floats, and returns every master.
std::vector<std::vector<float>> RunSteps(const GroupOptions& options, const std::vector<std::vector<int64_t>>& shapes,
                                         size_t limit, int steps = 2, size_t* held = nullptr) {
  auto backend = kernels::NewCpuBackend(1);
  BackendNsWorkspace(*backend).ws.set_limit(limit);
  auto opt = *Optimizer::Create(options);
  Group g = MakeGroup(*backend, *opt, shapes);
  std::mt19937 rng(21);
  for (int t = 0; t < steps; ++t) {
    for (ParamState* p : g.ptrs) {
      const int64_t rows = p->shape[0], cols = p->numel / rows;
      const std::vector<float> grad = testing::ToFloat(testing::RandomMat(rng, rows, cols).v);
      EXPECT_OK(backend->CopyToDevice(grad.data(), p->grad->data(), grad.size()));
    }
    EXPECT_OK(opt->Step(*backend, opt->DefaultHyper(), g.ptrs));
  }
  if (held != nullptr) *held = BackendNsWorkspace(*backend).ws.held();
  std::vector<std::vector<float>> out;
  for (ParamState* p : g.ptrs) out.push_back(testing::Download(*backend, p->master.fp32(), p->numel));
  return out;
}

GroupOptions MuonWith(NsAlgorithm algorithm, const char* set = "simple") {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.ns_algorithm = algorithm;
  o.ns_schedule = *NamedSchedule(set);
  return o;
}

// auto runs, per shape, the variant the rule picks, so its results are that variant's bit for bit:
// 16×64 (n/m = 4) and 64×16 go to Gram, 32×40 (1.25) and the square 24×24 to the standard
// iteration, on the CPU's square weight.
TEST(NsAutoTest, EqualsTheChosenVariantBitForBit) {
  const NsSchedule simple = Named("simple");
  ASSERT_TRUE(PreferGram(16, 64, simple, 5, {}, kCpuSquareWeight));
  ASSERT_FALSE(PreferGram(32, 40, simple, 5, {}, kCpuSquareWeight));
  for (const char* set : {"simple", "gram_polar_express"}) {
    SCOPED_TRACE(set);
    const std::vector<std::vector<int64_t>> gram_shapes = {{16, 64}, {64, 16}, {2, 16, 64}};
    const std::vector<std::vector<int64_t>> standard_shapes = {{32, 40}, {24, 24}, {40, 32}};
    EXPECT_EQ(RunSteps(MuonWith(NsAlgorithm::kAuto, set), gram_shapes, 0),
              RunSteps(MuonWith(NsAlgorithm::kGram, set), gram_shapes, 0));
    EXPECT_EQ(RunSteps(MuonWith(NsAlgorithm::kAuto, set), standard_shapes, 0),
              RunSteps(MuonWith(NsAlgorithm::kStandard, set), standard_shapes, 0));
  }
  // And the two variants do differ on the Gram shapes (in the last bits), so the comparison above
  // can tell them apart.
  const std::vector<std::vector<int64_t>> gram_shapes = {{16, 64}};
  EXPECT_NE(RunSteps(MuonWith(NsAlgorithm::kGram), gram_shapes, 0),
            RunSteps(MuonWith(NsAlgorithm::kStandard), gram_shapes, 0));
}

// Every matrix is computed by its own GEMMs and element-wise loops on the CPU backend, so cutting
// batches changes no bit. Shapes: four 32×32 (contiguous experts and separate parameters), three
// 16×48 (Gram under auto), a column-blocked parameter (the transpose slot) and NorMuon's copy.
TEST(NsWorkspaceBoundTest, CutBatchesGiveTheUnboundedResultsBitForBit) {
  const std::vector<std::vector<int64_t>> shapes = {{32, 32}, {32, 32}, {4, 32, 32}, {16, 48}, {16, 48}, {48, 16}};
  for (NsAlgorithm algorithm : {NsAlgorithm::kStandard, NsAlgorithm::kAuto}) {
    for (Moment2Method method : {Moment2Method::kNone, Moment2Method::kNormuon}) {
      GroupOptions o = MuonWith(algorithm);
      o.moment2_method = method;
      auto opt = *Optimizer::Create(o);
      auto backend = kernels::NewCpuBackend(1);
      std::vector<ParamState> states;
      for (const auto& shape : shapes) {
        ParamState p;
        p.shape = shape;
        p.numel = 1;
        for (int64_t d : shape) p.numel *= d;
        states.push_back(std::move(p));
      }
      std::vector<const ParamState*> ptrs;
      for (const ParamState& p : states) ptrs.push_back(&p);
      const size_t least = opt->LeastWorkspace(*backend, ptrs).floats;
      size_t unbounded_held = 0, bounded_held = 0;
      const auto unbounded = RunSteps(o, shapes, 0, 2, &unbounded_held);
      for (size_t limit : {least, least + 1000, (least + unbounded_held) / 2}) {
        SCOPED_TRACE(::testing::Message()
                     << "limit " << limit << " least " << least << " unbounded " << unbounded_held);
        EXPECT_EQ(RunSteps(o, shapes, limit, 2, &bounded_held), unbounded);
        EXPECT_LE(bounded_held, limit);
      }
      EXPECT_LT(least, unbounded_held);  // the bound did cut batches
    }
  }
}

// LeastWorkspace: one matrix per batch, each slot at its largest matrix. Below it the step is
// refused before it changes anything.
TEST(NsWorkspaceBoundTest, LeastWorkspaceAndRefusalBelowIt) {
  auto backend = kernels::NewCpuBackend(1);
  auto opt = *Optimizer::Create(MuonWith(NsAlgorithm::kStandard));
  ParamState a, b;
  a.name = "a";
  a.shape = {32, 32};
  a.numel = 1024;
  b.name = "b";
  b.shape = {16, 96};
  b.numel = 1536;
  const ParamState* both[] = {&a, &b};
  const Optimizer::WorkspaceNeed need = opt->LeastWorkspace(*backend, both);
  // Slots 0 and 1: max(1024, 1536); 2 and 3: max(32², 16²).
  EXPECT_EQ(need.floats, 2 * 1536u + 2 * 1024u);
  EXPECT_EQ(need.largest, &a);  // 4·1024 against 2·1536 + 2·256
  EXPECT_EQ(need.largest_floats, 4 * 1024u);
  auto gram = *Optimizer::Create(MuonWith(NsAlgorithm::kGram));
  EXPECT_EQ(gram->LeastWorkspace(*backend, both).floats, 2 * 1536u + 2 * 1024u + 2 * 256u);
  auto adamw = *Optimizer::Create(DefaultOptions(OptimizerKind::kAdamW));
  EXPECT_EQ(adamw->LeastWorkspace(*backend, both).floats, 0u);

  BackendNsWorkspace(*backend).ws.set_limit(need.floats - 1);
  Group g = MakeGroup(*backend, *opt, {{32, 32}, {16, 96}});
  const std::vector<float> before = testing::Download(*backend, g.ptrs[0]->master.fp32(), 1024);
  EXPECT_THAT(opt->Step(*backend, opt->DefaultHyper(), g.ptrs),
              StatusIs(absl::StatusCode::kResourceExhausted, "--ns-workspace-bytes"));
  EXPECT_EQ(testing::Download(*backend, g.ptrs[0]->master.fp32(), 1024), before);
  EXPECT_EQ(g.ptrs[0]->step_count, 0);
  BackendNsWorkspace(*backend).ws.set_limit(need.floats);
  EXPECT_OK(opt->Step(*backend, opt->DefaultHyper(), g.ptrs));
  EXPECT_EQ(g.ptrs[0]->step_count, 1);
}

}  // namespace
}  // namespace muond::optim
