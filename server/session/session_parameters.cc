// Session: the parameters as answers read them — the snapshot a step leaves (host views or copies,
// or nothing read back after a GPU transport's step), reading it back on demand, and the locks that
// keep views valid while an answer is encoded. See session.h.
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/stored_tensor.h"
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

absl::StatusOr<Session::ParameterReadLock> Session::ReadParameters(const ParameterSnapshot& snapshot) const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (!snapshot.views) return ParameterReadLock();  // copies, or on the device (CopyParameterOnDevice checks)
  masters_mu_.ReaderLock();
  if (masters_version_ != snapshot.generation) {
    masters_mu_.ReaderUnlock();
    return absl::AbortedError(absl::StrCat("session '", id_, "': the parameters after step ", snapshot.step,
                                           " were replaced (by a later step, an upload or SetState) before they "
                                           "could be sent; read the current ones with GetParameters"));
  }
  return ParameterReadLock(&masters_mu_);
}

absl::StatusOr<Session::LatestParameters> Session::ReadLatestParameters() const {
  // Views of the masters hold while no step changes them; a step that slips in between reading the
  // snapshot and locking it makes them stale, and the parameters after it are read instead.
  constexpr int kRetries = 8;
  {
    absl::ReaderMutexLock lock(&mu_);
    MUOND_RETURN_IF_ERROR(BrokenLocked());  // the masters are no step's
  }
  LatestParameters latest;
  latest.snapshot = Parameters(&latest.last_step);
  absl::StatusOr<ParameterReadLock> still = ReadParameters(*latest.snapshot);
  for (int attempt = 0; !still.ok() && absl::IsAborted(still.status()) && attempt < kRetries; ++attempt) {
    latest.snapshot = Parameters(&latest.last_step);
    still = ReadParameters(*latest.snapshot);
  }
  MUOND_RETURN_IF_ERROR(still.status());
  latest.lock = *std::move(still);
  return latest;
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
    // The on-device snapshot stays; readers refuse it (ReadParameters) and the next call tries again.
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
