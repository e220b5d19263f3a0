// half_ranges_bench: the host's 16-bit conversions of whole ranges (common/half_ranges.h), which the
// CPU backend's 16-bit optimizer state and the wire codec use, against the per-value conversions of
// common/half_float.h they replace (the floor here is that scalar loop), in one run, one thread:
// milliseconds for `--values` values (best of `--reps`), values per second, and the ratio.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/half_float.h"
#include "common/half_ranges.h"

namespace {

template <typename Run>
double BestSeconds(int reps, Run&& run) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// Keeps a loop's results from being optimized away.
template <typename T>
void Use(const std::vector<T>& values) {
  asm volatile("" : : "r"(values.data()) : "memory");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"muond 16-bit range conversions against the per-value ones"};
  size_t count = 16'000'000;
  int reps = 5;
  app.add_option("--values", count, "Values converted per run")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed repetitions (best reported)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  std::vector<float> values(count), widened(count);
  for (size_t i = 0; i < count; ++i) values[i] = 0.001f * static_cast<float>(i % 9973) - 3.0f;
  std::vector<uint16_t> narrowed(count);
  std::printf("%zu values, best of %d, one thread\n", count, reps);
  std::printf("%-14s %12s %12s %12s %9s\n", "conversion", "scalar ms", "ranges ms", "ranges Gv/s", "speed-up");
  const auto report = [&](const char* name, double scalar, double ranges) {
    std::printf("%-14s %12.2f %12.2f %12.3f %8.2fx\n", name, scalar * 1e3, ranges * 1e3, count / ranges / 1e9,
                scalar / ranges);
  };
  for (const bool bf16 : {true, false}) {
    const double scalar_narrow = BestSeconds(reps, [&] {
      for (size_t i = 0; i < count; ++i)
        narrowed[i] = bf16 ? muond::FloatToBf16(values[i]) : muond::FloatToFp16(values[i]);
      Use(narrowed);
    });
    const double ranges_narrow = BestSeconds(reps, [&] {
      (bf16 ? muond::NarrowToBf16 : muond::NarrowToFp16)(values.data(), narrowed.data(), count);
      Use(narrowed);
    });
    report(bf16 ? "fp32 -> bf16" : "fp32 -> fp16", scalar_narrow, ranges_narrow);
    const double scalar_widen = BestSeconds(reps, [&] {
      for (size_t i = 0; i < count; ++i)
        widened[i] = bf16 ? muond::Bf16ToFloat(narrowed[i]) : muond::Fp16ToFloat(narrowed[i]);
      Use(widened);
    });
    const double ranges_widen = BestSeconds(reps, [&] {
      (bf16 ? muond::WidenBf16 : muond::WidenFp16)(narrowed.data(), widened.data(), count);
      Use(widened);
    });
    report(bf16 ? "bf16 -> fp32" : "fp16 -> fp32", scalar_widen, ranges_widen);
  }
  return 0;
}
