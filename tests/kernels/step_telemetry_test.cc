// Telemetry of an optimizer step (kernels/optim/step_telemetry.h): StepMeasured leaves exactly the
// bits Step leaves, in every optimizer and storage format, over parameters of several meter chunks;
// its sums are those of the masters before and after; Newton–Schulz's input sums and the
// orthogonality residual are those of the matrices.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

struct Case {
  OptimizerKind kind;
  kernels::StorageDtype master_dtype;
};

class StepMeasuredTest : public ::testing::TestWithParam<Case> {};

std::vector<float> Read(kernels::Backend& backend, const StoredTensor& t, size_t n) {
  std::vector<float> out(n);
  EXPECT_OK(ReadStored(backend, t, 0, n, out.data()));
  return out;
}

// A master of more than kMeasuredChunks chunks is updated once everywhere, and measured on a sample
// of chunks whose sums stand for the whole: exact when every chunk moves alike, as here (2 → 1.5
// everywhere, with a part chunk at the end), whatever chunks the sample takes.
TEST(UpdateMeterTest, ALargeMasterIsUpdatedWholeAndMeasuredOnASample) {
  auto backend = kernels::NewCpuBackend(1);
  const size_t chunk = UpdateMeter::ChunkElements(*backend);
  const size_t n = 9 * chunk + 5;
  ASSERT_OK_AND_ASSIGN(StoredTensor master, AllocateStored(*backend, kernels::StorageDtype::kFp32, n));
  const std::vector<float> twos(n, 2.0f);
  ASSERT_OK(WriteStored(*backend, master, 0, n, twos.data()));
  std::vector<int> updates(n, 0);
  StepTelemetry t;
  ASSERT_OK(UpdateMeter::Reserve(*backend, t));
  ASSERT_OK(UpdateMeter::Measure(
      *backend, master.Ref(), n,
      [&](size_t offset, size_t count, double*) {
        auto* w = static_cast<float*>(master.Ref().At(offset).data);
        for (size_t i = 0; i < count; ++i) {
          w[i] -= 0.5f;
          ++updates[offset + i];
        }
        return absl::OkStatus();
      },
      &t, /*in_pass=*/false));
  ASSERT_OK(t.pending.Collect(*backend));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(updates[i], 1) << "element " << i;
  EXPECT_EQ(t.updated_elements, static_cast<int64_t>(n));
  EXPECT_NEAR(t.master_sum_squares, 4.0 * n, 1e-12 * 4.0 * n);
  EXPECT_NEAR(t.update_sum_squares, 0.25 * n, 1e-12 * 0.25 * n);
}

TEST_P(StepMeasuredTest, SameBitsAndTheSumsOfTheChange) {
  auto backend = kernels::NewCpuBackend(1);
  GroupOptions o = DefaultOptions(GetParam().kind);
  o.master_dtype = GetParam().master_dtype;
  o.weight_decay = 0.1;
  ASSERT_OK_AND_ASSIGN(auto plain, Optimizer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto measured, Optimizer::Create(o));
  // Element-wise parameters over three meter chunks and a part; Muon's (and Dion2's) two same-shape
  // matrices and an expert stack.
  const bool matrices = o.optimizer == OptimizerKind::kMuon || o.optimizer == OptimizerKind::kDion2;
  const size_t chunk = UpdateMeter::ChunkElements(*backend);
  const std::vector<std::vector<int64_t>> shapes =
      matrices ? std::vector<std::vector<int64_t>>{{64, 48}, {64, 48}, {3, 16, 40}}
               : std::vector<std::vector<int64_t>>{{static_cast<int64_t>(3 * chunk + 11)}, {5, 7}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<ParamState> a(shapes.size()), b(shapes.size());
  std::vector<std::vector<float>> before(shapes.size()), grads(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (ParamState* s : {&a[i], &b[i]}) {
      s->name = "p" + std::to_string(i);
      s->shape = shapes[i];
      s->numel = 1;
      for (int64_t d : s->shape) s->numel *= d;
    }
    const size_t n = static_cast<size_t>(a[i].numel);
    std::vector<float> w(n), g(n);
    for (float& x : w) x = normal(rng);
    for (float& x : g) x = normal(rng);
    grads[i] = g;
    for (ParamState* s : {&a[i], &b[i]}) {
      ASSERT_OK_AND_ASSIGN(s->master, AllocateStored(*backend, o.master_dtype, n));
      ASSERT_OK(WriteStored(*backend, s->master, 0, n, w.data()));
      ASSERT_OK_AND_ASSIGN(s->grad, backend->Allocate(n));
      ASSERT_OK(backend->CopyToDevice(g.data(), s->grad->data(), n));
      s->has_grad = true;
      ASSERT_OK((s == &a[i] ? plain : measured)->InitState(*backend, *s));
    }
    before[i] = Read(*backend, a[i].master, n);  // as stored (rounded to the master's format)
  }
  std::vector<ParamState*> pa, pb;
  for (size_t i = 0; i < shapes.size(); ++i) {
    pa.push_back(&a[i]);
    pb.push_back(&b[i]);
  }
  ASSERT_OK(plain->Step(*backend, plain->DefaultHyper(), pa));
  StepTelemetry t;
  ASSERT_OK(measured->StepMeasured(*backend, measured->DefaultHyper(), pb, t));

  double w2 = 0, d2 = 0;
  int64_t elements = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t n = static_cast<size_t>(a[i].numel);
    const std::vector<float> wa = Read(*backend, a[i].master, n), wb = Read(*backend, b[i].master, n);
    for (size_t j = 0; j < n; ++j) ASSERT_EQ(wa[j], wb[j]) << "parameter " << i << " element " << j;
    for (size_t s = 0; s < a[i].slots.size(); ++s) {
      const size_t slot_n = a[i].slots[s].tensor.numel;
      EXPECT_EQ(Read(*backend, a[i].slots[s].tensor, slot_n), Read(*backend, b[i].slots[s].tensor, slot_n));
    }
    for (size_t j = 0; j < n; ++j) {
      w2 += static_cast<double>(before[i][j]) * before[i][j];
      // The meter subtracts in fp32: exact where the two are within a factor 2 (Sterbenz), else
      // rounded by ≤ 2⁻²⁴ of the difference.
      const double d = static_cast<double>(static_cast<float>(before[i][j] - wb[j]));
      d2 += d * d;
    }
    elements += a[i].numel;
  }
  EXPECT_EQ(t.updated_elements, elements);
  // The CPU backend measures an element-wise update of an fp32 master in its own pass, in eight
  // fp32 lanes over pieces of 1024 (each lane ≤ 128 terms: within 2⁻¹⁷ relative); otherwise in fp64.
  const bool in_pass = !matrices && o.master_dtype == kernels::StorageDtype::kFp32;
  EXPECT_NEAR(t.master_sum_squares, w2, (in_pass ? 1e-5 : 1e-12) * w2);
  EXPECT_NEAR(t.update_sum_squares, d2, (in_pass ? 1e-5 : 1e-6) * d2);
  EXPECT_GT(t.update_sum_squares, 0);
  if (o.optimizer == OptimizerKind::kMuon) {
    EXPECT_EQ(t.matrices, 5);  // two matrices and three experts
    ASSERT_TRUE(t.residual.has_value());
    // Step 0 measures the first matrix in the order they are orthogonalized, by shape: (16, 40)
    // before (64, 48), so p2's first expert.
    EXPECT_EQ(t.residual_parameter, "p2");
    EXPECT_GT(*t.residual, 0);
    EXPECT_LT(*t.residual, 0.8);
    EXPECT_GT(t.momentum_sum_squares, 0);
    EXPECT_LE(t.smallest_momentum_norm * t.smallest_momentum_norm, t.momentum_sum_squares);
  } else if (o.optimizer == OptimizerKind::kDion2) {
    // Newton–Schulz's input is each matrix's chosen lines of M = G: the ⌈0.25·lines⌉ of largest L1
    // norm, columns of the tall 64×48 matrices (12 of 48), rows of the wide 16×40 experts (4 of 16).
    EXPECT_EQ(t.matrices, 5);
    double chosen = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const bool experts = shapes[i].size() == 3;
      const int64_t count = experts ? shapes[i][0] : 1, rows = shapes[i][experts ? 1 : 0],
                    cols = shapes[i][experts ? 2 : 1];
      const bool columns = rows > cols;
      const int64_t lines = columns ? cols : rows, length = columns ? rows : cols;
      for (int64_t e = 0; e < count; ++e) {
        std::vector<std::pair<double, double>> by_line;  // (L1, Σ²) of each line
        for (int64_t l = 0; l < lines; ++l) {
          double l1 = 0, squares = 0;
          for (int64_t k = 0; k < length; ++k) {
            const double v = grads[i][static_cast<size_t>(e * rows * cols + (columns ? k * cols + l : l * cols + k))];
            l1 += std::abs(v);
            squares += v * v;
          }
          by_line.emplace_back(l1, squares);
        }
        std::sort(by_line.begin(), by_line.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
        for (int64_t l = 0; l < (lines + 3) / 4; ++l) chosen += by_line[static_cast<size_t>(l)].second;
      }
    }
    EXPECT_NEAR(t.momentum_sum_squares, chosen, 1e-6 * chosen);
    EXPECT_LE(t.smallest_momentum_norm * t.smallest_momentum_norm, t.momentum_sum_squares);
    // Step 0 measures the group's first matrix, in parameter order: p0's.
    ASSERT_TRUE(t.residual.has_value());
    EXPECT_EQ(t.residual_parameter, "p0");
    EXPECT_EQ(t.residual_offset, 0u);
    EXPECT_GT(*t.residual, 0);
    EXPECT_LT(*t.residual, 0.8);
  } else {
    EXPECT_EQ(t.matrices, 0);
    EXPECT_FALSE(t.residual.has_value());
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, StepMeasuredTest,
                         ::testing::Values(Case{OptimizerKind::kMuon, kernels::StorageDtype::kFp32},
                                           Case{OptimizerKind::kMuon, kernels::StorageDtype::kBf16},
                                           Case{OptimizerKind::kAdamW, kernels::StorageDtype::kFp32},
                                           Case{OptimizerKind::kAdamW, kernels::StorageDtype::kBf16},
                                           Case{OptimizerKind::kLion, kernels::StorageDtype::kFp16},
                                           Case{OptimizerKind::kDion2, kernels::StorageDtype::kFp32},
                                           Case{OptimizerKind::kDion2, kernels::StorageDtype::kBf16},
                                           Case{OptimizerKind::kSgd, kernels::StorageDtype::kFp32}));

// Rows s·eᵢ (wide) or their transpose (tall): X·Xᵀ (or Xᵀ·X) = s²·I, so the residual is |s² − 1|
// exactly (s² and s² − 1 are exact in fp32 for these s).
TEST(OrthogonalityResidualTest, ScaledIdentityBlocks) {
  auto backend = kernels::NewCpuBackend(1);
  NsWorkspace ws;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 9}, {9, 4}, {5, 5}}) {
    for (float s : {1.0f, 0.5f, 2.0f}) {
      std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);
      for (int64_t i = 0; i < std::min(rows, cols); ++i) x[static_cast<size_t>(i * cols + i)] = s;
      ASSERT_OK_AND_ASSIGN(auto buffer, backend->Allocate(x.size()));
      ASSERT_OK(backend->CopyToDevice(x.data(), buffer->data(), x.size()));
      ASSERT_OK_AND_ASSIGN(double r, OrthogonalityResidual(*backend, buffer->data(), rows, cols, ws));
      EXPECT_EQ(r, std::abs(static_cast<double>(s) * s - 1.0)) << rows << "x" << cols << " s=" << s;
    }
  }
}

TEST(NewtonSchulzSumsTest, InputSumsAreEachMatrixsSumOfSquares) {
  auto backend = kernels::NewCpuBackend(1);
  NsWorkspace ws;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 12, cols = 5, batch = 3;
  std::vector<float> g(static_cast<size_t>(rows * cols * batch));
  for (float& x : g) x = normal(rng);
  ASSERT_OK_AND_ASSIGN(auto in, backend->Allocate(g.size()));
  ASSERT_OK_AND_ASSIGN(auto out, backend->Allocate(g.size()));
  ASSERT_OK(backend->CopyToDevice(g.data(), in->data(), g.size()));
  std::vector<double> sums(batch), expected(batch);
  ASSERT_OK(backend->SumSquares(in->data(), static_cast<size_t>(rows * cols), batch, expected.data()));
  const GroupOptions o;
  ASSERT_OK(NewtonSchulz(*backend, o.ns_schedule, 5, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, in->data(),
                         out->data(), rows, cols, batch, ws, sums.data()));
  // The same fp64 sums, in the transposed order Newton–Schulz reads a tall matrix in.
  for (int64_t i = 0; i < batch; ++i) EXPECT_NEAR(sums[i], expected[i], 1e-12 * expected[i]);
}

}  // namespace
}  // namespace muond::optim
