// CallCuttingProxy: a TCP proxy on a loopback port in front of one daemon, for tests that need a
// connection to fail at a chosen call rather than at a guessed time. It forwards bytes both ways and
// reads the HTTP/2 frames the client sends (gRPC's transport): after CutAfterCalls(n) it lets n more
// calls (HEADERS frames opening new streams) through, and at the next one closes that connection
// without forwarding the frame, then closes every connection it is offered, until Heal(). So a test
// can let a daemon answer one call and make the next one fail before it reaches the daemon.
//
// Owns its listening socket, an accept thread and one thread per connection; the public methods are
// thread-safe. Plaintext gRPC only (the frames are not readable under TLS).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace muond::testing {

class CallCuttingProxy {
 public:
  // Listens on 127.0.0.1 (a free port) and forwards to 127.0.0.1:`target_port`.
  explicit CallCuttingProxy(int target_port);
  CallCuttingProxy(const CallCuttingProxy&) = delete;
  CallCuttingProxy& operator=(const CallCuttingProxy&) = delete;
  ~CallCuttingProxy();

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  // Lets `calls` more calls through (on any connection), then cuts (see the class comment).
  void CutAfterCalls(int calls);
  // Forwards everything again, new connections included.
  void Heal();
  // Calls cut so far (each a connection closed at a call's first frame; connections refused at
  // their accept while cutting are not counted).
  int cut_calls() const { return cut_calls_.load(); }

 private:
  struct Connection;
  void AcceptLoop();
  void Serve(Connection* connection);
  // Whether a call opening on a connection may go through; counts it either way.
  bool AdmitCall();
  // Whether calls are being cut now (a new connection is then closed at once).
  bool Cutting();

  int target_port_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd written once, at destruction: every thread polls it
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> cut_calls_{0};
  std::thread acceptor_;
  std::mutex mu_;
  int calls_left_ = -1;  // -1: no cut armed; 0: cutting
  std::vector<std::unique_ptr<Connection>> connections_;
};

}  // namespace muond::testing
