// IncomingStep: a begun step's gradients on their way in — staging their copies to the backend and
// the buffers a GPU transport fills directly. See incoming_step.h.
#include "server/session/incoming_step.h"

#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "server/session/session.h"

namespace muond::session {

IncomingStep::IncomingStep(const Session& session, const std::vector<optim::StepHyper>& defaults, StepPlan plan,
                           bool replay, HostGradients* host_store, std::unique_ptr<StagedGradients> staged,
                           bool device_gradients)
    : session_(session),
      config_(session.config()),
      defaults_(defaults),
      plan_(std::move(plan)),
      replay_(replay),
      host_store_(host_store),
      gradients_(host_store != nullptr ? host_store->Take() : std::vector<HostTensor>(config_.parameters.size())),
      staged_(std::move(staged)),
      device_gradients_(device_gradients) {}

absl::Status IncomingStep::CheckOpen() const { return session_.CheckOpen(); }

IncomingStep::~IncomingStep() {
  if (host_store_ != nullptr) host_store_->GiveBack(std::move(gradients_));
}

absl::Status IncomingStep::TakeStepOptions(const StepRequest& options) {
  StepRequest request = plan_.request;
  request.overrides = options.overrides;
  request.max_grad_norm = options.max_grad_norm;
  request.qk_logits = options.qk_logits;
  request.grad_scale = options.grad_scale;
  request.weight = options.weight;
  MUOND_ASSIGN_OR_RETURN(plan_, PlanStep(config_, defaults_, std::move(request)));
  return absl::OkStatus();
}

absl::Status IncomingStep::Stage(size_t index, int64_t offset, size_t count) {
  if (staged_ == nullptr) return absl::OkStatus();
  HostTensor& tensor = gradients_[index];
  MUOND_RETURN_IF_ERROR(staged_->Add(index, offset, tensor.values.data() + offset, count));
  tensor.staged = true;
  return absl::OkStatus();
}

float* IncomingStep::DeviceGradient(size_t index) {
  if (!takes_device_gradients()) return nullptr;
  return staged_->lease().set().buffer(index)->data();
}

void IncomingStep::MarkDeviceGradient(size_t index) {
  HostTensor& tensor = gradients_[index];
  tensor.received = config_.parameters[index].numel;
  tensor.sum_squares = 0.0;  // taken in FinishStaging
  tensor.staged = true;
  tensor.device_only = true;
}

absl::Status IncomingStep::FinishStaging(kernels::Backend& backend) {
  if (staged_ == nullptr) return absl::OkStatus();
  MUOND_RETURN_IF_ERROR(staged_->Finish());
  if (replay_) return absl::OkStatus();
  std::vector<size_t> indices;
  std::vector<kernels::Backend::Slice> slices;
  for (size_t i = 0; i < gradients_.size(); ++i) {
    if (!gradients_[i].device_only) continue;
    indices.push_back(i);
    slices.push_back({staged_->lease().set().buffer(i)->data(), static_cast<size_t>(config_.parameters[i].numel)});
  }
  if (slices.empty()) return absl::OkStatus();
  std::vector<double> sums(slices.size());
  MUOND_RETURN_IF_ERROR(backend.SumSquaresEach(slices, sums.data()));
  for (size_t k = 0; k < indices.size(); ++k) gradients_[indices[k]].sum_squares = sums[k];
  return absl::OkStatus();
}

}  // namespace muond::session
