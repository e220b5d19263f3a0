#include "tools/muondctl/top_command.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tools/muondctl/top_view.h"

namespace muond::ctl {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;

void OnInterrupt(int) { g_interrupted = 1; }

// The terminal while the view owns it: keys unbuffered and unechoed, the alternate screen, no
// cursor; all restored when destroyed.
class TerminalSession {
 public:
  TerminalSession() {
    if (tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);  // ISIG stays: Ctrl-C is SIGINT
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      keys_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    std::fputs("\x1b[?1049h\x1b[?25l", stdout);  // alternate screen, cursor hidden
    std::fflush(stdout);
  }
  ~TerminalSession() {
    std::fputs("\x1b[?25h\x1b[?1049l", stdout);
    std::fflush(stdout);
    if (keys_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  TerminalSession(const TerminalSession&) = delete;
  TerminalSession& operator=(const TerminalSession&) = delete;

  bool keys() const { return keys_; }

 private:
  termios saved_{};
  bool keys_ = false;
};

size_t TerminalWidth() {
  winsize size{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 160;
}

std::string Clock() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[16];
  std::strftime(text, sizeof(text), "%H:%M:%S", &local);
  return text;
}

// Waits up to `seconds` for a key on stdin (when `keys`) or an interrupt; true when the view should
// end (q, Q or Ctrl-C).
bool WaitForQuit(double seconds, bool keys) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!g_interrupted) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    if (!keys) {
      // Plain lines: only a signal ends the wait early.
      pollfd none{};
      poll(&none, 0, static_cast<int>(left.count()));
      continue;
    }
    pollfd in{.fd = STDIN_FILENO, .events = POLLIN, .revents = 0};
    if (poll(&in, 1, static_cast<int>(left.count())) > 0 && (in.revents & POLLIN) != 0) {
      char key = 0;
      if (read(STDIN_FILENO, &key, 1) == 1 && (key == 'q' || key == 'Q')) return true;
    }
  }
  return true;
}

bool DaemonGone(const absl::Status& status) { return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status); }

}  // namespace

Answer Top(const ConnectFlags& connect, const TopFlags& flags) {
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectDaemon(connect);
  if (!client.ok()) return ErrorAnswer(client.status());
  const bool interactive = isatty(STDOUT_FILENO) != 0;
  g_interrupted = 0;
  struct sigaction action {};
  action.sa_handler = OnInterrupt;
  sigemptyset(&action.sa_mask);
  struct sigaction saved_int {
  }, saved_term{};
  sigaction(SIGINT, &action, &saved_int);  // no SA_RESTART: a poll ends at once
  sigaction(SIGTERM, &action, &saved_term);

  Answer answer;
  {
    std::unique_ptr<TerminalSession> terminal;
    if (interactive) terminal = std::make_unique<TerminalSession>();
    const bool keys = terminal != nullptr && terminal->keys() && isatty(STDIN_FILENO) != 0;
    std::map<std::string, std::pair<int64_t, std::chrono::steady_clock::time_point>> seen;  // step, when
    for (int refresh = 1;; ++refresh) {
      absl::StatusOr<std::vector<v1::SessionSummary>> sessions = (*client)->ListSessions();
      if (!sessions.ok()) {
        answer = ErrorAnswer(sessions.status());
        if (DaemonGone(sessions.status())) {
          answer.exit_code = kExitUnreachable;
          answer.text = absl::StrCat("the daemon at ", connect.endpoint, " went away: ", sessions.status().message());
        }
        break;
      }
      const auto now = std::chrono::steady_clock::now();
      TopFrame frame{.endpoint = connect.endpoint, .clock = Clock(), .sessions = {}, .interactive = keys};
      std::map<std::string, std::pair<int64_t, std::chrono::steady_clock::time_point>> next;
      for (v1::SessionSummary& summary : *sessions) {
        TopSession row;
        auto before = seen.find(summary.session_id());
        if (before != seen.end()) {
          const double seconds = std::chrono::duration<double>(now - before->second.second).count();
          if (seconds > 0) {
            row.steps_per_second =
                static_cast<double>(std::max<int64_t>(0, summary.last_step() - before->second.first)) / seconds;
          }
        }
        next[summary.session_id()] = {summary.last_step(), now};
        row.summary = std::move(summary);
        frame.sessions.push_back(std::move(row));
      }
      seen = std::move(next);
      const std::vector<std::string> lines = RenderTop(frame, interactive ? TerminalWidth() : 1000);
      std::string out = interactive ? "\x1b[H\x1b[2J" : (refresh > 1 ? "\n" : "");
      for (const std::string& line : lines) absl::StrAppend(&out, Printable(line), "\n");
      std::fputs(out.c_str(), stdout);
      std::fflush(stdout);
      if (flags.iterations > 0 && refresh >= flags.iterations) break;
      if (WaitForQuit(flags.interval_seconds, keys)) break;
    }
  }  // the terminal is restored before any message
  sigaction(SIGINT, &saved_int, nullptr);
  sigaction(SIGTERM, &saved_term, nullptr);
  return answer;
}

}  // namespace muond::ctl
