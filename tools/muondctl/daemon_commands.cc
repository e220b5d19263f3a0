#include "tools/muondctl/daemon_commands.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/muond_client.h"
#include "common/echo.h"
#include "google/protobuf/util/json_util.h"
#include "proto/wire/dtype_codec.h"
#include "server/durability/checkpoint.h"
#include "server/durability/file_util.h"
#include "tools/muondctl/group_health.h"

namespace muond::ctl {
namespace {

using nlohmann::ordered_json;

absl::StatusOr<std::string> ReadToken(const ConnectFlags& flags) {
  if (flags.auth_token_file.empty()) {
    const char* env = std::getenv("MUOND_AUTH_TOKEN");
    return std::string(env == nullptr ? "" : env);
  }
  std::ifstream in(flags.auth_token_file);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-token-file: cannot read ", flags.auth_token_file));
  }
  std::string line;
  while (std::getline(in, line)) {
    const std::string token(absl::StripAsciiWhitespace(line));
    if (!token.empty() && token[0] != '#') return token;
  }
  return absl::InvalidArgumentError(absl::StrCat("--auth-token-file: no token in ", flags.auth_token_file));
}

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const ConnectFlags& flags) {
  if (flags.endpoint.empty()) {
    return absl::InvalidArgumentError("--endpoint: empty; give the daemon's host:port (or set $MUOND_ENDPOINT)");
  }
  client::ClientOptions options;
  options.endpoint = flags.endpoint;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_seconds * 1000));
  options.connect_timeout = timeout;
  // Calls that move or write a whole state (export, checkpoint) may take minutes on a large session;
  // --timeout bounds the connection, and the calls get at least the clients' usual ten minutes.
  options.rpc_timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(10));
  options.max_step_attempts = 1;  // an operator's tool reports what happened; it does not retry
  options.use_tls = flags.use_tls;
  options.tls_ca_file = flags.tls_ca_file;
  options.tls_client_cert_file = flags.tls_client_cert_file;
  options.tls_client_key_file = flags.tls_client_key_file;
  options.tls_server_name_override = flags.tls_server_name;
  options.transport = "grpc";
  absl::StatusOr<std::string> token = ReadToken(flags);
  if (!token.ok()) return token.status();
  options.auth_token = *token;
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(std::move(options));
  // The client's message names its own options; say which flags to check.
  if (client.status().code() == absl::StatusCode::kUnavailable) {
    const bool tls = flags.use_tls || !flags.tls_ca_file.empty() || !flags.tls_client_cert_file.empty();
    return absl::UnavailableError(absl::StrCat(
        "cannot reach muond at ", flags.endpoint, " within ", flags.timeout_seconds, " s",
        tls ? " (TLS: check --tls-ca-file, --tls-server-name against the daemon's certificate and, for mutual TLS, "
              "--tls-client-cert-file)"
            : " (if the daemon serves TLS, give --tls-ca-file or --tls)"));
  }
  return client;
}

}  // namespace

absl::StatusOr<std::unique_ptr<client::Client>> ConnectDaemon(const ConnectFlags& flags) { return Connect(flags); }

namespace {

// The summary of `session_id` among the caller's sessions, or NOT_FOUND.
absl::StatusOr<v1::SessionSummary> FindSession(client::Client& client, const std::string& session_id) {
  absl::StatusOr<std::vector<v1::SessionSummary>> sessions = client.ListSessions();
  if (!sessions.ok()) return sessions.status();
  for (v1::SessionSummary& summary : *sessions) {
    if (summary.session_id() == session_id) return std::move(summary);
  }
  return absl::NotFoundError(absl::StrCat("no session '", session_id, "' on this daemon"));
}

ordered_json SummaryJson(const v1::SessionSummary& s) {
  return {{"session_id", s.session_id()},         {"last_step", s.last_step()},     {"num_tensors", s.num_tensors()},
          {"num_parameters", s.num_parameters()}, {"initialized", s.initialized()}, {"world_size", s.world_size()},
          {"state_bytes", s.state_bytes()}};
}

ordered_json SpecJson(const v1::SessionSpec& spec) {
  std::string text;
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  print.always_print_primitive_fields = true;  // a shard index of 0 is shown, not left out
  (void)google::protobuf::util::MessageToJsonString(spec, &text, print);
  return ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
}

}  // namespace

Answer Health(const ConnectFlags& flags) {
  Answer answer;
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  absl::StatusOr<bool> serving = client.ok() ? (*client)->Serving() : absl::StatusOr<bool>(client.status());
  if (!serving.ok()) {
    answer = ErrorAnswer(serving.status());
    answer.json["status"] = answer.exit_code == kExitUnreachable ? "UNREACHABLE" : "ERROR";
    return answer;
  }
  answer.json["status"] = *serving ? "SERVING" : "NOT_SERVING";
  answer.text = absl::StrCat(*serving ? "SERVING" : "NOT_SERVING", "\n");
  answer.exit_code = *serving ? kExitOk : kExitNo;
  return answer;
}

Answer Info(const ConnectFlags& flags) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
  if (!info.ok()) return ErrorAnswer(info.status());
  Answer answer;
  answer.json = {{"endpoint", flags.endpoint},
                 {"version", info->version()},
                 {"backend", info->backend()},
                 {"backend_detail", info->backend_detail()},
                 {"sessions", info->num_sessions()},
                 {"max_sessions", info->max_sessions()},
                 {"max_chunk_bytes", info->max_chunk_bytes()},
                 {"max_message_bytes", info->max_message_bytes()},
                 {"durability", info->durability()},
                 {"shm_socket", info->shm_socket()},
                 {"metrics_address", info->metrics_address()},
                 {"optimizers", std::vector<std::string>(info->optimizers().begin(), info->optimizers().end())},
                 {"ns_coefficient_sets",
                  std::vector<std::string>(info->ns_coefficient_sets().begin(), info->ns_coefficient_sets().end())}};
  const auto or_none = [](const std::string& value) { return value.empty() ? std::string("none") : value; };
  answer.text = absl::StrCat(
      "endpoint      ", flags.endpoint, "\n",                                  //
      "version       ", info->version(), "\n",                                 //
      "backend       ", info->backend(), " (", info->backend_detail(), ")\n",  //
      "sessions      ", info->num_sessions(), " of at most ", info->max_sessions(), "\n", "durability    ",
      or_none(info->durability()), "\n",                    //
      "shared memory ", or_none(info->shm_socket()), "\n",  //
      "metrics       ",
      info->metrics_address().empty() ? "off" : absl::StrCat("http://", info->metrics_address(), "/metrics"),
      "\n",                                                         //
      "max chunk     ", HumanBytes(info->max_chunk_bytes()), "\n",  //
      "optimizers    ", absl::StrJoin(info->optimizers(), ", "), "\n");
  return answer;
}

Answer ListSessions(const ConnectFlags& flags) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  absl::StatusOr<std::vector<v1::SessionSummary>> sessions = (*client)->ListSessions();
  if (!sessions.ok()) return ErrorAnswer(sessions.status());
  Answer answer;
  answer.json["sessions"] = ordered_json::array();
  answer.text = absl::StrFormat("%-32s %10s %8s %14s %6s %12s\n", "SESSION", "LAST STEP", "TENSORS", "PARAMETERS",
                                "RANKS", "STATE");
  for (const v1::SessionSummary& s : *sessions) {
    answer.json["sessions"].push_back(SummaryJson(s));
    absl::StrAppend(&answer.text, absl::StrFormat("%-32s %10d %8d %14d %6d %12s%s\n", s.session_id(), s.last_step(),
                                                  s.num_tensors(), s.num_parameters(), s.world_size(),
                                                  HumanBytes(static_cast<double>(s.state_bytes())),
                                                  s.initialized() ? "" : "  (awaiting parameters)"));
  }
  return answer;
}

Answer ShowSession(const ConnectFlags& flags, const std::string& session_id) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  absl::StatusOr<v1::SessionSummary> s = FindSession(**client, session_id);
  if (!s.ok()) return ErrorAnswer(s.status());
  Answer answer;
  answer.json = SummaryJson(*s);
  answer.json["spec"] = s->spec_omitted() ? ordered_json(nullptr) : SpecJson(s->spec());
  if (s->spec_omitted()) answer.json["spec_omitted"] = true;
  answer.json["telemetry"] = GroupHealthJson(*s);
  answer.text = absl::StrCat("session       ", s->session_id(), "\n",  //
                             "last step     ", s->last_step(), "\n",   //
                             "initialized   ", s->initialized() ? "yes" : "no (parameters not uploaded yet)", "\n",
                             "ranks         ", s->world_size(), "\n",  //
                             "parameters    ", s->num_parameters(), " in ", s->num_tensors(), " tensors\n",
                             "state         ", HumanBytes(static_cast<double>(s->state_bytes())), " (estimated)\n");
  if (s->spec_omitted()) {
    absl::StrAppend(&answer.text, "spec          not shown: too large for one ListSessions answer\n",
                    GroupHealthText(*s));
    return answer;
  }
  if (s->spec().has_shard()) {
    absl::StrAppend(&answer.text, "shard         ", s->spec().shard().index(), " of ",
                    s->spec().shard().endpoints_size(), " (", absl::StrJoin(s->spec().shard().endpoints(), ", "),
                    ")\n");
  }
  if (!s->spec().labels().empty()) {
    const std::map<std::string, std::string> labels(s->spec().labels().begin(), s->spec().labels().end());
    absl::StrAppend(&answer.text, "labels        ", absl::StrJoin(labels, ", ", absl::PairFormatter("=")), "\n");
  }
  absl::StrAppend(&answer.text, "groups\n");
  for (const v1::ParameterGroup& group : s->spec().groups()) {
    absl::StrAppend(&answer.text, "  ", group.name(), ": ",
                    group.options().optimizer() == v1::OPTIMIZER_UNSPECIFIED
                        ? std::string("muon")
                        : absl::AsciiStrToLower(v1::OptimizerKind_Name(group.options().optimizer()).substr(10)),
                    "\n");
  }
  absl::StrAppend(&answer.text, "parameters\n");
  for (const v1::ParameterSpec& p : s->spec().parameters()) {
    absl::StrAppend(&answer.text, "  ", p.name(), " [", absl::StrJoin(p.shape(), ", "), "] group ", p.group(), "\n");
  }
  absl::StrAppend(&answer.text, GroupHealthText(*s));
  return answer;
}

Answer CheckpointSession(const ConnectFlags& flags, const std::string& session_id) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  v1::CheckpointRequest request;
  request.set_session_id(session_id);
  v1::CheckpointResponse response;
  grpc::ClientContext context;
  (*client)->PrepareContext(context);
  const grpc::Status status = (*client)->stub().Checkpoint(&context, request, &response);
  if (!status.ok()) return ErrorAnswer(client::FromGrpcStatus(status));
  Answer answer;
  answer.json = {{"session_id", session_id}, {"step", response.step()}};
  answer.text = absl::StrCat("session ", session_id, " checkpointed at step ", response.step(), "\n");
  return answer;
}

Answer DigestSession(const ConnectFlags& flags, const std::string& session_id) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  v1::GetStateDigestRequest request;
  request.set_session_id(session_id);
  v1::StateDigest response;
  grpc::ClientContext context;
  (*client)->PrepareContext(context);
  const grpc::Status status = (*client)->stub().GetStateDigest(&context, request, &response);
  if (!status.ok()) return ErrorAnswer(client::FromGrpcStatus(status));
  Answer answer;
  answer.json = {{"session_id", session_id},          {"step", response.step()},
                 {"algorithm", response.algorithm()}, {"digest", response.digest()},
                 {"format", response.format()},       {"num_tensors", response.num_tensors()},
                 {"num_bytes", response.num_bytes()}};
  answer.text =
      absl::StrCat(session_id, ": step ", response.step(), " ", response.algorithm(), ":", response.digest(), "\n  ",
                   response.num_tensors(), " tensors, ", HumanBytes(static_cast<double>(response.num_bytes())), "\n");
  return answer;
}

Answer CloseSession(const ConnectFlags& flags, const std::string& session_id) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  if (absl::Status closed = (*client)->CloseSession(session_id); !closed.ok()) return ErrorAnswer(closed);
  Answer answer;
  answer.json = {{"session_id", session_id}, {"closed", true}};
  answer.text = absl::StrCat("session ", session_id, " closed\n");
  return answer;
}

Answer ExportSession(const ConnectFlags& flags, const std::string& session_id, const std::string& to) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = Connect(flags);
  if (!client.ok()) return ErrorAnswer(client.status());
  absl::StatusOr<v1::SessionSummary> summary = FindSession(**client, session_id);
  if (!summary.ok()) return ErrorAnswer(summary.status());
  if (summary->spec_omitted()) {
    return ErrorAnswer(absl::FailedPreconditionError(
        absl::StrCat("session '", session_id,
                     "': its spec, which the export reads its shapes from, is too large for one ListSessions answer; "
                     "read the state with a client (GetState) instead")));
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const v1::ParameterSpec& p : summary->spec().parameters())
    shapes[p.name()] = {p.shape().begin(), p.shape().end()};

  durability::CheckpointData data;
  data.session_id = session_id;
  data.backend = "export";
  std::map<std::pair<std::string, std::string>, size_t> index;  // (parameter, slot) → data.tensors
  std::map<size_t, size_t> received;                            // data.tensors index → elements the daemon sent
  // Every stored element takes at least 2 bytes of the session's estimate (state_bytes): what the
  // answer's shapes may claim in all, before anything is allocated for them.
  const int64_t max_elements = std::max<int64_t>(summary->state_bytes(), 0) / 2;
  int64_t claimed = 0;
  v1::GetStateRequest request;
  request.set_session_id(session_id);
  request.set_stored_dtypes(true);  // 16-bit tensors come, and are written, as such
  grpc::ClientContext context;
  (*client)->PrepareContext(context);
  std::unique_ptr<grpc::ClientReader<v1::GetStateResponse>> reader = (*client)->stub().GetState(&context, request);
  v1::GetStateResponse response;
  while (reader->Read(&response)) {
    if (response.has_header()) {
      data.last_step = response.header().last_step();
      for (const v1::ParameterStepCount& c : response.header().step_counts())
        data.step_counts.emplace_back(c.name(), c.count());
      if (response.header().has_loss_scaler()) {
        const v1::LossScalerState& scaler = response.header().loss_scaler();
        data.loss_scaler =
            durability::CheckpointLossScaler{scaler.scale(), scaler.growth_tracker(), scaler.hysteresis_tracker()};
      }
      continue;
    }
    const v1::TensorChunk& chunk = response.chunk();
    auto shape = shapes.find(chunk.name());
    if (shape == shapes.end()) {
      context.TryCancel();
      return ErrorAnswer(
          absl::InternalError(absl::StrCat("the daemon sent state for unknown parameter '", chunk.name(), "'")));
    }
    auto [it, added] = index.emplace(std::make_pair(chunk.name(), chunk.slot()), data.tensors.size());
    if (added) {
      // The tensor's own shape, from its first chunk (a daemon that sends none: the parameter's).
      std::vector<int64_t> dims =
          chunk.shape_size() > 0 ? std::vector<int64_t>(chunk.shape().begin(), chunk.shape().end()) : shape->second;
      int64_t numel = 1;
      for (int64_t d : dims) {
        // Checked one dimension at a time, so the product never overflows.
        if (d < 0 || d > (int64_t{1} << 40) || (d > 0 && numel > (int64_t{1} << 40) / d)) {
          context.TryCancel();
          return ErrorAnswer(absl::InternalError(absl::StrCat("the daemon sent a bad shape for '", chunk.name(), "'")));
        }
        numel *= d;
      }
      claimed += numel;
      if (claimed > max_elements) {
        context.TryCancel();
        return ErrorAnswer(absl::InternalError(
            absl::StrCat("the daemon sent more state than its session's state_bytes (", summary->state_bytes(),
                         ") holds, at '", Echo(chunk.name()), "' (", numel, " elements)")));
      }
      const v1::DType dtype = chunk.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : chunk.dtype();
      if (!wire::IsConcrete(dtype)) {
        context.TryCancel();
        return ErrorAnswer(
            absl::InternalError(absl::StrCat("the daemon sent '", chunk.name(), "' in an unknown dtype")));
      }
      data.tensors.push_back({chunk.name(), chunk.slot(), std::move(dims),
                              std::vector<float>(static_cast<size_t>(numel)),
                              dtype == v1::DTYPE_BF16   ? "BF16"
                              : dtype == v1::DTYPE_FP16 ? "F16"
                                                        : "F32"});
    }
    std::vector<float>& values = data.tensors[it->second].values;
    const v1::DType dtype = chunk.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : chunk.dtype();
    if (!wire::IsConcrete(dtype) || chunk.data().size() % wire::ElementSize(dtype) != 0) {
      context.TryCancel();
      return ErrorAnswer(
          absl::InternalError(absl::StrCat("the daemon sent a malformed chunk of '", chunk.name(), "'")));
    }
    const size_t count = chunk.data().size() / wire::ElementSize(dtype);
    if (chunk.offset() > values.size() || count > values.size() - chunk.offset()) {
      context.TryCancel();
      return ErrorAnswer(absl::InternalError(
          absl::StrCat("the daemon sent a chunk of '", chunk.name(), "/", chunk.slot(), "' beyond its shape")));
    }
    wire::Decode(dtype, chunk.data(), std::span<float>(values.data() + chunk.offset(), count));
    received[it->second] = std::max(received[it->second], chunk.offset() + count);
  }
  if (const grpc::Status status = reader->Finish(); !status.ok()) return ErrorAnswer(client::FromGrpcStatus(status));
  for (size_t i = 0; i < data.tensors.size(); ++i) {
    if (received[i] < data.tensors[i].values.size() && data.tensors[i].slot == "master") {
      return ErrorAnswer(
          absl::InternalError(absl::StrCat("the daemon sent ", received[i], " of ", data.tensors[i].values.size(),
                                           " elements of '", data.tensors[i].parameter, "'")));
    }
    if (received[i] < data.tensors[i].values.size()) {
      // A daemon that sends no shapes: a slot smaller than its parameter (NorMuon's) is written flat.
      data.tensors[i].values.resize(received[i]);
      data.tensors[i].shape = {static_cast<int64_t>(received[i])};
    }
  }

  const std::string bytes = durability::EncodeSafetensors(data);
  if (absl::Status written = durability::WriteFileAtomically(durability::Env::Default(), to, bytes); !written.ok()) {
    return ErrorAnswer(absl::InvalidArgumentError(absl::StrCat("--to: ", written.message())));
  }
  Answer answer;
  answer.json = {{"session_id", session_id},
                 {"step", data.last_step},
                 {"file", to},
                 {"tensors", data.tensors.size()},
                 {"bytes", bytes.size()}};
  answer.text = absl::StrCat("session ", session_id, " at step ", data.last_step, ": ", data.tensors.size(),
                             " tensors (", HumanBytes(static_cast<double>(bytes.size())), ") written to ", to, "\n");
  return answer;
}

}  // namespace muond::ctl
