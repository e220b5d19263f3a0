// DecodeAll and EncodeAll: whole tensors copied out of and into shared memory over a pool's threads,
// with sums of squares whose bits depend on the values alone — not on the thread count, on how a
// tensor is split into pieces, on alignment, or on whether the copy streams around the caches.
#include "server/transport/api_codec/bulk_codec.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/compute_pool.h"
#include "gmock/gmock.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/api_codec/tensor_decode.h"

namespace muond::transport {
namespace {

constexpr size_t kFp32Segment = kSegmentBytes / 4;

// Values whose squares span much of the fp32 range, so that any change in the order of the
// additions shows in the sum's bits.
std::vector<float> SpreadValues(size_t n, float phase) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    values[i] = std::ldexp(std::sin(1.3f * static_cast<float>(i) + phase), static_cast<int>(i % 41) - 20);
  }
  return values;
}

// The definition: the payload's segments (kSegmentBytes each, as the clients' default gRPC chunks),
// each summed by DecodeSumSquares, added in order.
double SegmentedSum(v1::DType dtype, const std::string& bytes) {
  double sum = 0;
  for (size_t begin = 0; begin < bytes.size(); begin += kSegmentBytes) {
    const size_t n = std::min(kSegmentBytes, bytes.size() - begin);
    std::vector<float> out(n / wire::ElementSize(dtype));
    sum += DecodeSumSquares(dtype, absl::string_view(bytes).substr(begin, n), out);
  }
  return sum;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

// Bytes at an offset from an aligned buffer's start, as a client's region gives them.
struct Payload {
  Payload(const std::string& bytes, size_t misalign) : storage(bytes.size() + 64), at(misalign) {
    if (!bytes.empty()) std::memcpy(storage.data() + at, bytes.data(), bytes.size());
  }
  const char* data() const { return storage.data() + at; }
  std::vector<char> storage;
  size_t at;
};

TEST(BulkCodecTest, DecodedValuesAndSumsDoNotDependOnTheThreadCount) {
  // Empty, shorter than a segment, several segments and a tail; every wire dtype; misaligned sources.
  const std::vector<size_t> sizes = {0, 1, 4097, 3 * kFp32Segment + 13, 2 * kFp32Segment, 777};
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::vector<std::vector<float>> values;
    std::vector<std::string> bytes;
    std::vector<std::unique_ptr<Payload>> payloads;
    for (size_t t = 0; t < sizes.size(); ++t) {
      values.push_back(SpreadValues(sizes[t], 0.1f * static_cast<float>(t)));
      bytes.emplace_back();
      wire::Encode(dtype, values.back(), &bytes.back());
      payloads.push_back(std::make_unique<Payload>(bytes.back(), t % 4));
    }
    for (int threads : {0, 1, 2, 3, 4}) {  // 0: no pool
      std::unique_ptr<ComputePool> pool = threads > 0 ? std::make_unique<ComputePool>(threads) : nullptr;
      std::vector<std::vector<float>> out(sizes.size());
      std::vector<DecodeItem> items;
      for (size_t t = 0; t < sizes.size(); ++t) {
        out[t].assign(sizes[t], -1.0f);
        items.push_back({dtype, payloads[t]->data(), out[t]});
      }
      DecodeAll(items, pool.get());
      for (size_t t = 0; t < sizes.size(); ++t) {
        std::vector<float> expected(sizes[t]);
        wire::Decode(dtype, bytes[t], expected);
        EXPECT_EQ(out[t], expected) << "tensor " << t << " threads " << threads;
        EXPECT_TRUE(SameBits(items[t].sum_squares, SegmentedSum(dtype, bytes[t])))
            << "tensor " << t << " dtype " << static_cast<int>(dtype) << " threads " << threads;
      }
    }
  }
}

// A tensor decoded in pieces that begin at whole segments, each carrying the sum of the one before,
// sums as the whole tensor does; so does a tensor large enough to be copied with streaming stores,
// into destinations of every alignment the allocator may give.
TEST(BulkCodecTest, PiecesAndStreamingCopiesSumLikeTheWholeTensor) {
  const size_t n = 17 * kFp32Segment + 5;  // over 16 MiB: streaming stores
  const std::vector<float> values = SpreadValues(n, 0.7f);
  std::string bytes;
  wire::Encode(v1::DTYPE_FP32, values, &bytes);
  const double expected = SegmentedSum(v1::DTYPE_FP32, bytes);
  ComputePool pool(2);
  for (size_t shift : {0, 1, 4}) {  // floats: 32-, 4- and 16-byte aligned destinations
    std::vector<float> storage(n + 8);
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 31) / 32 * 32) + shift;
    std::span<float> out(base, n);
    std::vector<DecodeItem> whole = {{v1::DTYPE_FP32, bytes.data(), out}};
    DecodeAll(whole, &pool);
    EXPECT_TRUE(SameBits(whole[0].sum_squares, expected)) << shift;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), values.begin())) << shift;
  }
  std::vector<float> out(n);
  double sum = 0;
  for (size_t begin = 0; begin < n;) {
    const size_t take = std::min(n - begin, (begin / kFp32Segment % 3 + 1) * kFp32Segment);
    std::vector<DecodeItem> piece = {
        {v1::DTYPE_FP32, bytes.data() + 4 * begin, std::span<float>(out).subspan(begin, take), sum}};
    DecodeAll(piece, &pool);
    sum = piece[0].sum_squares;
    begin += take;
  }
  EXPECT_TRUE(SameBits(sum, expected));
  EXPECT_EQ(out, values);
}

TEST(BulkCodecTest, CopySumSquaresHasTheBitsOfDecodeSumSquares) {
  for (size_t n : {0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5}) {
    const std::vector<float> values = SpreadValues(n, 0.3f);
    std::string bytes;
    wire::Encode(v1::DTYPE_FP32, values, &bytes);
    std::vector<float> decoded(n);
    const double expected = DecodeSumSquares(v1::DTYPE_FP32, bytes, decoded);
    for (bool streaming : {false, true}) {
      for (size_t misalign : {0, 1, 3}) {
        const Payload payload(bytes, misalign);
        std::vector<float> out(n + 8, -1.0f);
        for (size_t shift : {0, 1, 4}) {
          std::span<float> dst(out.data() + shift, n);
          EXPECT_TRUE(SameBits(CopySumSquaresFp32(payload.data(), dst, streaming), expected)) << n;
          EXPECT_TRUE(std::equal(dst.begin(), dst.end(), values.begin())) << n;
        }
      }
    }
  }
}

TEST(BulkCodecTest, ANonFiniteValueMakesTheSumNonFinite) {
  std::vector<float> values = SpreadValues(2 * kFp32Segment, 0.2f);
  values[kFp32Segment + 3] = NAN;
  std::string bytes;
  wire::Encode(v1::DTYPE_FP32, values, &bytes);
  std::vector<float> out(values.size());
  ComputePool pool(2);
  std::vector<DecodeItem> items = {{v1::DTYPE_FP32, bytes.data(), out}};
  DecodeAll(items, &pool);
  EXPECT_FALSE(std::isfinite(items[0].sum_squares));
}

TEST(BulkCodecTest, EncodedBytesAreTheWireEncodingWhateverTheThreads) {
  const std::vector<size_t> sizes = {3, 0, 2 * kFp32Segment + 9, 5000, 4 * kFp32Segment + 1};
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::vector<std::vector<float>> values;
    for (size_t t = 0; t < sizes.size(); ++t) values.push_back(SpreadValues(sizes[t], 0.5f * static_cast<float>(t)));
    for (int threads : {0, 1, 2, 3}) {
      std::unique_ptr<ComputePool> pool = threads > 0 ? std::make_unique<ComputePool>(threads) : nullptr;
      std::vector<std::vector<char>> regions;
      std::vector<EncodeItem> items;
      for (size_t t = 0; t < sizes.size(); ++t) {
        regions.emplace_back(sizes[t] * 4 + 8, '\x5a');
        items.push_back({dtype, values[t], regions.back().data() + 1 + t % 3});  // misaligned
      }
      EncodeAll(items, pool.get());
      for (size_t t = 0; t < sizes.size(); ++t) {
        std::string expected;
        wire::Encode(dtype, values[t], &expected);
        const std::vector<char>& region = regions[t];
        const size_t at = 1 + t % 3;
        EXPECT_EQ(std::string(region.data() + at, expected.size()), expected) << t << " threads " << threads;
        EXPECT_EQ(region[at - 1], '\x5a');  // nothing written around it
        EXPECT_EQ(region[at + expected.size()], '\x5a');
      }
    }
  }
  // Large enough to stream (over 16 MiB), to a destination aligned to an element only.
  const std::vector<float> big = SpreadValues(17 * kFp32Segment + 3, 0.9f);
  std::vector<float> storage(big.size() + 8);
  ComputePool pool(2);
  std::vector<EncodeItem> items = {{v1::DTYPE_FP32, big, reinterpret_cast<char*>(storage.data() + 1)}};
  EncodeAll(items, &pool);
  EXPECT_TRUE(std::equal(big.begin(), big.end(), storage.begin() + 1));
}

}  // namespace
}  // namespace muond::transport
