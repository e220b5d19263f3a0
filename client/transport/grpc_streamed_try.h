// GrpcStreamedTry: the first try of a StreamedStep on the gRPC transport — one Step stream opened
// with a header marked `streamed`, each added gradient's chunks written at once, a StepEnd with the
// count and the step's options at the end, then the answer read as for any step.
//
// Ownership: borrows the Client and the Session, which outlive it; owns its call. A failed write
// leaves the try broken: Finish() then reports the call's status (UNAVAILABLE for a lost daemon).
// Destroying an unfinished try cancels its call. One thread at a time.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "client/muond_client.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"

namespace muond::client {

class GrpcStreamedTry {
 public:
  // Opens the stream and sends `header` (streamed set; no options, no chunk count).
  GrpcStreamedTry(Client& client, const Session& session, const v1::StepHeader& header);
  ~GrpcStreamedTry();

  // Sends `gradient`'s chunks in its wire dtype; false once the stream broke.
  bool Add(const TensorView& gradient);
  // Sends StepEnd with `end`'s options and the chunk count, and reads the answer.
  absl::StatusOr<StepReply> Finish(v1::StepEnd end, const StepOptions& options);

 private:
  Client& client_;
  const Session& session_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  uint32_t chunks_ = 0;
  bool ok_ = true;
  bool finished_ = false;
};

}  // namespace muond::client
