#include "server/transport/shm/shm_step.h"

#include <span>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/grpc/api_conversion.h"
#include "server/transport/grpc/tensor_assembler.h"

namespace muond::transport {

absl::StatusOr<std::vector<SharedTensorPlace>> ResolveSharedTensors(
    const session::SessionConfig& config, const SharedMemoryRegions& regions, const std::string& caller,
    const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs, absl::string_view field, bool require_all) {
  std::vector<SharedTensorPlace> places;
  std::vector<bool> seen(config.parameters.size(), false);
  for (int i = 0; i < refs.size(); ++i) {
    const v1::SharedTensor& ref = refs[i];
    const std::string at = absl::StrCat(field, "[", i, "]");
    auto it = config.parameter_index.find(ref.name());
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat(at, ".name: unknown parameter '", ref.name(), "'"));
    }
    if (seen[it->second]) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: '", ref.name(), "' appears twice"));
    }
    seen[it->second] = true;
    const v1::DType dtype = ref.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : ref.dtype();
    if (!wire::IsConcrete(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".dtype: unknown dtype ", static_cast<int>(ref.dtype())));
    }
    const uint64_t numel = static_cast<uint64_t>(config.parameters[it->second].numel);
    const uint64_t want = numel * wire::ElementSize(dtype);
    if (ref.byte_size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".byte_size: '", ref.name(), "' has ", numel, " elements, ",
                                                     want, " bytes in ", wire::DTypeName(dtype), "; got ",
                                                     ref.byte_size()));
    }
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<SharedMapping> region,
                           regions.Find(caller, ref.region(), absl::StrCat(at, ".region")));
    if (!WithinRegion(ref.offset(), ref.byte_size(), region->size())) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".offset: ", ref.byte_size(), " bytes at offset ",
                                                     ref.offset(), " end past region '", ref.region(), "' (",
                                                     region->size(), " bytes)"));
    }
    places.push_back({it->second, std::move(region), ref.offset(), ref.byte_size(), dtype});
  }
  if (require_all) {
    for (size_t p = 0; p < seen.size(); ++p) {
      if (!seen[p]) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": no place for parameter '", config.parameters[p].name,
                                                       "'; every parameter needs one"));
      }
    }
  }
  return places;
}

absl::Status ShmGradientSource::ReadGradients(session::IncomingStep& step) {
  if (step.replay()) return absl::OkStatus();  // applied already: the gradients are not needed again
  for (const SharedTensorPlace& place : places_) {
    HostTensor& tensor = step.gradients()[place.index];
    const size_t numel = static_cast<size_t>(step.config().parameters[place.index].numel);
    if (tensor.values.size() != numel) tensor.values.resize(numel);
    tensor.sum_squares = DecodeSumSquares(place.dtype, absl::string_view(place.region->data() + place.offset, place.bytes),
                                          std::span<float>(tensor.values.data(), numel));
    tensor.received = static_cast<int64_t>(numel);
    bytes_received_ += static_cast<int64_t>(place.bytes);
    MUOND_RETURN_IF_ERROR(step.Stage(place.index, 0, numel));
  }
  return absl::OkStatus();
}

absl::Status ShmParameterSink::Send(const session::StepOutcome& outcome) {
  for (const SharedTensorPlace& place : places_) {
    if (outcome.parameters == nullptr) break;  // a prepare: the result alone
    wire::EncodeTo(place.dtype, outcome.parameters->values[place.index], place.region->data() + place.offset);
    bytes_sent_ += static_cast<int64_t>(place.bytes);
  }
  result_ = ToProto(outcome.result);
  return absl::OkStatus();
}

}  // namespace muond::transport
