// MuondService: server information and session management.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/options.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/session_spec_codec.h"
#include "server/transport/api_codec/api_conversion.h"

namespace muond::rpc {
namespace {
constexpr size_t kMinAnswerChunkBytes = 64u << 10;
// A list entry's framing (field tag and length) beside its summary's own bytes.
constexpr size_t kListEntryOverhead = 16;

// The summaries one ListSessions answer may carry: a message limit (the daemon's or the caller's)
// less room for the answer's own fields, or 4 MiB under a service built without a limit.
size_t ListPageBytes(size_t max_message_bytes) {
  constexpr size_t kRoom = 64u << 10;
  if (max_message_bytes == 0) return 4u << 20;
  return max_message_bytes > 2 * kRoom ? max_message_bytes - kRoom : max_message_bytes / 2;
}

v1::SessionSummary Summarize(const session::Session& session) {
  v1::SessionSummary summary;
  summary.set_session_id(session.id());
  summary.set_last_step(session.last_step());
  summary.set_num_tensors(static_cast<int32_t>(session.config().parameters.size()));
  summary.set_num_parameters(session.config().total_elements);
  summary.set_initialized(session.initialized());
  summary.set_world_size(session.config().world_size);
  summary.set_state_bytes(session.state_bytes());
  const session::HealthWatch::Latest health = session.LatestHealth();
  summary.set_telemetry_step(health.step);
  for (const auto& clip : health.clips) *summary.add_group_clips() = transport::ToProto(clip);
  for (const auto& t : health.telemetry) *summary.add_group_telemetry() = transport::ToProto(t);
  for (size_t g = 0; g < health.history.size() && g < health.telemetry.size(); ++g) {
    v1::GroupHistory* history = summary.add_group_history();
    history->set_group(health.telemetry[g].group);
    history->mutable_grad_norm()->Add(health.history[g].grad_norm.begin(), health.history[g].grad_norm.end());
    history->mutable_update_rms()->Add(health.history[g].update_rms.begin(), health.history[g].update_rms.end());
  }
  const session::Session::Activity activity = session.activity();
  summary.set_last_transport(activity.last_transport);
  const absl::Time now = absl::Now();
  for (const absl::Time seen : activity.rank_seen) {
    summary.add_rank_idle_seconds(seen == absl::InfinitePast() ? -1.0 : absl::ToDoubleSeconds(now - seen));
  }
  if (absl::StatusOr<v1::SessionSpec> spec = SpecFromJson(session.config().spec_json); spec.ok()) {
    *summary.mutable_spec() = *std::move(spec);
  }
  return summary;
}
}  // namespace

size_t MuondService::AnswerChunkBytes(uint32_t requested) const {
  if (requested == 0) return options_.default_chunk_bytes;
  // A floor, so a tiny request cannot make the daemon send one element per message.
  const size_t floor = std::min<size_t>(kMinAnswerChunkBytes, options_.max_chunk_bytes);
  return std::clamp<size_t>(requested, floor, options_.max_chunk_bytes);
}

grpc::Status MuondService::GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest*,
                                         v1::ServerInfo* info) {
  return Serve(calls_, context, "GetServerInfo", [&](const std::string&) {
    info->set_version(MUOND_VERSION);
    info->set_backend(backend_->Name());
    info->set_backend_detail(backend_->Detail());
    info->set_max_chunk_bytes(options_.max_chunk_bytes);
    info->set_streamed_steps(true);
    info->set_packed_chunks(true);
    info->set_whole_steps(true);
    info->set_max_message_bytes(options_.max_message_bytes);
    for (const std::string& name : optim::OptimizerNames()) info->add_optimizers(name);
    for (const std::string& name : optim::NamedScheduleNames()) info->add_ns_coefficient_sets(name);
    info->set_num_sessions(static_cast<int32_t>(registry_->size()));
    if (options_.transports.shm_regions != nullptr) {
      info->set_shm_socket(options_.transports.shm_socket);
      info->set_shm_grants(true);
    }
    info->set_host_id(options_.host_id);
    info->set_metrics_address(options_.metrics_address);
    info->set_durability(options_.durability);
    info->set_max_sessions(options_.max_sessions);
    info->set_cuda_ipc(options_.transports.cuda_regions != nullptr && !backend_->DeviceUuid().empty());
    info->set_cuda_device_uuid(backend_->DeviceUuid());
    info->set_nccl_version(options_.transports.nccl_channels != nullptr ? backend_->NcclVersion() : 0);
    if (options_.transports.nccl_channels != nullptr)
      info->set_max_nccl_channels(options_.transports.nccl_channels->limits().max_channels);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::CreateSession(grpc::ServerContext* context, const v1::CreateSessionRequest* request,
                                         v1::CreateSessionResponse* response) {
  return Serve(calls_, context, "CreateSession", [&](const std::string& caller) -> absl::Status {
    // Checked before anything is created; the spec's world_size (0 means 1) bounds it.
    const int world_size = std::max(request->spec().world_size(), 1);
    if (request->has_rank() && (request->rank() < 0 || request->rank() >= world_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank: must be in [0, spec.world_size ", world_size, "), got ", request->rank()));
    }
    MUOND_ASSIGN_OR_RETURN(
        session::CreateResult created,
        registry_->CreateOrAttach(request->session_id(), SpecToJson(request->spec()), caller, request->create_token()));
    const session::Session& session = *created.session;
    response->set_session_id(session.id());
    response->set_attached(created.attached);
    const session::Session::LastStepOverrides last = session.LastOverrides();
    response->set_last_step(last.step);
    if (last.overrides.has_value()) {
      for (const session::GroupOverride& o : *last.overrides) *response->add_last_overrides() = transport::ToProto(o);
      response->set_last_overrides_known(true);
    }
    response->set_initialized(session.initialized());
    if (const double scale = session.loss_scale(); scale != 0) response->set_loss_scale(scale);
    response->set_num_parameters(session.config().total_elements);
    if (request->has_rank()) response->set_last_push(session.LastPush(request->rank()).push);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                                        v1::CloseSessionResponse*) {
  return Serve(calls_, context, "CloseSession", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(const uint64_t serial, registry_->Close(request->session_id(), caller));
    // Its GPU transports go with it (CUDA IPC handles closed, NCCL communicators aborted), not those
    // of a session created under the same id since.
    const transport::BoundSession closed{request->session_id(), serial};
    if (options_.transports.cuda_regions != nullptr) options_.transports.cuda_regions->DropSession(closed);
    if (options_.transports.nccl_channels != nullptr) options_.transports.nccl_channels->DropSession(closed);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest* request,
                                        v1::ListSessionsResponse* response) {
  return Serve(calls_, context, "ListSessions", [&](const std::string& caller) -> absl::Status {
    if (request->page_size() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_size: must be 0 (as many as fit) or more, got ", request->page_size()));
    }
    if (request->max_answer_bytes() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_answer_bytes: must be 0 (none given) or more, got ", request->max_answer_bytes()));
    }
    const size_t page_size = request->page_size() == 0 ? SIZE_MAX : static_cast<size_t>(request->page_size());
    size_t page_bytes = ListPageBytes(options_.max_message_bytes);
    if (request->max_answer_bytes() > 0) {
      page_bytes = std::min(page_bytes, ListPageBytes(static_cast<size_t>(request->max_answer_bytes())));
    }
    size_t bytes = 0;
    // The token is the last id of the page before; ids are listed in order, so sessions created or
    // closed between two pages never make a page repeat or skip one that stayed.
    for (const auto& session : registry_->ListOwnedBy(caller)) {
      if (!request->page_token().empty() && session->id() <= request->page_token()) continue;
      v1::SessionSummary summary = Summarize(*session);
      size_t summary_bytes = summary.ByteSizeLong() + kListEntryOverhead;
      if (summary_bytes > page_bytes) {  // a spec too large for any page: left out, said so
        summary.clear_spec();
        summary.set_spec_omitted(true);
        summary_bytes = summary.ByteSizeLong() + kListEntryOverhead;
      }
      if (response->sessions_size() > 0 &&
          (static_cast<size_t>(response->sessions_size()) >= page_size || bytes + summary_bytes > page_bytes)) {
        response->set_next_page_token(response->sessions(response->sessions_size() - 1).session_id());
        break;
      }
      bytes += summary_bytes;
      *response->add_sessions() = std::move(summary);
    }
    return absl::OkStatus();
  });
}

grpc::Status MuondService::Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* request,
                                      v1::CheckpointResponse* response) {
  return Serve(calls_, context, "Checkpoint", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request->session_id(), caller));
    MUOND_ASSIGN_OR_RETURN(int64_t step, session->Checkpoint());
    response->set_step(step);
    MUOND_EVENT(info, "checkpoint_requested", request->session_id(), step, "session {} checkpointed at step {}",
                request->session_id(), step);
    return absl::OkStatus();
  });
}

}  // namespace muond::rpc
