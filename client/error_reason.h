// The daemon's refusals as absl::Status, with their machine-readable reason. The daemon sends the
// reason of a refusal a client acts on in the gRPC status details (google.rpc.Status holding a
// google.rpc.ErrorInfo of domain "muond.v1"; docs/protocol.md, Error reasons); FromGrpcStatus keeps
// it on the absl::Status as a payload, and ReasonOf reads it back. The client decides on the
// reason, never on the message text, so rewording a message changes nothing a client does.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "muond/v1/muond.pb.h"

namespace muond::client {

// grpc::Status → absl::Status, keeping the code, the daemon's message and its reason.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The reason the daemon gave `status`; ERROR_REASON_UNSPECIFIED when it gave none (an older daemon,
// or a refusal no client acts on) or for a reason this client does not know.
v1::ErrorReason ReasonOf(const absl::Status& status);

// `status` with the reason of `from`, for a client that rewrites a refusal's code or message.
absl::Status WithReasonOf(const absl::Status& from, absl::Status status);

// The last try's failure, saying how many tries were made (with its code and reason), for a call
// retried until it gave up; `status` itself after one try.
absl::Status AfterTries(const absl::Status& status, int tries);

// A refusal that ended a retried call on a later try, saying so and what the tries before met (say,
// NOT_FOUND after UNAVAILABLE: the daemon restarted without the session); `status` itself when it
// is OK or came on the first try. Its code and reason are kept.
absl::Status OnLaterTry(const absl::Status& status, int tries, const absl::Status& before);

}  // namespace muond::client
