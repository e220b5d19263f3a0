// ShmGradientSource and ShmParameterSink: a step read from and answered into a region gives the
// same norm, to the bit, and the same parameters whatever the number of copy threads, and on a
// backend whose memory is not the host's, where the gradients are staged in batches of 16 MiB
// (a tensor larger than a batch is cut at a whole segment, its sum carried on). An answer is
// written only by the latest call of its session and rank that named the region, and only while its
// caller has not given it up (answer_gate.h).
#include "server/transport/shm/shm_step.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/compute_pool.h"
#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/wire/dtype_codec.h"
#include "server/metrics/metrics.h"
#include "server/session/session.h"
#include "server/transport/shm/shared_mapping.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::transport {
namespace {

using ::muond::testing::StatusIs;

constexpr size_t kBig = 5'000'003;  // 20 MB of fp32: more than one staging batch
constexpr size_t kSmall = 7;

v1::SessionSpec BigAndSmallSpec() {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("adamw");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  for (const auto& [name, numel] : {std::pair<const char*, size_t>{"big", kBig}, {"small", kSmall}}) {
    auto* p = spec.add_parameters();
    p->set_name(name);
    p->add_shape(static_cast<int64_t>(numel));
    p->set_group("adamw");
  }
  return spec;
}

std::vector<float> Values(size_t n, float phase, int spread) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = std::ldexp(std::sin(phase + 0.37f * static_cast<float>(i)), static_cast<int>(i % spread) - spread / 2);
  }
  return v;
}

// A sealed memfd of `bytes`, mapped as the daemon maps a client's.
std::shared_ptr<SharedMapping> Region(size_t bytes) {
  const int fd = ::memfd_create("shm-step-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  absl::StatusOr<std::shared_ptr<SharedMapping>> mapping = SharedMapping::Map(fd, bytes);
  EXPECT_TRUE(mapping.ok()) << mapping.status();
  return *std::move(mapping);
}

struct Answers {
  std::vector<double> norms;
  std::vector<std::vector<float>> answered;  // the last step's parameters, read from the region
};

// Two steps of a session on `backend`, the gradients in `dtype` in a region laid out as the clients
// lay it out (a 4-byte slot per element, parameters answered as fp32 over the gradients), copied on
// `threads` threads.
Answers Steps(kernels::Backend* backend, int threads, v1::DType dtype) {
  Answers run;
  std::unique_ptr<session::Session> session = session::session_testing::NewSession(backend, BigAndSmallSpec());
  EXPECT_NE(session, nullptr);
  if (session == nullptr) return run;
  EXPECT_OK(session->Upload({session::session_testing::Tensor(Values(kBig, 0.5f, 9)),
                             session::session_testing::Tensor(Values(kSmall, 0.9f, 9))}));
  const std::shared_ptr<SharedMapping> region = Region(4 * (kBig + kSmall));
  const uint64_t offsets[2] = {0, 4 * kBig};  // "small" starts on no 16-byte boundary
  ComputePool pool(threads);
  for (int step = 1; step <= 2; ++step) {
    std::vector<SharedTensorPlace> gradients, parameters;
    for (size_t i = 0; i < 2; ++i) {
      const size_t numel = i == 0 ? kBig : kSmall;
      const std::vector<float> grad = Values(numel, 0.1f * static_cast<float>(step) + static_cast<float>(i), 41);
      wire::EncodeTo(dtype, grad, region->data() + offsets[i]);
      gradients.push_back({i, region, offsets[i], numel * wire::ElementSize(dtype), dtype});
      parameters.push_back({i, region, offsets[i], 4 * numel, v1::DTYPE_FP32});
    }
    ShmGradientSource source(std::move(gradients), &pool);
    ShmParameterSink sink(std::move(parameters), &pool);
    session::StepRequest request = session::session_testing::Request(step);
    request.max_grad_norm = 1.0;  // the norm decides the clipping: its bits matter
    EXPECT_OK(RunStep(*session, std::move(request), source, sink, *metrics::NoMetrics()));
    EXPECT_TRUE(sink.result().applied()) << sink.result().skip_reason();
    run.norms.push_back(sink.result().grad_norm());
  }
  for (size_t i = 0; i < 2; ++i) {
    std::vector<float> values(i == 0 ? kBig : kSmall);
    std::memcpy(values.data(), region->data() + offsets[i], 4 * values.size());
    run.answered.push_back(std::move(values));
  }
  int64_t last_step = 0;
  EXPECT_EQ(run.answered, session::CopyValues(*session->Parameters(&last_step)));
  return run;
}

bool SameBits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

class ShmStepTest : public ::testing::TestWithParam<v1::DType> {};

TEST_P(ShmStepTest, NormsAndParametersDoNotDependOnThreadsOrStaging) {
  auto host = kernels::NewCpuBackend(1);
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  const Answers one = Steps(host.get(), 1, GetParam());
  ASSERT_EQ(one.norms.size(), 2u);
  for (const auto& [backend, threads] :
       {std::pair{host.get(), 3}, std::pair{device_like.get(), 1}, std::pair{device_like.get(), 2}}) {
    const Answers other = Steps(backend, threads, GetParam());
    EXPECT_TRUE(SameBits(other.norms, one.norms)) << threads << " threads, " << backend->HostAddressable();
    EXPECT_EQ(other.answered, one.answered) << threads << " threads, " << backend->HostAddressable();
  }
}

// One step of a one-parameter session into `region`, answered through `claims`; the step's status.
absl::Status StepInto(session::Session& session, int64_t step, const std::shared_ptr<SharedMapping>& region,
                      AnswerClaims claims, bool given_up) {
  ComputePool pool(1);
  wire::EncodeTo(v1::DTYPE_FP32, Values(kSmall, 0.3f * static_cast<float>(step), 9), region->data());
  ShmGradientSource source({{1, region, 0, 4 * kSmall, v1::DTYPE_FP32}}, &pool);
  ShmParameterSink sink({{1, region, 0, 4 * kSmall, v1::DTYPE_FP32}}, &pool, std::move(claims),
                        [given_up] { return given_up; });
  return RunStep(session, session::session_testing::Request(step), source, sink, *metrics::NoMetrics());
}

TEST(ShmAnswerTest, OnlyTheLatestCallOfASessionAndRankThatItsCallerStillWaitsForWritesTheRegion) {
  auto backend = kernels::NewCpuBackend(1);
  std::unique_ptr<session::Session> session = session::session_testing::NewSession(backend.get(), BigAndSmallSpec());
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Upload({session::session_testing::Tensor(Values(kBig, 0.5f, 9)),
                             session::session_testing::Tensor(Values(kSmall, 0.9f, 9))}));
  const std::shared_ptr<SharedMapping> region = Region(4 * kSmall);
  const std::vector<float> sentinel(kSmall, -7.25f);
  const auto region_values = [&] {
    std::vector<float> values(kSmall);
    std::memcpy(values.data(), region->data(), 4 * kSmall);
    return values;
  };
  const auto claim = [&](int rank) { return AnswerClaims({&region->answers()}, "s", rank); };

  // A call of rank 0 that a later call of rank 0 superseded: the step is applied, nothing written.
  AnswerClaims first = claim(0);
  AnswerClaims later = claim(0);
  std::memcpy(region->data(), sentinel.data(), 4 * kSmall);
  ShmParameterSink superseded({{1, region, 0, 4 * kSmall, v1::DTYPE_FP32}}, nullptr, std::move(first));
  int64_t last_step = 0;
  session::StepOutcome outcome{{}, session->Parameters(&last_step)};
  ASSERT_OK_AND_ASSIGN(session::ParameterReader parameters, session->OpenParameters(outcome.parameters));
  parameters.Release();  // as RunStep gives it
  EXPECT_THAT(superseded.Send(outcome, parameters),
              StatusIs(absl::StatusCode::kFailedPrecondition, "a later step call of session 's' rank 0"));
  EXPECT_EQ(region_values(), sentinel);
  EXPECT_EQ(superseded.bytes_sent(), 0);

  // Another rank's call is not superseded by rank 0's: its answer is written.
  ASSERT_OK(StepInto(*session, 1, region, claim(1), /*given_up=*/false));
  EXPECT_EQ(region_values(), session::CopyValues(*session->Parameters(&last_step))[1]);
  EXPECT_EQ(last_step, 1);

  // A call its caller gave up: applied, CANCELLED, the region as the caller left it (the gradients
  // StepInto wrote, which the answer would have gone over).
  EXPECT_THAT(StepInto(*session, 2, region, claim(2), /*given_up=*/true),
              StatusIs(absl::StatusCode::kCancelled, "gave this call up"));
  EXPECT_EQ(session->last_step(), 2);
  EXPECT_EQ(region_values(), Values(kSmall, 0.3f * 2, 9));

  // The latest claim of rank 0 writes; once it is done, the earlier one is still refused.
  EXPECT_OK(StepInto(*session, 3, region, std::move(later), /*given_up=*/false));
  EXPECT_EQ(region_values(), session::CopyValues(*session->Parameters(&last_step))[1]);
  std::memcpy(region->data(), sentinel.data(), 4 * kSmall);
  EXPECT_THAT(superseded.Send(outcome, parameters),
              StatusIs(absl::StatusCode::kFailedPrecondition, "a later step call"));
  EXPECT_EQ(region_values(), sentinel);
}

// Once an answer is in the client's region its reader has nothing left to read: a step that changes
// the masters before the reader closes copies nothing for it, which leaves the copies' budget (the
// parameters' fp32 bytes) to a reader that still needs every parameter.
TEST(ShmAnswerTest, AnAnswerWrittenLeavesNoCopyToMakeForIt) {
  auto backend = kernels::NewCpuBackend(1);
  std::unique_ptr<session::Session> session = session::session_testing::NewSession(backend.get(), BigAndSmallSpec());
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Upload({session::session_testing::Tensor(Values(kBig, 0.5f, 9)),
                             session::session_testing::Tensor(Values(kSmall, 0.9f, 9))}));
  const std::shared_ptr<SharedMapping> region = Region(4 * (kBig + kSmall));
  ComputePool pool(1);
  ShmParameterSink sink({{0, region, 0, 4 * kBig, v1::DTYPE_FP32}, {1, region, 4 * kBig, 4 * kSmall, v1::DTYPE_FP32}},
                        &pool, AnswerClaims({&region->answers()}, "s", 0));
  int64_t last_step = 0;
  session::StepOutcome outcome{{}, session->Parameters(&last_step)};
  const std::vector<std::vector<float>> uploaded = session::CopyValues(*outcome.parameters);
  ASSERT_OK_AND_ASSIGN(session::ParameterReader written, session->OpenParameters(outcome.parameters));
  written.Release();  // as RunStep gives it
  ASSERT_OK(sink.Send(outcome, written));
  ASSERT_OK_AND_ASSIGN(session::ParameterReader unread, session->OpenParameters(outcome.parameters));
  unread.Release();

  const std::shared_ptr<SharedMapping> other = Region(4 * kSmall);
  ASSERT_OK(StepInto(*session, 1, other, AnswerClaims({&other->answers()}, "s", 1), /*given_up=*/false));
  EXPECT_OK(written.Hold());
  written.Release();
  ASSERT_OK(unread.Hold());
  for (size_t i = 0; i < uploaded.size(); ++i) {
    const std::span<const float> values = unread.Values(i);
    EXPECT_EQ(std::vector<float>(values.begin(), values.end()), uploaded[i]) << i;
  }
  unread.Release();
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ShmStepTest, ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16),
                         [](const auto& param_info) { return std::string(wire::DTypeName(param_info.param)); });

}  // namespace
}  // namespace muond::transport
