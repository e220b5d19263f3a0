// CreateBackend: the `--backend` kinds, in a build with or without the CUDA backend and on a
// machine with or without a usable GPU. What must hold everywhere: "cpu" always works, "auto" never
// fails and says why it fell back, "cuda" either works or fails with FAILED_PRECONDITION and a
// reason, and "auto" picks CUDA exactly when "cuda" works.
#include "kernels/backend_factory.h"

#include "common/config.h"
#if MUOND_HAVE_CUDA
#include "kernels/cuda_library.h"
#endif

#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using ::muond::testing::StatusIs;

TEST(BackendFactoryTest, CpuAlwaysWorks) {
  ASSERT_OK_AND_ASSIGN(BackendSelection cpu, CreateBackend("cpu", 0, 1));
  EXPECT_EQ(cpu.backend->Name(), "cpu");
  EXPECT_TRUE(cpu.note.empty());
}

// Sanitizers that map terabytes of shadow memory, under which an address-space limit means nothing.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kShadowMemory = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer) || \
    __has_feature(hwaddress_sanitizer)
constexpr bool kShadowMemory = true;
#else
constexpr bool kShadowMemory = false;
#endif
#else
constexpr bool kShadowMemory = false;
#endif

// What CreateBackend("cpu") answers in a child process whose address space is limited to what it
// has mapped plus `room_mib`: "OK", or the error's code and message. The child has 120 s (a CPU
// backend starts in milliseconds): past them it is killed and the answer says it hung.
std::string CpuBackendUnderALimit(int64_t room_mib) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return "fork failed";
  }
  if (pid == 0) {
    close(fds[0]);
    const rlim_t limit = static_cast<rlim_t>(MappedBytes()) + (static_cast<rlim_t>(room_mib) << 20);
    const rlimit as{limit, limit};
    std::string answer = "setrlimit failed";
    if (setrlimit(RLIMIT_AS, &as) == 0) {
      absl::StatusOr<BackendSelection> cpu = CreateBackend("cpu", 0, 1);
      answer =
          cpu.ok() ? "OK" : absl::StrCat(absl::StatusCodeToString(cpu.status().code()), ": ", cpu.status().message());
    }
    const ssize_t written = write(fds[1], answer.data(), answer.size());
    _exit(written == static_cast<ssize_t>(answer.size()) ? 0 : 1);
  }
  close(fds[1]);
  std::string answer;
  pollfd readable{fds[0], POLLIN, 0};
  char chunk[512];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool ended = false;  // the child closed its end: it answered, or died
  while (!ended) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int ready = poll(&readable, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    const ssize_t got = read(fds[0], chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      ended = true;
    } else {
      answer.append(chunk, static_cast<size_t>(got));
    }
  }
  close(fds[0]);
  if (!ended) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!ended) return "hung: killed after 120 s";
  if (WIFSIGNALED(status)) return absl::StrCat(answer, " (the child died of signal ", WTERMSIG(status), ")");
  return answer;
}

// OpenBLAS retries a failed map of its 128 MiB work buffer for ever, so a CPU backend made under an
// address-space limit too tight for it never returned, and the daemon hung at start without a word.
// The child inherits this process's mappings (an OpenBLAS buffer an earlier test mapped among them):
// what is checked is that the backend refuses, naming the limit, rather than where OpenBLAS would
// have spun.
TEST(BackendFactoryTest, CpuUnderATightAddressSpaceLimitIsRefusedNamingIt) {
  if (kShadowMemory) {
    GTEST_SKIP() << "the sanitizer maps terabytes of shadow memory: an address-space limit means nothing under it";
  }
  const std::string refused = CpuBackendUnderALimit(128);
  EXPECT_EQ(refused.rfind("RESOURCE_EXHAUSTED: ", 0), 0u) << refused;
  EXPECT_NE(refused.find("RLIMIT_AS"), std::string::npos) << refused;
  EXPECT_NE(refused.find("cannot map 208 MiB for its 1 thread (--threads"), std::string::npos) << refused;
  EXPECT_EQ(CpuBackendUnderALimit(1024), "OK");
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
