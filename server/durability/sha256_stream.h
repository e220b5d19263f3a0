// Sha256Stream: SHA-256 over bytes fed in pieces (OpenSSL's EVP digest), for contents too large to
// gather into one buffer first, such as a session's whole state (server/session/state_digest.h).
// One stream per digest; not thread-safe; movable, not copyable.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"

namespace muond::durability {

class Sha256Stream {
 public:
  Sha256Stream();
  ~Sha256Stream();
  Sha256Stream(Sha256Stream&&) noexcept;
  Sha256Stream& operator=(Sha256Stream&&) noexcept;

  void Update(const void* data, size_t size);
  void Update(absl::string_view bytes) { Update(bytes.data(), bytes.size()); }
  // The digest of everything fed so far, as 64 lowercase hex digits; the stream is spent afterwards.
  std::string FinishHex();

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

}  // namespace muond::durability
