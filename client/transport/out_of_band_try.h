// What the out-of-band step transports (shared memory, CUDA IPC) share about one try: the
// reference to a tensor's slot in a request, and how a failed try is read: whether the
// daemon lost what the transport registered — UNAVAILABLE (a restart may have lost it) or
// REGION_NOT_FOUND — and the status the try returns: REGION_NOT_FOUND becomes UNAVAILABLE, so the
// session tries again and the transport registers anew. Stateless.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/error_reason.h"
#include "muond/v1/muond.pb.h"

namespace muond::client {

// Adds a reference to `numel` elements of `dtype` at `offset` of region `region` to `refs`.
inline v1::SharedTensor* AddReference(google::protobuf::RepeatedPtrField<v1::SharedTensor>* refs,
                                      const std::string& name, const std::string& region, uint64_t offset,
                                      uint64_t byte_size, v1::DType dtype) {
  v1::SharedTensor* ref = refs->Add();
  ref->set_name(name);
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(byte_size);
  ref->set_dtype(dtype);
  return ref;
}

struct FailedTry {
  bool registration_lost = false;
  absl::Status status;
};

// `what` names the registration in the message ("region", "CUDA memory").
inline FailedTry ReadFailedTry(const absl::Status& status, std::string_view what) {
  if (ReasonOf(status) == v1::REGION_NOT_FOUND) {
    return {true, absl::UnavailableError(absl::StrCat("the daemon lost this session's ", std::string(what),
                                                      " (restarted?): ", status.message()))};
  }
  return {status.code() == absl::StatusCode::kUnavailable, status};
}

}  // namespace muond::client
