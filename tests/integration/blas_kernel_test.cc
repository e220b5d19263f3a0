// The daemon's GEMMs run OpenBLAS's best kernels for this CPU (kernels/cpu/blas_kernel.h): started
// without OPENBLAS_CORETYPE, the kernel its CPU backend reports is the one this CPU should run — on a
// CPU newer than the OpenBLAS (an Emerald Rapids Xeon under Debian 12's 0.3.21, which fell back to Prescott)
// that is the daemon started again under OPENBLAS_CORETYPE, elsewhere OpenBLAS's own choice; an
// OPENBLAS_CORETYPE given by whoever starts it is kept; `muond --print-blas-kernel` names the same.
#include "kernels/cpu/blas_kernel.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "gmock/gmock.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

// The kernel named in the backend detail of a daemon started with `coretype` as OPENBLAS_CORETYPE
// (unset when empty); its log in *log.
std::string KernelOfADaemonStartedWith(const std::string& coretype, std::string* log) {
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::string kept = before == nullptr ? "" : before;
  if (coretype.empty()) {
    unsetenv("OPENBLAS_CORETYPE");
  } else {
    setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1);
  }
  DaemonProcess daemon;
  std::string error;
  const bool started = daemon.Start({"--backend", "cpu"}, &error);
  if (before == nullptr) {
    unsetenv("OPENBLAS_CORETYPE");
  } else {
    setenv("OPENBLAS_CORETYPE", kept.c_str(), 1);
  }
  EXPECT_TRUE(started) << error;
  if (!started) return "";
  client::ClientOptions options = TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.transport = "grpc";
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(options);
  EXPECT_OK(client.status());
  if (!client.ok()) return "";
  absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
  EXPECT_OK(info.status());
  *log = daemon.ReadStderr();
  if (!info.ok()) return "";
  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64, 2 threads, …"
  std::istringstream words(info->backend_detail());
  for (std::string word; words >> word;) {
    if (kernels::KernelTier(word).has_value()) return word;
  }
  ADD_FAILURE() << "no OpenBLAS kernel in the backend detail: " << info->backend_detail();
  return "";
}

TEST(BlasKernelTest, TheDaemonRunsTheKernelsThisCpuShould) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    GTEST_SKIP() << "OPENBLAS_CORETYPE is set for this test: its own OpenBLAS cannot say what it would choose";
  }
  const kernels::BlasKernel here = kernels::InspectBlasKernel();
  std::string log;
  const std::string kernel = KernelOfADaemonStartedWith("", &log);
  EXPECT_EQ(kernel, here.better.value_or(here.chosen)) << log;
  if (here.better.has_value()) {
    EXPECT_THAT(log, HasSubstr("OpenBLAS chose its " + here.chosen + " kernels, below what this CPU runs"));
  } else {
    EXPECT_THAT(log, ::testing::Not(HasSubstr("OPENBLAS_CORETYPE")));
  }
}

// What `muond --print-blas-kernel` prints, under `coretype` as OPENBLAS_CORETYPE (unset when empty).
std::string PrintedKernel(const std::string& coretype) {
  const std::string command =
      (coretype.empty() ? std::string("env -u OPENBLAS_CORETYPE ") : "env OPENBLAS_CORETYPE=" + coretype + " ") +
      MUOND_BINARY + " --print-blas-kernel";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buffer[256];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) out += buffer;
  EXPECT_EQ(pclose(pipe), 0) << command;
  return out;
}

TEST(BlasKernelTest, PrintBlasKernelNamesTheKernelsADaemonRuns) {
  std::string log;
  EXPECT_EQ(PrintedKernel(""), KernelOfADaemonStartedWith("", &log) + "\n") << log;
  EXPECT_EQ(PrintedKernel("Sandybridge"), "Sandybridge\n");
}

TEST(BlasKernelTest, AKernelGivenInTheEnvironmentIsKept) {
  std::string log;
  EXPECT_EQ(KernelOfADaemonStartedWith("Sandybridge", &log), "Sandybridge") << log;
  EXPECT_THAT(log, ::testing::Not(HasSubstr("started again")));
}

}  // namespace
}  // namespace muond::testing
