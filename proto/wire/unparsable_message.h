// Why protobuf refused a message, in the API's terms. Protobuf's parser answers only "failed"; a
// daemon that must name the field of bad input walks the encoding again with the message's
// descriptor and finds what the parser stopped at: a string field whose bytes are not UTF-8 (the one
// check proto3 makes beyond the wire format), named by its path from the message ("header.session_id",
// "spec.parameters[2].name"), or an encoding that is malformed. Stateless; thread-safe.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"

namespace muond::wire {

// The path of the first string field in `bytes` (a message of `type`) whose value is not UTF-8;
// empty when there is none, or when the encoding is malformed before one is found.
std::string FirstNonUtf8Field(const google::protobuf::Descriptor& type, absl::string_view bytes);

// INVALID_ARGUMENT saying why `bytes` do not parse as a message of `type`: "<path>: is not UTF-8 ..."
// for a string field that is not, and otherwise "<what>: not a valid <type>'s protobuf encoding"
// (`what` names the message, e.g. "request" or "chunk").
absl::Status ExplainUnparsable(const google::protobuf::Descriptor& type, absl::string_view bytes,
                               absl::string_view what = "request");

}  // namespace muond::wire
