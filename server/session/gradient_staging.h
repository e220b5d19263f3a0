// Where a step's gradients go on their way into the optimizer: backend buffers they are copied into
// while the step's stream is still being read, so that on a GPU the host→device copies overlap the
// network instead of following it.
//
// GradientSet: one fp32 backend buffer per parameter of a session (all allocated before a stream
// fills the set, then kept), holding one step's gradients. GradientPool: a session's spare set. A
// session starts with one full set, which is what its memory estimate counts. Only one stream at a
// time stages into it: a step that streams while another holds the set keeps its gradients on the
// host and has them copied when it is applied (under the session's lock, into a transient set), so
// a client opening many streams at once cannot make the daemon allocate a set for each.
// StagedGradients: a step stream's set plus the backend transfer that fills it.
// HostGradients: a session's spare host tensors that a step stream decodes its gradients into, kept
// across steps so that a steady run allocates (and page-faults) nothing per step. On a backend whose
// memory is the host's these are the session's gradient buffers: the optimizer reads them in place
// and no GradientSet is allocated at all.
//
// Ownership: the pool owns idle sets; a GradientLease owns its set and gives it back to the pool when
// destroyed; the pool (and the session holding it) must outlive its leases. A StagedGradients owns
// its lease and its transfer, and waits for the transfer's copies before giving the set back.
// Thread-safety: GradientPool and HostGradients are thread-safe; sets, leases and StagedGradients are used by one
// thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/host_tensor.h"
#include "kernels/backend.h"

namespace muond::session {

class GradientSet {
 public:
  explicit GradientSet(size_t num_parameters) : buffers_(num_parameters) {}
  // Parameter `index`'s buffer (null until allocated).
  std::unique_ptr<kernels::DeviceBuffer>& buffer(size_t index) { return buffers_[index]; }
  // How many parameters have a buffer.
  size_t allocated() const;

 private:
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> buffers_;
};

class GradientPool;

// A set taken from a pool; given back when the lease is destroyed.
class GradientLease {
 public:
  GradientLease() = default;
  GradientLease(GradientPool* pool, std::unique_ptr<GradientSet> set) : pool_(pool), set_(std::move(set)) {}
  GradientLease(GradientLease&&) = default;
  GradientLease& operator=(GradientLease&& other) noexcept;
  ~GradientLease();

  GradientSet& set() { return *set_; }
  explicit operator bool() const { return set_ != nullptr; }

 private:
  GradientPool* pool_ = nullptr;
  std::unique_ptr<GradientSet> set_;
};

class GradientPool {
 public:
  // `numel[i]`: the element count of parameter i.
  GradientPool(kernels::Backend* backend, std::vector<int64_t> numel);

  // Allocates the set in full (so a new session holds its gradient memory from the start); nothing
  // is staged before.
  absl::Status Preallocate();
  // The spare set, or a new empty one.
  GradientLease Acquire();
  // The spare set, or an empty lease when another holds it.
  GradientLease TryAcquire();
  // Parameter `index`'s buffer in `set`, allocated when it is not yet.
  absl::StatusOr<kernels::DeviceBuffer*> Buffer(GradientSet& set, size_t index);
  // Allocates every buffer `set` lacks.
  absl::Status AllocateAll(GradientSet& set);

 private:
  friend class GradientLease;
  void GiveBack(std::unique_ptr<GradientSet> set);

  kernels::Backend* const backend_;
  const std::vector<int64_t> numel_;
  absl::Mutex mu_;
  std::unique_ptr<GradientSet> spare_ ABSL_GUARDED_BY(mu_);
};

// A step stream's gradients, copied into a leased set as the chunks are decoded.
class StagedGradients {
 public:
  // Null when another stream is staging into the pool's set.
  static absl::StatusOr<std::unique_ptr<StagedGradients>> Start(GradientPool* pool, kernels::Backend* backend);

  // Starts copying `count` decoded values of parameter `index`, beginning at element `offset`.
  absl::Status Add(size_t index, int64_t offset, const float* values, size_t count);
  // Waits until every value added has landed in the set.
  absl::Status Finish();
  // The set; valid until this is destroyed.
  GradientLease& lease() { return lease_; }

 private:
  StagedGradients(GradientLease lease, std::unique_ptr<kernels::HostToDevice> upload)
      : lease_(std::move(lease)), upload_(std::move(upload)) {}

  GradientLease lease_;                            // every buffer allocated (Start)
  std::unique_ptr<kernels::HostToDevice> upload_;  // destroyed (its copies waited for) before lease_
};

// A session's one spare set of host gradient tensors (indexed like the parameters), lent to one step
// at a time.
class HostGradients {
 public:
  explicit HostGradients(std::vector<int64_t> numel) : numel_(std::move(numel)) {}

  // Allocates (and touches) every tensor, so that the session holds this memory from the start.
  void Preallocate();
  // The spare tensors, reset (no values received) but keeping their memory; empty tensors when
  // another step holds them.
  std::vector<HostTensor> Take();
  // Gives tensors taken back (any tensors of the right count; the fuller spare is kept).
  void GiveBack(std::vector<HostTensor> tensors);

 private:
  static size_t AllocatedCount(const std::vector<HostTensor>& tensors);

  const std::vector<int64_t> numel_;
  absl::Mutex mu_;
  std::vector<HostTensor> spare_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::session
