#include "server/session/gradient_staging.h"

#include <utility>

#include "common/status_macros.h"

namespace muond::session {

size_t GradientSet::allocated() const {
  size_t n = 0;
  for (const auto& buffer : buffers_) n += buffer != nullptr ? 1 : 0;
  return n;
}

GradientLease& GradientLease::operator=(GradientLease&& other) noexcept {
  if (this != &other) {
    if (set_ != nullptr) pool_->GiveBack(std::move(set_));
    pool_ = other.pool_;
    set_ = std::move(other.set_);
  }
  return *this;
}

GradientLease::~GradientLease() {
  if (set_ != nullptr) pool_->GiveBack(std::move(set_));
}

GradientPool::GradientPool(kernels::Backend* backend, std::vector<int64_t> numel)
    : backend_(backend), numel_(std::move(numel)) {}

absl::Status GradientPool::AllocateAll(GradientSet& set) {
  for (size_t i = 0; i < numel_.size(); ++i) MUOND_RETURN_IF_ERROR(Buffer(set, i).status());
  return absl::OkStatus();
}

absl::Status GradientPool::Preallocate() {
  auto set = std::make_unique<GradientSet>(numel_.size());
  MUOND_RETURN_IF_ERROR(AllocateAll(*set));
  absl::MutexLock lock(&mu_);
  spare_ = std::move(set);
  return absl::OkStatus();
}

GradientLease GradientPool::Acquire() {
  absl::MutexLock lock(&mu_);
  if (spare_ != nullptr) return GradientLease(this, std::move(spare_));
  return GradientLease(this, std::make_unique<GradientSet>(numel_.size()));
}

GradientLease GradientPool::TryAcquire() {
  absl::MutexLock lock(&mu_);
  if (spare_ == nullptr) return GradientLease();
  return GradientLease(this, std::move(spare_));
}

absl::StatusOr<kernels::DeviceBuffer*> GradientPool::Buffer(GradientSet& set, size_t index) {
  std::unique_ptr<kernels::DeviceBuffer>& buffer = set.buffer(index);
  if (buffer == nullptr) {
    MUOND_ASSIGN_OR_RETURN(buffer, backend_->Allocate(static_cast<size_t>(numel_[index])));
  }
  return buffer.get();
}

void GradientPool::GiveBack(std::unique_ptr<GradientSet> set) {
  absl::MutexLock lock(&mu_);
  // One spare: the fuller of the two, so that steady-state steps allocate nothing. The other (a
  // concurrent step's) is freed here.
  if (spare_ == nullptr || set->allocated() > spare_->allocated()) spare_ = std::move(set);
}

absl::StatusOr<std::unique_ptr<StagedGradients>> StagedGradients::Start(GradientPool* pool, kernels::Backend* backend) {
  GradientLease lease = pool->TryAcquire();
  if (!lease) return nullptr;
  // Every buffer exists before the transfer does: a transfer is ordered only after the work enqueued
  // before its creation, and a new buffer's zeroing is such work (on a GPU, asynchronous).
  MUOND_RETURN_IF_ERROR(pool->AllocateAll(lease.set()));
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::HostToDevice> upload, backend->NewHostToDevice());
  return std::unique_ptr<StagedGradients>(new StagedGradients(std::move(lease), std::move(upload)));
}

absl::Status StagedGradients::Add(size_t index, int64_t offset, const float* values, size_t count) {
  return upload_->Enqueue(values, lease_.set().buffer(index)->data() + offset, count);
}

absl::Status StagedGradients::Finish() { return upload_->Wait(); }

void HostGradients::Preallocate() {
  std::vector<HostTensor> tensors(numel_.size());
  for (size_t i = 0; i < numel_.size(); ++i) tensors[i].values.resize(static_cast<size_t>(numel_[i]));
  absl::MutexLock lock(&mu_);
  spare_ = std::move(tensors);
}

std::vector<HostTensor> HostGradients::Take() {
  std::vector<HostTensor> tensors;
  {
    absl::MutexLock lock(&mu_);
    tensors = std::move(spare_);
    spare_.clear();
  }
  tensors.resize(numel_.size());
  for (HostTensor& tensor : tensors) {
    tensor.received = 0;
    tensor.sum_squares = 0.0;
    tensor.staged = false;
    tensor.device_only = false;
  }
  return tensors;
}

size_t HostGradients::AllocatedCount(const std::vector<HostTensor>& tensors) {
  size_t n = 0;
  for (const HostTensor& tensor : tensors) n += tensor.values.empty() ? 0 : 1;
  return n;
}

void HostGradients::GiveBack(std::vector<HostTensor> tensors) {
  if (tensors.size() != numel_.size()) return;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].values.empty() && tensors[i].values.size() != static_cast<size_t>(numel_[i])) return;
  }
  absl::MutexLock lock(&mu_);
  if (AllocatedCount(tensors) >= AllocatedCount(spare_)) spare_ = std::move(tensors);
}

}  // namespace muond::session
