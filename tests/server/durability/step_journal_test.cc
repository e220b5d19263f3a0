// The step journal's framing: records round-trip; only a record cut short at the very end of the
// file is a torn tail; an inflated length, an altered header or payload, a length no step of the
// session could have, or a gradient of the wrong size refuses the journal (DATA_LOSS naming the file
// and the record's offset) and leaves its bytes as they were; journals of the previous format (MJR2)
// and the one before the checkpoint generation (MJR3) are still read. The last record can be
// withdrawn, durably, and only it.
#include "server/durability/step_journal.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durability/fault_injecting_env.h"
#include "tests/testing/status_matchers.h"

namespace muond::durability {
namespace {

namespace fs = std::filesystem;
using ::muond::testing::StatusIs;

constexpr size_t kHeader = 20;
const std::vector<int64_t> kNumel = {6, 2};  // the session's two parameters

HostTensor Gradient(std::vector<float> values) {
  HostTensor g;
  g.received = static_cast<int64_t>(values.size());
  for (const float v : values) g.sum_squares += static_cast<double>(v) * v;
  g.values = std::move(values);
  return g;
}

class StepJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-journal-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    path_ = dir_ + "/journal.log";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Appends steps 1..n, each a request and both gradients; returns each record's offset.
  std::vector<size_t> Write(int n) {
    StepJournal journal(Env::Default());
    EXPECT_OK(journal.Open(path_));
    std::vector<size_t> offsets;
    for (int step = 1; step <= n; ++step) {
      offsets.push_back(fs::file_size(path_));
      const std::vector<HostTensor> gradients = {Gradient({1, 2, 3, 4, 5, static_cast<float>(step)}), Gradient({7, 8})};
      EXPECT_OK(
          journal.Append(/*checkpoint_generation=*/step / 2, "{\"step\":" + std::to_string(step) + "}", gradients));
    }
    journal.Close();
    return offsets;
  }
  std::string Bytes() const {
    std::ifstream in(path_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  void SetBytes(const std::string& bytes) const { std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes; }

  absl::StatusOr<JournalContents> Read() const { return StepJournal::Read(Env::Default(), path_, kNumel); }

  std::string dir_;
  std::string path_;
};

TEST_F(StepJournalTest, RecordsRoundTrip) {
  Write(3);
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 3u);
  EXPECT_FALSE(contents.dropped_torn_tail);
  EXPECT_EQ(contents.records[2].request, "{\"step\":3}");
  EXPECT_EQ(contents.records[0].checkpoint_generation, 0u);
  EXPECT_EQ(contents.records[2].checkpoint_generation, 1u);
  EXPECT_EQ(contents.records[2].gradients[0].values, (std::vector<float>{1, 2, 3, 4, 5, 3}));
  EXPECT_EQ(contents.records[2].gradients[1].sum_squares, 113);  // 7² + 8², kept as written
}

// A step that failed before it changed anything takes its record back: the journal reads as if it
// had never been appended, the next step's record follows the one before, and a second withdrawal,
// or one after a failed append, is refused.
TEST_F(StepJournalTest, TheLastRecordIsWithdrawnAndTheNextFollowsTheOneBefore) {
  StepJournal journal(Env::Default());
  ASSERT_OK(journal.Open(path_));
  ASSERT_OK(journal.Append(1, "{\"step\":1}", {Gradient({1, 2, 3, 4, 5, 6}), Gradient({7, 8})}));
  const std::string after_one = Bytes();
  ASSERT_OK(journal.Append(1, "{\"step\":2}", {Gradient({9, 9, 9, 9, 9, 9}), HostTensor()}));
  ASSERT_OK(journal.WithdrawLast());
  EXPECT_EQ(Bytes(), after_one);
  EXPECT_THAT(journal.WithdrawLast(), StatusIs(absl::StatusCode::kFailedPrecondition, "no record to withdraw"));
  EXPECT_EQ(Bytes(), after_one);
  ASSERT_OK(journal.Append(1, "{\"step\":2}", {Gradient({2, 2, 2, 2, 2, 2}), Gradient({3, 3})}));
  journal.Close();
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 2u);
  EXPECT_FALSE(contents.dropped_torn_tail);
  EXPECT_EQ(contents.records[0].request, "{\"step\":1}");
  EXPECT_EQ(contents.records[1].request, "{\"step\":2}");
  EXPECT_EQ(contents.records[1].gradients[0].values, std::vector<float>(6, 2.0f));

  // The only record withdrawn: an empty journal.
  fs::remove(path_);
  StepJournal again(Env::Default());
  ASSERT_OK(again.Open(path_));
  ASSERT_OK(again.Append(0, "{\"step\":1}", {Gradient({1, 2, 3, 4, 5, 6}), Gradient({7, 8})}));
  ASSERT_OK(again.WithdrawLast());
  again.Close();
  EXPECT_EQ(fs::file_size(path_), 0u);
}

// A withdrawal that cannot cut the journal leaves the record (a restore would apply its step) and says
// so; the next append cuts it off before it writes, so no record ever follows a withdrawn one. One whose
// cut is not known to be durable (its fsync failed) says so too, and the next append follows the record
// before. An append that failed has nothing to withdraw.
TEST_F(StepJournalTest, AWithdrawalThatFailsLeavesTheRecordUntilTheNextAppendCutsIt) {
  FaultInjectingEnv env(Env::Default());
  StepJournal journal(&env);
  ASSERT_OK(journal.Open(path_));
  ASSERT_OK(journal.Append(1, "{\"step\":1}", {Gradient({1, 2, 3, 4, 5, 6}), Gradient({7, 8})}));
  ASSERT_OK(journal.Append(1, "{\"step\":2}", {Gradient({9, 9, 9, 9, 9, 9}), Gradient({7, 8})}));
  const std::string both = Bytes();
  env.FailTruncate("journal.log");
  EXPECT_THAT(journal.WithdrawLast(), StatusIs(absl::StatusCode::kInternal, "cannot truncate"));
  EXPECT_EQ(Bytes(), both);
  ASSERT_OK_AND_ASSIGN(JournalContents kept, Read());
  EXPECT_EQ(kept.records.size(), 2u);
  ASSERT_OK(journal.Append(1, "{\"step\":2}", {Gradient({2, 2, 2, 2, 2, 2}), Gradient({3, 3})}));
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 2u);
  EXPECT_EQ(contents.records[1].gradients[0].values, std::vector<float>(6, 2.0f));

  const std::string two = Bytes();
  ASSERT_OK(journal.Append(1, "{\"step\":3}", {Gradient({4, 4, 4, 4, 4, 4}), Gradient({4, 4})}));
  env.FailTruncate("journal.log", TruncateFault::kTruncatedNotSynced);
  EXPECT_THAT(journal.WithdrawLast(), StatusIs(absl::StatusCode::kInternal, "cannot fsync"));
  EXPECT_EQ(Bytes(), two);
  ASSERT_OK(journal.Append(1, "{\"step\":3}", {Gradient({5, 5, 5, 5, 5, 5}), Gradient({5, 5})}));
  ASSERT_OK_AND_ASSIGN(JournalContents three, Read());
  ASSERT_EQ(three.records.size(), 3u);
  EXPECT_EQ(three.records[2].gradients[0].values, std::vector<float>(6, 5.0f));

  env.FailAppend("journal.log", AppendFault::kNoSpace);
  EXPECT_THAT(journal.Append(1, "{\"step\":4}", {Gradient({1, 1, 1, 1, 1, 1}), Gradient({1, 1})}),
              StatusIs(absl::StatusCode::kResourceExhausted, "No space"));
  EXPECT_THAT(journal.WithdrawLast(), StatusIs(absl::StatusCode::kFailedPrecondition, "no record to withdraw"));
  journal.Close();
  ASSERT_OK_AND_ASSIGN(JournalContents after, Read());
  EXPECT_EQ(after.records.size(), 3u);
}

// Read says where the last complete record ends; a journal opened with it (a restored session's)
// cuts a torn tail off before its next record, which then follows the complete ones.
TEST_F(StepJournalTest, AJournalOpenedAfterATornTailAppendsAfterItsLastCompleteRecord) {
  Write(2);
  const std::string complete = Bytes();
  SetBytes(complete + "MJR4torn");  // a header cut short
  ASSERT_OK_AND_ASSIGN(JournalContents read, Read());
  EXPECT_TRUE(read.dropped_torn_tail);
  EXPECT_EQ(read.complete_bytes, complete.size());
  StepJournal journal(Env::Default());
  ASSERT_OK(journal.Open(path_, read.complete_bytes));
  EXPECT_EQ(Bytes().size(), complete.size() + 8) << "opening cut the tail (a checkpoint may empty it first)";
  ASSERT_OK(journal.Append(1, "{\"step\":3}", {Gradient({3, 3, 3, 3, 3, 3}), Gradient({3, 3})}));
  journal.Close();
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 3u);
  EXPECT_FALSE(contents.dropped_torn_tail);
  EXPECT_EQ(contents.records[2].request, "{\"step\":3}");
  EXPECT_EQ(Bytes().substr(0, complete.size()), complete);
}

TEST_F(StepJournalTest, OnlyARecordCutShortAtTheEndIsATornTail) {
  const std::vector<size_t> offsets = Write(3);
  const std::string full = Bytes();
  // The last record keeps 3 bytes (part of its marker), 10 (part of its header), its header and 2
  // payload bytes, or all but its last byte.
  for (const size_t keep : {size_t{3}, size_t{10}, kHeader + 2, full.size() - offsets[2] - 1}) {
    const size_t cut = full.size() - offsets[2] - keep;
    SetBytes(full.substr(0, offsets[2] + keep));
    SCOPED_TRACE(::testing::Message() << "cut " << cut);
    ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
    EXPECT_EQ(contents.records.size(), 2u) << "cut " << cut;
    EXPECT_TRUE(contents.dropped_torn_tail) << "cut " << cut;
  }
}

TEST_F(StepJournalTest, AnInflatedLengthFollowedByRecordsIsRefusedAndKept) {
  const std::vector<size_t> offsets = Write(5);
  std::string bytes = Bytes();
  // Step 3's payload length set to 0x7fffffff: steps 3 to 5 must not pass for a torn tail.
  const uint64_t inflated = 0x7fffffff;
  std::memcpy(bytes.data() + offsets[2] + 4, &inflated, sizeof(inflated));
  SetBytes(bytes);
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss,
                               "journal " + path_ + " is unusable: record at byte " + std::to_string(offsets[2])));
  EXPECT_EQ(Bytes(), bytes) << "refused bytes are kept";
}

TEST_F(StepJournalTest, AHeaderWithAForgedCrcAndAnImplausibleLengthIsRefused) {
  const std::vector<size_t> offsets = Write(3);
  std::string bytes = Bytes();
  // A length that verifies against a recomputed header CRC but is more than any step could hold.
  const uint64_t inflated = 1u << 30;
  std::memcpy(bytes.data() + offsets[1] + 4, &inflated, sizeof(inflated));
  const uint32_t crc = static_cast<uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data() + offsets[1]), 16));
  std::memcpy(bytes.data() + offsets[1] + 16, &crc, sizeof(crc));
  SetBytes(bytes);
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "a step of this session can hold"));
}

TEST_F(StepJournalTest, AlteredHeadersPayloadsAndMarkersAreRefused) {
  const std::vector<size_t> offsets = Write(3);
  const std::string saved = Bytes();
  for (const size_t at :
       {offsets[1], offsets[1] + 5, offsets[1] + 13, offsets[1] + 17, offsets[1] + kHeader + 2, offsets[1] + 40}) {
    std::string bytes = saved;
    bytes[at] ^= 0x01;
    SetBytes(bytes);
    EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "record at byte " + std::to_string(offsets[1])))
        << "byte " << at;
  }
  // Garbage after the last record is no torn tail either.
  SetBytes(saved + "xy");
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "has no record marker"));
}

TEST_F(StepJournalTest, AGradientOfTheWrongSizeIsRefused) {
  StepJournal journal(Env::Default());
  ASSERT_OK(journal.Open(path_));
  ASSERT_OK(journal.Append(0, "{}", {Gradient({1, 2, 3, 4, 5}), Gradient({7, 8})}));  // one element short
  journal.Close();
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "a gradient of 5 elements for parameter 0"));
}

TEST_F(StepJournalTest, ALinkedOrDanglingJournalIsRefusedAndNothingIsCreatedOutside) {
  fs::create_directory(dir_ + "/outside");
  fs::create_symlink(dir_ + "/outside/journal.log", path_);
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kFailedPrecondition, "symbolic link"));
  StepJournal journal(Env::Default());
  EXPECT_THAT(journal.Open(path_), StatusIs(absl::StatusCode::kFailedPrecondition, "symbolic link"));
  EXPECT_FALSE(fs::exists(dir_ + "/outside/journal.log"));
}

uint32_t Crc(absl::string_view bytes) {
  return static_cast<uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

// The payload of the earlier formats (no generation): a request "{}" and parameter 1's gradient.
std::string PayloadWithoutGeneration(std::vector<float> values = {7, 8}, double sum_squares = 113) {
  std::string payload;
  const uint32_t request_length = 2, present = 1, index = 1;
  const uint64_t count = 2;
  payload.append(reinterpret_cast<const char*>(&request_length), 4).append("{}");
  payload.append(reinterpret_cast<const char*>(&present), 4).append(reinterpret_cast<const char*>(&index), 4);
  payload.append(reinterpret_cast<const char*>(&count), 8).append(reinterpret_cast<const char*>(&sum_squares), 8);
  payload.append(reinterpret_cast<const char*>(values.data()), 8);
  return payload;
}

// The previous format: "MJR2" | u32 length | CRC-32 of the payload | payload.
std::string PreviousFormatRecord(const std::string& payload) {
  std::string record = "MJR2";
  const uint32_t length = static_cast<uint32_t>(payload.size());
  const uint32_t crc = Crc(payload);
  record.append(reinterpret_cast<const char*>(&length), 4);
  record.append(reinterpret_cast<const char*>(&crc), 4);
  return record + payload;
}

// The format before the generation: "MJR3" | u64 length | CRC-32 of the payload | CRC-32 of the
// header's 16 bytes before it | payload.
std::string FormatWithoutGenerationRecord(const std::string& payload) {
  std::string record = "MJR3";
  const uint64_t length = payload.size();
  const uint32_t crc = Crc(payload);
  record.append(reinterpret_cast<const char*>(&length), 8);
  record.append(reinterpret_cast<const char*>(&crc), 4);
  const uint32_t header_crc = Crc(record);
  record.append(reinterpret_cast<const char*>(&header_crc), 4);
  return record + payload;
}

TEST_F(StepJournalTest, RecordsWithoutAGenerationAreReadAsGenerationZero) {
  Write(3);  // generations 0, 1, 1
  const std::string old_record = FormatWithoutGenerationRecord(PayloadWithoutGeneration());
  SetBytes(old_record + Bytes() + old_record);
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 5u);
  EXPECT_EQ(contents.records[0].checkpoint_generation, 0u);
  EXPECT_EQ(contents.records[0].request, "{}");
  EXPECT_EQ(contents.records[0].gradients[1].values, (std::vector<float>{7, 8}));
  EXPECT_FALSE(contents.records[0].gradients[0].present());
  EXPECT_EQ(contents.records[3].checkpoint_generation, 1u);
  EXPECT_EQ(contents.records[3].request, "{\"step\":3}");
  EXPECT_EQ(contents.records[4].checkpoint_generation, 0u);
}

TEST_F(StepJournalTest, ThePreviousFormatIsStillReadWithinThePlausibleBound) {
  const std::string payload = PayloadWithoutGeneration();
  const std::string record = PreviousFormatRecord(payload);
  SetBytes(record + record);
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  ASSERT_EQ(contents.records.size(), 2u);
  EXPECT_EQ(contents.records[1].gradients[1].values, (std::vector<float>{7, 8}));

  std::string inflated = record;
  const uint32_t length = 0x7fffffff;
  std::memcpy(inflated.data() + 4, &length, 4);
  SetBytes(inflated + record);
  EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "record at byte 0 declares 2147483647 payload bytes"));
}

// The replay skips a step and clips it by the sums of squares a record keeps, not by its values: a
// record whose sum cannot be its values' (checksums made to match) is refused, the values' sum
// taken again in fp64. A non-finite value has a non-finite sum, and a finite one a sum within
// rounding of Σv² (113 for 7, 8).
TEST_F(StepJournalTest, ARecordWhoseSumOfSquaresIsNotItsValuesIsRefused) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const struct {
    std::vector<float> values;
    double sum_squares;
  } refused[] = {{{7, 8}, std::numeric_limits<double>::quiet_NaN()},  // would skip an applied step
                 {{7, 8}, 0},                                         // would not clip
                 {{7, 8}, -1},
                 {{7, 8}, 113 * (1 + 1e-5)},
                 {{nan, 8}, 64},  // would apply NaN
                 {{inf, 8}, 113},
                 {{1e30f, 8}, 113}};
  for (const auto& c : refused) {
    SetBytes(FormatWithoutGenerationRecord(PayloadWithoutGeneration(c.values, c.sum_squares)));
    EXPECT_THAT(Read(), StatusIs(absl::StatusCode::kDataLoss, "record at byte 0 holds a gradient of parameter 1 with"))
        << c.values[0] << " " << c.sum_squares;
  }
  const struct {
    std::vector<float> values;
    double sum_squares;
  } accepted[] = {{{7, 8}, 113 * (1 + 1e-9)},
                  {{nan, 8}, std::numeric_limits<double>::quiet_NaN()},
                  {{inf, 8}, std::numeric_limits<double>::infinity()},
                  {{0, 0}, 0}};
  for (const auto& c : accepted) {
    SetBytes(FormatWithoutGenerationRecord(PayloadWithoutGeneration(c.values, c.sum_squares)));
    EXPECT_OK(Read().status()) << c.values[0] << " " << c.sum_squares;
  }
}

// The journal is read a record at a time: a file that claims 64 GiB past its last record (sparse,
// holding almost nothing) is refused at the first bytes that are no record, without memory for its
// size.
TEST_F(StepJournalTest, AJournalIsReadARecordAtATime) {
  const std::vector<size_t> offsets = Write(2);
  const uintmax_t written = fs::file_size(path_);
  fs::resize_file(path_, written + (uintmax_t{64} << 30));
  EXPECT_THAT(Read(),
              StatusIs(absl::StatusCode::kDataLoss, absl::StrCat("record at byte ", written, " has no record marker")));
  fs::resize_file(path_, written);
  ASSERT_OK_AND_ASSIGN(JournalContents contents, Read());
  EXPECT_EQ(contents.records.size(), offsets.size());
}

// A payload larger than what is read whole (64 MiB) is checked against its CRC piece by piece first,
// then read: it round-trips, and one flipped byte in it is refused as altered.
TEST_F(StepJournalTest, ALargeRecordIsCheckedBeforeItIsRead) {
  const std::vector<int64_t> numel = {int64_t{20} << 20};  // 80 MiB of fp32
  std::vector<float> values(static_cast<size_t>(numel[0]));
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 97) - 48;
  {
    StepJournal journal(Env::Default());
    ASSERT_OK(journal.Open(path_));
    ASSERT_OK(journal.Append(0, "{\"step\":1}", {Gradient(values)}));
    journal.Close();
  }
  ASSERT_OK_AND_ASSIGN(JournalContents contents, StepJournal::Read(Env::Default(), path_, numel));
  ASSERT_EQ(contents.records.size(), 1u);
  EXPECT_EQ(contents.records[0].gradients[0].values, values);
  std::string bytes = Bytes();
  bytes[bytes.size() - 1000] ^= 0x40;
  SetBytes(bytes);
  EXPECT_THAT(StepJournal::Read(Env::Default(), path_, numel),
              StatusIs(absl::StatusCode::kDataLoss, "record at byte 0 fails its CRC"));
}

}  // namespace
}  // namespace muond::durability
