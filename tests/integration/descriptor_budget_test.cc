// The daemon's descriptors and address space against hostile peers, with the real daemon under a
// low descriptor limit (--max-open-files) so that filling it is cheap: peers without a grant hold
// no descriptor, and one caller flooding the shared-memory socket with grants of its own stops no
// other caller from registering, while gRPC keeps accepting; unclaimed memfds expire;
// memfds passed but never claimed take no address space; and when gRPC's listener dies anyway
// (connections to the gRPC port itself exhaust the descriptors), the daemon exits 1 for its
// supervisor instead of serving nobody.
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/muond_client.h"
#include "client/shm_region.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.grpc.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/one_parameter_spec.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

// A connection to the daemon's shm socket whose connect and reads give up after 2 s (a daemon that
// stopped accepting must fail the test, not hang it); -1 when it could not connect.
int ConnectWithTimeout(const std::string& address) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (address[0] == '@') addr.sun_path[0] = '\0';
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const timeval two_seconds{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &two_seconds, sizeof(two_seconds));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &two_seconds, sizeof(two_seconds));
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A sealed memfd of `bytes` (sparse: nothing is allocated).
int SealedMemfd(uint64_t bytes) {
  const int fd = ::memfd_create("flood", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

class DescriptorBudgetTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& flags) {
    std::vector<std::string> all = {"--backend", "cpu"};
    all.insert(all.end(), flags.begin(), flags.end());
    std::string error;
    ASSERT_TRUE(daemon_.Start(all, &error)) << error;
    client::ClientOptions options;
    options.endpoint = daemon_.endpoint();
    options.transport = "grpc";
    options.max_step_attempts = 1;
    options.auth_token = token_;
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client_->GetServerInfo());
    socket_ = info.shm_socket();
  }

  void TearDown() override {
    for (int fd : attackers_) ::close(fd);
    client_.reset();
    if (daemon_.running() && !daemon_.Exited()) {
      const int status = daemon_.Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "muond exit status " << status;
    }
  }

  // A call on a connection of its own (a new TCP connection, which gRPC must accept now).
  grpc::Status FreshCall() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(daemon_.endpoint(), grpc::InsecureChannelCredentials(), args);
    auto stub = v1::Muond::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::GetServerInfoRequest request;
    v1::ServerInfo info;
    return stub->GetServerInfo(&context, request, &info);
  }

  // Opens `connections` connections to the shm socket, each presenting a grant of `granter`'s when
  // given, passing `memfd` up to `per_connection` times on each while the daemon takes it; they stay
  // open (closed in TearDown, or with `open` given, left in it). Returns the tickets. Stops early when
  // the daemon stops answering (it ran out of descriptors).
  std::vector<std::string> Flood(int connections, int per_connection, int memfd, client::Client* granter = nullptr,
                                 std::vector<int>* open = nullptr) {
    std::vector<std::string> tickets;
    for (int c = 0; c < connections; ++c) {
      const int fd = ConnectWithTimeout(socket_);
      if (fd < 0) break;
      (open != nullptr ? *open : attackers_).push_back(fd);
      if (granter != nullptr) {
        absl::StatusOr<v1::ServerInfo> info = granter->GetServerInfo();
        absl::StatusOr<std::string> grant = info.ok() ? granter->SharedMemoryGrant(*info) : info.status();
        if (!grant.ok() || !client::PresentGrant(fd, *grant).ok()) continue;  // beyond the caller's share
      }
      for (int i = 0; i < per_connection; ++i) {
        absl::StatusOr<std::string> answer = client::PassDescriptor(fd, memfd);
        if (!answer.ok()) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) return tickets;  // no answer within 2 s: the daemon is stuck
          break;                                                        // refused and closed by the daemon
        }
        if (answer->rfind("ok ", 0) != 0) break;
        tickets.push_back(answer->substr(3, answer->find(' ', 3) - 3));
      }
    }
    return tickets;
  }

  DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
  std::string socket_;
  std::vector<int> attackers_;
  std::string token_;  // the test client's, when the daemon takes tokens
};

TEST_F(DescriptorBudgetTest, PeersWithoutAGrantHoldNoDescriptorAndLockNobodyOut) {
  Start({"--max-open-files", "256"});
  ASSERT_TRUE(daemon_.WaitForLog("open files: soft limit 256"));
  const int memfd = SealedMemfd(4096);
  // 300 connections × 64 memfds, none with a grant: every memfd is refused and its connection closed.
  EXPECT_TRUE(Flood(300, 64, memfd).empty());
  EXPECT_TRUE(daemon_.WaitForLog("shm socket: a connection without a grant"));
  // 300 more that connect and say nothing: far beyond the 16 connections the socket takes (a
  // sixteenth of 256), all still open on this side.
  for (int i = 0; i < 300; ++i) {
    const int fd = ConnectWithTimeout(socket_);
    if (fd >= 0) attackers_.push_back(fd);
  }
  // A trainer with a grant still connects, passes its memfd and registers it; gRPC still accepts.
  ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client_->GetServerInfo());
  ASSERT_OK_AND_ASSIGN(std::string grant, client_->SharedMemoryGrant(info));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::ShmRegion> region, client::ShmRegion::Create(socket_, 4096, grant));
  v1::RegisterSharedMemoryRequest request;
  request.set_name("after-the-flood");
  request.set_ticket(region->ticket());
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  EXPECT_OK(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)));
  ::close(memfd);
  EXPECT_OK(client::FromGrpcStatus(FreshCall()));
  EXPECT_THAT(daemon_.ReadStderr(), ::testing::Not(HasSubstr("Failed accept4")));
}

// Mallory holds a token too, and floods with grants of her own, from another thread, while Alice
// registers region after region: Mallory gets a quarter of the connections and has her own oldest
// memfds dropped when the daemon's places are full; every one of Alice's registrations succeeds.
TEST_F(DescriptorBudgetTest, OnePeerFloodsWhileAnotherRegisters) {
  const std::string tokens = daemon_.dir() + "/tokens";
  {
    FILE* f = std::fopen(tokens.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("alice:alice-5be0c2d71a\nmallory:mallory-9f3e1a66b0\n", f);
    std::fclose(f);
  }
  token_ = "alice-5be0c2d71a";
  Start({"--max-open-files", "256", "--auth-token-file", tokens});
  client::ClientOptions options;
  options.endpoint = daemon_.endpoint();
  options.transport = "grpc";
  options.auth_token = "mallory-9f3e1a66b0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> mallory, client::Client::Connect(options));
  const int memfd = SealedMemfd(4096);
  std::atomic<bool> done{false};
  std::atomic<int> mallorys_tickets{0};
  std::vector<int> mallorys_connections;
  std::thread flood([&] {
    while (!done.load()) {
      std::vector<int> open;
      mallorys_tickets += static_cast<int>(Flood(8, 64, memfd, mallory.get(), &open).size());
      for (int fd : open) ::close(fd);
    }
  });
  for (int i = 0; i < 20; ++i) {
    ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client_->GetServerInfo());
    ASSERT_OK_AND_ASSIGN(std::string grant, client_->SharedMemoryGrant(info));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::ShmRegion> region, client::ShmRegion::Create(socket_, 4096, grant));
    v1::RegisterSharedMemoryRequest request;
    request.set_name("alice-" + std::to_string(i));
    request.set_ticket(region->ticket());
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    client_->PrepareContext(context);
    EXPECT_OK(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response))) << i;
    // Wait until Mallory has been at work since: the daemon's places were full again.
    const int seen = mallorys_tickets.load();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (mallorys_tickets.load() < seen + 32 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
  }
  done = true;
  flood.join();
  ::close(memfd);
  EXPECT_GT(mallorys_tickets.load(), 20 * 32);
  EXPECT_TRUE(daemon_.WaitForLog("was dropped to make room"));
  EXPECT_OK(client_->GetServerInfo().status());
}

// A daemon that refuses a session's region (here a memfd beyond --shm-max-region-bytes): under
// "auto" the session goes on over gRPC, with one warning saying why, and its steps succeed; a
// client that insists on "shm" gets the refusal.
TEST_F(DescriptorBudgetTest, ARefusedRegionFallsBackToGrpcUnderAuto) {
  Start({"--shm-max-region-bytes", "64"});
  const v1::SessionSpec spec = OneParameterSpec({32, 32}, v1::OPTIMIZER_SGD);
  const std::vector<float> values(32 * 32, 0.5f), gradient(32 * 32, 1.0f);
  const std::vector<client::TensorView> upload = {{"w", {32, 32}, values}};
  const std::vector<client::TensorView> gradients = {{"w", {32, 32}, gradient}};
  for (const std::string transport : {"auto", "shm"}) {
    client::ClientOptions options;
    options.endpoint = daemon_.endpoint();
    options.transport = transport;
    std::vector<std::string> warnings;
    options.warn = [&warnings](const std::string& line) { warnings.push_back(line); };
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(std::string chosen, client->Transport());
    EXPECT_EQ(chosen, "shm") << "the daemon offers shared memory on this host";
    ASSERT_OK_AND_ASSIGN(auto session, client->CreateSession("refused-" + transport, spec));
    ASSERT_OK(session->UploadParameters(upload));
    if (transport == "auto") {
      for (int step = 1; step <= 3; ++step) ASSERT_OK(session->Step(step, gradients).status()) << step;
      EXPECT_EQ(session->transport_name(), "grpc");
      ASSERT_EQ(warnings.size(), 1u);
      EXPECT_THAT(warnings[0], HasSubstr("transport shm refused by the daemon"));
      EXPECT_THAT(warnings[0], HasSubstr("more than the daemon's limit of 64"));
    } else {
      EXPECT_THAT(session->Step(1, gradients), StatusIs(absl::StatusCode::kFailedPrecondition, "limit of 64"));
      EXPECT_EQ(session->transport_name(), "shm");
      EXPECT_TRUE(warnings.empty());
    }
  }
}

TEST_F(DescriptorBudgetTest, UnclaimedMemfdsExpire) {
  Start({"--shm-ticket-timeout", "0.2"});
  const int memfd = SealedMemfd(4096);
  const std::vector<std::string> tickets = Flood(1, 1, memfd, client_.get());
  ::close(memfd);
  ASSERT_EQ(tickets.size(), 1u);
  ASSERT_TRUE(daemon_.WaitForLog("1 unclaimed regions expired"));
  v1::RegisterSharedMemoryRequest request;
  request.set_name("late");
  request.set_ticket(tickets[0]);
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  EXPECT_THAT(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)),
              StatusIs(absl::StatusCode::kNotFound, "ticket"));
}

TEST_F(DescriptorBudgetTest, UnclaimedHugeMemfdsTakeNoAddressSpace) {
  Start({});
  // 3 connections × 64 sealed sparse memfds of 1 TiB: 192 TiB, more than a process can map.
  const uint64_t tib = uint64_t{1} << 40;
  const int memfd = SealedMemfd(tib);
  const std::vector<std::string> tickets = Flood(3, 64, memfd, client_.get());
  ::close(memfd);
  EXPECT_EQ(tickets.size(), 192u);
  // An ordinary session still gets its 16 MiB.
  const v1::SessionSpec spec = OneParameterSpec({2048, 2048}, v1::OPTIMIZER_ADAMW);
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("after-the-flood", spec));
  const std::vector<float> values(2048 * 2048, 0.5f);
  const std::vector<client::TensorView> upload = {{"w", {2048, 2048}, values}};
  EXPECT_OK(session->UploadParameters(upload));
  // A claimed one is mapped then, and only then.
  v1::RegisterSharedMemoryRequest request;
  request.set_name("huge");
  request.set_ticket(tickets[0]);
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  EXPECT_OK(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)));
  EXPECT_EQ(response.byte_size(), tib);
}

TEST_F(DescriptorBudgetTest, ALostGrpcListenerMakesTheDaemonExitForItsSupervisor) {
  Start({"--max-open-files", "128", "--shm-socket", "none"});
  // Plain TCP connections to the gRPC port, each a descriptor the daemon holds, until gRPC's accept
  // fails for want of one.
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(daemon_.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < 1000 && !daemon_.WaitForLog("Failed accept4", 1, std::chrono::milliseconds(0)); ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    attackers_.push_back(fd);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) break;
  }
  ASSERT_TRUE(daemon_.WaitForLog("Failed accept4")) << daemon_.ReadStderr();
  EXPECT_TRUE(daemon_.WaitForLog("stopped accepting connections"));
  for (int fd : attackers_) ::close(fd);
  attackers_.clear();
  // It drains and exits 1 (not 0: a supervisor restarts it on failure).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!daemon_.Exited() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(daemon_.Exited()) << daemon_.ReadStderr();
  EXPECT_TRUE(WIFEXITED(daemon_.exit_status()) && WEXITSTATUS(daemon_.exit_status()) == 1) << daemon_.exit_status();
}

}  // namespace
}  // namespace muond::testing
