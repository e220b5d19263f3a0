// transport_bench: what one step exchange costs on each of muond's step transports, next to its
// peers, in one run on this machine. For each size (the bytes of fp32 gradients; the same bytes of
// parameters come back) it times:
//   tcp     a plain loopback TCP echo written here: N bytes to a thread that sends N bytes back;
//   grpc    a step over the gRPC transport (C++ client, transport "grpc") to a running daemon;
//   shm     the same step over the shared-memory transport (transport "shm");
//   memcpy  two memcpys of N bytes, the least any exchange moves.
// A step's optimizer is SGD with lr 0 on one flat parameter; the daemon's reported compute time is
// subtracted, so the figure is the exchange alone. GB/s counts both directions (2·N / time), from
// the median of the reps.
// Targets (README, Transports): grpc ≥ 0.7× tcp, shm ≥ 0.5× memcpy.
//
// A second table gives the fixed cost of a small step (--small-tensors: steps of that many tensors
// of 64 fp32 elements, SGD): the median wall milliseconds of a step over gRPC in one StepWhole call,
// over a Step stream (ClientOptions::whole_step_bytes 0) and over shared memory, each beside the
// floor, a GetServerInfo round trip on the same channel.
//
// Wall time on a shared virtual machine moves a lot between runs; the CPU time an exchange costs
// does not. With --daemon-pid, a second table gives the CPU milliseconds per exchange: this
// process (both ends of the TCP echo; the client of the steps) plus the daemon.
//
//   transport_bench --endpoint HOST:PORT [--sizes-mb 8 32 128 512] [--reps 5] [--daemon-pid PID]
//                   [--small-tensors 8 64] [--small-reps 500]
// (bench/run_transport_bench.sh starts the daemon and runs this.)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/muond_client.h"

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// CPU seconds this process has used (all threads), and those of process `pid` (0: none).
double SelfCpu() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec + 1e-6 * (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}
double ProcessCpu(int pid) {
  if (pid <= 0) return 0;
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return 0;
  char buffer[1024] = {};
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
  const char* p = std::strrchr(buffer, ')');
  if (p == nullptr || n == 0) return 0;
  unsigned long utime = 0, stime = 0;
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime, &stime) != 2) return 0;
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

int g_daemon_pid = 0;
double Cpu() { return SelfCpu() + ProcessCpu(g_daemon_pid); }

// A transport's figures: median wall seconds of an exchange, CPU seconds per exchange.
struct Timing {
  double seconds = -1;
  double cpu = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// One N-byte loopback TCP echo (median of reps).
Timing TcpEcho(size_t bytes, int reps) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  ::listen(listener, 1);
  std::thread echo([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    std::vector<char> buffer(bytes);
    for (int r = 0; r < reps + 1; ++r) {
      if (!RecvAll(fd, buffer.data(), bytes) || !SendAll(fd, buffer.data(), bytes)) break;
    }
    ::close(fd);
  });
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> out(bytes, 1), in(bytes);
  std::vector<double> times;
  double cpu_start = 0;
  for (int r = 0; r < reps + 1; ++r) {
    if (r == 1) cpu_start = SelfCpu();
    const double start = Now();
    // Send and receive at once, as a step's stream does: a large echo would otherwise deadlock on
    // full socket buffers.
    std::thread sender([&] { SendAll(fd, out.data(), bytes); });
    RecvAll(fd, in.data(), bytes);
    sender.join();
    if (r > 0) times.push_back(Now() - start);
  }
  const double cpu = (SelfCpu() - cpu_start) / reps;
  ::close(fd);
  echo.join();
  ::close(listener);
  return {Median(times), cpu};
}

Timing Memcpy(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes), c(bytes);
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    const double start = Now();
    std::memcpy(b.data(), a.data(), bytes);
    std::memcpy(c.data(), b.data(), bytes);
    if (r > 0) times.push_back(Now() - start);
  }
  if (c[bytes / 2] != 1) std::fprintf(stderr, "memcpy: wrong result\n");
  return {Median(times), Median(times)};
}

// One step's exchange over `transport` (round trip minus the daemon's compute).
Timing StepExchange(const std::string& endpoint, const std::string& transport, size_t bytes, int reps) {
  muond::client::ClientOptions options;
  options.endpoint = endpoint;
  options.transport = transport;
  options.chunk_bytes = 4u << 20;
  auto client = muond::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "%s: %s\n", transport.c_str(), client.status().ToString().c_str());
    return {};
  }
  const int64_t n = static_cast<int64_t>(bytes / 4);
  muond::v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("sgd");
  group->mutable_options()->set_optimizer(muond::v1::OPTIMIZER_SGD);
  group->mutable_options()->set_lr(0.0);
  auto* p = spec.add_parameters();
  p->set_name("flat");
  p->add_shape(n);
  p->set_group("sgd");
  const std::string id = "transport-bench-" + transport + "-" + std::to_string(bytes);
  auto session = (*client)->CreateSession(id, spec);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return {};
  }
  std::vector<float> values(static_cast<size_t>(n), 0.5f);
  const std::vector<muond::client::TensorView> tensors = {{"flat", {n}, values}};
  if (auto s = (*session)->UploadParameters(tensors); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return {};
  }
  std::vector<float> after(static_cast<size_t>(n));
  muond::client::StepOptions step_options;
  step_options.parameters_out["flat"] = after;  // the answer lands here: no allocation per step
  std::vector<double> times;
  double cpu_start = 0;
  for (int r = 0; r < reps + 1; ++r) {
    if (r == 1) cpu_start = Cpu();
    const double start = Now();
    auto reply = (*session)->Step(r + 1, tensors, step_options);
    const double seconds = Now() - start;
    if (!reply.ok()) {
      std::fprintf(stderr, "%s\n", reply.status().ToString().c_str());
      return {};
    }
    if (r > 0) times.push_back(seconds - reply->compute_seconds);
  }
  const double cpu = (Cpu() - cpu_start) / reps;
  (void)(*session)->Close();
  return {Median(times), cpu};
}

// Median wall seconds of a GetServerInfo round trip: the least a call costs on this channel.
double InfoFloor(const std::string& endpoint, int reps) {
  muond::client::ClientOptions options;
  options.endpoint = endpoint;
  auto client = muond::client::Client::Connect(options);
  if (!client.ok()) return 0;
  std::vector<double> times;
  for (int r = 0; r < reps + 20; ++r) {
    const double start = Now();
    if (!(*client)->GetServerInfo().ok()) return 0;
    if (r >= 20) times.push_back(Now() - start);
  }
  return Median(times);
}

// Median wall seconds of a step of `count` tensors of 64 fp32 elements (SGD) over `transport`, with
// whole steps up to `whole_step_bytes` (0: every step on a stream).
double SmallStep(const std::string& endpoint, const std::string& transport, size_t whole_step_bytes, int count,
                 int reps) {
  muond::client::ClientOptions options;
  options.endpoint = endpoint;
  options.transport = transport;
  options.whole_step_bytes = whole_step_bytes;
  auto client = muond::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "%s: %s\n", transport.c_str(), client.status().ToString().c_str());
    return 0;
  }
  constexpr int64_t kElements = 64;
  muond::v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("sgd");
  group->mutable_options()->set_optimizer(muond::v1::OPTIMIZER_SGD);
  group->mutable_options()->set_lr(1e-9);
  std::vector<std::string> names;
  for (int i = 0; i < count; ++i) {
    names.push_back("t" + std::to_string(i));
    auto* p = spec.add_parameters();
    p->set_name(names.back());
    p->add_shape(kElements);
    p->set_group("sgd");
  }
  const std::string id =
      "transport-bench-small-" + transport + "-" + std::to_string(whole_step_bytes) + "-" + std::to_string(count);
  auto session = (*client)->CreateSession(id, spec);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 0;
  }
  std::vector<float> values(kElements, 0.5f);
  std::vector<std::vector<float>> after(static_cast<size_t>(count), std::vector<float>(kElements));
  std::vector<muond::client::TensorView> tensors;
  muond::client::StepOptions step_options;
  for (int i = 0; i < count; ++i) {
    tensors.push_back({names[i], {kElements}, values});
    step_options.parameters_out[names[i]] = after[i];
  }
  if (auto s = (*session)->UploadParameters(tensors); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 0;
  }
  std::vector<double> times;
  for (int r = 0; r < reps + 20; ++r) {  // 20 untimed steps first
    const double start = Now();
    auto reply = (*session)->Step(r + 1, tensors, step_options);
    if (!reply.ok()) {
      std::fprintf(stderr, "%s\n", reply.status().ToString().c_str());
      return 0;
    }
    if (r >= 20) times.push_back(Now() - start);
  }
  (void)(*session)->Close();
  return Median(times);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("transport_bench: one step exchange per transport against raw TCP and memcpy");
  std::string endpoint;
  std::vector<int> sizes_mb = {8, 32, 128, 512};
  int reps = 5;
  bool json = false;
  app.add_option("--endpoint", endpoint, "A running muond daemon on this host")->required();
  app.add_option("--sizes-mb", sizes_mb, "Gradient sizes in MiB");
  app.add_option("--reps", reps, "Timed repetitions (median)");
  app.add_flag("--json", json, "One JSON object per size");
  app.add_option("--daemon-pid", g_daemon_pid, "The daemon's process id: adds its CPU time to the steps' CPU figures");
  std::vector<int> small_tensors = {8, 64};
  int small_reps = 500;
  app.add_option("--small-tensors", small_tensors, "Tensors per small step (64 fp32 elements each); 0: none");
  app.add_option("--small-reps", small_reps, "Timed small steps (median)");
  CLI11_PARSE(app, argc, argv);
  if (!json) {
    std::printf("%8s %9s %9s %9s %9s %9s %9s\n", "MiB", "tcp", "grpc", "shm", "memcpy", "grpc/", "shm/");
    std::printf("%8s %9s %9s %9s %9s %9s %9s\n", "", "GB/s", "GB/s", "GB/s", "GB/s", "tcp", "memcpy");
  }
  struct Row {
    int mb;
    Timing tcp, grpc, shm, copy;
  };
  std::vector<Row> rows;
  for (int mb : sizes_mb) {
    const size_t bytes = static_cast<size_t>(mb) << 20;
    Row row{mb, TcpEcho(bytes, reps), StepExchange(endpoint, "grpc", bytes, reps),
            StepExchange(endpoint, "shm", bytes, reps), Memcpy(bytes, reps)};
    auto gbps = [&](double seconds) { return seconds > 0 ? 2.0 * bytes / seconds / 1e9 : 0.0; };
    if (json) {
      std::printf(
          "{\"mib\": %d, \"tcp_gbps\": %.3f, \"grpc_gbps\": %.3f, \"shm_gbps\": %.3f, \"memcpy_gbps\": %.3f, "
          "\"tcp_cpu_ms\": %.2f, \"grpc_cpu_ms\": %.2f, \"shm_cpu_ms\": %.2f, \"memcpy_cpu_ms\": %.2f}\n",
          mb, gbps(row.tcp.seconds), gbps(row.grpc.seconds), gbps(row.shm.seconds), gbps(row.copy.seconds),
          1e3 * row.tcp.cpu, 1e3 * row.grpc.cpu, 1e3 * row.shm.cpu, 1e3 * row.copy.cpu);
    } else {
      std::printf("%8d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", mb, gbps(row.tcp.seconds), gbps(row.grpc.seconds),
                  gbps(row.shm.seconds), gbps(row.copy.seconds), gbps(row.grpc.seconds) / gbps(row.tcp.seconds),
                  gbps(row.shm.seconds) / gbps(row.copy.seconds));
    }
    std::fflush(stdout);
    rows.push_back(row);
  }
  if (!json && g_daemon_pid > 0) {
    std::printf("\nCPU milliseconds per exchange (this process + the daemon; memcpy: its wall time)\n");
    std::printf("%8s %9s %9s %9s %9s %9s %9s\n", "MiB", "tcp", "grpc", "shm", "memcpy", "grpc/", "shm/");
    std::printf("%8s %9s %9s %9s %9s %9s %9s\n", "", "ms", "ms", "ms", "ms", "tcp", "memcpy");
    for (const Row& row : rows) {
      std::printf("%8d %9.1f %9.1f %9.1f %9.1f %9.2f %9.2f\n", row.mb, 1e3 * row.tcp.cpu, 1e3 * row.grpc.cpu,
                  1e3 * row.shm.cpu, 1e3 * row.copy.cpu, row.grpc.cpu / row.tcp.cpu, row.shm.cpu / row.copy.cpu);
    }
  }
  const double floor = InfoFloor(endpoint, small_reps);
  if (!json && !small_tensors.empty() && small_tensors.front() > 0) {
    std::printf("\nSmall steps: ms per step (median of %d) and × the floor (a GetServerInfo round trip, %.3f ms)\n",
                small_reps, 1e3 * floor);
    std::printf("%8s %9s %9s %9s %9s %9s %9s\n", "tensors", "grpc", "grpc/", "stream", "stream/", "shm", "shm/");
  }
  for (int count : small_tensors) {
    if (count <= 0) continue;
    const double whole =
        SmallStep(endpoint, "grpc", muond::client::ClientOptions().whole_step_bytes, count, small_reps);
    const double stream = SmallStep(endpoint, "grpc", 0, count, small_reps);
    const double shm = SmallStep(endpoint, "shm", 0, count, small_reps);
    if (json) {
      std::printf(
          "{\"small_tensors\": %d, \"floor_ms\": %.4f, \"grpc_ms\": %.4f, \"grpc_stream_ms\": %.4f, "
          "\"shm_ms\": %.4f}\n",
          count, 1e3 * floor, 1e3 * whole, 1e3 * stream, 1e3 * shm);
    } else {
      std::printf("%8d %9.3f %9.2f %9.3f %9.2f %9.3f %9.2f\n", count, 1e3 * whole, whole / floor, 1e3 * stream,
                  stream / floor, 1e3 * shm, shm / floor);
    }
    std::fflush(stdout);
  }
  return 0;
}
