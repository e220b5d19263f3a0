// The byte format of request_fuzzer's inputs: a script of RPCs against one daemon.
//
// An input is a sequence of records: an op byte, a 16-bit little-endian payload length, then the
// payload. The op (taken modulo kNumOps) says what to do; where an op sends a request, its payload is
// that request in protobuf wire format, so the fuzzer mutates exactly the bytes a client controls.
// A stream (upload, step, set-state) is opened by its Begin op, fed by kMessage records and ended by
// kFinish, by kCancel (the client cancels mid-stream) or by the next op of any other kind. A record
// cut short by the end of the input keeps the bytes that are there.
//
// ScriptReader splits an input into records; ScriptWriter builds inputs (the seed corpus).
// Header-only; no shared state.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"

namespace muond::fuzz {

enum class Op : uint8_t {
  kCreateSession = 0,  // payload: CreateSessionRequest
  kCloseSession,       // payload: CloseSessionRequest
  kListSessions,       // payload: ListSessionsRequest (empty: the first page)
  kGetServerInfo,      // no payload
  kGetParameters,      // payload: GetParametersRequest
  kGetState,           // payload: GetStateRequest
  kBeginUpload,        // opens an UploadParameters stream
  kBeginStep,          // opens a Step stream
  kBeginSetState,      // opens a SetState stream
  kMessage,            // payload: the next request of the open stream (ignored with none open)
  kCancel,             // cancels the open stream before its end
  kFinish,             // half-closes the open stream and reads the answer
  kCheckpoint,         // payload: CheckpointRequest
  kGetStateDigest,     // payload: GetStateDigestRequest
  kStepWhole,          // payload: StepMessages (a whole step in one call)
  kNumOps,
};

struct Record {
  Op op;
  absl::string_view payload;
};

class ScriptReader {
 public:
  ScriptReader(const uint8_t* data, size_t size) : data_(reinterpret_cast<const char*>(data)), size_(size) {}

  std::optional<Record> Next() {
    if (pos_ >= size_) return std::nullopt;
    const Op op = static_cast<Op>(static_cast<uint8_t>(data_[pos_++]) % static_cast<uint8_t>(Op::kNumOps));
    size_t length = 0;
    for (int i = 0; i < 2 && pos_ < size_; ++i) length |= size_t{static_cast<uint8_t>(data_[pos_++])} << (8 * i);
    length = std::min(length, size_ - pos_);
    Record record{op, absl::string_view(data_ + pos_, length)};
    pos_ += length;
    return record;
  }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

class ScriptWriter {
 public:
  ScriptWriter& Add(Op op, absl::string_view payload = {}) {
    const size_t length = std::min<size_t>(payload.size(), 0xffff);
    bytes_.push_back(static_cast<char>(op));
    bytes_.push_back(static_cast<char>(length & 0xff));
    bytes_.push_back(static_cast<char>(length >> 8));
    bytes_.append(payload.data(), length);
    return *this;
  }
  ScriptWriter& Add(Op op, const google::protobuf::MessageLite& message) {
    return Add(op, message.SerializeAsString());
  }

  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

}  // namespace muond::fuzz
