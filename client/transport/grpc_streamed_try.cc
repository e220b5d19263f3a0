#include "client/transport/grpc_streamed_try.h"

#include "client/transport/grpc_step_transport.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {

GrpcStreamedTry::GrpcStreamedTry(Client& client, const Session& session, const v1::StepHeader& header)
    : client_(client), session_(session) {
  client_.PrepareContext(context_);
  stream_.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
      client_.channel(), client_.step_method(), &context_));
  v1::StepRequest request;
  *request.mutable_header() = header;
  ok_ = WriteRequest(*stream_, request);
}

GrpcStreamedTry::~GrpcStreamedTry() {
  if (finished_) return;
  context_.TryCancel();
  stream_->Finish().ok();  // CANCELLED: nothing of it is applied
}

bool GrpcStreamedTry::Add(const TensorView& gradient) {
  if (!ok_) return false;
  const size_t chunk_bytes = client_.chunk_bytes();
  wire::SlicePool& pool = client_.slice_pool();
  ok_ = wire::ForEachChunk(FirstChunk(gradient), gradient.values, session_.WireDType(gradient.name), chunk_bytes,
                           [&](const v1::TensorChunk& meta, std::span<const float> values) {
                             ++chunks_;
                             return stream_->Write(wire::EncodeChunk(wire::kChunkField, meta, values, pool));
                           });
  return ok_;
}

absl::StatusOr<StepReply> GrpcStreamedTry::Finish(v1::StepEnd end, const StepOptions& options) {
  finished_ = true;
  if (ok_) {
    end.set_num_chunks(chunks_);
    v1::StepRequest request;
    *request.mutable_end() = std::move(end);
    ok_ = WriteRequest(*stream_, request);
  }
  stream_->WritesDone();
  // A broken stream's answer is the call's status (the daemon refused it, or went away).
  return ReadStepAnswer(*stream_, session_.element_counts(), options);
}

}  // namespace muond::client
