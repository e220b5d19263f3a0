// What `muondctl sessions show` prints of a session's groups in its last applied step: clipping,
// telemetry and the health warnings that step raised (docs/algorithms.md, Telemetry). Stateless
// functions over a SessionSummary.
#pragma once

#include <string>

#include "muond/v1/muond.pb.h"
#include "nlohmann/json.hpp"

namespace muond::ctl {

// {"step": N, "groups": [{"group", "grad_norm", "clip_coefficient", "update_rms", ...}]}; a figure
// not measured is null.
nlohmann::ordered_json GroupHealthJson(const v1::SessionSummary& summary);
// One line per group under a header, or a line saying no step has been applied.
std::string GroupHealthText(const v1::SessionSummary& summary);

}  // namespace muond::ctl
