// StateDirLock: one daemon's exclusive hold on its --state-dir, so that a second daemon started on
// the same folder (a restart racing the old process's shutdown, two replicas mounting one volume)
// refuses to start instead of both restoring and writing the same sessions' files.
//
// An flock(2) on `<state-dir>/+lock`, taken without blocking and held until the object is destroyed
// or the process ends, however it ends (the kernel drops the lock with its last descriptor: a
// SIGKILLed daemon leaves nothing to clean up). The file holds the holder's pid, for the refusal's
// message; it is never removed. The lock is per open file, so two locks on one folder exclude each
// other within a process too.
//
// Ownership: owns the descriptor. Thread-safety: none needed; made and destroyed by one thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muond::durability {

inline constexpr char kStateDirLockFile[] = "+lock";

class StateDirLock {
 public:
  // Takes the lock of `state_dir` (which must exist). FAILED_PRECONDITION naming the folder and the
  // holder's pid when another holds it; FAILED_PRECONDITION when `+lock` is a symbolic link or not a
  // regular file; the Env's errno codes otherwise (env.h).
  static absl::StatusOr<std::unique_ptr<StateDirLock>> Acquire(const std::string& state_dir);

  ~StateDirLock();
  StateDirLock(const StateDirLock&) = delete;
  StateDirLock& operator=(const StateDirLock&) = delete;

 private:
  explicit StateDirLock(int fd) : fd_(fd) {}
  const int fd_;
};

}  // namespace muond::durability
