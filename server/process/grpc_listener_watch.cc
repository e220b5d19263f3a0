#include "server/process/grpc_listener_watch.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "common/logging.h"
#include "grpc/support/log.h"

namespace muond::server {
namespace {

std::function<void()>* g_on_lost = nullptr;  // set once, before gRPC logs anything; never freed
std::atomic<bool> g_lost{false};

void OnGrpcLog(gpr_log_func_args* args) {
  const char* message = args->message != nullptr ? args->message : "";
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      MUOND_LOG(debug, "grpc: {} ({}:{})", message, args->file, args->line);
      break;
    case GPR_LOG_SEVERITY_INFO:
      MUOND_LOG(info, "grpc: {} ({}:{})", message, args->file, args->line);
      break;
    case GPR_LOG_SEVERITY_ERROR:
      MUOND_LOG(error, "grpc: {} ({}:{})", message, args->file, args->line);
      break;
  }
  if (std::strstr(message, "Failed accept4") != nullptr && !g_lost.exchange(true)) (*g_on_lost)();
}

}  // namespace

void WatchGrpcListener(std::function<void()> on_lost) {
  g_on_lost = new std::function<void()>(std::move(on_lost));
  gpr_set_log_function(OnGrpcLog);
}

}  // namespace muond::server
