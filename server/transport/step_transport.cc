#include "server/transport/step_transport.h"

#include <chrono>

#include "common/logging.h"
#include "common/status_macros.h"

namespace muond::transport {

namespace {

// An applied step's group telemetry into `report`, and each health warning it raised as a log event
// of its kind (docs/operations.md, Warnings) and into `report`. Once a step: not for a replay, nor
// for the answers to its other ranks.
void ReportHealth(const std::string& session, const session::StepResult& result, metrics::StepReport& report) {
  report.groups = session::GroupFiguresOf(result.group_clips, result.group_telemetry);
  for (const session::StepResult::HealthWarning& warning : result.warnings) {
    MUOND_EVENT(warn, warning.kind, session, result.step, "session {} step {} group '{}': {}: {}", session, result.step,
                warning.group, warning.kind, warning.detail);
    report.warnings.push_back(warning.kind);
  }
}

}  // namespace

absl::Status RunStep(session::Session& session, session::StepRequest request, GradientSource& source,
                     ParameterSink& sink, metrics::Metrics& metrics) {
  using Clock = std::chrono::steady_clock;  // durations: immune to wall-clock steps
  const Clock::time_point start = Clock::now();
  const bool device_answer = request.device_answer;
  const int rank = request.rank;
  session.NoteStepArrived(rank, source.transport());
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<session::IncomingStep> step, session.BeginStep(std::move(request)));
  MUOND_RETURN_IF_ERROR(source.ReadGradients(*step));
  const Clock::time_point received = Clock::now();
  MUOND_ASSIGN_OR_RETURN(session::StepOutcome outcome, session.FinishStep(std::move(step)));
  const Clock::time_point computed = Clock::now();
  const session::StepResult& result = outcome.result;
  if (outcome.parameters != nullptr && !result.applied) {
    MUOND_EVENT(warn, "step_skipped", session.id(), result.step, "session {} step {} skipped: {}", session.id(),
                result.step, result.skip_reason);
  }
  absl::Status sent;
  if (outcome.parameters == nullptr) {
    session::ParameterReader none;
    sent = sink.Send(outcome, none);  // a prepare: the result alone
  } else {
    // A rank that holds parts of partitioned parameters gets those parts back, and the rest whole
    // (the same snapshot, untouched, when nothing is partitioned).
    absl::StatusOr<session::ParameterReader> reader = session.OpenParameters(outcome.parameters, rank);
    // Ranks that do not wait for each other (quorum, async) may replace the parameters with another
    // step before this answer goes out: it carries the latest ones instead, and its step names them
    // (the rank continues after it; the step it sent was applied, or answered, all the same).
    if (!reader.ok() && absl::IsAborted(reader.status()) &&
        session.config().sync.mode != session::SyncMode::kLockstep) {
      absl::StatusOr<session::Session::LatestParameters> latest = session.ReadLatestParameters(rank);
      if (latest.ok()) {
        outcome.result.step = latest->last_step;
        reader = std::move(latest->reader);
      }
    }
    if (reader.ok() && reader->snapshot()->on_device && !device_answer) {
      reader = absl::InternalError("parameters left on the device for a transport that answers from the host");
    }
    if (reader.ok()) {
      outcome.parameters = reader->snapshot();
      reader->Release();
      sent = sink.Send(outcome, *reader);
    } else {
      sent = reader.status();
    }
  }
  // Reported even when the answer could not be sent: the step was applied (or replayed) all the same.
  metrics::StepReport report;
  report.transport = source.transport();
  report.applied = result.applied;
  report.replayed = result.replayed;
  report.prepared = outcome.parameters == nullptr;
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  report.receive_seconds = seconds(received - start);
  report.compute_seconds = seconds(computed - received);
  report.send_seconds = seconds(Clock::now() - computed);
  report.bytes_received = source.bytes_received();
  report.bytes_sent = sink.bytes_sent();
  report.grad_norm = result.grad_norm;
  report.elements = session.config().total_elements;
  report.world_size = session.config().world_size;
  report.session = session.id();
  report.session_serial = session.serial();
  if (result.applied && !result.replayed && session.ClaimHealthReport(result.step)) {
    ReportHealth(session.id(), result, report);
  }
  metrics.StepAnswered(report);
  return sent;
}

}  // namespace muond::transport
