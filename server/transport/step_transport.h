// The transport seam: how one step's gradients arrive and how its answer leaves, whatever carries
// them. A GradientSource fills a session's IncomingStep (gradients decoded into it, each piece
// staged as it lands); a ParameterSink sends the step's result and the parameters after it.
// Today's chunked gRPC streams are the first implementation (transport/grpc/); shared memory, CUDA
// IPC and NCCL plug in here the same way. RunStep is the step itself, the same on every transport:
// begin (the session checks the request and decides new or retry), read, finish (apply once or
// replay), answer, report (each phase timed, with the bytes each way, for metrics).
//
// A source and a sink serve one step on one thread; RunStep is thread-safe as the session is.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "server/metrics/metrics.h"
#include "server/session/incoming_step.h"
#include "server/session/session.h"
#include "server/session/step_types.h"

namespace muond::transport {

class GradientSource {
 public:
  virtual ~GradientSource() = default;
  // Reads the step's gradients into `step` — all of them, or an error naming the field; a replay's
  // gradients are read and dropped (the transport must still consume them).
  virtual absl::Status ReadGradients(session::IncomingStep& step) = 0;
  // The transport's name in metrics ("grpc", "shm", "cuda_ipc", "nccl").
  virtual std::string_view transport() const = 0;
  // Bytes taken in so far (payload and framing), for metrics.
  int64_t bytes_received() const { return bytes_received_; }

 protected:
  int64_t bytes_received_ = 0;
};

class ParameterSink {
 public:
  virtual ~ParameterSink() = default;
  // Sends the result and the parameters after the step; CANCELLED when the peer went away. The
  // parameters are read through `parameters` (a reader of outcome.parameters, given released: an
  // empty one for a prepare), held while they are read and released while the sink waits on its
  // peer, so that a slow peer never holds up the session's next steps (session::ParameterReader).
  virtual absl::Status Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) = 0;
  // Bytes sent so far (payload and framing), for metrics.
  int64_t bytes_sent() const { return bytes_sent_; }

 protected:
  int64_t bytes_sent_ = 0;
};

// One step of `session` from `source` to `sink`. Refusals change no state.
absl::Status RunStep(session::Session& session, session::StepRequest request, GradientSource& source,
                     ParameterSink& sink, metrics::Metrics& metrics);

}  // namespace muond::transport
