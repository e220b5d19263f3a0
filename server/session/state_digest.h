// The state digest: one SHA-256 over a session's whole state in a canonical order and framing, the
// way to prove that a resumed session continued the same model (docs/operations.md). The live daemon
// (GetStateDigest) and `muondctl state digest` (a state directory restored offline) both compute it
// here, so the same state gives the same digest wherever it is held.
//
// The format "muond-state-v1" (integers little-endian; a string is its u64 byte length, then its
// bytes):
//   string "muond-state-v1", i64 last step,
//   u8 1 and the loss scaler's f64 scale, i64 growth tracker, i64 hysteresis tracker (u8 0 without one),
//   u64 number of parameters, then for each parameter in spec order:
//     string name, i64 step count, u64 number of tensors, then for each tensor — the master first,
//     then the optimizer slots in byte order of their names:
//       string parameter name, string slot, string dtype ("fp32" | "bf16" | "fp16"),
//       u64 rank, i64 each dimension, u64 byte length, the elements as stored (little-endian).
// Not hashed: the session's id, owner and spec options (what the state is used with, not what it is),
// and delivery records (asynchronous push records, a prepared sharded step).
//
// Plain functions; DigestSession reads the session under its own lock (Session::ExportState).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/session/session.h"
#include "server/session/session_config.h"
#include "server/session/session_persistence.h"

namespace muond::session {

inline constexpr char kStateDigestFormat[] = "muond-state-v1";
inline constexpr char kStateDigestAlgorithm[] = "sha256";

struct StateDigest {
  int64_t step = 0;  // the last applied step of the state
  std::string hex;   // SHA-256, 64 lowercase hex digits
  int64_t num_tensors = 0;
  int64_t num_bytes = 0;  // the stored bytes of every tensor
};

// The shape of tensor `slot` of parameter `parameter` (Session::TensorShape).
using TensorShapeFn = std::function<std::vector<int64_t>(size_t parameter, std::string_view slot)>;

// The digest of `state`, a state of a session with `config` (as Session::ExportState gives it: every
// parameter's master and slots, widened exactly from their stored dtypes).
StateDigest DigestState(const SessionConfig& config, const SessionState& state, const TensorShapeFn& shape_of);

// The digest of `session`'s current state; FAILED_PRECONDITION before its parameters are uploaded.
absl::StatusOr<StateDigest> DigestSession(const Session& session);

}  // namespace muond::session
