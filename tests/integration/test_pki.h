// A throwaway public-key infrastructure for the security tests: a CA, a server certificate for
// localhost / 127.0.0.1 and client certificates signed by it (two with different common names, and
// three whose subject alternative names test how a certificate names its caller), plus a second,
// untrusted CA with a client certificate of its own. Made with the `openssl` command-line tool (scripts/setup.sh
// installs it) into a folder the caller owns. Test-only; not thread-safe.
#pragma once

#include <map>
#include <string>
#include <utility>

namespace muond::testing {

struct TestPki {
  std::string ca_cert;
  std::string server_cert;
  std::string server_key;
  std::string client_cert;
  std::string client_key;
  std::string second_client_cert;  // another trusted client, with a different name
  std::string second_client_key;
  // {certificate, key} by name: "two-names" (DNS:alice.test, DNS:bob.test), "two-names-reversed"
  // (the same names the other way round) and "comma-name" (the one name "alice.test,bob.test").
  std::map<std::string, std::pair<std::string, std::string>> named_clients;
  std::string rogue_client_cert;  // signed by a CA the daemon does not trust
  std::string rogue_client_key;
};

// Whether the openssl tool can be run (tests skip, saying so, when it cannot).
bool OpensslAvailable();

// Writes the PEM files into `dir` (which must exist). Returns false with *error holding openssl's
// output when a command fails.
bool MakeTestPki(const std::string& dir, TestPki* pki, std::string* error);

}  // namespace muond::testing
