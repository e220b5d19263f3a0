#include "client/transport/parameter_output.h"

#include "absl/strings/str_cat.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {

absl::StatusOr<std::span<float>> Destination(const std::string& name, int64_t numel, const OutputSpans& into,
                                             ParameterMap* out) {
  if (auto given = into.find(name); given != into.end()) {
    if (given->second.size() != static_cast<size_t>(numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters_out['", name, "']: ", given->second.size(), " elements for a parameter of ", numel));
    }
    return given->second;
  }
  std::vector<float>& values = (*out)[name];
  values.resize(static_cast<size_t>(numel));
  return std::span<float>(values);
}

absl::Status ReadChunk(const v1::TensorChunk& meta, std::span<const absl::string_view> pieces, size_t bytes,
                       const std::map<std::string, int64_t>& numel, const OutputSpans& into, ParameterMap* out) {
  auto size = numel.find(meta.name());
  const size_t element = wire::ElementSize(meta.dtype());
  if (size == numel.end() || element == 0 || bytes % element != 0) {
    return absl::InternalError(absl::StrCat("malformed chunk from the daemon for '", meta.name(), "'"));
  }
  absl::StatusOr<std::span<float>> values = Destination(meta.name(), size->second, into, out);
  if (!values.ok()) return values.status();
  const size_t count = bytes / element;
  if (meta.offset() > values->size() || count > values->size() - meta.offset()) {
    return absl::InternalError(absl::StrCat("chunk for '", meta.name(), "' runs past its end"));
  }
  wire::PayloadReader(pieces).Read(meta.dtype(), values->subspan(meta.offset(), count));
  return absl::OkStatus();
}

absl::Status ReadChunk(const v1::TensorChunk& chunk, const std::map<std::string, int64_t>& numel,
                       const OutputSpans& into, ParameterMap* out) {
  const absl::string_view data = chunk.data();
  return ReadChunk(chunk, std::span<const absl::string_view>(&data, 1), data.size(), numel, into, out);
}

}  // namespace muond::client
