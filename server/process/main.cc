// The muond daemon: parses flags, picks the compute backend, serves muond.v1.Muond and
// grpc.health.v1.Health, and on SIGINT/SIGTERM lets in-flight requests finish before exiting 0.
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/host_id.h"
#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/blas_kernel.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/newton_schulz.h"
#include "server/durability/env.h"
#include "server/durability/session_files.h"
#include "server/durability/state_dir_lock.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_endpoint.h"
#include "server/metrics/prometheus_metrics.h"
#include "server/process/fd_budget.h"
#include "server/process/flags.h"
#include "server/process/grpc_listener_watch.h"
#include "server/rpc/call_tracker.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/server_credentials.h"
#include "server/rpc/session_spec_codec.h"
#include "server/security/tls_files.h"
#include "server/security/token_table.h"
#include "server/session/session_registry.h"
#include "server/transport/cuda_ipc/cuda_memory_regions.h"
#include "server/transport/nccl/nccl_channels.h"
#include "server/transport/shm/shm_socket_server.h"

namespace muond::server {
namespace {

// Protobuf's own log lines, which it writes to stderr in its own format, go to the daemon's log. A
// request whose string field is not UTF-8 makes protobuf complain at ERROR level as it parses: the
// daemon refuses that request and logs the refusal itself, naming the field, so protobuf's line is
// only a debug one (a client could otherwise fill the log with them).
void LogProtobufLine(google::protobuf::LogLevel level, const char* /*file*/, int /*line*/, const std::string& message) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      MUOND_LOG(debug, "protobuf: {}", message);
      return;
    case google::protobuf::LOGLEVEL_WARNING:
      MUOND_LOG(warn, "protobuf: {}", message);
      return;
    case google::protobuf::LOGLEVEL_ERROR:
      if (message.find("invalid UTF-8") != std::string::npos) {
        MUOND_LOG(debug, "protobuf: {}", message);
      } else {
        MUOND_LOG(error, "protobuf: {}", message);
      }
      return;
    case google::protobuf::LOGLEVEL_FATAL:
      MUOND_LOG(critical, "protobuf: {}", message);
      return;
  }
}

// Writes the port next to the target and renames it into place, so a reader never sees half a file.
bool WritePortFile(const std::string& path, int port) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << port << "\n";
    if (!out.good()) return false;
  }
  std::error_code error;
  std::filesystem::rename(temp, path, error);
  return !error;
}

// SIGINT/SIGTERM → one byte (the signal number) on this pipe; main() waits for it.
int g_stop_pipe[2] = {-1, -1};

void OnStopSignal(int signal_number) {
  const char byte = static_cast<char>(signal_number);
  [[maybe_unused]] const ssize_t written = write(g_stop_pipe[1], &byte, 1);  // async-signal-safe
}

bool InstallStopHandlers() {
  if (pipe2(g_stop_pipe, O_CLOEXEC) != 0) return false;
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  return sigaction(SIGINT, &action, nullptr) == 0 && sigaction(SIGTERM, &action, nullptr) == 0;
}

// Written to the stop pipe instead of a signal number when gRPC's listener has stopped accepting.
constexpr char kListenerLost = 0;

int WaitForStopSignal() {
  char byte = 0;
  while (read(g_stop_pipe[0], &byte, 1) != 1) {
    if (errno != EINTR) return SIGTERM;
  }
  return byte;
}

std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

// Start-up refused: logged where it was found; the daemon exits with `exit_code` (2: a flag or a
// file it names is wrong; 1: anything else).
struct Refused {
  int exit_code;
};

// Descriptors: every one the hard limit allows, and the shared-memory socket's share of them.
std::optional<FdBudget> BudgetDescriptors(const DaemonFlags& flags) {
  absl::StatusOr<FdLimit> fd_limit = RaiseFdLimit(flags.max_open_files);
  if (!fd_limit.ok()) {
    MUOND_LOG(error, "{}", fd_limit.status().message());
    return std::nullopt;
  }
  const FdBudget fd_budget = DeriveFdBudget(fd_limit->soft, flags.shm_max_connections, flags.shm_max_pending_fds);
  MUOND_LOG(info,
            "open files: soft limit {} (was {}), hard limit {}; shared memory holds at most {} connections "
            "and {} unclaimed memfds",
            fd_limit->soft, fd_limit->soft_before, fd_limit->hard, fd_budget.shm_connections, fd_budget.shm_pending);
  return fd_budget;
}

// StartOnTheBestBlasKernel's result in main(): why the daemon could not start again under a better
// OpenBLAS kernel, if it could not (kernels/cpu/blas_kernel.h).
int g_blas_exec_errno = 0;

std::optional<kernels::BackendSelection> StartBackend(const DaemonFlags& flags) {
  absl::StatusOr<kernels::BackendSelection> selection =
      kernels::CreateBackend(flags.backend, flags.device, flags.threads);
  if (!selection.ok()) {
    MUOND_LOG(error, "cannot start the {} backend: {}", flags.backend, selection.status().message());
    return std::nullopt;
  }
  if (!selection->note.empty()) MUOND_LOG(info, "{}", selection->note);
  if (const kernels::BlasKernelNote note = kernels::DescribeBlasKernel(g_blas_exec_errno);
      selection->backend->Name() == "cpu" && !note.text.empty()) {
    if (note.warning) {
      MUOND_LOG(warn, "CPU backend: {}", note.text);
    } else {
      MUOND_LOG(info, "CPU backend: {}", note.text);
    }
  }
  return *std::move(selection);
}

// Who may call: tokens and TLS material, checked before any session is restored so that a typo
// fails fast.
struct Access {
  std::optional<security::TokenTable> tokens;
  security::TlsFiles tls;
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

std::optional<Access> LoadAccess(const DaemonFlags& flags) {
  Access access;
  if (!flags.auth_token_file.empty()) {
    absl::StatusOr<security::TokenTable> loaded = security::TokenTable::Load(flags.auth_token_file);
    if (!loaded.ok()) {
      MUOND_LOG(error, "{}", loaded.status().message());
      return std::nullopt;
    }
    access.tokens = *std::move(loaded);
    const auto permissions = std::filesystem::status(flags.auth_token_file).permissions();
    if ((permissions & (std::filesystem::perms::group_read | std::filesystem::perms::others_read)) !=
        std::filesystem::perms::none) {
      MUOND_LOG(warn, "--auth-token-file {} is readable by other users (chmod 600 it)", flags.auth_token_file);
    }
  }
  access.tls = security::TlsFiles{flags.tls_cert, flags.tls_key, flags.tls_client_ca};
  absl::StatusOr<security::TlsMaterial> tls_material = security::LoadTlsMaterial(access.tls);
  if (!tls_material.ok()) {
    MUOND_LOG(error, "{}", tls_material.status().message());
    return std::nullopt;
  }
  access.credentials = rpc::MakeServerCredentials(*tls_material);
  return access;
}

// Where the daemon reports: a Prometheus exporter and its endpoint with --metrics-listen, else
// NoMetrics() (recorded only when served).
struct MetricsOutlet {
  std::unique_ptr<metrics::PrometheusMetrics> prometheus;
  std::unique_ptr<metrics::MetricsEndpoint> endpoint;
  metrics::Metrics* metrics = metrics::NoMetrics();
};

std::variant<MetricsOutlet, Refused> StartMetrics(const DaemonFlags& flags, kernels::Backend* backend) {
  MetricsOutlet outlet;
  if (flags.metrics_listen.empty()) return outlet;
  metrics::PrometheusOptions options;
  options.version = MUOND_VERSION;
  options.backend = backend->Name();
  options.max_sessions = flags.max_sessions;
  options.max_session_bytes = flags.max_session_bytes;
  options.max_total_bytes = flags.max_total_bytes;
  options.backend_memory = [backend] {
    const kernels::Backend::MemoryUse use = backend->Memory();
    return std::make_pair(use.in_use_bytes, use.reserved_bytes);
  };
  options.ns_workspace = [backend] {
    const optim::NsWorkspace& ws = optim::BackendNsWorkspace(*backend).ws;
    return std::make_pair(static_cast<int64_t>(4 * ws.held()), static_cast<int64_t>(4 * ws.limit()));
  };
  outlet.prometheus = std::make_unique<metrics::PrometheusMetrics>(std::move(options));
  absl::StatusOr<std::unique_ptr<metrics::MetricsEndpoint>> endpoint =
      metrics::MetricsEndpoint::Start(flags.metrics_listen, [m = outlet.prometheus.get()] { return m->Render(); },
                                      {.max_connections = flags.metrics_max_connections});
  if (!endpoint.ok()) {
    MUOND_LOG(error, "{}", endpoint.status().message());
    return Refused{endpoint.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1};
  }
  outlet.endpoint = *std::move(endpoint);
  outlet.metrics = outlet.prometheus.get();
  MUOND_LOG(info, "metrics: http://{}/metrics", outlet.endpoint->address());
  return outlet;
}

session::SpecLimits SpecLimitsOf(const DaemonFlags& flags) {
  session::SpecLimits spec_limits;
  spec_limits.max_rank = flags.max_tensor_rank;
  spec_limits.max_tensor_elements = flags.max_tensor_elements;
  spec_limits.straggler_timeout_seconds = flags.straggler_timeout_seconds;
  return spec_limits;
}

// With --state-dir: takes the folder's lock (held in `lock` for the daemon's life: one daemon per
// state directory), makes the registry durable and restores the sessions found there.
bool RestoreStateDir(const DaemonFlags& flags, const kernels::Backend& backend, session::SessionRegistry& registry,
                     std::unique_ptr<durability::StateDirLock>& lock) {
  if (flags.state_dir.empty()) return true;
  if (absl::Status created = durability::Env::Default()->CreateDirs(flags.state_dir); !created.ok()) {
    MUOND_LOG(error, "cannot create --state-dir {}: {}", flags.state_dir, created.message());
    return false;
  }
  absl::StatusOr<std::unique_ptr<durability::StateDirLock>> locked = durability::StateDirLock::Acquire(flags.state_dir);
  if (!locked.ok()) {
    MUOND_LOG(error, "{}", locked.status().message());
    return false;
  }
  lock = *std::move(locked);
  durability::StateDirOptions state;
  state.state_dir = flags.state_dir;
  state.durability =
      flags.durability == "journal" ? durability::Durability::kJournal : durability::Durability::kSnapshot;
  state.checkpoint_every = flags.checkpoint_every;
  state.on_damaged =
      flags.on_damaged_state == "fail" ? durability::DamagedState::kFail : durability::DamagedState::kQuarantine;
  state.backend_name = backend.Name();
  if (absl::Status restored = registry.EnablePersistence(state); !restored.ok()) {
    MUOND_LOG(error, "cannot restore the sessions in --state-dir {}: {}", flags.state_dir, restored.message());
    return false;
  }
  MUOND_LOG(info, "state directory {} ({} durability): {} sessions restored", flags.state_dir, flags.durability,
            registry.size());
  return true;
}

// The out-of-band transports' tables and the shared-memory socket, owned for the daemon's life.
// The GPU transports are served by a CUDA backend and refused (with the reason) by the others; CUDA
// IPC memory registered with a liveness ticket goes when the client's socket connection closes.
struct Transports {
  std::unique_ptr<transport::SharedMemoryRegions> shm_regions;
  std::unique_ptr<transport::CudaMemoryRegions> cuda_regions;
  std::unique_ptr<transport::NcclChannels> nccl_channels;
  std::unique_ptr<transport::ShmSocketServer> shm_socket;  // null with --shm-socket none
  std::string shm_address;

  // Offers them to the service: shared memory only when its socket listens.
  rpc::OfferedTransports Offered() const {
    rpc::OfferedTransports offered;
    offered.cuda_regions = cuda_regions.get();
    offered.nccl_channels = nccl_channels.get();
    if (shm_socket != nullptr) {
      offered.shm_regions = shm_regions.get();
      offered.shm_socket = shm_address;
    }
    return offered;
  }
};

std::optional<Transports> StartTransports(const DaemonFlags& flags, kernels::Backend* backend,
                                          const FdBudget& fd_budget) {
  Transports transports;
  // The shared-memory transport: its socket takes memfds from clients on this host.
  transport::SharedMemoryLimits shm_limits;
  shm_limits.max_region_bytes = flags.shm_max_region_bytes;
  shm_limits.max_connections = fd_budget.shm_connections;
  shm_limits.max_pending = fd_budget.shm_pending;
  shm_limits.pending_timeout = absl::Seconds(flags.shm_ticket_timeout_seconds);
  // Steps copy gradients out of the regions and parameters into them on the threads compute has
  // (--threads): the CPU backend's own pool, whose gate they then share with compute; a pool of as
  // many for another backend; without a socket nothing is copied.
  const int copy_threads = flags.shm_socket == "none" ? 1
                           : flags.threads > 0        ? flags.threads
                                                      : static_cast<int>(std::thread::hardware_concurrency());
  transports.shm_regions =
      std::make_unique<transport::SharedMemoryRegions>(shm_limits, kernels::CpuComputePool(*backend), copy_threads);
  transports.cuda_regions = std::make_unique<transport::CudaMemoryRegions>(backend, transports.shm_regions.get());
  transports.shm_regions->OnConnectionClosed([cuda_regions = transports.cuda_regions.get()](uint64_t connection) {
    cuda_regions->DropConnection(connection);
  });
  transports.nccl_channels = std::make_unique<transport::NcclChannels>(
      backend, transport::NcclChannelLimits{flags.max_nccl_channels, absl::Seconds(flags.nccl_timeout_seconds)});
  if (flags.shm_socket == "none") return transports;
  transports.shm_address = flags.shm_socket == "auto" ? transport::DefaultShmSocketAddress() : flags.shm_socket;
  absl::StatusOr<std::unique_ptr<transport::ShmSocketServer>> started =
      transport::ShmSocketServer::Start(transports.shm_address, transports.shm_regions.get());
  if (!started.ok()) {
    MUOND_LOG(error, "{}", started.status().message());
    return std::nullopt;
  }
  transports.shm_socket = *std::move(started);
  return transports;
}

rpc::ServiceOptions ServiceOptionsOf(const DaemonFlags& flags, const Access& access, const MetricsOutlet& outlet,
                                     const Transports& transports) {
  rpc::ServiceOptions service_options;
  service_options.max_chunk_bytes = flags.max_chunk_bytes;
  service_options.default_chunk_bytes = std::min<size_t>(flags.max_chunk_bytes, 1u << 20);
  // Room for the chunk plus its name and framing.
  service_options.max_message_bytes = flags.max_chunk_bytes + (1u << 20);
  service_options.tokens = access.tokens ? &*access.tokens : nullptr;
  service_options.rpc_timeout = absl::Seconds(flags.rpc_timeout_seconds);
  service_options.metrics = outlet.metrics;
  service_options.transports = transports.Offered();
  service_options.host_id = muond::HostId();
  service_options.metrics_address = outlet.endpoint ? outlet.endpoint->address() : "";
  service_options.durability = flags.state_dir.empty() ? "" : flags.durability;
  service_options.max_sessions = flags.max_sessions;
  service_options.max_calls_per_caller = flags.max_calls_per_caller;
  return service_options;
}

// The gRPC server with the service, the health service and `calls` (which must outlive it), bound
// to --listen; `*port` is the port it bound (0 when it could not).
std::unique_ptr<grpc::Server> StartServer(const DaemonFlags& flags, const Access& access,
                                          const rpc::ServiceOptions& service_options, rpc::MuondService& service,
                                          rpc::CallTracker& calls, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(flags.listen, access.credentials, port);
  // Never SO_REUSEPORT (gRPC's default on Linux): a second daemon given the same --listen would share
  // its connections, a trainer's steps reaching either and its session held by one. It fails instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(service_options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(service_options.max_message_bytes));
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(calls.NewFactory());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  // gRPC 1.51 stops accepting for good after accept4 fails (out of descriptors): exit for the
  // supervisor rather than serve nobody.
  WatchGrpcListener([] {
    const char byte = kListenerLost;
    [[maybe_unused]] const ssize_t written = write(g_stop_pipe[1], &byte, 1);
  });
  return builder.BuildAndStart();
}

void LogServing(const DaemonFlags& flags, int port, const kernels::Backend& backend, const Access& access,
                const Transports& transports) {
  const security::TlsFiles& tls = access.tls;
  MUOND_LOG(info, "muond listening on {}:{} with the {} backend ({})", HostOf(flags.listen), port, backend.Name(),
            backend.Detail());
  MUOND_LOG(info, "transport: {}; authentication: {}",
            tls.enabled() ? (tls.client_ca.empty() ? "TLS" : "mutual TLS") : "plaintext",
            access.tokens ? absl::StrCat(access.tokens->size(), " bearer tokens") : std::string("none"));
  MUOND_LOG(info, "shared memory: {}",
            transports.shm_socket ? absl::StrCat("memfd regions on socket ", transports.shm_socket->address())
                                  : std::string("off"));
  for (const std::string& line :
       security::ExposureWarnings(flags.listen, tls.enabled(), !tls.client_ca.empty(), access.tokens.has_value())) {
    MUOND_LOG(warn, "{}", line);
  }
  for (const std::string& line :
       security::MetricsExposureWarnings(flags.metrics_listen, !tls.client_ca.empty() || access.tokens.has_value())) {
    MUOND_LOG(warn, "{}", line);
  }
}

// After a stop signal (or a lost listener): NOT_SERVING, the calls in flight given until
// --shutdown-grace, then the server shut down. Returns the exit code.
int Drain(const DaemonFlags& flags, int signal_number, int port, grpc::Server& server, rpc::MuondService& service,
          rpc::CallTracker& calls) {
  const bool listener_lost = signal_number == kListenerLost;
  if (listener_lost) {
    MUOND_LOG(error,
              "the gRPC listener on port {} stopped accepting connections (out of descriptors?): draining "
              "in-flight requests (up to {} s), then exiting 1 for the supervisor to restart the daemon",
              port, flags.shutdown_grace_seconds);
  } else {
    MUOND_LOG(info, "{} received: draining in-flight requests (up to {} s)", strsignal(signal_number),
              flags.shutdown_grace_seconds);
  }
  server.GetHealthCheckService()->SetServingStatus(false);
  // Drain ourselves, then shut down at once: gRPC's own graceful shutdown also waits for idle
  // client connections to go away, which can take seconds after the last call has finished. First
  // the handlers return, then gRPC sends their answers and statuses (CallTracker).
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(flags.shutdown_grace_seconds);
  if (!service.AwaitIdle(drain_deadline - absl::Now()) || !calls.AwaitIdle(drain_deadline - absl::Now())) {
    MUOND_LOG(warn, "calls still running after {} s (--shutdown-grace); cancelling them", flags.shutdown_grace_seconds);
  }
  server.Shutdown(std::chrono::system_clock::now());
  server.Wait();
  return listener_lost ? 1 : 0;
}

// Checkpoints every durable session once the server has stopped.
void CheckpointAtExit(const DaemonFlags& flags, session::SessionRegistry& registry) {
  if (!flags.state_dir.empty()) {
    MUOND_LOG(info, "checkpointed {} sessions into {}", registry.CheckpointAll(), flags.state_dir);
  }
  MUOND_LOG(info, "muond stopped; {} sessions were open", registry.size());
}

int Run(int argc, char** argv) {
  // Libraries start threads before main() (OpenBLAS's pool), so blocking the signals here cannot
  // route them to one thread; a handler that writes to a pipe works whichever thread runs it.
  if (!InstallStopHandlers()) {
    std::fprintf(stderr, "muond: cannot install the SIGINT/SIGTERM handlers\n");
    return 1;
  }
  int exit_code = 0;
  std::optional<DaemonFlags> flags = ParseFlags(argc, argv, &exit_code);
  if (!flags) return exit_code;
  if (flags->print_blas_kernel) {
    std::printf("%s\n", kernels::InspectBlasKernel().chosen.c_str());
    return 0;
  }
  if (absl::Status s = ConfigureLogging(flags->log_level, flags->log_format); !s.ok()) {
    std::fprintf(stderr, "muond: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  google::protobuf::SetLogHandler(&LogProtobufLine);
  const std::optional<FdBudget> fd_budget = BudgetDescriptors(*flags);
  if (!fd_budget) return 1;
  const std::optional<kernels::BackendSelection> selection = StartBackend(*flags);
  if (!selection) return 1;
  kernels::Backend* backend = selection->backend.get();
  optim::BackendNsWorkspace(*backend).ws.set_limit(
      flags->ns_workspace_bytes > 0 ? std::max<size_t>(1, static_cast<size_t>(flags->ns_workspace_bytes) / 4) : 0,
      /*hard=*/flags->ns_workspace_given);
  const std::optional<Access> access = LoadAccess(*flags);
  if (!access) return 2;
  std::variant<MetricsOutlet, Refused> started_metrics = StartMetrics(*flags, backend);
  if (const Refused* refused = std::get_if<Refused>(&started_metrics)) return refused->exit_code;
  const MetricsOutlet& metrics_outlet = std::get<MetricsOutlet>(started_metrics);

  const rpc::ProtoSpecCodec spec_codec;
  // Declared before the registry, so held until every session's files are done with.
  std::unique_ptr<durability::StateDirLock> state_dir_lock;
  session::SessionRegistry registry(backend, &spec_codec, SpecLimitsOf(*flags), flags->max_sessions,
                                    {flags->max_session_bytes, flags->max_total_bytes}, metrics_outlet.metrics);
  if (!RestoreStateDir(*flags, *backend, registry, state_dir_lock)) return 1;
  const std::optional<Transports> transports = StartTransports(*flags, backend, *fd_budget);
  if (!transports) return 1;
  const rpc::ServiceOptions service_options = ServiceOptionsOf(*flags, *access, metrics_outlet, *transports);
  rpc::MuondService service(&registry, backend, service_options);

  rpc::CallTracker calls;  // outlives the server (declared before it)
  int port = 0;
  std::unique_ptr<grpc::Server> server = StartServer(*flags, *access, service_options, service, calls, &port);
  if (!server || port == 0) {
    MUOND_LOG(error, "cannot listen on {} (address in use or not valid)", flags->listen);
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  LogServing(*flags, port, *backend, *access, *transports);
  if (!flags->port_file.empty() && !WritePortFile(flags->port_file, port)) {
    MUOND_LOG(error, "cannot write --port-file {}", flags->port_file);
    server->Shutdown();
    return 1;
  }

  const int code = Drain(*flags, WaitForStopSignal(), port, *server, service, calls);
  CheckpointAtExit(*flags, registry);
  return code;
}

}  // namespace
}  // namespace muond::server

// Tensor-sized host buffers (a GPU session's decoded gradients and answers, a second stream's
// gradients) come and go with steps. glibc raises its mmap threshold after each such free (up to
// 32 MiB), after which those buffers come from the heap and fragment it: resident memory creeps up
// and wanders between steps. A fixed threshold keeps every buffer above it in its own mapping,
// returned to the system when freed. It sits above the largest chunk message (4 MiB by default plus
// framing), so that the many chunk-sized buffers of a stream are reused from the heap instead of
// being mapped, faulted in and zeroed afresh for every chunk. The trim threshold keeps up to 16 MiB
// of freed heap (gRPC's receive buffers, several chunks in flight) instead of handing it back after
// every message: on a virtual machine, faulting those pages in again cost more CPU than the whole
// exchange otherwise does (bench/transport_bench: 4 MiB gave about 2.5× the CPU per gRPC step).
void SteadyMalloc() {
  mallopt(M_MMAP_THRESHOLD, 16 << 20);
  mallopt(M_TRIM_THRESHOLD, 16 << 20);
  mallopt(M_ARENA_MAX, 2);  // gRPC's many threads would each keep an arena of freed chunks
}

int main(int argc, char** argv) {
  muond::server::g_blas_exec_errno = muond::kernels::StartOnTheBestBlasKernel(argv);
  SteadyMalloc();
  return muond::server::Run(argc, argv);
}
