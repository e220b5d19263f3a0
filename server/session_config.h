// SessionConfig: a validated, typed view of a v1::SessionSpec — the parameters with their element
// counts and group, and each group's optimizer options with defaults filled in. Built once when a
// session is created; immutable afterwards, so it may be read from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/optim/options.h"
#include "kernels/optim/param_state.h"
#include "muond/v1/muond.pb.h"

namespace muond::server {

// Bounds on what one session may ask for; requests beyond them are refused at creation.
struct SpecLimits {
  int max_rank = 8;
  int64_t max_tensor_elements = int64_t{1} << 32;
  int max_parameters = 100000;
  int max_world_size = 1024;
  double straggler_timeout_seconds = 120;  // how long a multi-rank step waits for its last rank
};

struct ParameterConfig {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  v1::DType wire_dtype = v1::DTYPE_FP32;
  size_t group = 0;  // index into SessionConfig::groups
  optim::QkvSplit qkv;
};

struct GroupConfig {
  std::string name;
  optim::GroupOptions options;
};

// A query/key pair of spec.qk_clip, by parameter index.
struct QkClipConfig {
  size_t query = 0;
  size_t key = 0;
  int num_heads = 0;
};

struct SessionConfig {
  std::vector<ParameterConfig> parameters;
  std::vector<GroupConfig> groups;
  int world_size = 1;
  double straggler_timeout_seconds = 120;
  v1::DType return_dtype = v1::DTYPE_FP32;
  std::vector<QkClipConfig> qk_clip;
  int64_t total_elements = 0;
  absl::flat_hash_map<std::string, size_t> parameter_index;
  absl::flat_hash_map<std::string, size_t> group_index;
};

// Validates `spec` and fills defaults. Errors are INVALID_ARGUMENT naming the field, for example
// "spec.parameters[2].shape: dimension 1 is 0" or "spec.groups[0].options.ns_steps must be >= 1".
absl::StatusOr<SessionConfig> ParseSessionSpec(const v1::SessionSpec& spec, const SpecLimits& limits);

// Converts one group's wire options; `field` is the path used in error messages.
absl::StatusOr<optim::GroupOptions> ParseGroupOptions(const v1::GroupOptions& options,
                                                      const std::string& field);

// OK when `requested` equals `existing`; otherwise ALREADY_EXISTS naming the first difference.
absl::Status CheckSameSpec(const v1::SessionSpec& existing, const v1::SessionSpec& requested);

}  // namespace muond::server
