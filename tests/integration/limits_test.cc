// The daemon's limits through the C++ client: per-session and total memory quotas (and closing a
// session giving its share back), tensor rank and element counts, and --rpc-timeout ending a call
// whose client went silent; ListSessions' pages under the message limit. Every test starts its own
// daemon, so quotas start empty.
#include <sys/wait.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/muond_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/one_parameter_spec.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class LimitsTest : public ::testing::Test {
 protected:
  // Starts a daemon with `flags` and connects a client to it.
  void Start(const std::vector<std::string>& flags) {
    std::vector<std::string> all = {"--backend", "cpu"};
    all.insert(all.end(), flags.begin(), flags.end());
    std::string error;
    ASSERT_TRUE(daemon_.Start(all, &error)) << error;
    client::ClientOptions options = testing::TestClientOptions();
    options.endpoint = daemon_.endpoint();
    options.max_step_attempts = 1;
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Connect(options));
  }

  void TearDown() override {
    client_.reset();
    if (daemon_.running()) {
      EXPECT_FALSE(daemon_.Exited()) << "muond exited during the test:\n" << daemon_.ReadStderr();
      const int status = daemon_.Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "muond exit status " << status;
    }
  }

  std::vector<std::string> SessionIds() {
    std::vector<std::string> ids;
    auto sessions = client_->ListSessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    if (sessions.ok()) {
      for (const auto& s : *sessions) ids.push_back(s.session_id());
    }
    return ids;
  }

  // One ListSessions call through the stub: one page, as the daemon answers it.
  grpc::Status ListPage(const v1::ListSessionsRequest& request, v1::ListSessionsResponse* page) {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    return client_->stub().ListSessions(&context, request, page);
  }
  // The message of a page `request` the daemon must refuse as INVALID_ARGUMENT.
  std::string RefusalOf(const v1::ListSessionsRequest& request) {
    v1::ListSessionsResponse page;
    const grpc::Status status = ListPage(request, &page);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    return status.error_message();
  }

  DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
};

// Bytes by the daemon's estimate: elements × 4 × (master + gradient + optimizer slots).
constexpr int64_t kMuon16x16 = 16 * 16 * 4 * 3;   // 3072
constexpr int64_t kAdamW16x16 = 16 * 16 * 4 * 4;  // 4096

TEST_F(LimitsTest, SessionOverTheSessionQuotaIsRefusedNamingIt) {
  Start({"--max-session-bytes", std::to_string(kAdamW16x16)});
  EXPECT_OK(client_->CreateSession("fits", OneParameterSpec({16, 16}, v1::OPTIMIZER_ADAMW)));
  // AdamW keeps two slots: 16×17 elements × 4 bytes × 4 buffers = 4352 bytes.
  const auto refused = client_->CreateSession("too-big", OneParameterSpec({16, 17}, v1::OPTIMIZER_ADAMW));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, "--max-session-bytes 4096"));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, "needs 4352 bytes"));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, "session_id 'too-big'"));
  // The same element count fits under Muon (one slot).
  EXPECT_OK(client_->CreateSession("muon-fits", OneParameterSpec({16, 17})));
  EXPECT_THAT(SessionIds(), Not(::testing::Contains("too-big")));
}

TEST_F(LimitsTest, TotalQuotaIsSharedAndClosingASessionFreesItsShare) {
  Start({"--max-total-bytes", std::to_string(3 * kMuon16x16 + 100)});
  for (const char* id : {"a", "b", "c"}) ASSERT_OK(client_->CreateSession(id, OneParameterSpec({16, 16})));
  const auto refused = client_->CreateSession("d", OneParameterSpec({16, 16}));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, "--max-total-bytes 9316"));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, "holds 9216 bytes"));
  EXPECT_THAT(SessionIds(), Not(::testing::Contains("d")));
  // Attaching to a held session takes nothing more.
  ASSERT_OK_AND_ASSIGN(auto attached, client_->CreateSession("b", OneParameterSpec({16, 16})));
  EXPECT_TRUE(attached->attached());
  // A smaller session still fits in what is left.
  EXPECT_OK(client_->CreateSession("small", OneParameterSpec({2, 4})));
  EXPECT_OK(client_->CloseSession("small"));

  ASSERT_OK(client_->CloseSession("a"));
  ASSERT_OK_AND_ASSIGN(auto d, client_->CreateSession("d", OneParameterSpec({16, 16})));
  EXPECT_FALSE(d->attached());
  EXPECT_THAT(client_->CreateSession("e", OneParameterSpec({16, 16})),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max-total-bytes"));
}

TEST_F(LimitsTest, QuotaSuffixesAreAccepted) {
  Start({"--max-session-bytes", "4KiB", "--max-total-bytes", "1MiB"});
  EXPECT_OK(client_->CreateSession("fits", OneParameterSpec({16, 16}, v1::OPTIMIZER_ADAMW)));
  EXPECT_THAT(client_->CreateSession("too-big", OneParameterSpec({16, 17}, v1::OPTIMIZER_ADAMW)),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max-session-bytes 4096"));
}

TEST_F(LimitsTest, RankAndElementLimitsNameTheSpecField) {
  Start({"--max-tensor-rank", "3", "--max-tensor-elements", "1000"});
  EXPECT_THAT(client_->CreateSession("rank4", OneParameterSpec({2, 2, 2, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].shape: rank 4 exceeds the limit of 3"));
  EXPECT_THAT(client_->CreateSession("rank4", OneParameterSpec({2, 2, 2, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument, "--max-tensor-rank"));
  EXPECT_THAT(client_->CreateSession("large", OneParameterSpec({40, 40})),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].shape: more than 1000 elements"));
  EXPECT_THAT(client_->CreateSession("large", OneParameterSpec({40, 40})),
              StatusIs(absl::StatusCode::kInvalidArgument, "--max-tensor-elements"));
  EXPECT_OK(client_->CreateSession("rank3", OneParameterSpec({10, 10, 10})));
  EXPECT_THAT(SessionIds(), ::testing::ElementsAre("rank3"));
}

// Sessions whose summaries together pass the daemon's message limit (--max-chunk-bytes 1024 makes
// it 1 MiB + 1 KiB; each session here carries about 5 KiB of labels) are listed in pages.
TEST_F(LimitsTest, SessionsAreListedInPagesUnderTheMessageLimit) {
  constexpr int kSessions = 240;
  Start({"--max-chunk-bytes", "1024", "--max-sessions", std::to_string(kSessions)});
  v1::SessionSpec spec = OneParameterSpec({2, 2});
  for (int i = 0; i < 16; ++i) {
    (*spec.mutable_labels())[absl::StrCat("label-", i, std::string(50, 'k'))] = std::string(256, 'v');
  }
  std::vector<std::string> created;
  for (int i = 0; i < kSessions; ++i) {
    created.push_back(absl::StrFormat("listed-%03d", i));
    ASSERT_OK(client_->CreateSession(created.back(), spec));
  }
  ASSERT_GT(kSessions * spec.ByteSizeLong(), size_t{1} << 20) << "the sessions would fit in one answer";

  // The client asks page after page: every session once, in id order.
  EXPECT_EQ(SessionIds(), created);

  // One call answers the first page, under the limit, with a token for the rest.
  v1::ListSessionsResponse first;
  {
    const grpc::Status status = ListPage(v1::ListSessionsRequest(), &first);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_GT(first.sessions_size(), 0);
  EXPECT_LT(first.sessions_size(), kSessions);
  EXPECT_LE(first.ByteSizeLong(), size_t{1} << 20);
  EXPECT_EQ(first.next_page_token(), first.sessions(first.sessions_size() - 1).session_id());

  // page_size bounds a page; the pages cover every session once, the last one without a token.
  std::vector<std::string> paged;
  v1::ListSessionsRequest request;
  request.set_page_size(7);
  int pages = 0;
  do {
    v1::ListSessionsResponse page;
    const grpc::Status status = ListPage(request, &page);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LE(page.sessions_size(), 7);
    for (const auto& summary : page.sessions()) paged.push_back(summary.session_id());
    request.set_page_token(page.next_page_token());
    ASSERT_LT(++pages, kSessions) << "the pages do not end";
  } while (!request.page_token().empty());
  EXPECT_EQ(paged, created);
  EXPECT_EQ(pages, (kSessions + 6) / 7);

  // A session closed between two pages is simply not listed; the others stay.
  ASSERT_OK(client_->CloseSession(created[10]));
  request.set_page_size(10);
  request.set_page_token(created[5]);
  v1::ListSessionsResponse after;
  { ASSERT_TRUE(ListPage(request, &after).ok()); }
  ASSERT_EQ(after.sessions_size(), 10);
  EXPECT_EQ(after.sessions(0).session_id(), created[6]);
  EXPECT_EQ(after.sessions(4).session_id(), created[11]);

  request.set_page_size(-1);
  EXPECT_THAT(RefusalOf(request), HasSubstr("page_size"));
}

// A page also stays under the caller's own receive limit (max_answer_bytes), and a session whose
// spec alone would not fit in any page is listed without it, saying so, rather than failing every
// listing from there on.
TEST_F(LimitsTest, APageStaysUnderTheCallersLimitAndLeavesOutASpecNoPageHolds) {
  Start({});
  ASSERT_OK(client_->CreateSession("a-small", OneParameterSpec({2, 2})));
  ASSERT_OK(client_->CreateSession("c-small", OneParameterSpec({2, 2})));
  v1::SessionSpec big = OneParameterSpec({2, 2});
  for (int i = 1; i < 2000; ++i) {
    v1::ParameterSpec* p = big.add_parameters();
    p->set_name(absl::StrFormat("p%04d%s", i, std::string(60, 'x')));
    p->add_shape(2);
    p->add_shape(2);
    p->set_group("g");
  }
  ASSERT_GT(big.ByteSizeLong(), size_t{160 - 64} << 10) << "a page under a 160 KiB limit would hold the spec";
  ASSERT_OK(client_->CreateSession("b-big", big));

  v1::ListSessionsRequest request;
  request.set_max_answer_bytes(160 << 10);
  std::vector<v1::SessionSummary> listed;
  do {
    v1::ListSessionsResponse page;
    const grpc::Status status = ListPage(request, &page);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LE(page.ByteSizeLong(), size_t{160} << 10);
    ASSERT_GT(page.sessions_size(), 0);
    listed.insert(listed.end(), page.sessions().begin(), page.sessions().end());
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty());
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[1].session_id(), "b-big");
  EXPECT_TRUE(listed[1].spec_omitted());
  EXPECT_EQ(listed[1].spec().parameters_size(), 0);
  EXPECT_EQ(listed[1].num_tensors(), 2000) << "the rest of the summary is there";
  for (const size_t i : {size_t{0}, size_t{2}}) {
    EXPECT_FALSE(listed[i].spec_omitted()) << listed[i].session_id();
    EXPECT_EQ(listed[i].spec().parameters_size(), 1) << listed[i].session_id();
  }
  // The client's own limit (64 MiB) holds the whole spec.
  ASSERT_OK_AND_ASSIGN(const std::vector<v1::SessionSummary> all, client_->ListSessions());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_FALSE(all[1].spec_omitted());
  EXPECT_EQ(all[1].spec().parameters_size(), 2000);

  request.set_page_token("");
  request.set_max_answer_bytes(-1);
  EXPECT_THAT(RefusalOf(request), HasSubstr("max_answer_bytes"));
}

TEST_F(LimitsTest, SilentUploadStreamEndsWithDeadlineExceeded) {
  Start({"--rpc-timeout", "1"});
  ASSERT_OK(client_->CreateSession("slow", OneParameterSpec({8, 4})));
  grpc::ClientContext context;
  client_->PrepareContext(context);  // the client's own deadline is minutes away
  v1::UploadParametersResponse response;
  auto writer = client_->stub().UploadParameters(&context, &response);
  v1::UploadParametersRequest request;
  request.set_session_id("slow");
  ASSERT_TRUE(writer->Write(request));
  // Then nothing: the daemon must not wait for the rest forever. Finish would half-close the stream,
  // so the test waits for the daemon to cancel the call first (it logs that).
  ASSERT_TRUE(daemon_.WaitForLog("exceeded --rpc-timeout", 1, std::chrono::seconds(60)))
      << "the daemon did not end the silent upload";
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--rpc-timeout"));

  // The daemon is fine, and the session is untouched.
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("slow", OneParameterSpec({8, 4})));
  EXPECT_FALSE(session->initialized());
  const std::vector<float> w(32, 0.5f);
  EXPECT_OK(session->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}}));
}

TEST_F(LimitsTest, SilentStepStreamEndsWithDeadlineExceeded) {
  Start({"--rpc-timeout", "1"});
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("slow-step", OneParameterSpec({8, 4})));
  const std::vector<float> w(32, 0.5f);
  ASSERT_OK(session->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}}));
  grpc::ClientContext context;
  client_->PrepareContext(context);
  auto stream = client_->stub().Step(&context);
  v1::StepRequest request;
  request.mutable_header()->set_session_id("slow-step");
  request.mutable_header()->set_step(1);
  request.mutable_header()->set_num_chunks(1);
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(daemon_.WaitForLog("exceeded --rpc-timeout", 1, std::chrono::seconds(60)))
      << "the daemon did not end the silent step";
  v1::StepResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--rpc-timeout"));
  // Step 1 was never applied, so it is still the one expected.
  const std::vector<float> grad(32, 1.0f);
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, std::vector<client::TensorView>{{"w", {8, 4}, grad}}));
  EXPECT_TRUE(reply.applied);
  EXPECT_FALSE(reply.replayed);
}

}  // namespace
}  // namespace muond::testing
