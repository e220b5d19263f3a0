#include "tests/integration/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

extern char** environ;

namespace muond::testing {
namespace {

// Starts `binary` with its stderr appended to `stderr_path`, tied to this process: the kernel kills
// the child (SIGKILL) when the thread that started it dies, so a test that is killed, times out or
// aborts under a sanitizer never leaves a daemon behind. Everything the child runs between fork
// and exec is async-signal-safe. Returns the pid, or -1 with errno set.
pid_t SpawnTiedToThisProcess(const std::string& binary, char* const* argv, const std::string& stderr_path) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);  // the parent is gone already
  const int log = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0 || dup2(log, STDERR_FILENO) < 0) _exit(127);
  execve(binary.c_str(), argv, environ);
  _exit(127);
}

// Whether a daemon that ended with `info` and wrote `log` stopped on a fault rather than by a
// test's wish: a sanitizer's report (each ends with "SUMMARY: <Name>Sanitizer"), or a crash signal.
bool DiedOfAFault(const siginfo_t& info, const std::string& log) {
  if (log.find("SUMMARY: ") != std::string::npos && log.find("Sanitizer") != std::string::npos) return true;
  if (info.si_code != CLD_KILLED && info.si_code != CLD_DUMPED) return false;
  for (int fault : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
    if (info.si_status == fault) return true;
  }
  return false;
}

}  // namespace

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    expected_exit_ = true;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  JoinWatchdog();
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

void DaemonProcess::StartWatchdog() {
  JoinWatchdog();
  expected_exit_ = false;
  watchdog_ = std::thread([this, pid = pid_] {
    siginfo_t info{};
    // WNOWAIT: the test's own Stop, Kill or Exited still reaps the child and reads its status.
    if (waitid(P_PID, pid, &info, WEXITED | WNOWAIT) != 0 || expected_exit_) return;
    const std::string log = ReadStderr();
    if (!DiedOfAFault(info, log)) return;
    const size_t tail = log.size() > 16384 ? log.size() - 16384 : 0;
    std::fprintf(stderr, "\n[  FAILED  ] muond (pid %d) died of a fault while the test ran; its log ends:\n%s\n",
                 static_cast<int>(pid), log.c_str() + tail);
    std::fflush(stderr);
    _exit(1);
  });
}

void DaemonProcess::JoinWatchdog() {
  if (watchdog_.joinable()) watchdog_.join();
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
  std::vector<std::string> args = {
      binary, "--listen", listen_host_ + ":" + std::to_string(port), "--port-file", port_file, "--threads", "1"};
  if (std::find(extra_flags.begin(), extra_flags.end(), "--log-level") == extra_flags.end()) {
    args.insert(args.end(), {"--log-level", "info"});
  }
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  JoinWatchdog();
  pid_ = SpawnTiedToThisProcess(binary, argv.data(), stderr_path());
  if (pid_ < 0) {
    *error = "cannot start " + binary + ": " + std::strerror(errno);
    pid_ = -1;
    return false;
  }
  StartWatchdog();
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
    JoinWatchdog();
    return true;
  }
  return false;
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  expected_exit_ = true;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  JoinWatchdog();
}

void DaemonProcess::Signal(int signal) {
  if (pid_ <= 0) return;
  expected_exit_ = true;  // whatever the signal does to the daemon, the test asked for it
  kill(pid_, signal);
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
  expected_exit_ = true;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  JoinWatchdog();
  return status;
}

}  // namespace muond::testing
