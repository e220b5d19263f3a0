// Transport security of the daemon's listener: the server credentials built from --tls-cert,
// --tls-key and --tls-client-ca (mutual TLS), and the warnings printed when the daemon is reachable
// from other hosts without authentication. Pure functions over file contents and flags; thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace muond::server {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server (--tls-cert)
  std::string key;        // PEM private key of the server (--tls-key)
  std::string client_ca;  // PEM roots that client certificates must chain to (--tls-client-ca)

  bool enabled() const { return !cert.empty() || !key.empty(); }
};

// Insecure credentials when no TLS file is given; TLS credentials otherwise, requiring and
// verifying a client certificate when client_ca is set. INVALID_ARGUMENT naming the flag when the
// flags do not go together or a file cannot be read or holds no PEM block of the expected kind.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files);

// Whether `listen` (host:port as given to --listen, or unix:path) only accepts local connections.
bool IsLocalListenAddress(const std::string& listen);

// The lines to log as warnings for this configuration (empty when there is nothing to warn about):
// a non-local listener without any authentication, or bearer tokens sent over plaintext.
std::vector<std::string> ExposureWarnings(const std::string& listen, bool tls, bool client_certificates,
                                          bool tokens);

}  // namespace muond::server
