// WatchGrpcListener: notices when gRPC's listener stops accepting connections for good.
//
// gRPC 1.51 gives up on a listening socket when accept4 fails with anything but EAGAIN/EINTR (out
// of descriptors: EMFILE, ENFILE): it logs "Failed accept4: ..." and never accepts again, so no
// trainer could connect and no probe would be answered. Installed once, before the server starts,
// this routes gRPC's log lines into the daemon's log and calls `on_lost` (once, on a gRPC thread)
// when that line appears; main() then exits non-zero for its supervisor to restart it.
#pragma once

#include <functional>

namespace muond::server {

void WatchGrpcListener(std::function<void()> on_lost);

}  // namespace muond::server
