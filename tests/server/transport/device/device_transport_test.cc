// The GPU transports' step logic on the CPU backend in its device-like mode (buffers not handed to
// the host): gradients taken straight into the session's backend buffers match, step for step, the
// same gradients decoded on the host; the cases that need host values (several ranks, a zero count)
// take the host path; a non-finite device gradient skips the step; a replay reads nothing; the
// CUDA IPC source and sink and the NCCL source and sink move each listed tensor in its dtype.
// The peer objects here are host memory standing in for what libmuond_cuda.so opens on a GPU
// (kernels/peer_exchange.h); the table checks and the refusals of a backend without a GPU run as in
// the daemon.
#include <cmath>
#include <cstring>
#include <deque>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/wire/dtype_codec.h"
#include "server/metrics/metrics.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session.h"
#include "server/transport/api_codec/tensor_decode.h"
#include "server/transport/cuda_ipc/cuda_ipc_step.h"
#include "server/transport/cuda_ipc/cuda_memory_regions.h"
#include "server/transport/device/device_tensors.h"
#include "server/transport/nccl/nccl_channels.h"
#include "server/transport/nccl/nccl_step.h"
#include "server/transport/shm/shared_memory_regions.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::transport {
namespace {

using ::testing::HasSubstr;

// The session layer tests' spec: w (8×6, Muon) and b (6, AdamW).
constexpr size_t kW = 48, kB = 6;

v1::SessionSpec Spec(int world_size = 1) { return session::session_testing::SmallSpec(world_size); }

std::vector<float> Values(size_t n, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(phase + 0.37f * static_cast<float>(i));
  return v;
}

// A session of `spec` with w and b uploaded (the same values every time).
std::unique_ptr<session::Session> SessionOf(const std::string& id, const v1::SessionSpec& spec,
                                            kernels::Backend* backend) {
  std::unique_ptr<session::Session> session =
      session::Session::Create(id, rpc::ParseSessionSpec(spec, session::SpecLimits{}).value(), backend).value();
  std::vector<HostTensor> initial(2);
  initial[0].values = Values(kW, 1.0f);
  initial[0].received = kW;
  initial[1].values = Values(kB, 2.0f);
  initial[1].received = kB;
  EXPECT_OK(session->Upload(std::move(initial)));
  return session;
}

std::unique_ptr<session::Session> NewSession(const std::string& id, kernels::Backend* backend, int world_size = 1) {
  return SessionOf(id, Spec(world_size), backend);
}

// Bytes of `values` in `dtype`.
std::string Encoded(v1::DType dtype, const std::vector<float>& values) {
  std::string bytes(values.size() * wire::ElementSize(dtype), '\0');
  wire::EncodeTo(dtype, values, bytes.data());
  return bytes;
}

std::vector<float> Decoded(v1::DType dtype, const std::string& bytes) {
  std::vector<float> values(bytes.size() / wire::ElementSize(dtype));
  DecodeSumSquares(dtype, absl::string_view(bytes), std::span<float>(values));
  return values;
}

// Steps `session` with `w` and `b` (in `dtype`) taken from "device" memory, as the GPU transports do.
absl::StatusOr<session::StepOutcome> DeviceStep(session::Session& session, kernels::Backend& backend,
                                                session::StepRequest request, v1::DType dtype,
                                                const std::vector<float>& w, const std::vector<float>& b,
                                                bool expect_device) {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<session::IncomingStep> step, session.BeginStep(std::move(request)));
  EXPECT_EQ(step->takes_device_gradients(), expect_device);
  std::string host_bytes;
  const std::string wb = Encoded(dtype, w), bb = Encoded(dtype, b);
  MUOND_RETURN_IF_ERROR(TakeDeviceGradient(backend, *step, 0, dtype, wb.data(), wb.size(), host_bytes));
  MUOND_RETURN_IF_ERROR(TakeDeviceGradient(backend, *step, 1, dtype, bb.data(), bb.size(), host_bytes));
  EXPECT_EQ(step->gradients()[0].device_only, expect_device);
  return session.FinishStep(std::move(step));
}

// The same step decoded on the host (the journal's path).
session::StepOutcome HostStep(session::Session& session, session::StepRequest request, v1::DType dtype,
                              const std::vector<float>& w, const std::vector<float>& b) {
  std::vector<HostTensor> tensors(2);
  const std::string wb = Encoded(dtype, w), bb = Encoded(dtype, b);
  tensors[0].values.resize(w.size());
  tensors[0].sum_squares = DecodeSumSquares(dtype, absl::string_view(wb), std::span<float>(tensors[0].values));
  tensors[0].received = static_cast<int64_t>(w.size());
  tensors[1].values.resize(b.size());
  tensors[1].sum_squares = DecodeSumSquares(dtype, absl::string_view(bb), std::span<float>(tensors[1].values));
  tensors[1].received = static_cast<int64_t>(b.size());
  request.device_answer = false;  // answered from the host, as a journal replay is
  return session.ApplyJournaledStep(std::move(request), std::move(tensors)).value();
}

class DeviceGradientsTest : public ::testing::TestWithParam<v1::DType> {};

TEST_P(DeviceGradientsTest, MatchTheHostPathStepForStep) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto device = NewSession("device", device_like.get());
  auto host = NewSession("host", device_like.get());
  for (int k = 1; k <= 4; ++k) {
    session::StepRequest request;
    request.step = k;
    if (k % 2 == 0) request.max_grad_norm = 0.5;  // clips: the norm is about 5
    const std::vector<float> w = Values(kW, 0.1f * k), b = Values(kB, 0.7f * k);
    ASSERT_OK_AND_ASSIGN(session::StepOutcome on_device,
                         DeviceStep(*device, *device_like, request, GetParam(), w, b, true));
    const session::StepOutcome on_host = HostStep(*host, request, GetParam(), w, b);
    ASSERT_TRUE(on_device.result.applied) << on_device.result.skip_reason;
    // The norm is summed on the backend, in its own order: equal to rounding.
    EXPECT_NEAR(on_device.result.grad_norm, on_host.result.grad_norm, 1e-12 * on_host.result.grad_norm);
    const auto device_values = session::CopyValues(*on_device.parameters);
    const auto host_values = session::CopyValues(*on_host.parameters);
    for (size_t p = 0; p < 2; ++p) {
      ASSERT_EQ(device_values[p].size(), host_values[p].size());
      for (size_t i = 0; i < host_values[p].size(); ++i) {
        if (k % 2 == 1) {
          ASSERT_EQ(device_values[p][i], host_values[p][i]) << "step " << k << " parameter " << p << " [" << i << "]";
        } else {
          ASSERT_NEAR(device_values[p][i], host_values[p][i], 1e-6f) << "step " << k;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DeviceGradientsTest, ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16),
                         [](const auto& param_info) { return std::string(wire::DTypeName(param_info.param)); });

TEST(DeviceGradientsTest, ANonFiniteDeviceGradientSkipsTheStepAndChangesNothing) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto session = NewSession("s", device_like.get());
  int64_t last = 0;
  const auto before = session::CopyValues(*session->Parameters(&last));
  std::vector<float> w = Values(kW, 0.3f);
  w[17] = std::nanf("");
  session::StepRequest request;
  request.step = 1;
  ASSERT_OK_AND_ASSIGN(session::StepOutcome outcome,
                       DeviceStep(*session, *device_like, request, v1::DTYPE_FP32, w, Values(kB, 0.2f), true));
  EXPECT_FALSE(outcome.result.applied);
  EXPECT_THAT(outcome.result.skip_reason, HasSubstr("non-finite gradient in 'w'"));
  EXPECT_EQ(session::CopyValues(*session->Parameters(&last)), before);
  EXPECT_EQ(last, 1) << "a skipped step still counts";
}

TEST(DeviceGradientsTest, ASkippedStepAfterADeviceAnswerAnswersFromTheHost) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto session = NewSession("mixed", device_like.get());
  session::StepRequest first;
  first.step = 1;
  first.device_answer = true;  // a GPU transport's step
  ASSERT_OK_AND_ASSIGN(session::StepOutcome on_device, DeviceStep(*session, *device_like, first, v1::DTYPE_FP32,
                                                                  Values(kW, 0.2f), Values(kB, 0.3f), true));
  ASSERT_TRUE(on_device.parameters->on_device);
  std::vector<float> w = Values(kW, 0.4f);
  w[0] = INFINITY;  // skipped
  session::StepRequest second;
  second.step = 2;  // over a host transport
  ASSERT_OK_AND_ASSIGN(session::StepOutcome skipped,
                       DeviceStep(*session, *device_like, second, v1::DTYPE_FP32, w, Values(kB, 0.5f), true));
  EXPECT_FALSE(skipped.result.applied);
  ASSERT_FALSE(skipped.parameters->on_device) << "a host transport gets host values";
  int64_t last = 0;
  EXPECT_EQ(session::CopyValues(*skipped.parameters), session::CopyValues(*session->Parameters(&last)));
}

TEST(DeviceGradientsTest, AZeroCountAndSeveralRanksTakeTheHostPath) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto session = NewSession("zeros", device_like.get());
  std::vector<float> w = Values(kW, 0.3f);
  w[3] = 0.0f;
  w[5] = -0.0f;
  session::StepRequest request;
  request.step = 1;
  request.count_zeros = true;
  ASSERT_OK_AND_ASSIGN(session::StepOutcome outcome,
                       DeviceStep(*session, *device_like, request, v1::DTYPE_FP32, w, Values(kB, 0.2f), false));
  EXPECT_EQ(outcome.result.num_zeros_in_grad, 2);

  // Two ranks: averaged on the host, so each rank's gradients come to the host.
  auto ranks = NewSession("ranks", device_like.get(), 2);
  auto reference = NewSession("reference", device_like.get());
  const std::vector<float> w0 = Values(kW, 0.1f), w1 = Values(kW, 0.9f);
  const std::vector<float> b0 = Values(kB, 0.4f), b1 = Values(kB, 0.6f);
  absl::StatusOr<session::StepOutcome> rank1;
  std::thread other([&] {
    session::StepRequest r;
    r.step = 1;
    r.rank = 1;
    rank1 = DeviceStep(*ranks, *device_like, r, v1::DTYPE_FP32, w1, b1, false);
  });
  session::StepRequest r0;
  r0.step = 1;
  r0.rank = 0;
  ASSERT_OK_AND_ASSIGN(session::StepOutcome rank0, DeviceStep(*ranks, *device_like, r0, v1::DTYPE_FP32, w0, b0, false));
  other.join();
  ASSERT_OK(rank1.status());
  std::vector<float> mean_w(w0.size()), mean_b(b0.size());
  for (size_t i = 0; i < w0.size(); ++i) mean_w[i] = (w0[i] + w1[i]) / 2;
  for (size_t i = 0; i < b0.size(); ++i) mean_b[i] = (b0[i] + b1[i]) / 2;
  session::StepRequest one;
  one.step = 1;
  const session::StepOutcome expected = HostStep(*reference, one, v1::DTYPE_FP32, mean_w, mean_b);
  EXPECT_EQ(session::CopyValues(*rank0.parameters), session::CopyValues(*expected.parameters));
  EXPECT_EQ(session::CopyValues(*rank1->parameters), session::CopyValues(*expected.parameters));
}

// Host memory standing in for a client's exported device buffer and its interprocess event.
class HostPeerMemory final : public kernels::PeerMemory {
 public:
  explicit HostPeerMemory(size_t bytes) : bytes_(bytes) {}
  void* data() override { return bytes_.data(); }
  uint64_t size() const override { return bytes_.size(); }

 private:
  std::vector<char> bytes_;
};

class CountingPeerEvent final : public kernels::PeerEvent {
 public:
  explicit CountingPeerEvent(int* waits) : waits_(waits) {}
  absl::StatusOr<bool> Poll() override {
    ++*waits_;
    return true;
  }

 private:
  int* waits_;
};

TEST(CudaIpcStepTest, GradientsInAndParametersOutOfTheRegionInTheirDtypes) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto ipc = NewSession("ipc", device_like.get());
  auto host = NewSession("host", device_like.get());
  // One region, laid out as the clients do: a 4-byte slot per element; w in bf16, b in fp32.
  const size_t w_bytes = kW * 4, b_bytes = kB * 4;
  auto region = std::make_shared<CudaRegion>();
  region->session = {"ipc", 1};
  region->memory = std::make_unique<HostPeerMemory>(w_bytes + b_bytes);
  int waits = 0;
  region->event = std::make_unique<CountingPeerEvent>(&waits);
  char* base = static_cast<char*>(region->memory->data());
  auto place = [&](size_t index, uint64_t offset, v1::DType dtype, uint64_t numel) {
    return CudaTensorPlace{TensorRef{index, offset, numel * wire::ElementSize(dtype), dtype}, region};
  };
  for (int k = 1; k <= 3; ++k) {
    const std::vector<float> w = Values(kW, 0.2f * k), b = Values(kB, 0.5f * k);
    const std::string wb = Encoded(v1::DTYPE_BF16, w), bb = Encoded(v1::DTYPE_FP32, b);
    std::memcpy(base, wb.data(), wb.size());
    std::memcpy(base + w_bytes, bb.data(), bb.size());
    session::StepRequest request;
    request.step = k;
    request.device_answer = k != 2;  // step 2 answers from a host copy, as after a failed read-back
    CudaIpcGradientSource source(device_like.get(),
                                 {place(0, 0, v1::DTYPE_BF16, kW), place(1, w_bytes, v1::DTYPE_FP32, kB)},
                                 absl::InfiniteFuture());
    // w goes back in bf16 from its fp32 master (narrowed on the device), b in fp32.
    CudaIpcParameterSink sink(ipc.get(), device_like.get(),
                              {place(0, 0, v1::DTYPE_BF16, kW), place(1, w_bytes, v1::DTYPE_FP32, kB)},
                              absl::InfiniteFuture());
    ASSERT_OK(RunStep(*ipc, request, source, sink, *metrics::NoMetrics()));
    EXPECT_EQ(waits, 2 * k) << "one wait on the client's event per region, before the gradients and the answer";
    EXPECT_EQ(source.bytes_received(), static_cast<int64_t>(wb.size() + bb.size()));
    ASSERT_TRUE(sink.result().applied());

    session::StepOutcome expected = HostStep(*host, request, v1::DTYPE_FP32, Decoded(v1::DTYPE_BF16, wb), b);
    const auto want = session::CopyValues(*expected.parameters);
    std::vector<float> got_b(kB);
    std::memcpy(got_b.data(), base + w_bytes, b_bytes);
    EXPECT_EQ(std::string(base, kW * 2), Encoded(v1::DTYPE_BF16, want[0])) << "step " << k;
    EXPECT_EQ(got_b, want[1]) << "step " << k;
    int64_t last = 0;
    // Asked for afterwards, the parameters are read back from the device.
    const auto read_back = ipc->Parameters(&last);
    EXPECT_FALSE(read_back->on_device);
    EXPECT_EQ(session::CopyValues(*read_back), want) << "step " << k;
  }
  // A replay (the answer was lost) reads nothing and writes the parameters again.
  std::memset(base, 0, w_bytes + b_bytes);
  session::StepRequest again;
  again.step = 3;
  CudaIpcGradientSource source(device_like.get(), {place(0, 0, v1::DTYPE_BF16, kW)}, absl::InfiniteFuture());
  CudaIpcParameterSink sink(ipc.get(), device_like.get(),
                            {place(0, 0, v1::DTYPE_FP32, kW), place(1, w_bytes, v1::DTYPE_FP32, kB)},
                            absl::InfiniteFuture());
  const int waits_before = waits;
  ASSERT_OK(RunStep(*ipc, again, source, sink, *metrics::NoMetrics()));
  EXPECT_TRUE(sink.result().replayed());
  EXPECT_EQ(waits, waits_before + 1) << "a replay's answer waits for the client's event too";
  EXPECT_EQ(source.bytes_received(), 0);
  int64_t last = 0;
  const auto now = session::CopyValues(*ipc->Parameters(&last));
  std::vector<float> got_b(kB);
  std::memcpy(got_b.data(), base + w_bytes, b_bytes);
  EXPECT_EQ(got_b, now[1]);
}

// An event that never completes: the step ends at its deadline, or at once when its caller is gone
// (the client died mid-step and its call was cancelled); either way nothing is applied and the
// session steps on afterwards.
class NeverCompletingEvent final : public kernels::PeerEvent {
 public:
  absl::StatusOr<bool> Poll() override {
    ++polls;
    return false;
  }
  int polls = 0;
};

TEST(CudaIpcStepTest, AnEventThatNeverCompletesEndsAtTheDeadlineOrWhenTheCallerIsGone) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto ipc = NewSession("ipc", device_like.get());
  auto region = std::make_shared<CudaRegion>();
  region->session = {"ipc", 1};
  region->memory = std::make_unique<HostPeerMemory>((kW + kB) * 4);
  auto* event = new NeverCompletingEvent;
  region->event.reset(event);
  const std::string wb = Encoded(v1::DTYPE_FP32, Values(kW, 0.3f)), bb = Encoded(v1::DTYPE_FP32, Values(kB, 0.1f));
  char* base = static_cast<char*>(region->memory->data());
  std::memcpy(base, wb.data(), wb.size());
  std::memcpy(base + wb.size(), bb.data(), bb.size());
  const std::vector<CudaTensorPlace> places = {
      CudaTensorPlace{TensorRef{0, 0, wb.size(), v1::DTYPE_FP32}, region},
      CudaTensorPlace{TensorRef{1, wb.size(), bb.size(), v1::DTYPE_FP32}, region}};
  int64_t last = -1;
  const auto before = session::CopyValues(*ipc->Parameters(&last));
  session::StepRequest request;
  request.step = 1;
  {
    CudaIpcGradientSource source(device_like.get(), places, absl::Now());
    CudaIpcParameterSink sink(ipc.get(), device_like.get(), places, absl::Now());
    EXPECT_THAT(RunStep(*ipc, request, source, sink, *metrics::NoMetrics()),
                ::muond::testing::StatusIs(absl::StatusCode::kDeadlineExceeded, "event_handle"));
  }
  {
    int asked = 0;
    const EventWait wait(absl::InfiniteFuture(), [&asked] { return ++asked >= 3; });
    CudaIpcGradientSource source(device_like.get(), places, wait);
    CudaIpcParameterSink sink(ipc.get(), device_like.get(), places, wait);
    const int polls_before = event->polls;
    EXPECT_THAT(RunStep(*ipc, request, source, sink, *metrics::NoMetrics()),
                ::muond::testing::StatusIs(absl::StatusCode::kCancelled, "the client went away"));
    EXPECT_EQ(event->polls - polls_before, 3) << "the caller is asked after every poll";
  }
  EXPECT_EQ(ipc->last_step(), 0);
  EXPECT_EQ(session::CopyValues(*ipc->Parameters(&last)), before) << "nothing was applied";
  // The session is free: a client whose event completes steps it.
  int waits = 0;
  region->event = std::make_unique<CountingPeerEvent>(&waits);
  CudaIpcGradientSource source(device_like.get(), places, absl::InfiniteFuture());
  CudaIpcParameterSink sink(ipc.get(), device_like.get(), places, absl::InfiniteFuture());
  ASSERT_OK(RunStep(*ipc, request, source, sink, *metrics::NoMetrics()));
  EXPECT_TRUE(sink.result().applied());
}

// Answers from 16-bit masters on the device: in their own format (bytes), widened, and converted to
// the other 16-bit format; refused once the masters have moved on.
TEST(CudaIpcStepTest, SixteenBitMastersAnswerInEveryDtype) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  v1::SessionSpec spec = Spec();
  spec.mutable_groups(0)->mutable_options()->set_master_dtype("fp16");
  spec.mutable_groups(1)->mutable_options()->set_master_dtype("bf16");
  std::unique_ptr<session::Session> session = SessionOf("sixteen", spec, device_like.get());
  session::StepRequest request;
  request.step = 1;
  request.device_answer = true;
  ASSERT_OK_AND_ASSIGN(session::StepOutcome outcome, DeviceStep(*session, *device_like, request, v1::DTYPE_FP32,
                                                                Values(kW, 0.3f), Values(kB, 0.6f), true));
  ASSERT_TRUE(outcome.result.applied) << outcome.result.skip_reason;
  ASSERT_TRUE(outcome.parameters->on_device);
  const std::shared_ptr<const session::ParameterSnapshot> on_device = outcome.parameters;
  int64_t last = 0;
  const auto masters = session::CopyValues(*session->Parameters(&last));  // widened exactly
  for (const v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (size_t p = 0; p < 2; ++p) {
      std::string out(masters[p].size() * wire::ElementSize(dtype), '\0');
      ASSERT_OK(session->CopyParameterOnDevice(*on_device, p, StorageOf(dtype), out.data()));
      EXPECT_EQ(out, Encoded(dtype, masters[p])) << wire::DTypeName(dtype) << " parameter " << p;
    }
  }
  request.step = 2;
  ASSERT_OK(
      DeviceStep(*session, *device_like, request, v1::DTYPE_FP32, Values(kW, 0.4f), Values(kB, 0.7f), true).status());
  std::string out(kB * 4, '\0');
  EXPECT_EQ(session->CopyParameterOnDevice(*on_device, 1, kernels::StorageDtype::kFp32, out.data()).code(),
            absl::StatusCode::kAborted);
}

// A channel whose peer's sends are queued byte strings, and whose sends are kept.
class QueuedPeerChannel final : public kernels::PeerChannel {
 public:
  absl::Status Ready(absl::Time) override { return absl::OkStatus(); }
  // A range of no bytes is no transfer, as on the CUDA backend's NCCL channel.
  absl::Status Receive(std::span<const kernels::ByteRange> ranges, absl::Time deadline) override {
    receive_deadline = deadline;
    for (const kernels::ByteRange& range : ranges) {
      if (range.bytes == 0) continue;
      if (incoming.empty() || incoming.front().size() != range.bytes) {
        return absl::DataLossError("the peer sent something else");
      }
      std::memcpy(range.data, incoming.front().data(), range.bytes);
      incoming.pop_front();
    }
    return absl::OkStatus();
  }
  absl::Status Send(std::span<const kernels::ByteRange> ranges, absl::Time deadline) override {
    send_deadline = deadline;
    for (const kernels::ByteRange& range : ranges) {
      if (range.bytes > 0) sent.emplace_back(static_cast<const char*>(range.data), range.bytes);
    }
    return absl::OkStatus();
  }
  void Abort() override {
    aborted_ = true;
    if (abort_seen != nullptr) *abort_seen = true;
  }
  bool aborted() const override { return aborted_; }

  std::deque<std::string> incoming;
  std::shared_ptr<bool> abort_seen;  // outlives the channel: what a test checks after it is gone
  std::vector<std::string> sent;
  absl::Time receive_deadline, send_deadline;

 private:
  bool aborted_ = false;
};

TEST(NcclStepTest, ReceivesInOrderSendsEveryParameterAndAReplayDrainsTheGradients) {
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  auto nccl = NewSession("nccl", device_like.get());
  auto host = NewSession("host", device_like.get());
  NcclChannel channel;
  auto peer = std::make_unique<QueuedPeerChannel>();
  QueuedPeerChannel* queue = peer.get();
  channel.peer = std::move(peer);
  const session::SessionConfig& config = nccl->config();
  google::protobuf::RepeatedPtrField<v1::NcclTensor> grads, params;
  auto add = [](google::protobuf::RepeatedPtrField<v1::NcclTensor>& list, const std::string& name, v1::DType dtype,
                uint64_t numel) {
    v1::NcclTensor* t = list.Add();
    t->set_name(name);
    t->set_dtype(dtype);
    t->set_byte_size(numel * wire::ElementSize(dtype));
  };
  add(grads, "b", v1::DTYPE_FP32, kB);  // listed order, not the spec's
  add(grads, "w", v1::DTYPE_FP16, kW);
  add(params, "w", v1::DTYPE_BF16, kW);
  add(params, "b", v1::DTYPE_FP32, kB);
  const absl::Time deadline = absl::InfiniteFuture();
  for (int k = 1; k <= 3; ++k) {
    const std::vector<float> w = Values(kW, 0.3f * k), b = Values(kB, 0.8f * k);
    const std::string wb = Encoded(v1::DTYPE_FP16, w);
    queue->incoming = {Encoded(v1::DTYPE_FP32, b), wb};
    queue->sent.clear();
    session::StepRequest request;
    request.step = k == 3 ? 2 : k;  // the third is a replay of step 2
    request.device_answer = true;
    NcclGradientSource source(device_like.get(), &channel,
                              ResolveNcclTensors(config, grads, "gradients", false, -1).value(), deadline,
                              absl::Seconds(60));
    NcclParameterSink sink(nccl.get(), device_like.get(), &channel,
                           ResolveNcclTensors(config, params, "parameters", true, -1).value(), deadline,
                           absl::Seconds(60));
    ASSERT_OK(RunStep(*nccl, request, source, sink, *metrics::NoMetrics()));
    EXPECT_TRUE(queue->incoming.empty()) << "every gradient is received, a replay's too";
    // Each transfer has --nccl-timeout from its own start: the answer's clock starts after the step.
    EXPECT_LT(queue->receive_deadline, absl::Now() + absl::Seconds(60));
    EXPECT_GE(queue->send_deadline, queue->receive_deadline);
    ASSERT_EQ(queue->sent.size(), 2u);
    int64_t last = 0;
    const auto now = session::CopyValues(*nccl->Parameters(&last));
    EXPECT_EQ(queue->sent[0], Encoded(v1::DTYPE_BF16, now[0]));
    EXPECT_EQ(queue->sent[1], Encoded(v1::DTYPE_FP32, now[1]));
    if (k < 3) {
      const session::StepOutcome expected = HostStep(*host, request, v1::DTYPE_FP32, Decoded(v1::DTYPE_FP16, wb), b);
      EXPECT_EQ(now, session::CopyValues(*expected.parameters)) << "step " << k;
    } else {
      EXPECT_TRUE(sink.result().replayed());
    }
  }
}

// Four ranks that hold rows (docs/ranks.md, Ranks that hold parts) step over NCCL: each receives and
// sends its parts only, rank 3 holds none of b (no transfer for it on either side), and the parts
// are those of one rank stepping the whole gradients.
TEST(NcclStepTest, RanksThatHoldPartsSendAndReceiveOnlyTheirParts) {
  constexpr int kRanks = 4;  // w: 8 rows of 6 → 2 rows each; b: 6 → 2, 2, 2, none
  auto device_like = kernels::NewCpuBackend(1, /*host_addressable=*/false);
  v1::SessionSpec spec = Spec(kRanks);
  for (v1::ParameterGroup& group : *spec.mutable_groups()) group.mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  std::unique_ptr<session::Session> parts = SessionOf("parts", spec, device_like.get());
  auto whole = NewSession("whole", device_like.get());
  const session::SessionConfig& config = parts->config();
  const auto part_of = [](const std::vector<float>& v, size_t rank, size_t per) {
    const size_t begin = std::min(v.size(), rank * per), end = std::min(v.size(), (rank + 1) * per);
    return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                              v.begin() + static_cast<std::ptrdiff_t>(end));
  };
  std::vector<NcclChannel> channels(kRanks);
  std::vector<QueuedPeerChannel*> queues;
  for (NcclChannel& channel : channels) {
    auto peer = std::make_unique<QueuedPeerChannel>();
    queues.push_back(peer.get());
    channel.peer = std::move(peer);
  }
  for (int k = 1; k <= 2; ++k) {
    const std::vector<float> w = Values(kW, 0.3f * k), b = Values(kB, 0.8f * k);
    std::vector<absl::Status> done(kRanks);
    std::vector<std::thread> ranks;
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<float> w_part = part_of(w, r, 12), b_part = part_of(b, r, 2);
      google::protobuf::RepeatedPtrField<v1::NcclTensor> grads, params;
      for (auto* list : {&grads, &params}) {
        for (const auto& [name, numel] : {std::pair{"w", w_part.size()}, std::pair{"b", b_part.size()}}) {
          v1::NcclTensor* t = list->Add();
          t->set_name(name);
          t->set_dtype(v1::DTYPE_FP32);
          t->set_byte_size(numel * 4);
        }
      }
      queues[r]->incoming.clear();
      queues[r]->sent.clear();
      queues[r]->incoming.push_back(Encoded(v1::DTYPE_FP32, w_part));
      if (!b_part.empty()) queues[r]->incoming.push_back(Encoded(v1::DTYPE_FP32, b_part));
      ranks.emplace_back([&, r, grads, params] {
        absl::StatusOr<std::vector<TensorRef>> in = ResolveNcclTensors(config, grads, "gradients", false, r);
        absl::StatusOr<std::vector<TensorRef>> out = ResolveNcclTensors(config, params, "parameters", true, r);
        if (!in.ok() || !out.ok()) {
          done[r] = in.ok() ? out.status() : in.status();
          return;
        }
        session::StepRequest request;
        request.step = k;
        request.rank = r;
        NcclGradientSource source(device_like.get(), &channels[r], *std::move(in), absl::InfiniteFuture(),
                                  absl::Seconds(60));
        NcclParameterSink sink(parts.get(), device_like.get(), &channels[r], *std::move(out), absl::InfiniteFuture(),
                               absl::Seconds(60));
        done[r] = RunStep(*parts, request, source, sink, *metrics::NoMetrics());
      });
    }
    for (std::thread& t : ranks) t.join();
    session::StepRequest one;
    one.step = k;
    const session::StepOutcome expected = HostStep(*whole, one, v1::DTYPE_FP32, w, b);
    const auto want = session::CopyValues(*expected.parameters);
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_OK(done[r]) << "rank " << r;
      EXPECT_TRUE(queues[r]->incoming.empty()) << "rank " << r;
      const std::vector<float> b_part = part_of(want[1], r, 2);
      ASSERT_EQ(queues[r]->sent.size(), b_part.empty() ? 1u : 2u) << "rank " << r << ": an empty part is no transfer";
      EXPECT_EQ(queues[r]->sent[0], Encoded(v1::DTYPE_FP32, part_of(want[0], r, 12))) << "rank " << r << " step " << k;
      if (!b_part.empty()) {
        EXPECT_EQ(queues[r]->sent[1], Encoded(v1::DTYPE_FP32, b_part)) << "rank " << r;
      }
    }
  }
  // A part of the wrong size is refused naming the field and the rank's part.
  google::protobuf::RepeatedPtrField<v1::NcclTensor> wrong;
  v1::NcclTensor* t = wrong.Add();
  t->set_name("b");
  t->set_dtype(v1::DTYPE_FP32);
  t->set_byte_size(kB * 4);
  const absl::Status refused = ResolveNcclTensors(config, wrong, "gradients", false, 3).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("gradients[0].byte_size"));
  EXPECT_THAT(refused.message(), HasSubstr("rank 3's part of 'b'"));
}

// A backend that only opens channels (QueuedPeerChannels), each recorded: what NcclChannels needs.
class ChannelOnlyBackend final : public kernels::Backend {
 public:
  // Whether each channel opened so far was aborted (in opening order).
  std::vector<std::shared_ptr<bool>> aborted;

  absl::StatusOr<kernels::NcclUniqueId> NewNcclUniqueId() override { return kernels::NcclUniqueId{}; }
  absl::StatusOr<std::unique_ptr<kernels::PeerChannel>> OpenPeerChannel(const kernels::NcclUniqueId&) override {
    auto channel = std::make_unique<QueuedPeerChannel>();
    channel->abort_seen = aborted.emplace_back(std::make_shared<bool>(false));
    return channel;
  }

  std::string Name() const override { return "channels"; }
  std::string Detail() const override { return ""; }
  MemoryUse Memory() const override { return {}; }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> Allocate(size_t) override { return No(); }
  absl::Status CopyToDevice(const float*, float*, size_t) override { return No(); }
  absl::Status CopyToHost(const float*, float*, size_t) override { return No(); }
  absl::Status CopyOnDevice(const float*, float*, size_t) override { return No(); }
  absl::Status Fill(float*, size_t, float) override { return No(); }
  absl::Status Widen(kernels::StorageDtype, const void*, float*, size_t) override { return No(); }
  absl::Status Narrow(kernels::StorageDtype, const float*, void*, size_t) override { return No(); }
  absl::Status Gemm(const kernels::GemmShape&, float, const float*, const float*, float, float*,
                    kernels::MatmulPrecision) override {
    return No();
  }
  absl::Status Transpose2D(const float*, float*, int64_t, int64_t, int64_t) override { return No(); }
  absl::Status SumSquares(const float*, size_t, size_t, double*) override { return No(); }
  absl::StatusOr<bool> AllFinite(const float*, size_t) override { return No(); }
  absl::Status ScaleBatched(float*, size_t, size_t, const float*) override { return No(); }
  absl::Status Axpby(float, kernels::StoredRef, float, kernels::StoredRef, size_t) override { return No(); }
  absl::Status Momentum(const kernels::MomentumArgs&, kernels::StoredRef, const float*, float*, size_t) override {
    return No();
  }
  absl::Status AdamW(const kernels::AdamWArgs&, kernels::StoredRef, const float*, kernels::StoredRef,
                     kernels::StoredRef, size_t) override {
    return No();
  }
  absl::Status Lion(const kernels::LionArgs&, kernels::StoredRef, const float*, kernels::StoredRef, size_t) override {
    return No();
  }
  absl::Status Sgd(const kernels::SgdArgs&, kernels::StoredRef, const float*, kernels::StoredRef, size_t) override {
    return No();
  }
  absl::Status Adamuon(const kernels::AdamuonArgs&, kernels::StoredRef, float*, size_t) override { return No(); }
  absl::Status CautiousUpdate(const kernels::CautiousArgs&, const float*, kernels::StoredRef, size_t) override {
    return No();
  }

 private:
  static absl::Status No() { return absl::UnimplementedError("this test backend only opens channels"); }
};

TEST(NcclChannelsTest, ACapOnChannelsAndANewChannelPerRank) {
  ChannelOnlyBackend backend;
  NcclChannels channels(&backend, {/*max_channels=*/2, /*join_timeout=*/absl::Hours(1)});
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened r0, channels.Open("alice", {"s", 1}, 0));
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened r1, channels.Open("alice", {"s", 1}, 1));
  // Rank 0 again (its trainer restarted): the old channel is aborted and replaced.
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened r0_again, channels.Open("alice", {"s", 1}, 0));
  EXPECT_TRUE(*backend.aborted[0]);
  EXPECT_EQ(channels.Find("alice", r0.name, {"s", 1}, "channel").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(channels.size(), 2u);
  // Full, and no channel idle past the timeout: a third is refused.
  const absl::Status full = channels.Open("bob", {"t", 1}, 0).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("--max-nccl-channels"));
  // Another caller's channel is neither found nor closed by name; nor is one of another session.
  EXPECT_EQ(channels.Find("bob", r1.name, {"s", 1}, "channel").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(channels.Close("bob", r1.name).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(channels.Find("alice", r1.name, {"t", 1}, "channel").status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(channels.Close("alice", r1.name));
  EXPECT_TRUE(*backend.aborted[1]);
  channels.DropSession({"s", 1});
  EXPECT_TRUE(*backend.aborted[2]);
  EXPECT_EQ(channels.size(), 0u);
  EXPECT_FALSE(r0_again.name.empty());
}

// A session closed and created again under its id (a new serial): closing the first drops only its
// own channels, and a channel of the first is not the second's.
TEST(NcclChannelsTest, ASessionCreatedAgainUnderItsIdKeepsItsChannelsWhenTheFirstIsDropped) {
  ChannelOnlyBackend backend;
  NcclChannels channels(&backend, {/*max_channels=*/4, /*join_timeout=*/absl::Hours(1)});
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened first, channels.Open("alice", {"s", 1}, 0));
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened second, channels.Open("alice", {"s", 2}, 0));
  EXPECT_FALSE(*backend.aborted[0]) << "rank 0 of another session of the id: not a restarted trainer";
  const absl::Status earlier = channels.Find("alice", first.name, {"s", 2}, "channel").status();
  EXPECT_THAT(earlier,
              ::muond::testing::StatusIs(absl::StatusCode::kNotFound, "belongs to another session of the id 's'"));
  channels.DropSession({"s", 1});
  EXPECT_TRUE(*backend.aborted[0]);
  EXPECT_FALSE(*backend.aborted[1]);
  EXPECT_OK(channels.Find("alice", second.name, {"s", 2}, "channel").status());
  EXPECT_EQ(channels.size(), 1u);
}

TEST(NcclChannelsTest, AtTheCapIdleChannelsMakeRoomButNotOneInUse) {
  ChannelOnlyBackend backend;
  NcclChannels channels(&backend, {/*max_channels=*/2, /*join_timeout=*/absl::Milliseconds(1)});
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened idle, channels.Open("alice", {"s", 1}, 0));
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened used, channels.Open("alice", {"s", 1}, 1));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<NcclChannel> in_use, channels.Find("alice", used.name, {"s", 1}, "channel"));
  in_use->busy.Lock();                    // a step is using it
  absl::SleepFor(absl::Milliseconds(5));  // both past the timeout since their opening
  ASSERT_OK_AND_ASSIGN(NcclChannels::Opened fresh, channels.Open("bob", {"t", 1}, 0));
  EXPECT_TRUE(*backend.aborted[0]) << "the idle channel made room";
  EXPECT_FALSE(*backend.aborted[1]) << "a channel in use never expires";
  EXPECT_EQ(channels.Find("alice", idle.name, {"s", 1}, "channel").status().code(), absl::StatusCode::kNotFound);
  in_use->busy.Unlock();
  EXPECT_EQ(channels.size(), 2u);
  EXPECT_FALSE(fresh.name.empty());
}

TEST(TensorRefsTest, EveryBadReferenceIsRefusedNamingItsField) {
  auto backend = kernels::NewCpuBackend(1);
  auto session = NewSession("refs", backend.get());
  const session::SessionConfig& config = session->config();
  auto resolve = [&](std::vector<RefFields> refs, bool require_all) {
    return ResolveTensorRefs(
        config, static_cast<int>(refs.size()), [&](int i) { return refs[i]; }, "gradients", require_all,
        [](const std::string& region, const std::string& at) -> absl::StatusOr<uint64_t> {
          if (region != "r") return absl::NotFoundError(at + ": no region");
          return 4096;
        });
  };
  const std::string w = "w", b = "b", nope = "nope", r = "r", other = "q";
  EXPECT_THAT(resolve({{nope, v1::DTYPE_FP32, 4}}, false).status().message(), HasSubstr("gradients[0].name"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_FP32, kB * 4}, {b, v1::DTYPE_FP32, kB * 4}}, false).status().message(),
              HasSubstr("gradients[1].name: 'b' appears twice"));
  EXPECT_THAT(resolve({{b, static_cast<v1::DType>(9), 96}}, false).status().message(), HasSubstr("gradients[0].dtype"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_FP32, kB * 4 - 1}}, false).status().message(),
              HasSubstr("gradients[0].byte_size"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_BF16, kB * 2, &other}}, false).status().message(),
              HasSubstr("gradients[0].region"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_FP32, kB * 4, &r, 4096 - kB * 4 + 1}}, false).status().message(),
              HasSubstr("gradients[0].offset"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_FP32, kB * 4, &r, ~uint64_t{0} - 10}}, false).status().message(),
              HasSubstr("end past region"));
  RefFields misaligned{b, v1::DTYPE_FP32, kB * 4, &r, 2};
  EXPECT_OK(resolve({misaligned}, false).status()) << "host memory takes any offset";
  misaligned.aligned = true;
  EXPECT_THAT(resolve({misaligned}, false).status().message(),
              HasSubstr("gradients[0].offset: 2 is not a multiple of 4"));
  EXPECT_THAT(resolve({{b, v1::DTYPE_FP32, kB * 4}}, true).status().message(), HasSubstr("no place for parameter 'w'"));
  ASSERT_OK_AND_ASSIGN(std::vector<TensorRef> refs,
                       resolve({{b, v1::DTYPE_BF16, kB * 2, &r, 8}, {w, v1::DTYPE_FP32, kW * 4, &r, 100}}, true));
  EXPECT_EQ(refs[0].index, 1u);
  EXPECT_EQ(refs[0].offset, 8u);
  EXPECT_EQ(refs[1].index, 0u);
}

TEST(GpuTablesTest, ABackendWithoutAGpuRefusesAfterTheRequestIsChecked) {
  auto backend = kernels::NewCpuBackend(1);
  SharedMemoryRegions shm;
  CudaMemoryRegions regions(backend.get(), &shm);
  v1::RegisterCudaMemoryRequest request;
  request.set_name("grads");
  request.set_session_id("s");
  request.set_byte_size(1024);
  request.set_mem_handle(std::string(10, 'x'));
  request.set_event_handle(std::string(64, 'e'));
  EXPECT_THAT(regions.Register("", request, {"s", 1}).status().message(),
              HasSubstr("mem_handle: a cudaIpcMemHandle_t has 64 bytes"));
  request.set_mem_handle(std::string(64, 'm'));
  request.set_event_handle("");
  EXPECT_THAT(regions.Register("", request, {"s", 1}).status().message(), HasSubstr("event_handle"));
  request.set_event_handle(std::string(64, 'e'));
  request.set_liveness_ticket("not-issued");
  EXPECT_EQ(regions.Register("", request, {"s", 1}).status().code(), absl::StatusCode::kNotFound);
  request.clear_liveness_ticket();
  const absl::Status refused = regions.Register("", request, {"s", 1}).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("the cpu backend has no CUDA IPC memory"));
  EXPECT_EQ(regions.size(), 0u);
  EXPECT_EQ(regions.Find("", "grads", {"s", 1}, "gradients[0].region").status().code(), absl::StatusCode::kNotFound);

  NcclChannels channels(backend.get(), {});
  const absl::Status no_nccl = channels.Open("", {"s", 1}, 0).status();
  EXPECT_EQ(no_nccl.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_nccl.message(), HasSubstr("NCCL"));
  EXPECT_EQ(channels.size(), 0u);
  EXPECT_EQ(channels.Find("", "nccl-x", {"s", 1}, "channel").status().code(), absl::StatusCode::kNotFound);
}

TEST(GpuTablesTest, LivenessTicketsLastAsLongAsTheirConnection) {
  SharedMemoryRegions shm;
  std::vector<uint64_t> closed;
  shm.OnConnectionClosed([&](uint64_t connection) { closed.push_back(connection); });
  const uint64_t connection = shm.OpenConnection();
  const std::string ticket = shm.AddLivenessTicket(connection);
  EXPECT_EQ(ticket.size(), 32u);
  ASSERT_OK_AND_ASSIGN(uint64_t named, shm.LivenessConnection(ticket, "liveness_ticket"));
  EXPECT_EQ(named, connection);
  shm.CloseConnection(connection);
  EXPECT_THAT(closed, ::testing::ElementsAre(connection));
  EXPECT_THAT(shm.LivenessConnection(ticket, "liveness_ticket").status().message(), HasSubstr("liveness_ticket"));
}

}  // namespace
}  // namespace muond::transport
