#include "proto/wire/unparsable_message.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/wire_format_lite.h"

namespace muond::wire {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// Protobuf's own default nesting limit: deeper messages fail its parse too.
constexpr int kMaxDepth = 100;

// Walks the fields of one message of `type` up to `in`'s limit (`whole` is everything `in` reads).
// False when the encoding is malformed; otherwise `*found` holds the path of the first string field
// that is not UTF-8, or stays empty.
bool Walk(const Descriptor& type, absl::string_view whole, CodedInputStream& in, const std::string& prefix, int depth,
          std::string* found) {
  std::unordered_map<int, int> seen;  // per field number, how many came: a repeated field's index
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.ConsumedEntireMessage();  // the end, or a tag of field 0 (malformed)
    const FieldDescriptor* field = type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const bool delimited = WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
    if (field == nullptr || !delimited ||
        (field->type() != FieldDescriptor::TYPE_STRING && field->type() != FieldDescriptor::TYPE_MESSAGE)) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    std::string path = absl::StrCat(prefix, field->name());
    const int index = seen[field->number()]++;
    // A repeated field's element by its index; a map's entries have no order to index by.
    if (field->is_repeated() && !field->is_map()) absl::StrAppend(&path, "[", index, "]");
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) return false;
    if (field->type() == FieldDescriptor::TYPE_STRING) {
      const absl::string_view value = whole.substr(static_cast<size_t>(in.CurrentPosition()), length);
      if (!google::protobuf::internal::IsStructurallyValidUTF8(value.data(), static_cast<int>(value.size()))) {
        *found = std::move(path);
        return true;
      }
      if (!in.Skip(static_cast<int>(length))) return false;
      continue;
    }
    if (depth >= kMaxDepth) return false;
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    if (!Walk(*field->message_type(), whole, in, path + ".", depth + 1, found)) return false;
    if (!found->empty()) return true;
    in.PopLimit(limit);
  }
}

}  // namespace

std::string FirstNonUtf8Field(const Descriptor& type, absl::string_view bytes) {
  if (bytes.size() > static_cast<size_t>(INT32_MAX)) return std::string();  // more than protobuf parses
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int>(bytes.size()));
  in.PushLimit(static_cast<int>(bytes.size()));  // BytesUntilLimit bounds every length read
  std::string found;
  if (!Walk(type, bytes, in, "", 0, &found)) return std::string();
  return found;
}

absl::Status ExplainUnparsable(const Descriptor& type, absl::string_view bytes, absl::string_view what) {
  const std::string field = FirstNonUtf8Field(type, bytes);
  if (!field.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": is not UTF-8 (a string field holds UTF-8 text; nothing of the ", what, " was used)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": not a valid ", type.full_name(), " (its protobuf encoding is malformed)"));
}

}  // namespace muond::wire
