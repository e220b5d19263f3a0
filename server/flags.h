// The daemon's command-line flags, parsed with CLI11. Plain values; no shared state.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace muond::server {

struct DaemonFlags {
  std::string listen = "127.0.0.1:50051";
  std::string backend = "auto";
  int device = 0;
  int threads = 0;  // compute threads; 0: one per core
  std::string log_level = "info";
  size_t max_chunk_bytes = 4u << 20;
  int max_sessions = 64;
  std::string port_file;  // written with the bound port once serving (useful with --listen host:0)
  double shutdown_grace_seconds = 30;
};

// Parses argv. Returns the flags, or std::nullopt with *exit_code set when the process should exit
// now (--help, --version, or a usage error, which CLI11 has already printed).
std::optional<DaemonFlags> ParseFlags(int argc, char** argv, int* exit_code);

}  // namespace muond::server
