// Precision-aware state (GroupOptions' master_dtype and slot *_dtype options): the 16-bit
// conversions, StoredTensor and StagingArea on the CPU backend, and every optimizer with 16-bit
// state against its fp32 path whose state is rounded on the host after each step — the definition of
// "load, compute in fp32, round on store", which the 16-bit path must meet bit for bit.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/half_float.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "kernels/optim/stored_tensor.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using kernels::StorageDtype;

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Round to nearest even by the definition: of the two neighbours on the target grid, the nearer
// (compared in fp64, exact here), the even one on a tie. `Down` gives the grid point at or below |x|
// and `Next` the one above.
template <typename Down, typename Next, typename Widen>
uint16_t NearestEven(float x, Down down, Next next, Widen widen) {
  const uint16_t lo = down(x), hi = next(lo);
  const double dl = std::abs(static_cast<double>(x) - widen(lo)), dh = std::abs(widen(hi) - static_cast<double>(x));
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1u) ? hi : lo;
}

TEST(HalfFloat, EveryBf16AndFp16ValueSurvivesARoundTrip) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float b = Bf16ToFloat(bits), f = Fp16ToFloat(bits);
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(b))));
    } else {
      ASSERT_EQ(FloatToBf16(b), bits) << std::hex << h;
    }
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f))));
    } else {
      ASSERT_EQ(FloatToFp16(f), bits) << std::hex << h;
    }
  }
}

TEST(HalfFloat, RoundsToNearestEvenByDefinition) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  int checked_bf16 = 0, checked_fp16 = 0;
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns cover every exponent; every 4th is a midpoint, the tie case.
    uint32_t bits = any(rng);
    if (i % 4 == 0) bits = (bits & 0xffff0000u) | 0x8000u;
    const float x = FromBits(bits);
    if (!std::isfinite(x)) continue;
    const float a = std::abs(x);
    if (a < 3.38e38f) {  // below bf16's largest finite value: both neighbours are finite
      const uint16_t expect = NearestEven(
          a, [](float v) { return static_cast<uint16_t>(Bits(v) >> 16); },
          [](uint16_t v) { return static_cast<uint16_t>(v + 1); }, [](uint16_t v) { return double{Bf16ToFloat(v)}; });
      ASSERT_EQ(FloatToBf16(a), expect) << a;
      ASSERT_EQ(FloatToBf16(-a), expect | 0x8000u) << -a;
      ++checked_bf16;
    }
    // fp16: scale the same mantissa into fp16's range (2^-26 .. 65504) and check against the grid.
    int exponent = 0;
    const float h = std::ldexp(std::abs(std::frexp(x, &exponent)), (i % 42) - 26);
    if (h < 65504.0f) {
      const uint16_t expect = NearestEven(
          h,
          [](float v) {  // largest fp16 at or below v, by search over the ordered positive codes
            uint16_t lo = 0, hi = 0x7bff;
            while (lo < hi) {
              const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
              if (Fp16ToFloat(mid) <= v)
                lo = mid;
              else
                hi = static_cast<uint16_t>(mid - 1);
            }
            return lo;
          },
          [](uint16_t v) { return static_cast<uint16_t>(v + 1); }, [](uint16_t v) { return double{Fp16ToFloat(v)}; });
      ASSERT_EQ(FloatToFp16(h), expect) << h;
      ++checked_fp16;
    }
  }
  EXPECT_GT(checked_bf16, 1000000);
  EXPECT_GT(checked_fp16, 1000000);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00) << "fp16 overflow is infinity";
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
}

float RoundTo(StorageDtype dtype, float x) {
  switch (dtype) {
    case StorageDtype::kBf16:
      return Bf16ToFloat(FloatToBf16(x));
    case StorageDtype::kFp16:
      return Fp16ToFloat(FloatToFp16(x));
    case StorageDtype::kFp32:
      return x;
  }
  return x;
}

class StoredTensorTest : public ::testing::TestWithParam<bool> {};  // the backend is host-addressable

TEST_P(StoredTensorTest, WritesRoundAndReadsWidenAtAnyOffset) {
  auto backend = kernels::NewCpuBackend(1, GetParam());
  for (StorageDtype dtype : {StorageDtype::kFp32, StorageDtype::kBf16, StorageDtype::kFp16}) {
    ASSERT_OK_AND_ASSIGN(StoredTensor t, AllocateStored(*backend, dtype, 13));
    EXPECT_EQ(t.bytes(), 13 * kernels::StorageBytes(dtype));
    std::vector<float> zeros(13, 1.0f);
    ASSERT_OK(ReadStored(*backend, t, 0, 13, zeros.data()));
    EXPECT_EQ(zeros, std::vector<float>(13, 0.0f)) << "allocated zeroed";
    const std::vector<float> values = {1.0f / 3, -2.7182817f, 1000.1f, 1e-6f, -0.0f};
    ASSERT_OK(WriteStored(*backend, t, 7, values.size(), values.data()));  // an odd offset
    std::vector<float> all(13);
    ASSERT_OK(ReadStored(*backend, t, 0, 13, all.data()));
    for (size_t i = 0; i < 13; ++i) {
      const float expect = i >= 7 && i < 12 ? RoundTo(dtype, values[i - 7]) : 0.0f;
      EXPECT_EQ(Bits(all[i]), Bits(expect)) << kernels::StorageDtypeName(dtype) << " element " << i;
    }
    EXPECT_FALSE(ReadStored(*backend, t, 10, 4, all.data()).ok()) << "a region past the end is refused";
    // Single elements that share a word with a neighbour leave the neighbour as it was.
    const float six = 6.5f, eleven = -11.25f;
    ASSERT_OK(WriteStored(*backend, t, 6, 1, &six));      // the low half of word 3; 7 is its high half
    ASSERT_OK(WriteStored(*backend, t, 11, 1, &eleven));  // the high half of word 5; 10 is its low half
    ASSERT_OK(ReadStored(*backend, t, 0, 13, all.data()));
    for (size_t i = 0; i < 13; ++i) {
      const float expect = i == 6 ? six : i == 11 ? eleven : i >= 7 && i < 12 ? RoundTo(dtype, values[i - 7]) : 0.0f;
      EXPECT_EQ(Bits(all[i]), Bits(expect)) << kernels::StorageDtypeName(dtype) << " element " << i << " after";
    }
    std::vector<float> tail(3);
    ASSERT_OK(ReadStored(*backend, t, 10, 3, tail.data()));  // an odd-length read from an even offset
    EXPECT_EQ(Bits(tail[1]), Bits(eleven));
    std::vector<float> odd(5);
    ASSERT_OK(ReadStored(*backend, t, 7, 5, odd.data()));  // a read from an odd offset
    for (size_t i = 0; i < 5; ++i) {
      const float expect = i == 4 ? eleven : RoundTo(dtype, values[i]);
      EXPECT_EQ(Bits(odd[i]), Bits(expect)) << kernels::StorageDtypeName(dtype) << " element " << 7 + i;
    }
  }
}

TEST_P(StoredTensorTest, StagingLoadsWideAndStoresRounded) {
  auto backend = kernels::NewCpuBackend(1, GetParam());
  ASSERT_OK_AND_ASSIGN(StoredTensor t, AllocateStored(*backend, StorageDtype::kBf16, 6));
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  ASSERT_OK(WriteStored(*backend, t, 0, 6, values.data()));
  StagingArea staging;
  ASSERT_OK(staging.Reserve(*backend, 1, t, 4));
  EXPECT_EQ(staging.floats(), 4u);
  ASSERT_OK_AND_ASSIGN(float* view, staging.Load(*backend, 1, t, 2, 4));
  const float third = 1.0f / 3;
  ASSERT_OK(backend->Axpby(third, view, 0.0f, view, 4));  // view = values / 3, in fp32
  ASSERT_OK(staging.Store(*backend, 1, t, 2, 4));
  std::vector<float> back(6);
  ASSERT_OK(ReadStored(*backend, t, 0, 6, back.data()));
  for (size_t i = 0; i < 6; ++i) {
    const float expect = i >= 2 ? RoundTo(StorageDtype::kBf16, third * values[i]) : values[i];
    EXPECT_EQ(back[i], expect) << i;
  }
  // fp32 tensors are worked on in place: no scratch.
  ASSERT_OK_AND_ASSIGN(StoredTensor wide, AllocateStored(*backend, StorageDtype::kFp32, 6));
  ASSERT_OK(staging.Reserve(*backend, 0, wide, 6));
  ASSERT_OK_AND_ASSIGN(float* in_place, staging.Load(*backend, 0, wide, 1, 5));
  EXPECT_EQ(in_place, wide.fp32() + 1);
  EXPECT_EQ(staging.floats(), 4u);
}

INSTANTIATE_TEST_SUITE_P(HostAndDeviceLike, StoredTensorTest, ::testing::Bool(),
                         [](const auto& param_info) { return param_info.param ? "HostAddressable" : "DevicePath"; });

// ---- Optimizers with 16-bit state against their fp32 path, rounded after each step ----

struct PrecisionCase {
  std::string name;
  GroupOptions options;  // with 16-bit dtypes
  std::vector<std::vector<int64_t>> shapes;
};

GroupOptions Fp32Of(GroupOptions o) {
  o.master_dtype = o.momentum_dtype = o.exp_avg_dtype = o.exp_avg_sq_dtype = StorageDtype::kFp32;
  return o;
}

std::vector<float> Read(kernels::Backend& backend, const StoredTensor& t) {
  std::vector<float> out(t.numel);
  EXPECT_OK(ReadStored(backend, t, 0, t.numel, out.data()));
  return out;
}

// Rounds an fp32 tensor's values to `dtype` in place (the fp32 path's "store").
void RoundInPlace(kernels::Backend& backend, StoredTensor& t, StorageDtype dtype) {
  std::vector<float> v = Read(backend, t);
  for (float& x : v) x = RoundTo(dtype, x);
  EXPECT_OK(WriteStored(backend, t, 0, v.size(), v.data()));
}

class PrecisionStateTest : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(PrecisionStateTest, SixteenBitStateIsTheFp32StepRoundedOnStore) {
  const PrecisionCase& c = GetParam();
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto narrow, Optimizer::Create(c.options));
  ASSERT_OK_AND_ASSIGN(auto wide, Optimizer::Create(Fp32Of(c.options)));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<ParamState> a(c.shapes.size()), b(c.shapes.size());
  for (size_t i = 0; i < c.shapes.size(); ++i) {
    for (ParamState* s : {&a[i], &b[i]}) {
      s->name = "p" + std::to_string(i);
      s->shape = c.shapes[i];
      s->numel = 1;
      for (int64_t d : s->shape) s->numel *= d;
    }
    std::vector<float> w(a[i].numel);
    for (float& x : w) x = RoundTo(c.options.master_dtype, normal(rng));
    ASSERT_OK_AND_ASSIGN(a[i].master, AllocateStored(*backend, c.options.master_dtype, w.size()));
    ASSERT_OK(WriteStored(*backend, a[i].master, 0, w.size(), w.data()));
    b[i].master = testing::Upload(*backend, w);
    for (ParamState* s : {&a[i], &b[i]}) {
      ASSERT_OK_AND_ASSIGN(s->grad, backend->Allocate(s->numel));
    }
    ASSERT_OK(narrow->InitState(*backend, a[i]));
    ASSERT_OK(wide->InitState(*backend, b[i]));
    for (const StateSlot& slot : a[i].slots) {
      EXPECT_EQ(slot.tensor.dtype, narrow->SlotDtype(slot.name)) << slot.name;
    }
  }
  std::vector<ParamState*> pa, pb;
  for (size_t i = 0; i < a.size(); ++i) {
    pa.push_back(&a[i]);
    pb.push_back(&b[i]);
  }
  bool any_16bit_changed = false;
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      std::vector<float> g(a[i].numel);
      for (float& x : g) x = 0.1f * normal(rng);
      ASSERT_OK(backend->CopyToDevice(g.data(), a[i].grad->data(), g.size()));
      ASSERT_OK(backend->CopyToDevice(g.data(), b[i].grad->data(), g.size()));
      a[i].has_grad = b[i].has_grad = true;
    }
    ASSERT_OK(narrow->Step(*backend, narrow->DefaultHyper(), pa));
    ASSERT_OK(wide->Step(*backend, wide->DefaultHyper(), pb));
    for (size_t i = 0; i < a.size(); ++i) {
      RoundInPlace(*backend, b[i].master, c.options.master_dtype);
      EXPECT_EQ(Read(*backend, a[i].master), Read(*backend, b[i].master)) << c.name << " master, step " << step;
      for (size_t s = 0; s < a[i].slots.size(); ++s) {
        const StorageDtype dtype = narrow->SlotDtype(a[i].slots[s].name);
        RoundInPlace(*backend, b[i].slots[s].tensor, dtype);
        const std::vector<float> got = Read(*backend, a[i].slots[s].tensor);
        EXPECT_EQ(got, Read(*backend, b[i].slots[s].tensor))
            << c.name << " " << a[i].slots[s].name << ", step " << step;
        if (dtype != StorageDtype::kFp32) {
          for (float x : got) any_16bit_changed |= x != 0.0f;
        }
      }
    }
  }
  EXPECT_TRUE(any_16bit_changed) << "the 16-bit slots must take part in the step";
}

PrecisionCase Case(std::string name, GroupOptions o, std::vector<std::vector<int64_t>> shapes) {
  return PrecisionCase{std::move(name), std::move(o), std::move(shapes)};
}

std::vector<PrecisionCase> Cases() {
  std::vector<PrecisionCase> out;
  GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  muon.momentum_dtype = StorageDtype::kBf16;
  out.push_back(Case("MuonBf16Momentum", muon, {{8, 12}, {8, 12}, {3, 4, 6}}));
  muon.master_dtype = StorageDtype::kBf16;
  muon.weight_decay = 0.1;
  muon.weight_decay_mode = WeightDecayMode::kCautious;
  out.push_back(Case("MuonBf16MasterCautious", muon, {{8, 12}, {12, 8}}));
  GroupOptions adamuon = DefaultOptions(OptimizerKind::kMuon);
  adamuon.moment2_method = Moment2Method::kAdamuon;
  adamuon.beta2 = 0.95;
  adamuon.master_dtype = adamuon.momentum_dtype = adamuon.exp_avg_sq_dtype = StorageDtype::kBf16;
  adamuon.weight_decay_mode = WeightDecayMode::kL2;
  adamuon.weight_decay = 0.01;
  out.push_back(Case("AdamuonAllBf16L2", adamuon, {{6, 10}, {6, 10}, {10, 6}}));
  GroupOptions normuon = adamuon;
  normuon.moment2_method = Moment2Method::kNormuon;
  normuon.weight_decay_mode = WeightDecayMode::kDecoupled;
  normuon.exp_avg_sq_dtype = StorageDtype::kFp16;
  out.push_back(Case("NormuonFp16Moment", normuon, {{6, 10}, {10, 6}, {2, 5, 7}}));
  GroupOptions tp = DefaultOptions(OptimizerKind::kMuon);
  tp.master_dtype = tp.momentum_dtype = StorageDtype::kFp16;
  tp.moment2_method = Moment2Method::kAdamuon;
  tp.exp_avg_sq_dtype = StorageDtype::kBf16;
  out.push_back(Case("AdamuonFp16Conv", tp, {{4, 3, 2, 2}, {5, 7}}));
  GroupOptions adamw = DefaultOptions(OptimizerKind::kAdamW);
  adamw.exp_avg_dtype = adamw.exp_avg_sq_dtype = StorageDtype::kBf16;
  out.push_back(Case("AdamWBf16Moments", adamw, {{7}, {5, 3}}));
  adamw.master_dtype = StorageDtype::kBf16;
  adamw.exp_avg_sq_dtype = StorageDtype::kFp32;
  out.push_back(Case("AdamWBf16MasterAndExpAvg", adamw, {{9}, {4, 4}}));
  GroupOptions lion = DefaultOptions(OptimizerKind::kLion);
  lion.exp_avg_dtype = StorageDtype::kFp16;
  lion.master_dtype = StorageDtype::kBf16;
  lion.lr = 1e-2;
  out.push_back(Case("LionFp16ExpAvg", lion, {{11}}));
  // Large parameters: the CPU loops widen and round them in blocks, over several threads.
  GroupOptions chunked = DefaultOptions(OptimizerKind::kMuon);
  chunked.master_dtype = chunked.momentum_dtype = StorageDtype::kBf16;
  out.push_back(Case("MuonChunked", chunked, {{2, 600001}}));
  GroupOptions chunked_adamw = DefaultOptions(OptimizerKind::kAdamW);
  chunked_adamw.master_dtype = chunked_adamw.exp_avg_sq_dtype = StorageDtype::kFp16;
  out.push_back(Case("AdamWChunked", chunked_adamw, {{(int64_t{1} << 20) + 5}}));
  GroupOptions sgd = DefaultOptions(OptimizerKind::kSgd);
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  sgd.momentum_dtype = StorageDtype::kBf16;
  out.push_back(Case("SgdBf16Momentum", sgd, {{6}, {2, 3}}));
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, PrecisionStateTest, ::testing::ValuesIn(Cases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(PrecisionOptions, SlotsFollowTheirOptionAndMuonRefusesAMomentWithoutAMethod) {
  GroupOptions o = DefaultOptions(OptimizerKind::kAdamW);
  o.exp_avg_dtype = StorageDtype::kBf16;
  o.exp_avg_sq_dtype = StorageDtype::kFp16;
  ASSERT_OK_AND_ASSIGN(auto adamw, Optimizer::Create(o));
  EXPECT_EQ(adamw->SlotDtype("exp_avg"), StorageDtype::kBf16);
  EXPECT_EQ(adamw->SlotDtype("exp_avg_sq"), StorageDtype::kFp16);
  GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  muon.exp_avg_sq_dtype = StorageDtype::kBf16;
  const absl::Status refused = ValidateOptions(muon);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("exp_avg_sq_dtype"), std::string::npos) << refused.message();
}

TEST(PrecisionOptions, CaveatsNameWhatSixteenBitsCannotHold) {
  GroupOptions adamw = DefaultOptions(OptimizerKind::kAdamW);  // beta2 0.999
  EXPECT_TRUE(PrecisionCaveats(adamw).empty()) << "fp32 state has none";
  adamw.exp_avg_dtype = StorageDtype::kBf16;  // beta1 0.9: 1 - beta1 is far above bf16's 2^-8
  EXPECT_TRUE(PrecisionCaveats(adamw).empty());
  adamw.exp_avg_sq_dtype = StorageDtype::kBf16;  // 1 - 0.999 < 2^-8: v cannot decay
  std::vector<std::string> caveats = PrecisionCaveats(adamw);
  ASSERT_EQ(caveats.size(), 1u);
  EXPECT_NE(caveats[0].find("exp_avg_sq_dtype bf16"), std::string::npos) << caveats[0];
  EXPECT_NE(caveats[0].find("cannot decay"), std::string::npos) << caveats[0];
  adamw.exp_avg_sq_dtype = StorageDtype::kFp16;  // 1 - 0.999 > 2^-11, but (1 - beta2)·g² underflows
  caveats = PrecisionCaveats(adamw);
  ASSERT_EQ(caveats.size(), 1u);
  EXPECT_NE(caveats[0].find("rounds to 0 for |g| below about 0.0054"), std::string::npos) << caveats[0];
  GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  muon.momentum_dtype = StorageDtype::kBf16;  // 0.95
  EXPECT_TRUE(PrecisionCaveats(muon).empty());
  muon.momentum = 0.999;
  EXPECT_EQ(PrecisionCaveats(muon).size(), 1u);
}

}  // namespace
}  // namespace muond::optim
