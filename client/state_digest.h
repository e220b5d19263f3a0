// The state digest in the C++ client: what GetStateDigest answers for one daemon's session, and the
// rule that combines a sharded session's shards into one digest (docs/sharding.md):
//
//   digest = SHA-256 of the text "muond-sharded-state-v1\n" followed, for each shard in placement
//            order, by "<shard's hex digest>\n"
//
// every shard at the same step (else FAILED_PRECONDITION), the counts summed; a session on one daemon
// keeps that daemon's digest. Plain values and a stateless function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"

namespace muond::client {

struct StateDigest {
  int64_t step = 0;                 // the last applied step the state belongs to
  std::string algorithm;            // "sha256"
  std::string digest;               // lowercase hex
  std::string format;               // "muond-state-v1"; "muond-sharded-state-v1" when combined
  int64_t num_tensors = 0;          // masters and slots hashed
  int64_t num_bytes = 0;            // their stored bytes
  std::vector<std::string> shards;  // a combined digest's parts, in shard order (empty otherwise)
};

inline constexpr char kShardedStateDigestFormat[] = "muond-sharded-state-v1";

StateDigest FromProto(const v1::StateDigest& digest);

// The sharded session's digest from its shards' (in placement order), per the rule above.
absl::StatusOr<StateDigest> CombineShardDigests(const std::vector<StateDigest>& shards);

}  // namespace muond::client
