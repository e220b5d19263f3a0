// Shared set-up of the integration tests: one real muond daemon per test suite on a loopback port,
// a connected C++ client, a small two-group session spec, and a raw Step stream for sending requests
// the client library would never build. Test-only; not thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/muond_client.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace muond::testing {

class DaemonTest : public ::testing::Test {
 public:
  // "w" [8, 4] in a Muon group "matrices"; "b" [4] in an AdamW group "vectors".
  static v1::SessionSpec SmallSpec(v1::DType wire_dtype = v1::DTYPE_FP32);
  static std::vector<float> Initial(const std::string& name, size_t count);

 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;

  // Creates the session and uploads deterministic initial values.
  std::unique_ptr<client::Session> NewSession(const std::string& id, v1::DType wire_dtype = v1::DTYPE_FP32);
  // Gradients for step `step` (deterministic, different per step).
  static std::vector<float> Gradient(const std::string& name, int step, size_t count);
  std::vector<client::TensorView> Gradients(int step);

  // Sends a hand-built step stream; fills *result when the daemon answered.
  grpc::Status RawStep(const v1::StepHeader& header, const std::vector<v1::TensorChunk>& chunks,
                       v1::StepResult* result = nullptr);
  // Sends `messages` as they are (no header filled in), half-closes and reads the answer.
  grpc::Status RawStepMessages(const std::vector<v1::StepRequest>& messages, v1::StepResult* result = nullptr);
  static v1::TensorChunk Chunk(const std::string& name, const std::vector<float>& values, v1::DType dtype,
                               uint64_t offset = 0);

  static DaemonProcess* daemon_;
  static std::unique_ptr<client::Client> client_;

 private:
  std::vector<std::vector<float>> gradient_storage_;
};

}  // namespace muond::testing
