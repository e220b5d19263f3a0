# Sanitizer and fuzzing builds, each meant for a build folder of its own (scripts/test.sh --sanitize
# uses build-sanitize, scripts/fuzz.sh build-fuzz); a normal build sets neither option.
#
# MUOND_SANITIZE: a comma-separated list for -fsanitize= (e.g. "address,undefined"). It is applied with
#   -fno-omit-frame-pointer to every C and C++ target of the project, at compile and at link time, so
#   the whole test suite (and the daemon the integration tests start) runs instrumented. CUDA sources
#   are left alone: nvcc does not take these flags.
# MUOND_FUZZ: builds the libFuzzer targets of tests/fuzz/. libFuzzer comes with clang, so the C++
#   compiler must be clang (CC=clang-14 CXX=clang++-14). The code the fuzzer drives — common/, proto/
#   and server/, which call muond_fuzz_coverage() — gets coverage instrumentation
#   (-fsanitize=fuzzer-no-link) so that the fuzzer is guided by it; the kernels' arithmetic and the
#   tests are left out (they would only slow the sanitized suite that shares the build). Only the
#   fuzzer executables link libFuzzer itself.
set(MUOND_SANITIZE "" CACHE STRING
    "Sanitizers for every target, as given to -fsanitize= (e.g. address,undefined); empty for none")
option(MUOND_FUZZ "Build the libFuzzer targets in tests/fuzz (needs clang)" OFF)

if(MUOND_SANITIZE)
  message(STATUS "muond: building with -fsanitize=${MUOND_SANITIZE}")
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=${MUOND_SANITIZE};-fno-omit-frame-pointer>")
  add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-fsanitize=${MUOND_SANITIZE}>")
  # clang's vptr check cannot read the dynamic type of objects that GCC-built shared libraries made
  # (Debian's libgrpc++): it reports grpc::Server, made inside libgrpc++, as "invalid vptr" at
  # server.Shutdown(). Off for clang; GCC's build keeps it.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang" AND MUOND_SANITIZE MATCHES "undefined")
    add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize=vptr>")
  endif()
endif()

if(MUOND_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "MUOND_FUZZ=ON needs clang for libFuzzer, but the C++ compiler is "
                        "${CMAKE_CXX_COMPILER_ID}; configure a separate build folder with "
                        "CC=clang-14 CXX=clang++-14")
  endif()
  if(NOT MUOND_BUILD_TESTS)
    message(FATAL_ERROR "MUOND_FUZZ=ON needs MUOND_BUILD_TESTS=ON (the fuzzers live in tests/fuzz)")
  endif()
  message(STATUS "muond: building the libFuzzer targets (coverage instrumentation of common, proto, server)")
endif()

# Called at the top of a folder's CMakeLists.txt whose code the fuzzer should be guided by.
macro(muond_fuzz_coverage)
  if(MUOND_FUZZ)
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>")
  endif()
endmacro()
