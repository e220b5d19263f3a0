// SealedMemfd and SharedMapping: a memfd region a client passed to the daemon, first as a checked
// but unmapped descriptor, then (once an authenticated call claims it) mapped read-write.
//
// Only memory that cannot shrink under the daemon is accepted: the file must carry F_SEAL_SHRINK
// (memfd_create with MFD_ALLOW_SEALING, then fcntl(F_ADD_SEALS)), so that a client truncating its
// file can never make the daemon's next access fault (SIGBUS). Files that cannot be sealed (plain
// files, sockets, pipes) are refused, as are empty ones and ones larger than the given limit.
//
// A SealedMemfd owns one descriptor and maps nothing: what an unauthenticated peer passes costs the
// daemon a descriptor, never address space. SharedMapping owns the mapping alone (the descriptor is
// closed once mapped; the mapping keeps the memory), so a registered region costs no descriptor.
// Regions are held by shared_ptr, so a step in flight keeps its regions mapped after they are
// unregistered. A mapping carries the gate its steps' answers pass (answer_gate.h: a call the client
// gave up writes nothing). Thread-safety: both are immutable after construction but for that gate,
// which is thread-safe; the bytes themselves are shared with the client, which may write them at any
// time — readers copy what they need once and check the copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/transport/answer_gate.h"

namespace muond::transport {

class SharedMapping;

class SealedMemfd {
 public:
  // Takes ownership of `fd` (closed on failure too). INVALID_ARGUMENT when it is not a memfd sealed
  // against shrinking of 1 to `max_bytes` bytes.
  static absl::StatusOr<SealedMemfd> Check(int fd, uint64_t max_bytes);
  ~SealedMemfd();
  SealedMemfd(SealedMemfd&& other) noexcept : fd_(other.fd_), size_(other.size_) { other.fd_ = -1; }
  SealedMemfd& operator=(SealedMemfd&& other) noexcept;
  SealedMemfd(const SealedMemfd&) = delete;
  SealedMemfd& operator=(const SealedMemfd&) = delete;

  uint64_t size() const { return size_; }
  // Maps the memfd read-write and closes the descriptor; RESOURCE_EXHAUSTED when it cannot be mapped
  // (no address space left), INVALID_ARGUMENT when the file refuses a writable mapping.
  absl::StatusOr<std::shared_ptr<SharedMapping>> Map() &&;

 private:
  SealedMemfd(int fd, uint64_t size) : fd_(fd), size_(size) {}

  int fd_;
  uint64_t size_;
};

class SharedMapping {
 public:
  // Checks and maps `fd` at once (SealedMemfd::Check, then Map); takes ownership of `fd`.
  static absl::StatusOr<std::shared_ptr<SharedMapping>> Map(int fd, uint64_t max_bytes);
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  AnswerGate& answers() const { return answers_; }

 private:
  friend class SealedMemfd;
  SharedMapping(char* data, uint64_t size) : data_(data), size_(size) {}

  char* const data_;
  const uint64_t size_;
  mutable AnswerGate answers_;
};

// Whether [offset, offset + bytes) lies within `size` bytes, without overflow.
inline bool WithinRegion(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

}  // namespace muond::transport
