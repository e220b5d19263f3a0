#include "server/session/parameter_reader.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/session/session.h"

namespace muond::session {

ParameterReader::ParameterReader(std::unique_ptr<Registration> registration) : registration_(std::move(registration)) {}

ParameterReader::ParameterReader(ParameterReader&& other) noexcept = default;

ParameterReader& ParameterReader::operator=(ParameterReader&& other) noexcept {
  if (this != &other) {
    Close();
    registration_ = std::move(other.registration_);
  }
  return *this;
}

ParameterReader::~ParameterReader() { Close(); }

const std::shared_ptr<const ParameterSnapshot>& ParameterReader::snapshot() const {
  static const std::shared_ptr<const ParameterSnapshot> kNone;
  return registration_ == nullptr ? kNone : registration_->snapshot;
}

std::span<const float> ParameterReader::Values(size_t index) const {
  const Registration& r = *registration_;
  if (r.copied && r.copies[index].has_value()) return *r.copies[index];
  return r.snapshot->values[index];
}

void ParameterReader::Finished(size_t index) {
  if (registration_ != nullptr && registration_->snapshot->views) registration_->finished[index] = true;
}

// The masters' lock is taken and released across calls (its holder is this reader), which the
// static analysis cannot follow.
absl::Status ParameterReader::Hold() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Registration* r = registration_.get();
  if (r == nullptr || r->held || r->own_copy || !r->snapshot->views) return absl::OkStatus();
  const Session& session = *r->session;
  session.masters_mu_.ReaderLock();
  if (r->replaced) {
    session.masters_mu_.ReaderUnlock();
    return absl::UnavailableError(
        absl::StrCat("session '", session.id(), "': the parameters after step ", r->snapshot->step,
                     " were replaced (by a later step, an upload or SetState) while this answer was being sent, and "
                     "the answers then in flight held as many copies as the session keeps (its parameters' size); "
                     "read them again"));
  }
  if (r->copied) {
    // Written once, before `copied` was set: the copies stay as they are, and writers skip this reader.
    r->own_copy = true;
    session.masters_mu_.ReaderUnlock();
    return absl::OkStatus();
  }
  r->held = true;
  return absl::OkStatus();
}

void ParameterReader::Release() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Registration* r = registration_.get();
  if (r == nullptr || !r->held) return;
  r->held = false;
  r->session->masters_mu_.ReaderUnlock();
}

void ParameterReader::Close() {
  if (registration_ == nullptr) return;
  Release();
  if (registration_->snapshot->views) {
    const Session& session = *registration_->session;
    absl::MutexLock lock(&session.readers_mu_);
    session.readers_.erase(registration_.get());
    session.answer_copy_bytes_ -= static_cast<int64_t>(registration_->copy_bytes);
  }
  registration_.reset();
}

}  // namespace muond::session
