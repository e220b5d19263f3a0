// Checkpoints in process: a round trip keeps every field and value; a checkpoint.json whose digest
// matches but whose fields have the wrong type or are missing is refused as unusable (DATA_LOSS
// naming the file), never read as a default or thrown; truncated tensors are refused too.
#include "server/durability/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/half_float.h"
#include "gmock/gmock.h"
#include "nlohmann/json.hpp"
#include "server/durability/fault_injecting_env.h"
#include "server/durability/file_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::durability {
namespace {

using ::muond::testing::StatusIs;
using nlohmann::json;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-checkpoint-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    data_.session_id = "s";
    data_.owner = "alice";
    data_.spec_json = R"({"parameters":[{"name":"w","shape":["2","3"]}]})";
    data_.backend = "cpu";
    data_.last_step = 7;
    data_.generation = 12;
    data_.step_counts = {{"w", 7}};
    data_.tensors = {{"w", "master", {2, 3}, {1, 2, 3, 4, 5, 6}}, {"w", "momentum", {2, 3}, {0, 0, 1, 0, 0, -1}}};
    ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Rewrites checkpoint.json through `edit`, with a digest that matches again.
  void EditMetadata(const std::function<void(json&)>& edit) {
    const std::string path = dir_ + "/" + kCheckpointMetadataFile;
    json metadata = json::parse(Env::Default()->ReadFile(path, kNoReadLimit).value());
    edit(metadata);
    metadata.erase("metadata_sha256");
    metadata["metadata_sha256"] = Sha256Hex(metadata.dump());
    ASSERT_OK(WriteFileAtomically(Env::Default(), path, metadata.dump(2)));
  }

  std::string dir_;
  CheckpointData data_;
};

TEST_F(CheckpointTest, ARoundTripKeepsEverything) {
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.session_id, "s");
  EXPECT_EQ(read.owner, "alice");
  EXPECT_EQ(json::parse(read.spec_json), json::parse(data_.spec_json));
  EXPECT_EQ(read.last_step, 7);
  EXPECT_EQ(read.generation, 12u);
  EXPECT_EQ(read.step_counts, data_.step_counts);
  ASSERT_EQ(read.tensors.size(), 2u);
  EXPECT_EQ(read.tensors[1].slot, "momentum");
  EXPECT_EQ(read.tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(read.tensors[1].values, data_.tensors[1].values);
}

// Every bf16 and fp16 value is written as the 16-bit word it is stored as (the words a
// value-by-value rounding gives) and read back as the same fp32 value, also where an odd count
// before it leaves a tensor's bytes at an address no multiple of 4 (odd byte addresses:
// HalfRangesTest.ElementsAtAnyByteAddressConvertAsTheWordOnes).
TEST_F(CheckpointTest, SixteenBitTensorsKeepEveryValueAtAnyAlignment) {
  std::vector<float> every_bf16(1 << 16), every_fp16(1 << 16);
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    every_bf16[bits] = Bf16ToFloat(static_cast<uint16_t>(bits));
    every_fp16[bits] = Fp16ToFloat(static_cast<uint16_t>(bits));
  }
  data_.tensors = {{"w", "master", {2, 3}, {1, 2, 3, 4, 5, 6}},
                   {"w", "odd", {3}, {0.5f, -2.0f, 65504.0f}, "F16"},
                   {"w", "exp_avg", {1 << 16}, every_bf16, "BF16"},
                   {"w", "exp_avg_sq", {1 << 16}, every_fp16, "F16"}};
  const std::string encoded = EncodeSafetensors(data_);
  uint64_t header = 0;
  std::memcpy(&header, encoded.data(), 8);
  size_t at = 8 + header + 6 * sizeof(float);
  for (size_t t = 1; t < data_.tensors.size(); ++t) {
    const CheckpointTensor& tensor = data_.tensors[t];
    for (size_t i = 0; i < tensor.values.size(); ++i, at += 2) {
      uint16_t word = 0;
      std::memcpy(&word, encoded.data() + at, 2);
      const float x = tensor.values[i];
      ASSERT_EQ(word, tensor.dtype == "BF16" ? FloatToBf16(x) : FloatToFp16(x)) << tensor.slot << "[" << i << "]";
    }
  }
  ASSERT_EQ(at, encoded.size());

  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_EQ(read.tensors.size(), data_.tensors.size());
  for (size_t t = 1; t < data_.tensors.size(); ++t) {
    const std::vector<float>& want = data_.tensors[t].values;
    auto found = std::find_if(read.tensors.begin(), read.tensors.end(),
                              [&](const CheckpointTensor& r) { return r.slot == data_.tensors[t].slot; });
    ASSERT_NE(found, read.tensors.end()) << data_.tensors[t].slot;
    EXPECT_EQ(found->dtype, data_.tensors[t].dtype);
    const std::vector<float>& got = found->values;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << data_.tensors[t].slot << "[" << i << "]";
      } else {
        EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
            << data_.tensors[t].slot << "[" << i << "]";
      }
    }
  }
}

TEST_F(CheckpointTest, FieldsOfTheWrongTypeAreRefusedNotThrown) {
  for (const auto& edit : std::vector<std::function<void(json&)>>{
           [](json& m) { m["last_step"] = "seven"; },
           [](json& m) { m.erase("last_step"); },
           [](json& m) {
             m["step_counts"] = json::array({1, 2});
           },
           [](json& m) { m["step_counts"]["w"] = "x"; },
           [](json& m) { m["tensors"] = "file"; },
           [](json& m) { m["tensors"]["bytes"] = -1; },
           [](json& m) { m["spec"] = 3; },
           [](json& m) { m["generation"] = -1; },
           [](json& m) { m["generation"] = "12"; },
       }) {
    TearDown();
    SetUp();  // a fresh checkpoint for each edit
    EditMetadata(edit);
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_),
                StatusIs(absl::StatusCode::kDataLoss, "checkpoint.json is unusable"));
  }
}

// A checkpoint of an earlier version has no generation: it reads as generation 0, which every
// journal record of that version has too.
TEST_F(CheckpointTest, ACheckpointWithoutAGenerationReadsAsGenerationZero) {
  EditMetadata([](json& m) { m.erase("generation"); });
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.generation, 0u);
  EXPECT_EQ(read.last_step, 7);
}

// An asynchronous session's push records keep their outcome; a record of three numbers (an applied
// push, as earlier versions write and read them) reads as applied; another shape is refused.
TEST_F(CheckpointTest, PushRecordsKeepTheirOutcomeAndOlderRecordsReadAsApplied) {
  data_.pushes = {{3, 5, 1, true, ""}, {2, 4, 0, false, "non-finite gradient in 'w'"}};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_EQ(read.pushes.size(), 2u);
  EXPECT_EQ(read.pushes[0].push, 3);
  EXPECT_EQ(read.pushes[0].global_step, 5);
  EXPECT_EQ(read.pushes[0].staleness, 1);
  EXPECT_TRUE(read.pushes[0].applied);
  EXPECT_FALSE(read.pushes[1].applied);
  EXPECT_EQ(read.pushes[1].skip_reason, "non-finite gradient in 'w'");
  // An applied push is written as the three numbers earlier versions read; a skipped one in full.
  const json written =
      json::parse(Env::Default()->ReadFile(dir_ + "/" + kCheckpointMetadataFile, kNoReadLimit).value());
  EXPECT_EQ(written["pushes"][0], json::array({3, 5, 1}));
  EXPECT_EQ(written["pushes"][1].size(), 5u);

  EditMetadata([](json& m) { m["pushes"] = json::array({json::array({3, 5, 1}), json::array({2, 4, 0})}); });
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_EQ(read.pushes.size(), 2u);
  EXPECT_TRUE(read.pushes[0].applied && read.pushes[1].applied);
  EXPECT_EQ(read.pushes[1].skip_reason, "");

  for (const json& record : {json::array({3, 5}), json::array({3, 5, 1, true}), json::array({3, 5, 1, 1, ""}),
                             json::array({3, 5, 1, false, 7}), json::array({3, "5", 1, true, ""}),
                             json::array({3, 5, 1, false, std::string(kMaxCheckpointSkipReason + 1, 'x')})}) {
    EditMetadata([&](json& m) { m["pushes"] = json::array({record}); });
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_),
                StatusIs(absl::StatusCode::kDataLoss, "a push record is not [push, global_step, staleness"))
        << record.dump();
  }
}

// The record of parts written rank by rank round-trips, an upload's without a step; a record of
// another shape is refused. Absent, it reads as absent.
TEST_F(CheckpointTest, PartsWrittenRoundTripAndAnotherShapeIsRefused) {
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_FALSE(read.parts_written.has_value());
  data_.parts_written =
      CheckpointPartsWritten{.upload = false, .last_step = 7, .step_counts = {{"w", 6}}, .ranks = {0, 2}};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_TRUE(read.parts_written.has_value());
  EXPECT_FALSE(read.parts_written->upload);
  EXPECT_EQ(read.parts_written->last_step, 7);
  EXPECT_EQ(read.parts_written->step_counts, data_.parts_written->step_counts);
  EXPECT_EQ(read.parts_written->ranks, (std::vector<int64_t>{0, 2}));
  data_.parts_written = CheckpointPartsWritten{.upload = true, .last_step = 0, .step_counts = {}, .ranks = {1}};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  const json written =
      json::parse(Env::Default()->ReadFile(dir_ + "/" + kCheckpointMetadataFile, kNoReadLimit).value());
  EXPECT_EQ(written["parts_written"], json({{"of", "upload"}, {"ranks", {1}}}));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_TRUE(read.parts_written.has_value());
  EXPECT_TRUE(read.parts_written->upload);
  EXPECT_EQ(read.parts_written->ranks, (std::vector<int64_t>{1}));

  for (const json& record :
       {json(3), json({{"of", "upload"}}), json({{"of", "write"}, {"ranks", {0}}}),
        json({{"of", "upload"}, {"ranks", {"0"}}}), json({{"of", "upload"}, {"ranks", 0}}),
        json({{"of", "load"}, {"ranks", {0}}}),
        json({{"of", "load"}, {"ranks", {0}}, {"last_step", "7"}, {"step_counts", json::object()}}),
        json({{"of", "load"}, {"ranks", {0}}, {"last_step", 7}, {"step_counts", {{"w", 1.5}}}})}) {
    EditMetadata([&](json& m) { m["parts_written"] = record; });
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "parts_written"))
        << record.dump();
  }
}

// The last step's decision round-trips (a norm that is not finite as null, read back as NaN);
// absent, it reads as absent; one of another shape, or a skip without its reason, is refused.
TEST_F(CheckpointTest, TheLastDecisionRoundTripsAndAnotherShapeIsRefused) {
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_FALSE(read.last_decision.has_value());
  data_.last_decision = CheckpointLastDecision{.applied = true, .grad_norm = 13.000000000000002, .skip_reason = ""};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_TRUE(read.last_decision.has_value());
  EXPECT_TRUE(read.last_decision->applied);
  EXPECT_EQ(read.last_decision->grad_norm, 13.000000000000002) << "every bit of the norm clipping used";
  data_.last_decision = CheckpointLastDecision{.applied = false, .grad_norm = NAN, .skip_reason = "non-finite"};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  const json written =
      json::parse(Env::Default()->ReadFile(dir_ + "/" + kCheckpointMetadataFile, kNoReadLimit).value());
  EXPECT_EQ(written["last_decision"],
            json({{"applied", false}, {"grad_norm", nullptr}, {"skip_reason", "non-finite"}}));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_TRUE(read.last_decision.has_value());
  EXPECT_FALSE(read.last_decision->applied);
  EXPECT_TRUE(std::isnan(read.last_decision->grad_norm));
  EXPECT_EQ(read.last_decision->skip_reason, "non-finite");

  for (const json& decision :
       {json(3), json({{"applied", true}}), json({{"applied", 1}, {"grad_norm", 2.0}, {"skip_reason", ""}}),
        json({{"applied", true}, {"grad_norm", "2"}, {"skip_reason", ""}}),
        json({{"applied", true}, {"grad_norm", -1.0}, {"skip_reason", ""}}),
        json({{"applied", false}, {"grad_norm", 2.0}, {"skip_reason", ""}}),
        json({{"applied", true}, {"grad_norm", 2.0}, {"skip_reason", std::string(5000, 'x')}})}) {
    EditMetadata([&](json& m) { m["last_decision"] = decision; });
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "last_decision"))
        << decision.dump();
  }
}

// The last steps' contributors round-trip, every bit of a weight kept; absent (a one-rank session,
// an earlier version), they read as none; a record of another shape or out of order is refused.
TEST_F(CheckpointTest, TheContributorsRoundTripAndAnotherShapeIsRefused) {
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_TRUE(read.contributors.empty());
  data_.contributors = {{.step = 5, .total_weight = 0.30000000000000004, .ranks = {0, 2}},
                        {.step = 7, .total_weight = 3, .ranks = {0, 1, 2}}};
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  const json written =
      json::parse(Env::Default()->ReadFile(dir_ + "/" + kCheckpointMetadataFile, kNoReadLimit).value());
  EXPECT_EQ(written["contributors"], json::parse("[[5, 0.30000000000000004, [0, 2]], [7, 3.0, [0, 1, 2]]]"));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  ASSERT_EQ(read.contributors.size(), 2u);
  EXPECT_EQ(read.contributors[0].step, 5);
  EXPECT_EQ(read.contributors[0].total_weight, 0.30000000000000004);
  EXPECT_EQ(read.contributors[0].ranks, (std::vector<int>{0, 2}));
  EXPECT_EQ(read.contributors[1].step, 7);
  EXPECT_EQ(read.contributors[1].ranks, (std::vector<int>{0, 1, 2}));

  json too_many = json::array();
  for (int step = 1; step <= static_cast<int>(kMaxCheckpointContributorSteps) + 1; ++step) {
    too_many.push_back({step, 1.0, {0}});
  }
  for (const json& records :
       {json(3), json::parse("[[5, 1.0]]"), json::parse("[[5, \"1\", [0]]]"), json::parse("[[5, 1.0, []]]"),
        json::parse("[[5, 1.0, [-1]]]"), json::parse("[[5, 1.0, [1048576]]]"), json::parse("[[5.5, 1.0, [0]]]"),
        json::parse("[[5, 1.0, [\"0\"]]]"), json::parse("[[6, 1.0, [0]], [5, 1.0, [0]]]"),
        json::parse("[[5, 1.0, [0]], [5, 1.0, [1]]]"), json::parse("[[0, 1.0, [0]]]"), json::parse("[[8, 1.0, [0]]]"),
        json::parse("[[5, 0.0, [0]]]"), json::parse("[[5, -2.0, [0]]]"), json::parse("[[5, 1.0, [1, 0]]]"),
        json::parse("[[5, 1.0, [1, 1]]]"), too_many}) {
    EditMetadata([&](json& m) { m["contributors"] = records; });
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "contributors"))
        << records.dump();
  }
}

TEST_F(CheckpointTest, AlteredOrTruncatedFilesAreRefusedNamingThem) {
  const std::string path = dir_ + "/" + kCheckpointMetadataFile;
  std::string text = Env::Default()->ReadFile(path, kNoReadLimit).value();
  text.replace(text.find("alice"), 5, "mallo");
  ASSERT_OK(WriteFileAtomically(Env::Default(), path, text));
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "altered"));
  TearDown();
  SetUp();
  EditMetadata([](json& m) { m["tensors"]["bytes"] = m["tensors"]["bytes"].get<uint64_t>() - 4; });
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "safetensors is unusable"));
}

TEST_F(CheckpointTest, DeeplyNestedJsonIsRefusedNotAStackOverflow) {
  // 200,000 nested arrays: copying or dumping the parsed document would recurse once per level.
  const std::string deep = "{\"format\":" + std::string(200000, '[') + std::string(200000, ']') + "}";
  ASSERT_OK(WriteFileAtomically(Env::Default(), dir_ + "/" + kCheckpointMetadataFile, deep));
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_),
              StatusIs(absl::StatusCode::kDataLoss, "checkpoint.json is unusable: nests deeper than 64 levels"));
}

TEST_F(CheckpointTest, ATensorsFileOutsideTheFolderIsRefusedNamingTheField) {
  for (const std::string name : {"../../../../../../dev/zero", "/dev/zero", "../outside/checkpoint-1.safetensors",
                                 "checkpoint-1.safetensors/../../x", ""}) {
    EditMetadata([&](json& m) { m["tensors"]["file"] = name; });
    EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kDataLoss, "tensors.file")) << name;
  }
}

TEST_F(CheckpointTest, LinkedFilesAndFoldersAreRefused) {
  const std::string metadata = dir_ + "/" + kCheckpointMetadataFile;
  const std::string tensors = dir_ + "/checkpoint-000000000007.safetensors";
  ASSERT_TRUE(std::filesystem::exists(tensors));
  // The tensor file moved out of the folder, a link left in its place.
  std::filesystem::rename(tensors, dir_ + ".tensors");
  std::filesystem::create_symlink(dir_ + ".tensors", tensors);
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_),
              StatusIs(absl::StatusCode::kFailedPrecondition, tensors + ": it is a symbolic link"));
  std::filesystem::remove(tensors);
  std::filesystem::rename(dir_ + ".tensors", tensors);
  // checkpoint.json linked to /dev/zero.
  std::filesystem::rename(metadata, dir_ + ".json");
  std::filesystem::create_symlink("/dev/zero", metadata);
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_), StatusIs(absl::StatusCode::kFailedPrecondition, metadata));
  std::filesystem::remove(metadata);
  std::filesystem::rename(dir_ + ".json", metadata);
  // The whole folder reached through a link.
  std::filesystem::create_directory_symlink(dir_, dir_ + ".link");
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_ + ".link"),
              StatusIs(absl::StatusCode::kFailedPrecondition, dir_ + ".link is a symbolic link"));
  std::filesystem::remove(dir_ + ".link");
  ASSERT_OK(ReadCheckpoint(Env::Default(), dir_).status());
}

TEST_F(CheckpointTest, AFifoInPlaceOfAFileDoesNotHang) {
  const std::string metadata = dir_ + "/" + kCheckpointMetadataFile;
  std::filesystem::remove(metadata);
  ASSERT_EQ(mkfifo(metadata.c_str(), 0600), 0);
  EXPECT_THAT(ReadCheckpoint(Env::Default(), dir_),
              StatusIs(absl::StatusCode::kFailedPrecondition, metadata + ": not a regular file"));
}

// A spec of explicit ranges, nested four levels deep: an indented checkpoint.json took about ten
// times its bytes and passed what a restore reads while the spec was well under it. The metadata
// costs the spec's compact JSON and little more.
TEST_F(CheckpointTest, TheMetadataTakesTheSpecsCompactSizeAndIsRead) {
  json ranks = json::array();
  for (int r = 0; r < 64; ++r) {
    json ranges = json::array();
    for (int p = 0; p < 64; ++p) ranges.push_back({{"parameter", "w"}, {"begin", "0"}, {"end", "1"}});
    ranks.push_back({{"ranges", ranges}});
  }
  json spec = json::parse(data_.spec_json);
  spec["groups"] =
      json::array({{{"name", "g"}, {"partition", {{"kind", "PARTITION_KIND_EXPLICIT"}, {"ranks", ranks}}}}});
  data_.spec_json = spec.dump();
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(std::string written,
                       Env::Default()->ReadFile(dir_ + "/" + kCheckpointMetadataFile, kNoReadLimit));
  EXPECT_LT(written.size(), data_.spec_json.size() + 1024);
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(json::parse(read.spec_json), spec);
}

// What a restore would refuse to read is never written: the checkpoint before it stays.
TEST_F(CheckpointTest, MetadataPastWhatARestoreReadsIsNotWritten) {
  CheckpointData huge = data_;
  huge.last_step = 8;
  huge.spec_json =
      json({{"parameters", json::array()}, {"note", std::string(kMaxCheckpointMetadataBytes, 'x')}}).dump();
  EXPECT_THAT(WriteCheckpoint(Env::Default(), dir_, huge),
              StatusIs(absl::StatusCode::kFailedPrecondition, "a restore reads; not written"));
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.last_step, 7);
}

// Another checkpoint of the same step (ranks uploading or loading their parts, a SetState of the
// current step) never writes over the tensor file the checkpoint in place names: when its
// checkpoint.json cannot be written, the one before still reads back whole.
TEST_F(CheckpointTest, AFailedCheckpointOfTheSameStepLeavesThePreviousOneReadable) {
  FaultInjectingEnv env(Env::Default());
  CheckpointData other = data_;
  other.tensors[0].values = {6, 5, 4, 3, 2, 1};
  env.FailAppend(kCheckpointMetadataFile, AppendFault::kNoSpace);
  EXPECT_FALSE(WriteCheckpoint(&env, dir_, other).ok());
  ASSERT_OK_AND_ASSIGN(CheckpointData read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.tensors[0].values, data_.tensors[0].values);

  // Written, it takes a name of its contents beside the step's; the next one of the step the plain one.
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, other));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.tensors[0].values, other.tensors[0].values);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/checkpoint-000000000007.safetensors"));
  ASSERT_OK(WriteCheckpoint(Env::Default(), dir_, data_));
  ASSERT_OK_AND_ASSIGN(read, ReadCheckpoint(Env::Default(), dir_));
  EXPECT_EQ(read.tensors[0].values, data_.tensors[0].values);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/checkpoint-000000000007.safetensors"));
}

// A session whose checkpoints could not all be read back is refused before it exists: the spec, a
// count per parameter twice and a push record per rank, each at its largest.
TEST(CheckpointRoomTest, ASpecWhoseCheckpointsCouldNotBeReadIsRefusedNamingTheSpec) {
  const std::string small_spec = R"({"parameters":[{"name":"w","shape":["2","3"]}]})";
  EXPECT_OK(CheckCheckpointRoom(small_spec, {"w"}, 1024));
  // 100 000 parameters of 256-byte names: their counts alone take about 56 MB, the spec most of the rest.
  std::vector<std::string> names;
  json parameters = json::array();
  for (int i = 0; i < 100000; ++i) {
    names.push_back(absl::StrCat(i, std::string(250, 'n')).substr(0, 256));
    parameters.push_back({{"name", names.back()}, {"shape", {"1"}}, {"group", "g"}});
  }
  const std::string many = json({{"parameters", parameters}}).dump();
  EXPECT_THAT(CheckCheckpointRoom(many, names, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec: a checkpoint of this session could take"));
  names.resize(50000);  // half of them fit
  parameters.erase(parameters.begin() + 50000, parameters.end());
  EXPECT_OK(CheckCheckpointRoom(json({{"parameters", parameters}}).dump(), names, 1024));
}

}  // namespace
}  // namespace muond::durability
