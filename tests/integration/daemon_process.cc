#include "tests/integration/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
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

const std::string& DaemonProcess::dir() {
  if (dir_.empty()) {
    char pattern[] = "/tmp/muond-test-XXXXXX";
    if (mkdtemp(pattern) != nullptr) dir_ = pattern;
  }
  return dir_;
}

bool DaemonProcess::Start(const std::vector<std::string>& extra_flags, std::string* error, int port) {
  if (dir().empty()) {
    *error = "mkdtemp failed";
    return false;
  }
  const std::string port_file = dir_ + "/port";
  std::filesystem::remove(port_file);
  port_ = 0;
  // $MUOND_BINARY, when set, runs another build of the daemon (a copy carried to a GPU machine).
  const char* from_env = std::getenv("MUOND_BINARY");
  const std::string binary = from_env != nullptr && *from_env != '\0' ? from_env : MUOND_BINARY;
  std::vector<std::string> args = {binary, "--listen", listen_host_ + ":" + std::to_string(port), "--port-file",
                                   port_file, "--threads", "1"};
  if (std::find(extra_flags.begin(), extra_flags.end(), "--log-level") == extra_flags.end()) {
    args.insert(args.end(), {"--log-level", "info"});
  }
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_path().c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  const int spawned = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    *error = "cannot start " + binary;
    pid_ = -1;
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(port_file);
    if (in >> port_) return true;
    if (Exited()) {
      *error = "muond exited during start-up: " + ReadStderr();
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
    exit_status_ = status;
    return true;
  }
  return false;
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void DaemonProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

std::string DaemonProcess::ReadStderr() const {
  std::ifstream in(stderr_path());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool DaemonProcess::WaitForLog(const std::string& text, int count, std::chrono::milliseconds limit) const {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (true) {
    const std::string log = ReadStderr();
    int found = 0;
    for (size_t at = log.find(text); at != std::string::npos && found < count; at = log.find(text, at + 1)) ++found;
    if (found >= count) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
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
