// Backend's defaults: synchronous pipelined transfers, for backends whose memory is the host's (the
// CPU backend), where there is nothing to overlap; per-tensor sums of squares; normalization and
// NorMuon's scales computed on the host; byte copies with memcpy. The refusals of the GPU
// transports are PeerPrimitives' (peer_primitives.cc).
#include "kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/elementwise.h"

namespace muond::kernels {
namespace {

class SynchronousHostToDevice final : public HostToDevice {
 public:
  explicit SynchronousHostToDevice(Backend* backend) : backend_(backend) {}
  absl::Status Enqueue(const float* host, float* device, size_t count) override {
    return backend_->CopyToDevice(host, device, count);
  }
  absl::Status Wait() override { return absl::OkStatus(); }

 private:
  Backend* backend_;
};

class SynchronousDeviceToHost final : public DeviceToHost {
 public:
  explicit SynchronousDeviceToHost(Backend* backend) : backend_(backend) {}
  absl::Status Enqueue(const float* device, float* host, size_t count) override {
    return backend_->CopyToHost(device, host, count);
  }
  absl::Status Wait() override { return absl::OkStatus(); }

 private:
  Backend* backend_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostToDevice>> Backend::NewHostToDevice() {
  return std::make_unique<SynchronousHostToDevice>(this);
}

absl::StatusOr<std::unique_ptr<DeviceToHost>> Backend::NewDeviceToHost() {
  return std::make_unique<SynchronousDeviceToHost>(this);
}

absl::Status Backend::SumSquaresEach(std::span<const Slice> tensors, double* sums) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    absl::Status status = SumSquares(tensors[i].data, tensors[i].count, 1, &sums[i]);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status Backend::NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                       double* sums) {
  if (batch == 0) return absl::OkStatus();
  std::vector<double> host_sums(batch);
  absl::Status status = SumSquares(x, count, batch, host_sums.data());
  if (!status.ok()) return status;
  std::vector<float> scales(batch);
  for (size_t i = 0; i < batch; ++i) scales[i] = InverseNormScale(host_sums[i], eps, norm_safety);
  status = ScaleBatched(x, count, batch, scales.data());
  if (!status.ok() || sums == nullptr) return status;
  return CopyBytes(host_sums.data(), sums, batch * sizeof(double));
}

absl::Status Backend::SumSquaresTo(const float* x, size_t count, size_t batch, double* sums) {
  if (batch == 0) return absl::OkStatus();
  std::vector<double> host_sums(batch);
  absl::Status status = SumSquares(x, count, batch, host_sums.data());
  if (!status.ok()) return status;
  return CopyBytes(host_sums.data(), sums, batch * sizeof(double));
}

absl::Status Backend::ScaleBatchedBy(float* x, size_t count, size_t batch, const float* scales) {
  if (batch == 0) return absl::OkStatus();
  std::vector<float> host_scales(batch);
  absl::Status status = CopyBytes(scales, host_scales.data(), batch * sizeof(float));
  if (!status.ok()) return status;
  return ScaleBatched(x, count, batch, host_scales.data());
}

absl::Status Backend::NormuonScales(const NormuonArgs& args, const double* line_sums, StoredRef moment2, float* scales,
                                    size_t length) {
  if (!HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("NormuonScales: the ", Name(), " backend has no implementation"));
  }
  if (length == 0) return absl::OkStatus();
  std::vector<float> moment(length);
  absl::Status status = Widen(moment2.dtype, moment2.data, moment.data(), length);
  if (!status.ok()) return status;
  std::vector<double> line_scales(length);
  double norm2 = 0, scaled_norm2 = 0;
  for (size_t j = 0; j < length; ++j) {
    const double sum = line_sums[j];
    moment[j] = NormuonMoment(sum, static_cast<double>(args.count), args.weight, moment[j]);
    line_scales[j] = NormuonLineScale(moment[j], args.eps);
    norm2 += sum;
    scaled_norm2 += line_scales[j] * line_scales[j] * sum;
  }
  const double ratio = scaled_norm2 > 0 ? std::sqrt(norm2 / scaled_norm2) : 0.0;
  for (size_t j = 0; j < length; ++j) scales[j] = static_cast<float>(line_scales[j] * ratio);
  return Narrow(moment2.dtype, moment.data(), moment2.data, length);
}

absl::Status Backend::SumAbs(const float* x, size_t count, size_t batch, double* sums) {
  if (!HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("SumAbs: the ", Name(), " backend has no implementation"));
  }
  for (size_t b = 0; b < batch; ++b) {
    double acc = 0;
    for (size_t i = 0; i < count; ++i) acc += std::abs(static_cast<double>(x[b * count + i]));
    sums[b] = acc;
  }
  return absl::OkStatus();
}

absl::Status Backend::Dot(const float* x, const float* y, size_t count, double* dot) {
  *dot = 0;
  if (count == 0) return absl::OkStatus();
  auto sum_buffer = Allocate(count);
  if (!sum_buffer.ok()) return sum_buffer.status();
  float* sum = (*sum_buffer)->data();
  absl::Status status = CopyOnDevice(y, sum, count);
  if (status.ok()) status = Axpby(1.0f, x, 1.0f, sum, count);
  double squares[3] = {0, 0, 0};  // |x + y|², |x|², |y|²
  if (status.ok()) status = SumSquares(sum, count, 1, &squares[0]);
  if (status.ok()) status = SumSquares(x, count, 1, &squares[1]);
  if (status.ok()) status = SumSquares(y, count, 1, &squares[2]);
  if (!status.ok()) return status;
  *dot = 0.5 * (squares[0] - squares[1] - squares[2]);
  return absl::OkStatus();
}

absl::Status Backend::NamoScales(const NamoArgs& args, const double* grad_sums, const double* update_sums,
                                 StoredRef moment2, float* scales, size_t lines) {
  if (!HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("NamoScales: the ", Name(), " backend has no implementation"));
  }
  if (lines == 0) return absl::OkStatus();
  std::vector<float> moment(lines);
  absl::Status status = Widen(moment2.dtype, moment2.data, moment.data(), lines);
  if (!status.ok()) return status;
  std::vector<double> line_scales(lines);
  double total = 0;
  for (size_t j = 0; j < lines; ++j) {
    moment[j] = NormuonMoment(grad_sums[j], 1.0, args.weight, moment[j]);
    line_scales[j] = NamoLineScale(args, update_sums[j], moment[j]);
    total += line_scales[j];
  }
  const double mean = total / static_cast<double>(lines);
  for (size_t j = 0; j < lines; ++j) scales[j] = static_cast<float>(NamoClamped(line_scales[j], mean, args.clamp));
  return Narrow(moment2.dtype, moment.data(), moment2.data, lines);
}

absl::Status Backend::InverseRootScales(const double* sums, float* scales, size_t length, double eps) {
  if (!HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("InverseRootScales: the ", Name(), " backend has no implementation"));
  }
  for (size_t j = 0; j < length; ++j) scales[j] = static_cast<float>(1.0 / std::sqrt(sums[j] + eps));
  return absl::OkStatus();
}

absl::Status Backend::AolScales(const float* gram, int64_t m, int64_t batch, double floor, float* scales) {
  if (!HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("AolScales: the ", Name(), " backend has no implementation"));
  }
  for (int64_t row = 0; row < m * batch; ++row) {
    double sum = 0;
    for (int64_t j = 0; j < m; ++j) sum += std::abs(static_cast<double>(gram[row * m + j]));
    scales[row] = static_cast<float>(1.0 / std::sqrt(std::max(sum, floor)));
  }
  return absl::OkStatus();
}

absl::Status Backend::AddToDiagonal(float*, int64_t, int64_t, float) {
  return absl::UnimplementedError(absl::StrCat("AddToDiagonal: the ", Name(), " backend has no implementation"));
}

absl::Status Backend::CopyBytes(const void* src, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace muond::kernels
