// DaemonProcess: starts the real `muond` binary on an ephemeral loopback port for a test and stops it
// with SIGTERM, reporting how it exited. The binary's path comes from the MUOND_BINARY compile
// definition. The daemon dies with the test process (PR_SET_PDEATHSIG), and a daemon that dies of a
// fault the test did not ask for (a sanitizer's report, SIGSEGV, SIGABRT, …) ends the test process
// at once with its log, instead of leaving the test to wait on a daemon that is gone. One instance
// owns one child process and its watchdog thread; not thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/test_transport.h"

namespace muond::testing {

class DaemonProcess {
 public:
  DaemonProcess() = default;
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess();

  // Starts muond with --listen 127.0.0.1:<port> (0: a free one) plus `extra_flags` (--log-level info
  // unless they name another) and waits (up to 20 s) for its port. Returns false with *error set
  // when it did not come up. The daemon's stderr goes to stderr_path(). A stopped or killed daemon
  // may be started again (same folder).
  bool Start(const std::vector<std::string>& extra_flags, std::string* error, int port = 0);

  // The host part of --listen for the next Start (127.0.0.1 unless set; endpoint() stays loopback).
  void set_listen_host(std::string host) { listen_host_ = std::move(host); }

  // SIGKILL, as a crash would; returns once the process is gone.
  void Kill();
  // Sends `signal` and returns at once (the daemon's end is then the test's wish).
  void Signal(int signal);
  // The daemon's log so far.
  std::string ReadStderr() const;
  // Waits until the daemon's log holds `text` at least `count` times; false after `limit`. Lets a
  // test wait for what the daemon did rather than for a guessed time.
  bool WaitForLog(const std::string& text, int count = 1,
                  std::chrono::milliseconds limit = std::chrono::seconds(20)) const;
  std::string stderr_path() const { return dir_ + "/stderr.log"; }
  // A folder private to this daemon (for --state-dir and the like), created on first use and
  // removed with the DaemonProcess.
  const std::string& dir();

  // SIGTERM, then waits; returns the exit status as waitpid reports it (-1 when not running).
  int Stop();
  bool running() const { return pid_ > 0; }
  // Whether the child has exited on its own (a crash, say) without being stopped.
  bool Exited();
  // The waitpid status of a daemon that exited on its own (valid once Exited() returned true).
  int exit_status() const { return exit_status_; }

  int port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  void StartWatchdog();
  void JoinWatchdog();

  int pid_ = -1;
  int port_ = 0;
  int exit_status_ = -1;
  std::string dir_;
  std::string listen_host_ = "127.0.0.1";
  std::thread watchdog_;                    // waits for the child's end (waitid with WNOWAIT)
  std::atomic<bool> expected_exit_{false};  // set before Stop, Kill and Signal act
};

}  // namespace muond::testing
