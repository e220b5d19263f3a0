// ParameterReader: one answer's read of a ParameterSnapshot while the answer is sent. A snapshot of
// host copies is read freely. A snapshot of views (the masters themselves, on a backend whose memory
// is the host's) is read only while the reader is held — the masters' reader lock, which a writer of
// the masters waits for. A reader that waits on its peer between chunks (a gRPC stream to a client
// that may read slowly, or stop) releases in the meantime; a writer that changes the masters then
// first leaves every released reader of the current masters a copy of the parameters it has not
// finished, and the reader goes on from the copy (without the lock from then on). So a slow reader
// never holds up the session's steps, and its answer is still the step it names. The copies of a
// session's readers take at most its parameters' fp32 bytes at once (Session::ChangeMastersLocked,
// smallest first); a reader left none is replaced: it reads nothing more, and its answer ends
// UNAVAILABLE (a client tries again, and reads the parameters then current).
//
// Made, held, by Session::OpenParameters. Owned by one thread at a time; it must not outlive its
// session. While held, call nothing else of the session (the session's own lock comes first).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "server/session/step_types.h"

namespace muond::session {

class Session;

class ParameterReader {
 public:
  ParameterReader() = default;  // reads nothing
  ParameterReader(ParameterReader&&) noexcept;
  ParameterReader& operator=(ParameterReader&&) noexcept;
  ParameterReader(const ParameterReader&) = delete;
  ParameterReader& operator=(const ParameterReader&) = delete;
  ~ParameterReader();

  const std::shared_ptr<const ParameterSnapshot>& snapshot() const;
  // Parameter `index`'s values as of the snapshot: valid while held (always, for a snapshot of
  // copies), until Finished(index).
  std::span<const float> Values(size_t index) const;
  // Parameter `index` will not be read again: a writer need not copy it. Call while held.
  void Finished(size_t index);
  // Calls read(values) with `count` values of parameter `index` from `offset`, held only meanwhile
  // (given released, released after); the piece that ends the parameter marks it Finished. The
  // reader's refusal (Hold) when it was replaced, and then read is not called.
  template <typename Read>
  absl::Status ReadPiece(size_t index, size_t offset, size_t count, Read&& read) {
    if (absl::Status held = Hold(); !held.ok()) return held;
    const std::span<const float> values = Values(index);
    read(values.subspan(offset, count));
    if (offset + count == values.size()) Finished(index);
    Release();
    return absl::OkStatus();
  }
  // Takes the masters' reader lock again (a no-op for copies, when held, or once left a copy);
  // UNAVAILABLE when the reader was replaced. Release lets writers in.
  absl::Status Hold();
  void Release();

 private:
  friend class Session;
  // What the session's writers see of a reader: registered with the session while it lives.
  struct Registration {
    const Session* session = nullptr;
    std::shared_ptr<const ParameterSnapshot> snapshot;
    bool held = false;
    bool own_copy = false;  // seen `copied` while held: reads the copies without the lock from then on
    // Written by a writer (the masters' lock held exclusively), read while held: the parameters the
    // reader had not finished when the masters changed, indexed like the snapshot's values (and their
    // bytes, counted against the session's budget until the reader closes), or that none was left.
    bool copied = false;
    bool replaced = false;
    std::vector<std::optional<std::vector<float>>> copies;
    size_t copy_bytes = 0;
    std::vector<bool> finished;  // written by the reader while held
  };
  explicit ParameterReader(std::unique_ptr<Registration> registration);
  void Close();

  std::unique_ptr<Registration> registration_;
};

}  // namespace muond::session
