// Moving one tensor between device memory a GPU transport received or will send (peer memory, a
// NCCL buffer) and a step: the part CUDA IPC and NCCL share.
//
// TakeDeviceGradient puts parameter `index`'s gradient — `bytes` bytes of `dtype` at device address
// `src`, the step's rank's part of a partitioned parameter — into `step`: straight into its backend
// buffer when the step takes device gradients and this is the whole tensor (GoesToDevice: fp32
// copied, 16-bit widened, on the device; the session sums its squares there), else copied to the
// host and decoded there with its sum of squares, exactly as the host transports decode theirs
// (several ranks, parts, a journal, a zero count). PutDeviceParameter writes an answer's values, encoded in `dtype` on
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

// Whether parameter `index`'s gradient goes straight into the step's backend buffer: the step takes
// device gradients and its rank sends the whole tensor (a part is assembled on the host).
bool GoesToDevice(session::IncomingStep& step, size_t index);

// The elements of parameter `index` the step's rank sends and gets back (its part, or the whole).
size_t RankElements(const session::IncomingStep& step, size_t index);

absl::Status TakeDeviceGradient(kernels::Backend& backend, session::IncomingStep& step, size_t index, v1::DType dtype,
                                const void* src, uint64_t bytes, std::string& host_bytes);

absl::Status PutDeviceParameter(kernels::Backend& backend, std::span<const float> values, v1::DType dtype, void* dst,
                                std::string& host_bytes);

// The storage format of a wire dtype (for Widen).
kernels::StorageDtype StorageOf(v1::DType dtype);

}  // namespace muond::transport
