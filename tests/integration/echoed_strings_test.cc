// What the daemon echoes of a client's strings: bounded in errors and log lines (a megabyte of
// channel name gets a short error naming the field, not one over the client's metadata limit), and
// the step calls name the field a session id came in (header.session_id).
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using EchoedStringsTest = DaemonTest;

TEST_F(EchoedStringsTest, AHugeChannelNameIsEchoedBounded) {
  v1::CloseNcclChannelRequest request;
  request.set_channel(std::string(1 << 20, 'c'));
  v1::CloseNcclChannelResponse response;
  grpc::ClientContext context;
  const grpc::Status status = client_->stub().CloseNcclChannel(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message().substr(0, 200);
  EXPECT_THAT(status.error_message(), HasSubstr("channel: no NCCL channel 'ccc"));
  EXPECT_THAT(status.error_message(), HasSubstr("…(1048576 bytes)"));
  EXPECT_LT(status.error_message().size(), 512u);
  // Its log line is short too.
  ASSERT_TRUE(daemon_->WaitForLog("(1048576 bytes)"));
  std::istringstream log(daemon_->ReadStderr());
  for (std::string line; std::getline(log, line);) EXPECT_LT(line.size(), 8192u);
}

TEST_F(EchoedStringsTest, StepCallsNameTheHeadersSessionId) {
  v1::StepSharedRequest shared;
  shared.mutable_header()->set_session_id("no-such-session");
  shared.mutable_header()->set_step(1);
  v1::StepSharedResponse response;
  {
    grpc::ClientContext context;
    const grpc::Status status = client_->stub().StepShared(&context, shared, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(status.error_message(), HasSubstr("header.session_id: no session 'no-such-session'"));
  }
  {
    grpc::ClientContext context;
    const grpc::Status status = client_->stub().StepCuda(&context, shared, &response);
    EXPECT_THAT(status.error_message(), Not(::testing::StartsWith("session_id")));
  }
  v1::StepNcclRequest nccl;
  *nccl.mutable_header() = shared.header();
  {
    grpc::ClientContext context;
    const grpc::Status status = client_->stub().StepNccl(&context, nccl, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(status.error_message(), HasSubstr("header.session_id: no session 'no-such-session'"));
  }
}

}  // namespace
}  // namespace muond::testing
