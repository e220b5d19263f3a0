// Ranks that hold parts of a session sharded over real daemons through client::ShardedSession
// (docs/ranks.md, Over several daemons), and what each shard's spec holds of a partition, as the
// Python client gives it.
#include <future>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/partition_rules.h"
#include "gmock/gmock.h"
#include "tests/integration/sharded_session_fixture.h"

namespace muond::testing {
namespace {

// What each shard's spec holds of a partition, as the Python client gives it
// (tests/python/test_partition_shards.py checks the same example), so that ranks of either client attach:
// a flat group's ranges over the whole group, an explicit group's ranges of the shard's parameters,
// each in the group's order and without empty ones. x (12 elements), y (5) and z (6) flat with
// alignment 4 over 2 ranks: ranges of 14 over [x 0-12 | pad | y 12-17 | pad | z 20-26 | pad].
TEST(ShardSpecTest, PartitionsReachEachShardAsThePythonClientGivesThem) {
  v1::SessionSpec spec;
  spec.set_world_size(2);
  for (const char* group : {"flat", "explicit"}) {
    v1::ParameterGroup* g = spec.add_groups();
    g->set_name(group);
    g->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  }
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_FLAT);
  spec.mutable_groups(0)->mutable_partition()->set_alignment(4);
  AddParameter(spec, "x", {4, 3}, "flat");
  AddParameter(spec, "y", {5}, "flat");
  AddParameter(spec, "z", {6}, "flat");
  AddParameter(spec, "u", {4}, "explicit");
  AddParameter(spec, "v", {4}, "explicit");
  v1::Partition* given = spec.mutable_groups(1)->mutable_partition();
  given->set_kind(v1::PARTITION_KIND_EXPLICIT);
  auto add = [](v1::RankRanges* rank, const std::string& name, int64_t begin, int64_t end) {
    v1::ParameterRange* range = rank->add_ranges();
    range->set_parameter(name);
    range->set_begin(begin);
    range->set_end(end);
  };
  v1::RankRanges* rank0 = given->add_ranks();
  add(rank0, "v", 0, 2);
  add(rank0, "u", 0, 4);
  v1::RankRanges* rank1 = given->add_ranks();
  add(rank1, "v", 2, 4);
  add(rank1, "u", 4, 4);
  client::Placement placement;
  placement.shard_of = {0, 1, 0, 0, 1};
  placement.loads = {0, 0};
  // Each shard's partitions as "group: rank r: name begin-end, …; rank r: …".
  auto ranges_of = [&](int shard) {
    std::vector<std::string> out;
    const v1::SessionSpec mine = client::ShardSpec(spec, placement, {"a:1", "b:2"}, shard);
    for (const v1::ParameterGroup& g : mine.groups()) {
      std::string text = g.name() + (g.partition().kind() == v1::PARTITION_KIND_EXPLICIT ? ":" : ": not explicit");
      for (int r = 0; r < g.partition().ranks_size(); ++r) {
        text += absl::StrCat(" rank ", r, ":");
        for (const v1::ParameterRange& range : g.partition().ranks(r).ranges())
          text += absl::StrCat(" ", range.parameter(), " ", range.begin(), "-", range.end());
      }
      out.push_back(text);
    }
    return out;
  };
  EXPECT_THAT(ranges_of(0),
              ::testing::ElementsAre("flat: rank 0: x 0-12 rank 1: z 0-6", "explicit: rank 0: u 0-4 rank 1:"));
  EXPECT_THAT(ranges_of(1),
              ::testing::ElementsAre("flat: rank 0: y 0-2 rank 1: y 2-5", "explicit: rank 0: v 0-2 rank 1: v 2-4"));
  // A range naming no parameter of the group stays, for the daemon to refuse naming it.
  add(rank1, "typo", 0, 1);
  EXPECT_EQ(ranges_of(0)[1], "explicit: rank 0: u 0-4 rank 1: typo 0-1");
}

// Ranks that hold parts of a session sharded over daemons (docs/ranks.md, Over several daemons):
// three ranks, each its own ShardedSession over the three shards, holding rows of the Muon matrices
// and a flat partition of the AdamW group (alignment 4) whose range for rank 2 cuts through emb and
// b1, which the placement puts on two different daemons (each is given its explicit ranges). Every
// rank's parts equal, bit for bit, the same parts of one rank stepping the whole gradients on one
// daemon, with the same global clipping, and a rank that opens the session again reads its parts back.
class ShardedPartsTest : public ShardedRanksTest {};

TEST_F(ShardedPartsTest, RanksThatHoldPartsStepBitForBitLikeOneRankOnOneDaemon) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 3;
  v1::SessionSpec whole = ModelSpec();
  whole.clear_qk_clip();  // QK-clip's logits are not this test's subject
  whole.mutable_groups(0)->mutable_options()->clear_qk_clip_threshold();
  v1::SessionSpec spec = whole;
  spec.set_world_size(kRanks);
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  spec.mutable_groups(1)->mutable_partition()->set_kind(v1::PARTITION_KIND_FLAT);
  spec.mutable_groups(1)->mutable_partition()->set_alignment(4);
  // Each parameter's range for each rank, by the rules of common/partition_rules.h.
  std::map<std::string, std::vector<ElementRange>> parts;
  std::vector<std::string> flat_names;
  std::vector<int64_t> flat_numels;
  for (const v1::ParameterSpec& p : spec.parameters()) {
    if (p.group() == "muon") {
      parts[p.name()] = RowParts({p.shape().begin(), p.shape().end()}, kRanks);
    } else {
      flat_names.push_back(p.name());
      flat_numels.push_back(Numel(p));
    }
  }
  const std::vector<std::vector<ElementRange>> flat = FlatParts(flat_numels, 4, kRanks);
  for (size_t k = 0; k < flat_names.size(); ++k) parts[flat_names[k]] = flat[k];
  ASSERT_OK_AND_ASSIGN(const client::Placement placement, client::PlaceSpec(spec, 3));
  ASSERT_EQ(spec.parameters(0).name(), "emb");
  ASSERT_EQ(spec.parameters(4).name(), "b1");
  ASSERT_NE(placement.shard_of[0], placement.shard_of[4]);
  ASSERT_GT(parts["emb"][2].size(), 0);
  ASSERT_GT(parts["b1"][2].size(), 0);

  client::ClientOptions one = options_;
  one.endpoint = endpoints_[3];
  ASSERT_OK_AND_ASSIGN(single_client_, client::Client::Connect(one));
  ASSERT_OK_AND_ASSIGN(auto single, single_client_->CreateSession("parts", whole));
  const Tensors initial(whole, 0, 0.5f);
  ASSERT_OK(single->UploadParameters(initial.views));

  // Rank r's parts of `tensors`, copied into `data`.
  auto cut = [&](const Tensors& tensors, int r, std::vector<std::vector<float>>& data) {
    std::vector<client::TensorView> views;
    data.assign(tensors.views.size(), {});
    for (size_t i = 0; i < tensors.views.size(); ++i) {
      const client::TensorView& t = tensors.views[i];
      const ElementRange range = parts.at(t.name)[static_cast<size_t>(r)];
      data[i].assign(t.values.begin() + range.begin, t.values.begin() + range.end);
      views.push_back({t.name, {range.size()}, data[i]});
    }
    return views;
  };
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  std::vector<std::unique_ptr<client::ShardedSession>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_OK_AND_ASSIGN(auto rank, client::ShardedSession::Open(options_, shards, "parts", spec));
    ASSERT_OK(rank->HoldParts(r));
    std::vector<std::vector<float>> data;
    ASSERT_OK(rank->UploadParameters(cut(initial, r, data)));
    ranks.push_back(std::move(rank));
  }
  std::vector<client::ParameterMap> got(kRanks);
  for (int step = 1; step <= kSteps; ++step) {
    const Tensors grads(whole, 100 * step, 0.3f);
    client::StepOptions options = OptionsOf(step);
    options.qk_logits.clear();
    std::vector<std::future<absl::StatusOr<client::StepReply>>> sent;
    for (int r = 0; r < kRanks; ++r) {
      sent.push_back(std::async(std::launch::async, [&, r] {
        std::vector<std::vector<float>> data;
        client::StepOptions mine = options;
        mine.rank = r;
        return ranks[static_cast<size_t>(r)]->Step(step, cut(grads, r, data), mine);
      }));
    }
    ASSERT_OK_AND_ASSIGN(client::StepReply want, single->Step(step, grads.views, options));
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<client::StepReply> reply = sent[static_cast<size_t>(r)].get();
      ASSERT_OK(reply.status()) << "rank " << r << " step " << step;
      // The norm is a sum of squares in fp64 of at most 192 terms per parameter, taken in another
      // order (the daemon sums an assembled gradient in one pass, a whole one chunk by chunk as it
      // arrives): each sum within 192·2⁻⁵³ of itself, far below 1e-12 of the norm.
      EXPECT_NEAR(reply->grad_norm, want.grad_norm, 1e-12 * want.grad_norm) << "rank " << r << " step " << step;
      got[static_cast<size_t>(r)] = reply->parameters;
      for (const auto& [name, value] : want.parameters) {
        const ElementRange range = parts.at(name)[static_cast<size_t>(r)];
        EXPECT_EQ(got[static_cast<size_t>(r)].at(name),
                  std::vector<float>(value.begin() + range.begin, value.begin() + range.end))
            << "rank " << r << " '" << name << "' step " << step;
      }
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_OK_AND_ASSIGN(auto reopened, client::ShardedSession::Open(options_, shards, "parts", spec));
    ASSERT_OK(reopened->HoldParts(r));
    ASSERT_OK_AND_ASSIGN(client::ParameterMap back, reopened->GetParameters());
    EXPECT_EQ(back, got[static_cast<size_t>(r)]) << "rank " << r;
  }
  ASSERT_OK(ranks[0]->Close());
}

}  // namespace
}  // namespace muond::testing
