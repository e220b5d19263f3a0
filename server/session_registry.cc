#include "server/session_registry.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/logging.h"

namespace muond::server {

absl::Status CheckSessionId(const std::string& id, absl::string_view field) {
  const bool valid = !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": '", id.substr(0, 140), "' is not a session id (1 to 128 of [A-Za-z0-9._-])"));
}

absl::StatusOr<CreateResult> SessionRegistry::CreateOrAttach(const std::string& id, const v1::SessionSpec& spec) {
  MUOND_RETURN_IF_ERROR(CheckSessionId(id));
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(id); it != sessions_.end()) {
    absl::Status same = CheckSameSpec(it->second->spec(), spec);
    if (!same.ok()) return absl::AlreadyExistsError(absl::StrCat("session_id '", id, "': ", same.message()));
    MUOND_LOG(info, "session {} attached at step {}", id, it->second->last_step());
    return CreateResult{it->second, true};
  }
  if (static_cast<int>(sessions_.size()) >= max_sessions_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session_id '", id, "': the daemon already holds ", sessions_.size(),
                     " sessions (--max-sessions ", max_sessions_, "); close one first"));
  }
  MUOND_ASSIGN_OR_RETURN(SessionConfig config, ParseSessionSpec(spec, limits_));
  const int64_t elements = config.total_elements;
  const size_t tensors = config.parameters.size();
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, Session::Create(id, spec, std::move(config), backend_));
  std::shared_ptr<Session> shared = std::move(session);
  sessions_.emplace(id, shared);
  MUOND_LOG(info, "session {} created: {} tensors, {} parameters, {} groups", id, tensors, elements,
            spec.groups_size());
  return CreateResult{std::move(shared), false};
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session_id: no session '", id.substr(0, 140), "'"));
  }
  return it->second;
}

absl::Status SessionRegistry::Close(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session_id: no session '", id.substr(0, 140), "'"));
  }
  MUOND_LOG(info, "session {} closed at step {}", id, it->second->last_step());
  sessions_.erase(it);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, session] : sessions_) out.push_back(session);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return out;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

}  // namespace muond::server
