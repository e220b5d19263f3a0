// request_fuzzer: a libFuzzer target over the daemon's request handling.
//
// The real MuondService (with its SessionRegistry, Sessions, TensorAssemblers, spec parsing, dtype
// codec and the CPU backend) serves on an in-process gRPC channel: no network, but every request is
// serialized, parsed and handled as it would be from a socket. Each input is a script of RPCs
// (tests/fuzz/request_script.h) run against a daemon without sessions; all are closed afterwards.
//
// Besides crashes, leaks and undefined behaviour (the fuzz build adds ASan and UBSan), it checks the
// protocol's promise that a refused request changes no state: before each RPC it takes a fingerprint
// of every session (id, last step, the whole exported state) and aborts when an RPC that was
// refused, that only read, or that replayed a step leaves a different one. A step skipped for
// non-finite gradients may move only that session's step counter.
//
// It also checks the rules of docs/protocol.md (Ranges and rules) on what was accepted: after every
// call each session's last step and step counts are in range and every master and slot is finite;
// a step applied or skipped has the number last step + 1; and an accepted request used no option
// that does not apply — a group option or a QKV split outside its optimizer, a step override the
// group's optimizer does not use, a slot or an empty payload on a step or upload chunk — and named
// nothing with control characters.
//
// The daemon's limits are small (tensors of at most 4096 elements, 16 parameters, 4 sessions, 1 KiB
// chunks, 5 KiB messages) so that inputs reach every limit, and each call takes well under a
// millisecond.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "kernels/backend_factory.h"
#include "kernels/optim/options.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "server/session/value_rules.h"
#include "tests/fuzz/request_script.h"

namespace muond::fuzz {
namespace {

constexpr size_t kMaxChunkBytes = 1024;
// Bounds on one input, so the fuzzer spends its time on variety rather than on long repetitions:
// calls (each a round trip of about a third of a millisecond) and stream messages.
constexpr int kMaxCalls = 48;
constexpr int kMaxMessages = 512;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "request_fuzzer: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// REQUEST_FUZZER_TRACE=1 prints every call's outcome and the time since the one before (to read
// what a failing input does).
void Trace(absl::string_view rpc, const grpc::Status& status, absl::string_view note = "") {
  static const bool enabled = std::getenv("REQUEST_FUZZER_TRACE") != nullptr;
  if (!enabled) return;
  static auto last = std::chrono::steady_clock::now();
  const auto now = std::chrono::steady_clock::now();
  std::fprintf(stderr, "  %s: %d %s%s [%.2f ms]\n", std::string(rpc).c_str(), status.error_code(),
               status.error_message().c_str(), std::string(note).c_str(),
               std::chrono::duration<double, std::milli>(now - last).count());
  last = now;
}

// Counts the calls whose server side is still alive: a call's interceptor is destroyed only after
// its handler returned. The script waits for zero before it looks at the state, so a cancelled call
// whose handler is still running cannot change a session behind its back.
class InFlightCalls final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new Counter(&count_);
  }
  void WaitIdle() const {
    while (count_.load() > 0) std::this_thread::yield();
  }

 private:
  class Counter final : public grpc::experimental::Interceptor {
   public:
    explicit Counter(std::atomic<int>* count) : count_(count) { ++*count_; }
    ~Counter() override { --*count_; }
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

   private:
    std::atomic<int>* const count_;
  };

  std::atomic<int> count_{0};
};

// One daemon per fuzzing process, started on first use and never torn down.
struct Daemon {
  std::unique_ptr<kernels::Backend> backend;
  rpc::ProtoSpecCodec codec;
  std::unique_ptr<session::SessionRegistry> registry;
  std::unique_ptr<rpc::MuondService> service;
  InFlightCalls* in_flight = nullptr;  // owned by the server
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Muond::Stub> stub;
};

Daemon& TheDaemon() {
  static Daemon* const daemon = [] {
    auto* d = new Daemon;
    if (absl::Status s = ConfigureLogging("off"); !s.ok()) Fail(s.ToString());
    // protobuf logs every string field that is not UTF-8; for fuzzed bytes that is most of them.
    google::protobuf::SetLogHandler(nullptr);
    absl::StatusOr<kernels::BackendSelection> selection = kernels::CreateBackend("cpu", 0, 1);
    if (!selection.ok()) Fail(selection.status().ToString());
    d->backend = std::move(selection->backend);
    session::SpecLimits limits;
    limits.max_tensor_elements = 4096;
    limits.max_parameters = 16;
    d->registry = std::make_unique<session::SessionRegistry>(d->backend.get(), &d->codec, limits, /*max_sessions=*/4);
    rpc::ServiceOptions options;
    options.max_chunk_bytes = kMaxChunkBytes;
    options.default_chunk_bytes = 256;
    // Within reach of an input's payloads (up to 64 KiB), so that gRPC itself cuts some streams
    // short for an oversized message, as it would for a real client.
    options.max_message_bytes = kMaxChunkBytes + 4096;
    d->service = std::make_unique<rpc::MuondService>(d->registry.get(), d->backend.get(), options);
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
    builder.RegisterService(d->service.get());
    auto in_flight = std::make_unique<InFlightCalls>();
    d->in_flight = in_flight.get();
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::move(in_flight));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    d->server = builder.BuildAndStart();
    if (d->server == nullptr) Fail("cannot start the in-process server");
    d->stub = v1::Muond::NewStub(d->server->InProcessChannel(grpc::ChannelArguments()));
    return d;
  }();
  return *daemon;
}

// What a session looks like from outside: its step and its whole state, byte for byte.
struct SessionPrint {
  int64_t last_step = 0;
  std::string state;
  bool operator==(const SessionPrint&) const = default;
};
using Fingerprint = std::map<std::string, SessionPrint>;

Fingerprint Take(const session::SessionRegistry& registry) {
  Fingerprint print;
  for (const std::shared_ptr<session::Session>& session : registry.List()) {
    SessionPrint& p = print[session->id()];
    absl::StatusOr<session::SessionState> state = session->ExportState();
    if (!state.ok()) {  // not initialized yet
      p.last_step = session->last_step();
      p.state = state.status().ToString();
      continue;
    }
    p.last_step = state->last_step;
    for (int64_t count : state->step_counts) p.state.append(reinterpret_cast<const char*>(&count), sizeof count);
    for (const session::StateTensor& t : state->tensors) {
      absl::StrAppend(&p.state, "|", t.parameter, "/", t.slot, ":");
      p.state.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * sizeof(float));
    }
  }
  return print;
}

void ExpectState(const Fingerprint& expected, const std::string& what, const grpc::Status& status) {
  TheDaemon().in_flight->WaitIdle();
  if (Take(*TheDaemon().registry) == expected) return;
  Fail(absl::StrCat(what, " changed the state (status ", status.error_code(), ": ", status.error_message(), ")"));
}

// The rules every session keeps whatever was sent: step numbers and counts in range, every master
// and slot finite and within the magnitude limit, second moments not negative.
void CheckInvariants(const std::string& after) {
  TheDaemon().in_flight->WaitIdle();
  for (const std::shared_ptr<session::Session>& session : TheDaemon().registry->List()) {
    const std::string where = absl::StrCat(" in session '", session->id(), "' after ", after);
    absl::StatusOr<session::SessionState> state = session->ExportState();
    if (!state.ok()) continue;  // not initialized yet
    if (state->last_step < 0 || state->last_step > session::kMaxStep) {
      Fail(absl::StrCat("last step ", state->last_step, " out of range", where));
    }
    for (int64_t count : state->step_counts) {
      if (count < 0 || count > state->last_step) Fail(absl::StrCat("step count ", count, " out of range", where));
    }
    for (const session::StateTensor& t : state->tensors) {
      for (float v : t.values) {
        if (!(std::abs(v) <= session::kMagnitudeLimit)) {
          Fail(absl::StrCat("value ", v, " in ", t.slot, " of parameter ", t.parameter, where));
        }
        if (t.slot == "exp_avg_sq" && v < 0) Fail(absl::StrCat("negative exp_avg_sq", where));
      }
    }
  }
}

bool HasControlCharacter(absl::string_view name) {
  for (char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return true;
  }
  return false;
}

// An accepted CreateSession (not an attach) used only options that apply and clean names.
void CheckCreatedSpec(const v1::SessionSpec& spec) {
  std::map<std::string, optim::OptimizerKind> kinds;
  for (const v1::ParameterGroup& group : spec.groups()) {
    if (HasControlCharacter(group.name())) Fail("a group name with a control character was accepted");
    const v1::GroupOptions& options = group.options();
    const optim::OptimizerKind kind = options.optimizer() == v1::OPTIMIZER_UNSPECIFIED
                                          ? optim::OptimizerKind::kMuon
                                          : static_cast<optim::OptimizerKind>(options.optimizer() - 1);
    kinds[group.name()] = kind;
    std::vector<const google::protobuf::FieldDescriptor*> fields;
    options.GetReflection()->ListFields(options, &fields);
    for (const auto* field : fields) {
      if (optim::IsGroupOption(field->name()) && !optim::OptionApplies(kind, field->name())) {
        Fail(absl::StrCat("CreateSession accepted option ", field->name(), " for optimizer ",
                          std::string(optim::OptimizerName(kind))));
      }
    }
  }
  for (const v1::ParameterSpec& parameter : spec.parameters()) {
    if (HasControlCharacter(parameter.name())) Fail("a parameter name with a control character was accepted");
    if (parameter.qkv_split_size() > 0 && kinds[parameter.group()] != optim::OptimizerKind::kMuon) {
      Fail("CreateSession accepted qkv_split outside a Muon group");
    }
  }
}

// A chunk that an accepted step or upload must not have held.
bool ForeignChunk(const v1::TensorChunk& chunk) { return !chunk.slot().empty() || chunk.data().empty(); }

template <typename Message>
std::optional<Message> Parse(absl::string_view payload) {
  Message message;
  if (!message.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) return std::nullopt;
  return message;
}

// An open client stream of the script.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual void Write(absl::string_view payload) = 0;
  // Half-closes (or cancels) the stream, reads the answer and checks what the call did to the state.
  virtual void End(bool cancel) = 0;
};

// UploadParameters and SetState: client streaming, one answer.
template <typename Request, typename Response>
class ClientStream final : public Stream {
 public:
  template <typename Open>
  ClientStream(const char* name, Open open)
      : name_(name), before_(Take(*TheDaemon().registry)), writer_(open(&context_, &response_)) {}

  void Write(absl::string_view payload) override {
    std::optional<Request> request = Parse<Request>(payload);
    if (!request || !open_) return;
    if constexpr (std::is_same_v<Request, v1::UploadParametersRequest>) {
      if (request->has_chunk() && ForeignChunk(request->chunk())) foreign_chunk_ = true;
    }
    open_ = writer_->Write(*request);
  }

  void End(bool cancel) override {
    if (cancel) {
      context_.TryCancel();
    } else {
      writer_->WritesDone();
    }
    const grpc::Status status = writer_->Finish();
    Trace(name_, status, cancel ? " (cancelled by the client)" : "");
    TheDaemon().in_flight->WaitIdle();
    // A cancelled call may or may not have been applied; anything else refused must change nothing.
    if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
      ExpectState(before_, absl::StrCat("a refused ", name_), status);
    }
    if (status.ok() && foreign_chunk_) Fail(absl::StrCat(name_, " accepted a chunk with a slot or without data"));
    CheckInvariants(name_);
  }

 private:
  const char* name_;
  Fingerprint before_;
  grpc::ClientContext context_;
  Response response_;
  std::unique_ptr<grpc::ClientWriter<Request>> writer_;
  bool open_ = true;
  bool foreign_chunk_ = false;
};

// What a step call did, checked against the rules: a step on a Step stream or in one StepWhole call.
class StepCheck {
 public:
  StepCheck() : before_(Take(*TheDaemon().registry)) {}

  // Notes one request message of the step, in order.
  void Note(const v1::StepRequest& request) {
    if (!noted_any_ && request.has_header()) header_ = request.header();
    if (request.has_chunk() && ForeignChunk(request.chunk())) foreign_chunk_ = true;
    noted_any_ = true;
  }

  void Finish(const char* name, const grpc::Status& status, const std::optional<v1::StepResult>& result,
              bool cancelled) const {
    Trace(name, status,
          result ? absl::StrCat(" step ", result->step(), result->applied() ? " applied" : " skipped",
                                result->replayed() ? " (replay)" : "")
                 : std::string(cancelled ? " (cancelled by the client)" : ""));
    CheckInvariants(name);
    if (status.error_code() == grpc::StatusCode::CANCELLED) return;
    if (!status.ok()) return ExpectState(before_, absl::StrCat("a refused ", name), status);
    if (!result) Fail(absl::StrCat(name, " succeeded without a result"));
    if (result->replayed()) return ExpectState(before_, absl::StrCat("a replayed ", name), status);
    CheckAcceptedStep(*result);
    if (!result->applied()) {  // skipped: the counter moves, nothing else
      Fingerprint expected = before_;
      auto it = expected.find(header_.session_id());
      if (it == expected.end()) Fail("a step was skipped in a session that did not exist");
      it->second.last_step = result->step();
      ExpectState(expected, absl::StrCat("a skipped ", name), status);
    }
  }

 private:
  // A step that was applied or skipped (not a replay) follows the last one and used only overrides
  // its groups' optimizers apply and chunks without slots or empty payloads.
  void CheckAcceptedStep(const v1::StepResult& result) const {
    auto it = before_.find(header_.session_id());
    if (it == before_.end()) Fail("a step was answered in a session that did not exist");
    if (result.step() != it->second.last_step + 1) {
      Fail(absl::StrCat("step ", result.step(), " was answered after step ", it->second.last_step));
    }
    if (foreign_chunk_) Fail("a step accepted a chunk with a slot or without data");
    std::shared_ptr<session::Session> session = TheDaemon().registry->Find(header_.session_id(), "").value_or(nullptr);
    if (session == nullptr) return;  // closed since
    const session::SessionConfig& config = session->config();
    for (const v1::GroupOverride& o : header_.overrides()) {
      auto group = config.group_index.find(o.group());
      if (group == config.group_index.end()) Fail("a step accepted an override of an unknown group");
      const optim::OptimizerKind kind = config.groups[group->second].options.optimizer;
      if (o.has_momentum() && !optim::OptionApplies(kind, "momentum")) {
        Fail(absl::StrCat("a step accepted a momentum override for optimizer ",
                          std::string(optim::OptimizerName(kind))));
      }
    }
  }

  Fingerprint before_;
  v1::StepHeader header_;
  bool noted_any_ = false;
  bool foreign_chunk_ = false;
};

class StepStream final : public Stream {
 public:
  StepStream() : stream_(TheDaemon().stub->Step(&context_)) {}

  void Write(absl::string_view payload) override {
    std::optional<v1::StepRequest> request = Parse<v1::StepRequest>(payload);
    if (!request) return;
    check_.Note(*request);
    if (open_) open_ = stream_->Write(*request);
  }

  void End(bool cancel) override {
    if (cancel) {
      context_.TryCancel();
    } else {
      stream_->WritesDone();
    }
    std::optional<v1::StepResult> result;
    v1::StepResponse response;
    while (stream_->Read(&response)) {
      if (response.has_result()) result = response.result();
    }
    const grpc::Status status = stream_->Finish();
    check_.Finish("Step", status, result, cancel);
  }

 private:
  StepCheck check_;  // first: it takes the state before the stream opens
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream_;
  bool open_ = true;
};

// A whole step in one call: the payload is a StepMessages.
void StepWhole(absl::string_view payload) {
  std::optional<v1::StepMessages> request = Parse<v1::StepMessages>(payload);
  if (!request || request->messages_size() > kMaxMessages) return;
  StepCheck check;
  for (const v1::StepRequest& message : request->messages()) check.Note(message);
  grpc::ClientContext context;
  v1::StepAnswers answers;
  const grpc::Status status = TheDaemon().stub->StepWhole(&context, *request, &answers);
  std::optional<v1::StepResult> result;
  for (const v1::StepResponse& answer : answers.messages()) {
    if (answer.has_result()) result = answer.result();
  }
  TheDaemon().in_flight->WaitIdle();
  check.Finish("StepWhole", status, result, /*cancelled=*/false);
}

// Server-streaming reads: GetParameters, GetState. They must never change anything.
template <typename Request, typename Response, typename Open>
void ReadAll(absl::string_view payload, const char* name, Open open) {
  std::optional<Request> request = Parse<Request>(payload);
  if (!request) return;
  const Fingerprint before = Take(*TheDaemon().registry);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<Response>> reader = open(&context, *request);
  Response response;
  while (reader->Read(&response)) {
  }
  const grpc::Status status = reader->Finish();
  Trace(name, status);
  ExpectState(before, name, status);
}

void RunUnary(Op op, absl::string_view payload) {
  Daemon& d = TheDaemon();
  const Fingerprint before = Take(*d.registry);
  grpc::ClientContext context;
  switch (op) {
    case Op::kCreateSession: {
      std::optional<v1::CreateSessionRequest> request = Parse<v1::CreateSessionRequest>(payload);
      if (!request) return;
      v1::CreateSessionResponse response;
      const grpc::Status status = d.stub->CreateSession(&context, *request, &response);
      Trace("CreateSession", status, response.attached() ? " (attached)" : "");
      if (!status.ok() || response.attached()) ExpectState(before, "a refused or attaching CreateSession", status);
      if (status.ok() && !response.attached()) CheckCreatedSpec(request->spec());
      return;
    }
    case Op::kCloseSession: {
      std::optional<v1::CloseSessionRequest> request = Parse<v1::CloseSessionRequest>(payload);
      if (!request) return;
      v1::CloseSessionResponse response;
      const grpc::Status status = d.stub->CloseSession(&context, *request, &response);
      Trace("CloseSession", status);
      if (!status.ok()) ExpectState(before, "a refused CloseSession", status);
      return;
    }
    case Op::kListSessions: {
      std::optional<v1::ListSessionsRequest> request = Parse<v1::ListSessionsRequest>(payload);
      if (!request) return;
      v1::ListSessionsResponse response;
      const grpc::Status status = d.stub->ListSessions(&context, *request, &response);
      Trace("ListSessions", status);
      // A page that says more follow holds at least one session, whose id is the token.
      if (status.ok() && !response.next_page_token().empty() &&
          (response.sessions_size() == 0 ||
           response.sessions(response.sessions_size() - 1).session_id() != response.next_page_token())) {
        Fail("ListSessions: a next_page_token that is not the page's last session");
      }
      ExpectState(before, "ListSessions", status);
      return;
    }
    case Op::kCheckpoint: {  // writes a file at most; the session itself must not change
      std::optional<v1::CheckpointRequest> request = Parse<v1::CheckpointRequest>(payload);
      if (!request) return;
      v1::CheckpointResponse response;
      const grpc::Status status = d.stub->Checkpoint(&context, *request, &response);
      Trace("Checkpoint", status);
      ExpectState(before, "Checkpoint", status);
      return;
    }
    case Op::kGetStateDigest: {  // reads the whole state; changes nothing
      std::optional<v1::GetStateDigestRequest> request = Parse<v1::GetStateDigestRequest>(payload);
      if (!request) return;
      v1::StateDigest response;
      const grpc::Status status = d.stub->GetStateDigest(&context, *request, &response);
      Trace("GetStateDigest", status);
      ExpectState(before, "GetStateDigest", status);
      return;
    }
    case Op::kGetServerInfo: {
      v1::ServerInfo response;
      const grpc::Status status = d.stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
      Trace("GetServerInfo", status);
      ExpectState(before, "GetServerInfo", status);
      return;
    }
    default:
      return;
  }
}

void RunScript(const uint8_t* data, size_t size) {
  Daemon& d = TheDaemon();
  std::unique_ptr<Stream> stream;
  ScriptReader reader(data, size);
  int calls = 0, messages = 0;
  while (std::optional<Record> record = reader.Next()) {
    if (record->op == Op::kMessage) {
      if (stream && ++messages <= kMaxMessages) stream->Write(record->payload);
      continue;
    }
    if (record->op != Op::kCancel && record->op != Op::kFinish && ++calls > kMaxCalls) break;
    if (stream) {
      stream->End(/*cancel=*/record->op == Op::kCancel);
      stream.reset();
    }
    switch (record->op) {
      case Op::kBeginUpload:
        stream = std::make_unique<ClientStream<v1::UploadParametersRequest, v1::UploadParametersResponse>>(
            "UploadParameters",
            [&](grpc::ClientContext* c, v1::UploadParametersResponse* r) { return d.stub->UploadParameters(c, r); });
        break;
      case Op::kBeginSetState:
        stream = std::make_unique<ClientStream<v1::SetStateRequest, v1::SetStateResponse>>(
            "SetState", [&](grpc::ClientContext* c, v1::SetStateResponse* r) { return d.stub->SetState(c, r); });
        break;
      case Op::kBeginStep:
        stream = std::make_unique<StepStream>();
        break;
      case Op::kStepWhole:
        StepWhole(record->payload);
        break;
      case Op::kGetParameters:
        ReadAll<v1::GetParametersRequest, v1::GetParametersResponse>(
            record->payload, "GetParameters",
            [&](grpc::ClientContext* c, const v1::GetParametersRequest& q) { return d.stub->GetParameters(c, q); });
        break;
      case Op::kGetState:
        ReadAll<v1::GetStateRequest, v1::GetStateResponse>(
            record->payload, "GetState",
            [&](grpc::ClientContext* c, const v1::GetStateRequest& q) { return d.stub->GetState(c, q); });
        break;
      case Op::kCancel:
      case Op::kFinish:
        break;
      default:
        RunUnary(record->op, record->payload);
        break;
    }
  }
  if (stream) stream->End(/*cancel=*/false);
}

}  // namespace
}  // namespace muond::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  muond::fuzz::RunScript(data, size);
  // The next input starts from a daemon without sessions.
  muond::fuzz::Daemon& daemon = muond::fuzz::TheDaemon();
  daemon.in_flight->WaitIdle();
  for (const auto& session : daemon.registry->List()) (void)daemon.registry->Close(session->id());
  return 0;
}
