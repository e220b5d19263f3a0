// libmuond_client: the C++ trainer's side of muond. A Client is a connection to one daemon; a
// Session is one optimizer on it. Tensors are plain fp32 spans owned by the caller; chunking, dtype
// encoding, message limits and retrying a step whose answer was lost are handled here.
//
// A retried step is safe: the daemon applies step k once and answers a repeat of k with the same
// parameters, so Step() retries transient failures (UNAVAILABLE, DEADLINE_EXCEEDED) with the same
// step number.
//
// Steps travel through a step transport (client/transport/step_transport.h): chunked gRPC streams
// or, with a daemon on the same host, a shared-memory region the session registers
// (ClientOptions::transport); the semantics are the same on every one.
//
// Errors are absl::Status values carrying the daemon's gRPC code and message unchanged.
// Thread-safety: a Client may be shared by threads; a Session must be used by one thread at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/error_reason.h"
#include "client/state_digest.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::wire {
class SlicePool;
}

namespace muond::client {

class StepTransport;
class StreamedStep;
struct StepPayload;
struct TransportKind;

struct ClientOptions {
  std::string endpoint = "127.0.0.1:50051";
  // Payload per chunk sent (at least 1), lowered to the daemon's limit (4 MiB by default) when that is
  // smaller: Client::chunk_bytes(). With 64 KiB for a chunk's framing it must fit max_message_bytes.
  size_t chunk_bytes = 1u << 20;
  int max_message_bytes = 64 << 20;  // gRPC message limits, set explicitly on the channel
  // A gRPC step whose gradients and answer each carry at most this much payload, and fit the daemon's
  // message limit, goes in one StepWhole call when the daemon offers it (docs/protocol.md, "Steps in
  // one call"): a Step stream costs the daemon more per step. 0: every step on a Step stream.
  size_t whole_step_bytes = 1u << 20;
  std::chrono::milliseconds rpc_timeout{std::chrono::minutes(10)};
  int max_step_attempts = 4;                     // tries of a step (or an idempotent call) on transient failures
  std::chrono::milliseconds retry_backoff{100};  // doubled after each failed try
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds max_reconnect_backoff{std::chrono::seconds(2)};  // between reconnection tries

  // Transport security. TLS is used when use_tls is set or any TLS file is given; otherwise the
  // channel is plaintext.
  bool use_tls = false;
  std::string tls_ca_file;               // PEM roots to verify the daemon with; empty: the system's roots
  std::string tls_client_cert_file;      // PEM certificate chain for mutual TLS (with tls_client_key_file)
  std::string tls_client_key_file;       // PEM private key of tls_client_cert_file
  std::string tls_server_name_override;  // name to verify the daemon's certificate against (tests)
  // Sent as 'authorization: Bearer <auth_token>' with every call when not empty. Over plaintext the
  // token is readable by anyone on the path; use TLS beyond loopback.
  std::string auth_token;

  // How steps' tensors travel: "grpc" (chunked streams), "shm" (shared memory: the daemon must be on
  // this host and offer it) or "auto" (shared memory when the daemon is on this host and its socket
  // is reachable, else gRPC). Client::transport() says which was chosen. Control calls always use gRPC.
  std::string transport = "auto";
  // Where the client's warnings go, one line each (a session whose "auto" transport was refused by
  // the daemon and goes on over gRPC); unset: standard error.
  std::function<void(const std::string&)> warn;
};

// Writes `line` to options.warn, or to standard error when that is unset.
void Warn(const ClientOptions& options, const std::string& line);

// A named tensor owned by the caller.
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> values;
};

struct StepOptions {
  int rank = 0;                      // this trainer's rank in a session with world_size > 1
  std::map<std::string, double> lr;  // per group, this step only (schedulers)
  std::optional<double> max_grad_norm;
  // QK-clip: per query weight of a spec.qk_clip pair, the maximum attention logit of each head seen
  // in this step's forward pass.
  std::map<std::string, std::vector<double>> qk_logits;
  v1::DType return_dtype = v1::DTYPE_UNSPECIFIED;  // session default
  // Where the parameters after the step go, when not empty: the caller's memory, one span of the
  // parameter's element count per parameter (those named here are then left out of
  // StepReply::parameters), so that a steady loop allocates nothing per step.
  std::map<std::string, std::span<float>> parameters_out;
  // One shard of a sharded session (docs/sharding.md; ShardedSession sets these): the phase of this
  // step and, for a commit, the decision taken over every shard.
  v1::StepPhase phase = v1::STEP_PHASE_WHOLE;
  std::optional<v1::ShardDecision> decision;
  // Count the gradient elements that are exactly 0 (Megatron-Core's log_num_zeros_in_grad):
  // StepReply::num_zeros_in_grad.
  bool log_num_zeros_in_grad = false;
  // The factor the loss was multiplied by (a static loss scale): the daemon divides the gradients
  // by it before the norm, clipping and the non-finite check. With a session loss scaler leave it
  // unset (or give StepReply::loss_scale of the previous step).
  std::optional<double> grad_scale;
  // This rank's weight in a multi-rank step's average (e.g. the tokens behind its gradients): the
  // daemon applies sum(w_r * g_r) / sum(w_r). Finite and > 0; unset: 1.
  std::optional<double> weight;
  // Asynchronous sessions (required there, refused elsewhere): the global step whose parameters the
  // gradients were computed on — the previous answer's StepReply::step (0: the initial parameters).
  // The step number given to Step() then numbers this rank's own pushes (1, 2, ...).
  std::optional<int64_t> base_step;
};

using ParameterMap = std::map<std::string, std::vector<float>>;

struct StepReply {
  int64_t step = 0;
  bool applied = false;   // false: skipped (non-finite gradients)
  bool replayed = false;  // the daemon had applied this step already
  std::string skip_reason;
  double grad_norm = 0;
  double compute_seconds = 0;
  int attempts = 1;
  ParameterMap parameters;  // every parameter after the step (none after a prepare)
  // A prepare's answer: nothing applied; each parameter's sum of squares, in spec order.
  bool prepared = false;
  std::vector<double> sum_squares;
  int64_t num_zeros_in_grad = 0;  // with StepOptions::log_num_zeros_in_grad; summed over shards
  // With a session loss scaler (SessionSpec::loss_scaler): the scale to multiply the next loss by.
  double loss_scale = 0;
  // Multi-rank sessions (docs/ranks.md): the ranks whose gradients the step used, the sum of their
  // weights, and whether this rank's were used. A quorum session answers a rank that came late with
  // included = false and the parameters after its last step, which `step` names: continue with
  // step + 1.
  std::vector<int> contributors;
  double total_weight = 0;
  bool included = true;
  // Asynchronous sessions: the global step this push became and its staleness (global steps applied
  // since its base_step); `step` is the global step of the parameters in the answer.
  int64_t global_step = 0;
  int64_t staleness = 0;
  // Each group's clipping this step, by group name: its gradients' norm and the coefficient they
  // were multiplied by (group option clip_scope; docs/algorithms.md, Clipping).
  struct GroupClip {
    double grad_norm = 0;
    double coefficient = 1;
  };
  std::map<std::string, GroupClip> group_clips;
  // Each group's telemetry and the health warnings the step raised, by group name, on an applied
  // step (docs/algorithms.md, Telemetry; docs/operations.md, Warnings).
  std::map<std::string, v1::GroupTelemetry> group_telemetry;
};

class Session;

class Client {
 public:
  // Connects and waits until the daemon answers (up to connect_timeout). INVALID_ARGUMENT naming the
  // option, before connecting, when one cannot work (a chunk size of 0, a timeout not above 0, fewer
  // than one try, an unknown transport) or a TLS file cannot be read.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);

  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  // A one-time grant for the daemon's shared-memory socket (GrantSharedMemory), which a connection
  // presents before it passes descriptors; empty for a daemon that takes them without one (`info`
  // without shm_grants). Not retried: a registration fails as one try.
  absl::StatusOr<std::string> SharedMemoryGrant(const v1::ServerInfo& info);
  // Creates the session, or attaches when one with this id and an identical spec exists. With
  // `rank`, an asynchronous session also says that rank's last push (Session::last_push).
  absl::StatusOr<std::unique_ptr<Session>> CreateSession(const std::string& session_id, const v1::SessionSpec& spec,
                                                         std::optional<int> rank = std::nullopt);
  // Ends the session. Retried on UNAVAILABLE; a retry that finds no session is taken as done (an
  // earlier try closed it, its answer lost, or the daemon restarted without it): NOT_FOUND only
  // from a first try. (A session created again under the same id between two tries would be the one
  // the retry closes: the request names an id, not one session's life.)
  absl::Status CloseSession(const std::string& session_id);
  // Every session the caller may see, in id order, asking page after page (each retried on
  // UNAVAILABLE); a session created or closed meanwhile may or may not be in it.
  absl::StatusOr<std::vector<v1::SessionSummary>> ListSessions();
  // The daemon's grpc.health.v1 status for the whole server: true when SERVING (false while it
  // drains on shutdown). Not retried, and bounded by connect_timeout: a probe wants the answer now.
  absl::StatusOr<bool> Serving();

  v1::Muond::Stub& stub() { return *stub_; }
  // For calls made over byte buffers (Step, StepWhole): the channel, the methods, the payload buffers.
  grpc::ChannelInterface* channel();
  const grpc::internal::RpcMethod& step_method() const { return step_method_; }
  const grpc::internal::RpcMethod& whole_step_method() const { return whole_step_method_; }
  wire::SlicePool& slice_pool() { return *slice_pool_; }
  const ClientOptions& options() const { return options_; }
  // The payload per chunk sent: ClientOptions::chunk_bytes, or the daemon's chunk limit
  // (ServerInfo::max_chunk_bytes) when that is smaller, which the first CreateSession asks for and
  // RefitChunksAfter asks again.
  size_t chunk_bytes() const { return chunk_bytes_.load(std::memory_order_relaxed); }
  // Whether `refusal` refused chunks larger than the daemon takes (CHUNK_TOO_LARGE, or gRPC's own
  // message limit: a daemon restarted with a smaller --max-chunk-bytes) and asking its limit again
  // lowered chunk_bytes(). The refused call changed nothing; the caller makes it again.
  bool RefitChunksAfter(const absl::Status& refusal);
  // "grpc" or "shm": the transport steps use (ClientOptions::transport). Settled by the first step
  // (or the first call of this), not by Connect, so that connecting makes no call of its own.
  absl::StatusOr<std::string> Transport();
  // A new transport of the settled kind for `session`'s steps.
  absl::StatusOr<std::unique_ptr<StepTransport>> OpenTransport(const Session& session);
  void PrepareContext(grpc::ClientContext& context) const;
  // Waits `backoff` before a retry while watching the channel, so that it reconnects meanwhile: gRPC
  // notices a finished connection attempt only while something polls the channel (otherwise only
  // its backup poller does, every 5 s), and a call failing fast in TRANSIENT_FAILURE polls for no
  // time.
  void PauseBeforeRetry(std::chrono::milliseconds backoff) const;

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // The transport options_.transport and the daemon's offer give (transport_choice.h), settled once.
  absl::StatusOr<const TransportKind*> SettledTransport();
  // Lowers chunk_bytes_ to the daemon's chunk limit, asked once (a daemon refuses larger chunks), and
  // sizes slice_pool_'s buffers to it.
  absl::Status FitChunksToDaemon();
  // Asks the daemon's chunk limit and lowers chunk_bytes_ to it when smaller; whether it did. Under
  // chunk_mu_.
  absl::StatusOr<bool> LowerChunksToDaemonsLimitLocked();
  ClientOptions options_;
  std::mutex chunk_mu_;
  bool chunk_limit_asked_ = false;  // guarded by chunk_mu_
  std::atomic<size_t> chunk_bytes_;
  std::mutex transport_mu_;
  const TransportKind* transport_ = nullptr;  // null until settled
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Muond::Stub> stub_;
  grpc::internal::RpcMethod step_method_;
  grpc::internal::RpcMethod whole_step_method_;
  std::shared_ptr<wire::SlicePool> slice_pool_;
};

class Session {
 public:
  Session(Client* client, std::string id, v1::SessionSpec spec, const v1::CreateSessionResponse& created);
  ~Session();

  const std::string& id() const { return id_; }
  const v1::SessionSpec& spec() const { return spec_; }
  // The transport this session's steps use: the Client's (Client::Transport), or "grpc" after the
  // daemon refused the region of an "auto" shared-memory one; empty before the first step.
  std::string transport_name() const;
  // Each parameter's element count, by name.
  const std::map<std::string, int64_t>& element_counts() const { return numel_; }
  // The dtype parameter `name`'s gradients travel in (its spec's wire_dtype; fp32 by default).
  v1::DType WireDType(const std::string& name) const;
  // The dtype the parameters come back in with `options` (the step's, the session's, or fp32).
  v1::DType ReturnDType(const StepOptions& options) const;
  bool attached() const { return attached_; }
  bool initialized() const { return initialized_; }
  int64_t last_step() const { return last_step_; }  // as of creation or the last Step
  // An asynchronous session created or attached with a rank: that rank's last push when it did (0:
  // none); continue with last_push() + 1.
  int64_t last_push() const { return last_push_; }
  // With a session loss scaler: its scale when the session was created or attached (what the first
  // loss is multiplied by); 0 without one. Each StepReply::loss_scale gives the next.
  double loss_scale() const { return loss_scale_; }
  // What last_step() ran with beyond the groups' options when the session was created or attached:
  // its overrides (StepOptions::lr among them), one per group that had any; a trainer attaching to
  // resume starts its schedule from them. nullopt when the daemon does not know them (its state was
  // replaced, or restored from a checkpoint of an earlier muond, since that step; or it is older).
  const std::optional<std::vector<v1::GroupOverride>>& last_overrides() const { return last_overrides_; }

  // Makes this a rank that holds parts (docs/ranks.md, Ranks that hold parts): from here on every
  // parameter of a partitioned group counts only `rank`'s part of it (element_counts()), uploads
  // and reads carry `rank`'s parts, and steps must name `rank` (StepOptions::rank). An empty part is
  // left out of uploads and steps. The parts follow the spec's partitions with the daemon's rules
  // (common/partition_rules.h); under HSDP (`partition.replicas`) the rank holds its shard's parts.
  // INVALID_ARGUMENT for a rank outside [0, world_size), replicas that do not divide the world size,
  // or explicit ranges the spec does not give for every shard.
  absl::Status HoldParts(int rank);
  // The rank HoldParts made this; nullopt: whole tensors.
  std::optional<int> parts_rank() const { return parts_rank_; }

  // The tries of each step (Step, StepThrough, a streamed step's Finish): the client's
  // max_step_attempts unless set. ShardedSession sets 1 on its shards' sessions: it retries whole
  // steps itself.
  void set_step_attempts(int attempts) { step_attempts_ = attempts; }

  // Uploads every parameter's initial value (each in its wire dtype); a rank that holds parts
  // uploads its parts, and every rank does so before its first step.
  absl::Status UploadParameters(std::span<const TensorView> parameters);

  // Sends the gradients of step `step` (a parameter left out has no gradient this step) and returns
  // the parameters after it.
  absl::StatusOr<StepReply> Step(int64_t step, std::span<const TensorView> gradients, const StepOptions& options = {});

  // Begins step `step` as a streamed step (client/streamed_step.h): its gradients are added as
  // they are ready and StreamedStep::Finish takes its options. `options` names the step (its
  // rank, base_step, log_num_zeros_in_grad, return_dtype, phase and a commit's decision); its
  // other fields wait for Finish.
  absl::StatusOr<std::unique_ptr<StreamedStep>> BeginStreamedStep(int64_t step, const StepOptions& options = {});

  // Step `step` through `transport` (a transport of this session): the header is built here, and
  // transient failures are retried with the same step number. Session::Step uses the Client's
  // transport; CudaIpcStepper its own. A session that holds parts (HoldParts) steps as its rank
  // only: INVALID_ARGUMENT naming options.rank otherwise.
  absl::StatusOr<StepReply> StepThrough(StepTransport& transport, int64_t step, const StepPayload& payload,
                                        const StepOptions& options);

  // The daemon's current parameters (all, or the named ones) and the step they belong to.
  absl::StatusOr<ParameterMap> GetParameters(int64_t* last_step = nullptr, const std::vector<std::string>& names = {});

  // Asks the daemon to write a checkpoint now (it needs --state-dir); returns the step it holds.
  absl::StatusOr<int64_t> Checkpoint();

  // The digest of the session's whole state as it is now (GetStateDigest; client/state_digest.h),
  // equal for equal states wherever they are held, different for any changed bit.
  absl::StatusOr<StateDigest> GetStateDigest();

  absl::Status Close();

  // INVALID_ARGUMENT naming options.parameters_out when one of its buffers does not fit this
  // session's parameters (Step checks it before anything is sent).
  absl::Status CheckParametersOut(const StepOptions& options) const;

 private:
  absl::StatusOr<ParameterMap> GetParametersOnce(int64_t* last_step, const std::vector<std::string>& names);
  v1::StepHeader Header(int64_t step, const StepOptions& options) const;
  friend class StreamedStep;
  absl::StatusOr<StepReply> FinishStreamed(StreamedStep& streamed, const StepOptions& options);
  // Tries from attempt `first` on (earlier ones were made elsewhere, the last failing with
  // `before`), as StepThrough does.
  absl::StatusOr<StepReply> StepFrom(int first, StepTransport& transport, int64_t step, const StepPayload& payload,
                                     const StepOptions& options, absl::Status before = absl::OkStatus());
  // INVALID_ARGUMENT naming options.rank when this session holds another rank's parts (HoldParts).
  absl::Status CheckPartsRank(const StepOptions& options) const;
  absl::Status EnsureTransport();
  // After an answer: its attempt count, whether this rank was included, the session's last step.
  StepReply Answered(StepReply reply, int attempts);
  std::optional<v1::ServerInfo> offer_;  // the daemon's, asked at the first streamed step

  Client* const client_;
  const std::string id_;
  const v1::SessionSpec spec_;
  std::map<std::string, v1::DType> wire_dtypes_;
  std::map<std::string, int64_t> numel_;
  std::optional<int> parts_rank_;
  std::optional<int> step_attempts_;  // set_step_attempts; nullopt: the client's max_step_attempts
  int StepAttempts() const;
  // Under "auto", when the daemon refused what transport_ needs (its region): one warning, and
  // transport_ becomes gRPC. True when it did.
  bool FellBackToGrpc();
  std::unique_ptr<StepTransport> transport_;  // the Client's kind (or gRPC after a refusal), once a step needed it
  bool attached_ = false;
  bool initialized_ = false;
  int64_t last_step_ = 0;
  int64_t last_push_ = 0;
  double loss_scale_ = 0;
  std::optional<std::vector<v1::GroupOverride>> last_overrides_;
};

// For step transports: whether a failed call may be
// retried as it is (UNAVAILABLE, DEADLINE_EXCEEDED), and the daemon's StepResult into a reply.
bool IsTransient(absl::StatusCode code);
void CopyResult(const v1::StepResult& result, StepReply* reply);

}  // namespace muond::client
