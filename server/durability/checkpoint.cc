#include "server/durability/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/half_ranges.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/durability/file_util.h"
#include "server/durability/json_depth.h"

namespace muond::durability {
namespace {

using nlohmann::json;

constexpr char kFormat[] = "muond.checkpoint.v1";

// Bytes per element of a safetensors dtype muond writes; 0 for any other.
size_t DtypeBytes(const json& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  return 0;
}

// The 16-bit format of a safetensors dtype muond writes in 16 bits ("BF16" or "F16").
HalfFormat HalfFormatOf(const std::string& dtype) { return dtype == "BF16" ? HalfFormat::kBf16 : HalfFormat::kFp16; }

bool IsUnsigned(const json& value) { return value.is_number_unsigned() || (value.is_number_integer() && value >= 0); }

absl::Status DecodeSafetensors(const std::string& file, const std::string& bytes, CheckpointData* data) {
  uint64_t length = 0;
  if (bytes.size() < 8) return CheckpointCorrupt(file, "shorter than its header");
  std::memcpy(&length, bytes.data(), 8);
  if (length > bytes.size() - 8) return CheckpointCorrupt(file, "header length past the end of the file");
  if (!JsonDepthWithin(absl::string_view(bytes).substr(8, length))) {
    return CheckpointCorrupt(file, absl::StrCat("header nests deeper than ", kMaxJsonDepth, " levels"));
  }
  const json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(length), nullptr,
                                  /*allow_exceptions=*/false);
  if (!header.is_object()) return CheckpointCorrupt(file, "header is not a JSON object");
  const size_t data_start = 8 + length;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") continue;
    const size_t slash = key.rfind('/');
    if (slash == std::string::npos) return CheckpointCorrupt(file, absl::StrCat("unknown tensor '", key, "'"));
    // Every field is checked for its type before it is read: a value of the wrong type is a
    // corrupt file, not an exception.
    const bool well_formed = entry.is_object() && entry.contains("dtype") && DtypeBytes(entry["dtype"]) != 0 &&
                             entry.contains("shape") && entry["shape"].is_array() && entry.contains("data_offsets") &&
                             entry["data_offsets"].is_array() && entry["data_offsets"].size() == 2 &&
                             IsUnsigned(entry["data_offsets"][0]) && IsUnsigned(entry["data_offsets"][1]);
    if (!well_formed) {
      return CheckpointCorrupt(file, absl::StrCat("tensor '", key, "' is not F32, BF16 or F16 with a shape"));
    }
    const size_t element = DtypeBytes(entry["dtype"]);
    CheckpointTensor t{key.substr(0, slash), key.substr(slash + 1), {}, {}, entry["dtype"].get<std::string>()};
    uint64_t numel = 1;
    for (const json& dim : entry["shape"]) {
      if (!dim.is_number_integer() || dim.get<int64_t>() <= 0 || dim.get<uint64_t>() > (uint64_t{1} << 40)) {
        return CheckpointCorrupt(file, absl::StrCat("tensor '", key, "' has a bad shape"));
      }
      t.shape.push_back(dim.get<int64_t>());
      numel *= dim.get<uint64_t>();
      if (numel > (uint64_t{1} << 40)) return CheckpointCorrupt(file, absl::StrCat("tensor '", key, "' is too large"));
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    if (end < begin || end - begin != numel * element || end > bytes.size() - data_start) {
      return CheckpointCorrupt(file, absl::StrCat("tensor '", key, "' has bad data offsets"));
    }
    t.values.resize(numel);
    const char* raw = bytes.data() + data_start + begin;
    if (element == 4) {
      std::memcpy(t.values.data(), raw, end - begin);
    } else {
      WidenHalfBytes(HalfFormatOf(t.dtype), raw, t.values.data(), numel);
    }
    data->tensors.push_back(std::move(t));
  }
  return absl::OkStatus();
}

std::string TensorFileName(int64_t step) { return absl::StrFormat("checkpoint-%012d.safetensors", step); }

// The digest of the metadata covers every field but itself: the SHA-256 of what dump() would give
// with "metadata_sha256" erased, built member by member so the document is not copied.
std::string MetadataDigest(const json& metadata) {
  std::string text = "{";
  for (auto it = metadata.begin(); it != metadata.end(); ++it) {
    if (it.key() == "metadata_sha256") continue;
    if (text.size() > 1) text += ',';
    absl::StrAppend(&text, json(it.key()).dump(), ":", it.value().dump());
  }
  text += '}';
  return Sha256Hex(text);
}

// checkpoint.json's "tensors.file" names a file beside it, as WriteCheckpoint does: one path
// component of the form checkpoint-<step>.safetensors, never a path out of the folder.
bool IsTensorFileName(const std::string& name) {
  return absl::StartsWith(name, "checkpoint-") && absl::EndsWith(name, ".safetensors") &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

// A string member of `object`, or "" when it is missing or not a string.
std::string StringField(const json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

// safetensors: 8-byte little-endian header length, the JSON header (padded with spaces to a multiple
// of 8 so the data is aligned), then the raw tensor bytes.
std::string EncodeSafetensors(const CheckpointData& data) {
  json header = json::object();
  size_t offset = 0;
  for (const CheckpointTensor& t : data.tensors) {
    const size_t bytes = t.values.size() * DtypeBytes(t.dtype);
    header[t.parameter + "/" + t.slot] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", kFormat},
                            {"session_id", data.session_id},
                            {"last_step", std::to_string(data.last_step)},
                            {"backend", data.backend}};
  if (data.loss_scaler.has_value()) {  // safetensors metadata holds strings only
    header["__metadata__"]["loss_scale"] = absl::StrFormat("%.17g", data.loss_scaler->scale);
    header["__metadata__"]["loss_scale_growth_tracker"] = std::to_string(data.loss_scaler->growth_tracker);
    header["__metadata__"]["loss_scale_hysteresis_tracker"] = std::to_string(data.loss_scaler->hysteresis_tracker);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  out += text;
  out.reserve(out.size() + offset);
  for (const CheckpointTensor& t : data.tensors) {
    if (DtypeBytes(t.dtype) == 4) {
      out.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * sizeof(float));
      continue;
    }
    const size_t at = out.size();
    out.resize(at + 2 * t.values.size());
    NarrowToHalfBytes(HalfFormatOf(t.dtype), t.values.data(), out.data() + at, t.values.size());
  }
  return out;
}

absl::Status CheckpointCorrupt(const std::string& file, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("checkpoint ", file, " is unusable: ", why));
}

namespace {

// checkpoint.json's "parts_written": {"of": "upload", "ranks": [...]} or {"of": "load", "last_step": n,
// "step_counts": {name: count}, "ranks": [...]}. Whether the ranks and counts fit the session is for
// the session to judge (Session::ImportState).
absl::StatusOr<CheckpointPartsWritten> ReadPartsWritten(const json& parts, const std::string& metadata_file) {
  const std::string of = parts.is_object() ? StringField(parts, "of") : "";
  auto ranks = parts.is_object() ? parts.find("ranks") : parts.end();
  const bool typed = (of == "upload" || of == "load") && ranks != parts.end() && ranks->is_array() &&
                     std::all_of(ranks->begin(), ranks->end(), [](const json& r) { return r.is_number_integer(); });
  if (!typed) return CheckpointCorrupt(metadata_file, "parts_written is not {of: upload|load, ranks: [...], ...}");
  CheckpointPartsWritten written;
  written.upload = of == "upload";
  for (const json& rank : *ranks) written.ranks.push_back(rank.get<int64_t>());
  if (written.upload) return written;
  auto last_step = parts.find("last_step");
  auto counts = parts.find("step_counts");
  if (last_step == parts.end() || !last_step->is_number_integer() || counts == parts.end() || !counts->is_object()) {
    return CheckpointCorrupt(metadata_file, "parts_written of a load lacks its last_step or step_counts");
  }
  written.last_step = last_step->get<int64_t>();
  for (const auto& [name, count] : counts->items()) {
    if (!count.is_number_integer())
      return CheckpointCorrupt(metadata_file, "a parts_written step count is not an integer");
    written.step_counts.emplace_back(name, count.get<int64_t>());
  }
  return written;
}

// checkpoint.json's "contributors": [[step, total_weight, [rank, ...]], ...], steps ascending and
// none past `last_step`, weights finite and positive, ranks ascending. Whether the ranks fit the
// session is for the session to judge (Session::ImportState).
absl::StatusOr<std::vector<CheckpointContributors>> ReadContributors(const json& records, int64_t last_step,
                                                                     const std::string& metadata_file) {
  if (!records.is_array() || records.size() > kMaxCheckpointContributorSteps) {
    return CheckpointCorrupt(metadata_file, absl::StrCat("contributors is not a list of at most ",
                                                         kMaxCheckpointContributorSteps, " steps"));
  }
  auto is_rank = [](const json& r) {
    return r.is_number_integer() && r.get<int64_t>() >= 0 && r.get<int64_t>() <= kMaxCheckpointRank;
  };
  std::vector<CheckpointContributors> out;
  for (const json& record : records) {
    const bool typed = record.is_array() && record.size() == 3 && record[0].is_number_integer() &&
                       record[1].is_number() && record[2].is_array() && !record[2].empty() &&
                       std::all_of(record[2].begin(), record[2].end(), is_rank);
    if (!typed) {
      return CheckpointCorrupt(metadata_file, "a contributors record is not [step, total_weight, [rank, ...]]");
    }
    const int64_t previous = out.empty() ? 0 : out.back().step;
    CheckpointContributors& c = out.emplace_back();
    c.step = record[0].get<int64_t>();
    c.total_weight = record[1].get<double>();
    for (const json& rank : record[2]) c.ranks.push_back(rank.get<int>());
    if (c.step <= previous || c.step > last_step) {
      return CheckpointCorrupt(metadata_file,
                               absl::StrCat("contributors names step ", c.step,
                                            "; its steps must ascend, from 1 to last_step (", last_step, ")"));
    }
    if (!(c.total_weight > 0 && std::isfinite(c.total_weight))) {
      return CheckpointCorrupt(
          metadata_file, absl::StrCat("the total_weight of step ", c.step, "'s contributors is not a positive number"));
    }
    if (std::adjacent_find(c.ranks.begin(), c.ranks.end(), std::greater_equal<int>()) != c.ranks.end()) {
      return CheckpointCorrupt(metadata_file,
                               absl::StrCat("step ", c.step, "'s contributors are not ranks in ascending order"));
    }
  }
  return out;
}

}  // namespace

absl::Status WriteCheckpoint(Env* env, const std::string& dir, const CheckpointData& data) {
  MUOND_RETURN_IF_ERROR(env->CreateDirs(dir));
  const std::string tensors = EncodeSafetensors(data);
  const std::string tensors_sha256 = Sha256Hex(tensors);
  // Never written over the tensor file the checkpoint in place may name (another checkpoint of the
  // same step: ranks uploading or loading parts, a SetState of the current step): should this one
  // fail, that one must still read back. A name of its contents instead.
  std::string tensor_file = TensorFileName(data.last_step);
  if (env->FileExists(dir + "/" + tensor_file) || env->IsLink(dir + "/" + tensor_file)) {
    tensor_file = absl::StrFormat("checkpoint-%012d-%s.safetensors", data.last_step, tensors_sha256.substr(0, 16));
  }

  json spec = json::parse(data.spec_json, nullptr, /*allow_exceptions=*/false);
  if (spec.is_discarded()) return absl::InternalError("the session spec is not JSON");
  json counts = json::object();
  for (const auto& [name, count] : data.step_counts) counts[name] = count;
  json metadata = {{"format", kFormat},
                   {"session_id", data.session_id},
                   {"owner", data.owner},
                   {"last_step", data.last_step},
                   {"generation", data.generation},
                   {"step_counts", counts},
                   {"backend", data.backend},
                   {"spec", std::move(spec)},
                   {"tensors", {{"file", tensor_file}, {"bytes", tensors.size()}, {"sha256", tensors_sha256}}}};
  if (data.loss_scaler.has_value()) {
    metadata["loss_scaler"] = {{"scale", data.loss_scaler->scale},
                               {"growth_tracker", data.loss_scaler->growth_tracker},
                               {"hysteresis_tracker", data.loss_scaler->hysteresis_tracker}};
  }
  if (!data.pushes.empty()) {
    nlohmann::json pushes = nlohmann::json::array();
    for (const CheckpointPush& p : data.pushes) {
      // An applied push as the three numbers earlier versions write and read; a skipped one with
      // its outcome.
      if (p.applied && p.skip_reason.empty()) {
        pushes.push_back({p.push, p.global_step, p.staleness});
      } else {
        pushes.push_back({p.push, p.global_step, p.staleness, p.applied, p.skip_reason});
      }
    }
    metadata["pushes"] = std::move(pushes);
  }
  if (data.parts_written.has_value()) {
    const CheckpointPartsWritten& parts = *data.parts_written;
    json written = {{"of", parts.upload ? "upload" : "load"}, {"ranks", parts.ranks}};
    if (!parts.upload) {
      json load_counts = json::object();
      for (const auto& [name, count] : parts.step_counts) load_counts[name] = count;
      written["last_step"] = parts.last_step;
      written["step_counts"] = std::move(load_counts);
    }
    metadata["parts_written"] = std::move(written);
  }
  if (data.last_decision.has_value()) {
    const CheckpointLastDecision& d = *data.last_decision;
    metadata["last_decision"] = {{"applied", d.applied},
                                 {"grad_norm", std::isfinite(d.grad_norm) ? json(d.grad_norm) : json(nullptr)},
                                 {"skip_reason", d.skip_reason.substr(0, kMaxCheckpointSkipReason)}};
  }
  if (data.last_overrides.has_value()) {
    json overrides = json::parse(*data.last_overrides, nullptr, /*allow_exceptions=*/false);
    if (!overrides.is_array()) {
      return absl::InternalError(absl::StrCat("checkpoint of session '", data.session_id,
                                              "': last_overrides is not a JSON array; not written"));
    }
    metadata["last_overrides"] = std::move(overrides);
  }
  if (!data.contributors.empty()) {
    json records = json::array();
    for (const CheckpointContributors& c : data.contributors) records.push_back({c.step, c.total_weight, c.ranks});
    metadata["contributors"] = std::move(records);
  }
  metadata["metadata_sha256"] = MetadataDigest(metadata);
  // Compact: an indented spec of many explicit ranges takes ten times the bytes.
  const std::string text = metadata.dump() + "\n";
  if (text.size() > kMaxCheckpointMetadataBytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint of session '", data.session_id, "': ", kCheckpointMetadataFile, " would hold ", text.size(),
        " bytes, more than the ", kMaxCheckpointMetadataBytes, " a restore reads; not written"));
  }
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(env, dir + "/" + tensor_file, tensors));
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(env, dir + "/" + kCheckpointMetadataFile, text));

  // The new checkpoint is committed; older tensor files are garbage now.
  absl::StatusOr<std::vector<std::string>> names = env->ListDir(dir);
  if (names.ok()) {
    for (const std::string& name : *names) {
      if (absl::StartsWith(name, "checkpoint-") && name != tensor_file) env->RemoveFile(dir + "/" + name).IgnoreError();
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCheckpointRoom(absl::string_view spec_json, const std::vector<std::string>& names, int world_size,
                                 absl::string_view owner) {
  const json spec = json::parse(spec_json, nullptr, /*allow_exceptions=*/false);
  uint64_t bytes = 4096 + json(std::string(owner)).dump().size() +
                   (spec.is_discarded() ? spec_json.size() : spec.dump().size());  // the spec, the owner, the rest
  constexpr uint64_t kNumber = 21;                                                 // an int64 and its comma
  size_t longest_name = 0;
  for (const std::string& name : names) {
    const size_t quoted = json(name).dump().size();
    longest_name = std::max(longest_name, quoted);
    bytes += 2 * (quoted + 1 + kNumber);  // "name":count, in step_counts and in parts_written
  }
  // A push record [push, global_step, staleness, applied, skip_reason] per rank; the longest reason (the
  // magnitude guard's) names a parameter and a slot in about 200 more bytes.
  constexpr uint64_t kSkipReason = 256 + 64;
  bytes += static_cast<uint64_t>(std::max(world_size, 1)) * (3 * kNumber + 8 + kSkipReason + longest_name) +
           static_cast<uint64_t>(std::max(world_size, 1)) * kNumber;  // and its rank in parts_written
  bytes += 64 + kNumber + kSkipReason + longest_name;                 // the last step's decision
  if (world_size > 1) {  // the contributors of the last steps: a step, a weight and every rank each
    bytes += kMaxCheckpointContributorSteps * (8 + 2 * kNumber + static_cast<uint64_t>(world_size) * 8);
  }
  // The last step's overrides: at most one entry per group, its name (as in the spec) and five numbers.
  constexpr uint64_t kOverrideEntry = 64 + 5 * (16 + 32);  // {"group":…, "weight_decay":<a double>, …}
  if (spec.is_object() && spec.contains("groups") && spec["groups"].is_array()) {
    for (const json& group : spec["groups"]) {
      bytes += kOverrideEntry + (group.is_object() && group.contains("name") ? group["name"].dump().size() : 0);
    }
  } else {
    bytes += spec_json.size();  // not the codec's JSON: its whole size bounds the names it holds
  }
  if (bytes <= kMaxCheckpointMetadataBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("spec: a checkpoint of this session could take ", bytes, " bytes of ", kCheckpointMetadataFile,
                   ", more than the ", kMaxCheckpointMetadataBytes,
                   " a restore reads (--state-dir), so it could never be restored; use fewer parameters, shorter "
                   "names or fewer explicit ranges"));
}

absl::StatusOr<CheckpointData> ReadCheckpoint(Env* env, const std::string& dir, const TensorBytesBound& bound) {
  if (env->IsLink(dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("session folder ", dir, " is a symbolic link (state files are never reached through links)"));
  }
  const std::string metadata_file = dir + "/" + kCheckpointMetadataFile;
  MUOND_ASSIGN_OR_RETURN(std::string text, env->ReadFile(metadata_file, kMaxCheckpointMetadataBytes));
  if (!JsonDepthWithin(text)) {
    return CheckpointCorrupt(metadata_file, absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
  }
  const json metadata = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!metadata.is_object()) return CheckpointCorrupt(metadata_file, "not valid JSON (truncated?)");
  if (StringField(metadata, "format") != kFormat) return CheckpointCorrupt(metadata_file, "unknown format");
  if (StringField(metadata, "metadata_sha256") != MetadataDigest(metadata)) {
    return CheckpointCorrupt(metadata_file, "its SHA-256 does not match its contents (altered)");
  }
  // The digest matched, so the fields are as muond wrote them; their types are still checked, since
  // a digest is no proof against a file written to look valid.
  auto last_step = metadata.find("last_step");
  auto counts = metadata.find("step_counts");
  auto tensors = metadata.find("tensors");
  auto spec = metadata.find("spec");
  if (last_step == metadata.end() || !last_step->is_number_integer() || counts == metadata.end() ||
      !counts->is_object() || tensors == metadata.end() || !tensors->is_object() || spec == metadata.end() ||
      !spec->is_object() || !tensors->contains("bytes") || !IsUnsigned((*tensors)["bytes"])) {
    return CheckpointCorrupt(metadata_file, "a field is missing or of the wrong type");
  }
  CheckpointData data;
  data.session_id = StringField(metadata, "session_id");
  data.owner = StringField(metadata, "owner");
  data.backend = StringField(metadata, "backend");
  data.spec_json = spec->dump();
  data.last_step = last_step->get<int64_t>();
  if (auto generation = metadata.find("generation"); generation != metadata.end()) {
    if (!IsUnsigned(*generation)) return CheckpointCorrupt(metadata_file, "generation is not a count");
    data.generation = generation->get<uint64_t>();
  }
  for (const auto& [name, count] : counts->items()) {
    if (!count.is_number_integer()) return CheckpointCorrupt(metadata_file, "a step count is not an integer");
    data.step_counts.emplace_back(name, count.get<int64_t>());
  }

  if (auto scaler = metadata.find("loss_scaler"); scaler != metadata.end()) {
    const bool typed = scaler->is_object() && scaler->contains("scale") && (*scaler)["scale"].is_number() &&
                       scaler->contains("growth_tracker") && (*scaler)["growth_tracker"].is_number_integer() &&
                       scaler->contains("hysteresis_tracker") && (*scaler)["hysteresis_tracker"].is_number_integer();
    if (!typed)
      return CheckpointCorrupt(metadata_file, "loss_scaler is not {scale, growth_tracker, hysteresis_tracker}");
    data.loss_scaler =
        CheckpointLossScaler{(*scaler)["scale"].get<double>(), (*scaler)["growth_tracker"].get<int64_t>(),
                             (*scaler)["hysteresis_tracker"].get<int64_t>()};
  }

  if (auto pushes = metadata.find("pushes"); pushes != metadata.end()) {
    if (!pushes->is_array()) return CheckpointCorrupt(metadata_file, "pushes is not a list");
    for (const auto& record : *pushes) {
      const bool numbers =
          record.is_array() && (record.size() == 3 || record.size() == 5) &&
          std::all_of(record.begin(), record.begin() + 3, [](const auto& v) { return v.is_number_integer(); });
      const bool outcome = numbers && (record.size() == 3 ||
                                       (record[3].is_boolean() && record[4].is_string() &&
                                        record[4].get_ref<const std::string&>().size() <= kMaxCheckpointSkipReason));
      if (!outcome) {
        return CheckpointCorrupt(metadata_file,
                                 "a push record is not [push, global_step, staleness, applied, skip_reason]");
      }
      CheckpointPush push;
      push.push = record[0].get<int64_t>();
      push.global_step = record[1].get<int64_t>();
      push.staleness = record[2].get<int64_t>();
      if (record.size() == 5) {
        push.applied = record[3].get<bool>();
        push.skip_reason = record[4].get<std::string>();
      }
      data.pushes.push_back(std::move(push));
    }
  }

  if (auto parts = metadata.find("parts_written"); parts != metadata.end()) {
    MUOND_ASSIGN_OR_RETURN(data.parts_written, ReadPartsWritten(*parts, metadata_file));
  }

  if (auto decision = metadata.find("last_decision"); decision != metadata.end()) {
    const bool typed = decision->is_object() && decision->contains("applied") && (*decision)["applied"].is_boolean() &&
                       decision->contains("grad_norm") &&
                       ((*decision)["grad_norm"].is_null() || (*decision)["grad_norm"].is_number()) &&
                       decision->contains("skip_reason") && (*decision)["skip_reason"].is_string() &&
                       (*decision)["skip_reason"].get_ref<const std::string&>().size() <= kMaxCheckpointSkipReason;
    if (!typed) return CheckpointCorrupt(metadata_file, "last_decision is not {applied, grad_norm, skip_reason}");
    CheckpointLastDecision& d = data.last_decision.emplace();
    d.applied = (*decision)["applied"].get<bool>();
    d.grad_norm = (*decision)["grad_norm"].is_null() ? std::numeric_limits<double>::quiet_NaN()
                                                     : (*decision)["grad_norm"].get<double>();
    d.skip_reason = (*decision)["skip_reason"].get<std::string>();
    if (!d.applied && d.skip_reason.empty()) {
      return CheckpointCorrupt(metadata_file, "last_decision skips the step without a skip_reason");
    }
    if (!std::isnan(d.grad_norm) && !(d.grad_norm >= 0 && std::isfinite(d.grad_norm))) {
      return CheckpointCorrupt(metadata_file, "last_decision.grad_norm is not a norm");
    }
  }

  if (auto overrides = metadata.find("last_overrides"); overrides != metadata.end()) {
    // The session's to read (session::DecodeOverrides), as a journal record's request is; what it
    // cannot use it drops as unknown, since the record only informs an attach's answer.
    data.last_overrides = overrides->dump();
  }

  if (auto contributors = metadata.find("contributors"); contributors != metadata.end()) {
    MUOND_ASSIGN_OR_RETURN(data.contributors, ReadContributors(*contributors, data.last_step, metadata_file));
  }

  const std::string tensor_name = StringField(*tensors, "file");
  if (!IsTensorFileName(tensor_name)) {
    return CheckpointCorrupt(metadata_file, absl::StrCat("tensors.file '", tensor_name.substr(0, 200),
                                                         "' is not a checkpoint-<step>.safetensors beside it"));
  }
  const std::string tensor_file = dir + "/" + tensor_name;
  // The declared size bounds the read: a larger file is refused before it is read. The size is the
  // metadata's word, so it is bounded in turn by what the spec could fill: a forged size must not
  // have the whole file read into memory (and a failed allocation stop the daemon's start).
  const uint64_t declared_bytes = (*tensors)["bytes"].get<uint64_t>();
  if (bound) {
    MUOND_ASSIGN_OR_RETURN(const uint64_t most, bound(data));
    if (declared_bytes > most) {
      return CheckpointCorrupt(metadata_file,
                               absl::StrCat("tensors.bytes declares ", declared_bytes,
                                            " bytes, more than its spec's tensors could fill (", most, ")"));
    }
  }
  absl::StatusOr<std::string> bytes = env->ReadFile(tensor_file, declared_bytes);
  const bool too_large = !bytes.ok() && bytes.status().code() == absl::StatusCode::kOutOfRange;
  if (!bytes.ok() && !too_large) return bytes.status();
  if (too_large || bytes->size() != declared_bytes || Sha256Hex(*bytes) != StringField(*tensors, "sha256")) {
    return CheckpointCorrupt(tensor_file, "its size or SHA-256 differs from checkpoint.json (truncated or altered)");
  }
  MUOND_RETURN_IF_ERROR(DecodeSafetensors(tensor_file, *bytes, &data));
  return data;
}

}  // namespace muond::durability
