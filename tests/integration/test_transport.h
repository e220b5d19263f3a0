// The transport the integration tests' clients use: MUOND_TEST_TRANSPORT ("grpc" or "shm"; ctest
// runs the suite once with each), or the client's default ("auto") when unset. With "shm" a client
// that cannot use shared memory fails to connect instead of falling back, so the shm run cannot
// quietly test gRPC.
#pragma once

#include <cstdlib>
#include <string>

#include "client/muond_client.h"

namespace muond::testing {

inline client::ClientOptions TestClientOptions() {
  client::ClientOptions options;
  if (const char* transport = std::getenv("MUOND_TEST_TRANSPORT"); transport != nullptr && *transport != '\0') {
    options.transport = transport;
  }
  return options;
}

}  // namespace muond::testing
