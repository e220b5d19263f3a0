#include "server/durability/env.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durability/fault_injecting_env.h"
#include "server/durability/file_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::durability {
namespace {

using ::muond::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Each test gets a fresh folder under /tmp, removed afterwards.
class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-env-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr) << "mkdtemp: " << errno;
    dir_ = pattern;
  }
  void TearDown() override {
    if (dir_.empty()) return;
    // A test may have made the folder read-only; give the owner its permissions back first.
    chmod(dir_.c_str(), 0700);
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes `contents` to `name` through the POSIX Env.
  void WriteFile(const std::string& name, const std::string& contents) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewWritableFile(Path(name)));
    ASSERT_OK(file->Append(contents));
    ASSERT_OK(file->Close());
  }

  std::string ReadOrDie(const std::string& name) {
    absl::StatusOr<std::string> contents = env_->ReadFile(Path(name), kNoReadLimit);
    EXPECT_OK(contents);
    return contents.ok() ? *contents : "<unreadable>";
  }

  Env* const env_ = Env::Default();
  std::string dir_;
};

// ---------------------------------------------------------------------------------------------------
// Errors.

TEST(ErrnoStatusTest, MapsErrnoToCodesAndNamesTheContext) {
  EXPECT_THAT(ErrnoStatus("cannot write /x/journal.log", ENOSPC),
              StatusIs(absl::StatusCode::kResourceExhausted, "cannot write /x/journal.log: No space left on device"));
  EXPECT_THAT(ErrnoStatus("cannot read /x", ENOENT),
              StatusIs(absl::StatusCode::kNotFound, "cannot read /x: No such file or directory"));
  EXPECT_THAT(ErrnoStatus("cannot create /x", EACCES), StatusIs(absl::StatusCode::kPermissionDenied, "/x"));
  EXPECT_THAT(ErrnoStatus("cannot create /x", EPERM), StatusIs(absl::StatusCode::kPermissionDenied, "/x"));
  EXPECT_THAT(ErrnoStatus("cannot fsync /x", EIO),
              StatusIs(absl::StatusCode::kInternal, "cannot fsync /x: Input/output error"));
  // The process's own shortage, not the file's fault.
  for (int shortage : {EMFILE, ENFILE, ENOMEM, ENOBUFS}) {
    EXPECT_THAT(ErrnoStatus("cannot read /x", shortage), StatusIs(absl::StatusCode::kResourceExhausted, "/x"))
        << shortage;
  }
}

// ---------------------------------------------------------------------------------------------------
// The POSIX Env.

TEST_F(EnvTest, DefaultIsOneInstance) { EXPECT_EQ(Env::Default(), Env::Default()); }

TEST_F(EnvTest, WriteAndReadBack) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewWritableFile(Path("a")));
  EXPECT_EQ(file->path(), Path("a"));
  ASSERT_OK(file->Append("hello, "));
  ASSERT_OK(file->Append(""));
  ASSERT_OK(file->Append(std::string("wor\0ld", 6)));
  ASSERT_OK(file->Sync());
  ASSERT_OK(file->Close());
  EXPECT_EQ(ReadOrDie("a"), std::string("hello, wor\0ld", 13));
  struct stat info;
  ASSERT_EQ(stat(Path("a").c_str(), &info), 0);
  const mode_t mask = umask(0);
  umask(mask);
  EXPECT_EQ(info.st_mode & 0777, 0644 & ~mask);
}

TEST_F(EnvTest, GetFileSizeOfAFileAndOfNothing) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewWritableFile(Path("sized")));
  ASSERT_OK(file->Append("12345"));
  ASSERT_OK(file->Close());
  ASSERT_OK_AND_ASSIGN(uint64_t size, env_->GetFileSize(Path("sized")));
  EXPECT_EQ(size, 5u);
  EXPECT_THAT(env_->GetFileSize(Path("missing")), StatusIs(absl::StatusCode::kNotFound, Path("missing")));
}

TEST_F(EnvTest, LargeAppendIsWrittenWhole) {
  const std::string big(3 << 20, 'x');
  WriteFile("big", big);
  EXPECT_EQ(ReadOrDie("big"), big);
}

TEST_F(EnvTest, NewWritableFileTruncatesAnExistingFile) {
  WriteFile("a", "old contents");
  WriteFile("a", "new");
  EXPECT_EQ(ReadOrDie("a"), "new");
}

TEST_F(EnvTest, AppendAcrossReopen) {
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewAppendableFile(Path("log")));
    ASSERT_OK(file->Append("one;"));
    ASSERT_OK(file->Sync());
    ASSERT_OK(file->Close());
  }
  {
    // Destroyed without Close(): the destructor closes.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewAppendableFile(Path("log")));
    ASSERT_OK(file->Append("two;"));
  }
  EXPECT_EQ(ReadOrDie("log"), "one;two;");
}

TEST_F(EnvTest, TruncateEmptiesTheFileAndLaterAppendsStartAtZero) {
  // Both kinds of file: without O_APPEND a missing seek would leave a hole of zeros.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> appendable, env_->NewAppendableFile(Path("appendable")));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> writable, env_->NewWritableFile(Path("writable")));
  for (WritableFile* file : {appendable.get(), writable.get()}) {
    SCOPED_TRACE(file->path());
    ASSERT_OK(file->Append("0123456789"));
    ASSERT_OK(file->Truncate(0));
    ASSERT_OK_AND_ASSIGN(std::string empty, env_->ReadFile(file->path(), kNoReadLimit));
    EXPECT_THAT(empty, IsEmpty());
    ASSERT_OK(file->Append("ab"));
    ASSERT_OK(file->Close());
    ASSERT_OK_AND_ASSIGN(std::string after, env_->ReadFile(file->path(), kNoReadLimit));
    EXPECT_EQ(after, "ab");
  }
}

TEST_F(EnvTest, TruncateToASizeKeepsTheFileUpToItAndLaterAppendsFollowIt) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> appendable, env_->NewAppendableFile(Path("appendable")));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> writable, env_->NewWritableFile(Path("writable")));
  for (WritableFile* file : {appendable.get(), writable.get()}) {
    SCOPED_TRACE(file->path());
    ASSERT_OK(file->Append("0123456789"));
    ASSERT_OK(file->Truncate(4));
    ASSERT_OK_AND_ASSIGN(std::string kept, env_->ReadFile(file->path(), kNoReadLimit));
    EXPECT_EQ(kept, "0123");
    EXPECT_THAT(file->Truncate(5), StatusIs(absl::StatusCode::kDataLoss, "holds only 4"));
    ASSERT_OK_AND_ASSIGN(std::string unchanged, env_->ReadFile(file->path(), kNoReadLimit));
    EXPECT_EQ(unchanged, "0123") << "grown with zeros";
    ASSERT_OK(file->Append("ab"));
    ASSERT_OK(file->Close());
    ASSERT_OK_AND_ASSIGN(std::string after, env_->ReadFile(file->path(), kNoReadLimit));
    EXPECT_EQ(after, "0123ab");
  }
}

TEST_F(EnvTest, OperationsOnAClosedFileFail) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, env_->NewWritableFile(Path("a")));
  ASSERT_OK(file->Close());
  ASSERT_OK(file->Close());  // twice is fine
  EXPECT_THAT(file->Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition, Path("a")));
  EXPECT_THAT(file->Sync(), StatusIs(absl::StatusCode::kFailedPrecondition, Path("a")));
  EXPECT_THAT(file->Truncate(0), StatusIs(absl::StatusCode::kFailedPrecondition, Path("a")));
}

TEST_F(EnvTest, RenameReplacesTheTarget) {
  WriteFile("from", "new");
  WriteFile("to", "old");
  ASSERT_OK(env_->RenameFile(Path("from"), Path("to")));
  EXPECT_FALSE(env_->FileExists(Path("from")));
  EXPECT_EQ(ReadOrDie("to"), "new");
  EXPECT_THAT(env_->RenameFile(Path("from"), Path("to")), StatusIs(absl::StatusCode::kNotFound, Path("from")));
}

TEST_F(EnvTest, RemoveFile) {
  WriteFile("a", "x");
  ASSERT_OK(env_->RemoveFile(Path("a")));
  EXPECT_FALSE(env_->FileExists(Path("a")));
  EXPECT_THAT(env_->RemoveFile(Path("a")),
              StatusIs(absl::StatusCode::kNotFound, "cannot remove " + Path("a") + ": No such file or directory"));
}

TEST_F(EnvTest, ListDirIsSortedWithoutDotEntries) {
  WriteFile("b", "");
  WriteFile("a", "");
  WriteFile("c.tmp", "");
  ASSERT_OK(env_->CreateDirs(Path("B")));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, env_->ListDir(dir_));
  EXPECT_THAT(names, ElementsAre("B", "a", "b", "c.tmp"));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> empty, env_->ListDir(Path("B")));
  EXPECT_THAT(empty, IsEmpty());
  EXPECT_THAT(env_->ListDir(Path("missing")).status(), StatusIs(absl::StatusCode::kNotFound, Path("missing")));
}

TEST_F(EnvTest, CreateDirsIsMkdirP) {
  ASSERT_OK(env_->CreateDirs(Path("x/y/z")));
  EXPECT_TRUE(env_->IsDirectory(Path("x/y/z")));
  ASSERT_OK(env_->CreateDirs(Path("x/y/z")));  // already there
  ASSERT_OK(env_->SyncDir(Path("x/y")));
  WriteFile("file", "");
  EXPECT_FALSE(env_->IsDirectory(Path("file")));
  EXPECT_TRUE(env_->FileExists(Path("file")));
  EXPECT_THAT(env_->CreateDirs(Path("file")), StatusIs(absl::StatusCode::kInternal, Path("file")));
  EXPECT_FALSE(env_->IsDirectory(Path("missing")));
  EXPECT_FALSE(env_->FileExists(Path("missing")));
}

TEST_F(EnvTest, RemoveTreeRemovesEverythingAndAcceptsAMissingPath) {
  ASSERT_OK(env_->CreateDirs(Path("t/sub/deeper")));
  WriteFile("t/a", "1");
  WriteFile("t/sub/b", "2");
  WriteFile("t/sub/deeper/c", "3");
  ASSERT_OK(env_->RemoveTree(Path("t")));
  EXPECT_FALSE(env_->FileExists(Path("t")));
  ASSERT_OK(env_->RemoveTree(Path("t")));
  ASSERT_OK(env_->RemoveTree(Path("never/existed")));
  // A plain file is a tree of one.
  WriteFile("f", "x");
  ASSERT_OK(env_->RemoveTree(Path("f")));
  EXPECT_FALSE(env_->FileExists(Path("f")));
}

TEST_F(EnvTest, ReadingAMissingFileIsNotFoundNamingThePath) {
  EXPECT_THAT(env_->ReadFile(Path("missing"), kNoReadLimit),
              StatusIs(absl::StatusCode::kNotFound, "cannot read " + Path("missing") + ": No such file or directory"));
  EXPECT_THAT(env_->NewAppendableFile(Path("no/such/folder/log")),
              StatusIs(absl::StatusCode::kNotFound, Path("no/such/folder/log")));
  EXPECT_THAT(env_->SyncDir(Path("missing")), StatusIs(absl::StatusCode::kNotFound, Path("missing")));
}

TEST_F(EnvTest, PermissionProblemsArePermissionDenied) {
  if (geteuid() == 0) GTEST_SKIP() << "root ignores file permissions";
  ASSERT_OK(env_->CreateDirs(Path("locked")));
  ASSERT_EQ(chmod(Path("locked").c_str(), 0500), 0);
  EXPECT_THAT(env_->NewWritableFile(Path("locked/a")), StatusIs(absl::StatusCode::kPermissionDenied, Path("locked/a")));
  ASSERT_EQ(chmod(Path("locked").c_str(), 0700), 0);
}

// ---------------------------------------------------------------------------------------------------
// file_util.

TEST(Sha256HexTest, KnownDigests) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_F(EnvTest, WriteFileAtomicallyReplacesContentsAndLeavesNoTemporary) {
  ASSERT_OK(WriteFileAtomically(env_, Path("state.json"), "first"));
  EXPECT_EQ(ReadOrDie("state.json"), "first");
  ASSERT_OK(WriteFileAtomically(env_, Path("state.json"), "second, longer"));
  EXPECT_EQ(ReadOrDie("state.json"), "second, longer");
  ASSERT_OK(WriteFileAtomically(env_, Path("state.json"), ""));
  EXPECT_EQ(ReadOrDie("state.json"), "");
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, env_->ListDir(dir_));
  EXPECT_THAT(names, ElementsAre("state.json"));
}

TEST_F(EnvTest, WriteFileAtomicallyIntoAMissingFolderFails) {
  EXPECT_THAT(WriteFileAtomically(env_, Path("missing/state.json"), "x"),
              StatusIs(absl::StatusCode::kNotFound, Path("missing/state.json.tmp")));
}

// ---------------------------------------------------------------------------------------------------
// FaultInjectingEnv.

class FaultInjectingEnvTest : public EnvTest {
 protected:
  FaultInjectingEnv faulty_{Env::Default()};
};

TEST_F(FaultInjectingEnvTest, PassesThroughWithoutFaults) {
  ASSERT_OK(WriteFileAtomically(&faulty_, Path("a"), "contents"));
  ASSERT_OK_AND_ASSIGN(std::string contents, faulty_.ReadFile(Path("a"), kNoReadLimit));
  EXPECT_EQ(contents, "contents");
  ASSERT_OK(faulty_.CreateDirs(Path("d/e")));
  EXPECT_TRUE(faulty_.IsDirectory(Path("d/e")));
  EXPECT_TRUE(faulty_.FileExists(Path("a")));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, faulty_.ListDir(dir_));
  EXPECT_THAT(names, ElementsAre("a", "d"));
  ASSERT_OK(faulty_.RemoveTree(Path("d")));
  ASSERT_OK(faulty_.RemoveFile(Path("a")));
  EXPECT_THAT(faulty_.ReadFile(Path("a"), kNoReadLimit), StatusIs(absl::StatusCode::kNotFound, Path("a")));
  EXPECT_EQ(faulty_.faults_triggered(), 0);
}

TEST_F(FaultInjectingEnvTest, ShortWriteLeavesOnlyThePrefix) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewAppendableFile(Path("journal.log")));
  ASSERT_OK(file->Append("head;"));
  faulty_.FailAppend("journal", AppendFault::kShortWrite);
  EXPECT_THAT(file->Append("0123456789"), StatusIs(absl::StatusCode::kInternal, "short write"));
  ASSERT_OK(file->Append("x"));  // one-shot: the next append works
  ASSERT_OK(file->Close());
  EXPECT_EQ(ReadOrDie("journal.log"), "head;01234x");
  EXPECT_EQ(faulty_.faults_triggered(), 1);
}

TEST_F(FaultInjectingEnvTest, NoSpaceWritesNothing) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewAppendableFile(Path("journal.log")));
  ASSERT_OK(file->Append("head;"));
  faulty_.FailAppend("journal.log", AppendFault::kNoSpace);
  EXPECT_THAT(file->Append("record"), StatusIs(absl::StatusCode::kResourceExhausted,
                                               "cannot write " + Path("journal.log") + ": No space left on device"));
  ASSERT_OK(file->Close());
  EXPECT_EQ(ReadOrDie("journal.log"), "head;");
}

TEST_F(FaultInjectingEnvTest, AfterAppendsLetsThatManySucceedFirst) {
  faulty_.FailAppend("log", AppendFault::kNoSpace, /*after_appends=*/2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewWritableFile(Path("log")));
  ASSERT_OK(file->Append("a"));
  ASSERT_OK(file->Append("b"));
  EXPECT_THAT(file->Append("c"), StatusIs(absl::StatusCode::kResourceExhausted, "No space left on device"));
  ASSERT_OK(file->Append("d"));
  ASSERT_OK(file->Close());
  EXPECT_EQ(ReadOrDie("log"), "abd");
}

TEST_F(FaultInjectingEnvTest, FaultsOnlyHitMatchingPaths) {
  faulty_.FailAppend("journal", AppendFault::kNoSpace);
  faulty_.FailSync("journal");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> other, faulty_.NewWritableFile(Path("checkpoint.json")));
  ASSERT_OK(other->Append("x"));
  ASSERT_OK(other->Sync());
  ASSERT_OK(faulty_.SyncDir(dir_));
  EXPECT_EQ(faulty_.faults_triggered(), 0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> journal, faulty_.NewWritableFile(Path("journal.log")));
  EXPECT_FALSE(journal->Append("x").ok());
  EXPECT_FALSE(journal->Sync().ok());
  EXPECT_EQ(faulty_.faults_triggered(), 2);
}

TEST_F(FaultInjectingEnvTest, FailedSyncIsReported) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewWritableFile(Path("journal.log")));
  ASSERT_OK(file->Append("data"));
  faulty_.FailSync("journal.log", /*after_syncs=*/1);
  ASSERT_OK(file->Sync());
  EXPECT_THAT(file->Sync(),
              StatusIs(absl::StatusCode::kInternal, "cannot fsync " + Path("journal.log") + ": Input/output error"));
  ASSERT_OK(file->Sync());
  EXPECT_EQ(faulty_.faults_triggered(), 1);
}

TEST_F(FaultInjectingEnvTest, FailedSyncOfAFolder) {
  ASSERT_OK(faulty_.CreateDirs(Path("sessions/s1")));
  faulty_.FailSync("sessions/s1");
  EXPECT_THAT(faulty_.SyncDir(Path("sessions/s1")),
              StatusIs(absl::StatusCode::kInternal, "cannot fsync folder " + Path("sessions/s1")));
  ASSERT_OK(faulty_.SyncDir(Path("sessions/s1")));
}

TEST_F(FaultInjectingEnvTest, FailedRenameRenamesNothing) {
  WriteFile("from", "new");
  WriteFile("to", "old");
  faulty_.FailRename("to");
  EXPECT_THAT(faulty_.RenameFile(Path("from"), Path("to")),
              StatusIs(absl::StatusCode::kInternal, "cannot rename " + Path("from") + " to " + Path("to")));
  EXPECT_EQ(ReadOrDie("to"), "old");
  EXPECT_EQ(ReadOrDie("from"), "new");
}

// WriteFileAtomically under every fault before the rename: the previous file stays, the temporary goes.
TEST_F(FaultInjectingEnvTest, WriteFileAtomicallyKeepsThePreviousContentsOnFailure) {
  struct Case {
    const char* name;
    void (*arm)(FaultInjectingEnv&);
    absl::StatusCode code;
    const char* substring;
  };
  const Case cases[] = {
      {"sync", [](FaultInjectingEnv& env) { env.FailSync("state.json"); }, absl::StatusCode::kInternal,
       "Input/output error"},
      {"rename", [](FaultInjectingEnv& env) { env.FailRename("state.json"); }, absl::StatusCode::kInternal,
       "cannot rename"},
      {"short write", [](FaultInjectingEnv& env) { env.FailAppend("state.json", AppendFault::kShortWrite); },
       absl::StatusCode::kInternal, "short write"},
      {"no space", [](FaultInjectingEnv& env) { env.FailAppend("state.json", AppendFault::kNoSpace); },
       absl::StatusCode::kResourceExhausted, "No space left on device"},
  };
  ASSERT_OK(WriteFileAtomically(env_, Path("state.json"), "previous"));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    c.arm(faulty_);
    EXPECT_THAT(WriteFileAtomically(&faulty_, Path("state.json"), "replacement"), StatusIs(c.code, c.substring));
    EXPECT_EQ(ReadOrDie("state.json"), "previous");
    ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, env_->ListDir(dir_));
    EXPECT_THAT(names, ElementsAre("state.json"));
  }
  EXPECT_EQ(faulty_.faults_triggered(), 4);
}

// A failed sync of the folder comes after the rename: the new contents are in place, the error still
// reaches the caller because the rename may not be durable.
TEST_F(FaultInjectingEnvTest, WriteFileAtomicallyReportsAFailedFolderSync) {
  ASSERT_OK(faulty_.CreateDirs(Path("sub")));
  // The substring also matches the temporary file, whose sync comes first: let that one pass.
  faulty_.FailSync(Path("sub"), /*after_syncs=*/1);
  EXPECT_THAT(WriteFileAtomically(&faulty_, Path("sub/state.json"), "new"),
              StatusIs(absl::StatusCode::kInternal, "cannot fsync folder " + Path("sub")));
  ASSERT_OK_AND_ASSIGN(std::string contents, env_->ReadFile(Path("sub/state.json"), kNoReadLimit));
  EXPECT_EQ(contents, "new");
  EXPECT_FALSE(env_->FileExists(Path("sub/state.json.tmp")));
}

TEST_F(FaultInjectingEnvTest, OneShotFaultsFireOnce) {
  faulty_.FailRename("b");
  WriteFile("a", "x");
  EXPECT_FALSE(faulty_.RenameFile(Path("a"), Path("b")).ok());
  ASSERT_OK(faulty_.RenameFile(Path("a"), Path("b")));
  EXPECT_EQ(faulty_.faults_triggered(), 1);
}

TEST_F(FaultInjectingEnvTest, StickyFaultsFireUntilCleared) {
  faulty_.FailAppend("log", AppendFault::kNoSpace, /*after_appends=*/1, /*sticky=*/true);
  faulty_.FailSync("log", /*after_syncs=*/0, /*sticky=*/true);
  faulty_.FailRename("b", /*sticky=*/true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewWritableFile(Path("log")));
  ASSERT_OK(file->Append("a"));
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(file->Append("b"), StatusIs(absl::StatusCode::kResourceExhausted, "No space"));
    EXPECT_THAT(file->Sync(), StatusIs(absl::StatusCode::kInternal, "Input/output error"));
    EXPECT_THAT(faulty_.RenameFile(Path("log"), Path("b")), StatusIs(absl::StatusCode::kInternal, "cannot rename"));
  }
  EXPECT_EQ(faulty_.faults_triggered(), 9);
  faulty_.ClearFaults();
  ASSERT_OK(file->Append("c"));
  ASSERT_OK(file->Sync());
  ASSERT_OK(file->Close());
  ASSERT_OK(faulty_.RenameFile(Path("log"), Path("b")));
  EXPECT_EQ(ReadOrDie("b"), "ac");
  EXPECT_EQ(faulty_.faults_triggered(), 9);
}

TEST_F(FaultInjectingEnvTest, SeveralDueFaultsFireOneAtATimeInArmingOrder) {
  faulty_.FailAppend("log", AppendFault::kShortWrite);
  faulty_.FailAppend("log", AppendFault::kNoSpace);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> file, faulty_.NewWritableFile(Path("log")));
  EXPECT_THAT(file->Append("abcd"), StatusIs(absl::StatusCode::kInternal, "short write"));
  EXPECT_THAT(file->Append("efgh"), StatusIs(absl::StatusCode::kResourceExhausted, "No space"));
  ASSERT_OK(file->Append("ijkl"));
  ASSERT_OK(file->Close());
  EXPECT_EQ(ReadOrDie("log"), "abijkl");
}

// Threads appending to their own files while one file's fault is due: exactly that file sees one
// failure, at the promised append. Mostly a smoke test for the locking. (Under TSan, an absl built
// without TSan reports absl::Mutex-protected accesses as races; the test is clean with std::mutex.)
TEST_F(FaultInjectingEnvTest, ConcurrentAppendsCountPerMatchingPath) {
  constexpr int kThreads = 4;
  constexpr int kAppends = 200;
  faulty_.FailAppend("t2.log", AppendFault::kNoSpace, /*after_appends=*/10);
  std::vector<int> failed_at(kThreads, -1);
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      absl::StatusOr<std::unique_ptr<WritableFile>> file =
          faulty_.NewWritableFile(Path("t" + std::to_string(t) + ".log"));
      if (!file.ok()) return;
      for (int i = 0; i < kAppends; ++i) {
        if (!(*file)->Append("x").ok()) {
          ++failures[t];
          failed_at[t] = i;
        }
      }
      (*file)->Close().IgnoreError();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(failures[t], t == 2 ? 1 : 0);
    EXPECT_EQ(ReadOrDie("t" + std::to_string(t) + ".log").size(),
              static_cast<size_t>(t == 2 ? kAppends - 1 : kAppends));
  }
  EXPECT_EQ(failed_at[2], 10);
  EXPECT_EQ(faulty_.faults_triggered(), 1);
}

}  // namespace
}  // namespace muond::durability
