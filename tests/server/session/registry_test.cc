// SessionRegistry in process: create-or-attach, a conflicting spec, ownership, --max-sessions and
// closing (a closed session held by a call refuses to change and still counts against the memory
// quota).
#include <atomic>
#include <chrono>
#include <future>
#include <new>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "tests/kernels/forwarding_backend.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using namespace ::muond::session::session_testing;

class RegistryTest : public ::testing::Test {
 protected:
  std::unique_ptr<kernels::Backend> backend_ = kernels::NewCpuBackend(1);
  rpc::ProtoSpecCodec codec_;
  SessionRegistry registry_{backend_.get(), &codec_, SpecLimits{}, /*max_sessions=*/2};
};

TEST_F(RegistryTest, AnIdenticalSpecAttachesAndADifferentOneNamesTheDifference) {
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_.CreateOrAttach("a", rpc::SpecToJson(SmallSpec()), "alice"));
  EXPECT_FALSE(created.attached);
  ASSERT_OK_AND_ASSIGN(CreateResult attached, registry_.CreateOrAttach("a", rpc::SpecToJson(SmallSpec()), "alice"));
  EXPECT_TRUE(attached.attached);
  EXPECT_EQ(attached.session, created.session);
  v1::SessionSpec other = SmallSpec();
  other.mutable_parameters(0)->set_shape(0, 9);
  EXPECT_THAT(registry_.CreateOrAttach("a", rpc::SpecToJson(other), "alice"),
              StatusIs(absl::StatusCode::kAlreadyExists, "parameters[0].shape"));
}

// A create whose answer was lost is sent again with its token: answered as the create it was, while
// another request (another token, or none) attaches; the token goes with the session's close.
TEST_F(RegistryTest, ARetriedCreateIsAnsweredAsCreatedByItsToken) {
  const std::string spec = rpc::SpecToJson(SmallSpec());
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_.CreateOrAttach("a", spec, "alice", "token-1"));
  EXPECT_FALSE(created.attached);
  ASSERT_OK_AND_ASSIGN(CreateResult retried, registry_.CreateOrAttach("a", spec, "alice", "token-1"));
  EXPECT_FALSE(retried.attached);
  EXPECT_EQ(retried.session, created.session);
  ASSERT_OK_AND_ASSIGN(CreateResult other, registry_.CreateOrAttach("a", spec, "alice", "token-2"));
  EXPECT_TRUE(other.attached);
  ASSERT_OK_AND_ASSIGN(CreateResult untokened, registry_.CreateOrAttach("a", spec, "alice"));
  EXPECT_TRUE(untokened.attached);
  // The token of a session closed since is not that of the session made again under its id.
  ASSERT_OK(registry_.Close("a", "alice").status());
  ASSERT_OK_AND_ASSIGN(CreateResult again, registry_.CreateOrAttach("a", spec, "alice", "token-3"));
  EXPECT_FALSE(again.attached);
  ASSERT_OK_AND_ASSIGN(CreateResult old_token, registry_.CreateOrAttach("a", spec, "alice", "token-1"));
  EXPECT_TRUE(old_token.attached);
  // A different spec is refused whatever the token.
  v1::SessionSpec different = SmallSpec();
  different.mutable_parameters(0)->set_shape(0, 9);
  EXPECT_THAT(registry_.CreateOrAttach("a", rpc::SpecToJson(different), "alice", "token-3"),
              StatusIs(absl::StatusCode::kAlreadyExists, "parameters[0].shape"));
  EXPECT_THAT(registry_.CreateOrAttach("b", spec, "alice", std::string(65, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument, "create_token: at most 64 bytes, got 65"));
}

TEST_F(RegistryTest, SessionsBelongToTheirCreator) {
  ASSERT_OK(registry_.CreateOrAttach("a", rpc::SpecToJson(SmallSpec()), "alice").status());
  EXPECT_THAT(registry_.Find("a", "bob"), StatusIs(absl::StatusCode::kPermissionDenied, "session 'a'"));
  EXPECT_THAT(registry_.CreateOrAttach("a", rpc::SpecToJson(SmallSpec()), "bob"),
              StatusIs(absl::StatusCode::kPermissionDenied, "session 'a'"));
  EXPECT_THAT(registry_.Close("a", "bob"), StatusIs(absl::StatusCode::kPermissionDenied, "session 'a'"));
  EXPECT_TRUE(registry_.ListOwnedBy("bob").empty());
  EXPECT_EQ(registry_.ListOwnedBy("alice").size(), 1u);
  ASSERT_OK(registry_.Find("a", "alice").status());
}

TEST_F(RegistryTest, LimitsAndClosing) {
  EXPECT_THAT(registry_.CreateOrAttach("bad id!", rpc::SpecToJson(SmallSpec())),
              StatusIs(absl::StatusCode::kInvalidArgument, "session_id"));
  v1::SessionSpec invalid = SmallSpec();
  invalid.mutable_parameters(1)->set_group("nope");
  EXPECT_THAT(registry_.CreateOrAttach("x", rpc::SpecToJson(invalid)),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[1].group"));
  ASSERT_OK(registry_.CreateOrAttach("a", rpc::SpecToJson(SmallSpec())).status());
  ASSERT_OK(registry_.CreateOrAttach("b", rpc::SpecToJson(SmallSpec())).status());
  EXPECT_THAT(registry_.CreateOrAttach("c", rpc::SpecToJson(SmallSpec())),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max-sessions 2"));
  ASSERT_OK(registry_.Close("a"));
  EXPECT_THAT(registry_.Find("a"), StatusIs(absl::StatusCode::kNotFound, "no session 'a'"));
  ASSERT_OK(registry_.CreateOrAttach("c", rpc::SpecToJson(SmallSpec())).status());
  EXPECT_EQ(registry_.size(), 2u);
}

// Ranks creating the same session at once (each parses the spec without the registry's lock): one
// creates it, the others wait for it and attach to that one.
TEST_F(RegistryTest, CallsCreatingTheSameSessionAtOnceGetOneSession) {
  constexpr int kCalls = 8;
  std::vector<absl::StatusOr<CreateResult>> results(kCalls, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] { results[i] = registry_.CreateOrAttach("same", rpc::SpecToJson(SmallSpec())); });
  }
  for (std::thread& thread : threads) thread.join();
  int created = 0;
  for (const absl::StatusOr<CreateResult>& result : results) {
    ASSERT_OK(result.status());
    created += result->attached ? 0 : 1;
    EXPECT_EQ(result->session, results[0]->session);
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(registry_.size(), 1u);
}

// A call that looked a session up before it was closed still holds it: whatever it tries next that
// would change the session is refused as NOT_FOUND, and the memory it keeps alive counts against
// --max-total-bytes until the call lets it go.
TEST_F(RegistryTest, AClosedSessionHeldByACallChangesNoMoreAndCountsUntilReleased) {
  ASSERT_OK_AND_ASSIGN(SessionConfig config, codec_.Parse(rpc::SpecToJson(SmallSpec()), SpecLimits{}));
  const int64_t one = EstimateSessionBytes(config);
  SessionRegistry registry(backend_.get(), &codec_, SpecLimits{}, /*max_sessions=*/4,
                           MemoryLimits{.max_total_bytes = one + one / 2});
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry.CreateOrAttach("a", rpc::SpecToJson(SmallSpec())));
  std::shared_ptr<Session> held = created.session;  // as a call in flight holds it
  created.session.reset();
  ASSERT_OK(held->Upload(InitialParameters()));
  ASSERT_OK(RunStep(*held, Request(1), Gradients(1)).status());
  ASSERT_OK(registry.Close("a"));

  const auto closed = [](absl::Status status) {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, "session 'a' was closed"));
  };
  closed(RunStep(*held, Request(2), Gradients(2)).status());
  closed(RunStep(*held, Request(1), Gradients(1)).status());  // a replay of the step applied
  closed(held->Upload(InitialParameters()));
  ASSERT_OK_AND_ASSIGN(SessionState state, held->ExportState());  // reading it is harmless
  closed(held->ImportState(state));
  closed(held->Checkpoint().status());
  EXPECT_EQ(held->last_step(), 1);

  EXPECT_THAT(registry.CreateOrAttach("b", rpc::SpecToJson(SmallSpec())),
              StatusIs(absl::StatusCode::kResourceExhausted, "b"));
  held.reset();
  ASSERT_OK(registry.CreateOrAttach("b", rpc::SpecToJson(SmallSpec())).status());
}

// A backend whose next allocation throws, as std::bad_alloc can from deep inside a session's
// creation.
class ThrowOnceBackend final : public ::muond::testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> Allocate(size_t count) override {
    if (throw_next.exchange(false)) throw std::bad_alloc();
    return ForwardingBackend::Allocate(count);
  }
  std::atomic<bool> throw_next{false};
};

// A creation that throws leaves nothing behind: the id is free again (a later call for it would
// otherwise wait for a creation that never ends) and the place it took counts no more.
TEST_F(RegistryTest, ACreationThatThrowsLeavesItsIdAndItsPlaceFree) {
  ThrowOnceBackend backend(*backend_);
  SessionRegistry registry(&backend, &codec_, SpecLimits{}, /*max_sessions=*/1);
  backend.throw_next = true;
  EXPECT_THROW(registry.CreateOrAttach("a", rpc::SpecToJson(SmallSpec())).IgnoreError(), std::bad_alloc);
  EXPECT_EQ(registry.size(), 0u);
  // In a thread: a regression shows as a wait, which the test reports rather than hangs on.
  auto again =
      std::async(std::launch::async, [&] { return registry.CreateOrAttach("a", rpc::SpecToJson(SmallSpec())); });
  ASSERT_EQ(again.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "the id stayed marked as created";
  ASSERT_OK_AND_ASSIGN(CreateResult created, again.get());
  EXPECT_FALSE(created.attached);
  EXPECT_EQ(registry.size(), 1u);
}

}  // namespace
}  // namespace muond::session
