#include "client/muond_client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "client/error_reason.h"
#include "client/streamed_step.h"
#include "client/transport/grpc_step_transport.h"
#include "client/transport/grpc_streamed_try.h"
#include "client/transport/parameter_output.h"
#include "client/transport/step_transport.h"
#include "client/transport/transport_choice.h"
#include "common/partition_rules.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {
namespace {

// The Step method of muond.v1.Muond, called over byte buffers (Session::StepOnce).
constexpr char kStepMethod[] = "/muond.v1.Muond/Step";
constexpr char kWholeStepMethod[] = "/muond.v1.Muond/StepWhole";

std::map<std::string, int64_t> ElementCounts(const v1::SessionSpec& spec) {
  std::map<std::string, int64_t> counts;
  for (const auto& p : spec.parameters()) {
    int64_t n = 1;
    for (int64_t d : p.shape()) n *= d;
    counts[p.name()] = n;
  }
  return counts;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* option) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("ClientOptions.", option, ": cannot read '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool UsesTls(const ClientOptions& options) {
  return options.use_tls || !options.tls_ca_file.empty() || !options.tls_client_cert_file.empty() ||
         !options.tls_client_key_file.empty();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientOptions& options) {
  if (!UsesTls(options)) return grpc::InsecureChannelCredentials();
  if (options.tls_client_cert_file.empty() != options.tls_client_key_file.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.tls_client_cert_file and tls_client_key_file go together: set both or neither");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> roots = ReadFile(options.tls_ca_file, "tls_ca_file");
    if (!roots.ok()) return roots.status();
    ssl.pem_root_certs = *std::move(roots);
  }
  if (!options.tls_client_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFile(options.tls_client_cert_file, "tls_client_cert_file");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile(options.tls_client_key_file, "tls_client_key_file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

// Unary calls that are safe to repeat are retried on UNAVAILABLE: the daemon may be restarting, or
// the connection may have died with the previous daemon process. `call` builds its own context.
template <typename Call>
absl::Status RetryWhileUnavailable(const Client& client, Call&& call) {
  std::chrono::milliseconds backoff = client.options().retry_backoff;
  absl::Status before;
  for (int attempt = 1;; ++attempt) {
    grpc::Status status = call();
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE)
      return OnLaterTry(FromGrpcStatus(status), attempt, before);
    before = FromGrpcStatus(status);
    if (attempt >= client.options().max_step_attempts) return AfterTries(before, attempt);
    client.PauseBeforeRetry(backoff);
    backoff *= 2;
  }
}

}  // namespace

bool IsTransient(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

void CopyResult(const v1::StepResult& r, StepReply* reply) {
  reply->step = r.step();
  reply->applied = r.applied();
  reply->replayed = r.replayed();
  reply->skip_reason = r.skip_reason();
  reply->grad_norm = r.grad_norm();
  reply->compute_seconds = r.compute_seconds();
  reply->prepared = r.prepared();
  reply->sum_squares.assign(r.sum_squares().begin(), r.sum_squares().end());
  reply->num_zeros_in_grad = r.num_zeros_in_grad();
  reply->loss_scale = r.loss_scale();
  reply->contributors.assign(r.contributors().begin(), r.contributors().end());
  reply->total_weight = r.total_weight();
  for (const v1::GroupClip& clip : r.group_clips()) {
    reply->group_clips[clip.group()] = {clip.grad_norm(), clip.coefficient()};
  }
  for (const v1::GroupTelemetry& t : r.group_telemetry()) reply->group_telemetry[t.group()] = t;
  reply->global_step = r.global_step();
  reply->staleness = r.staleness();
  reply->included = r.included();
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      chunk_bytes_(options_.chunk_bytes),
      channel_(std::move(channel)),
      stub_(v1::Muond::NewStub(channel_)),
      step_method_(kStepMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel_),
      whole_step_method_(kWholeStepMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel_),
      slice_pool_(wire::SlicePool::Create(options_.chunk_bytes)) {}

namespace {

// INVALID_ARGUMENT naming the first option that cannot work, before anything connects.
absl::Status CheckOptions(const ClientOptions& options) {
  // gRPC takes an empty target and waits out connect_timeout failing to resolve it.
  if (options.endpoint.empty()) return absl::InvalidArgumentError("endpoint: empty; give the daemon's host:port");
  if (absl::Status named = CheckTransportName(options.transport); !named.ok()) return named;
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes: must be at least 1 byte, got 0");
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes: must be above 0, got ", options.max_message_bytes));
  }
  // A chunk's payload travels with its parameter's name and fields in one gRPC message, sent and
  // received within max_message_bytes.
  constexpr size_t kChunkFraming = 64 << 10;
  if (options.chunk_bytes > static_cast<size_t>(options.max_message_bytes) ||
      static_cast<size_t>(options.max_message_bytes) - options.chunk_bytes < kChunkFraming) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: ", options.chunk_bytes, " bytes and a chunk's framing (up to ", kChunkFraming,
                     " bytes) must fit in max_message_bytes (", options.max_message_bytes, "); lower chunk_bytes"));
  }
  if (options.max_step_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_step_attempts: must be at least 1, got ", options.max_step_attempts));
  }
  for (const auto& [name, duration, zero] :
       {std::tuple{"rpc_timeout", options.rpc_timeout, false},
        std::tuple{"connect_timeout", options.connect_timeout, false},
        std::tuple{"retry_backoff", options.retry_backoff, true},
        std::tuple{"max_reconnect_backoff", options.max_reconnect_backoff, false}}) {
    if (duration.count() < 0 || (duration.count() == 0 && !zero)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be ", zero ? "at least 0" : "above 0", " ms, got ", duration.count()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void Warn(const ClientOptions& options, const std::string& line) {
  if (options.warn) {
    options.warn(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (absl::Status checked = CheckOptions(options); !checked.ok()) return checked;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect quickly after a daemon restart (gRPC's default backoff grows to two minutes). Not
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC uses it as the time one connection attempt may take
  // (20 s by default), and at 100 ms every attempt that is not noticed within that time (see
  // PauseBeforeRetry) is abandoned and started over.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(options.max_reconnect_backoff.count()));
  if (!options.tls_server_name_override.empty()) args.SetSslTargetNameOverride(options.tls_server_name_override);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = ChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  auto channel = grpc::CreateCustomChannel(options.endpoint, *credentials, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + options.connect_timeout)) {
    // A TLS mismatch looks like an unreachable daemon from here, so say what to check.
    return absl::UnavailableError(absl::StrCat(
        "cannot reach muond at ", options.endpoint, " within ", options.connect_timeout.count(), " ms",
        UsesTls(options) ? " (TLS: check tls_ca_file, the name in the daemon's certificate and, for mutual "
                           "TLS, the client certificate)"
                         : " (if the daemon serves TLS, set tls_ca_file or use_tls)"));
  }
  return std::unique_ptr<Client>(new Client(std::move(options), std::move(channel)));
}

absl::StatusOr<const TransportKind*> Client::SettledTransport() {
  std::lock_guard<std::mutex> lock(transport_mu_);
  if (transport_ == nullptr) {
    absl::StatusOr<const TransportKind*> chosen =
        ChooseTransport(options_.transport, [this] { return GetServerInfo(); });
    if (!chosen.ok()) return chosen.status();
    transport_ = *chosen;
  }
  return transport_;
}

absl::StatusOr<std::string> Client::Transport() {
  absl::StatusOr<const TransportKind*> kind = SettledTransport();
  if (!kind.ok()) return kind.status();
  return std::string((*kind)->name);
}

absl::StatusOr<std::unique_ptr<StepTransport>> Client::OpenTransport(const Session& session) {
  absl::StatusOr<const TransportKind*> kind = SettledTransport();
  if (!kind.ok()) return kind.status();
  return (*kind)->open(*this, session);
}

void Client::PauseBeforeRetry(std::chrono::milliseconds backoff) const {
  const auto deadline = std::chrono::steady_clock::now() + backoff;
  // A channel that has failed to connect for a while waits up to its longest reconnect backoff (2 s)
  // before trying again, longer than the first pauses of a retry: a daemon back since would be
  // missed by every try. The retry's own pause is the backoff that counts: try again now.
  grpc::experimental::ChannelResetConnectionBackoff(channel_.get());
  channel_->WaitForConnected(std::chrono::system_clock::now() + backoff);
  std::this_thread::sleep_until(deadline);  // connected early: still keep the backoff
}

void Client::PrepareContext(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
  // Per-call metadata rather than call credentials, so a token also works over a plaintext
  // loopback channel (gRPC only attaches call credentials to secure channels).
  if (!options_.auth_token.empty()) context.AddMetadata("authorization", "Bearer " + options_.auth_token);
}

grpc::ChannelInterface* Client::channel() { return channel_.get(); }

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo() {
  v1::ServerInfo info;
  absl::Status status = RetryWhileUnavailable(*this, [&] {
    grpc::ClientContext context;
    PrepareContext(context);
    return stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  });
  if (!status.ok()) return status;
  return info;
}

absl::Status Client::FitChunksToDaemon() {
  std::lock_guard<std::mutex> lock(chunk_mu_);
  if (chunk_limit_asked_) return absl::OkStatus();
  absl::StatusOr<bool> lowered = LowerChunksToDaemonsLimitLocked();
  if (!lowered.ok()) return lowered.status();
  // Payload buffers of the chunks' size (the pool gives none smaller than its own): no session, so
  // no step drawing on the pool, exists before the first CreateSession has come here.
  if (*lowered) slice_pool_ = wire::SlicePool::Create(chunk_bytes());
  chunk_limit_asked_ = true;
  return absl::OkStatus();
}

bool Client::RefitChunksAfter(const absl::Status& refusal) {
  // gRPC's own message limit carries no reason; another reason (CALLER_BUSY) is no size.
  const v1::ErrorReason reason = ReasonOf(refusal);
  if (reason != v1::CHUNK_TOO_LARGE &&
      (refusal.code() != absl::StatusCode::kResourceExhausted || reason != v1::ERROR_REASON_UNSPECIFIED)) {
    return false;
  }
  std::lock_guard<std::mutex> lock(chunk_mu_);
  // The pool's buffers, of the larger size, hold the smaller chunks as they are; steps in flight
  // may be drawing on it, so it stays.
  absl::StatusOr<bool> lowered = LowerChunksToDaemonsLimitLocked();
  return lowered.ok() && *lowered;
}

absl::StatusOr<bool> Client::LowerChunksToDaemonsLimitLocked() {
  absl::StatusOr<v1::ServerInfo> info = GetServerInfo();
  if (!info.ok()) return info.status();
  const size_t limit = info->max_chunk_bytes();
  if (limit == 0 || limit >= chunk_bytes()) return false;
  chunk_bytes_.store(limit, std::memory_order_relaxed);
  return true;
}

absl::StatusOr<std::string> Client::SharedMemoryGrant(const v1::ServerInfo& info) {
  if (!info.shm_grants()) return std::string();
  grpc::ClientContext context;
  PrepareContext(context);
  v1::GrantSharedMemoryResponse response;
  absl::Status granted = FromGrpcStatus(stub_->GrantSharedMemory(&context, v1::GrantSharedMemoryRequest(), &response));
  if (!granted.ok()) return granted;
  return response.grant();
}

namespace {

// 16 random bytes: one CreateSession's token, the same on its retries (CreateSessionRequest).
std::string RandomCreateToken() {
  std::random_device random;
  std::string token(16, '\0');
  for (size_t i = 0; i < token.size(); i += sizeof(uint32_t)) {
    const uint32_t word = random();
    std::memcpy(token.data() + i, &word, sizeof(word));
  }
  return token;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Client::CreateSession(const std::string& session_id,
                                                               const v1::SessionSpec& spec, std::optional<int> rank) {
  if (absl::Status fitted = FitChunksToDaemon(); !fitted.ok()) return fitted;
  v1::CreateSessionRequest request;
  request.set_session_id(session_id);
  *request.mutable_spec() = spec;
  if (rank.has_value()) request.set_rank(*rank);
  request.set_create_token(RandomCreateToken());
  v1::CreateSessionResponse response;
  // Create-or-attach is idempotent, so a retry is safe; its token has a retry of a create whose answer
  // was lost answered attached = false, as the first try was.
  absl::Status status = RetryWhileUnavailable(*this, [&] {
    grpc::ClientContext context;
    PrepareContext(context);
    return stub_->CreateSession(&context, request, &response);
  });
  if (!status.ok()) return status;
  return std::make_unique<Session>(this, session_id, spec, response);
}

absl::Status Client::CloseSession(const std::string& session_id) {
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  v1::CloseSessionResponse response;
  int tries = 0;
  absl::Status status = RetryWhileUnavailable(*this, [&] {
    ++tries;
    grpc::ClientContext context;
    PrepareContext(context);
    return stub_->CloseSession(&context, request, &response);
  });
  // A retry that finds no session: an earlier try closed it and its answer was lost, or the daemon
  // restarted without it.
  if (tries > 1 && status.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
  return status;
}

absl::StatusOr<bool> Client::Serving() {
  grpc::health::v1::Health::Stub health(channel_);
  grpc::ClientContext context;
  PrepareContext(context);
  context.set_deadline(std::chrono::system_clock::now() + options_.connect_timeout);  // a probe's budget
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health.Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<std::vector<v1::SessionSummary>> Client::ListSessions() {
  std::vector<v1::SessionSummary> sessions;
  v1::ListSessionsRequest request;
  request.set_max_answer_bytes(std::max(options_.max_message_bytes, 0));  // pages this client can take
  while (true) {
    v1::ListSessionsResponse response;
    absl::Status status = RetryWhileUnavailable(*this, [&] {
      grpc::ClientContext context;
      PrepareContext(context);
      response.Clear();
      return stub_->ListSessions(&context, request, &response);
    });
    if (!status.ok()) return status;
    for (auto& summary : *response.mutable_sessions()) sessions.push_back(std::move(summary));
    if (response.next_page_token().empty()) return sessions;
    // Ids come in order, so every token passes the one before: anything else would ask forever.
    if (response.next_page_token() <= request.page_token()) {
      return absl::InternalError(
          "ListSessions: the daemon's next_page_token does not follow the page asked for (pages would repeat)");
    }
    request.set_page_token(response.next_page_token());
  }
}

Session::Session(Client* client, std::string id, v1::SessionSpec spec, const v1::CreateSessionResponse& created)
    : client_(client), id_(std::move(id)), spec_(std::move(spec)) {
  for (const auto& p : spec_.parameters()) {
    wire_dtypes_[p.name()] = p.wire_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : p.wire_dtype();
  }
  numel_ = ElementCounts(spec_);
  attached_ = created.attached();
  initialized_ = created.initialized();
  last_step_ = created.last_step();
  last_push_ = created.last_push();
  loss_scale_ = created.loss_scale();
  if (created.last_overrides_known()) {
    last_overrides_.emplace(created.last_overrides().begin(), created.last_overrides().end());
  }
}

Session::~Session() = default;

v1::DType Session::WireDType(const std::string& name) const {
  auto it = wire_dtypes_.find(name);
  return it == wire_dtypes_.end() ? v1::DTYPE_FP32 : it->second;
}

v1::DType Session::ReturnDType(const StepOptions& options) const {
  if (options.return_dtype != v1::DTYPE_UNSPECIFIED) return options.return_dtype;
  return spec_.return_dtype() != v1::DTYPE_UNSPECIFIED ? spec_.return_dtype() : v1::DTYPE_FP32;
}

absl::Status Session::HoldParts(int rank) {
  const int world_size = spec_.world_size() == 0 ? 1 : spec_.world_size();
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("HoldParts: rank must be in [0, ", world_size, ") for this session, got ", rank));
  }
  std::map<std::string, int64_t> counts = ElementCounts(spec_);
  for (const v1::ParameterGroup& group : spec_.groups()) {
    std::vector<const v1::ParameterSpec*> members;
    for (const v1::ParameterSpec& p : spec_.parameters()) {
      if (p.group() == group.name()) members.push_back(&p);
    }
    const v1::Partition& partition = group.partition();
    // Under HSDP the rank holds its shard's parts (common/partition_rules.h).
    if (partition.replicas() > 1 && world_size % partition.replicas() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("HoldParts: group '", group.name(), "' has ", partition.replicas(),
                                                     " replicas for world_size ", world_size));
    }
    const int shards = ShardCount(world_size, partition.replicas());
    const int shard = ShardOf(rank, world_size, partition.replicas());
    switch (partition.kind()) {
      case v1::PARTITION_KIND_ROWS:
        for (const v1::ParameterSpec* p : members) {
          const std::vector<int64_t> shape(p->shape().begin(), p->shape().end());
          counts[p->name()] = RowParts(shape, shards)[static_cast<size_t>(shard)].size();
        }
        break;
      case v1::PARTITION_KIND_FLAT: {
        std::vector<int64_t> numels;
        for (const v1::ParameterSpec* p : members) numels.push_back(counts[p->name()]);
        const std::vector<std::vector<ElementRange>> parts =
            FlatParts(numels, std::max<int64_t>(1, partition.alignment()), shards);
        for (size_t k = 0; k < members.size(); ++k)
          counts[members[k]->name()] = parts[k][static_cast<size_t>(shard)].size();
        break;
      }
      case v1::PARTITION_KIND_EXPLICIT: {
        if (partition.ranks_size() != shards) {
          return absl::InvalidArgumentError(absl::StrCat("HoldParts: group '", group.name(), "' lists ",
                                                         partition.ranks_size(), " shards' ranges for ", shards,
                                                         " shards (world_size ", world_size, ")"));
        }
        for (const v1::ParameterSpec* p : members) counts[p->name()] = 0;
        for (const v1::ParameterRange& range : partition.ranks(shard).ranges()) {
          counts[range.parameter()] = range.end() - range.begin();
        }
        break;
      }
      default:
        break;  // replicated: whole
    }
  }
  numel_ = std::move(counts);
  parts_rank_ = rank;
  return absl::OkStatus();
}

absl::Status Session::UploadParameters(std::span<const TensorView> parameters) {
  grpc::ClientContext context;
  client_->PrepareContext(context);
  v1::UploadParametersResponse response;
  auto writer = client_->stub().UploadParameters(&context, &response);
  v1::UploadParametersRequest request;
  request.set_session_id(id_);
  if (parts_rank_.has_value()) request.set_rank(*parts_rank_);
  bool ok = writer->Write(request);
  for (const TensorView& tensor : parameters) {
    if (!ok) break;
    if (parts_rank_.has_value() && tensor.values.empty()) continue;  // an empty part: nothing to send
    const v1::DType dtype = WireDType(tensor.name);
    ok = wire::ForEachChunk(FirstChunk(tensor), tensor.values, dtype, client_->chunk_bytes(),
                            [&](const v1::TensorChunk& meta, std::span<const float> values) {
                              request.Clear();
                              v1::TensorChunk* chunk = request.mutable_chunk();
                              *chunk = meta;
                              wire::Encode(dtype, values, chunk->mutable_data());
                              return writer->Write(request);
                            });
  }
  writer->WritesDone();
  absl::Status status = FromGrpcStatus(writer->Finish());
  if (status.ok()) initialized_ = true;
  return status;
}

absl::Status Session::CheckParametersOut(const StepOptions& options) const {
  // Checked before anything is sent: a step must never be applied with nowhere to put its answer.
  for (const auto& [name, values] : options.parameters_out) {
    auto numel = numel_.find(name);
    if (numel == numel_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("parameters_out['", name, "']: no such parameter"));
    }
    if (values.size() != static_cast<size_t>(numel->second)) {
      return absl::InvalidArgumentError(absl::StrCat("parameters_out['", name, "']: ", values.size(),
                                                     " elements for a parameter of ", numel->second));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::EnsureTransport() {
  if (transport_ != nullptr) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<StepTransport>> opened = client_->OpenTransport(*this);
  if (!opened.ok()) return opened.status();
  transport_ = *std::move(opened);
  transport_->Prepare().IgnoreError();  // a failure is the first try's too, or a refusal
  FellBackToGrpc();
  return absl::OkStatus();
}

bool Session::FellBackToGrpc() {
  const absl::Status refusal = transport_ == nullptr ? absl::OkStatus() : transport_->refusal();
  if (refusal.ok() || client_->options().transport != "auto") return false;
  const std::string line = absl::StrCat("muond: session ", id_, ": transport ", std::string(transport_->name()),
                                        " refused by the daemon (", refusal.ToString(), "); its steps go over grpc");
  Warn(client_->options(), line);
  transport_ = GrpcTransportKind().open(*client_, *this);
  return true;
}

std::string Session::transport_name() const { return transport_ == nullptr ? "" : std::string(transport_->name()); }

absl::StatusOr<StepReply> Session::Step(int64_t step, std::span<const TensorView> gradients,
                                        const StepOptions& options) {
  if (absl::Status fits = CheckParametersOut(options); !fits.ok()) return fits;
  if (absl::Status opened = EnsureTransport(); !opened.ok()) return opened;
  std::vector<TensorView> held;  // an empty part has nothing to send
  if (parts_rank_.has_value()) {
    for (const TensorView& g : gradients) {
      if (!g.values.empty()) held.push_back(g);
    }
  }
  const StepPayload payload{.gradients = parts_rank_.has_value() ? std::span<const TensorView>(held) : gradients};
  absl::StatusOr<StepReply> reply = StepThrough(*transport_, step, payload, options);
  // Refused before anything was sent (the region, registered again after a restart): over gRPC.
  if (!reply.ok() && FellBackToGrpc()) reply = StepThrough(*transport_, step, payload, options);
  return reply;
}

absl::StatusOr<std::unique_ptr<StreamedStep>> Session::BeginStreamedStep(int64_t step, const StepOptions& options) {
  if (absl::Status rank = CheckPartsRank(options); !rank.ok()) return rank;
  if (absl::Status opened = EnsureTransport(); !opened.ok()) return opened;
  std::unique_ptr<StreamedStep> streamed(new StreamedStep(this, step, options));
  if (transport_->name() != "grpc") return streamed;  // gathered: shared memory moves them at once
  if (!offer_.has_value()) {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    if (!info.ok()) return info.status();
    offer_ = *std::move(info);
  }
  if (!offer_->streamed_steps()) return streamed;  // an older daemon: gathered, sent by Finish
  v1::StepHeader header = Header(step, options);
  header.clear_overrides();
  header.clear_max_grad_norm();
  header.clear_qk_logits();
  header.clear_grad_scale();
  header.clear_weight();
  header.set_streamed(true);
  header.set_packed_answer(offer_->packed_chunks());
  header.set_return_dtype(options.return_dtype);
  header.set_max_chunk_bytes(static_cast<uint32_t>(client_->chunk_bytes()));
  streamed->try_ = std::make_unique<GrpcStreamedTry>(*client_, *this, header);
  return streamed;
}

absl::StatusOr<StepReply> Session::FinishStreamed(StreamedStep& streamed, const StepOptions& options) {
  if (absl::Status fits = CheckParametersOut(options); !fits.ok()) {
    streamed.try_.reset();
    if (transport_ != nullptr) transport_->DropStaged();  // the step is over: its staging with it
    return fits;
  }
  const StepPayload payload{.gradients = streamed.added_};
  if (streamed.try_ == nullptr) return StepFrom(1, *transport_, streamed.step(), payload, options);
  const v1::StepHeader whole = Header(streamed.step(), options);
  v1::StepEnd end;
  *end.mutable_overrides() = whole.overrides();
  if (whole.has_max_grad_norm()) end.set_max_grad_norm(whole.max_grad_norm());
  *end.mutable_qk_logits() = whole.qk_logits();
  if (whole.has_grad_scale()) end.set_grad_scale(whole.grad_scale());
  if (whole.has_weight()) end.set_weight(whole.weight());
  absl::StatusOr<StepReply> reply = streamed.try_->Finish(std::move(end), options);
  streamed.try_.reset();
  if (reply.ok()) return Answered(*std::move(reply), 1);
  if (reply.status().code() == absl::StatusCode::kUnavailable) offer_.reset();  // ask a restarted daemon again
  if (client_->RefitChunksAfter(reply.status())) return StepFrom(1, *transport_, streamed.step(), payload, options);
  if (!IsTransient(reply.status().code()) || StepAttempts() <= 1) return reply;
  client_->PauseBeforeRetry(client_->options().retry_backoff);
  return StepFrom(2, *transport_, streamed.step(), payload, options, reply.status());
}

absl::Status Session::CheckPartsRank(const StepOptions& options) const {
  if (parts_rank_.has_value() && options.rank != *parts_rank_) {
    return absl::InvalidArgumentError(absl::StrCat("options.rank: this session holds rank ", *parts_rank_,
                                                   "'s parts (HoldParts), the step names rank ", options.rank));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepReply> Session::StepThrough(StepTransport& transport, int64_t step, const StepPayload& payload,
                                               const StepOptions& options) {
  if (absl::Status rank = CheckPartsRank(options); !rank.ok()) return rank;
  return StepFrom(1, transport, step, payload, options);
}

absl::StatusOr<StepReply> Session::StepFrom(int first, StepTransport& transport, int64_t step,
                                            const StepPayload& payload, const StepOptions& options,
                                            absl::Status before) {
  const v1::StepHeader header = Header(step, options);
  std::chrono::milliseconds backoff = client_->options().retry_backoff * (1 << (first - 1));
  for (int attempt = first;; ++attempt) {
    absl::StatusOr<StepReply> reply = transport.StepOnce(header, payload, options);
    if (reply.ok()) return Answered(*std::move(reply), attempt);
    if (client_->RefitChunksAfter(reply.status())) {
      --attempt;  // refused whole for its chunks' size, not a failed try: made again with smaller ones
      continue;
    }
    if (!IsTransient(reply.status().code())) {
      return before.ok() ? reply.status() : OnLaterTry(reply.status(), attempt, before);
    }
    before = reply.status();
    if (attempt >= StepAttempts()) return AfterTries(reply.status(), attempt);
    client_->PauseBeforeRetry(backoff);
    backoff *= 2;
  }
}

int Session::StepAttempts() const { return step_attempts_.value_or(client_->options().max_step_attempts); }

StepReply Session::Answered(StepReply reply, int attempts) {
  reply.attempts = attempts;
  // An answer without contributors comes from a daemon that does not report them (it used every
  // rank), or is a quorum session's replay of a step from before its restart (whose `included` the
  // daemon gave).
  const bool quorum_replay = reply.replayed && spec_.sync().mode() == v1::SYNC_MODE_QUORUM;
  if (reply.contributors.empty() && !quorum_replay) reply.included = true;
  last_step_ = reply.step;  // a rank left out of a quorum step continues where the session is
  return reply;
}

v1::StepHeader Session::Header(int64_t step, const StepOptions& options) const {
  v1::StepHeader header;
  header.set_session_id(id_);
  header.set_step(step);
  header.set_rank(options.rank);
  if (options.max_grad_norm) header.set_max_grad_norm(*options.max_grad_norm);
  header.set_log_num_zeros_in_grad(options.log_num_zeros_in_grad);
  if (options.grad_scale) header.set_grad_scale(*options.grad_scale);
  if (options.weight) header.set_weight(*options.weight);
  if (options.base_step) header.set_base_step(*options.base_step);
  for (const auto& [query, max_logits] : options.qk_logits) {
    v1::QkClipLogits* logits = header.add_qk_logits();
    logits->set_query(query);
    for (double s : max_logits) logits->add_max_logits(s);
  }
  for (const auto& [group, lr] : options.lr) {
    v1::GroupOverride* o = header.add_overrides();
    o->set_group(group);
    o->set_lr(lr);
  }
  header.set_phase(options.phase);
  if (options.decision.has_value()) *header.mutable_decision() = *options.decision;
  return header;
}

absl::StatusOr<ParameterMap> Session::GetParameters(int64_t* last_step, const std::vector<std::string>& names) {
  std::chrono::milliseconds backoff = client_->options().retry_backoff;
  absl::Status before;
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<ParameterMap> parameters = GetParametersOnce(last_step, names);
    if (parameters.ok()) return parameters;
    if (parameters.status().code() != absl::StatusCode::kUnavailable) {
      return OnLaterTry(parameters.status(), attempt, before);
    }
    before = parameters.status();
    if (attempt >= client_->options().max_step_attempts) return AfterTries(parameters.status(), attempt);
    client_->PauseBeforeRetry(backoff);
    backoff *= 2;
  }
}

absl::StatusOr<ParameterMap> Session::GetParametersOnce(int64_t* last_step, const std::vector<std::string>& names) {
  grpc::ClientContext context;
  client_->PrepareContext(context);
  v1::GetParametersRequest request;
  request.set_session_id(id_);
  request.set_max_chunk_bytes(static_cast<uint32_t>(client_->chunk_bytes()));
  if (parts_rank_.has_value()) request.set_rank(*parts_rank_);
  for (const std::string& name : names) request.add_names(name);
  auto reader = client_->stub().GetParameters(&context, request);
  ParameterMap parameters;
  absl::Status decode = absl::OkStatus();
  v1::GetParametersResponse response;
  bool first = true;
  while (reader->Read(&response)) {
    if (first && last_step != nullptr) *last_step = response.last_step();
    first = false;
    if (decode.ok()) decode = ReadChunk(response.chunk(), numel_, OutputSpans(), &parameters);
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  if (!status.ok()) return status;
  if (!decode.ok()) return decode;
  return parameters;
}

absl::StatusOr<int64_t> Session::Checkpoint() {
  v1::CheckpointRequest request;
  request.set_session_id(id_);
  v1::CheckpointResponse response;
  absl::Status status = RetryWhileUnavailable(*client_, [&] {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    return client_->stub().Checkpoint(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response.step();
}

absl::StatusOr<StateDigest> Session::GetStateDigest() {
  v1::GetStateDigestRequest request;
  request.set_session_id(id_);
  v1::StateDigest response;
  absl::Status status = RetryWhileUnavailable(*client_, [&] {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    return client_->stub().GetStateDigest(&context, request, &response);
  });
  if (!status.ok()) return status;
  return FromProto(response);
}

absl::Status Session::Close() { return client_->CloseSession(id_); }

}  // namespace muond::client
