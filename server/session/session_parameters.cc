// Session: the parameters as answers read them — the snapshot a step leaves (host views or copies,
// or nothing read back after a GPU transport's step), reading it back on demand, and the locks that
// keep views valid while an answer is encoded. See session.h.
#include <algorithm>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/stored_tensor.h"
#include "server/session/partition.h"
#include "server/session/session.h"

namespace muond::session {

absl::StatusOr<std::shared_ptr<const ParameterSnapshot>> Session::ReadBack(int64_t step) const {
  auto snapshot = std::make_shared<ParameterSnapshot>();
  snapshot->step = step;
  snapshot->values.reserve(params_.size());
  if (backend_->HostAddressable()) {
    // The masters are host memory: answers read the fp32 ones where they are; 16-bit ones are
    // widened into copies.
    snapshot->views = true;
    snapshot->generation = masters_version_;
    snapshot->copies.reserve(params_.size());  // `values` point into them: no reallocation
    for (const optim::ParamState& state : params_) {
      if (state.master.is_fp32()) {
        snapshot->values.emplace_back(state.master.fp32(), static_cast<size_t>(state.numel));
        continue;
      }
      std::vector<float>& values = snapshot->copies.emplace_back(state.numel);
      MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, state.master, 0, state.numel, values.data()));
      snapshot->values.emplace_back(values);
    }
    return snapshot;
  }
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceToHost> download, backend_->NewDeviceToHost());
  snapshot->copies.reserve(params_.size());
  for (const optim::ParamState& state : params_) {
    std::vector<float>& values = snapshot->copies.emplace_back(state.numel);
    if (state.master.is_fp32()) {
      MUOND_RETURN_IF_ERROR(download->Enqueue(state.master.fp32(), values.data(), state.numel));
    } else {
      MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, state.master, 0, state.numel, values.data()));
    }
    snapshot->values.emplace_back(values);
  }
  MUOND_RETURN_IF_ERROR(download->Wait());
  return snapshot;
}

// masters_version_ is read under the masters' reader lock that `reader` took.
absl::StatusOr<ParameterReader> Session::OpenParameters(std::shared_ptr<const ParameterSnapshot> snapshot,
                                                        std::optional<int> rank) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (rank.has_value()) snapshot = RankView(config_, std::move(snapshot), *rank);
  auto registration = std::make_unique<ParameterReader::Registration>();
  registration->session = this;
  registration->snapshot = std::move(snapshot);
  ParameterReader::Registration& r = *registration;
  if (!r.snapshot->views) return ParameterReader(std::move(registration));  // copies, or on the device
  r.copies.resize(r.snapshot->values.size());
  r.finished.resize(r.snapshot->values.size(), false);
  ParameterReader reader(std::move(registration));
  MUOND_RETURN_IF_ERROR(reader.Hold());  // a new reader: neither copied nor replaced
  bool current = false;
  {
    // Read under the reader lock just taken: no writer is between the check and the registration.
    absl::MutexLock lock(&readers_mu_);
    current = masters_version_ == r.snapshot->generation;
    if (current) readers_.insert(&r);
  }
  if (!current) {
    reader.Release();
    return absl::AbortedError(absl::StrCat("session '", id_, "': the parameters after step ", r.snapshot->step,
                                           " were replaced (by a later step, an upload or SetState) before they "
                                           "could be sent; read the current ones with GetParameters"));
  }
  return reader;
}

absl::StatusOr<Session::LatestParameters> Session::ReadLatestParameters(std::optional<int> rank) const {
  // Views of the masters hold while no step changes them; a step that slips in between reading the
  // snapshot and opening it makes them stale, and the parameters after it are read instead.
  constexpr int kRetries = 8;
  {
    absl::ReaderMutexLock lock(&mu_);
    MUOND_RETURN_IF_ERROR(BrokenLocked());  // the masters are no step's
  }
  LatestParameters latest;
  absl::StatusOr<ParameterReader> reader = OpenParameters(Parameters(&latest.last_step), rank);
  for (int attempt = 0; !reader.ok() && absl::IsAborted(reader.status()) && attempt < kRetries; ++attempt) {
    reader = OpenParameters(Parameters(&latest.last_step), rank);
  }
  MUOND_RETURN_IF_ERROR(reader.status());
  latest.reader = *std::move(reader);
  return latest;
}

void Session::ChangeMastersLocked() {
  absl::MutexLock lock(&readers_mu_);
  // Only the masters' own values are copied: a 16-bit master's are widened copies already.
  struct Pending {
    ParameterReader::Registration* reader;
    size_t bytes;
  };
  std::vector<Pending> pending;
  for (ParameterReader::Registration* r : readers_) {
    // Those of an earlier version were copied (or replaced) by its writer already.
    if (r->copied || r->replaced || r->snapshot->generation != masters_version_) continue;
    size_t bytes = 0;
    for (size_t i = 0; i < r->snapshot->values.size(); ++i) {
      if (!r->finished[i] && params_[i].master.is_fp32()) bytes += r->snapshot->values[i].size_bytes();
    }
    pending.push_back({r, bytes});
  }
  std::sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) { return a.bytes < b.bytes; });
  const int64_t budget = config_.total_elements * static_cast<int64_t>(sizeof(float));
  for (const Pending& p : pending) {
    ParameterReader::Registration& r = *p.reader;
    if (answer_copy_bytes_ + static_cast<int64_t>(p.bytes) > budget) {
      r.replaced = true;
      MUOND_LOG(warn, "session {}: an answer of step {} still being sent was replaced: no copy of its {} bytes fits",
                id_, r.snapshot->step, p.bytes);
      continue;
    }
    // Nothing here may fail the change: it comes after the step was journaled. A copy that cannot be
    // allocated replaces its reader instead.
    try {
      for (size_t i = 0; i < r.snapshot->values.size(); ++i) {
        if (r.finished[i] || !params_[i].master.is_fp32()) continue;
        r.copies[i].emplace(r.snapshot->values[i].begin(), r.snapshot->values[i].end());
      }
    } catch (const std::bad_alloc&) {
      for (std::optional<std::vector<float>>& copy : r.copies) copy.reset();
      r.replaced = true;
      MUOND_LOG(warn,
                "session {}: an answer of step {} still being sent was replaced: its copy of {} bytes could "
                "not be allocated",
                id_, r.snapshot->step, p.bytes);
      continue;
    }
    r.copy_bytes = p.bytes;
    answer_copy_bytes_ += static_cast<int64_t>(p.bytes);
    r.copied = true;
  }
  ++masters_version_;
}

std::shared_ptr<const ParameterSnapshot> Session::Parameters(int64_t* last_step) const {
  {
    absl::ReaderMutexLock lock(&mu_);
    if (snapshot_ == nullptr || !snapshot_->on_device) {
      *last_step = last_step_;
      return snapshot_;
    }
  }
  // Left on the device by a GPU transport's step: read back once, under the exclusive lock.
  absl::MutexLock lock(&mu_);
  *last_step = last_step_;
  if (absl::Status read = HostSnapshotLocked(); !read.ok()) {
    // The on-device snapshot stays; readers refuse it and the next call tries again.
    MUOND_LOG(error, "session {}: cannot read the parameters back from the backend: {}", id_, read.message());
  }
  return snapshot_;
}

absl::Status Session::HostSnapshotLocked() const {
  if (snapshot_ == nullptr || !snapshot_->on_device) return absl::OkStatus();
  absl::MutexLock masters(&masters_mu_);  // the masters are those of the snapshot: nothing changed them since
  MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(snapshot_->step));
  return absl::OkStatus();
}

absl::Status Session::CopyParameterOnDevice(const ParameterSnapshot& snapshot, size_t index,
                                            kernels::StorageDtype dtype, void* dst) const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // params_[index].master: its buffer is set at creation, never replaced
  absl::ReaderMutexLock masters(&masters_mu_);
  if (!snapshot.on_device || masters_version_ != snapshot.generation) {
    return absl::AbortedError(absl::StrCat("session '", id_, "': the parameters after step ", snapshot.step,
                                           " were replaced (by a later step, an upload or SetState) before they "
                                           "could be sent; read the current ones with GetParameters"));
  }
  const optim::StoredTensor& master = params_[index].master;
  const size_t n = static_cast<size_t>(master.numel);
  const kernels::StoredRef from = master.Ref(0);
  if (master.dtype == dtype) {
    if (master.is_fp32()) return backend_->CopyOnDevice(master.fp32(), static_cast<float*>(dst), n);
    return backend_->CopyBytes(from.data, dst, master.bytes());
  }
  if (master.is_fp32()) return backend_->Narrow(dtype, master.fp32(), dst, n);
  if (dtype == kernels::StorageDtype::kFp32)
    return backend_->Widen(master.dtype, from.data, static_cast<float*>(dst), n);
  // One 16-bit format into the other: through fp32 scratch, waited for before it is freed.
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> wide, backend_->Allocate(n));
  MUOND_RETURN_IF_ERROR(backend_->Widen(master.dtype, from.data, wide->data(), n));
  MUOND_RETURN_IF_ERROR(backend_->Narrow(dtype, wide->data(), dst, n));
  return backend_->Synchronize();
}

}  // namespace muond::session
