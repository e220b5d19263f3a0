// Moving one tensor between device memory a GPU transport received or will send (peer memory, a
// NCCL buffer) and a step: the part CUDA IPC and NCCL share.
//
// TakeDeviceGradient puts parameter `index`'s gradient — `bytes` bytes of `dtype` at device address
// `src` — into `step`: straight into its backend buffer when the step takes device gradients (fp32
// copied, 16-bit widened, on the device; the session sums its squares there), else copied to the host
// and decoded there with its sum of squares, exactly as the host transports decode theirs (several
// ranks, a journal, a zero count). PutDeviceParameter writes an answer's values, encoded in `dtype` on
// the host, to device address `dst`. `host_bytes` is the caller's scratch, reused across tensors.
//
// Both run on the caller's thread; the copies are complete when they return, except the device path
// of TakeDeviceGradient, whose copy is ordered before the backend's later work.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "muond/v1/muond.pb.h"
#include "server/session/incoming_step.h"

namespace muond::transport {

absl::Status TakeDeviceGradient(kernels::Backend& backend, session::IncomingStep& step, size_t index, v1::DType dtype,
                                const void* src, uint64_t bytes, std::string& host_bytes);

absl::Status PutDeviceParameter(kernels::Backend& backend, std::span<const float> values, v1::DType dtype, void* dst,
                                std::string& host_bytes);

// The storage format of a wire dtype (for Widen).
kernels::StorageDtype StorageOf(v1::DType dtype);

}  // namespace muond::transport
