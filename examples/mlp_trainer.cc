// A trainer that keeps forward and backward and lets muond do the optimizer step: a two-layer MLP
// (16 → 128 → 4, tanh) learns a synthetic 4-class problem labelled by a random "teacher" network.
// The hidden matrix goes to Muon; the output head and the biases go to AdamW, as the usual routing
// rule says. Prints the loss and accuracy per step.
//
//   mlp_trainer --endpoint 127.0.0.1:50051 --steps 200
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/muond_client.h"

namespace {

constexpr int kInputs = 16, kHidden = 128, kClasses = 4;

struct Dataset {
  std::vector<float> x;  // n × kInputs
  std::vector<int> y;
  int n = 0;
};

// Labels come from argmax of a random two-layer tanh network, so the classes have curved borders
// that a linear model cannot fit but the MLP can.
Dataset MakeDataset(int n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int kTeacherHidden = 32;
  std::vector<float> t1(kTeacherHidden * kInputs), t2(kClasses * kTeacherHidden);
  for (float& v : t1) v = normal(rng) * 0.6f;
  for (float& v : t2) v = normal(rng);
  Dataset data;
  data.n = n;
  data.x.resize(static_cast<size_t>(n) * kInputs);
  for (float& v : data.x) v = normal(rng);
  for (int i = 0; i < n; ++i) {
    float h[kTeacherHidden];
    for (int j = 0; j < kTeacherHidden; ++j) {
      float s = 0;
      for (int k = 0; k < kInputs; ++k) s += t1[j * kInputs + k] * data.x[i * kInputs + k];
      h[j] = std::tanh(s);
    }
    int best = 0;
    float best_score = -1e30f;
    for (int c = 0; c < kClasses; ++c) {
      float s = 0;
      for (int j = 0; j < kTeacherHidden; ++j) s += t2[c * kTeacherHidden + j] * h[j];
      if (s > best_score) best_score = s, best = c;
    }
    data.y.push_back(best);
  }
  return data;
}

struct Model {
  std::vector<float> w1 = std::vector<float>(kHidden * kInputs), b1 = std::vector<float>(kHidden);
  std::vector<float> w2 = std::vector<float>(kClasses * kHidden), b2 = std::vector<float>(kClasses);
};

// Forward and backward over a batch of indices; returns the mean cross-entropy and fills grads.
float ForwardBackward(const Model& m, const Dataset& d, const std::vector<int>& batch, Model* g, int* correct) {
  std::fill(g->w1.begin(), g->w1.end(), 0.0f);
  std::fill(g->b1.begin(), g->b1.end(), 0.0f);
  std::fill(g->w2.begin(), g->w2.end(), 0.0f);
  std::fill(g->b2.begin(), g->b2.end(), 0.0f);
  const float inv = 1.0f / static_cast<float>(batch.size());
  float loss = 0;
  *correct = 0;
  for (int i : batch) {
    const float* x = &d.x[static_cast<size_t>(i) * kInputs];
    float h[kHidden], logits[kClasses], dh[kHidden] = {};
    for (int j = 0; j < kHidden; ++j) {
      float s = m.b1[j];
      for (int k = 0; k < kInputs; ++k) s += m.w1[j * kInputs + k] * x[k];
      h[j] = std::tanh(s);
    }
    float max_logit = -1e30f;
    for (int c = 0; c < kClasses; ++c) {
      float s = m.b2[c];
      for (int j = 0; j < kHidden; ++j) s += m.w2[c * kHidden + j] * h[j];
      logits[c] = s;
      max_logit = std::max(max_logit, s);
    }
    float z = 0;
    for (float l : logits) z += std::exp(l - max_logit);
    const int label = d.y[i];
    loss += -(logits[label] - max_logit - std::log(z));
    if (std::max_element(logits, logits + kClasses) - logits == label) ++*correct;
    for (int c = 0; c < kClasses; ++c) {
      const float dlogit = (std::exp(logits[c] - max_logit) / z - (c == label ? 1.0f : 0.0f)) * inv;
      g->b2[c] += dlogit;
      for (int j = 0; j < kHidden; ++j) {
        g->w2[c * kHidden + j] += dlogit * h[j];
        dh[j] += dlogit * m.w2[c * kHidden + j];
      }
    }
    for (int j = 0; j < kHidden; ++j) {
      const float ds = dh[j] * (1.0f - h[j] * h[j]);
      g->b1[j] += ds;
      for (int k = 0; k < kInputs; ++k) g->w1[j * kInputs + k] += ds * x[k];
    }
  }
  return loss * inv;
}

muond::v1::SessionSpec MakeSpec() {
  muond::v1::SessionSpec spec;
  auto* muon = spec.add_groups();
  muon->set_name("hidden");
  muon->mutable_options()->set_optimizer(muond::v1::OPTIMIZER_MUON);
  muon->mutable_options()->set_lr(0.02);
  auto* adam = spec.add_groups();
  adam->set_name("head_and_biases");
  adam->mutable_options()->set_optimizer(muond::v1::OPTIMIZER_ADAMW);
  adam->mutable_options()->set_lr(3e-3);
  adam->mutable_options()->set_weight_decay(0.0);
  auto add = [&](const char* name, std::vector<int64_t> shape, const char* group) {
    auto* p = spec.add_parameters();
    p->set_name(name);
    for (int64_t d : shape) p->add_shape(d);
    p->set_wire_dtype(muond::v1::DTYPE_FP32);
    p->set_group(group);
  };
  add("w1", {kHidden, kInputs}, "hidden");
  add("b1", {kHidden}, "head_and_biases");
  add("w2", {kClasses, kHidden}, "head_and_biases");
  add("b2", {kClasses}, "head_and_biases");
  return spec;
}

std::vector<muond::client::TensorView> Views(const Model& m) {
  return {{"w1", {kHidden, kInputs}, m.w1},
          {"b1", {kHidden}, m.b1},
          {"w2", {kClasses, kHidden}, m.w2},
          {"b2", {kClasses}, m.b2}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains a two-layer MLP on a synthetic classification task through a muond daemon."};
  std::string endpoint = "127.0.0.1:50051", session_id = "mlp-example";
  int steps = 200, batch_size = 256;
  unsigned seed = 1;
  app.add_option("--endpoint", endpoint, "muond address")->capture_default_str();
  app.add_option("--session", session_id, "Session id")->capture_default_str();
  app.add_option("--steps", steps, "Optimizer steps")->capture_default_str();
  app.add_option("--batch-size", batch_size, "Examples per step")->capture_default_str();
  app.add_option("--seed", seed, "Random seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::mt19937 rng(seed);
  const Dataset data = MakeDataset(8192, rng);
  Model model, grads;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : model.w1) v = normal(rng) / std::sqrt(static_cast<float>(kInputs));
  for (float& v : model.w2) v = normal(rng) / std::sqrt(static_cast<float>(kHidden));

  muond::client::ClientOptions options;
  options.endpoint = endpoint;
  auto client = muond::client::Client::Connect(options);
  if (!client.ok()) return std::fprintf(stderr, "%s\n", client.status().ToString().c_str()), 1;
  auto info = (*client)->GetServerInfo();
  if (info.ok())
    std::printf("muond %s, %s backend (%s)\n", info->version().c_str(), info->backend().c_str(),
                info->backend_detail().c_str());
  auto session = (*client)->CreateSession(session_id, MakeSpec());
  if (!session.ok()) return std::fprintf(stderr, "%s\n", session.status().ToString().c_str()), 1;
  if (absl::Status s = (*session)->UploadParameters(Views(model)); !s.ok()) {
    return std::fprintf(stderr, "upload: %s\n", s.ToString().c_str()), 1;
  }

  std::uniform_int_distribution<int> pick(0, data.n - 1);
  std::vector<int> batch(batch_size);
  float first_loss = 0, last_loss = 0;
  for (int step = 1; step <= steps; ++step) {
    for (int& i : batch) i = pick(rng);
    int correct = 0;
    const float loss = ForwardBackward(model, data, batch, &grads, &correct);
    auto reply = (*session)->Step(step, Views(grads));
    if (!reply.ok()) return std::fprintf(stderr, "step %d: %s\n", step, reply.status().ToString().c_str()), 1;
    model.w1 = reply->parameters["w1"];
    model.b1 = reply->parameters["b1"];
    model.w2 = reply->parameters["w2"];
    model.b2 = reply->parameters["b2"];
    if (step == 1) first_loss = loss;
    last_loss = loss;
    std::printf("step %4d  loss %.4f  accuracy %5.1f%%  grad-norm %.3f  daemon %.2f ms\n", step, loss,
                100.0 * correct / batch_size, reply->grad_norm, reply->compute_seconds * 1e3);
  }
  std::printf("loss %.4f -> %.4f over %d steps\n", first_loss, last_loss, steps);
  (void)(*session)->Close();
  return last_loss < first_loss ? 0 : 1;
}
