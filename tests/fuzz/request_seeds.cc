// request_seeds: writes request_fuzzer's seed corpus, one file per script, into the folder given as
// the only argument. Generated from the current protobuf messages so the seeds never drift from the
// API. Each script is a plausible client session (create, upload, steps in every dtype, state
// transfer, QK-clip, the option vocabulary) or a typical mistake (a step before the upload, a gap in
// the chunks, a non-finite gradient, a conflicting attach, a cancelled stream, an oversized chunk)
// or whole steps in one call,
// from which the fuzzer's mutations start.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "muond/v1/muond.pb.h"
#include "proto/wire/dtype_codec.h"
#include "tests/fuzz/request_script.h"

namespace muond::fuzz {
namespace {

v1::GroupOptions Optimizer(v1::OptimizerKind kind) {
  v1::GroupOptions options;
  options.set_optimizer(kind);
  return options;
}

void AddGroup(v1::SessionSpec& spec, const std::string& name, const v1::GroupOptions& options) {
  v1::ParameterGroup* group = spec.add_groups();
  group->set_name(name);
  *group->mutable_options() = options;
}

v1::ParameterSpec* AddParameter(v1::SessionSpec& spec, const std::string& name, std::vector<int64_t> shape,
                                const std::string& group, v1::DType dtype = v1::DTYPE_FP32) {
  v1::ParameterSpec* p = spec.add_parameters();
  p->set_name(name);
  for (int64_t d : shape) p->add_shape(d);
  p->set_group(group);
  p->set_wire_dtype(dtype);
  return p;
}

int64_t Numel(const v1::ParameterSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape()) n *= d;
  return n;
}

// "w" [8, 4] in a Muon group, "b" [4] in an AdamW group: the integration tests' session.
v1::SessionSpec SmallSpec() {
  v1::SessionSpec spec;
  AddGroup(spec, "matrices", Optimizer(v1::OPTIMIZER_MUON));
  AddGroup(spec, "vectors", Optimizer(v1::OPTIMIZER_ADAMW));
  AddParameter(spec, "w", {8, 4}, "matrices");
  AddParameter(spec, "b", {4}, "vectors");
  return spec;
}

std::vector<float> Values(int64_t count, float seed) {
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i) v[i] = 0.1f * std::sin(seed + 0.37f * i);
  return v;
}

// The chunks of one tensor, `per_chunk` elements each, the first carrying the shape.
std::vector<v1::TensorChunk> Chunks(const v1::ParameterSpec& p, float seed, v1::DType dtype, int64_t per_chunk,
                                    const std::string& slot = "") {
  const std::vector<float> values = Values(Numel(p), seed);
  // An unset dtype means the parameter's wire dtype (fp32 when that is unset too).
  v1::DType encoding = dtype != v1::DTYPE_UNSPECIFIED ? dtype : p.wire_dtype();
  if (encoding == v1::DTYPE_UNSPECIFIED) encoding = v1::DTYPE_FP32;
  std::vector<v1::TensorChunk> chunks;
  for (int64_t offset = 0; offset < Numel(p); offset += per_chunk) {
    const int64_t count = std::min<int64_t>(per_chunk, Numel(p) - offset);
    v1::TensorChunk& chunk = chunks.emplace_back();
    chunk.set_name(p.name());
    chunk.set_offset(offset);
    chunk.set_dtype(dtype);
    chunk.set_slot(slot);
    if (offset == 0 && slot.empty()) {
      for (int64_t d : p.shape()) chunk.add_shape(d);
    }
    wire::Encode(encoding, std::span<const float>(values).subspan(offset, count), chunk.mutable_data());
  }
  return chunks;
}

void Create(ScriptWriter& w, const std::string& id, const v1::SessionSpec& spec) {
  v1::CreateSessionRequest request;
  request.set_session_id(id);
  *request.mutable_spec() = spec;
  w.Add(Op::kCreateSession, request);
}

void Upload(ScriptWriter& w, const std::string& id, const v1::SessionSpec& spec, int64_t per_chunk = 16) {
  w.Add(Op::kBeginUpload);
  v1::UploadParametersRequest request;
  request.set_session_id(id);
  w.Add(Op::kMessage, request);
  for (const v1::ParameterSpec& p : spec.parameters()) {
    for (const v1::TensorChunk& chunk : Chunks(p, 1.0f, v1::DTYPE_UNSPECIFIED, per_chunk)) {
      request.Clear();
      *request.mutable_chunk() = chunk;
      w.Add(Op::kMessage, request);
    }
  }
  w.Add(Op::kFinish);
}

v1::StepHeader Header(const std::string& id, int64_t step) {
  v1::StepHeader header;
  header.set_session_id(id);
  header.set_step(step);
  return header;
}

// Sends the header, then `chunks`, as one step stream.
void RawStep(ScriptWriter& w, const v1::StepHeader& header, const std::vector<v1::TensorChunk>& chunks) {
  w.Add(Op::kBeginStep);
  v1::StepRequest request;
  *request.mutable_header() = header;
  request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
  w.Add(Op::kMessage, request);
  for (const v1::TensorChunk& chunk : chunks) {
    request.Clear();
    *request.mutable_chunk() = chunk;
    w.Add(Op::kMessage, request);
  }
  w.Add(Op::kFinish);
}

// Step `step`'s gradient chunks for every parameter, or for those in `only` when it is not empty.
std::vector<v1::TensorChunk> StepChunks(const v1::SessionSpec& spec, int64_t step, v1::DType dtype, int64_t per_chunk,
                                        const std::vector<std::string>& only = {}) {
  std::vector<v1::TensorChunk> chunks;
  for (const v1::ParameterSpec& p : spec.parameters()) {
    if (!only.empty() && std::find(only.begin(), only.end(), p.name()) == only.end()) continue;
    for (v1::TensorChunk& chunk : Chunks(p, 2.0f + step, dtype, per_chunk)) chunks.push_back(std::move(chunk));
  }
  return chunks;
}

// A step stream with a gradient for every parameter, or for those in `only` when it is not empty.
void Step(ScriptWriter& w, const v1::SessionSpec& spec, const v1::StepHeader& header, v1::DType dtype = v1::DTYPE_FP32,
          int64_t per_chunk = 16, const std::vector<std::string>& only = {}) {
  RawStep(w, header, StepChunks(spec, header.step(), dtype, per_chunk, only));
}

void Reads(ScriptWriter& w, const std::string& id) {
  v1::GetParametersRequest parameters;
  parameters.set_session_id(id);
  w.Add(Op::kGetParameters, parameters);
  parameters.add_names("w");
  parameters.set_dtype(v1::DTYPE_BF16);
  parameters.set_max_chunk_bytes(8);
  w.Add(Op::kGetParameters, parameters);
  v1::GetStateRequest state;
  state.set_session_id(id);
  state.set_max_chunk_bytes(24);
  w.Add(Op::kGetState, state);
  w.Add(Op::kListSessions);
  v1::ListSessionsRequest page;
  page.set_page_size(1);
  page.set_page_token(id);
  w.Add(Op::kListSessions, page);
  w.Add(Op::kGetServerInfo);
  v1::CheckpointRequest checkpoint;
  checkpoint.set_session_id(id);
  w.Add(Op::kCheckpoint, checkpoint);
  v1::GetStateDigestRequest digest;
  digest.set_session_id(id);
  w.Add(Op::kGetStateDigest, digest);
}

std::string Train() {
  ScriptWriter w;
  const v1::SessionSpec spec = SmallSpec();
  Create(w, "s1", spec);
  Upload(w, "s1", spec);
  Step(w, spec, Header("s1", 1));
  v1::StepHeader header = Header("s1", 2);
  v1::GroupOverride* o = header.add_overrides();
  o->set_group("matrices");
  o->set_lr(0.01);
  o->set_momentum(0.9);
  o->set_weight_decay(0.1);
  header.set_max_grad_norm(0.5);
  header.set_return_dtype(v1::DTYPE_FP16);
  header.set_max_chunk_bytes(16);
  Step(w, spec, header, v1::DTYPE_BF16, 8);
  Step(w, spec, header, v1::DTYPE_BF16, 8);                   // a replay
  Step(w, spec, Header("s1", 3), v1::DTYPE_FP16, 32, {"w"});  // "b" has no gradient this step
  Reads(w, "s1");
  Create(w, "s1", spec);  // attach
  v1::CloseSessionRequest close;
  close.set_session_id("s1");
  w.Add(Op::kCloseSession, close);
  return w.bytes();
}

std::string State() {
  ScriptWriter w;
  const v1::SessionSpec spec = SmallSpec();
  Create(w, "s2", spec);
  Upload(w, "s2", spec, 32);
  w.Add(Op::kBeginSetState);
  v1::SetStateRequest request;
  request.set_session_id("s2");
  w.Add(Op::kMessage, request);
  request.Clear();
  request.mutable_header()->set_last_step(5);
  for (const v1::ParameterSpec& p : spec.parameters()) {
    v1::ParameterStepCount* count = request.mutable_header()->add_step_counts();
    count->set_name(p.name());
    count->set_count(5);
  }
  w.Add(Op::kMessage, request);
  const std::vector<std::pair<int, std::vector<std::string>>> slots = {{0, {"master", "momentum"}},
                                                                       {1, {"master", "exp_avg", "exp_avg_sq"}}};
  for (const auto& [index, names] : slots) {
    for (const std::string& slot : names) {
      for (const v1::TensorChunk& chunk : Chunks(spec.parameters(index), 3.0f, v1::DTYPE_FP32, 16, slot)) {
        request.Clear();
        *request.mutable_chunk() = chunk;
        w.Add(Op::kMessage, request);
      }
    }
  }
  w.Add(Op::kFinish);
  Step(w, spec, Header("s2", 6));
  Reads(w, "s2");
  return w.bytes();
}

// Every optimizer, the shapes Muon treats specially and QK-clip.
std::string Shapes() {
  ScriptWriter w;
  v1::SessionSpec spec;
  v1::GroupOptions muon = Optimizer(v1::OPTIMIZER_MUON);
  muon.set_qk_clip_threshold(1.0);
  muon.set_qk_clip_alpha(0.5);
  AddGroup(spec, "attention", muon);
  AddGroup(spec, "lion", Optimizer(v1::OPTIMIZER_LION));
  v1::GroupOptions sgd = Optimizer(v1::OPTIMIZER_SGD);
  sgd.set_momentum(0.9);
  sgd.set_nesterov(true);
  AddGroup(spec, "sgd", sgd);
  AddParameter(spec, "q", {8, 4}, "attention");
  AddParameter(spec, "k", {8, 4}, "attention", v1::DTYPE_BF16);
  v1::ParameterSpec* qkv = AddParameter(spec, "qkv", {8, 4}, "attention");
  qkv->add_qkv_split(2);
  qkv->add_qkv_split(1);
  qkv->add_qkv_split(1);
  qkv->set_num_query_groups(2);
  AddParameter(spec, "conv", {4, 2, 2, 2}, "attention", v1::DTYPE_FP16);
  AddParameter(spec, "experts", {2, 4, 3}, "attention");
  AddParameter(spec, "norm", {4}, "lion");
  AddParameter(spec, "scalar", {}, "sgd");
  v1::QkClipPair* pair = spec.add_qk_clip();
  pair->set_query("q");
  pair->set_key("k");
  pair->set_num_heads(2);
  spec.set_return_dtype(v1::DTYPE_BF16);
  Create(w, "s3", spec);
  Upload(w, "s3", spec);
  v1::StepHeader header = Header("s3", 1);
  v1::QkClipLogits* logits = header.add_qk_logits();
  logits->set_query("q");
  logits->add_max_logits(50.0);
  logits->add_max_logits(0.5);
  Step(w, spec, header);
  Step(w, spec, Header("s3", 2), v1::DTYPE_UNSPECIFIED);
  Reads(w, "s3");
  return w.bytes();
}

// The option vocabulary: named and custom coefficient sets and every choice-valued option.
std::string Options() {
  ScriptWriter w;
  v1::SessionSpec spec;
  v1::GroupOptions a = Optimizer(v1::OPTIMIZER_MUON);
  a.set_ns_coefficients("polar_express");
  a.set_ns_steps(3);
  a.set_momentum_style("sum");
  a.set_nesterov(false);
  a.set_scale_mode("spectral");
  a.set_extra_scale_factor(0.2);
  a.set_weight_decay_mode("l2");
  a.set_weight_decay(0.01);
  a.set_matmul_precision("fp32");
  a.set_ns_eps(1e-7);
  a.set_ns_norm_safety(1.0);
  AddGroup(spec, "a", a);
  v1::GroupOptions b = Optimizer(v1::OPTIMIZER_MUON);
  v1::NsCoefficients* t = b.add_ns_custom_coefficients();
  t->set_a(3.4445);
  t->set_b(-4.775);
  t->set_c(2.0315);
  b.set_ns_coefficients_after("repeat_last");
  b.set_scale_mode("unit_rms_norm");
  b.set_weight_decay_mode("independent");
  AddGroup(spec, "b", b);
  v1::GroupOptions c = Optimizer(v1::OPTIMIZER_ADAMW);
  c.set_beta1(0.8);
  c.set_beta2(0.95);
  c.set_eps(1e-6);
  c.set_lr(0.003);
  AddGroup(spec, "c", c);
  AddParameter(spec, "x", {4, 6}, "a", v1::DTYPE_FP16);
  AddParameter(spec, "y", {6, 4}, "b", v1::DTYPE_BF16);
  AddParameter(spec, "z", {3}, "c");
  spec.set_return_dtype(v1::DTYPE_FP16);
  Create(w, "s4", spec);
  Upload(w, "s4", spec, 5);
  Step(w, spec, Header("s4", 1), v1::DTYPE_UNSPECIFIED, 7);
  Reads(w, "s4");
  return w.bytes();
}

// Typical mistakes, each of which the daemon must refuse without changing anything.
std::string Mistakes() {
  ScriptWriter w;
  const v1::SessionSpec spec = SmallSpec();
  Create(w, "s5", spec);
  Step(w, spec, Header("s5", 1));  // before the upload
  Upload(w, "s5", spec);
  Step(w, spec, Header("s5", 3));  // out of order
  v1::SessionSpec other = spec;
  other.mutable_parameters(0)->set_shape(1, 5);
  Create(w, "s5", other);  // a conflicting attach

  // A gap between two chunks of "w".
  w.Add(Op::kBeginStep);
  v1::StepRequest request;
  std::vector<v1::TensorChunk> chunks = Chunks(spec.parameters(0), 1.0f, v1::DTYPE_FP32, 8);
  *request.mutable_header() = Header("s5", 1);
  request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
  w.Add(Op::kMessage, request);
  chunks[1].set_offset(12);
  for (const v1::TensorChunk& chunk : chunks) {
    request.Clear();
    *request.mutable_chunk() = chunk;
    w.Add(Op::kMessage, request);
  }
  w.Add(Op::kFinish);

  // A chunk over the 1 KiB chunk limit, then one over gRPC's 5 KiB message limit after a complete "b".
  for (size_t bytes : {2048, 16384}) {
    w.Add(Op::kBeginStep);
    request.Clear();
    *request.mutable_header() = Header("s5", 1);
    request.mutable_header()->set_num_chunks(2);
    w.Add(Op::kMessage, request);
    request.Clear();
    *request.mutable_chunk() = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4)[0];
    w.Add(Op::kMessage, request);
    request.Clear();
    request.mutable_chunk()->set_name("w");
    request.mutable_chunk()->mutable_data()->assign(bytes, '\0');
    w.Add(Op::kMessage, request);
    w.Add(Op::kFinish);
  }

  // A cancelled stream: half of "w", then the client gives up.
  w.Add(Op::kBeginStep);
  request.Clear();
  *request.mutable_header() = Header("s5", 1);
  request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
  w.Add(Op::kMessage, request);
  request.Clear();
  *request.mutable_chunk() = chunks[0];
  w.Add(Op::kMessage, request);
  w.Add(Op::kCancel);

  // A non-finite gradient: the step is skipped, the counter moves.
  w.Add(Op::kBeginStep);
  request.Clear();
  *request.mutable_header() = Header("s5", 1);
  request.mutable_header()->set_num_chunks(1);
  w.Add(Op::kMessage, request);
  v1::TensorChunk nan = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4)[0];
  const float value = std::nanf("");
  nan.mutable_data()->replace(4, 4, reinterpret_cast<const char*>(&value), 4);
  request.Clear();
  *request.mutable_chunk() = nan;
  w.Add(Op::kMessage, request);
  w.Add(Op::kFinish);

  // A set-state stream with a slot the optimizer does not have.
  w.Add(Op::kBeginSetState);
  v1::SetStateRequest set;
  set.set_session_id("s5");
  w.Add(Op::kMessage, set);
  set.Clear();
  set.mutable_header()->set_last_step(1);
  for (const v1::ParameterSpec& p : spec.parameters()) {
    v1::ParameterStepCount* count = set.mutable_header()->add_step_counts();
    count->set_name(p.name());
    count->set_count(1);
  }
  w.Add(Op::kMessage, set);
  set.Clear();
  *set.mutable_chunk() = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4, "momentum")[0];
  w.Add(Op::kMessage, set);
  w.Add(Op::kFinish);

  for (const char* id : {"t1", "t2", "t3", "t4"}) Create(w, id, spec);  // past the session limit
  Reads(w, "s5");
  return w.bytes();
}

// A state for SmallSpec at `last_step`, every count `count`, every slot from Chunks.
void SetStateAt(ScriptWriter& w, const std::string& id, const v1::SessionSpec& spec, int64_t last_step, int64_t count) {
  w.Add(Op::kBeginSetState);
  v1::SetStateRequest set;
  set.set_session_id(id);
  w.Add(Op::kMessage, set);
  set.Clear();
  set.mutable_header()->set_last_step(last_step);
  for (const v1::ParameterSpec& p : spec.parameters()) {
    v1::ParameterStepCount* c = set.mutable_header()->add_step_counts();
    c->set_name(p.name());
    c->set_count(count);
  }
  w.Add(Op::kMessage, set);
  for (const auto& [index, slot] : std::vector<std::pair<int, std::string>>{
           {0, "master"}, {0, "momentum"}, {1, "master"}, {1, "exp_avg"}, {1, "exp_avg_sq"}}) {
    for (const v1::TensorChunk& chunk : Chunks(spec.parameters(index), 0.5f, v1::DTYPE_FP32, 64, slot)) {
      set.Clear();
      *set.mutable_chunk() = chunk;
      if (slot == "exp_avg_sq") {  // squares: not negative
        std::string& data = *set.mutable_chunk()->mutable_data();
        for (size_t i = 0; i + 4 <= data.size(); i += 4) data[i + 3] = static_cast<char>(data[i + 3] & 0x7f);
      }
      w.Add(Op::kMessage, set);
    }
  }
  w.Add(Op::kFinish);
}

// The requests a hostile client once got accepted (docs/protocol.md, Ranges and rules): step numbers
// at the ends of int64, empty chunks, an absurd lr, an override and a slot that do not apply, a NaN
// upload, and a finite gradient whose step would leave the fp32 range.
std::string Hostile() {
  ScriptWriter w;
  const v1::SessionSpec spec = SmallSpec();
  Create(w, "h1", spec);
  std::vector<v1::TensorChunk> nan_upload = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4);
  const float nan = std::nanf("");
  nan_upload[0].mutable_data()->replace(0, 4, reinterpret_cast<const char*>(&nan), 4);
  w.Add(Op::kBeginUpload);
  v1::UploadParametersRequest upload;
  upload.set_session_id("h1");
  w.Add(Op::kMessage, upload);
  for (const v1::TensorChunk& chunk : Chunks(spec.parameters(0), 1.0f, v1::DTYPE_FP32, 16)) {
    upload.Clear();
    *upload.mutable_chunk() = chunk;
    w.Add(Op::kMessage, upload);
  }
  upload.Clear();
  *upload.mutable_chunk() = nan_upload[0];
  w.Add(Op::kMessage, upload);
  w.Add(Op::kFinish);
  Upload(w, "h1", spec);

  SetStateAt(w, "h1", spec, INT64_MAX, 3);
  RawStep(w, Header("h1", INT64_MIN), Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4));
  SetStateAt(w, "h1", spec, (int64_t{1} << 53) - 1, 3);
  RawStep(w, Header("h1", int64_t{1} << 53), Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4));
  SetStateAt(w, "h1", spec, 3, 3);

  v1::TensorChunk empty;
  empty.set_name("b");
  RawStep(w, Header("h1", 4), {empty});
  std::vector<v1::TensorChunk> trailing = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4);
  empty.set_offset(4);
  trailing.push_back(empty);
  RawStep(w, Header("h1", 4), trailing);
  std::vector<v1::TensorChunk> slotted = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4);
  slotted[0].set_slot("momentum");
  RawStep(w, Header("h1", 4), slotted);

  v1::StepHeader absurd = Header("h1", 4);
  absurd.add_overrides()->set_group("matrices");
  absurd.mutable_overrides(0)->set_lr(1e308);
  Step(w, spec, absurd);
  v1::StepHeader momentum = Header("h1", 4);
  momentum.add_overrides()->set_group("vectors");
  momentum.mutable_overrides(0)->set_momentum(0.9);
  Step(w, spec, momentum);

  // lr 100 times a gradient of 3e38: finite, yet the result would not be.
  v1::StepHeader steep = Header("h1", 4);
  steep.add_overrides()->set_group("vectors");
  steep.mutable_overrides(0)->set_lr(100);
  steep.mutable_overrides(0)->set_weight_decay(0);
  std::vector<v1::TensorChunk> huge = Chunks(spec.parameters(1), 1.0f, v1::DTYPE_FP32, 4);
  const std::vector<float> big(4, 3e38f);
  huge[0].clear_data();
  wire::Encode(v1::DTYPE_FP32, big, huge[0].mutable_data());
  RawStep(w, steep, huge);
  Step(w, spec, Header("h1", 5));

  v1::SessionSpec qkv = spec;
  qkv.mutable_parameters(1)->add_qkv_split(2);
  qkv.mutable_parameters(1)->add_qkv_split(1);
  qkv.mutable_parameters(1)->add_qkv_split(1);
  Create(w, "h2", qkv);
  v1::SessionSpec control = spec;
  control.mutable_parameters(0)->set_name(std::string("w\0\n", 3));
  Create(w, "h3", control);
  Reads(w, "h1");
  return w.bytes();
}

// The header and `chunks` as one StepWhole call (a whole step in one call).
// `announced`: the header's num_chunks, when it is to differ from the chunks sent.
void RawWholeStep(ScriptWriter& w, const v1::StepHeader& header, const std::vector<v1::TensorChunk>& chunks,
                  std::optional<uint32_t> announced = std::nullopt) {
  v1::StepMessages messages;
  v1::StepHeader* first = messages.add_messages()->mutable_header();
  *first = header;
  first->set_num_chunks(announced.value_or(static_cast<uint32_t>(chunks.size())));
  for (const v1::TensorChunk& chunk : chunks) *messages.add_messages()->mutable_chunk() = chunk;
  w.Add(Op::kStepWhole, messages);
}

// Whole steps: two in order, a resend, one that leaves a parameter out, and one announcing a chunk
// more than it carries.
std::string Whole() {
  ScriptWriter w;
  const v1::SessionSpec spec = SmallSpec();
  Create(w, "w1", spec);
  Upload(w, "w1", spec);
  for (int64_t step : {1, 2, 2}) RawWholeStep(w, Header("w1", step), StepChunks(spec, step, v1::DTYPE_FP32, 16));
  std::vector<v1::TensorChunk> only_w = Chunks(spec.parameters(0), 0.5f, v1::DTYPE_BF16, 8);
  RawWholeStep(w, Header("w1", 3), only_w);
  RawWholeStep(w, Header("w1", 4), only_w, static_cast<uint32_t>(only_w.size() + 1));
  Reads(w, "w1");
  return w.bytes();
}

}  // namespace
}  // namespace muond::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  const std::pair<const char*, std::string> seeds[] = {
      {"train", muond::fuzz::Train()},     {"state", muond::fuzz::State()},       {"shapes", muond::fuzz::Shapes()},
      {"options", muond::fuzz::Options()}, {"mistakes", muond::fuzz::Mistakes()}, {"hostile", muond::fuzz::Hostile()},
      {"whole", muond::fuzz::Whole()},
  };
  for (const auto& [name, bytes] : seeds) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", std::size(seeds), dir.c_str());
  return 0;
}
