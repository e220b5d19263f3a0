#include "server/transport/grpc/whole_step.h"

#include "proto/wire/message_list.h"

namespace muond::transport {

absl::StatusOr<std::vector<grpc::ByteBuffer>> ReadWholeStep(const grpc::ByteBuffer& request) {
  return wire::SplitMessageList(request, "StepMessages", "messages");
}

bool WholeStepStream::NextMessageSize(uint32_t* size) {
  if (next_ == messages_.size()) return false;
  *size = static_cast<uint32_t>(messages_[next_].Length());
  return true;
}

bool WholeStepStream::Read(grpc::ByteBuffer* message) {
  if (next_ == messages_.size()) return false;
  *message = std::move(messages_[next_++]);
  return true;
}

bool WholeStepStream::Write(const grpc::ByteBuffer& message, grpc::WriteOptions /*options*/) {
  written_.push_back(message);  // shares the message's slices
  return true;
}

grpc::ByteBuffer WholeStepStream::Answer() const { return wire::JoinMessageList(written_); }

}  // namespace muond::transport
