// Where a step's or a read's parameters land on the client: the caller's own span when it gave one
// (StepOptions::parameters_out), else a vector of the answer's ParameterMap; and the decoding of
// one answer chunk into it. Shared by the gRPC and shared-memory transports and by
// Session::GetParameters. Stateless.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/muond_client.h"

namespace muond::client {

using OutputSpans = std::map<std::string, std::span<float>>;

// Where parameter `name`'s `numel` values go: the caller's span in `into`, or a vector of `out`.
absl::StatusOr<std::span<float>> Destination(const std::string& name, int64_t numel, const OutputSpans& into,
                                             ParameterMap* out);

// Decodes one answer chunk — `meta` naming it, its payload in `pieces` (`bytes` in all) — into its
// destination, sized from `numel` (per parameter, from the spec).
absl::Status ReadChunk(const v1::TensorChunk& meta, std::span<const absl::string_view> pieces, size_t bytes,
                       const std::map<std::string, int64_t>& numel, const OutputSpans& into, ParameterMap* out);
absl::Status ReadChunk(const v1::TensorChunk& chunk, const std::map<std::string, int64_t>& numel,
                       const OutputSpans& into, ParameterMap* out);

}  // namespace muond::client
