// Ranks that hold parts, from the C++ client (docs/ranks.md, Ranks that hold parts): the real
// daemon, one client handle per rank, each HoldParts(rank); every rank uploads and steps only its
// part of each partitioned parameter and gets back only that part, equal bit for bit to the same
// part of a one-rank session stepping the whole gradient, whether the step is sent whole or
// streamed gradient by gradient, and whatever loss scale each rank's gradients carry; HSDP
// replicas of the partitions step the weighted mean of their parts. Runs once per step transport.
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "client/streamed_step.h"
#include "common/partition_rules.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

constexpr int kWorld = 3;

struct PartitionedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// "w" (5 rows over 3 ranks: 2, 2, 1) and "t" (2 rows: rank 2 holds none) cut by rows; "b" and "c"
// by a flat partition with alignment 4 (7 and 5 elements padded to 8 each, cut into ranges of 6).
const std::vector<PartitionedParam> kRows = {{"w", {5, 4}}, {"t", {2, 4}}};
const std::vector<PartitionedParam> kFlat = {{"b", {7}}, {"c", {5}}};

v1::SessionSpec Spec(bool partitioned) {
  v1::SessionSpec spec;
  spec.set_world_size(partitioned ? kWorld : 1);
  auto* rows = spec.add_groups();
  rows->set_name("rows");
  rows->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  auto* flat = spec.add_groups();
  flat->set_name("flat");
  flat->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  if (partitioned) {
    rows->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
    flat->mutable_partition()->set_kind(v1::PARTITION_KIND_FLAT);
    flat->mutable_partition()->set_alignment(4);
  }
  for (const auto& [params, group] : {std::pair{&kRows, "rows"}, std::pair{&kFlat, "flat"}}) {
    for (const PartitionedParam& p : *params) {
      auto* added = spec.add_parameters();
      added->set_name(p.name);
      for (int64_t d : p.shape) added->add_shape(d);
      added->set_group(group);
    }
  }
  return spec;
}

std::vector<float> Values(const std::string& name, int64_t n, int step) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] =
        0.1f * std::sin(0.7f * static_cast<float>(i) + static_cast<float>(name[0]) + 1.3f * static_cast<float>(step));
  }
  return v;
}

// Rank r's range of each parameter, by the daemon's rules.
std::map<std::string, ElementRange> PartsOf(int rank) {
  std::map<std::string, ElementRange> parts;
  for (const PartitionedParam& p : kRows) parts[p.name] = RowParts(p.shape, kWorld)[static_cast<size_t>(rank)];
  const std::vector<std::vector<ElementRange>> flat = FlatParts({7, 5}, 4, kWorld);
  for (size_t k = 0; k < kFlat.size(); ++k) parts[kFlat[k].name] = flat[k][static_cast<size_t>(rank)];
  return parts;
}

std::vector<float> Slice(const std::vector<float>& whole, ElementRange range) {
  return {whole.begin() + range.begin, whole.begin() + range.end};
}

std::vector<PartitionedParam> AllParams() {
  std::vector<PartitionedParam> all = kRows;
  all.insert(all.end(), kFlat.begin(), kFlat.end());
  return all;
}

std::map<std::string, std::vector<float>> InitialValues() {
  std::map<std::string, std::vector<float>> initial;
  for (const PartitionedParam& p : AllParams()) initial[p.name] = Values(p.name, p.numel(), 0);
  return initial;
}

// Rank `rank`'s upload of its parts of `initial` through its handle.
absl::Status UploadParts(client::Session& session, int rank, const std::map<std::string, std::vector<float>>& initial) {
  const std::map<std::string, ElementRange> parts = PartsOf(rank);
  std::map<std::string, std::vector<float>> mine;
  std::vector<client::TensorView> upload;
  for (const PartitionedParam& p : AllParams()) mine[p.name] = Slice(initial.at(p.name), parts.at(p.name));
  for (const PartitionedParam& p : AllParams()) upload.push_back({p.name, {parts.at(p.name).size()}, mine[p.name]});
  return session.UploadParameters(upload);
}

// The reference: one rank stepping whole tensors from InitialValues(), step k with the whole
// gradients grads(p, k); its parameters after `steps` steps.
absl::StatusOr<client::ParameterMap> OneRankSteps(
    client::Client& client, const std::string& id, int steps,
    const std::function<std::vector<float>(const PartitionedParam&, int)>& grads) {
  MUOND_ASSIGN_OR_RETURN(auto single, client.CreateSession(id, Spec(false)));
  std::map<std::string, std::vector<float>> initial = InitialValues();
  std::vector<client::TensorView> views;
  for (const PartitionedParam& p : AllParams()) views.push_back({p.name, p.shape, initial[p.name]});
  MUOND_RETURN_IF_ERROR(single->UploadParameters(views));
  client::ParameterMap last;
  for (int step = 1; step <= steps; ++step) {
    std::map<std::string, std::vector<float>> given;
    std::vector<client::TensorView> g;
    for (const PartitionedParam& p : AllParams()) given[p.name] = grads(p, step);
    for (const PartitionedParam& p : AllParams()) g.push_back({p.name, p.shape, given[p.name]});
    MUOND_ASSIGN_OR_RETURN(client::StepReply reply, single->Step(step, g));
    last = std::move(reply.parameters);
  }
  return last;
}

class PartitionTest : public DaemonTest {};

TEST_F(PartitionTest, RanksThatHoldPartsStepBitForBitLikeOneRank) {
  constexpr int kSteps = 3;
  const std::vector<PartitionedParam> all = AllParams();

  ASSERT_OK_AND_ASSIGN(const client::ParameterMap want,
                       OneRankSteps(*client_, "parts-whole", kSteps, [](const PartitionedParam& p, int step) {
                         return Values(p.name, p.numel(), step);
                       }));
  const std::map<std::string, std::vector<float>> initial = InitialValues();

  // kWorld ranks, each with its own handle holding its parts.
  std::vector<std::unique_ptr<client::Session>> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("parts", Spec(true)));
    ASSERT_OK(session->HoldParts(r));
    ASSERT_OK(UploadParts(*session, r, initial));
    const std::map<std::string, ElementRange> parts = PartsOf(r);
    for (const PartitionedParam& p : all)
      EXPECT_EQ(session->element_counts().at(p.name), parts.at(p.name).size()) << p.name;
    ranks.push_back(std::move(session));
  }
  std::vector<client::ParameterMap> got(kWorld);
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<std::future<absl::StatusOr<client::StepReply>>> sent;
    for (int r = 0; r < kWorld; ++r) {
      sent.push_back(std::async(std::launch::async, [&, r, step] {
        const std::map<std::string, ElementRange> parts = PartsOf(r);
        std::map<std::string, std::vector<float>> grads;
        std::vector<client::TensorView> g;
        client::StepOptions options;
        options.rank = r;
        // Step 3 with a loss scale of each rank's own (rank 1 none): powers of two, divided out exactly.
        const std::optional<double> scales[kWorld] = {4.0, std::nullopt, 256.0};
        if (step == 3) options.grad_scale = scales[r];
        const float scale = static_cast<float>(options.grad_scale.value_or(1.0));
        for (const PartitionedParam& p : all) {
          grads[p.name] = Slice(Values(p.name, p.numel(), step), parts.at(p.name));
          for (float& v : grads[p.name]) v *= scale;
        }
        for (const PartitionedParam& p : all) g.push_back({p.name, {parts.at(p.name).size()}, grads[p.name]});
        client::Session& session = *ranks[static_cast<size_t>(r)];
        if (step != 2) return session.Step(step, g, options);
        // Step 2 streamed, each gradient added as backward would hand it over (rank 2's empty
        // part of "t" among them: not sent, as Step leaves it out).
        absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session.BeginStreamedStep(step, options);
        if (!streamed.ok()) return absl::StatusOr<client::StepReply>(streamed.status());
        for (const client::TensorView& view : g) {
          if (absl::Status added = (*streamed)->Add(view); !added.ok()) return absl::StatusOr<client::StepReply>(added);
        }
        return (*streamed)->Finish(options);
      }));
    }
    for (int r = 0; r < kWorld; ++r) {
      absl::StatusOr<client::StepReply> reply = sent[static_cast<size_t>(r)].get();
      ASSERT_OK(reply.status()) << "rank " << r << " step " << step;
      EXPECT_TRUE(reply->applied);
      got[static_cast<size_t>(r)] = reply->parameters;
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    const std::map<std::string, ElementRange> parts = PartsOf(r);
    for (const PartitionedParam& p : all) {
      EXPECT_EQ(got[static_cast<size_t>(r)].at(p.name), Slice(want.at(p.name), parts.at(p.name)))
          << "rank " << r << " '" << p.name << "'";
    }
    // A restarted rank reads its parts back.
    ASSERT_OK_AND_ASSIGN(auto reread, client_->CreateSession("parts", Spec(true)));
    ASSERT_OK(reread->HoldParts(r));
    ASSERT_OK_AND_ASSIGN(client::ParameterMap back, reread->GetParameters());
    EXPECT_EQ(back, got[static_cast<size_t>(r)]) << "rank " << r;
  }
}

// A rank that never uploaded its parts would start them from zeros: the first step waits for its
// upload, refused for every rank (naming it) and applied once it has uploaded.
TEST_F(PartitionTest, TheFirstStepWaitsForEveryRanksUpload) {
  const std::map<std::string, std::vector<float>> initial = InitialValues();
  std::vector<std::unique_ptr<client::Session>> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("parts-upload", Spec(true)));
    ASSERT_OK(session->HoldParts(r));
    if (r != 2) {
      ASSERT_OK(UploadParts(*session, r, initial));
    }
    ranks.push_back(std::move(session));
  }
  auto step_every_rank = [&] {
    std::vector<std::future<absl::StatusOr<client::StepReply>>> sent;
    for (int r = 0; r < kWorld; ++r) {
      sent.push_back(std::async(std::launch::async, [&, r] {
        const std::map<std::string, ElementRange> parts = PartsOf(r);
        std::map<std::string, std::vector<float>> grads;
        std::vector<client::TensorView> g;
        for (const PartitionedParam& p : AllParams())
          grads[p.name] = Slice(Values(p.name, p.numel(), 1), parts.at(p.name));
        for (const PartitionedParam& p : AllParams()) g.push_back({p.name, {parts.at(p.name).size()}, grads[p.name]});
        client::StepOptions options;
        options.rank = r;
        return ranks[static_cast<size_t>(r)]->Step(1, g, options);
      }));
    }
    std::vector<absl::StatusOr<client::StepReply>> replies;
    for (auto& reply : sent) replies.push_back(reply.get());
    return replies;
  };
  for (const absl::StatusOr<client::StepReply>& reply : step_every_rank()) {
    EXPECT_THAT(reply.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         "step 1: rank 2 sent it without uploading its parts of the initial "
                                         "parameters, which ranks 0, 1 uploaded"));
  }
  ASSERT_OK(UploadParts(*ranks[2], 2, initial));
  for (const absl::StatusOr<client::StepReply>& reply : step_every_rank()) {
    ASSERT_OK(reply.status());
    EXPECT_TRUE(reply->applied);
  }
}

// HSDP: two replicas of the partitions over 4 ranks (rank r holds shard r mod 2). Each replica's
// ranks send their own batch's gradients with the replica's weight; every part steps with the
// weighted mean of its replicas' parts — bit for bit one rank stepping that mean (fp64, replica
// order, rounded once) — and starts from the first upload of it, whichever replica's.
TEST_F(PartitionTest, HsdpReplicasStepTheWeightedMeanOfTheirParts) {
  constexpr int kRanks = 4, kReplicas = 2, kShards = kRanks / kReplicas, kSteps = 2;
  constexpr double kWeights[kReplicas] = {1.0, 3.0};
  const std::vector<PartitionedParam> all = AllParams();
  auto replica_grads = [](const PartitionedParam& p, int step, int replica) {
    return Values(p.name, p.numel(), step + 100 * replica);
  };
  std::map<std::string, ElementRange> shard_parts[kShards];
  for (int s = 0; s < kShards; ++s) {
    for (const PartitionedParam& p : kRows) shard_parts[s][p.name] = RowParts(p.shape, kShards)[static_cast<size_t>(s)];
    const std::vector<std::vector<ElementRange>> flat = FlatParts({7, 5}, 4, kShards);
    for (size_t k = 0; k < kFlat.size(); ++k) shard_parts[s][kFlat[k].name] = flat[k][static_cast<size_t>(s)];
  }

  // The reference steps the replicas' mean as the daemon takes it: fp64, replica order, rounded once.
  ASSERT_OK_AND_ASSIGN(const client::ParameterMap want,
                       OneRankSteps(*client_, "hsdp-whole", kSteps, [&](const PartitionedParam& p, int step) {
                         std::vector<double> sum(static_cast<size_t>(p.numel()), 0.0);
                         for (int replica = 0; replica < kReplicas; ++replica) {
                           const std::vector<float> grads = replica_grads(p, step, replica);
                           for (size_t i = 0; i < sum.size(); ++i) sum[i] += kWeights[replica] * grads[i];
                         }
                         std::vector<float> mean;
                         for (double v : sum) mean.push_back(static_cast<float>(v / (kWeights[0] + kWeights[1])));
                         return mean;
                       }));
  const std::map<std::string, std::vector<float>> initial = InitialValues();

  v1::SessionSpec spec = Spec(true);
  spec.set_world_size(kRanks);
  for (v1::ParameterGroup& group : *spec.mutable_groups()) group.mutable_partition()->set_replicas(kReplicas);
  std::vector<std::unique_ptr<client::Session>> ranks(kRanks);
  for (int r : {2, 1, 0, 3}) {
    ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("hsdp", spec));
    ASSERT_OK(session->HoldParts(r));
    const std::map<std::string, ElementRange>& parts = shard_parts[r % kShards];
    // Ranks 0 and 3 upload their shard second, and other values: the first upload stays.
    std::map<std::string, std::vector<float>> mine;
    std::vector<client::TensorView> upload;
    for (const PartitionedParam& p : all) {
      mine[p.name] = Slice(initial.at(p.name), parts.at(p.name));
      for (float& v : mine[p.name]) v += (r == 0 || r == 3) ? 1.0f : 0.0f;
      EXPECT_EQ(session->element_counts().at(p.name), parts.at(p.name).size()) << p.name;
    }
    for (const PartitionedParam& p : all) upload.push_back({p.name, {parts.at(p.name).size()}, mine[p.name]});
    ASSERT_OK(session->UploadParameters(upload));
    ranks[static_cast<size_t>(r)] = std::move(session);
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_OK_AND_ASSIGN(client::ParameterMap start, ranks[static_cast<size_t>(r)]->GetParameters());
    for (const PartitionedParam& p : all) {
      EXPECT_EQ(start.at(p.name), Slice(initial.at(p.name), shard_parts[r % kShards].at(p.name)))
          << "rank " << r << " '" << p.name << "'";
    }
  }
  std::vector<client::ParameterMap> got(kRanks);
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<std::future<absl::StatusOr<client::StepReply>>> sent;
    for (int r = 0; r < kRanks; ++r) {
      sent.push_back(std::async(std::launch::async, [&, r, step] {
        const int replica = r / kShards;
        const std::map<std::string, ElementRange>& parts = shard_parts[r % kShards];
        std::map<std::string, std::vector<float>> grads;
        std::vector<client::TensorView> g;
        for (const PartitionedParam& p : all) grads[p.name] = Slice(replica_grads(p, step, replica), parts.at(p.name));
        for (const PartitionedParam& p : all) g.push_back({p.name, {parts.at(p.name).size()}, grads[p.name]});
        client::StepOptions options;
        options.rank = r;
        options.weight = kWeights[replica];
        return ranks[static_cast<size_t>(r)]->Step(step, g, options);
      }));
    }
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<client::StepReply> reply = sent[static_cast<size_t>(r)].get();
      ASSERT_OK(reply.status()) << "rank " << r << " step " << step;
      EXPECT_TRUE(reply->applied);
      EXPECT_EQ(reply->total_weight, 2 * (kWeights[0] + kWeights[1]));
      got[static_cast<size_t>(r)] = reply->parameters;
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    for (const PartitionedParam& p : all) {
      EXPECT_EQ(got[static_cast<size_t>(r)].at(p.name), Slice(want.at(p.name), shard_parts[r % kShards].at(p.name)))
          << "rank " << r << " '" << p.name << "'";
    }
  }
}

TEST_F(PartitionTest, ReplicasThatDoNotDivideTheRanksAreRefused) {
  v1::SessionSpec spec = Spec(true);
  spec.mutable_groups(0)->mutable_partition()->set_replicas(2);  // world_size 3
  EXPECT_THAT(client_->CreateSession("hsdp-bad", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.groups[0].partition.replicas: must divide world_size (3), got 2"));
  spec = Spec(false);
  spec.mutable_groups(1)->mutable_partition()->set_replicas(2);
  EXPECT_THAT(client_->CreateSession("hsdp-bad", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.groups[1].partition.replicas: applies to kinds rows, flat and explicit only"));
}

TEST_F(PartitionTest, AStepNamingAnotherRankIsRefusedBeforeItIsSent) {
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("parts-rank", Spec(true)));
  ASSERT_OK(session->HoldParts(1));
  client::StepOptions options;
  options.rank = 2;
  absl::StatusOr<client::StepReply> reply = session->Step(1, {}, options);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reply.status().message()), ::testing::HasSubstr("options.rank"));
  absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session->BeginStreamedStep(1, options);
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(streamed.status().message()), ::testing::HasSubstr("options.rank"));
  EXPECT_EQ(session->HoldParts(kWorld).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace muond::testing
