// Checkpoints of a session in its folder of the state directory:
//   checkpoint-<step>.safetensors  every master and optimizer slot as F32 tensors named
//                                  "<parameter>/<slot>" (slot: master, momentum, exp_avg, ...)
//   checkpoint.json                the spec, step counters, backend, and the SHA-256 of the tensors
//                                  file and of itself
// checkpoint.json is written last and atomically, so it is the commit point: a crash at any moment
// leaves either the previous checkpoint or the new one, never a mix. Reading verifies both digests
// and refuses, naming the file, anything truncated or altered.
//
// Stateless functions; callers serialize writes to one folder.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/session.h"
#include "server/session_config.h"

namespace muond::server {

struct CheckpointContents {
  std::string session_id;
  std::string owner;  // the identity that created the session; empty without authentication
  v1::SessionSpec spec;
  SessionState state;  // StateTensor::parameter indexes the spec's parameters
};

absl::Status WriteCheckpoint(const std::string& dir, const CheckpointContents& contents, const SessionConfig& config,
                             const std::string& backend_name);

// `config` must be parsed from the checkpoint's own spec (ParseSessionSpec) by the caller after
// ReadCheckpointMetadata; ReadCheckpoint does both.
absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& dir, const SpecLimits& limits);

}  // namespace muond::server
