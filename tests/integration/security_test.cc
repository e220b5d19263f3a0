// Security of the real daemon through the C++ client: TLS, mutual TLS, bearer tokens, session
// ownership, and the warning printed when it listens beyond loopback without authentication. Each
// suite starts its own daemon with its own flags; certificates are made per run with openssl.
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/muond_client.h"
#include "client/shm_region.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/wire/dtype_codec.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_pki.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAliceToken[] = "alice-7c1f0b2e9d";
constexpr char kBobToken[] = "bob-44aa90e1c3";
constexpr char kBareToken[] = "ci-0d9e51f7";
// Line 5 holds the bare token, whose identity is "token-" and its SHA-256's first 16 hex digits.
constexpr char kTokenFile[] = "# muond bearer tokens\nalice:alice-7c1f0b2e9d\nbob: bob-44aa90e1c3\n\nci-0d9e51f7\n";

v1::SessionSpec Spec() {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("matrices");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(8);
  w->add_shape(4);
  w->set_group("matrices");
  return spec;
}

std::vector<float> Values(float base) {
  std::vector<float> v(32);
  for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.01f * static_cast<float>(i);
  return v;
}

// Every call on session `id` (created by another caller, at step 1) from `intruder` is
// PERMISSION_DENIED naming the session: attach, steps (new and "replayed"), parameters, upload, close,
// state out and state in.
void ExpectEverySessionCallDenied(client::Client& intruder, const std::string& id) {
  const auto denied = StatusIs(absl::StatusCode::kPermissionDenied, "session '" + id + "' belongs to another client");
  // Attaching with the identical spec is how a client resumes; for another caller it is refused.
  EXPECT_THAT(intruder.CreateSession(id, Spec()), denied);
  // A Session object for the id, as the intruder would build after a (refused) attach.
  v1::CreateSessionResponse pretend;
  pretend.set_initialized(true);
  pretend.set_last_step(1);
  client::Session theirs(&intruder, id, Spec(), pretend);
  const std::vector<float> evil = Values(-100.0f);
  EXPECT_THAT(theirs.Step(2, std::vector<client::TensorView>{{"w", {8, 4}, evil}}), denied);
  EXPECT_THAT(theirs.Step(1, std::vector<client::TensorView>{{"w", {8, 4}, evil}}), denied);  // a "replay"
  EXPECT_THAT(theirs.GetParameters(), denied);
  EXPECT_THAT(theirs.UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, evil}}), denied);
  EXPECT_THAT(intruder.CloseSession(id), denied);
  {
    grpc::ClientContext context;
    intruder.PrepareContext(context);
    v1::GetStateRequest request;
    request.set_session_id(id);
    auto reader = intruder.stub().GetState(&context, request);
    v1::GetStateResponse response;
    EXPECT_FALSE(reader->Read(&response)) << "state of another caller's session was streamed";
    EXPECT_THAT(client::FromGrpcStatus(reader->Finish()), denied);
  }
  {
    grpc::ClientContext context;
    intruder.PrepareContext(context);
    v1::SetStateResponse response;
    auto writer = intruder.stub().SetState(&context, &response);
    v1::SetStateRequest request;
    request.set_session_id(id);
    writer->Write(request);
    request.Clear();
    request.mutable_header()->set_last_step(0);
    request.mutable_header()->add_step_counts()->set_name("w");
    writer->Write(request);
    request.Clear();
    v1::TensorChunk* chunk = request.mutable_chunk();
    chunk->set_name("w");
    chunk->set_slot("master");
    chunk->set_dtype(v1::DTYPE_FP32);
    wire::Encode(v1::DTYPE_FP32, evil, chunk->mutable_data());
    writer->Write(request);
    writer->WritesDone();
    EXPECT_THAT(client::FromGrpcStatus(writer->Finish()), denied);
  }
}

// Creates a session and uploads its initial values.
absl::StatusOr<std::unique_ptr<client::Session>> NewSession(client::Client& client, const std::string& id) {
  absl::StatusOr<std::unique_ptr<client::Session>> session = client.CreateSession(id, Spec());
  if (!session.ok()) return session.status();
  const std::vector<float> w = Values(0.5f);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}};
  if (absl::Status s = (*session)->UploadParameters(initial); !s.ok()) return s;
  return session;
}

client::ClientOptions Options(const DaemonProcess& daemon, const std::string& token = "") {
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.connect_timeout = std::chrono::seconds(3);
  options.max_step_attempts = 1;
  options.auth_token = token;
  return options;
}

// Connects and makes one call: a refused TLS handshake shows up in either (with TLS 1.3 the client
// may finish its side of the handshake before the server rejects its certificate).
absl::Status Reach(const client::ClientOptions& options) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(options);
  if (!client.ok()) return client.status();
  return (*client)->ListSessions().status();
}

void WriteTokenFile(const std::string& path) {
  std::ofstream(path) << kTokenFile;
  chmod(path.c_str(), 0600);
}

// grpc.health.v1.Health/Check for the whole server, answered SERVING (bytes 08 01), without any token.
grpc::Status CheckHealth(const std::string& endpoint) {
  grpc::GenericStub stub(grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   done_cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  done_cv.wait(lock, [&] { return done; });
  if (!status.ok()) return status;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "empty answer");
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes != std::string("\x08\x01", 2)) return grpc::Status(grpc::StatusCode::INTERNAL, "not SERVING");
  return grpc::Status::OK;
}

// Stops a suite's daemon, which must have survived and must exit 0.
void StopDaemon(std::unique_ptr<DaemonProcess>& daemon) {
  if (daemon == nullptr) return;
  EXPECT_FALSE(daemon->Exited()) << "muond exited during the tests:\n" << daemon->ReadStderr();
  const int status = daemon->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "muond exit status " << status;
  daemon.reset();
}

// ---------------------------------------------------------------------------------------------
// Bearer tokens and session ownership (plaintext loopback).

class TokenAuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = std::make_unique<DaemonProcess>();
    const std::string tokens = daemon_->dir() + "/tokens";
    WriteTokenFile(tokens);
    std::string error;
    ASSERT_TRUE(daemon_->Start({"--backend", "cpu", "--auth-token-file", tokens}, &error)) << error;
  }
  static void TearDownTestSuite() { StopDaemon(daemon_); }

  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    ASSERT_FALSE(daemon_->Exited()) << "muond is not running";
  }

  static std::unique_ptr<client::Client> Connect(const std::string& token) {
    absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(Options(*daemon_, token));
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static std::unique_ptr<DaemonProcess> daemon_;
};

std::unique_ptr<DaemonProcess> TokenAuthTest::daemon_;

// Shared-memory regions belong to the caller that registered them: another token's caller neither
// sees them nor can step through them, and may use the same name for a region of its own.
TEST_F(TokenAuthTest, SharedMemoryRegionsArePrivateToTheirCaller) {
  auto alice = Connect(kAliceToken);
  auto bob = Connect(kBobToken);
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, alice->GetServerInfo());
  ASSERT_FALSE(info.shm_socket().empty());
  auto register_as = [&](client::Client& client, client::ShmRegion& region) {
    grpc::ClientContext context;
    client.PrepareContext(context);
    v1::RegisterSharedMemoryRequest request;
    request.set_name("grads");
    request.set_ticket(region.ticket());
    v1::RegisterSharedMemoryResponse response;
    return client::FromGrpcStatus(client.stub().RegisterSharedMemory(&context, request, &response));
  };
  ASSERT_OK_AND_ASSIGN(std::string alices_grant, alice->SharedMemoryGrant(info));
  ASSERT_OK_AND_ASSIGN(auto alices, client::ShmRegion::Create(info.shm_socket(), 32 * 4, alices_grant));
  // A ticket passed on Alice's connection is hers to claim: Bob cannot, even knowing it.
  EXPECT_THAT(register_as(*bob, *alices), StatusIs(absl::StatusCode::kNotFound, "ticket"));
  ASSERT_OK(register_as(*alice, *alices));
  ASSERT_OK_AND_ASSIGN(auto session, bob->CreateSession("bobs-shm", Spec()));
  const std::vector<float> w(32, 0.25f);
  ASSERT_OK(session->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}}));

  grpc::ClientContext context;
  bob->PrepareContext(context);
  v1::StepSharedRequest step;
  step.mutable_header()->set_session_id("bobs-shm");
  step.mutable_header()->set_step(1);
  v1::SharedTensor* g = step.add_gradients();
  g->set_name("w");
  g->set_region("grads");
  g->set_byte_size(32 * 4);
  *step.add_parameters() = *g;
  v1::StepSharedResponse response;
  EXPECT_THAT(client::FromGrpcStatus(bob->stub().StepShared(&context, step, &response)),
              StatusIs(absl::StatusCode::kNotFound, "gradients[0].region"));
  // Bob's own region of the same name is his, and works.
  ASSERT_OK_AND_ASSIGN(std::string bobs_grant, bob->SharedMemoryGrant(info));
  ASSERT_OK_AND_ASSIGN(auto bobs, client::ShmRegion::Create(info.shm_socket(), 32 * 4, bobs_grant));
  ASSERT_OK(register_as(*bob, *bobs));
  grpc::ClientContext again;
  bob->PrepareContext(again);
  EXPECT_OK(client::FromGrpcStatus(bob->stub().StepShared(&again, step, &response)));
  EXPECT_TRUE(response.result().applied());
}

TEST_F(TokenAuthTest, CallWithoutTokenIsUnauthenticated) {
  auto anonymous = Connect("");
  ASSERT_NE(anonymous, nullptr);
  EXPECT_THAT(anonymous->CreateSession("anonymous", Spec()),
              StatusIs(absl::StatusCode::kUnauthenticated, "authorization: Bearer <token>"));
  EXPECT_THAT(anonymous->ListSessions(), StatusIs(absl::StatusCode::kUnauthenticated, "--auth-token-file"));
  EXPECT_THAT(anonymous->GetServerInfo(), StatusIs(absl::StatusCode::kUnauthenticated, "missing credentials"));
  EXPECT_THAT(anonymous->CloseSession("anonymous"), StatusIs(absl::StatusCode::kUnauthenticated, "missing"));
}

TEST_F(TokenAuthTest, WrongTokenIsUnauthenticated) {
  auto stranger = Connect("alice-7c1f0b2e9e");  // one character off
  ASSERT_NE(stranger, nullptr);
  EXPECT_THAT(stranger->CreateSession("stranger", Spec()),
              StatusIs(absl::StatusCode::kUnauthenticated, "not one this daemon accepts"));
  auto prefix = Connect("alice");  // a prefix of a valid token
  ASSERT_NE(prefix, nullptr);
  EXPECT_THAT(prefix->ListSessions(), StatusIs(absl::StatusCode::kUnauthenticated, "not one this daemon accepts"));
}

TEST_F(TokenAuthTest, MalformedAuthorizationIsUnauthenticated) {
  auto client = Connect("");
  ASSERT_NE(client, nullptr);
  grpc::ClientContext context;
  context.AddMetadata("authorization", std::string("Basic ") + kAliceToken);
  v1::ListSessionsResponse response;
  const grpc::Status status = client->stub().ListSessions(&context, v1::ListSessionsRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("expected 'Bearer <token>'"));
  // The refusal never echoes the token.
  EXPECT_THAT(status.error_message(), Not(HasSubstr(kAliceToken)));
}

TEST_F(TokenAuthTest, HealthServiceNeedsNoToken) {
  const grpc::Status health = CheckHealth(daemon_->endpoint());
  EXPECT_TRUE(health.ok()) << health.error_message();
}

TEST_F(TokenAuthTest, ValidTokensWorkIncludingUnnamedOnes) {
  for (const char* token : {kAliceToken, kBobToken, kBareToken}) {
    auto client = Connect(token);
    ASSERT_NE(client, nullptr);
    const std::string id = std::string("works-") + token;
    ASSERT_OK_AND_ASSIGN(auto session, NewSession(*client, id));
    const std::vector<float> grad = Values(1.0f);
    const std::vector<client::TensorView> gradients = {{"w", {8, 4}, grad}};
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, gradients));
    EXPECT_TRUE(reply.applied);
    EXPECT_OK(client->GetServerInfo());
    EXPECT_OK(session->Close());
  }
}

TEST_F(TokenAuthTest, AnotherTokenIsDeniedEverySessionCallAndChangesNothing) {
  auto alice = Connect(kAliceToken);
  auto bob = Connect(kBobToken);
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  ASSERT_OK_AND_ASSIGN(auto mine, NewSession(*alice, "alice-run"));
  const std::vector<float> grad = Values(1.0f);
  const std::vector<client::TensorView> gradients = {{"w", {8, 4}, grad}};
  ASSERT_OK(mine->Step(1, gradients));
  int64_t step_before = -1;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap before, mine->GetParameters(&step_before));
  ASSERT_EQ(step_before, 1);

  ExpectEverySessionCallDenied(*bob, "alice-run");

  // Alice's session is exactly as it was.
  int64_t step_after = -1;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap after, mine->GetParameters(&step_after));
  EXPECT_EQ(step_after, 1);
  EXPECT_EQ(after, before);
  ASSERT_OK_AND_ASSIGN(client::StepReply next, mine->Step(2, gradients));
  EXPECT_TRUE(next.applied);
  EXPECT_FALSE(next.replayed);
  EXPECT_OK(mine->Close());
}

TEST_F(TokenAuthTest, ListSessionsShowsOnlyTheCallersSessions) {
  auto alice = Connect(kAliceToken);
  auto bob = Connect(kBobToken);
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  ASSERT_OK(alice->CreateSession("list-alice-1", Spec()));
  ASSERT_OK(alice->CreateSession("list-alice-2", Spec()));
  ASSERT_OK(bob->CreateSession("list-bob-1", Spec()));
  const auto ids = [](client::Client& client) {
    std::vector<std::string> out;
    auto sessions = client.ListSessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    if (sessions.ok()) {
      for (const auto& s : *sessions) out.push_back(s.session_id());
    }
    return out;
  };
  const std::vector<std::string> seen_by_alice = ids(*alice), seen_by_bob = ids(*bob);
  EXPECT_THAT(seen_by_alice, ::testing::IsSupersetOf({"list-alice-1", "list-alice-2"}));
  EXPECT_THAT(seen_by_alice, Not(::testing::Contains("list-bob-1")));
  EXPECT_THAT(seen_by_bob, ::testing::Contains("list-bob-1"));
  EXPECT_THAT(seen_by_bob, Not(::testing::Contains("list-alice-1")));
  EXPECT_THAT(seen_by_bob, Not(::testing::Contains("list-alice-2")));
  EXPECT_OK(alice->CloseSession("list-alice-1"));
  EXPECT_OK(alice->CloseSession("list-alice-2"));
  EXPECT_OK(bob->CloseSession("list-bob-1"));
}

// ---------------------------------------------------------------------------------------------
// TLS (server certificate only), with tokens on top.

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!OpensslAvailable()) return;  // each test skips, saying why
    daemon_ = std::make_unique<DaemonProcess>();
    std::string error;
    ASSERT_TRUE(MakeTestPki(daemon_->dir(), &pki_, &error)) << error;
    const std::string tokens = daemon_->dir() + "/tokens";
    WriteTokenFile(tokens);
    ASSERT_TRUE(daemon_->Start(
        {"--backend", "cpu", "--tls-cert", pki_.server_cert, "--tls-key", pki_.server_key, "--auth-token-file", tokens},
        &error))
        << error;
  }
  static void TearDownTestSuite() { StopDaemon(daemon_); }

  void SetUp() override {
    if (!OpensslAvailable()) GTEST_SKIP() << "the openssl command-line tool is not installed (scripts/setup.sh)";
    ASSERT_NE(daemon_, nullptr);
    ASSERT_FALSE(daemon_->Exited()) << "muond is not running";
  }

  static std::unique_ptr<DaemonProcess> daemon_;
  static TestPki pki_;
};

std::unique_ptr<DaemonProcess> TlsTest::daemon_;
TestPki TlsTest::pki_;

TEST_F(TlsTest, ClientTrustingTheCaStepsOverTls) {
  client::ClientOptions options = Options(*daemon_, kAliceToken);
  options.tls_ca_file = pki_.ca_cert;
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto session, NewSession(*client, "tls-run"));
  const std::vector<float> grad = Values(1.0f);
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, std::vector<client::TensorView>{{"w", {8, 4}, grad}}));
  EXPECT_TRUE(reply.applied);
  EXPECT_EQ(reply.parameters["w"].size(), 32u);
  EXPECT_OK(session->Close());
}

TEST_F(TlsTest, ServerNameOverrideVerifiesAgainstThatName) {
  client::ClientOptions options = Options(*daemon_, kAliceToken);
  options.tls_ca_file = pki_.ca_cert;
  options.tls_server_name_override = "localhost";  // in the certificate
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  EXPECT_OK(client->ListSessions());
  options.tls_server_name_override = "muond.example.com";  // not in the certificate
  EXPECT_THAT(Reach(options), StatusIs(absl::StatusCode::kUnavailable, ""));
}

TEST_F(TlsTest, TokenIsStillRequiredOverTls) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  EXPECT_THAT(client->ListSessions(), StatusIs(absl::StatusCode::kUnauthenticated, "authorization"));
}

TEST_F(TlsTest, PlaintextClientCannotTalkToTlsDaemon) {
  client::ClientOptions options = Options(*daemon_, kAliceToken);
  EXPECT_THAT(Reach(options), StatusIs(absl::StatusCode::kUnavailable, ""));
}

TEST_F(TlsTest, ClientNotTrustingTheCaIsRefused) {
  client::ClientOptions options = Options(*daemon_, kAliceToken);
  options.tls_ca_file = pki_.rogue_client_cert;  // some other certificate as the root
  EXPECT_THAT(Reach(options), StatusIs(absl::StatusCode::kUnavailable, ""));
}

TEST_F(TlsTest, UnreadableCaFileIsNamed) {
  client::ClientOptions options = Options(*daemon_, kAliceToken);
  options.tls_ca_file = daemon_->dir() + "/no-such.pem";
  EXPECT_THAT(client::Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, "tls_ca_file"));
}

// ---------------------------------------------------------------------------------------------
// Mutual TLS: the daemon requires a client certificate signed by --tls-client-ca.

class MutualTlsTest : public TlsTest {
 protected:
  static void SetUpTestSuite() {
    if (!OpensslAvailable()) return;
    daemon_ = std::make_unique<DaemonProcess>();
    std::string error;
    ASSERT_TRUE(MakeTestPki(daemon_->dir(), &pki_, &error)) << error;
    ASSERT_TRUE(daemon_->Start({"--backend", "cpu", "--tls-cert", pki_.server_cert, "--tls-key", pki_.server_key,
                                "--tls-client-ca", pki_.ca_cert},
                               &error))
        << error;
  }
  static void TearDownTestSuite() { StopDaemon(daemon_); }
};

TEST_F(MutualTlsTest, ClientWithCertificateIsServed) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  options.tls_client_cert_file = pki_.client_cert;
  options.tls_client_key_file = pki_.client_key;
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto session, NewSession(*client, "mtls-run"));
  const std::vector<float> grad = Values(1.0f);
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, std::vector<client::TensorView>{{"w", {8, 4}, grad}}));
  EXPECT_TRUE(reply.applied);
  EXPECT_OK(session->Close());
}

// Without tokens, the certificate names the caller: a client with another certificate (trusted as
// well) cannot use, list or close the first one's session.
TEST_F(MutualTlsTest, ASessionBelongsToTheCertificateThatCreatedIt) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  options.tls_client_cert_file = pki_.client_cert;
  options.tls_client_key_file = pki_.client_key;
  ASSERT_OK_AND_ASSIGN(auto first, client::Client::Connect(options));
  options.tls_client_cert_file = pki_.second_client_cert;
  options.tls_client_key_file = pki_.second_client_key;
  ASSERT_OK_AND_ASSIGN(auto second, client::Client::Connect(options));

  ASSERT_OK_AND_ASSIGN(auto mine, NewSession(*first, "cert-owned"));
  const std::vector<float> grad = Values(1.0f);
  const std::vector<client::TensorView> gradients = {{"w", {8, 4}, grad}};
  ASSERT_OK(mine->Step(1, gradients));
  ASSERT_OK_AND_ASSIGN(client::ParameterMap before, mine->GetParameters());
  ExpectEverySessionCallDenied(*second, "cert-owned");
  ASSERT_OK_AND_ASSIGN(client::ParameterMap after, mine->GetParameters());
  EXPECT_EQ(after, before);
  ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> listed, second->ListSessions());
  for (const v1::SessionSummary& s : listed) EXPECT_NE(s.session_id(), "cert-owned");

  // The owner still trains, from step 2, and a new connection with the same certificate is the
  // same caller.
  ASSERT_OK(mine->Step(2, gradients));
  options.tls_client_cert_file = pki_.client_cert;
  options.tls_client_key_file = pki_.client_key;
  ASSERT_OK_AND_ASSIGN(auto again, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto attached, again->CreateSession("cert-owned", Spec()));
  EXPECT_EQ(attached->last_step(), 2);
  EXPECT_OK(attached->Close());
}

// A certificate reissued with its names in another order is the same caller; one whose single name
// holds the separator ("alice.test,bob.test") is not the certificate of the two names.
TEST_F(MutualTlsTest, ACertificateIsItsSetOfNamesWhateverTheirOrder) {
  const auto connect = [&](const std::string& name) {
    client::ClientOptions options = Options(*daemon_);
    options.tls_ca_file = pki_.ca_cert;
    options.tls_client_cert_file = pki_.named_clients.at(name).first;
    options.tls_client_key_file = pki_.named_clients.at(name).second;
    return client::Client::Connect(options);
  };
  ASSERT_OK_AND_ASSIGN(auto two_names, connect("two-names"));
  ASSERT_OK_AND_ASSIGN(auto reversed, connect("two-names-reversed"));
  ASSERT_OK_AND_ASSIGN(auto comma, connect("comma-name"));
  ASSERT_OK_AND_ASSIGN(auto mine, NewSession(*two_names, "named-run"));
  const std::vector<float> grad = Values(1.0f);
  const std::vector<client::TensorView> gradients = {{"w", {8, 4}, grad}};
  ASSERT_OK(mine->Step(1, gradients));
  ExpectEverySessionCallDenied(*comma, "named-run");
  ASSERT_OK_AND_ASSIGN(auto attached, reversed->CreateSession("named-run", Spec()));
  EXPECT_EQ(attached->last_step(), 1);
  ASSERT_OK(attached->Step(2, gradients));
  ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> listed, reversed->ListSessions());
  EXPECT_TRUE(std::any_of(listed.begin(), listed.end(),
                          [](const v1::SessionSummary& s) { return s.session_id() == "named-run"; }));
  EXPECT_OK(attached->Close());
}

TEST_F(MutualTlsTest, ClientWithoutCertificateIsRefused) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  EXPECT_THAT(Reach(options), StatusIs(absl::StatusCode::kUnavailable, ""));
}

TEST_F(MutualTlsTest, ClientWithUntrustedCertificateIsRefused) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  options.tls_client_cert_file = pki_.rogue_client_cert;
  options.tls_client_key_file = pki_.rogue_client_key;
  EXPECT_THAT(Reach(options), StatusIs(absl::StatusCode::kUnavailable, ""));
}

TEST_F(MutualTlsTest, CertificateWithoutKeyIsAnOptionError) {
  client::ClientOptions options = Options(*daemon_);
  options.tls_ca_file = pki_.ca_cert;
  options.tls_client_cert_file = pki_.client_cert;
  EXPECT_THAT(client::Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, "tls_client_key_file"));
}

// ---------------------------------------------------------------------------------------------
// Start-up: refused configurations and the exposure warning.

TEST(SecurityStartupTest, WarnsLoudlyOnNonLoopbackListenerWithoutAuthentication) {
  DaemonProcess daemon;
  daemon.set_listen_host("0.0.0.0");
  std::string error;
  ASSERT_TRUE(daemon.Start({"--backend", "cpu"}, &error)) << error;
  // The daemon is reachable through loopback as well.
  client::ClientOptions options = Options(daemon);
  ASSERT_OK(client::Client::Connect(options));
  const int status = daemon.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string log = daemon.ReadStderr();
  EXPECT_THAT(log, HasSubstr("WITHOUT AUTHENTICATION"));
  EXPECT_THAT(log, HasSubstr("0.0.0.0"));
  EXPECT_THAT(log, HasSubstr("--auth-token-file"));
  EXPECT_THAT(log, HasSubstr("warn"));
}

TEST(SecurityStartupTest, NoWarningOnLoopbackOrWithTokens) {
  {
    DaemonProcess loopback;
    std::string error;
    ASSERT_TRUE(loopback.Start({"--backend", "cpu"}, &error)) << error;
    loopback.Stop();
    EXPECT_THAT(loopback.ReadStderr(), Not(HasSubstr("SECURITY")));
  }
  if (!OpensslAvailable()) GTEST_SKIP() << "the openssl command-line tool is not installed (scripts/setup.sh)";
  DaemonProcess secured;
  secured.set_listen_host("0.0.0.0");
  TestPki pki;
  std::string error;
  ASSERT_TRUE(MakeTestPki(secured.dir(), &pki, &error)) << error;
  const std::string tokens = secured.dir() + "/tokens";
  WriteTokenFile(tokens);
  ASSERT_TRUE(secured.Start(
      {"--backend", "cpu", "--auth-token-file", tokens, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key},
      &error))
      << error;
  secured.Stop();
  EXPECT_THAT(secured.ReadStderr(), Not(HasSubstr("SECURITY")));
}

TEST(SecurityStartupTest, TokensWithoutTlsBeyondLoopbackAreWarnedAbout) {
  DaemonProcess daemon;
  daemon.set_listen_host("0.0.0.0");
  const std::string tokens = daemon.dir() + "/tokens";
  WriteTokenFile(tokens);
  std::string error;
  ASSERT_TRUE(daemon.Start({"--backend", "cpu", "--auth-token-file", tokens}, &error)) << error;
  daemon.Stop();
  const std::string log = daemon.ReadStderr();
  EXPECT_THAT(log, HasSubstr("plain text"));
  EXPECT_THAT(log, Not(HasSubstr("WITHOUT AUTHENTICATION")));
  // Token values never reach the log.
  EXPECT_THAT(log, Not(HasSubstr(kAliceToken)));
}

TEST(SecurityStartupTest, BadSecurityFlagsStopStartup) {
  DaemonProcess daemon;
  const std::string empty_tokens = daemon.dir() + "/empty-tokens";
  std::ofstream(empty_tokens) << "# nothing here\n";
  std::string error;
  EXPECT_FALSE(daemon.Start({"--backend", "cpu", "--auth-token-file", empty_tokens}, &error));
  EXPECT_THAT(error, HasSubstr("no tokens"));

  const std::string not_pem = daemon.dir() + "/not.pem";
  std::ofstream(not_pem) << "hello\n";
  error.clear();
  EXPECT_FALSE(daemon.Start({"--backend", "cpu", "--tls-cert", not_pem}, &error));
  EXPECT_THAT(error, HasSubstr("--tls-key go together"));
  error.clear();
  EXPECT_FALSE(daemon.Start({"--backend", "cpu", "--tls-cert", not_pem, "--tls-key", not_pem}, &error));
  EXPECT_THAT(error, HasSubstr("--tls-cert"));
  EXPECT_THAT(error, HasSubstr("no PEM certificate"));

  // An empty variable for a flag that turns authentication on stops the start: taken as absent, it
  // would serve every caller.
  ASSERT_EQ(setenv("MUOND_AUTH_TOKEN_FILE", "", 1), 0);
  error.clear();
  const bool started = daemon.Start({"--backend", "cpu"}, &error);
  unsetenv("MUOND_AUTH_TOKEN_FILE");
  EXPECT_FALSE(started);
  EXPECT_THAT(error, HasSubstr("MUOND_AUTH_TOKEN_FILE is set but empty"));
}

}  // namespace
}  // namespace muond::testing
