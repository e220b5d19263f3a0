#include "server/transport/step_transport.h"

#include "common/logging.h"
#include "common/status_macros.h"

namespace muond::transport {

absl::Status RunStep(session::Session& session, session::StepRequest request, GradientSource& source,
                     ParameterSink& sink, metrics::Metrics& metrics) {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<session::IncomingStep> step, session.BeginStep(std::move(request)));
  MUOND_RETURN_IF_ERROR(source.ReadGradients(*step));
  MUOND_ASSIGN_OR_RETURN(session::StepOutcome outcome, session.FinishStep(std::move(step)));
  const session::StepResult& result = outcome.result;
  if (outcome.parameters == nullptr) return sink.Send(outcome);  // a prepare: the result alone
  if (!result.applied) {
    MUOND_LOG(warn, "session {} step {} skipped: {}", session.id(), result.step, result.skip_reason);
  }
  metrics.StepAnswered({result.compute_seconds, result.applied, result.replayed, result.grad_norm,
                        session.config().total_elements, session.config().world_size});
  // The parameters may be the masters themselves: they stay as they are until the answer is sent.
  MUOND_ASSIGN_OR_RETURN(session::Session::ParameterReadLock still, session.ReadParameters(*outcome.parameters));
  return sink.Send(outcome);
}

}  // namespace muond::transport
