// The rpc layer in process: the real MuondService on an in-process gRPC channel. Every call runs in
// its CallScope: a stream that goes silent ends with DEADLINE_EXCEEDED naming --rpc-timeout (the
// watchdog wakes the blocked handler), a call without the bearer token is UNAUTHENTICATED, and
// every call — ListSessions included — counts as in flight for the shutdown drain.
#include "server/rpc/call_scope.h"

#include <memory>
#include <stdexcept>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/error_reason.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "tests/testing/status_matchers.h"

namespace muond::rpc {
namespace {

using ::testing::HasSubstr;

// Counts the calls each method ended with, as a metrics exporter would.
class CountingMetrics final : public metrics::Metrics {
 public:
  void CallStarted(std::string_view) override {
    absl::MutexLock lock(&mu_);
    ++started_;
  }
  // Waits until `count` calls have started.
  void AwaitStarted(int count) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return started_ >= count; };
    mu_.Await(absl::Condition(&reached));
  }
  void CallEnded(std::string_view method, absl::StatusCode code, absl::Duration) override {
    absl::MutexLock lock(&mu_);
    ended_.push_back({std::string(method), code});
  }
  void StepAnswered(const metrics::StepReport&) override {}
  void SessionsHeld(int, int64_t) override {}
  void JournalAppended(absl::Duration, bool) override {}
  void CheckpointWritten(absl::Duration, bool) override {}
  std::vector<std::pair<std::string, absl::StatusCode>> ended() {
    absl::MutexLock lock(&mu_);
    return ended_;
  }

 private:
  absl::Mutex mu_;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<std::string, absl::StatusCode>> ended_ ABSL_GUARDED_BY(mu_);
};

class CallScopeTest : public ::testing::Test {
 protected:
  void Start(absl::Duration rpc_timeout, const security::TokenTable* tokens = nullptr, int max_calls_per_caller = 0) {
    backend_ = kernels::NewCpuBackend(1);
    registry_ = std::make_unique<session::SessionRegistry>(backend_.get(), &codec_, session::SpecLimits{}, 4);
    ServiceOptions options;
    options.rpc_timeout = rpc_timeout;
    options.tokens = tokens;
    options.metrics = &metrics_;
    options.max_calls_per_caller = max_calls_per_caller;
    service_ = std::make_unique<MuondService>(registry_.get(), backend_.get(), options);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = v1::Muond::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  CountingMetrics metrics_;
  ProtoSpecCodec codec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<session::SessionRegistry> registry_;
  std::unique_ptr<MuondService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Muond::Stub> stub_;
};

TEST_F(CallScopeTest, ASilentStreamEndsWithDeadlineExceededNamingTheFlag) {
  Start(absl::Milliseconds(200));
  grpc::ClientContext context;  // no client deadline: only the daemon's limit can end the call
  v1::UploadParametersResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadParametersRequest>> writer =
      stub_->UploadParameters(&context, &response);
  // Sends nothing and never half-closes: the handler blocks in Read until the watchdog cancels it.
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(), HasSubstr("--rpc-timeout"));
  EXPECT_TRUE(service_->AwaitIdle(absl::Seconds(30))) << "the handler thread was freed";
}

TEST_F(CallScopeTest, EveryCallIsAuthenticatedAndReported) {
  absl::StatusOr<security::TokenTable> tokens = security::TokenTable::Parse("alice:secret-a\n", "test");
  ASSERT_OK(tokens.status());
  Start(absl::Seconds(60), &*tokens);
  {
    grpc::ClientContext context;
    v1::ListSessionsResponse response;
    const grpc::Status status = stub_->ListSessions(&context, v1::ListSessionsRequest(), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer secret-a");
    v1::ListSessionsResponse response;
    EXPECT_TRUE(stub_->ListSessions(&context, v1::ListSessionsRequest(), &response).ok());
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer secret-a");
    v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  }
  EXPECT_THAT(metrics_.ended(),
              ::testing::ElementsAre(
                  std::pair<std::string, absl::StatusCode>{"ListSessions", absl::StatusCode::kUnauthenticated},
                  std::pair<std::string, absl::StatusCode>{"ListSessions", absl::StatusCode::kOk},
                  std::pair<std::string, absl::StatusCode>{"GetServerInfo", absl::StatusCode::kOk}));
}

// One caller's calls in flight are capped (--max-calls-per-caller); another caller's are not touched,
// and a call that ends gives its place back.
TEST_F(CallScopeTest, ACallerHasAtMostItsCapOfCallsInFlight) {
  absl::StatusOr<security::TokenTable> tokens = security::TokenTable::Parse("alice:secret-a\nbob:secret-b\n", "test");
  ASSERT_OK(tokens.status());
  Start(absl::Seconds(60), &*tokens, /*max_calls_per_caller=*/2);
  const auto list = [&](const char* token) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::ListSessionsResponse response;
    return stub_->ListSessions(&context, v1::ListSessionsRequest(), &response);
  };
  // Two uploads that send nothing: each stays in flight, holding its place, until it is closed.
  grpc::ClientContext first_context, second_context;
  first_context.AddMetadata("authorization", "Bearer secret-a");
  second_context.AddMetadata("authorization", "Bearer secret-a");
  v1::UploadParametersResponse first_response, second_response;
  auto first = stub_->UploadParameters(&first_context, &first_response);
  auto second = stub_->UploadParameters(&second_context, &second_response);
  metrics_.AwaitStarted(2);  // a started call holds its place
  const grpc::Status third = list("secret-a");
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(third.error_message(), HasSubstr("this caller has 2 calls in flight"));
  EXPECT_THAT(third.error_message(), HasSubstr("--max-calls-per-caller"));
  EXPECT_TRUE(list("secret-b").ok()) << "another caller is served";
  first->WritesDone();
  EXPECT_EQ(first->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // an empty upload
  EXPECT_TRUE(list("secret-a").ok()) << "the ended call gave its place back";
  second->WritesDone();
  EXPECT_EQ(second->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(CallerSlotsTest, SlotsAreCountedPerCallerAndGivenBackWhenDestroyed) {
  CallerSlots slots(1);
  {
    ASSERT_OK_AND_ASSIGN(CallerSlots::Slot alice, slots.Take("alice"));
    EXPECT_EQ(slots.InFlight("alice"), 1);
    EXPECT_THAT(slots.Take("alice"),
                ::muond::testing::StatusIs(absl::StatusCode::kResourceExhausted, "--max-calls-per-caller"));
    EXPECT_EQ(ReasonOf(slots.Take("alice").status()), "CALLER_BUSY");
    ASSERT_OK_AND_ASSIGN(CallerSlots::Slot bob, slots.Take("bob"));
    CallerSlots::Slot moved = std::move(alice);  // a moved slot is held once
    EXPECT_EQ(slots.InFlight("alice"), 1);
  }
  EXPECT_EQ(slots.InFlight("alice"), 0);
  EXPECT_EQ(slots.InFlight("bob"), 0);
  EXPECT_OK(slots.Take("alice").status());
  // The anonymous caller (no authentication) and a cap of 0 count nothing.
  std::vector<CallerSlots::Slot> anonymous;
  for (int i = 0; i < 3; ++i) anonymous.push_back(*slots.Take(""));
  EXPECT_EQ(slots.InFlight(""), 0);
  CallerSlots uncapped(0);
  std::vector<CallerSlots::Slot> many;
  for (int i = 0; i < 3; ++i) many.push_back(*uncapped.Take("alice"));
  EXPECT_EQ(uncapped.InFlight("alice"), 0);
}

TEST(CallScopeEndTest, AHandlerThatThrowsStillEndsTheCallInTheMetrics) {
  CountingMetrics metrics;
  CallServices services(absl::Seconds(60), nullptr, &metrics);
  grpc::ServerContext context;
  EXPECT_THROW(Serve(services, &context, "Step",
                     [](const std::string&) -> absl::Status { throw std::runtime_error("out of memory"); }),
               std::runtime_error);
  EXPECT_THAT(metrics.ended(),
              ::testing::ElementsAre(std::pair<std::string, absl::StatusCode>{"Step", absl::StatusCode::kUnknown}));
}

// A call is in flight from the moment its handler starts until it returns: the drain waits for it.
TEST_F(CallScopeTest, TheDrainWaitsForACallInFlight) {
  Start(absl::Seconds(60));
  grpc::ClientContext context;
  v1::UploadParametersResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadParametersRequest>> writer =
      stub_->UploadParameters(&context, &response);
  // The handler reads until the client half-closes, so once it has started it stays in flight for
  // as long as the writer is open.
  metrics_.AwaitStarted(1);
  EXPECT_FALSE(service_->AwaitIdle(absl::ZeroDuration())) << "an open call counts as in flight";
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_TRUE(service_->AwaitIdle(absl::Seconds(30)));
}

}  // namespace
}  // namespace muond::rpc
