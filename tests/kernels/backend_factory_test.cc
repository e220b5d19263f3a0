// CreateBackend: the `--backend` kinds, in a build with or without the CUDA backend and on a
// machine with or without a usable GPU. What must hold everywhere: "cpu" always works, "auto" never
// fails and says why it fell back, "cuda" either works or fails with FAILED_PRECONDITION and a
// reason, and "auto" picks CUDA exactly when "cuda" works.
#include "kernels/backend_factory.h"

#include "common/config.h"
#if MUOND_HAVE_CUDA
#include "kernels/cuda_library.h"
#endif

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using ::muond::testing::StatusIs;

TEST(BackendFactoryTest, CpuAlwaysWorks) {
  ASSERT_OK_AND_ASSIGN(BackendSelection cpu, CreateBackend("cpu", 0, 1));
  EXPECT_EQ(cpu.backend->Name(), "cpu");
  EXPECT_TRUE(cpu.note.empty());
}

TEST(BackendFactoryTest, UnknownKindNamesTheFlag) {
  EXPECT_THAT(CreateBackend("tpu", 0, 0), StatusIs(absl::StatusCode::kInvalidArgument, "--backend"));
  EXPECT_THAT(CreateBackend("", 0, 0), StatusIs(absl::StatusCode::kInvalidArgument, "--backend"));
}

TEST(BackendFactoryTest, WithoutCudaBuilt) {
  if (MUOND_HAVE_CUDA) GTEST_SKIP() << "this build has the CUDA backend";
  ASSERT_OK_AND_ASSIGN(BackendSelection autosel, CreateBackend("auto", 0, 0));
  EXPECT_EQ(autosel.backend->Name(), "cpu");
  EXPECT_EQ(autosel.note, "CUDA backend not built; using CPU");
  EXPECT_THAT(CreateBackend("cuda", 0, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, "built without the CUDA backend"));
}

TEST(BackendFactoryTest, AutoPicksCudaExactlyWhenCudaWorks) {
  if (!MUOND_HAVE_CUDA) GTEST_SKIP() << "this build has no CUDA backend";
  absl::StatusOr<BackendSelection> cuda = CreateBackend("cuda", 0, 0);
  ASSERT_OK_AND_ASSIGN(BackendSelection autosel, CreateBackend("auto", 0, 0));
  if (cuda.ok()) {
    EXPECT_EQ(cuda->backend->Name(), "cuda");
    EXPECT_NE(cuda->backend->Detail().find("device 0"), std::string::npos) << cuda->backend->Detail();
    EXPECT_TRUE(cuda->note.empty());
    EXPECT_EQ(autosel.backend->Name(), "cuda");
    EXPECT_TRUE(autosel.note.empty()) << autosel.note;
  } else {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition) << cuda.status();
    const std::string reason(cuda.status().message());
    EXPECT_FALSE(reason.empty());
    EXPECT_EQ(autosel.backend->Name(), "cpu");
    EXPECT_EQ(autosel.note, "CUDA not usable (" + reason + "); using the CPU backend");
  }
}

// The CUDA backend is a library loaded on first use; on a machine without a driver CreateBackend
// does not even load it. Loaded directly here, it must resolve every symbol (dlopen RTLD_NOW) and
// its entry point must answer: a backend on a GPU machine, FAILED_PRECONDITION with the runtime's
// reason elsewhere.
TEST(BackendFactoryTest, TheCudaLibraryLoadsAndAnswers) {
#if MUOND_HAVE_CUDA
  ASSERT_OK_AND_ASSIGN(NewCudaBackendEntry entry, LoadCudaLibrary());
  absl::StatusOr<std::unique_ptr<Backend>> backend = absl::UnknownError("not called");
  entry(0, &backend);
  if (backend.ok()) {
    EXPECT_EQ((*backend)->Name(), "cuda");
    EXPECT_TRUE(CudaDriverPresent());
  } else {
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition) << backend.status();
  }
#else
  GTEST_SKIP() << "this build has no CUDA backend";
#endif
}

TEST(BackendFactoryTest, CudaDeviceOutOfRange) {
  if (!MUOND_HAVE_CUDA) GTEST_SKIP() << "this build has no CUDA backend";
  // Whether or not a GPU is present, ordinal 4096 is not one of them.
  EXPECT_THAT(CreateBackend("cuda", 4096, 0), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
  EXPECT_THAT(CreateBackend("cuda", -1, 0), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
}

}  // namespace
}  // namespace muond::kernels
