#include "server/rpc/call_tracker.h"

#include <string_view>

namespace muond::rpc {

// Alive from the call's arrival to the destruction of its context.
class CallTracker::Counted final : public grpc::experimental::Interceptor {
 public:
  explicit Counted(CallTracker* tracker) : tracker_(tracker) {
    absl::MutexLock lock(&tracker_->mu_);
    ++tracker_->alive_;
  }
  ~Counted() override {
    absl::MutexLock lock(&tracker_->mu_);
    --tracker_->alive_;
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  CallTracker* const tracker_;
};

class CallTracker::Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(CallTracker* tracker) : tracker_(tracker) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const std::string_view method = info->method() != nullptr ? info->method() : "";
    if (method.substr(0, 10) != "/muond.v1.") return nullptr;
    return new Counted(tracker_);
  }

 private:
  CallTracker* const tracker_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallTracker::NewFactory() {
  return std::make_unique<Factory>(this);
}

bool CallTracker::AwaitIdle(absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return alive_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), limit);
}

}  // namespace muond::rpc
