#include "server/security/caller_identity.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::security {
namespace {

std::string Identity(const std::vector<std::string>& names) {
  CallCredentials credentials;
  credentials.peer_verified = true;
  credentials.peer_names = names;
  return *IdentifyCaller(credentials, nullptr);
}

// A certificate with one plain name keeps the identity it always had.
TEST(CertificateIdentityTest, ASingleNameIsItself) {
  EXPECT_EQ(Identity({"alice"}), "x509:alice");
  EXPECT_EQ(Identity({"spiffe://example.org/ns/train/sa/worker"}), "x509:spiffe://example.org/ns/train/sa/worker");
}

// A certificate reissued with its names in another order is the same caller.
TEST(CertificateIdentityTest, TheOrderOfTheNamesDoesNotMatter) {
  EXPECT_EQ(Identity({"bob", "alice"}), Identity({"alice", "bob"}));
  EXPECT_EQ(Identity({"bob", "alice"}), "x509:alice,bob");
}

// Names holding the separator cannot pose as another set of names.
TEST(CertificateIdentityTest, NamesWithCommasOrBackslashesAreNoOtherSetOfNames) {
  EXPECT_EQ(Identity({"alice,bob"}), "x509:alice\\,bob");
  EXPECT_NE(Identity({"alice,bob"}), Identity({"alice", "bob"}));
  EXPECT_NE(Identity({"alice\\", "bob"}), Identity({"alice\\,bob"}));
  EXPECT_NE(Identity({"a\\,b"}), Identity({"a,b"}));
  EXPECT_NE(Identity({"a", "b,c"}), Identity({"a,b", "c"}));
  EXPECT_NE(Identity({"alice"}), Identity({"alice", "alice"}));
}

// A certificate the transport did not verify names nobody.
TEST(CertificateIdentityTest, AnUnverifiedCertificateNamesNobody) {
  CallCredentials unverified;
  unverified.peer_names = {"alice"};
  EXPECT_EQ(*IdentifyCaller(unverified, nullptr), "");
}

}  // namespace
}  // namespace muond::security
