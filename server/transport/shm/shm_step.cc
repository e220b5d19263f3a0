#include "server/transport/shm/shm_step.h"

#include <span>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/v1/api_conversion.h"
#include "server/transport/v1/tensor_decode.h"
#include "server/transport/v1/tensor_refs.h"

namespace muond::transport {

absl::StatusOr<std::vector<SharedTensorPlace>> ResolveSharedTensors(
    const session::SessionConfig& config, const SharedMemoryRegions& regions, const std::string& caller,
    const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs, absl::string_view field, bool require_all) {
  MUOND_ASSIGN_OR_RETURN(
      auto checked,
      ResolveRegionTensors<SharedMapping>(
          config, refs, field, require_all, /*aligned=*/false,
          [&](const std::string& region, const std::string& at) { return regions.Find(caller, region, at); },
          [](const SharedMapping& mapping) { return static_cast<uint64_t>(mapping.size()); }));
  std::vector<SharedTensorPlace> places;
  for (auto& [ref, mapping] : checked) {
    places.push_back({ref.index, std::move(mapping), ref.offset, ref.bytes, ref.dtype});
  }
  return places;
}

absl::Status ShmGradientSource::ReadGradients(session::IncomingStep& step) {
  if (step.replay()) return absl::OkStatus();  // applied already: the gradients are not needed again
  for (const SharedTensorPlace& place : places_) {
    HostTensor& tensor = step.gradients()[place.index];
    const size_t numel = static_cast<size_t>(step.config().parameters[place.index].numel);
    if (tensor.values.size() != numel) tensor.values.resize(numel);
    tensor.sum_squares =
        DecodeSumSquares(place.dtype, absl::string_view(place.region->data() + place.offset, place.bytes),
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
