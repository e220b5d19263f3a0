// The step transports a client can use and how "auto" picks one, written once: a TransportKind
// says why its transport cannot serve a daemon (or that it can) and opens it for a session. "auto"
// is the first viable kind in kHostTransports' order (shared memory before gRPC); a named kind
// that is not viable is FAILED_PRECONDITION naming `transport` and the reason. CUDA IPC moves
// device memory, so it is not among the host kinds; CudaIpcStepper checks its kind the same way.
//
// Stateless; safe from any thread.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "client/transport/step_transport.h"

namespace muond::client {

struct TransportKind {
  const char* name;
  // Why this transport cannot serve steps with the daemon `info` describes, from here; empty when
  // it can. Null: always viable (nothing to ask the daemon).
  std::string (*unviable)(const v1::ServerInfo& info) = nullptr;
  // Opens the transport for `session` of `client` (host kinds only; null for CUDA IPC).
  std::unique_ptr<StepTransport> (*open)(Client& client, const Session& session) = nullptr;
};

// The host-memory kinds, in the order "auto" tries them.
std::span<const TransportKind> HostTransports();

// OK when `wanted` is "auto" or the name of a host kind; INVALID_ARGUMENT naming `transport` else.
absl::Status CheckTransportName(std::string_view wanted);

// The kind `wanted` ("auto" or a name) gives; `server_info` is asked at most once, only when a kind
// needs it.
absl::StatusOr<const TransportKind*> ChooseTransport(std::string_view wanted,
                                                     absl::FunctionRef<absl::StatusOr<v1::ServerInfo>()> server_info);

// Why `kind` cannot serve the daemon `info` describes: FAILED_PRECONDITION naming `transport`, or OK.
absl::Status CheckViable(const TransportKind& kind, const v1::ServerInfo& info);

// Empty when the daemon `info` describes runs on this host, else the reason.
std::string NotOnThisHost(const v1::ServerInfo& info);

}  // namespace muond::client
