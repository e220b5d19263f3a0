// The muond.v1 session spec, read for the session layer: ParseSessionSpec validates a
// v1::SessionSpec and fills defaults into a SessionConfig; ProtoSpecCodec is the session layer's
// SpecCodec for it, over the spec's JSON form (protobuf's JSON mapping, proto field names), which is
// what the registry compares and checkpoints store. A group's options are ParseGroupOptions'
// (group_options_codec.h).
//
// Errors are INVALID_ARGUMENT naming the field, for example "spec.parameters[2].shape: dimension 1
// is 0" or "spec.groups[0].options.ns_steps must be >= 1". Stateless; thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "kernels/optim/options.h"
#include "muond/v1/muond.pb.h"
#include "server/rpc/group_options_codec.h"
#include "server/session/session_config.h"
#include "server/session/spec_codec.h"

namespace muond::rpc {

absl::StatusOr<session::SessionConfig> ParseSessionSpec(const v1::SessionSpec& spec, const session::SpecLimits& limits);

// OK when `requested` equals `existing`; otherwise ALREADY_EXISTS naming the first difference.
absl::Status CheckSameSpec(const v1::SessionSpec& existing, const v1::SessionSpec& requested);

// The spec's JSON form, as the session layer carries it.
std::string SpecToJson(const v1::SessionSpec& spec);
// And back; INVALID_ARGUMENT naming `spec` when it does not parse.
absl::StatusOr<v1::SessionSpec> SpecFromJson(absl::string_view json);

class ProtoSpecCodec final : public session::SpecCodec {
 public:
  absl::StatusOr<session::SessionConfig> Parse(absl::string_view spec_json,
                                               const session::SpecLimits& limits) const override;
  absl::Status CheckSame(absl::string_view existing_json, absl::string_view requested_json) const override;
};

}  // namespace muond::rpc
