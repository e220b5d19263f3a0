#include "tools/muondctl/state_commands.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend_factory.h"
#include "server/durability/checkpoint.h"
#include "server/durability/file_util.h"
#include "server/durability/session_files.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/state_digest.h"
#include "server/session/state_dir.h"
#include "server/session/step_types.h"

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
  std::vector<int64_t> journal_steps;  // the steps of the journal's records, in file order
  std::vector<std::string> problems;   // for verify
  ordered_json json;
};

durability::StateDirOptions OptionsFor(const std::string& state_dir) {
  durability::StateDirOptions options;
  options.state_dir = state_dir;
  return options;
}

// Whether the session folder `dir` has a checkpoint to read: its metadata file, or a link in its
// place (which the reading refuses, as a restore does: the daemon quarantines such a folder).
bool HasCheckpoint(const std::string& dir) {
  durability::Env* env = durability::Env::Default();
  const std::string metadata_file = dir + "/" + durability::kCheckpointMetadataFile;
  return env->FileExists(metadata_file) || env->IsLink(metadata_file);
}

FolderReport ReadFolder(const std::string& state_dir, const std::string& name, const session::SpecLimits& limits) {
  durability::Env* env = durability::Env::Default();
  FolderReport report;
  report.name = name;
  report.dir = state_dir + "/" + name;
  report.json["folder"] = name;
  const std::string metadata_file = report.dir + "/" + durability::kCheckpointMetadataFile;
  if (!HasCheckpoint(report.dir)) {
    report.has_checkpoint = false;
    report.json["checkpoint"] = nullptr;
    report.json["note"] = "no checkpoint: the session never received its parameters (the daemon removes it at start)";
    return report;
  }
  absl::StatusOr<durability::SessionFolder> folder =
      durability::LoadSessionFolder(OptionsFor(state_dir), report.dir, [&](const durability::CheckpointData& data) {
        return session::CheckpointSpecSizes(data, metadata_file, rpc::ProtoSpecCodec(), limits);
      });
  if (!folder.ok()) {
    report.error = folder.status();
    report.problems.push_back(std::string(folder.status().message()));
    report.json["error"] = std::string(folder.status().message());
    return report;
  }
  const durability::CheckpointData& c = folder->checkpoint;
  // Read and checked by LoadSessionFolder just now (a regular file, its size and nesting bounded).
  const std::string metadata_text = env->ReadFile(metadata_file, durability::kNoReadLimit).value_or("{}");
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
                               // uint64_t: the size may pass 2 GiB (an int default reads it as an int).
                               {"bytes", metadata.is_object() ? metadata["tensors"].value("bytes", uint64_t{0}) : 0},
                               {"sha256", metadata.is_object() ? metadata["tensors"].value("sha256", "") : ""},
                               {"metadata_sha256", metadata.is_object() ? metadata.value("metadata_sha256", "") : ""}};
  ordered_json records = ordered_json::array();
  for (size_t i = 0; i < folder->journal.records.size(); ++i) {
    const durability::JournalRecord& record = folder->journal.records[i];
    // Decoded as a restore decodes it: a record it would refuse is this folder's error.
    absl::StatusOr<session::StepRequest> request = session::DecodeStepRequest(record.request);
    if (!request.ok()) {
      report.error = absl::DataLossError(absl::StrCat(report.dir, "/", durability::kJournalFile, ": record ", i + 1,
                                                      ": ", request.status().message()));
      report.problems.push_back(std::string(report.error.message()));
      report.json["error"] = std::string(report.error.message());
      return report;
    }
    // The session's step the record makes (an asynchronous push's is its global step, not its
    // rank's push number), as the restore replays it.
    const int64_t step = session::GlobalStepOf(*request);
    report.journal_steps.push_back(step);
    size_t gradients = 0;
    for (const HostTensor& g : record.gradients) gradients += !g.values.empty();
    records.push_back({{"step", step}, {"rank", request->rank}, {"gradients", gradients}});
  }
  report.json["journal"] = {{"records", records},
                            {"torn_tail_dropped", folder->journal.dropped_torn_tail},
                            {"records_before_checkpoint", folder->records_before_checkpoint}};
  // What a daemon restoring this folder would resume from: the journal's steps follow the checkpoint's.
  // Counted without overflow: a forged checkpoint step at the largest int64 is shown as it is.
  int64_t last = c.last_step;
  for (int64_t step : report.journal_steps) {
    if (last < std::numeric_limits<int64_t>::max() && step == last + 1) last = step;
  }
  report.json["last_step"] = last;  // what a daemon restoring this folder would resume from
  report.folder = *std::move(folder);
  return report;
}

// The session folders of `state_dir`, sorted, as the daemon lists them: names that are not session
// ids (its quarantine) are not sessions.
absl::StatusOr<std::vector<std::string>> SessionFolderNames(const std::string& state_dir) {
  durability::Env* env = durability::Env::Default();
  if (!env->IsDirectory(state_dir)) return absl::NotFoundError(absl::StrCat("no state directory ", state_dir));
  absl::StatusOr<std::vector<std::string>> names = env->ListDir(state_dir);
  if (!names.ok()) return names.status();
  std::sort(names->begin(), names->end());
  std::vector<std::string> folders;
  for (const std::string& name : *names) {
    if (durability::CheckSessionId(name).ok() && env->IsDirectory(state_dir + "/" + name)) folders.push_back(name);
  }
  return folders;
}

absl::StatusOr<std::vector<FolderReport>> ReadStateDir(const std::string& state_dir,
                                                       const session::SpecLimits& limits) {
  absl::StatusOr<std::vector<std::string>> names = SessionFolderNames(state_dir);
  if (!names.ok()) return names.status();
  std::vector<FolderReport> reports;
  for (const std::string& name : *names) reports.push_back(ReadFolder(state_dir, name, limits));
  return reports;
}

std::string FolderText(const FolderReport& r) {
  if (!r.has_checkpoint) return absl::StrCat(r.name, ": no checkpoint (the session never received its parameters)\n");
  if (!r.error.ok()) return absl::StrCat(r.name, ": UNREADABLE: ", r.error.message(), "\n");
  const ordered_json& c = r.json["checkpoint"];
  std::string text = absl::StrCat(
      r.name, ": session ", r.json["session_id"].get<std::string>(), ", resumes at step ",
      r.json["last_step"].get<int64_t>(), "\n  checkpoint  step ", c["step"].get<int64_t>(), ", ",
      c["tensors"].get<size_t>(), " tensors (", absl::StrJoin(c["slots"].get<std::vector<std::string>>(), ", "), "), ",
      c["values"].get<size_t>(), " values, ", HumanBytes(c["bytes"].get<double>()), "\n  sha256      ",
      c["sha256"].get<std::string>(), "\n  backend     ", r.json["backend"].get<std::string>(),
      r.json["owner"].get<std::string>().empty() ? "" : ", owner ", r.json["owner"].get<std::string>(),
      "\n  journal     ", r.journal_steps.size(), " records");
  if (!r.journal_steps.empty()) {
    absl::StrAppend(&text, " (steps ", r.journal_steps.front(), "–", r.journal_steps.back(), ")");
  }
  if (r.json["journal"]["torn_tail_dropped"].get<bool>()) absl::StrAppend(&text, ", a torn last record (dropped)");
  if (const size_t before = r.json["journal"]["records_before_checkpoint"].get<size_t>(); before > 0) {
    absl::StrAppend(&text, ", ", before, " written before the checkpoint (not replayed)");
  }
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

Answer InspectState(const std::string& state_dir, const session::SpecLimits& limits) {
  absl::StatusOr<std::vector<FolderReport>> reports = ReadStateDir(state_dir, limits);
  if (!reports.ok()) return ErrorAnswer(reports.status());
  Answer answer = StateDirAnswer(state_dir);
  for (const FolderReport& r : *reports) {
    answer.json["sessions"].push_back(r.json);
    answer.text += FolderText(r);
  }
  if (reports->empty()) answer.text = absl::StrCat(state_dir, ": no sessions\n");
  // A folder that cannot be read is an answer of no, for scripts as for people.
  const bool unreadable =
      std::any_of(reports->begin(), reports->end(), [](const FolderReport& r) { return !r.error.ok(); });
  if (unreadable) answer.exit_code = kExitNo;
  return answer;
}

Answer VerifyState(const std::string& state_dir, const session::SpecLimits& limits) {
  absl::StatusOr<std::vector<FolderReport>> reports = ReadStateDir(state_dir, limits);
  if (!reports.ok()) return ErrorAnswer(reports.status());
  // The daemon's own restore, folder by folder (session::LoadSession: every check, nothing written),
  // on a CPU backend of one thread; each restored session is dropped before the next.
  absl::StatusOr<kernels::BackendSelection> backend = kernels::CreateBackend("cpu", 0, 1);
  if (!backend.ok()) return ErrorAnswer(backend.status());
  const rpc::ProtoSpecCodec codec;
  for (FolderReport& r : *reports) {
    if (!r.has_checkpoint || !r.error.ok()) continue;
    absl::StatusOr<session::LoadedSession> loaded =
        session::LoadSession(OptionsFor(state_dir), r.dir, backend->backend.get(), codec, limits);
    if (!loaded.ok()) r.problems.push_back(std::string(loaded.status().message()));
  }
  Answer answer = StateDirAnswer(state_dir);
  int problems = 0;
  // A folder whose name is not a session id is left alone by the daemon, which logs why: the same
  // words fail it here, since the session in it would not come back.
  absl::StatusOr<std::vector<std::string>> all = durability::Env::Default()->ListDir(state_dir);
  if (!all.ok()) return ErrorAnswer(all.status());
  std::sort(all->begin(), all->end());
  for (const std::string& name : *all) {
    if (durability::IsKnownNonSessionFolder(name) || durability::CheckSessionId(name).ok() ||
        !durability::Env::Default()->IsDirectory(absl::StrCat(state_dir, "/", name))) {
      continue;
    }
    const std::string message = durability::ForeignFolderMessage(state_dir, name);
    ++problems;
    answer.json["sessions"].push_back({{"folder", absl::CHexEscape(name)}, {"ok", false}, {"problems", {message}}});
    absl::StrAppend(&answer.text, "FAIL  ", message, "\n");
  }
  for (const FolderReport& r : *reports) {
    problems += static_cast<int>(r.problems.size());
    answer.json["sessions"].push_back({{"folder", r.name}, {"ok", r.problems.empty()}, {"problems", r.problems}});
    if (!r.has_checkpoint) {
      absl::StrAppend(&answer.text, "skip  ", r.name, ": no checkpoint (never received its parameters)\n");
    } else if (r.problems.empty()) {
      absl::StrAppend(&answer.text, "ok    ", r.name, ": checkpoint at step ",
                      r.json["checkpoint"]["step"].get<int64_t>(), " and ", r.journal_steps.size(),
                      " journal records verify\n");
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

Answer DigestStateDir(const std::string& state_dir, const std::string& session_id, const session::SpecLimits& limits) {
  absl::StatusOr<std::vector<std::string>> names;
  if (session_id.empty()) {
    names = SessionFolderNames(state_dir);
  } else if (absl::Status id = durability::CheckSessionId(session_id, "SESSION"); !id.ok()) {
    return ErrorAnswer(id);
  } else if (!durability::Env::Default()->IsDirectory(absl::StrCat(state_dir, "/", session_id))) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("no session '", session_id, "' in ", state_dir)));
  } else {
    names = std::vector<std::string>{session_id};
  }
  if (!names.ok()) return ErrorAnswer(names.status());
  // The daemon's own restore of each folder (session::LoadSession: the checkpoint, then the journal's
  // steps replayed on top), on a CPU backend of one thread, and the digest the daemon would answer.
  absl::StatusOr<kernels::BackendSelection> backend = kernels::CreateBackend("cpu", 0, 1);
  if (!backend.ok()) return ErrorAnswer(backend.status());
  const rpc::ProtoSpecCodec codec;
  Answer answer = StateDirAnswer(state_dir);
  int failed = 0;
  for (const std::string& name : *names) {
    const std::string dir = absl::StrCat(state_dir, "/", name);
    if (!HasCheckpoint(dir)) {
      answer.json["sessions"].push_back({{"folder", name}, {"digest", nullptr}, {"note", "no checkpoint"}});
      absl::StrAppend(&answer.text, name, ": no checkpoint (the session never received its parameters)\n");
      continue;
    }
    absl::StatusOr<session::LoadedSession> loaded =
        session::LoadSession(OptionsFor(state_dir), dir, backend->backend.get(), codec, limits);
    absl::StatusOr<session::StateDigest> digest =
        loaded.ok() ? session::DigestSession(*loaded->session) : absl::StatusOr<session::StateDigest>(loaded.status());
    if (!digest.ok()) {
      ++failed;
      answer.json["sessions"].push_back({{"folder", name}, {"error", std::string(digest.status().message())}});
      absl::StrAppend(&answer.text, name, ": UNREADABLE: ", digest.status().message(), "\n");
      continue;
    }
    answer.json["sessions"].push_back({{"folder", name},
                                       {"session_id", loaded->session->id()},
                                       {"step", digest->step},
                                       {"algorithm", session::kStateDigestAlgorithm},
                                       {"digest", digest->hex},
                                       {"format", session::kStateDigestFormat},
                                       {"num_tensors", digest->num_tensors},
                                       {"num_bytes", digest->num_bytes},
                                       {"checkpoint_step", loaded->checkpoint_step},
                                       {"journal_steps_replayed", loaded->replayed}});
    absl::StrAppend(&answer.text, name, ": step ", digest->step, " ", session::kStateDigestAlgorithm, ":", digest->hex,
                    "\n  ", digest->num_tensors, " tensors, ", HumanBytes(static_cast<double>(digest->num_bytes)),
                    "; checkpoint at step ", loaded->checkpoint_step, ", ", loaded->replayed,
                    " journal steps replayed\n");
  }
  if (names->empty()) answer.text = absl::StrCat(state_dir, ": no sessions\n");
  if (failed > 0) answer.exit_code = kExitNo;
  return answer;
}

Answer ExportFromStateDir(const std::string& state_dir, const std::string& session_id, const std::string& to,
                          bool checkpoint_only, const session::SpecLimits& limits) {
  // The daemon's rule for session ids, which is what keeps the folder inside DIR.
  if (absl::Status id = durability::CheckSessionId(session_id, "SESSION"); !id.ok()) return ErrorAnswer(id);
  const std::string dir = state_dir + "/" + session_id;
  if (!HasCheckpoint(dir)) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("no checkpoint of session '", session_id, "' in ", state_dir)));
  }
  // What a daemon restoring DIR would hold, through its own restore (session::LoadSession: every
  // check, the journal's steps replayed on the checkpoint; with `checkpoint_only` the checkpoint
  // alone, the journal unread), on a CPU backend of one thread; written as `export` from that
  // daemon writes it.
  absl::StatusOr<kernels::BackendSelection> backend = kernels::CreateBackend("cpu", 0, 1);
  if (!backend.ok()) return ErrorAnswer(backend.status());
  durability::StateDirOptions options = OptionsFor(state_dir);
  options.read_journal = !checkpoint_only;
  absl::StatusOr<session::LoadedSession> loaded =
      session::LoadSession(options, dir, backend->backend.get(), rpc::ProtoSpecCodec(), limits);
  if (!loaded.ok()) return ErrorAnswer(loaded.status());
  absl::StatusOr<session::SessionState> state = loaded->session->ExportState();
  if (!state.ok()) return ErrorAnswer(state.status());
  const durability::CheckpointData data = session::CheckpointOf(*loaded->session, *std::move(state), "export");
  const std::string bytes = durability::EncodeSafetensors(data);
  if (absl::Status written = durability::WriteFileAtomically(durability::Env::Default(), to, bytes); !written.ok()) {
    return ErrorAnswer(absl::InvalidArgumentError(absl::StrCat("--to: ", written.message())));
  }
  Answer answer;
  answer.json = {{"session_id", session_id},
                 {"step", data.last_step},
                 {"file", to},
                 {"tensors", data.tensors.size()},
                 {"bytes", bytes.size()},
                 {"source", checkpoint_only ? "checkpoint" : "state_dir"},
                 {"checkpoint_step", loaded->checkpoint_step},
                 {"journal_steps_replayed", loaded->replayed}};
  const std::string journal =
      checkpoint_only ? "journal not read" : absl::StrCat(loaded->replayed, " journal steps replayed");
  answer.text = absl::StrCat("session ", session_id, " at step ", data.last_step, " (checkpoint at step ",
                             loaded->checkpoint_step, ", ", journal, "): ", data.tensors.size(), " tensors (",
                             HumanBytes(static_cast<double>(bytes.size())), ") written to ", to, "\n");
  return answer;
}

}  // namespace muond::ctl
