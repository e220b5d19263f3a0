#include "server/checkpoint.h"

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/durable_file.h"

namespace muond::server {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr char kFormat[] = "muond.checkpoint.v1";
constexpr char kMetadataFile[] = "checkpoint.json";

absl::Status Corrupt(const std::string& file, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("checkpoint ", file, " is unusable: ", why));
}

// safetensors: 8-byte little-endian header length, the JSON header (padded with spaces to a multiple
// of 8 so the data is aligned), then the raw tensor bytes.
std::string EncodeSafetensors(const CheckpointContents& contents, const SessionConfig& config,
                              const std::string& backend_name) {
  json header = json::object();
  size_t offset = 0;
  for (const StateTensor& t : contents.state.tensors) {
    const ParameterConfig& param = config.parameters[t.parameter];
    const size_t bytes = t.values.size() * sizeof(float);
    header[param.name + "/" + t.slot] = {{"dtype", "F32"}, {"shape", param.shape},
                                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", kFormat}, {"session_id", contents.session_id},
                            {"last_step", std::to_string(contents.state.last_step)}, {"backend", backend_name}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  out += text;
  out.reserve(out.size() + offset);
  for (const StateTensor& t : contents.state.tensors) {
    out.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * sizeof(float));
  }
  return out;
}

absl::Status DecodeSafetensors(const std::string& file, const std::string& bytes, const SessionConfig& config,
                               SessionState* state) {
  uint64_t length = 0;
  if (bytes.size() < 8) return Corrupt(file, "shorter than its header");
  std::memcpy(&length, bytes.data(), 8);
  if (length > bytes.size() - 8) return Corrupt(file, "header length past the end of the file");
  const json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(length),
                                  nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return Corrupt(file, "header is not a JSON object");
  const size_t data_start = 8 + length;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") continue;
    const size_t slash = key.rfind('/');
    auto it = slash == std::string::npos ? config.parameter_index.end()
                                         : config.parameter_index.find(key.substr(0, slash));
    if (it == config.parameter_index.end()) return Corrupt(file, absl::StrCat("unknown tensor '", key, "'"));
    const ParameterConfig& param = config.parameters[it->second];
    if (!entry.is_object() || entry.value("dtype", "") != "F32" || !entry.contains("data_offsets") ||
        entry["shape"] != json(param.shape)) {
      return Corrupt(file, absl::StrCat("tensor '", key, "' is not F32 with the spec's shape"));
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    if (end < begin || end - begin != static_cast<uint64_t>(param.numel) * sizeof(float) ||
        end > bytes.size() - data_start) {
      return Corrupt(file, absl::StrCat("tensor '", key, "' has bad data offsets"));
    }
    StateTensor t{it->second, key.substr(slash + 1), std::vector<float>(param.numel)};
    std::memcpy(t.values.data(), bytes.data() + data_start + begin, end - begin);
    state->tensors.push_back(std::move(t));
  }
  return absl::OkStatus();
}

std::string TensorFileName(int64_t step) { return absl::StrFormat("checkpoint-%012d.safetensors", step); }

// The digest of the metadata covers every field but itself.
std::string MetadataDigest(json metadata) {
  metadata.erase("metadata_sha256");
  return Sha256Hex(metadata.dump());
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, const CheckpointContents& contents, const SessionConfig& config,
                             const std::string& backend_name) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", error.message()));
  const std::string tensors = EncodeSafetensors(contents, config, backend_name);
  const std::string tensor_file = TensorFileName(contents.state.last_step);
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + tensor_file, tensors));

  std::string spec_json;
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(contents.spec, &spec_json, print).ok()) {
    return absl::InternalError("cannot encode the session spec as JSON");
  }
  json counts = json::object();
  for (size_t i = 0; i < config.parameters.size(); ++i) counts[config.parameters[i].name] = contents.state.step_counts[i];
  json metadata = {{"format", kFormat},
                   {"session_id", contents.session_id},
                   {"owner", contents.owner},
                   {"last_step", contents.state.last_step},
                   {"step_counts", counts},
                   {"backend", backend_name},
                   {"spec", json::parse(spec_json)},
                   {"tensors", {{"file", tensor_file}, {"bytes", tensors.size()}, {"sha256", Sha256Hex(tensors)}}}};
  metadata["metadata_sha256"] = MetadataDigest(metadata);
  MUOND_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + kMetadataFile, metadata.dump(2) + "\n"));

  // The new checkpoint is committed; older tensor files are garbage now.
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("checkpoint-") && name != tensor_file) fs::remove(entry.path(), error);
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& dir, const SpecLimits& limits) {
  const std::string metadata_file = dir + "/" + kMetadataFile;
  MUOND_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(metadata_file));
  const json metadata = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!metadata.is_object()) return Corrupt(metadata_file, "not valid JSON (truncated?)");
  if (metadata.value("format", "") != kFormat) return Corrupt(metadata_file, "unknown format");
  if (metadata.value("metadata_sha256", "") != MetadataDigest(metadata)) {
    return Corrupt(metadata_file, "its SHA-256 does not match its contents (altered)");
  }
  CheckpointContents contents;
  contents.session_id = metadata.value("session_id", "");
  contents.owner = metadata.value("owner", "");
  if (!google::protobuf::util::JsonStringToMessage(metadata["spec"].dump(), &contents.spec).ok()) {
    return Corrupt(metadata_file, "the spec does not parse");
  }
  absl::StatusOr<SessionConfig> config = ParseSessionSpec(contents.spec, limits);
  if (!config.ok()) return Corrupt(metadata_file, config.status().message());

  const json& tensors = metadata["tensors"];
  const std::string tensor_file = dir + "/" + tensors.value("file", "");
  MUOND_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(tensor_file));
  if (bytes.size() != tensors.value("bytes", uint64_t{0}) || Sha256Hex(bytes) != tensors.value("sha256", "")) {
    return Corrupt(tensor_file, "its size or SHA-256 differs from checkpoint.json (truncated or altered)");
  }
  contents.state.last_step = metadata.value("last_step", int64_t{-1});
  for (const ParameterConfig& param : config->parameters) {
    contents.state.step_counts.push_back(metadata["step_counts"].value(param.name, int64_t{-1}));
  }
  MUOND_RETURN_IF_ERROR(DecodeSafetensors(tensor_file, bytes, *config, &contents.state));
  return contents;
}

}  // namespace muond::server
