#include "tools/muondctl/state_commands.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/durability/checkpoint.h"
#include "server/durability/file_util.h"
#include "server/durability/session_files.h"

namespace muond::ctl {
namespace {

using nlohmann::ordered_json;

// What one session folder holds, read without changing anything.
struct FolderReport {
  std::string dir;
  std::string name;
  std::optional<durability::SessionFolder> folder;  // when it could be read
  absl::Status error;                               // why it could not
  bool has_checkpoint = true;
  std::vector<int64_t> journal_steps;   // the steps of the journal's records, in file order
  std::vector<std::string> problems;    // for verify
  ordered_json json;
};

absl::StatusOr<size_t> ParameterCount(const durability::CheckpointData& data) {
  const ordered_json spec = ordered_json::parse(data.spec_json, nullptr, /*allow_exceptions=*/false);
  if (!spec.is_object()) return absl::DataLossError("checkpoint.json: the spec is not a JSON object");
  auto parameters = spec.find("parameters");
  return parameters == spec.end() || !parameters->is_array() ? 0 : parameters->size();
}

FolderReport ReadFolder(const std::string& state_dir, const std::string& name) {
  durability::Env* env = durability::Env::Default();
  FolderReport report;
  report.name = name;
  report.dir = state_dir + "/" + name;
  report.json["folder"] = name;
  if (!env->FileExists(report.dir + "/" + durability::kCheckpointMetadataFile)) {
    report.has_checkpoint = false;
    report.json["checkpoint"] = nullptr;
    report.json["note"] = "no checkpoint: the session never received its parameters (the daemon removes it at start)";
    return report;
  }
  durability::StateDirOptions options;
  options.state_dir = state_dir;
  absl::StatusOr<durability::SessionFolder> folder = durability::LoadSessionFolder(options, report.dir, ParameterCount);
  if (!folder.ok()) {
    report.error = folder.status();
    report.problems.push_back(std::string(folder.status().message()));
    report.json["error"] = std::string(folder.status().message());
    return report;
  }
  const durability::CheckpointData& c = folder->checkpoint;
  const std::string metadata_text = env->ReadFile(report.dir + "/" + durability::kCheckpointMetadataFile, durability::kNoReadLimit).value_or("{}");
  const ordered_json metadata = ordered_json::parse(metadata_text, nullptr, false);
  size_t values = 0;
  std::vector<std::string> slots;
  for (const durability::CheckpointTensor& t : c.tensors) {
    values += t.values.size();
    if (std::find(slots.begin(), slots.end(), t.slot) == slots.end()) slots.push_back(t.slot);
  }
  report.json["session_id"] = c.session_id;
  report.json["owner"] = c.owner;
  report.json["backend"] = c.backend;
  report.json["checkpoint"] = {{"step", c.last_step},
                               {"tensors", c.tensors.size()},
                               {"slots", slots},
                               {"values", values},
                               {"file", metadata.is_object() ? metadata["tensors"].value("file", "") : ""},
                               {"bytes", metadata.is_object() ? metadata["tensors"].value("bytes", 0) : 0},
                               {"sha256", metadata.is_object() ? metadata["tensors"].value("sha256", "") : ""},
                               {"metadata_sha256", metadata.is_object() ? metadata.value("metadata_sha256", "") : ""}};
  ordered_json records = ordered_json::array();
  for (const durability::JournalRecord& record : folder->journal.records) {
    const ordered_json request = ordered_json::parse(record.request, nullptr, false);
    const int64_t step = request.is_object() ? request.value("step", int64_t{-1}) : -1;
    report.journal_steps.push_back(step);
    size_t gradients = 0;
    for (const HostTensor& g : record.gradients) gradients += !g.values.empty();
    records.push_back({{"step", step}, {"rank", request.is_object() ? request.value("rank", 0) : 0},
                       {"gradients", gradients}});
  }
  report.json["journal"] = {{"records", records},
                            {"torn_tail_dropped", folder->journal.dropped_torn_tail}};
  // The journal holds the steps after the checkpoint, one record per step (ranks' gradients are
  // averaged before they are recorded), in order.
  int64_t expected = c.last_step + 1;
  for (int64_t step : report.journal_steps) {
    if (step != expected) {
      report.problems.push_back(absl::StrCat(folder->journal_path, ": holds step ", step, " where step ", expected,
                                             " was expected (checkpoint at step ", c.last_step, ")"));
      break;
    }
    ++expected;
  }
  report.json["last_step"] = expected - 1;  // what a daemon restoring this folder would resume from
  report.folder = *std::move(folder);
  return report;
}

absl::StatusOr<std::vector<FolderReport>> ReadStateDir(const std::string& state_dir) {
  durability::Env* env = durability::Env::Default();
  if (!env->IsDirectory(state_dir)) return absl::NotFoundError(absl::StrCat("no state directory ", state_dir));
  absl::StatusOr<std::vector<std::string>> names = env->ListDir(state_dir);
  if (!names.ok()) return names.status();
  std::sort(names->begin(), names->end());
  std::vector<FolderReport> reports;
  for (const std::string& name : *names) {
    if (env->IsDirectory(state_dir + "/" + name)) reports.push_back(ReadFolder(state_dir, name));
  }
  return reports;
}

std::string FolderText(const FolderReport& r) {
  if (!r.has_checkpoint) return absl::StrCat(r.name, ": no checkpoint (the session never received its parameters)\n");
  if (!r.error.ok()) return absl::StrCat(r.name, ": UNREADABLE: ", r.error.message(), "\n");
  const ordered_json& c = r.json["checkpoint"];
  std::string text = absl::StrCat(
      r.name, ": session ", r.json["session_id"].get<std::string>(), ", resumes at step ", r.json["last_step"].get<int64_t>(),
      "\n  checkpoint  step ", c["step"].get<int64_t>(), ", ", c["tensors"].get<size_t>(), " tensors (",
      absl::StrJoin(c["slots"].get<std::vector<std::string>>(), ", "), "), ", c["values"].get<size_t>(), " values, ",
      HumanBytes(c["bytes"].get<double>()), "\n  sha256      ", c["sha256"].get<std::string>(), "\n  backend     ",
      r.json["backend"].get<std::string>(), r.json["owner"].get<std::string>().empty() ? "" : ", owner ",
      r.json["owner"].get<std::string>(), "\n  journal     ", r.journal_steps.size(), " records");
  if (!r.journal_steps.empty()) {
    absl::StrAppend(&text, " (steps ", r.journal_steps.front(), "–", r.journal_steps.back(), ")");
  }
  if (r.json["journal"]["torn_tail_dropped"].get<bool>()) absl::StrAppend(&text, ", a torn last record (dropped)");
  return text + "\n";
}

// The answer both state commands start from: the folder and an empty list of sessions.
Answer StateDirAnswer(const std::string& state_dir) {
  Answer answer;
  answer.json["state_dir"] = state_dir;
  answer.json["sessions"] = ordered_json::array();
  return answer;
}

}  // namespace

Answer InspectState(const std::string& state_dir) {
  absl::StatusOr<std::vector<FolderReport>> reports = ReadStateDir(state_dir);
  if (!reports.ok()) return ErrorAnswer(reports.status());
  Answer answer = StateDirAnswer(state_dir);
  for (const FolderReport& r : *reports) {
    answer.json["sessions"].push_back(r.json);
    answer.text += FolderText(r);
  }
  if (reports->empty()) answer.text = absl::StrCat(state_dir, ": no sessions\n");
  return answer;
}

Answer VerifyState(const std::string& state_dir) {
  absl::StatusOr<std::vector<FolderReport>> reports = ReadStateDir(state_dir);
  if (!reports.ok()) return ErrorAnswer(reports.status());
  Answer answer = StateDirAnswer(state_dir);
  int problems = 0;
  for (const FolderReport& r : *reports) {
    problems += static_cast<int>(r.problems.size());
    answer.json["sessions"].push_back({{"folder", r.name}, {"ok", r.problems.empty()}, {"problems", r.problems}});
    if (!r.has_checkpoint) {
      absl::StrAppend(&answer.text, "skip  ", r.name, ": no checkpoint (never received its parameters)\n");
    } else if (r.problems.empty()) {
      absl::StrAppend(&answer.text, "ok    ", r.name, ": checkpoint at step ", r.json["checkpoint"]["step"].get<int64_t>(),
                      " and ", r.journal_steps.size(), " journal records verify\n");
    } else {
      for (const std::string& p : r.problems) absl::StrAppend(&answer.text, "FAIL  ", r.name, ": ", p, "\n");
    }
  }
  answer.json["ok"] = problems == 0;
  answer.json["problems"] = problems;
  absl::StrAppend(&answer.text, problems == 0 ? "verified: " : "FAILED: ", reports->size(), " session folders, ",
                  problems, " problems\n");
  answer.exit_code = problems == 0 ? kExitOk : kExitNo;
  return answer;
}

Answer ExportFromStateDir(const std::string& state_dir, const std::string& session_id, const std::string& to) {
  durability::Env* env = durability::Env::Default();
  const std::string dir = state_dir + "/" + session_id;
  if (!env->FileExists(dir + "/" + durability::kCheckpointMetadataFile)) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("no checkpoint of session '", session_id, "' in ", state_dir)));
  }
  absl::StatusOr<durability::CheckpointData> data = durability::ReadCheckpoint(env, dir);
  if (!data.ok()) return ErrorAnswer(data.status());
  const std::string bytes = durability::EncodeSafetensors(*data);
  if (absl::Status written = durability::WriteFileAtomically(env, to, bytes); !written.ok()) {
    return ErrorAnswer(absl::InvalidArgumentError(absl::StrCat("--to: ", written.message())));
  }
  Answer answer;
  answer.json = {{"session_id", session_id}, {"step", data->last_step}, {"file", to},
                 {"tensors", data->tensors.size()}, {"bytes", bytes.size()}, {"source", "checkpoint"}};
  answer.text = absl::StrCat("session ", session_id, " checkpoint at step ", data->last_step, " (journal not applied): ",
                             data->tensors.size(), " tensors (", HumanBytes(static_cast<double>(bytes.size())),
                             ") written to ", to, "\n");
  return answer;
}

}  // namespace muond::ctl
