// Gradient staging: decoded chunks land in the leased backend buffers, the pool keeps its spare
// set, the host tensors are reused across steps, and a step from staged gradients, from gradients
// read in place and from host values are bit-identical (clipped or not).
#include "server/session/gradient_staging.h"

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/wire/dtype_codec.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session.h"
#include "server/transport/grpc/tensor_assembler.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using rpc::ParseSessionSpec;
using transport::TensorAssembler;

v1::SessionSpec Spec() {
  v1::SessionSpec spec;
  auto* muon = spec.add_groups();
  muon->set_name("muon");
  muon->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  auto* adamw = spec.add_groups();
  adamw->set_name("adamw");
  adamw->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(16);
  w->add_shape(24);
  w->set_group("muon");
  auto* b = spec.add_parameters();
  b->set_name("b");
  b->add_shape(24);
  b->set_group("adamw");
  return spec;
}

std::vector<float> Values(size_t n, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(phase + 0.37f * static_cast<float>(i));
  return v;
}

// `values` cut into chunks of at most `per_chunk` elements.
std::vector<v1::TensorChunk> Chunks(const std::string& name, const std::vector<float>& values, size_t per_chunk) {
  std::vector<v1::TensorChunk> chunks;
  for (size_t offset = 0; offset < values.size(); offset += per_chunk) {
    const size_t n = std::min(per_chunk, values.size() - offset);
    v1::TensorChunk& chunk = chunks.emplace_back();
    chunk.set_name(name);
    chunk.set_offset(offset);
    wire::Encode(v1::DTYPE_FP32, std::span<const float>(values.data() + offset, n), chunk.mutable_data());
  }
  return chunks;
}

std::vector<float> Download(kernels::Backend& backend, const kernels::DeviceBuffer& buffer) {
  std::vector<float> out(buffer.size());
  EXPECT_OK(backend.CopyToHost(buffer.data(), out.data(), out.size()));
  return out;
}

TEST(GradientStagingTest, StagedPiecesLandInTheLeasedSet) {
  auto backend = kernels::NewCpuBackend(1);
  GradientPool pool(backend.get(), {16 * 24, 24});
  ASSERT_OK(pool.Preallocate());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<StagedGradients> staged, StagedGradients::Start(&pool, backend.get()));
  ASSERT_NE(staged, nullptr);
  const std::vector<float> w = Values(16 * 24, 0.3f);
  for (size_t offset = 0; offset < w.size(); offset += 100) {
    ASSERT_OK(
        staged->Add(0, static_cast<int64_t>(offset), w.data() + offset, std::min<size_t>(100, w.size() - offset)));
  }
  ASSERT_OK(staged->Finish());
  GradientSet& set = staged->lease().set();
  ASSERT_EQ(set.allocated(), 2u);
  EXPECT_EQ(Download(*backend, *set.buffer(0)), w);
  EXPECT_EQ(Download(*backend, *set.buffer(1)), std::vector<float>(24, 0.0f));
}

TEST(GradientStagingTest, ThePoolKeepsItsFullestSetAndConcurrentStepsGetTheirOwn) {
  auto backend = kernels::NewCpuBackend(1);
  GradientPool pool(backend.get(), {8, 4});
  ASSERT_OK(pool.Preallocate());
  kernels::DeviceBuffer* preallocated = nullptr;
  {
    GradientLease first = pool.Acquire();
    EXPECT_EQ(first.set().allocated(), 2u);
    preallocated = first.set().buffer(0).get();
    EXPECT_FALSE(pool.TryAcquire()) << "a stream may stage only while no other does";
    ASSERT_OK_AND_ASSIGN(auto not_staged, StagedGradients::Start(&pool, backend.get()));
    EXPECT_EQ(not_staged, nullptr);
    GradientLease second = pool.Acquire();  // while the first is out: a set of its own
    EXPECT_EQ(second.set().allocated(), 0u);
    ASSERT_OK(pool.Buffer(second.set(), 1).status());
    // `second` goes back first, then `first`, which is fuller and replaces it.
  }
  GradientLease again = pool.Acquire();
  EXPECT_EQ(again.set().allocated(), 2u);
  EXPECT_EQ(again.set().buffer(0).get(), preallocated) << "steady state reuses the same buffers";
}

// Three sessions from the same start: one on a device-like backend gets its gradients staged as a
// stream would, one on the host-memory backend has the optimizer read the decoded values in place,
// and one on the device-like backend gets them from host values (the path of journal replays and of
// a second stream); with and without clipping the parameters stay bit-identical.
TEST(GradientStagingTest, StagedInPlaceAndHostStepsMatchBitwise) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto host_memory = kernels::NewCpuBackend(1);
  const v1::SessionSpec spec = Spec();
  auto make = [&](const std::string& id, kernels::Backend* backend) {
    std::unique_ptr<Session> session =
        Session::Create(id, ParseSessionSpec(spec, SpecLimits{}).value(), backend).value();
    std::vector<HostTensor> initial(2);
    initial[0].values = Values(16 * 24, 1.0f);
    initial[0].received = 16 * 24;
    initial[1].values = Values(24, 2.0f);
    initial[1].received = 24;
    EXPECT_OK(session->Upload(std::move(initial)));
    return session;
  };
  std::unique_ptr<Session> staged_session = make("staged", device_like.get());
  std::unique_ptr<Session> in_place_session = make("in-place", host_memory.get());
  std::unique_ptr<Session> host_session = make("host", device_like.get());
  const float* decoded_into = nullptr;
  for (int step = 1; step <= 4; ++step) {
    StepRequest request;
    request.step = step;
    if (step % 2 == 0) request.max_grad_norm = 0.5;  // clips: the norm is about 14
    const std::vector<float> w = Values(16 * 24, 0.1f * step), b = Values(24, 0.7f * step);

    auto stream = [&](Session& session, bool expect_staged) -> StepOutcome {
      auto incoming = session.BeginStep(request);
      EXPECT_OK(incoming.status());
      TensorAssembler assembler(incoming->get(), 1 << 20);
      for (const v1::TensorChunk& chunk : Chunks("w", w, 50)) EXPECT_OK(assembler.Add(chunk));
      for (const v1::TensorChunk& chunk : Chunks("b", b, 7)) EXPECT_OK(assembler.Add(chunk));
      EXPECT_OK(assembler.Finish(false));
      EXPECT_EQ((*incoming)->gradients()[0].staged, expect_staged) << "the previous step gave the set back";
      EXPECT_EQ((*incoming)->gradients()[1].staged, expect_staged);
      if (!expect_staged) {
        // The host tensors are the session's, lent again at every step: nothing is allocated.
        const float* data = (*incoming)->gradients()[0].values.data();
        if (decoded_into != nullptr) {
          EXPECT_EQ(data, decoded_into) << "step " << step;
        }
        decoded_into = data;
      }
      auto outcome = session.FinishStep(std::move(*incoming));
      EXPECT_OK(outcome.status());
      return *outcome;
    };
    const StepOutcome from_staged = stream(*staged_session, true);
    const StepOutcome in_place = stream(*in_place_session, false);

    TensorAssembler host(host_session->config(), 1 << 20);
    for (const v1::TensorChunk& chunk : Chunks("w", w, 50)) ASSERT_OK(host.Add(chunk));
    for (const v1::TensorChunk& chunk : Chunks("b", b, 7)) ASSERT_OK(host.Add(chunk));
    ASSERT_OK(host.Finish(false));
    EXPECT_FALSE(host.tensors()[0].staged);
    ASSERT_OK_AND_ASSIGN(StepOutcome from_host, host_session->ApplyJournaledStep(request, std::move(host.tensors())));

    ASSERT_TRUE(from_staged.result.applied);
    ASSERT_TRUE(in_place.result.applied);
    EXPECT_EQ(from_staged.result.grad_norm, from_host.result.grad_norm);
    EXPECT_EQ(in_place.result.grad_norm, from_host.result.grad_norm);
    EXPECT_EQ(CopyValues(*from_staged.parameters), CopyValues(*from_host.parameters)) << "step " << step;
    EXPECT_EQ(CopyValues(*in_place.parameters), CopyValues(*from_host.parameters)) << "step " << step;
    EXPECT_NE(CopyValues(*from_staged.parameters)[0], Values(16 * 24, 1.0f)) << "the step changed nothing";
  }
}

// A host-memory session holds its gradient tensors from creation; a second stream of the same
// session while the first holds them decodes into tensors of its own, freed afterwards.
TEST(GradientStagingTest, HostGradientsAreLentToOneStepAtATime) {
  HostGradients store({8, 4});
  store.Preallocate();
  std::vector<HostTensor> first = store.Take();
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].values.size(), 8u);
  EXPECT_EQ(first[1].values.size(), 4u);
  const float* preallocated = first[0].values.data();
  first[0].received = 8;
  first[0].sum_squares = 3.0;
  std::vector<HostTensor> second = store.Take();
  ASSERT_EQ(second.size(), 2u);
  EXPECT_TRUE(second[0].values.empty()) << "the spare is lent once";
  store.GiveBack(std::move(second));
  store.GiveBack(std::move(first));  // fuller: replaces the empty one
  std::vector<HostTensor> again = store.Take();
  EXPECT_EQ(again[0].values.data(), preallocated);
  EXPECT_EQ(again[0].received, 0) << "taken tensors are reset";
  EXPECT_EQ(again[0].sum_squares, 0.0);
}

}  // namespace
}  // namespace muond::session
