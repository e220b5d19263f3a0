#include "proto/wire/message_list.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace muond::wire {
namespace {

using google::protobuf::internal::WireFormatLite;

}  // namespace

absl::StatusOr<std::vector<grpc::ByteBuffer>> SplitMessageList(const grpc::ByteBuffer& list,
                                                               absl::string_view list_type, absl::string_view field) {
  grpc::Slice whole;
  if (!list.TrySingleSlice(&whole).ok() && !list.DumpToSingleSlice(&whole).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the ", list_type, " could not be read"));
  }
  const int size = static_cast<int>(whole.size());
  google::protobuf::io::CodedInputStream in(whole.begin(), size);
  in.SetTotalBytesLimit(size);
  std::vector<grpc::ByteBuffer> messages;
  while (in.CurrentPosition() < size) {
    const std::string where = absl::StrCat(field, "[", messages.size(), "]");
    const uint32_t tag = in.ReadTag();
    if (WireFormatLite::GetTagFieldNumber(tag) != kMessageListField ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a ", list_type, " holds only its messages (field ",
                                                     kMessageListField, ", length-delimited); found field ",
                                                     WireFormatLite::GetTagFieldNumber(tag), " of wire type ",
                                                     WireFormatLite::GetTagWireType(tag)));
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(size - in.CurrentPosition())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the encoding ends inside the message"));
    }
    const size_t begin = static_cast<size_t>(in.CurrentPosition());
    grpc::Slice message = whole.sub(begin, begin + length);  // shares `whole`'s bytes
    messages.emplace_back(&message, 1);
    in.Skip(static_cast<int>(length));
  }
  return messages;
}

grpc::ByteBuffer JoinMessageList(std::span<const grpc::ByteBuffer> messages) {
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * messages.size());
  for (const grpc::ByteBuffer& message : messages) {
    uint8_t prefix[1 + 5];  // the tag, then the length as a varint of at most 5 bytes
    prefix[0] =
        static_cast<uint8_t>(WireFormatLite::MakeTag(kMessageListField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint32ToArray(
        static_cast<uint32_t>(message.Length()), prefix + 1);
    slices.emplace_back(prefix, static_cast<size_t>(end - prefix));
    std::vector<grpc::Slice> parts;
    if (message.Dump(&parts).ok()) slices.insert(slices.end(), parts.begin(), parts.end());
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace muond::wire
