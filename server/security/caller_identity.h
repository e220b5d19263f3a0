// Who is calling: the identity a call's credentials prove, and the one ownership rule of the daemon.
//
// With bearer tokens configured (TokenTable), a call's `authorization: Bearer <token>` metadata names
// the caller. Without tokens, a client certificate verified by mutual TLS names the caller
// (CertificateIdentity of its subject alternative names, or of its common name when it has none, as
// the transport reports them), so that clients with different certificates own their sessions apart;
// everyone else is "" (authentication is off). A session belongs to the identity that created it.
//
// The rpc layer extracts CallCredentials from its calls; nothing here knows gRPC. Pure functions;
// thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/security/token_table.h"

namespace muond::security {

// What the transport knows of a call's credentials.
struct CallCredentials {
  std::optional<std::string> authorization;  // the authorization metadata, when present
  bool peer_verified = false;                // a client certificate was verified (mutual TLS)
  std::vector<std::string> peer_names;       // that certificate's identities
};

// "x509:" and a certificate's names, sorted and joined by commas, each with its backslashes and
// commas escaped by a backslash: the same whatever order the certificate lists them in, and two lists
// of names never share one ("a,b" as one name is "x509:a\,b", as two "x509:a,b"). A single name
// without either character is itself ("x509:alice").
std::string CertificateIdentity(std::vector<std::string> names);

// The caller's identity; UNAUTHENTICATED when tokens are required and missing or wrong.
absl::StatusOr<std::string> IdentifyCaller(const CallCredentials& credentials, const TokenTable* tokens);

// OK when `caller` owns the session; PERMISSION_DENIED naming the session otherwise.
absl::Status CheckOwner(const std::string& owner, const std::string& caller, const std::string& session_id);

}  // namespace muond::security
