#include "server/security/caller_identity.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace muond::security {

std::string CertificateIdentity(std::vector<std::string> names) {
  for (std::string& name : names) name = absl::StrReplaceAll(name, {{"\\", "\\\\"}, {",", "\\,"}});
  std::sort(names.begin(), names.end());
  return absl::StrCat("x509:", absl::StrJoin(names, ","));
}

absl::StatusOr<std::string> IdentifyCaller(const CallCredentials& credentials, const TokenTable* tokens) {
  if (tokens != nullptr) {
    if (!credentials.authorization.has_value()) return tokens->Authenticate(std::nullopt);
    return tokens->Authenticate(absl::string_view(*credentials.authorization));
  }
  if (!credentials.peer_verified) return std::string();
  return CertificateIdentity(credentials.peer_names);
}

absl::Status CheckOwner(const std::string& owner, const std::string& caller, const std::string& session_id) {
  if (owner == caller) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("session_id: session '", session_id, "' belongs to another client; this token may not use it"));
}

}  // namespace muond::security
