// ToGrpcStatus, the one status conversion: the code and message as they are, and a reason set where
// an error is created (common/error_reason.h) carried as google.rpc.ErrorInfo in the status details.
#include "server/rpc/grpc_status.h"

#include <string>

#include "common/error_reason.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.pb.h"
#include "server/transport/region_table.h"

namespace muond::rpc {
namespace {

// The ErrorInfo reason in `status`'s details; empty when there is none.
std::string ReasonIn(const grpc::Status& status) {
  v1::RpcStatus details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) return "";
  EXPECT_EQ(details.code(), status.error_code());
  EXPECT_EQ(details.message(), status.error_message());
  for (const v1::AnyDetail& any : details.details()) {
    v1::ErrorInfo info;
    if (any.type_url() == kErrorInfoTypeUrl && info.ParseFromString(any.value())) {
      EXPECT_EQ(info.domain(), "muond.v1");
      return info.reason();
    }
  }
  return "";
}

TEST(GrpcStatusTest, EveryReasonIsAnErrorReasonOfTheApi) {
  int named = 0;
  for (ErrorReason reason : kAllErrorReasons) {
    v1::ErrorReason parsed;
    EXPECT_TRUE(v1::ErrorReason_Parse(std::string(ReasonName(reason)), &parsed)) << ReasonName(reason);
    ++named;
  }
  // And every reason of the API is one the daemon can set.
  EXPECT_EQ(named, v1::ErrorReason_MAX);
}

TEST(GrpcStatusTest, AReasonTravelsInTheDetailsWhateverTheMessage) {
  for (ErrorReason reason : kAllErrorReasons) {
    for (const char* message : {"a message", "quite another wording"}) {
      const grpc::Status status = ToGrpcStatus(WithReason(absl::NotFoundError(message), reason));
      EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
      EXPECT_EQ(status.error_message(), message);
      EXPECT_EQ(ReasonIn(status), ReasonName(reason));
    }
  }
}

TEST(GrpcStatusTest, AStatusWithoutAReasonHasNoDetails) {
  const grpc::Status status = ToGrpcStatus(absl::NotFoundError("gradients[0].region: no region 'r'"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(status.error_details().empty());
  EXPECT_TRUE(ToGrpcStatus(WithReason(absl::OkStatus(), ErrorReason::kRegionNotFound)).ok());
}

TEST(GrpcStatusTest, RegionTablesAnswerAMissingEntryWithTheirReason) {
  transport::RegionTable<int> regions("shared-memory region", ErrorReason::kRegionNotFound);
  transport::RegionTable<int> channels("NCCL channel", ErrorReason::kChannelNotFound);
  const transport::BoundSession session{"s", 2};
  EXPECT_EQ(ReasonIn(ToGrpcStatus(regions.Find("caller", "r", nullptr, "gradients[0].region", "").status())),
            "REGION_NOT_FOUND");
  EXPECT_EQ(ReasonIn(ToGrpcStatus(channels.Find("caller", "c", &session, "channel", "").status())),
            "CHANNEL_NOT_FOUND");
  // One of another session of the same id (closed and created again) is as good as missing.
  ASSERT_TRUE(channels.Insert({"caller", {"s", 1}, 0}, "earlier", std::make_shared<int>(1)));
  EXPECT_EQ(ReasonIn(ToGrpcStatus(channels.Find("caller", "earlier", &session, "channel", "").status())),
            "CHANNEL_NOT_FOUND");
  // A lookup refused for another reason carries none.
  ASSERT_TRUE(channels.Insert({"caller", {"other-session", 1}, 0}, "c", std::make_shared<int>(1)));
  EXPECT_EQ(ReasonIn(ToGrpcStatus(channels.Find("caller", "c", &session, "channel", "").status())), "");
}

}  // namespace
}  // namespace muond::rpc
