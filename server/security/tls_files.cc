#include "server/security/tls_files.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace muond::security {
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

absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files) {
  TlsMaterial material;
  if (!files.enabled()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)");
    }
    return material;
  }
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together: give both or neither");
  }
  absl::StatusOr<std::string> cert = ReadPem(files.cert, "--tls-cert", "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(files.key, "--tls-key", "PRIVATE KEY");
  if (!key.ok()) return key.status();
  material.enabled = true;
  material.cert_chain = *std::move(cert);
  material.private_key = *std::move(key);
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> roots = ReadPem(files.client_ca, "--tls-client-ca", "CERTIFICATE");
    if (!roots.ok()) return roots.status();
    material.client_roots = *std::move(roots);
  }
  return material;
}

bool IsLocalListenAddress(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const size_t colon = listen.rfind(':');
  std::string host = absl::AsciiStrToLower(colon == std::string::npos ? listen : listen.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

std::vector<std::string> ExposureWarnings(const std::string& listen, bool tls, bool client_certificates, bool tokens) {
  std::vector<std::string> lines;
  if (IsLocalListenAddress(listen)) return lines;
  if (!tokens && !client_certificates) {
    lines.push_back(
        absl::StrCat("!!! SECURITY: muond listens on ", listen, ", a non-loopback address, WITHOUT AUTHENTICATION."));
    lines.push_back("!!! Anyone who can reach this port can create, read, overwrite and close optimizer sessions.");
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

std::vector<std::string> MetricsExposureWarnings(const std::string& metrics_listen, bool authenticated) {
  if (metrics_listen.empty() || !authenticated || IsLocalListenAddress(metrics_listen)) return {};
  return {absl::StrCat("!!! SECURITY: /metrics on ", metrics_listen,
                       " has no authentication: anyone who can reach it reads every client's session ids, group "
                       "names and step figures, which the gRPC port keeps to their owners."),
          "!!! Bind --metrics-listen to 127.0.0.1, or to a network only the scraper reaches (docs/operations.md)."};
}

}  // namespace muond::security
