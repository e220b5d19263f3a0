// Conversions of whole ranges between fp32 and the 16-bit formats (bf16, IEEE fp16) on the host: bit
// for bit those of common/half_float.h, which the CUDA kernels use (the same rounding to nearest
// even, quiet NaNs, fp16 overflow to ±inf and subnormals), written without branches so that the
// compiler vectorizes them, for AVX2 where the CPU has it (rounding to fp16 takes F16C's instruction
// there, with GCC on x86-64, its NaNs made the scalar ones). The CPU backend widens and rounds its
// 16-bit optimizer state through these, and the wire codec (proto/wire/dtype_codec.h) 16-bit
// gradients and answers; checkpoints, state digests and a device's 16-bit state read to the host
// (optim::ReadStored, WriteStored) theirs. Its own library (muond_half_ranges, no dependencies),
// which the C++ client links through the codec. Stateless; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace muond {

void WidenBf16(const uint16_t* in, float* out, size_t count);
void WidenFp16(const uint16_t* in, float* out, size_t count);
void NarrowToBf16(const float* in, uint16_t* out, size_t count);
void NarrowToFp16(const float* in, uint16_t* out, size_t count);

// The same for 16-bit elements stored (little-endian, as on x86-64) at any byte address, e.g. a
// tensor's bytes in a file or the halves of fp32 words: they go through an aligned block of words
// at a time, never addressed as uint16_t where they lie.
enum class HalfFormat { kBf16, kFp16 };
void WidenHalfBytes(HalfFormat format, const void* in, float* out, size_t count);
void NarrowToHalfBytes(HalfFormat format, const float* in, void* out, size_t count);

}  // namespace muond
