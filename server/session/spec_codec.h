// SpecCodec: how the session layer reads the session specs it is given, without knowing the API
// they come from. A spec travels through this layer as JSON text in the API's own form (stored in
// checkpoints as is); the codec parses and validates it into a SessionConfig and compares two of
// them. The rpc layer implements it for muond.v1 (server/rpc/session_spec_codec.h).
//
// Implementations are immutable and thread-safe; the registry borrows one for its lifetime.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/session/session_config.h"

namespace muond::session {

class SpecCodec {
 public:
  virtual ~SpecCodec() = default;

  // Validates `spec_json` and fills defaults; INVALID_ARGUMENT naming the field (for example
  // "spec.parameters[2].shape: dimension 1 is 0"). The result's spec_json is `spec_json`.
  virtual absl::StatusOr<SessionConfig> Parse(absl::string_view spec_json, const SpecLimits& limits) const = 0;

  // OK when the two specs are the same; otherwise ALREADY_EXISTS naming the first difference.
  virtual absl::Status CheckSame(absl::string_view existing_json, absl::string_view requested_json) const = 0;
};

}  // namespace muond::session
