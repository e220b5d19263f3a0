#include "server/transport/grpc/whole_step.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace muond::transport {
namespace {

using google::protobuf::internal::WireFormatLite;

constexpr int kMessagesField = 1;  // StepMessages.messages and StepAnswers.messages

}  // namespace

absl::StatusOr<std::vector<grpc::ByteBuffer>> ReadWholeStep(const grpc::ByteBuffer& request) {
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok()) return absl::InvalidArgumentError("messages: the request could not be read");
  std::string bytes;
  bytes.reserve(request.Length());
  for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  const int size = static_cast<int>(bytes.size());
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()), size);
  in.SetTotalBytesLimit(size);
  std::vector<grpc::ByteBuffer> messages;
  while (in.CurrentPosition() < size) {
    const std::string where = absl::StrCat("messages[", messages.size(), "]");
    const uint32_t tag = in.ReadTag();
    if (WireFormatLite::GetTagFieldNumber(tag) != kMessagesField ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a StepMessages holds only its messages (field ",
                                                     kMessagesField, ", length-delimited); found field ",
                                                     WireFormatLite::GetTagFieldNumber(tag), " of wire type ",
                                                     WireFormatLite::GetTagWireType(tag)));
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(size - in.CurrentPosition())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the encoding ends inside the message"));
    }
    grpc::Slice slice(bytes.data() + in.CurrentPosition(), length);
    messages.emplace_back(&slice, 1);
    in.Skip(static_cast<int>(length));
  }
  return messages;
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

grpc::ByteBuffer WholeStepStream::Answer() const {
  std::vector<grpc::Slice> slices;
  for (const grpc::ByteBuffer& message : written_) {
    uint8_t prefix[1 + 5];  // the tag, then the length as a varint of at most 5 bytes
    prefix[0] =
        static_cast<uint8_t>(WireFormatLite::MakeTag(kMessagesField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint32ToArray(
        static_cast<uint32_t>(message.Length()), prefix + 1);
    slices.emplace_back(prefix, static_cast<size_t>(end - prefix));
    std::vector<grpc::Slice> parts;
    if (message.Dump(&parts).ok()) slices.insert(slices.end(), parts.begin(), parts.end());
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace muond::transport
