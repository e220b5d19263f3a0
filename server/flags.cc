#include "server/flags.h"

#include "CLI/CLI.hpp"

#ifndef MUOND_VERSION
#define MUOND_VERSION "unknown"
#endif

namespace muond::server {

std::optional<DaemonFlags> ParseFlags(int argc, char** argv, int* exit_code) {
  DaemonFlags flags;
  CLI::App app{"muond — optimizer-as-a-service daemon: holds fp32 master parameters and optimizer state, "
               "receives gradients over gRPC, runs Muon / AdamW / Lion / SGD steps and returns the parameters."};
  app.set_version_flag("--version", std::string("muond ") + MUOND_VERSION);
  app.add_option("--listen", flags.listen, "Address to serve on, host:port (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--backend", flags.backend, "Compute backend: auto (CUDA when usable, else CPU), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device", flags.device, "CUDA device index for --backend cuda/auto")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--threads", flags.threads, "Compute threads of the CPU backend (0: one per core)")
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
  app.add_option("--port-file", flags.port_file, "Write the bound port to this file once serving");
  app.add_option("--shutdown-grace", flags.shutdown_grace_seconds,
                 "Seconds in-flight requests get to finish on SIGINT/SIGTERM")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    *exit_code = app.exit(e);
    return std::nullopt;
  }
  return flags;
}

}  // namespace muond::server
