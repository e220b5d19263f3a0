// StreamedStep: one step whose gradients are handed over one at a time as the trainer's backward
// pass produces them, and whose options come when it is finished (docs/protocol.md, "Streamed
// steps"; docs/overlap.md). Session::BeginStreamedStep makes one.
//
// On the gRPC transport of a daemon that takes streamed steps, the Step stream opens at once with a
// header marked `streamed`, and Add() sends each gradient's chunks before it returns, so the
// transfer overlaps the caller's remaining backward; Finish() sends the closing StepEnd with the
// step's options and reads the answer. On shared memory Add() writes each gradient into its slot of
// the session's region at once, and Finish() makes the one StepShared call; elsewhere (an older
// daemon) Add() only notes the gradient and Finish() makes an ordinary step of them all. Either way a try that fails
// transiently is retried by Finish() as an ordinary step with the same number and every gradient
// added, so a step is applied once.
//
// Ownership: borrows the Session (which must outlive it) and the caller's gradient memory: every
// span given to Add() must stay valid and unchanged until Finish() or Cancel() returns. Destroying an
// unfinished step cancels it (nothing is applied). One thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/muond_client.h"

namespace muond::client {

class GrpcStreamedTry;

class StreamedStep {
 public:
  ~StreamedStep();
  StreamedStep(const StreamedStep&) = delete;
  StreamedStep& operator=(const StreamedStep&) = delete;

  int64_t step() const { return step_; }
  // The gradient of one parameter, final for this step (a parameter is added at most once; one left
  // out has no gradient this step). INVALID_ARGUMENT for an unknown or repeated name or a wrong
  // element count, before anything is sent.
  absl::Status Add(const TensorView& gradient);
  // Ends the step with `options` — its rank, base_step, log_num_zeros_in_grad, return_dtype,
  // phase and decision must be those it began with (INVALID_ARGUMENT naming the field otherwise); lr,
  // max_grad_norm, qk_logits, grad_scale and weight are taken from here — and returns the answer,
  // as Session::Step does. Once only.
  absl::StatusOr<StepReply> Finish(const StepOptions& options = {});
  // Abandons the step: the daemon applies nothing of it.
  void Cancel();
  // Whether the gradients have been going out as they were added (false: gathered for Finish).
  bool streaming() const { return try_ != nullptr; }

 private:
  friend class Session;
  StreamedStep(Session* session, int64_t step, StepOptions begun);

  Session* const session_;
  const int64_t step_;
  const StepOptions begun_;
  std::vector<TensorView> added_;
  std::unique_ptr<GrpcStreamedTry> try_;  // null: gathered
  bool done_ = false;
};

}  // namespace muond::client
