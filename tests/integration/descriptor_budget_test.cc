// The daemon's descriptors and address space against unauthenticated peers, with the real daemon
// under a low descriptor limit (--max-open-files) so that filling it is cheap: a flood on the
// shared-memory socket stays within its share and gRPC keeps accepting; unclaimed memfds expire;
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

#include <cerrno>
#include <chrono>
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

  // Opens `connections` connections to the shm socket, passing `memfd` up to `per_connection` times
  // on each while the daemon takes it; they stay open (closed in TearDown). Returns the tickets.
  // Stops early when the daemon stops answering (it ran out of descriptors).
  std::vector<std::string> Flood(int connections, int per_connection, int memfd) {
    std::vector<std::string> tickets;
    for (int c = 0; c < connections; ++c) {
      const int fd = ConnectWithTimeout(socket_);
      if (fd < 0) break;
      attackers_.push_back(fd);
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
};

TEST_F(DescriptorBudgetTest, AShmSocketFloodLeavesGrpcAcceptingConnections) {
  Start({"--max-open-files", "256"});
  ASSERT_TRUE(daemon_.WaitForLog("open files: soft limit 256"));
  const int memfd = SealedMemfd(4096);
  // 300 connections × 64 memfds: far more than 256 descriptors, were they all held.
  const std::vector<std::string> tickets = Flood(300, 64, memfd);
  ::close(memfd);
  EXPECT_LE(tickets.size(), 32u);  // the derived share: an eighth of 256
  EXPECT_TRUE(daemon_.WaitForLog("shm socket: connection refused"));
  EXPECT_TRUE(daemon_.WaitForLog("shm socket: memfd refused"));
  // With every attacker still connected, a trainer can still connect and be answered.
  EXPECT_OK(client::FromGrpcStatus(FreshCall()));
  EXPECT_OK(client_->GetServerInfo().status());
  EXPECT_THAT(daemon_.ReadStderr(), ::testing::Not(HasSubstr("Failed accept4")));
}

TEST_F(DescriptorBudgetTest, UnclaimedMemfdsExpire) {
  Start({"--shm-ticket-timeout", "0.2"});
  const int memfd = SealedMemfd(4096);
  const std::vector<std::string> tickets = Flood(1, 1, memfd);
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
  const std::vector<std::string> tickets = Flood(3, 64, memfd);
  ::close(memfd);
  EXPECT_EQ(tickets.size(), 192u);
  // An ordinary session still gets its 16 MiB.
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("g");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(2048);
  w->add_shape(2048);
  w->set_group("g");
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
