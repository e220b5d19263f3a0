# Every third-party dependency, all from Debian packages (scripts/setup.sh installs them).
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(ZLIB REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)  # the metrics endpoint tests' HTTP client

set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(MUOND_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu/openblas-pthread REQUIRED)
# oneDNN 2.x (libdnnl-dev; scripts/setup.sh installs it) for the CPU backend's bf16 GEMMs; it runs on
# GNU OpenMP (libgomp), whose thread count the backend sets. Found by hand: its CMake package also wants
# the OpenCL headers of its GPU side. Without it (or with oneDNN 3's other API) the build goes on and
# bf16 GEMMs on the CPU compute in fp32, saying why.
find_path(MUOND_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
find_library(MUOND_DNNL_LIBRARY dnnl)
find_library(MUOND_GOMP_LIBRARY NAMES gomp libgomp.so.1)
set(MUOND_HAVE_DNNL OFF)
if(MUOND_DNNL_INCLUDE_DIR AND MUOND_DNNL_LIBRARY AND MUOND_GOMP_LIBRARY)
  file(STRINGS "${MUOND_DNNL_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h" muond_dnnl_major REGEX "define DNNL_VERSION_MAJOR")
  string(REGEX MATCH "[0-9]+" muond_dnnl_major "${muond_dnnl_major}")
  if(muond_dnnl_major EQUAL 2)
    set(MUOND_HAVE_DNNL ON)
  endif()
endif()
message(STATUS "muond: oneDNN 2.x for the CPU's bf16 GEMMs: ${MUOND_HAVE_DNNL}")

if(MUOND_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
find_package(Python3 COMPONENTS Interpreter)
