// DaemonProcess: starts the real `muond` binary on an ephemeral loopback port for a test and stops it
// with SIGTERM, reporting how it exited. The binary's path comes from the MUOND_BINARY compile
// definition. One instance owns one child process; not thread-safe.
#pragma once

#include <string>
#include <vector>

namespace muond::testing {

class DaemonProcess {
 public:
  DaemonProcess() = default;
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess();

  // Starts muond with --listen 127.0.0.1:0 plus `extra_flags` and waits (up to 20 s) for its port.
  // Returns false with *error set when it did not come up.
  bool Start(const std::vector<std::string>& extra_flags, std::string* error);

  // SIGTERM, then waits; returns the exit status as waitpid reports it (-1 when not running).
  int Stop();
  bool running() const { return pid_ > 0; }
  // Whether the child has exited on its own (a crash, say) without being stopped.
  bool Exited();

  int port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int pid_ = -1;
  int port_ = 0;
  std::string dir_;
};

}  // namespace muond::testing
