#include "common/listener_loop.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log_throttle.h"
#include "common/logging.h"

namespace muond {

absl::StatusOr<std::unique_ptr<ListenerLoop>> ListenerLoop::Start(std::string name, int listen_fd, int accept_flags,
                                                                  Handler handler) {
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    const std::string error = std::strerror(errno);
    ::close(listen_fd);
    return absl::InternalError(absl::StrCat("pipe: ", error));
  }
  std::unique_ptr<ListenerLoop> loop(
      new ListenerLoop(std::move(name), listen_fd, accept_flags, wake[0], wake[1], std::move(handler)));
  loop->thread_ = std::thread([l = loop.get()] { l->Run(); });
  return loop;
}

ListenerLoop::ListenerLoop(std::string name, int listen_fd, int accept_flags, int wake_read, int wake_write,
                           Handler handler)
    : name_(std::move(name)),
      listen_fd_(listen_fd),
      accept_flags_(accept_flags),
      wake_read_(wake_read),
      wake_write_(wake_write),
      handler_(std::move(handler)) {}

ListenerLoop::~ListenerLoop() {
  const char stop = 'x';
  (void)!::write(wake_write_, &stop, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
}

void ListenerLoop::Run() {
  LogThrottle accept_failures;
  absl::Time accept_again = absl::InfinitePast();  // backing off after accept4 ran out of descriptors
  std::vector<pollfd> fds;
  for (;;) {
    const absl::Time now = absl::Now();
    const bool accepting = now >= accept_again;
    fds.assign({{wake_read_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}});
    const absl::Time wake = std::min(handler_.prepare(now, fds), accepting ? absl::InfiniteFuture() : accept_again);
    const int timeout_ms =
        wake == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 60'000));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      MUOND_LOG(error, "{}: poll failed: {}", name_, std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    handler_.serve(std::span<const pollfd>(fds).subspan(2));
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | accept_flags_);
      int64_t held = 0;
      if (fd < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        if (accept_failures.Allow(&held)) {
          MUOND_LOG(error, "{}: cannot accept a connection: {}; retrying in {} ({} more since)", name_,
                    std::strerror(errno), absl::FormatDuration(kAcceptBackoff), held);
        }
        accept_again = absl::Now() + kAcceptBackoff;
      } else if (fd >= 0) {
        handler_.accept(fd);
      }
    }
  }
  handler_.stop();
}

}  // namespace muond
