// muondctl's offline commands: they read a daemon's --state-dir without a daemon (stop it first, or
// read a copy) through the durability library and never write to it.
//
//   state inspect DIR   every session folder: its checkpoint (step, owner, backend, tensors, digests)
//                       and its journal (records, the steps they hold); exit 1 when one is UNREADABLE
//   state verify DIR    the daemon's own restore of each folder (session::LoadSession, on a CPU
//                       backend, nothing written): it passes exactly the folders a daemon with the
//                       same limits restores; exit 1 naming each problem
//   state digest DIR [SESSION]   the state digest of each session (or the one named) as the daemon
//                       would answer it after restoring the folder: its checkpoint with the journal's
//                       steps replayed on top (session::LoadSession on a CPU backend, then
//                       session::DigestSession); exit 1 when a folder cannot be restored
//   export SESSION --state-dir DIR --to FILE   the session as a daemon restoring DIR would hold it
//                       (session::LoadSession: its checkpoint, the journal's steps replayed, every
//                       check of a restore), written as `export` from that daemon writes it; SESSION
//                       checked with the daemon's rule for session ids, so the folder is inside DIR;
//                       --checkpoint-only: the checkpoint alone (no replay; a damaged journal unread)
// Each restores with `limits`: the daemon's spec limits, its --max-tensor-rank and
// --max-tensor-elements as muondctl's flags of those names give them (a session created under raised
// limits is refused under the defaults, as by a daemon started without them).
#pragma once

#include <string>

#include "server/session/session_config.h"
#include "tools/muondctl/ctl_output.h"

namespace muond::ctl {

Answer InspectState(const std::string& state_dir, const session::SpecLimits& limits);
Answer VerifyState(const std::string& state_dir, const session::SpecLimits& limits);
// `session_id` empty: every session folder.
Answer DigestStateDir(const std::string& state_dir, const std::string& session_id, const session::SpecLimits& limits);
// `checkpoint_only`: the folder's checkpoint alone, its journal neither read nor replayed.
Answer ExportFromStateDir(const std::string& state_dir, const std::string& session_id, const std::string& to,
                          bool checkpoint_only, const session::SpecLimits& limits);

}  // namespace muond::ctl
