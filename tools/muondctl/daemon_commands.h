// muondctl's commands that talk to a running daemon over its gRPC API, through libmuond_client with
// the same connection options as the clients (TLS, mutual TLS, bearer token). Each returns an Answer
// (ctl_output.h); none retries a refused call, and none changes a session except `sessions
// checkpoint` and `sessions close`.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/muond_client.h"
#include "tools/muondctl/ctl_output.h"

namespace muond::ctl {

struct ConnectFlags {
  std::string endpoint = "127.0.0.1:50051";
  double timeout_seconds = 10;  // to connect, and for each call
  bool use_tls = false;         // TLS with the system's roots (implied by any TLS file)
  std::string tls_ca_file;
  std::string tls_client_cert_file;
  std::string tls_client_key_file;
  std::string tls_server_name;  // verify the daemon's certificate against this name
  std::string auth_token_file;  // first non-comment line is the token; else $MUOND_AUTH_TOKEN
};

// A client of the daemon `flags` name, with their TLS and token, that never retries.
absl::StatusOr<std::unique_ptr<client::Client>> ConnectDaemon(const ConnectFlags& flags);

// grpc.health.v1: {"status": "SERVING" | "NOT_SERVING"}; exit 0 only when serving.
Answer Health(const ConnectFlags& flags);
// The daemon's version, backend, limits, transports and where its metrics are.
Answer Info(const ConnectFlags& flags);
// The sessions the caller may see (all of them without authentication).
Answer ListSessions(const ConnectFlags& flags);
// One session: its counters, memory estimate and spec (groups, parameters).
Answer ShowSession(const ConnectFlags& flags, const std::string& session_id);
// Writes a checkpoint now (the daemon needs --state-dir); answers the step it holds.
Answer CheckpointSession(const ConnectFlags& flags, const std::string& session_id);
// The digest of the session's whole state as it is now (GetStateDigest): its step and SHA-256.
Answer DigestSession(const ConnectFlags& flags, const std::string& session_id);
// Closes the session: its state is dropped and, with --state-dir, its folder deleted.
Answer CloseSession(const ConnectFlags& flags, const std::string& session_id);
// Reads the session's whole state (GetState) into a safetensors file at `to`: "<parameter>/<slot>"
// F32 tensors, as checkpoints hold them.
Answer ExportSession(const ConnectFlags& flags, const std::string& session_id, const std::string& to);

}  // namespace muond::ctl
