#include "server/transport/cuda_ipc/cuda_ipc_step.h"

#include <set>

#include "absl/cleanup/cleanup.h"
#include "common/status_macros.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/device/device_tensors.h"

namespace muond::transport {

absl::StatusOr<std::vector<CudaTensorPlace>> ResolveCudaTensors(
    const session::SessionConfig& config, const CudaMemoryRegions& regions, const std::string& caller,
    const BoundSession& session, const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs,
    absl::string_view field, bool require_all, int rank) {
  MUOND_ASSIGN_OR_RETURN(auto checked, ResolveRegionTensors<CudaRegion>(
                                           config, refs, field, require_all, /*aligned=*/true, rank,
                                           [&](const std::string& region, const std::string& at) {
                                             return regions.Find(caller, region, session, at);
                                           },
                                           [](const CudaRegion& region) { return region.memory->size(); }));
  std::vector<CudaTensorPlace> places;
  for (auto& [ref, region] : checked) places.push_back({ref, std::move(region)});
  return places;
}

absl::Status AwaitClientEvents(const std::vector<CudaTensorPlace>& places, const EventWait& wait) {
  std::set<const CudaRegion*> awaited;
  for (const CudaTensorPlace& place : places) {
    if (awaited.insert(place.region.get()).second) {
      MUOND_RETURN_IF_ERROR(place.region->event->Await(wait.deadline, wait.caller_gone));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaIpcGradientSource::ReadGradients(session::IncomingStep& step) {
  if (step.replay()) return absl::OkStatus();  // applied already: the gradients are not needed again
  // The client recorded its event after writing the gradients.
  MUOND_RETURN_IF_ERROR(AwaitClientEvents(places_, wait_));
  for (const CudaTensorPlace& place : places_) {
    MUOND_RETURN_IF_ERROR(TakeDeviceGradient(*backend_, step, place.ref.index, place.ref.dtype, place.data(),
                                             place.ref.bytes, host_bytes_));
    bytes_received_ += static_cast<int64_t>(place.ref.bytes);
  }
  return absl::OkStatus();
}

absl::Status CudaIpcParameterSink::Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) {
  if (outcome.parameters != nullptr) {
    // Once more for a replay (whose gradients were not read): what the client wrote before its
    // event must land before the answer, not on top of it.
    MUOND_RETURN_IF_ERROR(AwaitClientEvents(places_, wait_));
    // The gate is held until the parameters are in the memory: a later call's answer cannot pass
    // this one's. The parameters are held from before the gate is taken.
    MUOND_RETURN_IF_ERROR(parameters.Hold());
    absl::Cleanup release = [&] { parameters.Release(); };
    const absl::Status written = claims_.Write([&] { return wait_.caller_gone && wait_.caller_gone(); },
                                               [&] { return WriteParameters(outcome, parameters); }, "CUDA memory");
    MUOND_RETURN_IF_ERROR(written);
  }
  result_ = ToProto(outcome.result);
  return absl::OkStatus();
}

absl::Status CudaIpcParameterSink::WriteParameters(const session::StepOutcome& outcome,
                                                   session::ParameterReader& parameters) {
  for (const CudaTensorPlace& place : places_) {
    if (outcome.parameters->on_device) {
      MUOND_RETURN_IF_ERROR(session_->CopyParameterOnDevice(*outcome.parameters, place.ref.index,
                                                            StorageOf(place.ref.dtype), place.data()));
    } else {
      MUOND_RETURN_IF_ERROR(PutDeviceParameter(*backend_, parameters.Values(place.ref.index), place.ref.dtype,
                                               place.data(), host_bytes_));
    }
    bytes_sent_ += static_cast<int64_t>(place.ref.bytes);
  }
  return backend_->Synchronize();
}

}  // namespace muond::transport
