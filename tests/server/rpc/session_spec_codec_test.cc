// ParseSessionSpec / ParseGroupOptions / CheckSameSpec: defaults, validation naming the field, and
// spec comparison for attach.
#include "server/rpc/session_spec_codec.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "kernels/optim/option_fields.h"
#include "kernels/optim/option_table.h"
#include "server/rpc/group_options_codec.h"
#include "tests/testing/status_matchers.h"

namespace muond::rpc {
namespace {

using session::SessionConfig;
using session::SpecLimits;

using ::muond::testing::StatusIs;

v1::SessionSpec Spec() {
  v1::SessionSpec spec;
  auto* m = spec.add_groups();
  m->set_name("m");
  auto* a = spec.add_groups();
  a->set_name("a");
  a->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(3);
  w->add_shape(5);
  w->set_group("m");
  return spec;
}

// The wire's GroupOptions (what the C++ client fills) and the option table name the same options, with
// the same types: the codec reads each row's field by its name.
TEST(GroupOptionTableTest, EveryWireFieldIsARowOfItsType) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* message = v1::GroupOptions::descriptor();
  std::set<std::string> fields;
  for (int i = 0; i < message->field_count(); ++i) {
    const FieldDescriptor* field = message->field(i);
    fields.insert(field->name());
    const optim::OptionSpec* row = optim::FindOption(field->name());
    ASSERT_NE(row, nullptr) << field->name() << " is in GroupOptions but not in the option table";
    EXPECT_EQ(row->carrier, optim::OptionCarrier::kGroup) << field->name();
    FieldDescriptor::CppType expected = FieldDescriptor::CPPTYPE_STRING;
    switch (row->type) {
      case optim::OptionType::kFloat:
        expected = FieldDescriptor::CPPTYPE_DOUBLE;
        break;
      case optim::OptionType::kInt:
        expected = FieldDescriptor::CPPTYPE_INT32;
        break;
      case optim::OptionType::kBool:
        expected = FieldDescriptor::CPPTYPE_BOOL;
        break;
      case optim::OptionType::kCoefficientList:
        expected = FieldDescriptor::CPPTYPE_MESSAGE;
        break;
      default:
        break;
    }
    if (field->name() == "optimizer") expected = FieldDescriptor::CPPTYPE_ENUM;
    EXPECT_EQ(field->cpp_type(), expected) << field->name();
    EXPECT_EQ(field->is_repeated(), row->type == optim::OptionType::kCoefficientList) << field->name();
    EXPECT_TRUE(field->has_presence() || field->is_repeated() || field->name() == "optimizer") << field->name();
  }
  for (const optim::OptionSpec& row : optim::GroupOptionTable().options) {
    if (row.carrier == optim::OptionCarrier::kGroup) {
      EXPECT_EQ(fields.count(row.name), 1u) << row.name << " is in the option table but not in GroupOptions";
    }
  }
}

// Each row's value arrives in its own member: a value off the default, set on the wire by name,
// comes back from the parsed options under the same name (print_option_table's walk, reversed).
TEST(GroupOptionTableTest, EachWireValueLandsInItsMember) {
  v1::GroupOptions options;
  options.set_moment2_method("adamuon");
  options.set_clip_scope("group");
  ASSERT_OK_AND_ASSIGN(optim::GroupOptions defaults, ParseGroupOptions(options, "g"));
  const google::protobuf::Reflection* reflection = options.GetReflection();
  optim::VisitOptionFields(defaults, [&](std::string_view name, const auto& member) {
    using Member = std::decay_t<decltype(member)>;
    v1::GroupOptions one = options;
    const auto* field = v1::GroupOptions::descriptor()->FindFieldByName(std::string(name));
    if constexpr (std::is_enum_v<Member>) {
      const auto& choices = *optim::ChoicesOf(name);
      const std::string& other = choices[(static_cast<size_t>(member) + 1) % choices.size()];
      reflection->SetString(&one, field, other);
      absl::StatusOr<optim::GroupOptions> parsed = ParseGroupOptions(one, "g");
      if (!parsed.ok()) return;  // a combination refused on its own (e.g. weight_decay_mode independent)
      bool landed = false;
      optim::VisitOptionFields(*parsed, [&](std::string_view n, const auto& m) {
        if constexpr (std::is_same_v<std::decay_t<decltype(m)>, Member>) {
          if (n == name) landed = choices[static_cast<size_t>(m)] == other;
        }
      });
      EXPECT_TRUE(landed) << name;
    }
  });
}

// Turbo-Muon: ns_preconditioner aol brings the aol set and 4 steps unless the request gives them.
TEST(SessionConfigTest, AolBringsItsCoefficientsAndStepsUnlessGiven) {
  v1::GroupOptions options;
  options.set_ns_preconditioner("aol");
  ASSERT_OK_AND_ASSIGN(optim::GroupOptions parsed, ParseGroupOptions(options, "g"));
  EXPECT_EQ(parsed.ns_preconditioner, optim::NsPreconditioner::kAol);
  EXPECT_EQ(parsed.ns_schedule.name, "aol");
  EXPECT_EQ(parsed.ns_steps, 4);
  options.set_ns_steps(5);
  options.set_ns_coefficients("quintic");
  ASSERT_OK_AND_ASSIGN(parsed, ParseGroupOptions(options, "g"));
  EXPECT_EQ(parsed.ns_schedule.name, "quintic");
  EXPECT_EQ(parsed.ns_steps, 5);
  options.set_ns_algorithm("gram");
  EXPECT_THAT(ParseGroupOptions(options, "g"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                        "g.ns_preconditioner aol applies with ns_algorithm standard"));
  v1::GroupOptions plain;
  ASSERT_OK_AND_ASSIGN(parsed, ParseGroupOptions(plain, "g"));
  EXPECT_EQ(parsed.ns_schedule.name, "simple");
  EXPECT_EQ(parsed.ns_steps, 5);
}

TEST(SessionConfigTest, FillsTheDefaultsOfEachOptimizer) {
  ASSERT_OK_AND_ASSIGN(SessionConfig config, ParseSessionSpec(Spec(), SpecLimits{}));
  ASSERT_EQ(config.groups.size(), 2u);
  const optim::GroupOptions& muon = config.groups[0].options;
  EXPECT_EQ(muon.optimizer, optim::OptimizerKind::kMuon);
  EXPECT_DOUBLE_EQ(muon.lr, 0.02);
  EXPECT_DOUBLE_EQ(muon.momentum, 0.95);
  EXPECT_TRUE(muon.nesterov);
  EXPECT_EQ(muon.ns_steps, 5);
  EXPECT_EQ(muon.ns_schedule.name, "simple");
  const optim::GroupOptions& adamw = config.groups[1].options;
  EXPECT_DOUBLE_EQ(adamw.lr, 1e-3);
  EXPECT_DOUBLE_EQ(adamw.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(adamw.beta2, 0.999);
  EXPECT_EQ(config.parameters[0].numel, 15);
  EXPECT_EQ(config.return_dtype, session::TensorDType::kFp32);
  EXPECT_EQ(config.world_size, 1);
}

TEST(SessionConfigTest, ParsesNamedChoices) {
  v1::GroupOptions options;
  options.set_momentum_style("sum");
  options.set_weight_decay_mode("l2");
  options.set_scale_mode("spectral");
  options.set_ns_coefficients("polar_express");
  ASSERT_OK_AND_ASSIGN(optim::GroupOptions parsed, ParseGroupOptions(options, "g"));
  EXPECT_EQ(parsed.momentum_style, kernels::MomentumStyle::kSum);
  EXPECT_EQ(parsed.weight_decay_mode, optim::WeightDecayMode::kL2);
  EXPECT_EQ(parsed.scale_mode, optim::ScaleMode::kSpectral);
  EXPECT_EQ(parsed.ns_schedule.name, "polar_express");
  EXPECT_EQ(parsed.ns_schedule.tuples.size(), 8u);
}

TEST(SessionConfigTest, LossScalerTakesMegatronDefaultsAndRefusesBadOptions) {
  v1::SessionSpec spec = Spec();
  ASSERT_OK_AND_ASSIGN(SessionConfig none, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_FALSE(none.loss_scaler.has_value());
  spec.mutable_loss_scaler()->set_window(3);
  ASSERT_OK_AND_ASSIGN(SessionConfig config, ParseSessionSpec(spec, SpecLimits{}));
  ASSERT_TRUE(config.loss_scaler.has_value());
  EXPECT_EQ(config.loss_scaler->window, 3);
  EXPECT_EQ(config.loss_scaler->initial_scale, 4294967296.0);
  EXPECT_EQ(config.loss_scaler->hysteresis, 2);
  spec.mutable_loss_scaler()->set_min_scale(-1);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.loss_scaler.min_scale"));
  spec.mutable_loss_scaler()->clear_min_scale();
  spec.mutable_loss_scaler()->set_hysteresis(0);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.loss_scaler.hysteresis"));
}

TEST(SessionConfigTest, BlockCountsAndLayoutsAreBoundedBeforeAnythingUsesThem) {
  // Sizes far beyond the parameter are refused by the codec (they would otherwise be iterated over
  // or multiplied before the optimizer's own checks).
  v1::SessionSpec spec = Spec();
  spec.mutable_parameters(0)->set_tp_blocks(int64_t{1} << 62);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].tp_blocks"));
  spec.mutable_parameters(0)->set_tp_blocks(5);
  spec.mutable_parameters(0)->set_tp_block_dim(1);
  ASSERT_OK_AND_ASSIGN(SessionConfig config, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(config.parameters[0].tp.blocks, 5);
  EXPECT_EQ(config.parameters[0].tp.dim, 1);
  spec.mutable_parameters(0)->set_tp_blocks(0);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].tp_block_dim"));
  spec.mutable_parameters(0)->set_tp_block_dim(0);
  spec.mutable_parameters(0)->add_qkv_split(1);
  spec.mutable_parameters(0)->add_qkv_split(1);
  spec.mutable_parameters(0)->add_qkv_split(1);
  spec.mutable_parameters(0)->set_num_query_groups(1 << 30);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].qkv_split"));
  // An MLA layout whose sums would overflow is compared per head, never added up.
  v1::SessionSpec mla = Spec();
  auto* k = mla.add_parameters();
  k->set_name("k");
  k->add_shape(4);
  k->add_shape(5);
  k->set_group("m");
  mla.mutable_parameters(0)->set_shape(0, 4);
  auto* pair = mla.add_qk_clip();
  pair->set_query("w");
  pair->set_key("k");
  pair->set_num_heads(2);
  pair->mutable_mla()->set_qk_nope_head_dim(int64_t{1} << 62);
  pair->mutable_mla()->set_qk_rope_head_dim((int64_t{1} << 62) + 2);
  EXPECT_THAT(ParseSessionSpec(mla, SpecLimits{}), StatusIs(absl::StatusCode::kInvalidArgument, "spec.qk_clip[0].mla"));
  pair->mutable_mla()->set_qk_nope_head_dim(1);
  pair->mutable_mla()->set_qk_rope_head_dim(1);
  pair->mutable_mla()->set_v_head_dim(1);
  ASSERT_OK_AND_ASSIGN(SessionConfig fits, ParseSessionSpec(mla, SpecLimits{}));
  ASSERT_TRUE(fits.qk_clip[0].mla.has_value());
  EXPECT_EQ(fits.qk_clip[0].mla->qk_nope_head_dim, 1);
}

// spec.shard.qk_clip_pairs: the whole session's pairs, at least the shard's own and at most its
// parameters; unset means the client did not say.
TEST(SessionConfigTest, AShardsCountOfTheSessionsPairsIsBounded) {
  v1::SessionSpec spec = Spec();
  v1::ShardPlacement* shard = spec.mutable_shard();
  shard->add_endpoints("a:1");
  shard->add_endpoints("b:2");
  shard->set_num_parameters(3);
  shard->add_parameters(1);
  ASSERT_OK_AND_ASSIGN(SessionConfig unsaid, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(unsaid.shard.qk_clip_pairs, -1);
  shard->set_qk_clip_pairs(0);
  ASSERT_OK_AND_ASSIGN(SessionConfig none, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(none.shard.qk_clip_pairs, 0);
  shard->set_qk_clip_pairs(1);
  ASSERT_OK_AND_ASSIGN(SessionConfig elsewhere, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(elsewhere.shard.qk_clip_pairs, 1);
  for (int bad : {-1, 4}) {
    shard->set_qk_clip_pairs(bad);
    EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
                StatusIs(absl::StatusCode::kInvalidArgument, "spec.shard.qk_clip_pairs"));
  }
}

TEST(SessionConfigTest, AdaptiveMuonAndItsRefusals) {
  v1::GroupOptions options;
  options.set_moment2_method("normuon");
  options.set_beta2(0.9);
  options.set_eps(1e-10);
  options.set_weight_decay_mode("cautious");
  ASSERT_OK_AND_ASSIGN(optim::GroupOptions parsed, ParseGroupOptions(options, "g"));
  EXPECT_EQ(parsed.moment2_method, optim::Moment2Method::kNormuon);
  EXPECT_EQ(parsed.weight_decay_mode, optim::WeightDecayMode::kCautious);
  EXPECT_DOUBLE_EQ(parsed.beta2, 0.9);
  EXPECT_DOUBLE_EQ(parsed.eps, 1e-10);
  // Muon's defaults are Megatron-Core's TensorParallelAdaptiveMuon's.
  v1::GroupOptions adamuon;
  adamuon.set_moment2_method("adamuon");
  ASSERT_OK_AND_ASSIGN(parsed, ParseGroupOptions(adamuon, "g"));
  EXPECT_DOUBLE_EQ(parsed.beta2, 0.95);
  EXPECT_DOUBLE_EQ(parsed.eps, 1e-8);

  v1::GroupOptions unused;  // beta2 without a second moment would be ignored: refused
  unused.set_beta2(0.9);
  EXPECT_THAT(ParseGroupOptions(unused, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.beta2"));
  unused.clear_beta2();
  unused.set_eps(1e-8);
  unused.set_moment2_method("none");
  EXPECT_THAT(ParseGroupOptions(unused, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.eps"));
  v1::GroupOptions adamw;
  adamw.set_optimizer(v1::OPTIMIZER_ADAMW);
  adamw.set_moment2_method("adamuon");
  EXPECT_THAT(ParseGroupOptions(adamw, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.moment2_method"));
  adamw.clear_moment2_method();
  adamw.set_weight_decay_mode("cautious");
  EXPECT_THAT(ParseGroupOptions(adamw, "g"),
              StatusIs(absl::StatusCode::kInvalidArgument, "cautious applies to muon only"));
  v1::GroupOptions bad;
  bad.set_moment2_method("adam");
  EXPECT_THAT(ParseGroupOptions(bad, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.moment2_method"));
  bad.set_moment2_method("adamuon");
  bad.set_beta2(1.0);
  EXPECT_THAT(ParseGroupOptions(bad, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "betas[1]"));
}

TEST(SessionConfigTest, CustomCoefficients) {
  v1::GroupOptions options;
  auto* t = options.add_ns_custom_coefficients();
  t->set_a(2);
  t->set_b(-1.5);
  t->set_c(0.5);
  options.set_ns_coefficients_after("repeat_last");
  ASSERT_OK_AND_ASSIGN(optim::GroupOptions parsed, ParseGroupOptions(options, "g"));
  EXPECT_EQ(parsed.ns_schedule.name, "custom");
  EXPECT_EQ(parsed.ns_schedule.after, optim::CoefficientsAfter::kRepeatLast);
  options.set_ns_coefficients("quintic");
  EXPECT_THAT(ParseGroupOptions(options, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.ns_coefficients"));
}

TEST(SessionConfigTest, RefusesBadOptionsNamingThem) {
  v1::GroupOptions options;
  options.set_ns_coefficients("nonsense");
  EXPECT_THAT(ParseGroupOptions(options, "spec.groups[0].options"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.groups[0].options.ns_coefficients: unknown coefficient set \"nonsense\""));
  // The name is quoted as the daemon quotes a client's strings: bounded.
  options.set_ns_coefficients(std::string(100000, 'x'));
  absl::Status long_name = ParseGroupOptions(options, "g").status();
  EXPECT_LT(long_name.message().size(), 1000u) << long_name;
  options.Clear();
  options.set_scale_mode("huge");
  EXPECT_THAT(ParseGroupOptions(options, "g"),
              StatusIs(absl::StatusCode::kInvalidArgument, "g.scale_mode: unknown value 'huge'; expected one of"));
  options.Clear();
  options.set_optimizer(v1::OPTIMIZER_ADAMW);
  options.set_nesterov(true);
  EXPECT_THAT(ParseGroupOptions(options, "g"),
              StatusIs(absl::StatusCode::kInvalidArgument, "g.nesterov: does not apply to optimizer adamw"));
  options.Clear();
  options.set_lr(std::numeric_limits<double>::infinity());
  EXPECT_THAT(ParseGroupOptions(options, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.lr"));
  options.Clear();
  options.set_optimizer(v1::OPTIMIZER_ADAMW);
  options.set_beta1(std::numeric_limits<double>::quiet_NaN());
  EXPECT_THAT(ParseGroupOptions(options, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.beta1"));
  options.Clear();
  options.add_ns_custom_coefficients()->set_a(std::numeric_limits<double>::quiet_NaN());
  EXPECT_THAT(ParseGroupOptions(options, "g"),
              StatusIs(absl::StatusCode::kInvalidArgument, "g.ns_custom_coefficients[0] must be finite"));
  options.Clear();
  options.set_optimizer(static_cast<v1::OptimizerKind>(17));
  EXPECT_THAT(ParseGroupOptions(options, "g"), StatusIs(absl::StatusCode::kInvalidArgument, "g.optimizer"));
}

TEST(SessionConfigTest, RefusesBadSpecsNamingTheField) {
  v1::SessionSpec spec = Spec();
  spec.mutable_parameters(0)->add_shape(-1);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].shape: dimension 2 is -1"));
  spec = Spec();
  *spec.add_parameters() = spec.parameters(0);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[1].name: duplicate"));
  spec = Spec();
  spec.set_world_size(5000);  // beyond SpecLimits::max_world_size
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}), StatusIs(absl::StatusCode::kInvalidArgument, "spec.world_size"));
  spec = Spec();
  SpecLimits small;
  small.max_tensor_elements = 10;
  EXPECT_THAT(ParseSessionSpec(spec, small), StatusIs(absl::StatusCode::kInvalidArgument, "more than 10 elements"));
  spec = Spec();
  spec.clear_groups();
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}), StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups"));
  spec = Spec();
  SpecLimits few_groups;
  few_groups.max_groups = spec.groups_size() - 1;
  EXPECT_THAT(ParseSessionSpec(spec, few_groups),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups: 2 groups exceed the limit of 1"));
  // Counted before any group is checked: groups without parameters are refused for the parameters.
  spec.clear_parameters();
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters: at least one parameter"));
  spec = Spec();
  spec.mutable_parameters(0)->add_qkv_split(1);
  EXPECT_THAT(ParseSessionSpec(spec, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].qkv_split"));
}

TEST(SessionConfigTest, NamesWithControlCharactersAreRefused) {
  for (const std::string& name :
       {std::string("w\0x", 3), std::string("w\n"), std::string("\x1b[31mw"), std::string("w\x7f")}) {
    v1::SessionSpec parameter = Spec();
    parameter.mutable_parameters(0)->set_name(name);
    EXPECT_THAT(ParseSessionSpec(parameter, SpecLimits{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         "spec.parameters[0].name: must be 1 to 256 bytes without "
                         "control characters"));
    v1::SessionSpec group = Spec();
    group.mutable_groups(1)->set_name(name);
    EXPECT_THAT(ParseSessionSpec(group, SpecLimits{}),
                StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups[1].name"));
  }
  v1::SessionSpec unicode = Spec();
  unicode.mutable_parameters(0)->set_name("blocks.0.attn.Wq \u00e9\u4e2d");
  EXPECT_OK(ParseSessionSpec(unicode, SpecLimits{}).status()) << "names are UTF-8; only control characters are refused";
}

TEST(SessionConfigTest, SameSpecAttachesAndADifferentOneNamesTheField) {
  EXPECT_OK(CheckSameSpec(Spec(), Spec()));
  v1::SessionSpec other = Spec();
  other.mutable_groups(0)->mutable_options()->set_lr(0.1);
  EXPECT_THAT(CheckSameSpec(Spec(), other),
              StatusIs(absl::StatusCode::kAlreadyExists, "groups[0].options: { lr: 0.1 }"));
}

// A shard's count of the session's QK-clip pairs: a session placed by a client that did not send it
// attaches a client that does, and the other way round; two counts are compared.
TEST(SessionConfigTest, AShardsPairCountIsComparedOnlyWhenBothSidesGiveIt) {
  v1::SessionSpec unsaid = Spec();
  unsaid.mutable_shard()->add_endpoints("a:1");
  unsaid.mutable_shard()->add_endpoints("b:2");
  unsaid.mutable_shard()->set_num_parameters(3);
  unsaid.mutable_shard()->add_parameters(1);
  v1::SessionSpec none = unsaid, one = unsaid;
  none.mutable_shard()->set_qk_clip_pairs(0);
  one.mutable_shard()->set_qk_clip_pairs(1);
  EXPECT_OK(CheckSameSpec(unsaid, none));
  EXPECT_OK(CheckSameSpec(none, unsaid));
  EXPECT_OK(CheckSameSpec(none, none));
  EXPECT_THAT(CheckSameSpec(none, one), StatusIs(absl::StatusCode::kAlreadyExists, "qk_clip_pairs"));
  // Another difference is still found beside an ignored count.
  v1::SessionSpec other = none;
  other.mutable_groups(0)->mutable_options()->set_lr(0.1);
  EXPECT_THAT(CheckSameSpec(unsaid, other), StatusIs(absl::StatusCode::kAlreadyExists, "lr: 0.1"));
}

// Labels: bounded and plain, compared at attach when both specs carry some (a session or a client
// from before labels has none, and attaches as before).
TEST(SessionConfigTest, LabelsAreBoundedAndComparedWhenBothSidesHaveThem) {
  v1::SessionSpec labelled = Spec();
  (*labelled.mutable_labels())["diloco.fragments"] = "2";
  EXPECT_OK(ParseSessionSpec(labelled, SpecLimits{}).status());
  EXPECT_OK(CheckSameSpec(labelled, labelled));
  EXPECT_OK(CheckSameSpec(Spec(), labelled));
  EXPECT_OK(CheckSameSpec(labelled, Spec()));

  v1::SessionSpec other = labelled;
  (*other.mutable_labels())["diloco.fragments"] = "1";
  EXPECT_THAT(CheckSameSpec(labelled, other),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       "spec.labels['diloco.fragments']: the session's is '2', this request's '1'"));
  v1::SessionSpec more = labelled;
  (*more.mutable_labels())["run"] = "a";
  EXPECT_THAT(CheckSameSpec(labelled, more),
              StatusIs(absl::StatusCode::kAlreadyExists, "spec.labels['run']: the session has none"));
  EXPECT_THAT(
      CheckSameSpec(more, labelled),
      StatusIs(absl::StatusCode::kAlreadyExists, "spec.labels['run']: the session's is 'a', this request has none"));
  // Another difference beside equal labels is named as before.
  other = labelled;
  other.mutable_groups(0)->mutable_options()->set_lr(0.1);
  EXPECT_THAT(CheckSameSpec(labelled, other), StatusIs(absl::StatusCode::kAlreadyExists, "lr: 0.1"));

  for (const std::string& key : {std::string(), std::string("Fragments"), std::string("a b"), std::string(65, 'k')}) {
    v1::SessionSpec bad = Spec();
    (*bad.mutable_labels())[key] = "1";
    EXPECT_THAT(ParseSessionSpec(bad, SpecLimits{}), StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels: key '"))
        << key;
    // An attach is checked too, whether or not the session has labels.
    EXPECT_THAT(CheckSameSpec(Spec(), bad), StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels: key '")) << key;
    EXPECT_THAT(CheckSameSpec(labelled, bad), StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels: key '"))
        << key;
  }
  // A refused key is echoed with its control characters escaped: no forged log line, no terminal escape.
  v1::SessionSpec forged = Spec();
  (*forged.mutable_labels())["x\n2026-12-01T00:00:00.000 info forged\x1b[2J"] = "1";
  const absl::Status refused = ParseSessionSpec(forged, SpecLimits{}).status();
  EXPECT_THAT(refused,
              StatusIs(absl::StatusCode::kInvalidArgument, "key 'x\\x0a2026-12-01T00:00:00.000 info forged\\x1b[2J'"));
  EXPECT_EQ(refused.message().find('\n'), std::string::npos);
  EXPECT_EQ(refused.message().find('\x1b'), std::string::npos);
  v1::SessionSpec bad_value = Spec();
  (*bad_value.mutable_labels())["k"] = "a\nb";
  EXPECT_THAT(ParseSessionSpec(bad_value, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels['k']: must be at most 256 bytes"));
  (*bad_value.mutable_labels())["k"] = std::string(257, 'v');
  EXPECT_THAT(ParseSessionSpec(bad_value, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels['k']"));
  v1::SessionSpec many = Spec();
  for (int i = 0; i < 17; ++i) (*many.mutable_labels())[absl::StrCat("k", i)] = "v";
  EXPECT_THAT(ParseSessionSpec(many, SpecLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.labels: 17 labels exceed the limit of 16"));
}

}  // namespace
}  // namespace muond::rpc
