// ForwardingBackend: a Backend that hands every primitive to another one, for tests that watch
// what optimizer code asks of a backend (count GEMMs, count waits for the device) by overriding
// a few methods. A Backend method added later needs its forwarder here, or the wrapper runs
// Backend's default instead of the inner backend's. Header-only; as thread-safe as the inner
// backend; must not outlive it.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kernels/backend.h"

namespace muond::testing {

class ForwardingBackend : public kernels::Backend {
 public:
  explicit ForwardingBackend(kernels::Backend& inner) : inner_(inner) {}

  std::string Name() const override { return inner_.Name(); }
  bool HostAddressable() const override { return inner_.HostAddressable(); }
  std::string Detail() const override { return inner_.Detail(); }
  MemoryUse Memory() const override { return inner_.Memory(); }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> Allocate(size_t count) override {
    return inner_.Allocate(count);
  }
  absl::Status CopyToDevice(const float* host, float* device, size_t count) override {
    return inner_.CopyToDevice(host, device, count);
  }
  absl::Status CopyToHost(const float* device, float* host, size_t count) override {
    return inner_.CopyToHost(device, host, count);
  }
  absl::Status CopyOnDevice(const float* src, float* dst, size_t count) override {
    return inner_.CopyOnDevice(src, dst, count);
  }
  absl::Status Fill(float* x, size_t count, float value) override { return inner_.Fill(x, count, value); }
  absl::Status AddToDiagonal(float* a, int64_t m, int64_t batch, float value) override {
    return inner_.AddToDiagonal(a, m, batch, value);
  }
  absl::Status Widen(kernels::StorageDtype dtype, const void* packed, float* out, size_t count) override {
    return inner_.Widen(dtype, packed, out, count);
  }
  absl::Status Narrow(kernels::StorageDtype dtype, const float* in, void* packed, size_t count) override {
    return inner_.Narrow(dtype, in, packed, count);
  }
  absl::Status Gemm(const kernels::GemmShape& shape, float alpha, const float* a, const float* b, float beta, float* c,
                    kernels::MatmulPrecision precision) override {
    return inner_.Gemm(shape, alpha, a, b, beta, c, precision);
  }
  bool GemmMayWriteAnOperand(kernels::MatmulPrecision precision) const override {
    return inner_.GemmMayWriteAnOperand(precision);
  }
  absl::Status Transpose2D(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch) override {
    return inner_.Transpose2D(in, out, rows, cols, batch);
  }
  absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) override {
    return inner_.SumSquares(x, count, batch, sums);
  }
  absl::StatusOr<bool> AllFinite(const float* x, size_t count) override { return inner_.AllFinite(x, count); }
  absl::Status SumSquaresEach(std::span<const Slice> tensors, double* sums) override {
    return inner_.SumSquaresEach(tensors, sums);
  }
  absl::Status ScaleBatched(float* x, size_t count, size_t batch, const float* scales) override {
    return inner_.ScaleBatched(x, count, batch, scales);
  }
  absl::Status NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                double* sums) override {
    return inner_.NormalizeBatched(x, count, batch, eps, norm_safety, sums);
  }
  absl::Status SumSquaresTo(const float* x, size_t count, size_t batch, double* sums) override {
    return inner_.SumSquaresTo(x, count, batch, sums);
  }
  absl::Status ScaleBatchedBy(float* x, size_t count, size_t batch, const float* scales) override {
    return inner_.ScaleBatchedBy(x, count, batch, scales);
  }
  absl::Status NormuonScales(const NormuonArgs& args, const double* line_sums, kernels::StoredRef moment2,
                             float* scales, size_t length) override {
    return inner_.NormuonScales(args, line_sums, moment2, scales, length);
  }
  absl::Status NamoScales(const kernels::NamoArgs& args, const double* grad_sums, const double* update_sums,
                          kernels::StoredRef moment2, float* scales, size_t lines) override {
    return inner_.NamoScales(args, grad_sums, update_sums, moment2, scales, lines);
  }
  absl::Status Axpby(float alpha, kernels::StoredRef x, float beta, kernels::StoredRef y, size_t count) override {
    return inner_.Axpby(alpha, x, beta, y, count);
  }
  absl::Status Momentum(const kernels::MomentumArgs& args, kernels::StoredRef momentum, const float* grad,
                        float* update, size_t count) override {
    return inner_.Momentum(args, momentum, grad, update, count);
  }
  absl::Status AdamW(const kernels::AdamWArgs& args, kernels::StoredRef param, const float* grad,
                     kernels::StoredRef exp_avg, kernels::StoredRef exp_avg_sq, size_t count) override {
    return inner_.AdamW(args, param, grad, exp_avg, exp_avg_sq, count);
  }
  absl::Status Lion(const kernels::LionArgs& args, kernels::StoredRef param, const float* grad,
                    kernels::StoredRef exp_avg, size_t count) override {
    return inner_.Lion(args, param, grad, exp_avg, count);
  }
  absl::Status Sgd(const kernels::SgdArgs& args, kernels::StoredRef param, const float* grad,
                   kernels::StoredRef momentum_buffer, size_t count) override {
    return inner_.Sgd(args, param, grad, momentum_buffer, count);
  }
  absl::Status Adamuon(const kernels::AdamuonArgs& args, kernels::StoredRef moment2, float* update,
                       size_t count) override {
    return inner_.Adamuon(args, moment2, update, count);
  }
  absl::Status CautiousUpdate(const kernels::CautiousArgs& args, const float* update, kernels::StoredRef param,
                              size_t count) override {
    return inner_.CautiousUpdate(args, update, param, count);
  }
  absl::Status CopyBytes(const void* src, void* dst, size_t bytes) override {
    return inner_.CopyBytes(src, dst, bytes);
  }
  absl::Status Synchronize() override { return inner_.Synchronize(); }

 private:
  kernels::Backend& inner_;
};

}  // namespace muond::testing
