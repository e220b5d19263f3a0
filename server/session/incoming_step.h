// IncomingStep: one step on its way into a session, between Session::BeginStep and
// Session::FinishStep. The session has already checked the request (its StepPlan) and decided
// whether the step is new or a retry of the applied one (replay()); a transport fills gradients()
// with the step's values and calls Stage() for each piece it wrote, which starts copying that piece
// into the session's backend gradient buffers while the rest is still arriving.
//
// The session owns the staging: it lends this step its gradient buffers when nobody else holds them
// (only one step of a session stages at a time; the others keep their gradients on the host, and
// multi-rank steps are averaged on the host), and takes them back when the step is finished or
// dropped. The host tensors gradients() are decoded into are lent the same way (HostGradients) and
// given back when this is destroyed; on a host-memory backend nothing is staged: the optimizer reads
// them in place.
//
// A transport whose gradients arrive in device memory (CUDA IPC, NCCL) writes them straight into the
// staged buffers instead (DeviceGradient, MarkDeviceGradient) when the step allows it
// (takes_device_gradients): the values then never visit the host, and the session takes their sums
// of squares on the backend. Otherwise — several ranks (averaged on the host), a prepare, a journal
// that records the gradients' bytes, a zero count, another step holding the buffers — it writes
// gradients() like any transport. A transport reading a long stream asks CheckOpen() between pieces,
// so that a session closed meanwhile stops the stream at once rather than after its last byte. An
// IncomingStep must not outlive its session. Used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/host_tensor.h"
#include "kernels/backend.h"
#include "server/session/gradient_staging.h"
#include "server/session/session_config.h"
#include "server/session/step_plan.h"

namespace muond::session {

class Session;

class IncomingStep {
 public:
  // Made by `session`'s BeginStep. `host_store`: the session's host tensors to decode into (null: this
  // step's own); `staged`: the session's backend buffers lent to this step (null: the gradients
  // stay on the host until applied); `device_gradients`: nothing needs the gradients' values on the
  // host, so a GPU transport may leave them in the staged buffers.
  // `defaults`: the session's per-group hyperparameters, for TakeStepOptions.
  IncomingStep(const Session& session, const std::vector<optim::StepHyper>& defaults, StepPlan plan, bool replay,
               HostGradients* host_store, std::unique_ptr<StagedGradients> staged, bool device_gradients);
  IncomingStep(const IncomingStep&) = delete;
  IncomingStep& operator=(const IncomingStep&) = delete;
  ~IncomingStep();

  // A retry of the session's last applied step: its gradients are not needed; read and drop them.
  bool replay() const { return replay_; }
  const StepPlan& plan() const { return plan_; }
  StepPlan& mutable_plan() { return plan_; }
  // A streamed step's options, which arrive after its gradients (StepEnd): the overrides, clipping
  // limit, QK-clip logits, loss scale and weight of `options` replace the plan's, and the step is
  // planned again — a refusal names the field as PlanStep does and leaves the plan as it was.
  absl::Status TakeStepOptions(const StepRequest& options);
  const SessionConfig& config() const { return config_; }
  // OK while the session is open; its NOT_FOUND (SESSION_NOT_FOUND) once it was closed. Lock-free.
  absl::Status CheckOpen() const;

  // Indexed like config().parameters; a transport writes each tensor's values in order.
  std::vector<HostTensor>& gradients() { return gradients_; }

  // `count` values of parameter `index`, from element `offset`, are final in gradients(): starts
  // their copy to the backend when this step stages (a no-op otherwise).
  absl::Status Stage(size_t index, int64_t offset, size_t count);

  // Whether gradients may go straight into backend buffers (see the class comment).
  bool takes_device_gradients() const { return staged_ != nullptr && device_gradients_; }
  // Parameter `index`'s fp32 backend buffer (config().parameters[index].numel elements) for the
  // transport to fill with work it enqueues on the session's backend; null unless
  // takes_device_gradients().
  float* DeviceGradient(size_t index);
  // The buffer of `index` holds its gradient once the backend's work enqueued so far has run: it is
  // received in full, and its sum of squares is taken on the backend when the step finishes.
  void MarkDeviceGradient(size_t index);

  // The backend buffers lent to this step; null when its gradients stay on the host.
  StagedGradients* staged() { return staged_.get(); }
  // Once every gradient has arrived: waits for the staged copies and, unless this is a replay, takes
  // the sums of squares of the gradients left in backend buffers (MarkDeviceGradient) on `backend`.
  // A no-op for a step that stages nothing.
  absl::Status FinishStaging(kernels::Backend& backend);

 private:
  const Session& session_;
  const SessionConfig& config_;
  const std::vector<optim::StepHyper>& defaults_;
  StepPlan plan_;
  const bool replay_;
  HostGradients* const host_store_;  // the session's; null: gradients_ are this step's own
  std::vector<HostTensor> gradients_;
  std::unique_ptr<StagedGradients> staged_;  // null: the gradients stay on the host until applied
  const bool device_gradients_;
};

}  // namespace muond::session
