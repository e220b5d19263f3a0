// muondctl's offline commands: they read a daemon's --state-dir without a daemon (stop it first, or
// read a copy) through the durability library alone, and never write to it.
//
//   state inspect DIR   every session folder: its checkpoint (step, owner, backend, tensors, digests)
//                       and its journal (records, the steps they hold)
//   state verify DIR    the same reading, as a check: every digest and record verifies and every
//                       journal continues its checkpoint step by step; exit 1 naming each problem
//   export SESSION --state-dir DIR --to FILE   a session's checkpoint as a safetensors file
#pragma once

#include <string>

#include "tools/muondctl/ctl_output.h"

namespace muond::ctl {

Answer InspectState(const std::string& state_dir);
Answer VerifyState(const std::string& state_dir);
Answer ExportFromStateDir(const std::string& state_dir, const std::string& session_id, const std::string& to);

}  // namespace muond::ctl
