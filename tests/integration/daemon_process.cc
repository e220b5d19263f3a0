#include "tests/integration/daemon_process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

extern char** environ;

namespace muond::testing {

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

bool DaemonProcess::Start(const std::vector<std::string>& extra_flags, std::string* error) {
  char pattern[] = "/tmp/muond-test-XXXXXX";
  if (mkdtemp(pattern) == nullptr) {
    *error = "mkdtemp failed";
    return false;
  }
  dir_ = pattern;
  const std::string port_file = dir_ + "/port";
  std::vector<std::string> args = {MUOND_BINARY, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                   "--log-level", "warn", "--threads", "1"};
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (posix_spawn(&pid_, MUOND_BINARY, nullptr, nullptr, argv.data(), environ) != 0) {
    *error = std::string("cannot start ") + MUOND_BINARY;
    pid_ = -1;
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(port_file);
    if (in >> port_) return true;
    if (Exited()) {
      *error = "muond exited during start-up";
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  *error = "muond did not write its port within 20 s";
  return false;
}

bool DaemonProcess::Exited() {
  if (pid_ <= 0) return true;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return true;
  }
  return false;
}

int DaemonProcess::Stop() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

}  // namespace muond::testing
