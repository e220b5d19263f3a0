// ListenerLoop: one thread serving a listening socket and its connections with poll(2), until
// destroyed. The metrics endpoint and the shared-memory socket each run one.
//
// Each round the loop asks its Handler for the connections' pollfds and for the time the round must
// end by, polls them with the listener (while not backing off) and a self-pipe that ends the loop,
// then hands the connections' events back (`serve`) and, when the listener is readable, accepts one
// connection (`accept`). accept4 failing for want of descriptors leaves the listener alone for
// kAcceptBackoff (polling a readable listener again at once would spin), with one throttled log
// line naming `name`. A failing poll ends the loop with a log line.
//
// Ownership: the loop owns the listening descriptor (closed when destroyed), its thread and its
// pipe; the Handler's functions run on the loop's thread only and must outlive the loop. Start and
// the destructor may be called from any thread; nothing else is shared.
#pragma once

#include <poll.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muond {

class ListenerLoop {
 public:
  static constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

  struct Handler {
    // Appends each connection's pollfd to `fds` (closing first whatever is due at `now`); returns
    // when this round must end at the latest (absl::InfiniteFuture(): whenever something happens).
    std::function<absl::Time(absl::Time now, std::vector<pollfd>& fds)> prepare;
    // After poll: the connections' pollfds, in the order `prepare` appended them, with their revents.
    std::function<void(std::span<const pollfd> fds)> serve;
    // A connection just accepted (accept4 with `accept_flags`, SOCK_CLOEXEC always).
    std::function<void(int fd)> accept;
    // The loop ends: let go of every connection.
    std::function<void()> stop;
  };

  // Starts the thread on `listen_fd` (owned from here on, also on failure). `name` prefixes its log
  // lines ("metrics endpoint"). INTERNAL when the pipe cannot be made.
  static absl::StatusOr<std::unique_ptr<ListenerLoop>> Start(std::string name, int listen_fd, int accept_flags,
                                                             Handler handler);
  ~ListenerLoop();
  ListenerLoop(const ListenerLoop&) = delete;
  ListenerLoop& operator=(const ListenerLoop&) = delete;

 private:
  ListenerLoop(std::string name, int listen_fd, int accept_flags, int wake_read, int wake_write, Handler handler);
  void Run();

  const std::string name_;
  const int listen_fd_;
  const int accept_flags_;
  const int wake_read_, wake_write_;  // a pipe that ends the loop
  const Handler handler_;
  std::thread thread_;
};

}  // namespace muond
