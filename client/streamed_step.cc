#include "client/streamed_step.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/transport/grpc_streamed_try.h"
#include "client/transport/step_transport.h"

namespace muond::client {
namespace {

// INVALID_ARGUMENT naming the first option that defines which step this is and differs.
absl::Status CheckSameStep(const StepOptions& begun, const StepOptions& now) {
  const char* field = nullptr;
  if (begun.rank != now.rank)
    field = "rank";
  else if (begun.base_step != now.base_step)
    field = "base_step";
  else if (begun.log_num_zeros_in_grad != now.log_num_zeros_in_grad)
    field = "log_num_zeros_in_grad";
  else if (begun.return_dtype != now.return_dtype)
    field = "return_dtype";
  else if (begun.phase != now.phase)
    field = "phase";
  else if (begun.decision.has_value() != now.decision.has_value() ||
           (begun.decision.has_value() && begun.decision->SerializeAsString() != now.decision->SerializeAsString()))
    field = "decision";  // a commit's: the streamed header carries it
  if (field == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("options.", field, ": must be what the streamed step began with (it names the step)"));
}

}  // namespace

StreamedStep::StreamedStep(Session* session, int64_t step, StepOptions begun)
    : session_(session), step_(step), begun_(std::move(begun)) {}

StreamedStep::~StreamedStep() { Cancel(); }

absl::Status StreamedStep::Add(const TensorView& gradient) {
  if (done_) return absl::FailedPreconditionError("the streamed step is finished");
  const auto numel = session_->element_counts().find(gradient.name);
  if (numel == session_->element_counts().end()) {
    return absl::InvalidArgumentError(absl::StrCat("gradient.name: no parameter '", gradient.name, "'"));
  }
  if (static_cast<int64_t>(gradient.values.size()) != numel->second) {
    return absl::InvalidArgumentError(absl::StrCat("gradient.values: '", gradient.name, "' has ", numel->second,
                                                   " elements, got ", gradient.values.size()));
  }
  for (const TensorView& added : added_) {
    if (added.name == gradient.name) {
      return absl::InvalidArgumentError(absl::StrCat("gradient.name: '", gradient.name, "' was added already"));
    }
  }
  // A rank's empty part of a partitioned parameter is not sent (the daemon expects nothing for it),
  // as Session::Step leaves it out.
  if (session_->parts_rank_.has_value() && gradient.values.empty()) return absl::OkStatus();
  added_.push_back(gradient);
  // A broken stream is noticed by Finish (its status), which then retries with every gradient.
  if (try_ != nullptr) {
    try_->Add(gradient);
  } else {
    session_->transport_->StageGradient(gradient);  // shared memory: into its slot now
  }
  return absl::OkStatus();
}

absl::StatusOr<StepReply> StreamedStep::Finish(const StepOptions& options) {
  if (done_) return absl::FailedPreconditionError("the streamed step is finished");
  if (absl::Status same = CheckSameStep(begun_, options); !same.ok()) return same;
  done_ = true;
  return session_->FinishStreamed(*this, options);
}

void StreamedStep::Cancel() {
  done_ = true;
  try_.reset();  // cancels the call: nothing of it is applied
  // What Add staged in shared memory is not for the session's next step, which writes its own.
  if (session_->transport_ != nullptr) session_->transport_->DropStaged();
}

}  // namespace muond::client
