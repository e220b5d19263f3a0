// The GPU transports' backend side (kernels/peer_exchange.h): CUDA IPC memory and events, the NCCL
// channel, CopyBytes and SumSquaresEach. The peer is a child process, this binary run again with
// --peer_child=ipc or --peer_child=nccl (posix_spawn, so the child starts CUDA afresh), talking to
// the test over its stdin and stdout one line at a time. Tests that need a device skip with the
// reason when there is none; the NCCL exchange needs two (NCCL puts no two ranks on one GPU). The
// CPU backend's refusals and defaults run everywhere.
#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#ifdef MUOND_HAVE_NCCL
#include <nccl.h>
#endif

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend_factory.h"
#include "kernels/peer_exchange.h"
#include "tests/testing/gpu_skip.h"
#include "tests/testing/status_matchers.h"

extern char** environ;

namespace muond::kernels {
namespace {

using ::muond::testing::StatusIs;

constexpr size_t kFloats = 4096;

float Pattern(size_t i) { return 0.5f * static_cast<float>(i) - 7.0f; }
uint8_t BytePattern(size_t i, int salt) { return static_cast<uint8_t>((i * 31 + salt) % 251); }

// ---- The peer process ---------------------------------------------------------------------------

// Writes one line to the parent (the child's stdout carries nothing else).
void Tell(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::string Hear() {
  std::string line;
  for (int c = std::getchar(); c != EOF && c != '\n'; c = std::getchar()) line.push_back(static_cast<char>(c));
  return line;
}

int ChildFail(const std::string& what) {
  Tell("error " + what);
  return 1;
}

#define CHILD_CUDA(expr)                                                  \
  do {                                                                    \
    if (const cudaError_t e = (expr); e != cudaSuccess) {                 \
      return ChildFail(absl::StrCat(#expr, ": ", cudaGetErrorString(e))); \
    }                                                                     \
  } while (0)

// Exports a filled device buffer and an event recorded after the fill; once the parent says
// "check", verifies that the parent wrote -Pattern(i) back.
int RunIpcChild() {
  CHILD_CUDA(cudaSetDevice(0));
  float* buffer = nullptr;
  CHILD_CUDA(cudaMalloc(&buffer, kFloats * sizeof(float)));
  std::vector<float> host(kFloats);
  for (size_t i = 0; i < kFloats; ++i) host[i] = Pattern(i);
  cudaStream_t stream = nullptr;
  CHILD_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t event = nullptr;
  CHILD_CUDA(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming));
  CHILD_CUDA(cudaMemcpyAsync(buffer, host.data(), kFloats * sizeof(float), cudaMemcpyHostToDevice, stream));
  CHILD_CUDA(cudaEventRecord(event, stream));
  cudaIpcMemHandle_t mem_handle;
  cudaIpcEventHandle_t event_handle;
  CHILD_CUDA(cudaIpcGetMemHandle(&mem_handle, buffer));
  CHILD_CUDA(cudaIpcGetEventHandle(&event_handle, event));
  Tell(absl::StrCat(
      "handles ",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&mem_handle), sizeof(mem_handle))), " ",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&event_handle), sizeof(event_handle)))));
  if (Hear() != "check") return ChildFail("expected check");
  CHILD_CUDA(cudaMemcpy(host.data(), buffer, kFloats * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < kFloats; ++i) {
    if (host[i] != -Pattern(i)) return ChildFail(absl::StrCat("element ", i, " is ", host[i]));
  }
  Tell("ok");
  return 0;
}

// The byte ranges the NCCL exchange moves, in order, each way.
constexpr size_t kRangeBytes[] = {1000, 3000, 17};

#ifdef MUOND_HAVE_NCCL
// Whether NCCL may put both ranks on one GPU: NCCL 2.30 and later do with
// NCCL_MULTI_RANK_GPU_ENABLE=1; earlier ones refuse ("Duplicate GPU detected").
bool SeveralRanksPerGpu() {
  int version = 0;
  const char* enabled = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  return ncclGetVersion(&version) == ncclSuccess && version >= 23000 && enabled != nullptr &&
         std::string(enabled) == "1";
}

// Joins the parent's channel as rank 1 on device 1 (device 0 when NCCL allows several ranks on one
// GPU and there is one), sends ranges filled with BytePattern(·, 1),
// receives the parent's (BytePattern(·, 2)) and checks them.
int RunNcclChild() {
  const std::string id_hex = Hear();
  const std::string id_bytes = absl::HexStringToBytes(id_hex);
  if (id_bytes.size() != sizeof(ncclUniqueId)) return ChildFail("bad id");
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  int devices = 0;
  CHILD_CUDA(cudaGetDeviceCount(&devices));
  CHILD_CUDA(cudaSetDevice(devices >= 2 ? 1 : 0));
  cudaStream_t stream = nullptr;
  CHILD_CUDA(cudaStreamCreate(&stream));
  ncclComm_t comm = nullptr;
  if (ncclCommInitRank(&comm, 2, id, 1) != ncclSuccess) return ChildFail("ncclCommInitRank");
  std::vector<uint8_t*> out, in;
  for (size_t r = 0; r < std::size(kRangeBytes); ++r) {
    uint8_t* send = nullptr;
    uint8_t* receive = nullptr;
    CHILD_CUDA(cudaMalloc(&send, kRangeBytes[r]));
    CHILD_CUDA(cudaMalloc(&receive, kRangeBytes[r]));
    std::vector<uint8_t> host(kRangeBytes[r]);
    for (size_t i = 0; i < host.size(); ++i) host[i] = BytePattern(i, 1);
    CHILD_CUDA(cudaMemcpy(send, host.data(), host.size(), cudaMemcpyHostToDevice));
    out.push_back(send);
    in.push_back(receive);
  }
  ncclGroupStart();
  for (size_t r = 0; r < out.size(); ++r) ncclSend(out[r], kRangeBytes[r], ncclUint8, 0, comm, stream);
  if (ncclGroupEnd() != ncclSuccess) return ChildFail("send group");
  ncclGroupStart();
  for (size_t r = 0; r < in.size(); ++r) ncclRecv(in[r], kRangeBytes[r], ncclUint8, 0, comm, stream);
  if (ncclGroupEnd() != ncclSuccess) return ChildFail("receive group");
  CHILD_CUDA(cudaStreamSynchronize(stream));
  for (size_t r = 0; r < in.size(); ++r) {
    std::vector<uint8_t> host(kRangeBytes[r]);
    CHILD_CUDA(cudaMemcpy(host.data(), in[r], host.size(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i] != BytePattern(i, 2)) return ChildFail(absl::StrCat("range ", r, " byte ", i));
    }
  }
  ncclCommDestroy(comm);
  Tell("ok");
  return 0;
}
#endif

// ---- The parent's side --------------------------------------------------------------------------

// This binary running as a peer, with pipes to its stdin and from its stdout.
class Child {
 public:
  ~Child() {
    if (to_ >= 0) close(to_);
    if (from_ >= 0) close(from_);
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // Starts `/proc/self/exe --peer_child=<role>`; false (with the reason in *error) if it cannot.
  bool Start(const std::string& role, std::string* error) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) {
      *error = "pipe failed";
      return false;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, down[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, up[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, down[1]);
    posix_spawn_file_actions_addclose(&actions, up[0]);
    std::string exe = "/proc/self/exe", flag = "--peer_child=" + role;
    char* argv[] = {exe.data(), flag.data(), nullptr};
    const int result = posix_spawn(&pid_, exe.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(down[0]);
    close(up[1]);
    to_ = down[1];
    from_ = up[0];
    if (result != 0) {
      pid_ = -1;
      *error = absl::StrCat("posix_spawn: ", std::strerror(result));
      return false;
    }
    return true;
  }

  void Tell(const std::string& line) {
    const std::string data = line + "\n";
    ASSERT_EQ(write(to_, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  }

  // The child's next line, or "" after `timeout` (or when it closed its stdout).
  std::string Hear(absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string line;
    for (;;) {
      pollfd fd{from_, POLLIN, 0};
      const int left_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (left_ms <= 0 || poll(&fd, 1, left_ms) <= 0) return "";
      char c;
      if (read(from_, &c, 1) != 1) return line;
      if (c == '\n') return line;
      line.push_back(c);
    }
  }

  // The child's exit status (waits for it).
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

// A CUDA backend on device 0, or the reason there is none.
class CudaPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = NewCudaBackend(0);
    if (!backend.ok()) MUOND_SKIP_WITHOUT_GPU() << "no usable CUDA device: " << backend.status().message();
    backend_ = std::move(*backend);
  }
  std::unique_ptr<Backend> backend_;
};

TEST_F(CudaPeerTest, IdentityAndVersions) {
  const std::string uuid = backend_->DeviceUuid();
  ASSERT_EQ(uuid.size(), 4u + 36u) << uuid;
  EXPECT_EQ(uuid.substr(0, 4), "GPU-");
  for (size_t i : {12u, 17u, 22u, 27u}) EXPECT_EQ(uuid[i], '-') << uuid;
#ifdef MUOND_HAVE_NCCL
  EXPECT_GE(backend_->NcclVersion(), 22800);
#endif
}

TEST_F(CudaPeerTest, SumSquaresEachMatchesSumSquaresBitwise) {
  const std::vector<size_t> counts = {0, 1, 255, 4096, 300000};
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<Backend::Slice> slices;
  for (size_t t = 0; t < counts.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(auto buffer, backend_->Allocate(counts[t] + 1));
    std::vector<float> host(counts[t]);
    for (size_t i = 0; i < host.size(); ++i) host[i] = Pattern(i * (t + 1)) * 1e-3f;
    ASSERT_OK(backend_->CopyToDevice(host.data(), buffer->data(), host.size()));
    slices.push_back({buffer->data(), counts[t]});
    buffers.push_back(std::move(buffer));
  }
  std::vector<double> each(slices.size(), -1.0);
  ASSERT_OK(backend_->SumSquaresEach(slices, each.data()));
  for (size_t t = 0; t < slices.size(); ++t) {
    double one = -2.0;
    ASSERT_OK(backend_->SumSquares(slices[t].data, slices[t].count, 1, &one));
    EXPECT_EQ(std::memcmp(&one, &each[t], sizeof(double)), 0) << "tensor " << t << ": " << one << " vs " << each[t];
  }
}

TEST_F(CudaPeerTest, CopyBytesBetweenHostAndDevice) {
  ASSERT_OK_AND_ASSIGN(auto buffer, backend_->Allocate(kFloats));
  std::vector<float> in(kFloats), out(kFloats, 0.0f);
  for (size_t i = 0; i < kFloats; ++i) in[i] = Pattern(i);
  ASSERT_OK(backend_->CopyBytes(in.data(), buffer->data(), kFloats * sizeof(float)));
  ASSERT_OK(backend_->CopyBytes(buffer->data(), out.data(), kFloats * sizeof(float)));
  EXPECT_EQ(in, out);
  EXPECT_OK(backend_->Synchronize());
}

TEST_F(CudaPeerTest, RefusesMalformedHandles) {
  EXPECT_THAT(backend_->OpenPeerMemory("short", 4), StatusIs(absl::StatusCode::kInvalidArgument, "mem_handle"));
  EXPECT_THAT(backend_->OpenPeerMemory(std::string(kIpcHandleBytes, '\x5a'), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, "mem_handle: cannot open"));
  EXPECT_THAT(backend_->OpenPeerEvent("short"), StatusIs(absl::StatusCode::kInvalidArgument, "event_handle"));
}

TEST_F(CudaPeerTest, OpensAPeersMemoryAndEvent) {
  Child child;
  std::string error;
  ASSERT_TRUE(child.Start("ipc", &error)) << error;
  const std::string line = child.Hear();
  const std::vector<std::string> words = absl::StrSplit(line, ' ');
  ASSERT_EQ(words.size(), 3u) << "the child said: " << line;
  ASSERT_EQ(words[0], "handles") << line;
  const std::string mem_handle = absl::HexStringToBytes(words[1]);
  const std::string event_handle = absl::HexStringToBytes(words[2]);
  constexpr uint64_t kBytes = kFloats * sizeof(float);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerMemory> memory, backend_->OpenPeerMemory(mem_handle, kBytes));
    EXPECT_GE(memory->size(), kBytes);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerEvent> event, backend_->OpenPeerEvent(event_handle));
    ASSERT_OK(event->Await(absl::Now() + absl::Seconds(30), /*caller_gone=*/{}));
    std::vector<float> host(kFloats);
    ASSERT_OK(backend_->CopyBytes(memory->data(), host.data(), kBytes));
    for (size_t i = 0; i < kFloats; ++i) ASSERT_EQ(host[i], Pattern(i)) << i;
    // The backend's own primitives read and write it too.
    ASSERT_OK_AND_ASSIGN(auto staged, backend_->Allocate(kFloats));
    ASSERT_OK(backend_->CopyOnDevice(static_cast<const float*>(memory->data()), staged->data(), kFloats));
    for (float& v : host) v = -v;
    ASSERT_OK(backend_->CopyBytes(host.data(), memory->data(), kBytes));
  }
  // Closed; an allocation smaller than asked for is refused, naming both sizes.
  const uint64_t too_many = uint64_t{1} << 40;
  EXPECT_THAT(backend_->OpenPeerMemory(mem_handle, too_many),
              StatusIs(absl::StatusCode::kInvalidArgument, absl::StrCat("byte_size: ", too_many)));
  child.Tell("check");
  EXPECT_EQ(child.Hear(), "ok");
  EXPECT_EQ(child.Wait(), 0);
}

TEST_F(CudaPeerTest, ChannelAbortsWhenThePeerNeverJoins) {
#ifndef MUOND_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  ASSERT_OK_AND_ASSIGN(NcclUniqueId id, backend_->NewNcclUniqueId());
  const absl::Time start = absl::Now();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerChannel> channel, backend_->OpenPeerChannel(id));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "opening must not wait for the peer";
  EXPECT_THAT(channel->Ready(absl::Now() + absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "the trainer did not join the NCCL channel within"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(channel->aborted());
  ASSERT_OK_AND_ASSIGN(auto buffer, backend_->Allocate(16));
  const ByteRange range{buffer->data(), 64};
  EXPECT_THAT(channel->Send(std::span(&range, 1), absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "aborted"));
  channel->Abort();  // idempotent
#endif
}

TEST_F(CudaPeerTest, ChannelExchangesBytesWithAPeerOnAnotherGpu) {
#ifndef MUOND_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || (devices < 2 && !SeveralRanksPerGpu())) {
    GTEST_SKIP() << "needs two CUDA devices, or one with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL "
                    "puts no two ranks on one GPU otherwise); "
                 << devices << " visible";
  }
  ASSERT_OK_AND_ASSIGN(NcclUniqueId id, backend_->NewNcclUniqueId());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerChannel> channel, backend_->OpenPeerChannel(id));
  Child child;
  std::string error;
  ASSERT_TRUE(child.Start("nccl", &error)) << error;
  child.Tell(absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(id.data()), id.size())));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  ASSERT_OK(channel->Ready(deadline));

  std::vector<std::unique_ptr<DeviceBuffer>> in, out;
  std::vector<ByteRange> in_ranges, out_ranges;
  for (size_t r = 0; r < std::size(kRangeBytes); ++r) {
    ASSERT_OK_AND_ASSIGN(auto receive, backend_->Allocate((kRangeBytes[r] + 3) / 4));
    ASSERT_OK_AND_ASSIGN(auto send, backend_->Allocate((kRangeBytes[r] + 3) / 4));
    std::vector<uint8_t> host(kRangeBytes[r]);
    for (size_t i = 0; i < host.size(); ++i) host[i] = BytePattern(i, 2);
    ASSERT_OK(backend_->CopyBytes(host.data(), send->data(), host.size()));
    in_ranges.push_back({receive->data(), kRangeBytes[r]});
    out_ranges.push_back({send->data(), kRangeBytes[r]});
    in.push_back(std::move(receive));
    out.push_back(std::move(send));
  }
  ASSERT_OK(channel->Receive(in_ranges, deadline));
  for (size_t r = 0; r < in_ranges.size(); ++r) {
    std::vector<uint8_t> host(kRangeBytes[r]);
    ASSERT_OK(backend_->CopyBytes(in_ranges[r].data, host.data(), host.size()));
    for (size_t i = 0; i < host.size(); ++i) ASSERT_EQ(host[i], BytePattern(i, 1)) << "range " << r << " byte " << i;
  }
  ASSERT_OK(channel->Send(out_ranges, deadline));
  EXPECT_EQ(child.Hear(), "ok");
  EXPECT_EQ(child.Wait(), 0);
  EXPECT_FALSE(channel->aborted());
#endif
}

// The CPU backend has no GPU transports, and its defaults copy and reduce on the host.
TEST(CpuPeerTest, RefusesTransportsAndKeepsDefaults) {
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  EXPECT_THAT(backend->OpenPeerMemory(std::string(kIpcHandleBytes, '\0'), 4),
              StatusIs(absl::StatusCode::kFailedPrecondition, "the cpu backend has no CUDA IPC memory"));
  EXPECT_THAT(backend->OpenPeerEvent(std::string(kIpcHandleBytes, '\0')),
              StatusIs(absl::StatusCode::kFailedPrecondition, "CUDA IPC events"));
  EXPECT_THAT(backend->NewNcclUniqueId(), StatusIs(absl::StatusCode::kFailedPrecondition, "NCCL"));
  EXPECT_THAT(backend->OpenPeerChannel(NcclUniqueId{}), StatusIs(absl::StatusCode::kFailedPrecondition, "NCCL"));
  EXPECT_EQ(backend->DeviceUuid(), "");
  EXPECT_EQ(backend->NcclVersion(), 0);
  EXPECT_OK(backend->Synchronize());

  ASSERT_OK_AND_ASSIGN(auto a, backend->Allocate(1000));
  ASSERT_OK_AND_ASSIGN(auto b, backend->Allocate(1000));
  std::vector<float> host(1000);
  for (size_t i = 0; i < host.size(); ++i) host[i] = Pattern(i);
  ASSERT_OK(backend->CopyBytes(host.data(), a->data(), host.size() * sizeof(float)));
  ASSERT_OK(backend->CopyBytes(a->data(), b->data(), host.size() * sizeof(float)));
  std::vector<float> back(1000);
  ASSERT_OK(backend->CopyToHost(b->data(), back.data(), back.size()));
  EXPECT_EQ(back, host);
  ASSERT_OK(backend->CopyBytes(nullptr, nullptr, 0));

  const std::vector<Backend::Slice> slices = {{a->data(), 1000}, {a->data() + 10, 0}, {b->data() + 3, 500}};
  std::vector<double> each(slices.size(), -1.0);
  ASSERT_OK(backend->SumSquaresEach(slices, each.data()));
  for (size_t t = 0; t < slices.size(); ++t) {
    double one = -2.0;
    ASSERT_OK(backend->SumSquares(slices[t].data, slices[t].count, 1, &one));
    EXPECT_EQ(one, each[t]) << "tensor " << t;
  }
  EXPECT_EQ(each[1], 0.0);
}

}  // namespace
}  // namespace muond::kernels

int main(int argc, char** argv) {
  if (argc == 2) {
    const std::string_view role = argv[1];
    if (role == "--peer_child=ipc") return muond::kernels::RunIpcChild();
#ifdef MUOND_HAVE_NCCL
    if (role == "--peer_child=nccl") return muond::kernels::RunNcclChild();
#endif
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
