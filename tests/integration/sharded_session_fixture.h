// What the tests of a session sharded over real daemons share (sharded_session_test.cc,
// sharded_parts_test.cc): a small model's spec (Muon matrices with a QK-clip pair, AdamW tensors), its
// values and per-step options, and fixtures starting four daemons (three shards, one for the
// one-daemon run). One fixture instance per test; not thread-safe.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "client/muond_client.h"
#include "client/sharded_session.h"
#include "tests/integration/daemon_process.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {

inline void AddParameter(v1::SessionSpec& spec, const std::string& name, std::vector<int64_t> shape,
                         const std::string& group) {
  v1::ParameterSpec* p = spec.add_parameters();
  p->set_name(name);
  for (int64_t d : shape) p->add_shape(d);
  p->set_group(group);
}

// Four Muon matrices (wq/wk a QK-clip pair of 2 heads) and two AdamW tensors.
inline v1::SessionSpec ModelSpec() {
  v1::SessionSpec spec;
  spec.add_groups()->set_name("muon");
  spec.mutable_groups(0)->mutable_options()->set_qk_clip_threshold(1.0);
  v1::ParameterGroup* adamw = spec.add_groups();
  adamw->set_name("adamw");
  adamw->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  AddParameter(spec, "emb", {24, 8}, "adamw");
  AddParameter(spec, "wq", {8, 8}, "muon");
  AddParameter(spec, "wk", {8, 8}, "muon");
  AddParameter(spec, "w1", {16, 8}, "muon");
  AddParameter(spec, "b1", {16}, "adamw");
  AddParameter(spec, "w2", {8, 16}, "muon");
  v1::QkClipPair* pair = spec.add_qk_clip();
  pair->set_query("wq");
  pair->set_key("wk");
  pair->set_num_heads(2);
  return spec;
}

inline int64_t Numel(const v1::ParameterSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape()) n *= d;
  return n;
}

inline std::vector<float> Values(int64_t n, int seed, float scale) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.7f * seed + 0.31f * static_cast<float>(i));
  return v;
}

// Every parameter's values for `seed`, and views of them.
struct Tensors {
  explicit Tensors(const v1::SessionSpec& spec, int seed, float scale) {
    for (int i = 0; i < spec.parameters_size(); ++i) data.push_back(Values(Numel(spec.parameters(i)), seed + i, scale));
    for (int i = 0; i < spec.parameters_size(); ++i) {
      const v1::ParameterSpec& p = spec.parameters(i);
      views.push_back({p.name(), {p.shape().begin(), p.shape().end()}, data[i]});
    }
  }
  std::vector<std::vector<float>> data;
  std::vector<client::TensorView> views;
};

inline client::StepOptions OptionsOf(int step) {
  client::StepOptions options;
  options.max_grad_norm = 0.8;
  options.lr["muon"] = 0.05 / step;
  options.qk_logits["wq"] = {0.5 + step, 2.0};
  return options;
}

class ShardedSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (DaemonProcess& daemon : daemons_) {
      std::string error;
      std::vector<std::string> flags = {"--backend", "cpu", "--log-level", "warn"};
      flags.insert(flags.end(), extra_flags_.begin(), extra_flags_.end());
      ASSERT_TRUE(daemon.Start(flags, &error)) << error;
      endpoints_.push_back(daemon.endpoint());
    }
    options_ = TestClientOptions();
  }

  // `id` sharded over `shards` and, for comparison, on the fourth daemon alone, both uploaded with
  // the same initial values (`single` stays null when anything fails).
  void OpenBoth(const std::string& id, const v1::SessionSpec& spec, const std::vector<std::string>& shards,
                std::unique_ptr<client::ShardedSession>* sharded, std::unique_ptr<client::Session>* single) {
    ASSERT_OK_AND_ASSIGN(*sharded, client::ShardedSession::Open(options_, shards, id, spec));
    client::ClientOptions one = options_;
    one.endpoint = endpoints_[3];
    ASSERT_OK_AND_ASSIGN(single_client_, client::Client::Connect(one));
    ASSERT_OK_AND_ASSIGN(auto made, single_client_->CreateSession(id, spec));
    const Tensors initial(spec, 0, 0.5f);
    ASSERT_OK((*sharded)->UploadParameters(initial.views));
    ASSERT_OK(made->UploadParameters(initial.views));
    *single = std::move(made);
  }

  std::vector<std::string> extra_flags_;  // every daemon's, beyond the backend and log level
  DaemonProcess daemons_[4];              // three shards, and one daemon for the one-daemon run
  std::unique_ptr<client::Client> single_client_;
  std::vector<std::string> endpoints_;
  client::ClientOptions options_;
};

class ShardedRanksTest : public ShardedSessionTest {
 protected:
  ShardedRanksTest() { extra_flags_ = {"--straggler-timeout", "5"}; }
};

}  // namespace muond::testing
