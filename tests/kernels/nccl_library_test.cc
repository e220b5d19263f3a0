// The CUDA backend's NCCL, loaded at first use: every entry point resolves from the installed
// libnccl.so.2 (no GPU needed to load it), and a library that cannot be loaded is a refusal that
// says what is missing. ctest runs this twice: as it is, and with MUOND_NCCL_LIBRARY naming a
// file that does not exist (the loader reads it once per process).
#include "kernels/cuda/nccl_library.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muond::kernels::cuda {
namespace {

using ::testing::HasSubstr;

TEST(NcclLibraryTest, LoadsEveryEntryPointOrSaysWhatIsMissing) {
  const char* given = std::getenv("MUOND_NCCL_LIBRARY");
  const absl::StatusOr<const NcclLibrary*> nccl = LoadNccl();
  if (given != nullptr && std::string(given) == "/nonexistent/libnccl.so.2") {
    ASSERT_FALSE(nccl.ok());
    EXPECT_EQ(nccl.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(nccl.status().message(), HasSubstr("/nonexistent/libnccl.so.2"));
    EXPECT_THAT(nccl.status().message(), HasSubstr("the NCCL channel is unavailable"));
    return;
  }
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  int version = 0;
  ASSERT_EQ((*nccl)->GetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 21800) << "NCCL 2.18 or later";
  EXPECT_STREQ((*nccl)->GetErrorString(ncclSuccess), ncclGetErrorString(ncclSuccess));
  EXPECT_EQ(*LoadNccl(), *nccl) << "loaded once";
}

}  // namespace
}  // namespace muond::kernels::cuda
