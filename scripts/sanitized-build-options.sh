# Sourced by scripts/test.sh --sanitize and scripts/fuzz.sh, which share one build folder
# (build-sanitize/, or $MUOND_SANITIZE_BUILD_DIR): how that folder is configured, in one place.
#
# clang, because libFuzzer comes with it and because GCC 12 compiles ASan+UBSan code four to five
# times slower than it compiles the plain build (106 s against 22 s for server/session/session_step.cc
# on the 2-vCPU build machine; clang at -O1 takes 24 s with the fuzzer's coverage too). -O1 and line
# tables only, as the sanitizers' own documentation advises: reports keep file and line, and the
# build is not slowed by full debug information. CUDA off: ASan's shadow memory and the CUDA driver's
# address-space reservations do not mix. No benchmarks: nothing in the suite runs them (the examples
# it does: test_health_false_alarms).
export CC=${MUOND_SANITIZE_CC:-clang-14}
export CXX=${MUOND_SANITIZE_CXX:-clang++-14}
sanitized_build_dir=${MUOND_SANITIZE_BUILD_DIR:-$root/build-sanitize}
sanitized_cmake_options=(
  -DMUOND_SANITIZE=address,undefined -DMUOND_FUZZ=ON -DMUOND_ENABLE_CUDA=OFF -DMUOND_BUILD_BENCH=OFF
  -DMUOND_BUILD_EXAMPLES=ON
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"
)
