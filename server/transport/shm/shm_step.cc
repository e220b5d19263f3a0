#include "server/transport/shm/shm_step.h"

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/partition.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/api_codec/bulk_codec.h"
#include "server/transport/api_codec/tensor_refs.h"

namespace muond::transport {

absl::StatusOr<std::vector<SharedTensorPlace>> ResolveSharedTensors(
    const session::SessionConfig& config, const SharedMemoryRegions& regions, const std::string& caller,
    const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs, absl::string_view field, bool require_all,
    int rank) {
  MUOND_ASSIGN_OR_RETURN(
      auto checked,
      ResolveRegionTensors<SharedMapping>(
          config, refs, field, require_all, /*aligned=*/false, rank,
          [&](const std::string& region, const std::string& at) { return regions.Find(caller, region, at); },
          [](const SharedMapping& mapping) { return static_cast<uint64_t>(mapping.size()); }));
  std::vector<SharedTensorPlace> places;
  for (auto& [ref, mapping] : checked) {
    places.push_back({ref.index, std::move(mapping), ref.offset, ref.bytes, ref.dtype});
  }
  return places;
}

namespace {

// A step staged into device buffers (a backend whose memory is not the host's) takes its gradients
// in batches of about this many decoded bytes, each on its way to the device while the next is
// decoded; on the host the optimizer reads them in place, and they are decoded in one batch.
constexpr size_t kStageBatchBytes = size_t{16} << 20;

}  // namespace

absl::Status ShmGradientSource::ReadGradients(session::IncomingStep& step) {
  if (step.replay()) return absl::OkStatus();  // applied already: the gradients are not needed again
  const size_t batch_limit = step.staged() != nullptr ? kStageBatchBytes : SIZE_MAX;
  std::vector<DecodeItem> batch;
  std::vector<std::pair<size_t, size_t>> batch_at;  // (parameter, first element) of each item
  size_t batch_bytes = 0;
  const auto flush = [&]() -> absl::Status {
    DecodeAll(batch, pool_);
    for (size_t k = 0; k < batch.size(); ++k) {
      const auto [index, offset] = batch_at[k];
      step.gradients()[index].sum_squares = batch[k].sum_squares;
      MUOND_RETURN_IF_ERROR(step.Stage(index, static_cast<int64_t>(offset), batch[k].out.size()));
    }
    batch.clear();
    batch_at.clear();
    batch_bytes = 0;
    return absl::OkStatus();
  };
  for (const SharedTensorPlace& place : places_) {
    HostTensor& tensor = step.gradients()[place.index];
    const size_t numel =
        static_cast<size_t>(session::PartElements(step.config(), place.index, step.plan().request.rank));
    if (tensor.values.size() != numel) tensor.values.resize(numel);
    tensor.sum_squares = 0.0;
    tensor.received = static_cast<int64_t>(numel);
    bytes_received_ += static_cast<int64_t>(place.bytes);
    if (numel == 0) {
      MUOND_RETURN_IF_ERROR(step.Stage(place.index, 0, 0));
      continue;
    }
    const size_t element = wire::ElementSize(place.dtype);
    const size_t segment = kSegmentBytes / element;
    for (size_t offset = 0; offset < numel;) {
      // A piece of the tensor that fills the batch ends at a whole segment; the rest goes in the next
      // batch, its sum carried on from this piece's.
      size_t take = numel - offset;
      const size_t room = (batch_limit - batch_bytes) / sizeof(float);
      if (take > room) {
        const size_t whole = room / segment * segment;
        if (whole == 0 && !batch.empty()) {
          MUOND_RETURN_IF_ERROR(flush());
          continue;
        }
        take = std::max(whole, std::min(segment, take));
      }
      batch.push_back({place.dtype, place.region->data() + place.offset + element * offset,
                       std::span<float>(tensor.values.data() + offset, take), tensor.sum_squares});
      batch_at.emplace_back(place.index, offset);
      batch_bytes += take * sizeof(float);
      offset += take;
      if (batch_bytes >= batch_limit) MUOND_RETURN_IF_ERROR(flush());
    }
  }
  if (!batch.empty()) MUOND_RETURN_IF_ERROR(flush());
  return absl::OkStatus();
}

absl::Status ShmParameterSink::Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) {
  if (outcome.parameters != nullptr) {  // else a prepare: the result alone
    // Held from before the region's gate is taken until the answer is in the region.
    MUOND_RETURN_IF_ERROR(parameters.Hold());
    absl::Cleanup release = [&] { parameters.Release(); };
    std::vector<EncodeItem> items;
    items.reserve(places_.size());
    for (const SharedTensorPlace& place : places_) {
      items.push_back({place.dtype, parameters.Values(place.index), place.region->data() + place.offset});
    }
    MUOND_RETURN_IF_ERROR(claims_.Write([&] { return given_up_ && given_up_(); },
                                        [&] {
                                          EncodeAll(items, pool_);
                                          return absl::OkStatus();
                                        },
                                        "shared-memory region"));
    for (const SharedTensorPlace& place : places_) {
      parameters.Finished(place.index);  // in the client's region: a writer from here on copies none
      bytes_sent_ += static_cast<int64_t>(place.bytes);
    }
  }
  result_ = ToProto(outcome.result);
  return absl::OkStatus();
}

}  // namespace muond::transport
