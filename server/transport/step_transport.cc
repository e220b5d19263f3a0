#include "server/transport/step_transport.h"

#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace muond::transport {

absl::Status RunStep(session::Session& session, session::StepRequest request, GradientSource& source,
                     ParameterSink& sink, metrics::Metrics& metrics) {
  const absl::Time start = absl::Now();
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<session::IncomingStep> step, session.BeginStep(std::move(request)));
  MUOND_RETURN_IF_ERROR(source.ReadGradients(*step));
  const absl::Time received = absl::Now();
  MUOND_ASSIGN_OR_RETURN(session::StepOutcome outcome, session.FinishStep(std::move(step)));
  const absl::Time computed = absl::Now();
  const session::StepResult& result = outcome.result;
  if (outcome.parameters != nullptr && !result.applied) {
    MUOND_EVENT(warn, "step_skipped", session.id(), result.step, "session {} step {} skipped: {}", session.id(), result.step,
                result.skip_reason);
  }
  absl::Status sent;
  if (outcome.parameters == nullptr) {
    sent = sink.Send(outcome);  // a prepare: the result alone
  } else {
    // The parameters may be the masters themselves: they stay as they are until the answer is sent.
    MUOND_ASSIGN_OR_RETURN(session::Session::ParameterReadLock still, session.ReadParameters(*outcome.parameters));
    sent = sink.Send(outcome);
  }
  // Reported even when the answer could not be sent: the step was applied (or replayed) all the same.
  metrics::StepReport report;
  report.transport = source.transport();
  report.applied = result.applied;
  report.replayed = result.replayed;
  report.prepared = outcome.parameters == nullptr;
  report.receive_seconds = absl::ToDoubleSeconds(received - start);
  report.compute_seconds = absl::ToDoubleSeconds(computed - received);
  report.send_seconds = absl::ToDoubleSeconds(absl::Now() - computed);
  report.bytes_received = source.bytes_received();
  report.bytes_sent = sink.bytes_sent();
  report.grad_norm = result.grad_norm;
  report.elements = session.config().total_elements;
  report.world_size = session.config().world_size;
  metrics.StepAnswered(report);
  return sent;
}

}  // namespace muond::transport
