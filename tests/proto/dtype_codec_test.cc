// The wire dtype codec: bf16 and fp16 conversions round to nearest even like torch, and keep the
// special values.
#include "proto/wire/dtype_codec.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace muond::wire {
namespace {

TEST(DTypeCodecTest, ElementSizes) {
  EXPECT_EQ(ElementSize(v1::DTYPE_FP32), 4u);
  EXPECT_EQ(ElementSize(v1::DTYPE_BF16), 2u);
  EXPECT_EQ(ElementSize(v1::DTYPE_FP16), 2u);
  EXPECT_EQ(ElementSize(v1::DTYPE_UNSPECIFIED), 0u);
  EXPECT_EQ(ElementSize(static_cast<v1::DType>(42)), 0u);
}

TEST(DTypeCodecTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  // 1 + 2^-8 lies halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3f80);
  // 1 + 3·2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): rounds up.
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3f82);
  EXPECT_EQ(Bf16ToFloat(0x3f82), 1.015625f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(FloatToBf16(3.4e38f), 0x7f80) << "the largest floats round up to infinity in bf16";
}

TEST(DTypeCodecTest, Fp16CoversNormalsSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.5f), 0xc100);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00) << "65520 is the first value that rounds to infinity";
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001) << "smallest subnormal";
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000) << "half of it ties to even (zero)";
  EXPECT_EQ(FloatToFp16(std::ldexp(3.0f, -25)), 0x0002) << "1.5 ulp ties to even (2)";
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -14)), 0x0400) << "smallest normal";
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00) << "a tie rounds to the even 1.0";
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::nanf("")))));
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(DTypeCodecTest, EveryHalfValueSurvivesARoundTrip) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = Fp16ToFloat(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), h) << "fp16 bits " << bits;
    ASSERT_EQ(FloatToBf16(Bf16ToFloat(h)), h) << "bf16 bits " << bits;
  }
}

TEST(DTypeCodecTest, EncodeAndDecodeRoundTrip) {
  const std::vector<float> values = {0.0f, -1.5f, 3.25f, 1e-3f, 1000.0f};
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::string bytes;
    Encode(dtype, values, &bytes);
    ASSERT_EQ(bytes.size(), values.size() * ElementSize(dtype));
    std::vector<float> decoded(values.size());
    Decode(dtype, bytes, std::span<float>(decoded));
    // Round to nearest: at most half a 16-bit ulp, i.e. the unit roundoff 2^-8 (bf16, 8 significant
    // bits) or 2^-11 (fp16) relative; 4e-3 is just above 2^-8.
    for (size_t i = 0; i < values.size(); ++i) EXPECT_NEAR(decoded[i], values[i], std::fabs(values[i]) * 4e-3);
  }
}

// An empty span may hold a null pointer; encoding or decoding nothing must not hand it to memcpy
// (undefined behaviour that UBSan stops on), in every dtype.
TEST(DTypeCodecTest, EmptySpansEncodeAndDecodeToNothing) {
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::string bytes;
    Encode(dtype, std::span<const float>(), &bytes);
    EXPECT_TRUE(bytes.empty());
    EncodeTo(dtype, std::span<const float>(), nullptr);
    Decode(dtype, absl::string_view(), std::span<float>());
  }
}

// Bytes at any address (a chunk's payload within a message) and lengths across the codec's blocks:
// every element as the scalar conversion gives it, and nothing written past the end.
TEST(DTypeCodecTest, UnalignedBytesAndLongRangesMatchTheScalarConversion) {
  std::vector<float> values(5000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.013f * static_cast<float>(i) - 31.0f;
  values[7] = std::numeric_limits<float>::quiet_NaN();
  values[4097] = 1e-7f;  // an fp16 subnormal
  values[4098] = 1e6f;   // beyond fp16
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    const bool bf16 = dtype == v1::DTYPE_BF16;
    for (size_t count : {size_t{1}, size_t{2047}, size_t{2048}, size_t{2049}, values.size()}) {
      const std::span<const float> part(values.data(), count);
      std::string bytes(1 + 2 * count + 2, '\x5a');  // one byte ahead: an odd address
      EncodeTo(dtype, part, bytes.data() + 1);
      EXPECT_EQ(bytes[0], '\x5a');
      EXPECT_EQ(bytes.substr(1 + 2 * count), std::string(2, '\x5a')) << count;
      std::vector<float> decoded(count + 1, -7.0f);
      Decode(dtype, absl::string_view(bytes).substr(1, 2 * count), std::span<float>(decoded.data(), count));
      EXPECT_EQ(decoded[count], -7.0f) << count;
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes.data() + 1 + 2 * i, 2);
        ASSERT_EQ(bits, bf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i])) << count << " " << i;
        const float want = bf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
        ASSERT_EQ(std::memcmp(&decoded[i], &want, sizeof want), 0) << count << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace muond::wire
