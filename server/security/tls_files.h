// Transport security of the daemon's listener: the PEM material read from --tls-cert, --tls-key and
// --tls-client-ca (mutual TLS), checked before anything listens, and the warnings printed when the
// daemon is reachable from other hosts without authentication. The rpc layer turns the material into
// gRPC credentials (server/rpc/server_credentials.h). Pure functions over files and flags; thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muond::security {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server (--tls-cert)
  std::string key;        // PEM private key of the server (--tls-key)
  std::string client_ca;  // PEM roots that client certificates must chain to (--tls-client-ca)

  bool enabled() const { return !cert.empty() || !key.empty(); }
};

// The PEM texts of the files; `enabled` false (and the texts empty) when no TLS file is given.
struct TlsMaterial {
  bool enabled = false;
  std::string cert_chain;
  std::string private_key;
  std::string client_roots;  // non-empty: mutual TLS, client certificates required and verified
};

// Reads and checks the files. INVALID_ARGUMENT naming the flag when the flags do not go together or
// a file cannot be read or holds no PEM block of the expected kind.
absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files);

// Whether `listen` (host:port as given to --listen, or unix:path) only accepts local connections.
bool IsLocalListenAddress(const std::string& listen);

// The lines to log as warnings for this configuration (empty when there is nothing to warn about):
// a non-local listener without any authentication, or bearer tokens sent over plaintext.
std::vector<std::string> ExposureWarnings(const std::string& listen, bool tls, bool client_certificates, bool tokens);

// The lines to log for --metrics-listen `metrics_listen` (empty: none, or nothing to warn about): a
// non-local metrics port beside an authenticated gRPC one, whose /metrics (no authentication) shows
// every client's session ids and group names to anyone who reaches it.
std::vector<std::string> MetricsExposureWarnings(const std::string& metrics_listen, bool authenticated);

}  // namespace muond::security
