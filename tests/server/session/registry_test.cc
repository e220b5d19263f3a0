// SessionRegistry in process: create-or-attach, a conflicting spec, ownership, --max-sessions and
// closing.
#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
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

}  // namespace
}  // namespace muond::session
