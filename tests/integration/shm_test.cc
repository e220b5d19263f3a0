// The shared-memory transport against the real daemon: the client's choice of transport, steps
// bit-identical to the gRPC transport's, and every refusal of a region or a tensor reference naming
// its field and changing nothing. (The whole integration suite also runs with MUOND_TEST_TRANSPORT=
// shm, which carries every other step semantic over shared memory.)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "client/shm_region.h"
#include "client/transport/transport_choice.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

class ShmTest : public DaemonTest {
 protected:
  static std::unique_ptr<client::Client> ConnectWith(const std::string& transport) {
    client::ClientOptions options;
    options.endpoint = daemon_->endpoint();
    options.transport = transport;
    auto client = client::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static std::string Socket() {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->shm_socket() : "";
  }

  // A one-time grant for the socket (GrantSharedMemory).
  static std::string Grant() {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return "";
    EXPECT_TRUE(info->shm_grants());
    absl::StatusOr<std::string> grant = client_->SharedMemoryGrant(*info);
    EXPECT_TRUE(grant.ok()) << grant.status();
    return grant.ok() ? *grant : "";
  }

  // A region of `bytes` passed to the daemon and registered as `name`.
  std::unique_ptr<client::ShmRegion> Register(const std::string& name, size_t bytes) {
    absl::StatusOr<std::unique_ptr<client::ShmRegion>> region = client::ShmRegion::Create(Socket(), bytes, Grant());
    EXPECT_TRUE(region.ok()) << region.status();
    if (!region.ok()) return nullptr;
    v1::RegisterSharedMemoryRequest request;
    request.set_name(name);
    request.set_ticket((*region)->ticket());
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    EXPECT_OK(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)));
    EXPECT_EQ(response.byte_size(), bytes);
    return *std::move(region);
  }

  static absl::StatusOr<v1::SharedMemoryStatusResponse> Status(const std::string& name = "") {
    v1::SharedMemoryStatusRequest request;
    request.set_name(name);
    v1::SharedMemoryStatusResponse response;
    grpc::ClientContext context;
    absl::Status status = client::FromGrpcStatus(client_->stub().SharedMemoryStatus(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  static v1::SharedTensor Place(const std::string& name, const std::string& region, uint64_t offset, uint64_t bytes) {
    v1::SharedTensor place;
    place.set_name(name);
    place.set_region(region);
    place.set_offset(offset);
    place.set_byte_size(bytes);
    return place;
  }

  static absl::StatusOr<v1::StepResult> StepShared(const v1::StepSharedRequest& request) {
    v1::StepSharedResponse response;
    grpc::ClientContext context;
    absl::Status status = client::FromGrpcStatus(client_->stub().StepShared(&context, request, &response));
    if (!status.ok()) return status;
    return response.result();
  }
};

TEST_F(ShmTest, AutoChoosesSharedMemoryOnTheDaemonsHost) {
  EXPECT_FALSE(Socket().empty()) << "the daemon offers shared memory by default";
  for (const std::string transport : {"auto", "grpc", "shm"}) {
    ASSERT_OK_AND_ASSIGN(std::string chosen, ConnectWith(transport)->Transport());
    EXPECT_EQ(chosen, transport == "grpc" ? "grpc" : "shm") << transport;
  }
  client::ClientOptions options;
  options.endpoint = daemon_->endpoint();
  options.transport = "carrier-pigeon";
  EXPECT_THAT(client::Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, "transport"));
}

TEST_F(ShmTest, AutoIsTheFirstViableTransportAndANamedOneSaysWhyNot) {
  ASSERT_OK_AND_ASSIGN(const v1::ServerInfo here, client_->GetServerInfo());
  int asked = 0;
  auto choose = [&](const std::string& wanted, const v1::ServerInfo& info) {
    return client::ChooseTransport(wanted, [&]() -> absl::StatusOr<v1::ServerInfo> {
      ++asked;
      return info;
    });
  };
  ASSERT_OK_AND_ASSIGN(const client::TransportKind* chosen, choose("grpc", here));
  EXPECT_STREQ(chosen->name, "grpc");
  EXPECT_EQ(asked, 0) << "gRPC needs nothing from the daemon";
  ASSERT_OK_AND_ASSIGN(chosen, choose("auto", here));
  EXPECT_STREQ(chosen->name, "shm");
  EXPECT_EQ(asked, 1);

  v1::ServerInfo no_socket = here;
  no_socket.clear_shm_socket();
  v1::ServerInfo elsewhere = here;
  elsewhere.set_host_id("another-host");
  v1::ServerInfo unreachable = here;
  unreachable.set_shm_socket("@muond-no-such-socket");
  for (const auto& [info, why] :
       {std::pair{no_socket, "offers no shared-memory transport"}, std::pair{elsewhere, "runs on another host"},
        std::pair{unreachable, "cannot be reached from here"}}) {
    ASSERT_OK_AND_ASSIGN(chosen, choose("auto", info));
    EXPECT_STREQ(chosen->name, "grpc") << why;
    EXPECT_THAT(choose("shm", info).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, "transport: 'shm' is not possible"));
    EXPECT_THAT(std::string(choose("shm", info).status().message()), HasSubstr(why));
  }
  EXPECT_THAT(
      choose("carrier-pigeon", here).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, "transport: 'carrier-pigeon' is not one of auto, shm, grpc"));
}

TEST_F(ShmTest, StepsMatchTheGrpcTransportBitForBit) {
  std::unique_ptr<client::Client> over_grpc = ConnectWith("grpc"), over_shm = ConnectWith("shm");
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    const std::string suffix = dtype == v1::DTYPE_FP32 ? "-fp32" : "-bf16";
    ASSERT_OK_AND_ASSIGN(auto a, over_grpc->CreateSession("shm-vs-grpc-a" + suffix, SmallSpec(dtype)));
    ASSERT_OK_AND_ASSIGN(auto b, over_shm->CreateSession("shm-vs-grpc-b" + suffix, SmallSpec(dtype)));
    const std::vector<float> w = Initial("w", 32), bias = Initial("b", 4);
    const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, bias}};
    ASSERT_OK(a->UploadParameters(initial));
    ASSERT_OK(b->UploadParameters(initial));
    for (int step = 1; step <= 3; ++step) {
      client::StepOptions options;
      if (step == 2) options.max_grad_norm = 0.5;  // clipped
      if (step == 3) options.lr["vectors"] = 0.003;
      const std::vector<client::TensorView> g = Gradients(step);
      // One answer of each goes straight into the caller's memory (parameters_out).
      std::vector<float> w_over_grpc(32), w_over_shm(32);
      client::StepOptions grpc_options = options, shm_options = options;
      grpc_options.parameters_out["w"] = w_over_grpc;
      shm_options.parameters_out["w"] = w_over_shm;
      ASSERT_OK_AND_ASSIGN(client::StepReply from_grpc, a->Step(step, g, grpc_options));
      ASSERT_OK_AND_ASSIGN(client::StepReply from_shm, b->Step(step, g, shm_options));
      EXPECT_TRUE(from_shm.applied);
      EXPECT_EQ(from_shm.grad_norm, from_grpc.grad_norm);
      EXPECT_EQ(from_shm.parameters, from_grpc.parameters) << "step " << step << suffix;
      EXPECT_FALSE(from_shm.parameters.contains("w"));
      EXPECT_EQ(w_over_shm, w_over_grpc) << "step " << step << suffix;
      from_shm.parameters["w"] = w_over_shm;
      // A retry of the applied step is replayed, with the same parameters, over shared memory too.
      ASSERT_OK_AND_ASSIGN(client::StepReply replay, b->Step(step, g, options));
      EXPECT_TRUE(replay.replayed);
      EXPECT_EQ(replay.parameters, from_shm.parameters);
    }
    ASSERT_OK_AND_ASSIGN(client::ParameterMap now, b->GetParameters());
    ASSERT_OK_AND_ASSIGN(client::ParameterMap expected, a->GetParameters());
    EXPECT_EQ(now, expected);
  }
}

TEST_F(ShmTest, AnOutputSpanOfTheWrongSizeIsRefusedBeforeTheStep) {
  std::unique_ptr<client::Session> session = NewSession("shm-parameters-out");
  std::vector<float> short_span(5);
  client::StepOptions options;
  options.parameters_out["w"] = short_span;
  EXPECT_THAT(session->Step(1, Gradients(1), options),
              StatusIs(absl::StatusCode::kInvalidArgument, "parameters_out['w']"));
  options.parameters_out.clear();
  options.parameters_out["nope"] = short_span;
  EXPECT_THAT(session->Step(1, Gradients(1), options),
              StatusIs(absl::StatusCode::kInvalidArgument, "parameters_out['nope']"));
  int64_t last_step = -1;
  ASSERT_OK(session->GetParameters(&last_step).status());
  EXPECT_EQ(last_step, 0) << "nothing was sent";
}

TEST_F(ShmTest, RegionsAreRefusedWithTheFieldNamed) {
  const std::unique_ptr<client::ShmRegion> region = Register("refusals", 4096);
  ASSERT_NE(region, nullptr);
  {
    v1::RegisterSharedMemoryRequest request;
    request.set_name("other");
    request.set_ticket("0123456789abcdef0123456789abcdef");
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    EXPECT_THAT(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)),
                StatusIs(absl::StatusCode::kNotFound, "ticket"));
  }
  {
    // A ticket is claimed once, and a name is taken once.
    v1::RegisterSharedMemoryRequest request;
    request.set_name("refusals");
    request.set_ticket(region->ticket());
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    EXPECT_THAT(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)),
                StatusIs(absl::StatusCode::kNotFound, "ticket"));
  }
  absl::StatusOr<std::unique_ptr<client::ShmRegion>> second = client::ShmRegion::Create(Socket(), 64, Grant());
  ASSERT_OK(second.status());
  {
    v1::RegisterSharedMemoryRequest request;
    request.set_name("refusals");
    request.set_ticket((*second)->ticket());
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    EXPECT_THAT(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response)),
                StatusIs(absl::StatusCode::kAlreadyExists, "name"));
    request.set_name(std::string(1, '\x01'));
    grpc::ClientContext again;
    EXPECT_THAT(client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&again, request, &response)),
                StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  }
  ASSERT_OK_AND_ASSIGN(v1::SharedMemoryStatusResponse status, Status("refusals"));
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).byte_size(), 4096u);
  EXPECT_THAT(Status("no-such-region"), StatusIs(absl::StatusCode::kNotFound, "name"));
}

TEST_F(ShmTest, BadTensorPlacesAreRefusedBeforeTheStepAndChangeNothing) {
  std::unique_ptr<client::Session> session = NewSession("shm-refusals");
  const std::unique_ptr<client::ShmRegion> region = Register("places", 36 * 4);
  ASSERT_NE(region, nullptr);
  ASSERT_OK_AND_ASSIGN(client::ParameterMap before, session->GetParameters());

  auto request = [&] {
    v1::StepSharedRequest r;
    r.mutable_header()->set_session_id("shm-refusals");
    r.mutable_header()->set_step(1);
    *r.add_gradients() = Place("w", "places", 0, 32 * 4);
    *r.add_gradients() = Place("b", "places", 32 * 4, 4 * 4);
    *r.add_parameters() = Place("w", "places", 0, 32 * 4);
    *r.add_parameters() = Place("b", "places", 32 * 4, 4 * 4);
    return r;
  };
  struct Case {
    std::function<void(v1::StepSharedRequest&)> change;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.mutable_gradients(0)->set_region("nobody"); }, absl::StatusCode::kNotFound,
       "gradients[0].region"},
      {[](auto& r) { r.mutable_gradients(1)->set_offset(33 * 4); }, absl::StatusCode::kInvalidArgument,
       "gradients[1].offset"},
      {[](auto& r) { r.mutable_gradients(1)->set_offset(~uint64_t{0} - 3); }, absl::StatusCode::kInvalidArgument,
       "gradients[1].offset"},
      {[](auto& r) { r.mutable_gradients(0)->set_byte_size(31 * 4); }, absl::StatusCode::kInvalidArgument,
       "gradients[0].byte_size"},
      {[](auto& r) { r.mutable_gradients(1)->set_name("w"); }, absl::StatusCode::kInvalidArgument, "gradients[1].name"},
      {[](auto& r) { r.mutable_gradients(0)->set_name("nope"); }, absl::StatusCode::kNotFound, "gradients[0].name"},
      {[](auto& r) { r.mutable_gradients(0)->set_dtype(static_cast<v1::DType>(77)); },
       absl::StatusCode::kInvalidArgument, "gradients[0].dtype"},
      {[](auto& r) { r.mutable_parameters()->RemoveLast(); }, absl::StatusCode::kInvalidArgument, "parameters"},
      {[](auto& r) { r.mutable_parameters(0)->set_offset(4096); }, absl::StatusCode::kInvalidArgument,
       "parameters[0].offset"},
      {[](auto& r) { r.mutable_header()->set_return_dtype(v1::DTYPE_BF16); }, absl::StatusCode::kInvalidArgument,
       "header.return_dtype"},
      {[](auto& r) { r.mutable_header()->set_step(7); }, absl::StatusCode::kFailedPrecondition, "header.step"},
  };
  for (const Case& c : cases) {
    v1::StepSharedRequest r = request();
    c.change(r);
    EXPECT_THAT(StepShared(r), StatusIs(c.code, c.field)) << c.field;
  }
  int64_t last_step = -1;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap after, session->GetParameters(&last_step));
  EXPECT_EQ(last_step, 0);
  EXPECT_EQ(after, before);

  // The same request, well formed, is applied.
  const std::vector<float> w = Gradient("w", 1, 32), b = Gradient("b", 1, 4);
  std::memcpy(region->data(), w.data(), 32 * 4);
  std::memcpy(region->data() + 32 * 4, b.data(), 4 * 4);
  ASSERT_OK_AND_ASSIGN(v1::StepResult result, StepShared(request()));
  EXPECT_TRUE(result.applied());
  ASSERT_OK_AND_ASSIGN(client::ParameterMap stepped, session->GetParameters(&last_step));
  EXPECT_EQ(last_step, 1);
  std::vector<float> in_region(32);
  std::memcpy(in_region.data(), region->data(), 32 * 4);
  EXPECT_EQ(in_region, stepped["w"]) << "the parameters after the step are written into the region";
}

TEST_F(ShmTest, MemoryThatCouldShrinkOrIsNotAMemfdIsRefused) {
  const std::string address = Socket();
  ASSERT_FALSE(address.empty());
  auto pass = [&](int fd) -> std::string {
    absl::StatusOr<int> socket = client::ConnectShmSocket(address);
    EXPECT_OK(socket.status());
    if (!socket.ok()) return "";
    EXPECT_OK(client::PresentGrant(*socket, Grant()));
    absl::StatusOr<std::string> answer = client::PassDescriptor(*socket, fd);
    ::close(*socket);
    EXPECT_OK(answer.status());
    return answer.ok() ? *answer : "";
  };
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  EXPECT_THAT(pass(unsealed), HasSubstr("not sealed against shrinking"));
  const int sealed_empty = ::memfd_create("empty", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(::fcntl(sealed_empty, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  EXPECT_THAT(pass(sealed_empty), HasSubstr("empty"));
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  EXPECT_THAT(pass(pipe_fds[0]), HasSubstr("not a sealable memfd"));
  for (int fd : {unsealed, sealed_empty, pipe_fds[0], pipe_fds[1]}) ::close(fd);
  EXPECT_FALSE(daemon_->Exited());
}

// Only a connection that presented a grant from the authenticated GrantSharedMemory holds a
// descriptor: a client that passes one without (an older client, or a peer that did not
// authenticate) is told what to upgrade and let go; a grant binds one connection, once.
TEST_F(ShmTest, ADescriptorNeedsAGrantFirst) {
  const std::string address = Socket();
  ASSERT_FALSE(address.empty());
  const int memfd = ::memfd_create("no-grant", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(::ftruncate(memfd, 4096), 0);
  ASSERT_EQ(::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  {
    ASSERT_OK_AND_ASSIGN(int socket, client::ConnectShmSocket(address));
    ASSERT_OK_AND_ASSIGN(std::string answer, client::PassDescriptor(socket, memfd));
    EXPECT_THAT(answer, HasSubstr("GrantSharedMemory"));
    EXPECT_THAT(answer, HasSubstr("upgrade the muond client"));
    char byte;
    EXPECT_EQ(::read(socket, &byte, 1), 0) << "the daemon closed the connection";
    ::close(socket);
  }
  {
    ASSERT_OK_AND_ASSIGN(int socket, client::ConnectShmSocket(address));
    EXPECT_THAT(client::RequestLivenessTicket(socket), StatusIs(absl::StatusCode::kUnavailable, "GrantSharedMemory"));
    ::close(socket);
  }
  const std::string grant = Grant();
  {
    ASSERT_OK_AND_ASSIGN(int socket, client::ConnectShmSocket(address));
    EXPECT_THAT(client::PresentGrant(socket, "0123456789abcdef0123456789abcdef"),
                StatusIs(absl::StatusCode::kFailedPrecondition, "unknown, used or expired"));
    ::close(socket);
  }
  ASSERT_OK_AND_ASSIGN(int first, client::ConnectShmSocket(address));
  ASSERT_OK(client::PresentGrant(first, grant));
  ASSERT_OK_AND_ASSIGN(std::string answer, client::PassDescriptor(first, memfd));
  EXPECT_THAT(answer, ::testing::StartsWith("ok "));
  EXPECT_OK(client::RequestLivenessTicket(first).status());
  ASSERT_OK_AND_ASSIGN(int second, client::ConnectShmSocket(address));
  EXPECT_THAT(client::PresentGrant(second, grant), StatusIs(absl::StatusCode::kFailedPrecondition, "used"));
  for (int fd : {first, second, memfd}) ::close(fd);
  EXPECT_FALSE(daemon_->Exited());
}

TEST_F(ShmTest, AClientThatGoesAwayLeavesNoRegionBehind) {
  std::unique_ptr<client::ShmRegion> region = Register("goes-away", 1 << 20);
  ASSERT_NE(region, nullptr);
  ASSERT_OK(Status("goes-away").status());
  region.reset();  // closes the socket connection, as the kernel does for a client that died
  // The daemon drops the region when it sees the connection close: wait for that event.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (Status("goes-away").ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_THAT(Status("goes-away"), StatusIs(absl::StatusCode::kNotFound, "name"));
  // A ticket claimed after its connection closed: refused, or (claimed before the daemon saw the
  // close) dropped with the connection all the same.
  std::string ticket;
  {
    absl::StatusOr<std::unique_ptr<client::ShmRegion>> unclaimed = client::ShmRegion::Create(Socket(), 64, Grant());
    ASSERT_OK(unclaimed.status());
    ticket = (*unclaimed)->ticket();
  }
  v1::RegisterSharedMemoryRequest request;
  request.set_name("late");
  request.set_ticket(ticket);
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  const absl::Status late = client::FromGrpcStatus(client_->stub().RegisterSharedMemory(&context, request, &response));
  if (late.ok()) {
    while (Status("late").ok() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_THAT(Status("late"), StatusIs(absl::StatusCode::kNotFound, "name"));
  } else {
    EXPECT_THAT(late, StatusIs(absl::StatusCode::kNotFound, "ticket"));
  }
}

TEST_F(ShmTest, UnregisteredRegionsAreGone) {
  std::unique_ptr<client::ShmRegion> region = Register("dropped", 64);
  ASSERT_NE(region, nullptr);
  v1::UnregisterSharedMemoryRequest request;
  request.set_name("dropped");
  v1::UnregisterSharedMemoryResponse response;
  {
    grpc::ClientContext context;
    ASSERT_OK(client::FromGrpcStatus(client_->stub().UnregisterSharedMemory(&context, request, &response)));
  }
  grpc::ClientContext again;
  EXPECT_THAT(client::FromGrpcStatus(client_->stub().UnregisterSharedMemory(&again, request, &response)),
              StatusIs(absl::StatusCode::kNotFound, "name"));
}

// A socket that accepts and never answers (a stopped or wedged daemon) fails a region's set-up as a
// daemon that is away once the client's deadline passes, instead of waiting on the answer forever.
TEST(ShmSocketTest, ASocketThatNeverAnswersIsUnavailableAfterTheDeadline) {
  DaemonProcess scratch;  // never started: its folder, removed with it, holds the socket
  ASSERT_FALSE(scratch.dir().empty());
  const std::string address = scratch.dir() + "/silent.sock";
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, address.data(), address.size());
  ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);  // connections queue; nothing ever reads them
  EXPECT_THAT(client::ShmRegion::Create(address, 4096, "", std::chrono::milliseconds(300)),
              StatusIs(absl::StatusCode::kUnavailable, "did not answer on its socket within the deadline"));
  ::close(listener);
}

}  // namespace
}  // namespace muond::testing
