// The daemon's command-line flags, parsed with CLI11. Plain values; no shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace muond::server {

struct DaemonFlags {
  bool print_blas_kernel = false;  // print the OpenBLAS kernels the CPU backend runs, and exit
  std::string listen = "127.0.0.1:50051";
  std::string backend = "auto";
  int device = 0;
  int threads = 0;  // compute threads; 0: one per core
  std::string log_level = "info";
  std::string log_format = "text";  // text | json
  std::string metrics_listen;       // HOST:PORT of the Prometheus endpoint; empty: off
  size_t max_chunk_bytes = 4u << 20;
  int max_sessions = 64;
  int max_calls_per_caller = 0;   // calls one authenticated caller has in flight at once; 0: no cap
  int64_t max_session_bytes = 0;  // optimizer memory of one session; 0: no limit
  int64_t max_total_bytes = 0;    // optimizer memory of all sessions together; 0: no limit
  // Newton–Schulz's workspace (one per backend, shared by every session); 0: no bound. The default
  // is soft (batches cut to fit, one larger matrix still runs); given explicitly it is hard.
  int64_t ns_workspace_bytes = int64_t{256} << 20;
  bool ns_workspace_given = false;
  int max_tensor_rank = 8;
  int64_t max_tensor_elements = int64_t{1} << 32;
  double rpc_timeout_seconds = 600;  // the daemon's limit on any call; 0: none
  std::string tls_cert;              // PEM files; TLS when --tls-cert and --tls-key are given
  std::string tls_key;
  std::string tls_client_ca;    // require client certificates signed by these roots
  std::string auth_token_file;  // bearer tokens, one a line; empty: no authentication
  std::string port_file;        // written with the bound port once serving (useful with --listen host:0)
  double shutdown_grace_seconds = 30;
  std::string state_dir;                        // empty: nothing is persisted
  std::string durability = "snapshot";          // snapshot | journal
  int64_t checkpoint_every = 0;                 // steps between periodic checkpoints; 0: none
  std::string on_damaged_state = "quarantine";  // quarantine | fail: a session folder that cannot be restored
  double straggler_timeout_seconds = 120;       // a multi-rank step waits this long for its last rank
  // Shared-memory transport: "auto" (an abstract socket unique to the process), "none", "@name" or a
  // filesystem path.
  std::string shm_socket = "auto";
  uint64_t shm_max_region_bytes = uint64_t{1} << 40;
  // Descriptors: the soft RLIMIT_NOFILE set at start (0: the hard limit), and the shared-memory
  // socket's share of it (0: derived from the limit, server/process/fd_budget.h).
  uint64_t max_open_files = 0;
  int shm_max_connections = 0;
  int shm_max_pending_fds = 0;
  double shm_ticket_timeout_seconds = 60;  // an unclaimed memfd is dropped after this long
  int metrics_max_connections = 16;
  // NCCL transport: communicators at once (each holds GPU memory), and the seconds a trainer has to
  // join a channel and a step's transfers to finish before the channel is aborted.
  int max_nccl_channels = 4;
  double nccl_timeout_seconds = 60;
};

// Parses argv. Returns the flags, or std::nullopt with *exit_code set when the process should exit
// now (--help, --version, or a usage error, which CLI11 has already printed).
std::optional<DaemonFlags> ParseFlags(int argc, char** argv, int* exit_code);

}  // namespace muond::server
