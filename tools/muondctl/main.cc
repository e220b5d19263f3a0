// muondctl: the operator's command-line tool for muond. Parses the command line (CLI11) and runs one
// command: daemon_commands.h (health, info, sessions, export over gRPC), top_command.h (a live view)
// or state_commands.h (offline reading of a --state-dir). Output and exit codes: ctl_output.h.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>

#include "CLI/CLI.hpp"
#include "common/config.h"
#include "kernels/cpu/blas_kernel.h"
#include "tools/muondctl/ctl_output.h"
#include "tools/muondctl/daemon_commands.h"
#include "tools/muondctl/state_commands.h"
#include "tools/muondctl/top_command.h"

namespace muond::ctl {
namespace {

// The daemon's flags that bound what a spec may ask for, on a command that restores a state directory
// offline: a session the daemon created under raised limits is restored only under the same ones.
void AddRestoreLimits(CLI::App* command, session::SpecLimits& limits) {
  command
      ->add_option("--max-tensor-rank", limits.max_rank,
                   "The daemon's --max-tensor-rank: the most dimensions a restored parameter may have")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  command
      ->add_option("--max-tensor-elements", limits.max_tensor_elements,
                   "The daemon's --max-tensor-elements: the most elements a restored parameter may have")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

int Run(int argc, char** argv) {
  CLI::App app{
      "muondctl — inspect and operate muond daemons, and read their state directories offline.\n"
      "Exit codes: 0 done, 1 no (refused, not serving, verify failed), 2 usage, 3 daemon unreachable, "
      "4 not found, 5 not allowed."};
  app.set_version_flag("--version", std::string("muondctl ") + MUOND_VERSION);
  app.require_subcommand(1);
  // Global options are taken after the subcommand too (`muondctl health --endpoint h:p`), as
  // kubectl and docker take them; every subcommand inherits this.
  app.fallthrough();

  ConnectFlags connect;
  if (const char* endpoint = std::getenv("MUOND_ENDPOINT"); endpoint != nullptr && *endpoint != '\0') {
    connect.endpoint = endpoint;  // set but empty: unset
  }
  bool json = false;
  app.add_flag("--json", json, "Print one JSON document instead of text");
  app.add_option("--endpoint,-e", connect.endpoint, "The daemon, host:port ($MUOND_ENDPOINT)")->capture_default_str();
  app.add_option("--timeout", connect.timeout_seconds,
                 "Seconds to connect (and for health); other calls get at least 10 minutes")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // Written so that NaN fails too (every comparison with it is false).
            const double seconds = std::strtod(text.c_str(), nullptr);
            return seconds >= 0.001 && seconds <= 86400 ? "" : "must be between 0.001 and 86400 seconds";
          },
          "SECONDS"))
      ->capture_default_str();
  app.add_flag("--tls", connect.use_tls, "Use TLS with the system's roots (implied by the --tls-* files)");
  app.add_option("--tls-ca-file", connect.tls_ca_file, "PEM roots that verify the daemon")->check(CLI::ExistingFile);
  app.add_option("--tls-client-cert-file", connect.tls_client_cert_file, "PEM client certificate (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-client-key-file", connect.tls_client_key_file, "PEM key of --tls-client-cert-file")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-server-name", connect.tls_server_name, "Verify the daemon's certificate against this name");
  app.add_option(
         "--auth-token-file", connect.auth_token_file,
         "File holding the bearer token: its first line that is not blank or a # comment (default: $MUOND_AUTH_TOKEN)")
      ->check(CLI::ExistingFile);

  std::function<Answer()> command;
  app.add_subcommand("health", "grpc.health.v1 check: exit 0 when SERVING, 1 when NOT_SERVING, 3 unreachable")
      ->callback([&] { command = [&] { return Health(connect); }; });
  app.add_subcommand("info", "The daemon's version, backend, limits, durability, transports and metrics address")
      ->callback([&] { command = [&] { return Info(connect); }; });

  CLI::App* sessions = app.add_subcommand("sessions", "The daemon's sessions");
  sessions->require_subcommand(1);
  std::string session_id;
  sessions->add_subcommand("list", "Every session the caller may see")->callback([&] {
    command = [&] { return ListSessions(connect); };
  });
  CLI::App* show = sessions->add_subcommand("show", "One session: counters, memory, groups and parameters");
  show->add_option("SESSION", session_id, "Session id")->required();
  show->callback([&] { command = [&] { return ShowSession(connect, session_id); }; });
  CLI::App* checkpoint = sessions->add_subcommand("checkpoint", "Write a checkpoint now (needs --state-dir)");
  checkpoint->add_option("SESSION", session_id, "Session id")->required();
  checkpoint->callback([&] { command = [&] { return CheckpointSession(connect, session_id); }; });
  CLI::App* digest = sessions->add_subcommand("digest", "The digest of a session's whole state: its step and SHA-256");
  digest->add_option("SESSION", session_id, "Session id")->required();
  digest->callback([&] { command = [&] { return DigestSession(connect, session_id); }; });
  CLI::App* close = sessions->add_subcommand("close", "Close a session: its state and its files are dropped");
  close->add_option("SESSION", session_id, "Session id")->required();
  close->callback([&] { command = [&] { return CloseSession(connect, session_id); }; });

  TopFlags top_flags;
  CLI::App* top = app.add_subcommand(
      "top",
      "A live view of the daemon's sessions and groups, refreshed until q or Ctrl-C (plain lines when "
      "stdout is not a terminal); exit 3 when the daemon goes away");
  top->add_option("--interval", top_flags.interval_seconds, "Seconds between refreshes")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  top->add_option("--iterations,-n", top_flags.iterations, "Stop after this many refreshes (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  top->callback([&] { command = [&] { return Top(connect, top_flags); }; });

  session::SpecLimits restore_limits;  // the daemon's defaults unless given
  std::string export_to;
  std::string export_state_dir;
  bool export_checkpoint_only = false;
  CLI::App* exporter = app.add_subcommand(
      "export",
      "Write a session's state (masters and every optimizer slot) to a safetensors file: from the daemon, "
      "or without one from --state-dir, as a daemon restoring it would hold it (checkpoint and journal)");
  exporter->add_option("SESSION", session_id, "Session id")->required();
  exporter->add_option("--to", export_to, "The .safetensors file to write")->required();
  CLI::Option* from_state_dir =
      exporter->add_option("--state-dir", export_state_dir, "Restore the session from this state directory instead")
          ->check(CLI::ExistingDirectory);
  exporter
      ->add_flag("--checkpoint-only", export_checkpoint_only,
                 "With --state-dir: the last checkpoint alone, the journal neither read nor replayed")
      ->needs(from_state_dir);
  AddRestoreLimits(exporter, restore_limits);
  exporter->callback([&] {
    command = [&] {
      return export_state_dir.empty()
                 ? ExportSession(connect, session_id, export_to)
                 : ExportFromStateDir(export_state_dir, session_id, export_to, export_checkpoint_only, restore_limits);
    };
  });

  std::string state_dir;
  CLI::App* state = app.add_subcommand("state", "Read a --state-dir offline (no daemon needed; nothing is written)");
  state->require_subcommand(1);
  CLI::App* inspect = state->add_subcommand("inspect", "Sessions, checkpoint steps, digests and journal records");
  inspect->add_option("DIR", state_dir, "The state directory")->required();
  AddRestoreLimits(inspect, restore_limits);
  inspect->callback([&] { command = [&] { return InspectState(state_dir, restore_limits); }; });
  CLI::App* verify = state->add_subcommand("verify", "Check every digest and journal record; exit 1 on any problem");
  verify->add_option("DIR", state_dir, "The state directory")->required();
  AddRestoreLimits(verify, restore_limits);
  verify->callback([&] { command = [&] { return VerifyState(state_dir, restore_limits); }; });

  CLI::App* state_digest = state->add_subcommand(
      "digest", "Each session's state digest as a daemon restoring DIR would answer it (checkpoint + journal)");
  state_digest->add_option("DIR", state_dir, "The state directory")->required();
  AddRestoreLimits(state_digest, restore_limits);
  std::string digest_session;
  state_digest->add_option("SESSION", digest_session, "Only this session");
  state_digest->callback([&] { command = [&] { return DigestStateDir(state_dir, digest_session, restore_limits); }; });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // With --json anywhere, a usage error is a JSON document too (help and --version are text).
    const bool wants_json =
        std::any_of(argv + 1, argv + argc, [](const char* arg) { return std::string_view(arg) == "--json"; });
    if (wants_json && e.get_exit_code() != 0) return Print(ErrorAnswer(absl::InvalidArgumentError(e.what())), true);
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  return Print(command(), json);
}

}  // namespace
}  // namespace muond::ctl

int main(int argc, char** argv) {
  // Offline restores replay steps on a CPU backend: on the daemon's OpenBLAS kernels, so that they sum
  // as it did (kernels/cpu/blas_kernel.h). A note would only clutter the output; the daemon logs one.
  muond::kernels::StartOnTheBestBlasKernel(argv);
  return muond::ctl::Run(argc, argv);
}
