// Explaining what protobuf refused: the first string field that is not UTF-8 is named by its path
// (nested messages, repeated elements by index, map fields without one), exactly where protobuf's own
// parse fails and nowhere it succeeds (valid multi-byte text, unknown fields, bytes fields);
// malformed encodings are named as such, and a hostile nesting is skipped without recursing past
// protobuf's own limit.
#include "proto/wire/unparsable_message.h"

#include <string>

#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.pb.h"
#include "tests/testing/status_matchers.h"

namespace muond::wire {
namespace {

using ::muond::testing::StatusIs;

constexpr char kPlaceholder[] = "Zq";  // held once by a test message, then spoiled

// `message` serialized, its one placeholder replaced by two bytes that are not UTF-8.
std::string Spoiled(const google::protobuf::Message& message) {
  std::string bytes = message.SerializeAsString();
  const size_t at = bytes.find(kPlaceholder);
  EXPECT_NE(at, std::string::npos);
  EXPECT_EQ(bytes.find(kPlaceholder, at + 1), std::string::npos);
  bytes.replace(at, 2, "\xff\xfe");
  return bytes;
}

// Whether protobuf itself parses `bytes` as a `Message` (its complaint silenced).
template <class Message>
bool ProtobufParses(const std::string& bytes) {
  google::protobuf::LogSilencer quiet;
  Message message;
  return message.ParseFromString(bytes);
}

TEST(UnparsableMessageTest, TheFirstStringThatIsNotUtf8IsNamedByItsPath) {
  v1::CreateSessionRequest create;
  create.set_session_id("run");
  v1::SessionSpec& spec = *create.mutable_spec();
  spec.add_groups()->set_name("g0");
  for (const char* name : {"w", "v", "uZq"}) {
    v1::ParameterSpec& p = *spec.add_parameters();
    p.set_name(name);
    p.set_group("g0");
  }
  std::string bytes = Spoiled(create);
  EXPECT_FALSE(ProtobufParses<v1::CreateSessionRequest>(bytes));
  EXPECT_EQ(FirstNonUtf8Field(*v1::CreateSessionRequest::descriptor(), bytes), "spec.parameters[2].name");
  EXPECT_THAT(ExplainUnparsable(*v1::CreateSessionRequest::descriptor(), bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[2].name: is not UTF-8"));

  // A map's key (its entries have no order to index by).
  spec.mutable_parameters(2)->set_name("u");
  (*spec.mutable_labels())["Zq"] = "x";
  bytes = Spoiled(create);
  EXPECT_FALSE(ProtobufParses<v1::CreateSessionRequest>(bytes));
  EXPECT_EQ(FirstNonUtf8Field(*v1::CreateSessionRequest::descriptor(), bytes), "spec.labels.key");

  // A field of a oneof member, the way the step stream's header comes.
  v1::StepRequest step;
  step.mutable_header()->set_session_id("runZq");
  bytes = Spoiled(step);
  EXPECT_FALSE(ProtobufParses<v1::StepRequest>(bytes));
  EXPECT_EQ(FirstNonUtf8Field(*v1::StepRequest::descriptor(), bytes), "header.session_id");
  EXPECT_THAT(ExplainUnparsable(*v1::StepRequest::descriptor(), bytes, "header"),
              StatusIs(absl::StatusCode::kInvalidArgument, "nothing of the header was used"));
}

TEST(UnparsableMessageTest, WhatProtobufAcceptsIsNotNamed) {
  v1::StepRequest step;
  step.mutable_chunk()->set_name("poids \xc3\xa9t\xc3\xa9 \xe2\x9c\x93");  // UTF-8 of several lengths
  step.mutable_chunk()->set_data("\xff\xfe\x00\x80", 4);                   // bytes, not text
  std::string bytes = step.SerializeAsString();
  // An unknown field (number 1000, length-delimited) whose bytes are not UTF-8: protobuf keeps it
  // as it is, unchecked.
  bytes += std::string("\xc2\x3e\x02\xff\xfe", 5);
  EXPECT_TRUE(ProtobufParses<v1::StepRequest>(bytes));
  EXPECT_EQ(FirstNonUtf8Field(*v1::StepRequest::descriptor(), bytes), "");
}

TEST(UnparsableMessageTest, MalformedEncodingsAreNamedAsSuch) {
  const std::string cases[] = {
      std::string("\x0a\x05"
                  "ab",
                  4),              // a length past the end
      std::string("\x0a", 1),      // a tag without its value
      std::string("\x00\x01", 2),  // field number 0
      std::string("\x0f\x01", 2),  // wire type 7
  };
  for (const std::string& bytes : cases) {
    EXPECT_FALSE(ProtobufParses<v1::CreateSessionRequest>(bytes));
    EXPECT_EQ(FirstNonUtf8Field(*v1::CreateSessionRequest::descriptor(), bytes), "");
    EXPECT_THAT(ExplainUnparsable(*v1::CreateSessionRequest::descriptor(), bytes, "request"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         "request: not a valid muond.v1.CreateSessionRequest (its protobuf encoding is malformed)"));
  }
}

TEST(UnparsableMessageTest, AHostileNestingIsNotFollowedPastProtobufsLimit) {
  // The API's messages do not hold themselves, so a deep nesting can only come as unknown fields:
  // 200 000 groups of field 1000 opened one inside the other. Skipping them recurses, within the
  // coded stream's own limit, as protobuf's parse does.
  std::string bytes;
  for (int i = 0; i < 200000; ++i) bytes += "\xc3\x3e";  // field 1000, start of a group
  EXPECT_FALSE(ProtobufParses<v1::CreateSessionRequest>(bytes));
  EXPECT_EQ(FirstNonUtf8Field(*v1::CreateSessionRequest::descriptor(), bytes), "");
}

}  // namespace
}  // namespace muond::wire
