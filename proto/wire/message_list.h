// A list of messages on a gRPC byte buffer: the encoding of `repeated <Message> messages = 1`, which
// StepMessages (StepWhole's request) and StepAnswers (its answer) are. The daemon and the C++ client
// both split one into its messages and join messages into one, without parsing the messages
// themselves: each keeps the bytes a Step stream would carry, chunk payloads included.
//
// Split makes at most one copy of the list (none when it arrived in one slice); every message it
// returns is a view of that one slice. Join references the messages' slices and copies nothing but
// each message's tag and length. Free functions, no state: safe from any thread.
#pragma once

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"

namespace muond::wire {

// The field number of `messages` in StepMessages and StepAnswers.
inline constexpr int kMessageListField = 1;

// The messages of the encoding of a `list_type` (such as "StepMessages"), in order. INVALID_ARGUMENT
// naming `<field>[i]` for the first entry that is not field 1 of length-delimited type, or whose
// length runs past the end.
absl::StatusOr<std::vector<grpc::ByteBuffer>> SplitMessageList(const grpc::ByteBuffer& list,
                                                               absl::string_view list_type, absl::string_view field);

// The encoding of a list holding `messages`, in order.
grpc::ByteBuffer JoinMessageList(std::span<const grpc::ByteBuffer> messages);

}  // namespace muond::wire
