#include "tests/integration/test_pki.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <vector>

namespace muond::testing {
namespace {

// One config for every certificate: the extensions decide what each one may do.
constexpr char kConfig[] = R"([req]
distinguished_name = dn
prompt = no
[dn]
CN = muond test
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = CA:FALSE
subjectAltName = DNS:localhost,IP:127.0.0.1
extendedKeyUsage = serverAuth
[client_ext]
basicConstraints = CA:FALSE
extendedKeyUsage = clientAuth
[two_names_ext]
basicConstraints = CA:FALSE
extendedKeyUsage = clientAuth
subjectAltName = DNS:alice.test,DNS:bob.test
[two_names_reversed_ext]
basicConstraints = CA:FALSE
extendedKeyUsage = clientAuth
subjectAltName = DNS:bob.test,DNS:alice.test
[comma_name_ext]
basicConstraints = CA:FALSE
extendedKeyUsage = clientAuth
subjectAltName = @comma_name
[comma_name]
DNS.1 = alice.test,bob.test
)";

std::string Quote(const std::string& s) { return "'" + s + "'"; }

}  // namespace

bool OpensslAvailable() { return std::system("openssl version >/dev/null 2>&1") == 0; }

bool MakeTestPki(const std::string& dir, TestPki* pki, std::string* error) {
  const std::string config = dir + "/pki.cnf";
  const std::string log = dir + "/openssl.log";
  {
    std::ofstream out(config);
    out << kConfig;
    if (!out.good()) {
      *error = "cannot write " + config;
      return false;
    }
  }
  const std::string key_options = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const auto path = [&](const std::string& name) { return dir + "/" + name; };
  // A self-signed CA, then a certificate signed by it (via a signing request).
  const auto make_ca = [&](const std::string& name, const std::string& subject) {
    return "openssl req -x509 -config " + Quote(config) + " -extensions ca_ext" + key_options + " -keyout " +
           Quote(path(name + ".key")) + " -out " + Quote(path(name + ".pem")) + " -days 2 -subj " + Quote(subject);
  };
  const auto make_leaf = [&](const std::string& name, const std::string& ca, const std::string& extensions,
                             const std::string& subject, int serial) {
    return "openssl req -new -config " + Quote(config) + key_options + " -keyout " + Quote(path(name + ".key")) +
           " -out " + Quote(path(name + ".csr")) + " -subj " + Quote(subject) + " && openssl x509 -req -in " +
           Quote(path(name + ".csr")) + " -CA " + Quote(path(ca + ".pem")) + " -CAkey " + Quote(path(ca + ".key")) +
           " -set_serial " + std::to_string(serial) + " -out " + Quote(path(name + ".pem")) + " -days 2 -extfile " +
           Quote(config) + " -extensions " + extensions;
  };
  const std::vector<std::string> commands = {
      make_ca("ca", "/CN=muond test CA"),
      make_leaf("server", "ca", "server_ext", "/CN=localhost", 2),
      make_leaf("client", "ca", "client_ext", "/CN=muond test client", 3),
      make_leaf("second-client", "ca", "client_ext", "/CN=muond second client", 5),
      make_leaf("two-names", "ca", "two_names_ext", "/CN=muond two names", 6),
      make_leaf("two-names-reversed", "ca", "two_names_reversed_ext", "/CN=muond two names reversed", 7),
      make_leaf("comma-name", "ca", "comma_name_ext", "/CN=muond comma name", 8),
      make_ca("rogue-ca", "/CN=untrusted test CA"),
      make_leaf("rogue-client", "rogue-ca", "client_ext", "/CN=untrusted client", 4),
  };
  for (const std::string& command : commands) {
    if (std::system(("(" + command + ") >>" + Quote(log) + " 2>&1").c_str()) != 0) {
      std::ifstream in(log);
      *error = "openssl failed: " + command + "\n" +
               std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      return false;
    }
  }
  pki->ca_cert = path("ca.pem");
  pki->server_cert = path("server.pem");
  pki->server_key = path("server.key");
  pki->client_cert = path("client.pem");
  pki->client_key = path("client.key");
  pki->second_client_cert = path("second-client.pem");
  pki->second_client_key = path("second-client.key");
  for (const char* name : {"two-names", "two-names-reversed", "comma-name"}) {
    pki->named_clients[name] = {path(std::string(name) + ".pem"), path(std::string(name) + ".key")};
  }
  pki->rogue_client_cert = path("rogue-client.pem");
  pki->rogue_client_key = path("rogue-client.key");
  return true;
}

}  // namespace muond::testing
