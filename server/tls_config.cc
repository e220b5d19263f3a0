#include "server/tls_config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace muond::server {
namespace {

// Reads a PEM file given to `flag`, checking that it holds a block whose label contains `label`.
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag, absl::string_view label) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (!absl::StrContains(pem, "-----BEGIN") || !absl::StrContains(pem, label)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' holds no PEM ", absl::AsciiStrToLower(label), " block"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files) {
  if (!files.enabled()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together: give both or neither");
  }
  absl::StatusOr<std::string> cert = ReadPem(files.cert, "--tls-cert", "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(files.key, "--tls-key", "PRIVATE KEY");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> roots = ReadPem(files.client_ca, "--tls-client-ca", "CERTIFICATE");
    if (!roots.ok()) return roots.status();
    options.pem_root_certs = *std::move(roots);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    options.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return grpc::SslServerCredentials(options);
}

bool IsLocalListenAddress(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const size_t colon = listen.rfind(':');
  std::string host = absl::AsciiStrToLower(colon == std::string::npos ? listen : listen.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

std::vector<std::string> ExposureWarnings(const std::string& listen, bool tls, bool client_certificates,
                                          bool tokens) {
  std::vector<std::string> lines;
  if (IsLocalListenAddress(listen)) return lines;
  if (!tokens && !client_certificates) {
    lines.push_back(absl::StrCat("!!! SECURITY: muond listens on ", listen,
                                 ", a non-loopback address, WITHOUT AUTHENTICATION."));
    lines.push_back(
        "!!! Anyone who can reach this port can create, read, overwrite and close optimizer sessions.");
    lines.push_back(
        "!!! Add --auth-token-file FILE (bearer tokens) and --tls-cert/--tls-key (TLS), or listen on 127.0.0.1.");
  }
  if (tokens && !tls) {
    lines.push_back(absl::StrCat("!!! SECURITY: muond listens on ", listen,
                                 " without TLS: bearer tokens cross the network in plain text. "
                                 "Add --tls-cert and --tls-key."));
  }
  return lines;
}

}  // namespace muond::server
