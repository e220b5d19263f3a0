// Hostile bytes against the real daemon: connections that send what is not gRPC at all, and
// hundreds of random well-formed requests that are each wrong somewhere. The fixture (see
// hostile_input_fixture.h) checks that the trained session is untouched and the daemon serves.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/hostile_input_fixture.h"

namespace muond::testing::hostile {
namespace {

// Connects to the daemon's port, sends `bytes`, reads whatever comes back for up to `linger` and
// closes. Returns the socket still open instead when `keep_open` (the caller closes it).
int SendRaw(int port, const std::string& bytes, std::chrono::milliseconds linger, bool keep_open = false) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the daemon hung up on us: fine
    sent += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + linger;
  char buffer[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    if (recv(fd, buffer, sizeof buffer, 0) <= 0) break;  // closed by the daemon
  }
  if (keep_open) return fd;
  close(fd);
  return 0;
}

// Bytes that are not gRPC: random noise, HTTP/1.1, every prefix of the HTTP/2 preface, the preface
// followed by broken frames, a TLS hello to a plaintext port, and idle connections held open while a
// real client works.
TEST_F(HostileInputTest, GarbageOnThePortIsDroppedAndChangesNothing) {
  const int port = daemon_->port();
  std::mt19937 rng(1234);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  std::vector<std::string> inputs = {
      "",
      "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
      "POST /muond.v1.Muond/Step HTTP/1.1\r\nContent-Type: application/grpc\r\nContent-Length: 5\r\n\r\nhello",
      std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11) + random_bytes(300),  // TLS ClientHello
      preface + random_bytes(64),
      // SETTINGS frame announcing a 16 MiB payload, then nothing.
      preface + std::string("\xff\xff\xff\x04\x00\x00\x00\x00\x00", 9),
      // HEADERS on stream 1 whose HPACK block is noise.
      preface + std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9) +
          std::string("\x00\x00\x20\x01\x05\x00\x00\x00\x01", 9) + random_bytes(32),
      // DATA on a stream that was never opened.
      preface + std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9) +
          std::string("\x00\x00\x05\x00\x01\x00\x00\x00\x07", 9) + "hello",
  };
  for (size_t n = 1; n < preface.size(); ++n) inputs.push_back(preface.substr(0, n));
  for (size_t n : {1, 7, 24, 1000, 70000}) inputs.push_back(random_bytes(n));
  for (const std::string& bytes : inputs) {
    ASSERT_EQ(SendRaw(port, bytes, std::chrono::milliseconds(20)), 0) << "cannot connect to port " << port;
  }
  ExpectIntact();

  // Half-open connections (a partial preface, noise, nothing) do not stop the real client.
  std::vector<int> held;
  for (int i = 0; i < 16; ++i) {
    const std::string bytes = i % 3 == 0 ? preface.substr(0, 10) : i % 3 == 1 ? random_bytes(100) : "";
    held.push_back(SendRaw(port, bytes, std::chrono::milliseconds(0), /*keep_open=*/true));
    ASSERT_GE(held.back(), 0);
  }
  ExpectIntact();
  for (int fd : held) close(fd);
  ASSERT_FALSE(daemon_->Exited()) << "muond died on bytes that are not gRPC";
  ExpectIntactAndServing();
}

// Random requests of the right message types, each wrong somewhere: random names, session ids,
// offsets, dtypes, shapes, step numbers, ranks, overrides, byte counts. None may change the
// session; each must be refused with a status that names a client error, never a crash.
class RandomRequests {
 public:
  RandomRequests(uint32_t seed, std::string id) : rng_(seed), id_(std::move(id)) {}

  int Int(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  template <typename T>
  T Pick(std::initializer_list<T> values) {
    return *(values.begin() + Int(static_cast<int>(values.size())));
  }

  std::string Text() {
    std::string s(Int(12), 'a');
    for (char& c : s) c = static_cast<char>(Pick<int>({'a', 'z', 'w', 'b', '.', '-', '_', '0', ' ', '/', '!'}));
    return s;
  }
  std::string SessionId() {
    return Pick<int>({0, 0, 1, 2, 3}) == 0 ? id_ : Pick<std::string>({"", "no-such", id_ + "x", "bad id!"});
  }
  std::string ParameterName() { return Pick<int>({0, 1, 2}) < 2 ? Pick<std::string>({"w", "b"}) : Text(); }
  std::string GroupName() { return Chance(0.7) ? Pick<std::string>({"matrices", "vectors"}) : Text(); }
  v1::DType DType() { return static_cast<v1::DType>(Pick<int>({0, 1, 2, 3, 4, 99, -1})); }
  double Real() { return Pick<double>({0.0, 0.01, 0.9, 1.0, -1.0, 1e300, std::nan(""), INFINITY, -INFINITY}); }
  int64_t Huge() {
    return Pick<int64_t>({-1, 0, 1, 32, 64, 2048, int64_t{1} << 40, std::numeric_limits<int64_t>::max()});
  }

  v1::TensorChunk RandomChunk() {
    v1::TensorChunk chunk;
    chunk.set_name(ParameterName());
    chunk.set_offset(Chance(0.5) ? 0 : static_cast<uint64_t>(Huge()));
    chunk.set_dtype(DType());
    const size_t bytes = Pick<size_t>({0, 1, 3, 4, 6, 128, 1024, 4096, 4100, 8192});
    std::string data(bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng_());
    chunk.set_data(std::move(data));
    if (Chance(0.2)) chunk.set_slot(Pick<std::string>({"master", "momentum", "exp_avg", "exp_avg_sq", "nope"}));
    if (Chance(0.3)) {
      for (int d = Int(4); d > 0; --d) chunk.add_shape(Huge());
    }
    return chunk;
  }

  v1::StepHeader RandomHeader(int64_t next_step) {
    v1::StepHeader header;
    header.set_session_id(SessionId());
    header.set_step(Chance(0.6) ? next_step : Pick<int64_t>({-1, 0, 1, next_step - 1, next_step + 1, 1 << 30}));
    header.set_rank(Chance(0.8) ? 0 : Pick<int>({-1, 1, 7}));
    for (int i = Int(3); i > 0; --i) {
      v1::GroupOverride* o = header.add_overrides();
      o->set_group(GroupName());
      if (Chance(0.7)) o->set_lr(Real());
      if (Chance(0.3)) o->set_momentum(Real());
      if (Chance(0.3)) o->set_weight_decay(Real());
    }
    if (Chance(0.3)) header.set_max_grad_norm(Real());
    if (Chance(0.3)) header.set_return_dtype(DType());
    if (Chance(0.3)) header.set_max_chunk_bytes(Pick<uint32_t>({1, 7, 4096, std::numeric_limits<uint32_t>::max()}));
    // Unset, the count of chunks actually sent is announced; otherwise a wrong one.
    if (Chance(0.1)) header.set_num_chunks(Pick<uint32_t>({0, 1, 1000, std::numeric_limits<uint32_t>::max()}));
    if (Chance(0.1)) {
      v1::QkClipLogits* logits = header.add_qk_logits();
      logits->set_query(ParameterName());
      logits->add_max_logits(Real());
    }
    return header;
  }

  // Something that makes a step request wrong however the rest came out.
  void Spoil(v1::StepHeader& header, std::vector<v1::TensorChunk>& chunks) {
    switch (Int(6)) {
      case 0: {
        v1::TensorChunk chunk = RandomChunk();
        chunk.set_name("not-a-parameter");
        chunks.push_back(chunk);
        break;
      }
      case 1: {
        v1::GroupOverride* o = header.add_overrides();
        o->set_group("matrices");
        o->set_lr(-1);
        break;
      }
      case 2:
        header.set_rank(5);
        break;
      case 3:
        header.set_max_grad_norm(-1);
        break;
      case 4:
        header.set_return_dtype(static_cast<v1::DType>(42));
        break;
      default:
        header.add_qk_logits()->set_query("w");  // the session has no QK-clip pairs
        break;
    }
  }

  v1::SessionSpec RandomSpec(const v1::SessionSpec& real) {
    v1::SessionSpec spec = real;
    switch (Int(5)) {
      case 0:
        spec.mutable_parameters(Int(2))->set_name(Text());
        break;
      case 1: {
        v1::ParameterSpec* p = spec.mutable_parameters(Int(2));
        p->clear_shape();
        // Small or refused: never a shape the daemon would have to allocate gigabytes for.
        for (int d = Chance(0.1) ? 9 : Int(4); d > 0; --d) p->add_shape(Pick<int64_t>({-1, 0, 1, 3, 64}));
        if (Chance(0.2)) p->add_shape(int64_t{1} << 40);
        break;
      }
      case 2:
        spec.mutable_parameters(Int(2))->set_wire_dtype(DType());
        break;
      case 3:
        spec.mutable_groups(Int(2))->mutable_options()->set_ns_steps(Pick<int>({-1, 0, 1, 1000}));
        break;
      default:
        spec.mutable_parameters(Int(2))->set_group(GroupName());
        spec.set_world_size(Pick<int>({-1, 0, 2, 1000}));
        break;
    }
    spec.add_parameters()->set_name("extra-" + std::to_string(Int(1000)));  // never the real spec
    return spec;
  }

  std::mt19937& rng() { return rng_; }

 private:
  std::mt19937 rng_;
  const std::string id_;
};

bool IsClientError(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::OUT_OF_RANGE:
      return true;
    default:
      return false;
  }
}

TEST_F(HostileInputTest, RandomWrongRequestsAreRefusedAndChangeNothing) {
  constexpr uint32_t kSeed = 20240607;
  constexpr int kRequests = 400;
  SCOPED_TRACE(::testing::Message() << "random requests from seed " << kSeed);
  RandomRequests random(kSeed, id_);
  const int64_t next = kTrainedSteps + 1;
  std::map<std::string, int> outcomes;  // "kind code" → count, printed at the end
  for (int i = 0; i < kRequests; ++i) {
    grpc::Status status;
    std::string kind;
    bool may_succeed = false;  // reads, replays, and sessions created under other ids
    switch (random.Int(7)) {
      case 0:
      case 1:
      case 2: {
        kind = "Step";
        v1::StepHeader header = random.RandomHeader(next);
        std::vector<v1::TensorChunk> chunks;
        for (int n = random.Int(10); n > 0; --n) chunks.push_back(random.RandomChunk());
        if (random.Chance(0.3)) {  // a real gradient in the mix, so the bad part is all that is wrong
          std::vector<v1::TensorChunk> real = TensorChunks(static_cast<int>(next), 512);
          chunks.insert(chunks.begin(), real.begin(), real.end());
        }
        if (header.session_id() == id_ && header.step() == next) random.Spoil(header, chunks);
        v1::StepResult result;
        status = RawStep(header, chunks, &result);
        may_succeed = status.ok() && result.replayed();
        break;
      }
      case 3: {
        kind = "CreateSession";
        const std::string id = random.Chance(0.7) ? id_ : "other-" + std::to_string(i);
        grpc::ClientContext context;
        client_->PrepareContext(context);
        v1::CreateSessionRequest request;
        request.set_session_id(id);
        *request.mutable_spec() = random.RandomSpec(Spec());
        v1::CreateSessionResponse response;
        status = client_->stub().CreateSession(&context, request, &response);
        if (status.ok()) {  // a valid spec under another id: a session of its own, closed again
          ASSERT_NE(id, id_) << "a different spec attached to the trained session";
          EXPECT_OK(client_->CloseSession(id));
          may_succeed = true;
        }
        break;
      }
      case 4: {
        kind = "UploadParameters";  // the trained session takes no upload; other ids do not exist
        std::vector<v1::TensorChunk> chunks =
            random.Chance(0.5) ? TensorChunks(0, 1024) : std::vector<v1::TensorChunk>{};
        for (int n = random.Int(4); n > 0; --n) chunks.push_back(random.RandomChunk());
        std::vector<v1::UploadParametersRequest> messages = UploadMessages(random.SessionId(), chunks);
        if (random.Chance(0.1)) messages.erase(messages.begin());
        status = Upload(messages);
        break;
      }
      case 5: {
        kind = "SetState";  // never complete: "b"'s exp_avg_sq is always missing
        std::vector<v1::SetStateRequest> messages = OtherState();
        std::erase_if(messages, [](const v1::SetStateRequest& m) {
          return m.has_chunk() && m.chunk().name() == "b" && m.chunk().slot() == "exp_avg_sq";
        });
        messages[0].set_session_id(random.SessionId());
        if (random.Chance(0.5))
          messages[1].mutable_header()->set_last_step(random.Huge() * (random.Chance(0.5) ? -1 : 1));
        if (random.Chance(0.3)) messages[1].mutable_header()->mutable_step_counts(0)->set_count(-random.Huge());
        for (int n = random.Int(4); n > 0; --n) {
          v1::SetStateRequest& m = *messages.insert(
              messages.begin() + 2 + random.Int(static_cast<int>(messages.size()) - 1), v1::SetStateRequest());
          *m.mutable_chunk() = random.RandomChunk();
        }
        status = SetState(messages);
        break;
      }
      default: {
        kind = "GetParameters";
        grpc::ClientContext context;
        client_->PrepareContext(context);
        v1::GetParametersRequest request;
        request.set_session_id(random.SessionId());
        for (int n = random.Int(3); n > 0; --n) request.add_names(random.ParameterName());
        request.set_dtype(random.DType());
        request.set_max_chunk_bytes(random.Pick<uint32_t>({0, 1, 3, 4096, std::numeric_limits<uint32_t>::max()}));
        auto reader = client_->stub().GetParameters(&context, request);
        v1::GetParametersResponse response;
        while (reader->Read(&response)) {
        }
        status = reader->Finish();
        may_succeed = true;
        break;
      }
    }
    ++outcomes[kind + " " + std::to_string(status.error_code())];
    if (status.ok()) {
      EXPECT_TRUE(may_succeed) << "request " << i << " (" << kind << ") was accepted";
    } else {
      EXPECT_TRUE(IsClientError(status.error_code()))
          << "request " << i << " (" << kind << "): " << status.error_code() << " " << status.error_message();
      EXPECT_FALSE(status.error_message().empty()) << "request " << i << " (" << kind << ") names no field";
    }
    if (i % 100 == 99) ExpectIntact();
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::string summary;
  for (const auto& [outcome, count] : outcomes) summary += " [" + outcome + "]x" + std::to_string(count);
  std::printf("outcomes by kind and status code:%s\n", summary.c_str());
  ExpectIntactAndServing();
}

}  // namespace
}  // namespace muond::testing::hostile
