// The range conversions of common/half_ranges.h against the scalar ones of
// common/half_float.h, which the CUDA kernels and the wire codec use: bit for bit, for every 16-bit
// value and for fp32 values sweeping every exponent, sign and NaN payload class, at every length and
// alignment the vector loops split at. A GCC build on an x86-64 CPU with F16C tests the F16C rounding
// to fp16; the sanitized (clang) build tests the portable one.
#include "common/half_ranges.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/half_float.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

std::vector<uint32_t> FloatBitPatterns() {
  std::vector<uint32_t> bits;
  // Every 65537th pattern (every exponent and both signs, payloads spread), then, around each
  // boundary a case turns at, every pattern within 4096 of it.
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65537) bits.push_back(static_cast<uint32_t>(b));
  const uint32_t edges[] = {0x00000000u, 0x00800000u, 0x33000000u, 0x33800000u, 0x38800000u, 0x387fe000u,
                            0x477fe000u, 0x477ff000u, 0x47800000u, 0x7f7fffffu, 0x7f800000u, 0x7fc00000u,
                            0x7fffffffu, 0x3f800000u, 0x3f808000u, 0x3f818000u};
  for (uint32_t edge : edges) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (int64_t d = -4096; d <= 4096; ++d) {
        const int64_t b = static_cast<int64_t>(edge) + d;
        if (b >= 0 && b <= 0x7fffffff) bits.push_back(static_cast<uint32_t>(b) | sign);
      }
    }
  }
  return bits;
}

std::vector<float> FloatsOf(const std::vector<uint32_t>& bits) {
  std::vector<float> values;
  for (uint32_t b : bits) values.push_back(BitsFloat(b));
  return values;
}

TEST(HalfRangesTest, NarrowingMatchesTheScalarConversionBitForBit) {
  const std::vector<uint32_t> bits = FloatBitPatterns();
  const std::vector<float> values = FloatsOf(bits);
  std::vector<uint16_t> bf16(values.size()), fp16(values.size());
  NarrowToBf16(values.data(), bf16.data(), values.size());
  NarrowToFp16(values.data(), fp16.data(), values.size());
  int bad = 0;
  for (size_t i = 0; i < values.size() && bad < 10; ++i) {
    if (bf16[i] != FloatToBf16(values[i])) {
      ADD_FAILURE() << std::hex << "bf16 of 0x" << bits[i] << ": 0x" << bf16[i] << ", scalar 0x"
                    << FloatToBf16(values[i]);
      ++bad;
    }
    if (fp16[i] != FloatToFp16(values[i])) {
      ADD_FAILURE() << std::hex << "fp16 of 0x" << bits[i] << ": 0x" << fp16[i] << ", scalar 0x"
                    << FloatToFp16(values[i]);
      ++bad;
    }
  }
}

TEST(HalfRangesTest, WideningMatchesTheScalarConversionForEvery16BitValue) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> from_bf16(halves.size()), from_fp16(halves.size());
  WidenBf16(halves.data(), from_bf16.data(), halves.size());
  WidenFp16(halves.data(), from_fp16.data(), halves.size());
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(FloatBits(from_bf16[h]), FloatBits(Bf16ToFloat(static_cast<uint16_t>(h)))) << "bf16 0x" << std::hex << h;
    ASSERT_EQ(FloatBits(from_fp16[h]), FloatBits(Fp16ToFloat(static_cast<uint16_t>(h)))) << "fp16 0x" << std::hex << h;
  }
}

// Lengths and offsets around the vector widths, so that every loop's head, body and tail run, and
// nothing outside [0, count) is touched.
TEST(HalfRangesTest, EveryLengthAndOffsetConvertsItsRangeAndNothingElse) {
  std::vector<float> values(200);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.37f * static_cast<float>(i) - 11.0f;
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t count = 0; count + offset + 1 < values.size(); count += (count < 70 ? 1 : 37)) {
      std::vector<uint16_t> out(values.size(), 0xabcd);
      NarrowToFp16(values.data() + offset, out.data() + offset, count);
      std::vector<float> back(values.size(), -1.0f);
      WidenFp16(out.data() + offset, back.data() + offset, count);
      for (size_t i = 0; i < values.size(); ++i) {
        const bool inside = i >= offset && i < offset + count;
        ASSERT_EQ(out[i], inside ? FloatToFp16(values[i]) : 0xabcd) << offset << " " << count << " " << i;
        ASSERT_EQ(back[i], inside ? Fp16ToFloat(out[i]) : -1.0f) << offset << " " << count << " " << i;
      }
      NarrowToBf16(values.data() + offset, out.data() + offset, count);
      WidenBf16(out.data() + offset, back.data() + offset, count);
      for (size_t i = offset; i < offset + count; ++i) {
        ASSERT_EQ(out[i], FloatToBf16(values[i])) << offset << " " << count << " " << i;
        ASSERT_EQ(back[i], Bf16ToFloat(out[i])) << offset << " " << count << " " << i;
      }
    }
  }
}

// The byte-addressed forms convert elements at an odd byte address, across their blocks, exactly as
// the word ones, and write no byte outside the range.
TEST(HalfRangesTest, ElementsAtAnyByteAddressConvertAsTheWordOnes) {
  const size_t count = 3 * 4096 + 5;  // more than two of the blocks they go through
  std::vector<uint16_t> words(count);
  for (size_t i = 0; i < count; ++i) words[i] = static_cast<uint16_t>(i * 40503u);
  for (HalfFormat format : {HalfFormat::kBf16, HalfFormat::kFp16}) {
    SCOPED_TRACE(format == HalfFormat::kBf16 ? "bf16" : "fp16");
    std::vector<float> want(count), got(count);
    (format == HalfFormat::kBf16 ? WidenBf16 : WidenFp16)(words.data(), want.data(), count);
    std::vector<char> bytes(2 * count + 2, '\x5a');
    std::memcpy(bytes.data() + 1, words.data(), 2 * count);
    WidenHalfBytes(format, bytes.data() + 1, got.data(), count);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(FloatBits(got[i]), FloatBits(want[i])) << i;

    std::vector<uint16_t> narrowed(count);
    (format == HalfFormat::kBf16 ? NarrowToBf16 : NarrowToFp16)(want.data(), narrowed.data(), count);
    std::vector<char> out(2 * count + 2, '\x5a');
    NarrowToHalfBytes(format, want.data(), out.data() + 1, count);
    EXPECT_EQ(out.front(), '\x5a');
    EXPECT_EQ(out.back(), '\x5a');
    EXPECT_EQ(std::memcmp(out.data() + 1, narrowed.data(), 2 * count), 0);
  }
}

}  // namespace
}  // namespace muond
