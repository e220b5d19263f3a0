// Machine-readable reasons on absl::Status: the few refusals a client acts on carry one, set where
// the error is created (WithReason) and read at the one status conversion point (rpc/grpc_status.cc),
// which sends it as a google.rpc.ErrorInfo in the gRPC status details. The reason travels as an absl
// payload, so it survives MUOND_RETURN_IF_ERROR and any rewording of the message.
//
// The names are those of muond.v1.ErrorReason (proto/muond/v1/error_details.proto); a test keeps the two
// lists equal. docs/protocol.md, Error reasons, says when each is sent and what a client does.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace muond {

enum class ErrorReason {
  kRegionNotFound,   // a step names shared-memory or CUDA memory the caller has not registered
  kChannelNotFound,  // a step names an NCCL channel the caller has not opened
  kStepNotPrepared,  // a sharded commit whose step this shard does not hold prepared
  kSessionNotFound,  // no session has the id
  kPushTooStale,     // an asynchronous push more than max_staleness global steps behind
  kChunkTooLarge,    // a chunk or packed message larger than the daemon's --max-chunk-bytes
  kCallerBusy,       // the caller has --max-calls-per-caller calls in flight already
};

// Every reason, for tests that walk them all.
inline constexpr ErrorReason kAllErrorReasons[] = {ErrorReason::kRegionNotFound,  ErrorReason::kChannelNotFound,
                                                   ErrorReason::kStepNotPrepared, ErrorReason::kSessionNotFound,
                                                   ErrorReason::kPushTooStale,    ErrorReason::kChunkTooLarge,
                                                   ErrorReason::kCallerBusy};

// The wire name, e.g. "REGION_NOT_FOUND".
absl::string_view ReasonName(ErrorReason reason);

// `status` with `reason` attached (an OK status is returned as it is).
absl::Status WithReason(absl::Status status, ErrorReason reason);

// The wire name of the reason attached to `status`; empty when it has none.
std::string ReasonOf(const absl::Status& status);

}  // namespace muond
