// Helpers for the session layer's in-process tests: a small spec (a Muon matrix and an AdamW
// vector), sessions made through the registry's codec, and steps driven the way a transport drives
// them (BeginStep, gradients written into the IncomingStep, FinishStep).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session.h"

namespace muond::session::session_testing {

// w: 8×6 in a Muon group; b: 6 in an AdamW group. world_size as given.
inline v1::SessionSpec SmallSpec(int world_size = 1) {
  v1::SessionSpec spec;
  spec.set_world_size(world_size);
  auto* muon = spec.add_groups();
  muon->set_name("muon");
  auto* adamw = spec.add_groups();
  adamw->set_name("adamw");
  adamw->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(8);
  w->add_shape(6);
  w->set_group("muon");
  auto* b = spec.add_parameters();
  b->set_name("b");
  b->add_shape(6);
  b->set_group("adamw");
  return spec;
}

inline HostTensor Tensor(std::vector<float> values) {
  HostTensor t;
  t.received = static_cast<int64_t>(values.size());
  for (float v : values) t.sum_squares += static_cast<double>(v) * v;
  t.values = std::move(values);
  return t;
}

// Deterministic values of step `step` for a tensor of `n` elements.
inline std::vector<float> Values(size_t n, int step, float scale = 0.1f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((static_cast<int>(i) * 7 + step * 3) % 11 - 5);
  return v;
}

inline std::vector<HostTensor> Gradients(int step) { return {Tensor(Values(48, step)), Tensor(Values(6, step, 0.3f))}; }

inline std::vector<HostTensor> InitialParameters() { return {Tensor(Values(48, 0, 0.5f)), Tensor(Values(6, 0, 0.2f))}; }

inline StepRequest Request(int64_t step, int rank = 0) {
  StepRequest request;
  request.session_id = "s";
  request.step = step;
  request.rank = rank;
  return request;
}

// One step as a transport runs it.
inline absl::StatusOr<StepOutcome> RunStep(Session& session, StepRequest request, std::vector<HostTensor> gradients) {
  absl::StatusOr<std::unique_ptr<IncomingStep>> step = session.BeginStep(std::move(request));
  if (!step.ok()) return step.status();
  if (!(*step)->replay()) (*step)->gradients() = std::move(gradients);
  return session.FinishStep(*std::move(step));
}

inline std::unique_ptr<Session> NewSession(kernels::Backend* backend, const v1::SessionSpec& spec = SmallSpec()) {
  rpc::ProtoSpecCodec codec;
  absl::StatusOr<SessionConfig> config = codec.Parse(rpc::SpecToJson(spec), SpecLimits{});
  if (!config.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Create("s", *std::move(config), backend);
  return session.ok() ? *std::move(session) : nullptr;
}

}  // namespace muond::session::session_testing
