// `muondctl top`: a live view of a daemon (top_view.h), refreshed every `interval_seconds` from
// ListSessions over the same connection as the other commands (TLS, mutual TLS, bearer token).
//
// On a terminal it draws in the alternate screen and ends on q (or Q) or Ctrl-C, restoring the
// terminal. When stdout is not a terminal it prints each refresh as plain lines (no escape codes),
// a blank line between refreshes. `iterations` > 0 ends it after that many refreshes. It exits 0
// when told to stop, 3 when the daemon goes away (unreachable), and as the other commands do on any
// other error. Runs on the calling thread; owns the terminal while it runs.
#pragma once

#include "tools/muondctl/ctl_output.h"
#include "tools/muondctl/daemon_commands.h"

namespace muond::ctl {

struct TopFlags {
  double interval_seconds = 1;
  int iterations = 0;  // 0: until q or Ctrl-C
};

// Runs the view; the Answer's text is empty (everything was printed as it came), its exit code what
// the view ended with, and its json the last error, if any.
Answer Top(const ConnectFlags& connect, const TopFlags& flags);

}  // namespace muond::ctl
