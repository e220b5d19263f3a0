// StateDirLock: one holder per state directory, released with its holder, never through a link.
#include "server/durability/state_dir_lock.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::durability {
namespace {

using ::muond::testing::StatusIs;

class StateDirLockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-lock-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(StateDirLockTest, ASecondHolderIsRefusedNamingTheFirstUntilItLetsGo) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<StateDirLock> first, StateDirLock::Acquire(dir_));
  std::ifstream written(dir_ + "/+lock");
  int pid = 0;
  written >> pid;
  EXPECT_EQ(pid, ::getpid());
  EXPECT_THAT(StateDirLock::Acquire(dir_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("--state-dir ", dir_, " is in use by another muond (pid ", ::getpid(),
                                    "), which holds ", dir_, "/+lock: one daemon per state directory")));
  first.reset();
  EXPECT_OK(StateDirLock::Acquire(dir_).status());
}

TEST_F(StateDirLockTest, ALinkInPlaceOfTheLockFileIsNeverFollowed) {
  const std::string elsewhere = dir_ + "/elsewhere";
  std::ofstream(elsewhere) << "x";
  std::filesystem::create_symlink(elsewhere, dir_ + "/+lock");
  EXPECT_THAT(StateDirLock::Acquire(dir_), StatusIs(absl::StatusCode::kFailedPrecondition, "is a symbolic link"));
  std::ifstream in(elsewhere);
  std::string content;
  in >> content;
  EXPECT_EQ(content, "x") << "the link's target was written";
}

}  // namespace
}  // namespace muond::durability
