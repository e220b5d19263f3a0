// SharedMapping: a memfd region a client passed to the daemon, mapped read-write into the daemon.
//
// Only memory that cannot shrink under the daemon is accepted: the file must carry F_SEAL_SHRINK
// (memfd_create with MFD_ALLOW_SEALING, then fcntl(F_ADD_SEALS)), so that a client truncating its
// file can never make the daemon's next access fault (SIGBUS). Files that cannot be sealed (plain
// files, sockets, pipes) are refused, as are empty ones and ones larger than the given limit.
//
// Ownership: the mapping owns the descriptor and the mapping; both go when it is destroyed (regions
// are held by shared_ptr, so a step in flight keeps its regions mapped after they are unregistered).
// Thread-safety: immutable after Map; the bytes themselves are shared with the client, which may
// write them at any time — readers copy what they need once and check the copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace muond::transport {

class SharedMapping {
 public:
  // Takes ownership of `fd` (closed on failure too).
  static absl::StatusOr<std::shared_ptr<SharedMapping>> Map(int fd, uint64_t max_bytes);
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  SharedMapping(int fd, char* data, uint64_t size) : fd_(fd), data_(data), size_(size) {}

  const int fd_;
  char* const data_;
  const uint64_t size_;
};

// Whether [offset, offset + bytes) lies within `size` bytes, without overflow.
inline bool WithinRegion(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

}  // namespace muond::transport
