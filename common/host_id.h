// The kernel's boot id, which names this host for as long as it runs: the daemon reports it
// (ServerInfo.host_id) and a client compares it with its own to tell whether they share a host, and
// so may share memory. Empty when it cannot be read. Stateless; thread-safe.
#pragma once

#include <fstream>
#include <string>

namespace muond {

inline std::string HostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

}  // namespace muond
