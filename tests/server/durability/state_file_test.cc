// The POSIX Env's confinement of state files: reading and writing never go through a symbolic link
// (to /dev/zero, to a file outside the folder, dangling), never block on a FIFO, accept regular files
// only, and a read past its limit is refused naming the file, before anything is read.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durability/env.h"
#include "tests/testing/status_matchers.h"

namespace muond::durability {
namespace {

namespace fs = std::filesystem;
using ::muond::testing::StatusIs;

class StateFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-state-file-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr) << "mkdtemp: " << errno;
    dir_ = pattern;
    fs::create_directory(Path("outside"));
    std::ofstream(Path("outside/secret")) << "outside bytes";
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Contents(const std::string& name) const {
    std::ifstream in(Path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  Env* const env_ = Env::Default();
  std::string dir_;
};

TEST_F(StateFileTest, ReadingRefusesSymbolicLinksNamingTheFile) {
  fs::create_symlink("/dev/zero", Path("zero"));
  fs::create_symlink(Path("outside/secret"), Path("secret"));
  fs::create_symlink(Path("nowhere"), Path("dangling"));
  for (const char* name : {"zero", "secret", "dangling"}) {
    EXPECT_THAT(env_->ReadFile(Path(name), kNoReadLimit),
                StatusIs(absl::StatusCode::kFailedPrecondition, Path(name) + ": it is a symbolic link"))
        << name;
  }
}

TEST_F(StateFileTest, ReadingAFifoOrADeviceIsRefusedWithoutBlocking) {
  ASSERT_EQ(mkfifo(Path("fifo").c_str(), 0600), 0);
  // Without O_NONBLOCK this open would wait for a writer forever.
  EXPECT_THAT(env_->ReadFile(Path("fifo"), kNoReadLimit),
              StatusIs(absl::StatusCode::kFailedPrecondition, Path("fifo") + ": not a regular file"));
  EXPECT_THAT(env_->ReadFile("/dev/zero", kNoReadLimit),
              StatusIs(absl::StatusCode::kFailedPrecondition, "/dev/zero: not a regular file"));
  fs::create_directory(Path("folder"));
  EXPECT_THAT(env_->ReadFile(Path("folder"), kNoReadLimit), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
}

TEST_F(StateFileTest, AReadPastItsLimitIsRefusedNamingTheFile) {
  std::ofstream(Path("big")) << std::string(100, 'x');
  EXPECT_THAT(env_->ReadFile(Path("big"), 99),
              StatusIs(absl::StatusCode::kOutOfRange, Path("big") + ": it holds 100 bytes, more than the 99"));
  ASSERT_OK_AND_ASSIGN(std::string all, env_->ReadFile(Path("big"), 100));
  EXPECT_EQ(all.size(), 100u);
}

TEST_F(StateFileTest, WritingThroughALinkChangesAndCreatesNothingOutside) {
  fs::create_symlink(Path("outside/secret"), Path("journal.log"));
  fs::create_symlink(Path("outside/created"), Path("dangling.log"));
  EXPECT_THAT(env_->NewAppendableFile(Path("journal.log")),
              StatusIs(absl::StatusCode::kFailedPrecondition, "symbolic link"));
  EXPECT_THAT(env_->NewWritableFile(Path("journal.log")), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
  EXPECT_THAT(env_->NewAppendableFile(Path("dangling.log")), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
  EXPECT_THAT(env_->NewWritableFile(Path("dangling.log")), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
  EXPECT_EQ(Contents("outside/secret"), "outside bytes") << "a link's target is never truncated";
  EXPECT_FALSE(fs::exists(Path("outside/created"))) << "a dangling link's target is never created";
}

TEST_F(StateFileTest, WritingToAFifoFailsWithoutBlocking) {
  ASSERT_EQ(mkfifo(Path("fifo").c_str(), 0600), 0);
  EXPECT_THAT(env_->NewWritableFile(Path("fifo")), StatusIs(absl::StatusCode::kFailedPrecondition, "not a regular"));
  EXPECT_THAT(env_->NewAppendableFile(Path("fifo")), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
}

TEST_F(StateFileTest, IsLinkSeesTheLinkNotItsTarget) {
  fs::create_directory_symlink(Path("outside"), Path("folder-link"));
  EXPECT_TRUE(env_->IsLink(Path("folder-link")));
  EXPECT_TRUE(env_->IsDirectory(Path("folder-link")));
  EXPECT_FALSE(env_->IsLink(Path("outside")));
  EXPECT_FALSE(env_->IsLink(Path("missing")));
}

}  // namespace
}  // namespace muond::durability
