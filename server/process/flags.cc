#include "server/process/flags.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "CLI/CLI.hpp"
#include "common/config.h"

namespace muond::server {

std::optional<DaemonFlags> ParseFlags(int argc, char** argv, int* exit_code) {
  DaemonFlags flags;
  CLI::App app{
      "muond — optimizer-as-a-service daemon: holds fp32 master parameters and optimizer state, "
      "receives gradients over gRPC, runs Muon / AdamW / Lion / SGD steps and returns the parameters."};
  app.set_version_flag("--version", std::string("muond ") + MUOND_VERSION);
  app.add_flag("--print-blas-kernel", flags.print_blas_kernel,
               "Print the OpenBLAS kernels the CPU backend's GEMMs run (this CPU's best unless OPENBLAS_CORETYPE "
               "chose; docs/operations.md) and exit: an OPENBLAS_CORETYPE for other programs on this machine");
  app.add_option("--listen", flags.listen, "Address to serve on, host:port (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--backend", flags.backend, "Compute backend: auto (CUDA when usable, else CPU), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device", flags.device, "CUDA device index for --backend cuda/auto")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--threads", flags.threads,
                 "Compute threads of the CPU backend, and the threads shared-memory steps copy on (0: one per core)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-level", flags.log_level, "trace, debug, info, warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  app.add_option("--max-chunk-bytes", flags.max_chunk_bytes,
                 "Largest tensor chunk accepted in one message, in bytes; also bounds answers")
      ->check(CLI::Range(size_t{1024}, size_t{64} << 20))
      ->capture_default_str();
  app.add_option("--max-sessions", flags.max_sessions, "Most sessions held at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-calls-per-caller", flags.max_calls_per_caller,
                 "Most calls one authenticated caller (a token's name or a client certificate) has in flight at "
                 "once; each holds a daemon thread; 0: no cap")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-session-bytes", flags.max_session_bytes,
                 "Most optimizer memory one session may take (masters, gradients, optimizer state); "
                 "units such as 512MiB or 2GiB are accepted; 0: no limit")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-total-bytes", flags.max_total_bytes,
                 "Most optimizer memory all sessions together may take (same units); 0: no limit")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--ns-workspace-bytes", flags.ns_workspace_bytes,
                 "Most memory Newton-Schulz's scratch may hold (one per backend, shared by every session; same "
                 "units): same-shape batches are cut to fit. By default the bound is soft (a single matrix that "
                 "needs more still runs); given explicitly it is hard, and a session whose Muon matrices cannot "
                 "run within it is refused; 0: no bound")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-tensor-rank", flags.max_tensor_rank, "Most dimensions a parameter may have")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--max-tensor-elements", flags.max_tensor_elements, "Most elements one parameter may have")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rpc-timeout", flags.rpc_timeout_seconds,
                 "Seconds any one call may take, whatever deadline the client set; a call still running "
                 "then is ended with DEADLINE_EXCEEDED (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--tls-cert", flags.tls_cert, "PEM certificate chain of the server: serve TLS (with --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", flags.tls_key, "PEM private key of --tls-cert")->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", flags.tls_client_ca,
                 "PEM roots: require every client to present a certificate they signed (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--auth-token-file", flags.auth_token_file,
                 "File of bearer tokens, one a line ('name:token' or 'token'); every call must send "
                 "'authorization: Bearer <token>', and sessions belong to the token that created them")
      ->check(CLI::ExistingFile);
  app.add_option("--port-file", flags.port_file, "Write the bound port to this file once serving");
  app.add_option("--shutdown-grace", flags.shutdown_grace_seconds,
                 "Seconds in-flight requests get to finish on SIGINT/SIGTERM")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--state-dir", flags.state_dir,
                 "Folder for checkpoints (and journals); sessions found there are restored at start");
  app.add_option("--durability", flags.durability,
                 "snapshot: checkpoints only; journal: also fsync every step before acknowledging it")
      ->check(CLI::IsMember({"snapshot", "journal"}))
      ->capture_default_str();
  app.add_option("--checkpoint-every", flags.checkpoint_every, "Checkpoint each session every N steps (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--on-damaged-state", flags.on_damaged_state,
                 "A session folder that cannot be restored at start: quarantine (move it into "
                 "<state-dir>/+quarantine and serve the others) or fail (exit 1)")
      ->check(CLI::IsMember({"quarantine", "fail"}))
      ->capture_default_str();
  app.add_option("--shm-socket", flags.shm_socket,
                 "Unix-domain socket on which clients on this host pass shared-memory regions (memfds): 'auto' "
                 "(an abstract socket unique to this process), 'none' (no shared-memory transport), '@name' "
                 "(abstract) or a path")
      ->capture_default_str();
  app.add_option("--shm-max-region-bytes", flags.shm_max_region_bytes, "Largest shared-memory region accepted")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-open-files", flags.max_open_files,
                 "Soft limit on open descriptors (RLIMIT_NOFILE) the daemon sets at start; 0: the hard limit")
      ->capture_default_str();
  app.add_option("--shm-max-connections", flags.shm_max_connections,
                 "Most shared-memory socket connections at once; 0: a sixteenth of the descriptor limit "
                 "(8 to 1024)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--shm-max-pending-fds", flags.shm_max_pending_fds,
                 "Most memfds passed but not yet registered, daemon-wide; 0: an eighth of the descriptor limit "
                 "(16 to 65536)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--shm-ticket-timeout", flags.shm_ticket_timeout_seconds,
                 "Seconds a passed memfd waits to be registered before it is dropped")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--metrics-max-connections", flags.metrics_max_connections,
                 "Most connections the metrics endpoint holds at once")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--max-nccl-channels", flags.max_nccl_channels,
                 "Most NCCL channels (two-rank communicators, each holding GPU memory) at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--nccl-timeout", flags.nccl_timeout_seconds,
                 "Seconds a trainer has to join an NCCL channel, and a step's NCCL transfers to finish, before "
                 "the channel is aborted")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--straggler-timeout", flags.straggler_timeout_seconds,
                 "Seconds a multi-rank step waits for its last rank before it is aborted for all")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--metrics-listen", flags.metrics_listen,
                 "Serve Prometheus metrics over HTTP at http://HOST:PORT/metrics (port 0 picks a free one; "
                 "default: off)");
  app.add_option("--log-format", flags.log_format,
                 "text: one readable line per event; json: one JSON object per line (time, level, message, "
                 "and session, step, event where the line is about one)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  // Every flag can also come from the environment as MUOND_<FLAG> (--state-dir: MUOND_STATE_DIR), for
  // containers and units; the command line wins.
  for (CLI::Option* option : app.get_options()) {
    const std::string name = option->get_single_name();
    if (name.empty() || name == "help" || name == "version" || name == "print-blas-kernel") continue;
    std::string env = "MUOND_";
    for (char c : name) env += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    option->envname(env);
    // CLI11 takes an empty variable for an absent one. For the flags that turn on TLS or
    // authentication that would fail open: MUOND_AUTH_TOKEN_FILE= serving everyone.
    const bool secures =
        name == "auth-token-file" || name == "tls-cert" || name == "tls-key" || name == "tls-client-ca";
    if (const char* value = std::getenv(env.c_str()); secures && value != nullptr && *value == '\0') {
      std::fprintf(stderr, "%s is set but empty: give --%s a file, or unset %s\n", env.c_str(), name.c_str(),
                   env.c_str());
      *exit_code = 2;
      return std::nullopt;
    }
  }
  try {
    app.parse(argc, argv);
    flags.ns_workspace_given = app.get_option("--ns-workspace-bytes")->count() > 0;
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2, whatever CLI11's own code for it.
    *exit_code = app.exit(e) == 0 ? 0 : 2;
    return std::nullopt;
  }
  if (flags.durability == "journal" && flags.state_dir.empty()) {
    std::fprintf(stderr, "--durability journal needs --state-dir\n");
    *exit_code = 2;
    return std::nullopt;
  }
  return flags;
}

}  // namespace muond::server
