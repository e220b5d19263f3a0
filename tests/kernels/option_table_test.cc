// The option table's reader (kernels/optim/option_table.h) and the daemon's use of it: the embedded
// table parses, damaged tables are refused naming the row, every row of carrier group has exactly
// one GroupOptions member of its type (option_fields.h), and range refusals read as documented.
#include "kernels/optim/option_table.h"

#include <set>
#include <string>
#include <type_traits>

#include "gtest/gtest.h"
#include "kernels/optim/option_fields.h"
#include "kernels/optim/options.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::StatusIs;

// A table of one row, `row` spliced in.
std::string TableWith(const std::string& row) {
  return R"({"optimizers": ["muon", "adamw", "lion", "sgd", "dion2"], "options": [)" + row + R"(], "coefficient_sets": [
    {"name": "simple", "after": "cycle", "tuples": [[3.4445, -4.7750, 2.0315]], "doc": "d"}]})";
}

TEST(OptionTableTest, TheEmbeddedTableParses) {
  const OptionTable& table = GroupOptionTable();
  EXPECT_EQ(table.optimizers, OptimizerNames());
  for (OptimizerKind kind : {OptimizerKind::kMuon, OptimizerKind::kAdamW, OptimizerKind::kLion, OptimizerKind::kSgd,
                             OptimizerKind::kDion2}) {
    EXPECT_EQ(table.optimizers[static_cast<size_t>(kind)], OptimizerName(kind));
  }
  EXPECT_GE(table.options.size(), 30u);
  EXPECT_EQ(table.coefficient_sets.size(), NamedScheduleNames().size());
}

TEST(OptionTableTest, DamagedTablesAreRefusedNamingTheRow) {
  const std::string good = R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float",
                               "default": 1.0, "range": "[0, 2]", "doc": "d"})";
  EXPECT_TRUE(ParseOptionTable(TableWith(good)).ok());
  EXPECT_THAT(ParseOptionTable(TableWith(good + "," + good)),
              StatusIs(absl::StatusCode::kInvalidArgument, "x: named twice"));
  EXPECT_THAT(ParseOptionTable("{"), StatusIs(absl::StatusCode::kInvalidArgument, "not a JSON object"));
  for (const auto& [row, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "real", "default": 1, "doc": "d"})",
            "unknown type real"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": 3, "range": "[0, 2]",
                "doc": "d"})",
            "option x: default out of range"},
           {R"({"name": "x", "carrier": "group", "applies_to": ["muon", "adam"], "type": "float", "default": 1,
                "doc": "d"})",
            "unknown optimizer \"adam\""},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "choice", "choices": ["a", "b"],
                "default": "c", "doc": "d"})",
            "default c is no choice"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": "a", "doc": "d"})",
            "does not fit the type"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": 1, "range": "~ 2",
                "doc": "d"})",
            "option x: ~ 2"},
           {R"({"name": "x", "carrier": "wire", "applies_to": "all", "type": "float", "default": 1, "doc": "d"})",
            "carrier wire"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": 1})", "doc"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "choice", "choices": ["a", "b"],
                "default": "a", "choice_defaults": {"c": {"x": "a"}}, "doc": "d"})",
            "option x choice_defaults: c is no choice"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "choice", "choices": ["a", "b"],
                "default": "a", "choice_defaults": {"b": {"y": 1}}, "doc": "d"})",
            "option x choice_defaults: unknown option y"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "choice", "choices": ["a", "b"],
                "default": "a", "choice_defaults": {"b": {"x": 1}}, "doc": "d"})",
            "does not fit the type"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": 1,
                "read_with": {"option": "y", "values": [true]}, "doc": "d"})",
            "option x read_with: no other option y"},
           {R"({"name": "x", "carrier": "group", "applies_to": "all", "type": "float", "default": 1,
                "read_with": {"option": "x", "values": [1]}, "doc": "d"})",
            "option x read_with: no other option x"},
       }) {
    EXPECT_THAT(ParseOptionTable(TableWith(row)), StatusIs(absl::StatusCode::kInvalidArgument, message)) << row;
  }
}

// read_with names another row, and its values fit that row: a choice it has, the row's type, and an
// option that applies wherever this one does.
TEST(OptionTableTest, ReadWithNamesAnotherRowAndItsValues) {
  const std::string x = R"({"name": "x", "carrier": "group", "applies_to": ["sgd"], "type": "float", "default": 1,
                            "read_with": {"option": "y", "values": VALUES}, "doc": "d"})";
  const auto with = [&](const std::string& y, const std::string& values) {
    std::string row = x;
    row.replace(row.find("VALUES"), 6, values);
    return ParseOptionTable(TableWith(row + "," + y));
  };
  const std::string bool_y = R"({"name": "y", "carrier": "group", "applies_to": ["sgd"], "type": "bool",
                                 "default": false, "doc": "d"})";
  const std::string choice_y = R"({"name": "y", "carrier": "group", "applies_to": "all", "type": "choice",
                                   "choices": ["a", "b"], "default": "a", "doc": "d"})";
  ASSERT_TRUE(with(bool_y, "[true]").ok()) << with(bool_y, "[true]").status();
  EXPECT_EQ(with(bool_y, "[true]")->options[0].read_with.option, "y");
  ASSERT_TRUE(with(choice_y, R"(["b"])").ok());
  EXPECT_EQ(with(choice_y, R"(["b"])")->options[0].read_with.values[0].name, "b");
  EXPECT_THAT(with(bool_y, "[]"), StatusIs(absl::StatusCode::kInvalidArgument, "option x read_with: no values"));
  EXPECT_THAT(with(bool_y, R"(["b"])"), StatusIs(absl::StatusCode::kInvalidArgument, "does not fit the type"));
  EXPECT_THAT(with(choice_y, R"(["c"])"), StatusIs(absl::StatusCode::kInvalidArgument, "c is no choice of y"));
  std::string muon_y = bool_y;
  muon_y.replace(muon_y.find("sgd"), 3, "muon");
  EXPECT_THAT(with(muon_y, "[true]"), StatusIs(absl::StatusCode::kInvalidArgument, "y applies to fewer optimizers"));
  std::string parameter_y = bool_y;
  parameter_y.replace(parameter_y.find("group"), 5, "parameter");
  EXPECT_THAT(with(parameter_y, "[true]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "option x read_with: this option and y must each be one value of the group's"));
}

// An option the group reads only with another's value, set to other than its default while that one
// has another: refused naming both; its default, or the other's value that reads it, passes.
TEST(OptionTableTest, AnOptionTheGroupWouldNotReadIsRefused) {
  GroupOptions sgd = DefaultOptions(OptimizerKind::kSgd);
  EXPECT_TRUE(CheckOptionsAreRead(sgd, true).ok()) << "every default";
  sgd.heloco_kappa = 2;
  EXPECT_THAT(CheckOptionsAreRead(sgd, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "heloco_kappa: this sgd group reads it only with heloco true, and has heloco false; set "
                       "heloco or leave heloco_kappa at its default 1"));
  sgd.heloco = true;
  EXPECT_TRUE(CheckOptionsAreRead(sgd, true).ok());
  GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  muon.moment2_method = Moment2Method::kNamo;
  muon.namo_clamp = 0;
  EXPECT_THAT(CheckOptionsAreRead(muon, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "namo_clamp: this muon group reads it only with moment2_method namo_d, and has "
                       "moment2_method namo; set moment2_method or leave namo_clamp at its default 0.75"));
  muon.moment2_method = Moment2Method::kNamoD;
  EXPECT_TRUE(CheckOptionsAreRead(muon, true).ok());
  GroupOptions adamw = DefaultOptions(OptimizerKind::kAdamW);
  adamw.heloco_kappa = 2;  // a member AdamW does not have a row for: not its to check
  EXPECT_TRUE(CheckOptionsAreRead(adamw, true).ok());
}

// QK-clip's options are read only in a session that names QK-clip pairs: set to other than their
// default in a session without, refused naming the option; the defaults, or a session with pairs
// (or a shard, which sees only its own), pass.
TEST(OptionTableTest, QkClipOptionsWithoutPairsAreRefused) {
  GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  EXPECT_TRUE(CheckOptionsAreRead(muon, false).ok()) << "every default";
  muon.qk_clip_threshold = 50;
  EXPECT_THAT(CheckOptionsAreRead(muon, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "qk_clip_threshold: only QK-clip reads it, and this session names no QK-clip pair "
                       "(spec.qk_clip); name the query and key weights or leave qk_clip_threshold at its default 100"));
  EXPECT_TRUE(CheckOptionsAreRead(muon, true).ok());
  muon.qk_clip_threshold = 100;
  muon.qk_clip_alpha = 1;
  EXPECT_THAT(CheckOptionsAreRead(muon, false),
              StatusIs(absl::StatusCode::kInvalidArgument, "qk_clip_alpha: only QK-clip reads it"));
  EXPECT_TRUE(ParseOptionTable(TableWith(R"({"name": "x", "carrier": "group", "applies_to": ["muon"],
                                             "type": "float", "read_for": "qk_clip", "default": 1, "doc": "d"})"))
                  .ok());
  EXPECT_THAT(ParseOptionTable(TableWith(R"({"name": "x", "carrier": "group", "applies_to": ["muon"],
                                             "type": "float", "read_for": "dion", "default": 1, "doc": "d"})")),
              StatusIs(absl::StatusCode::kInvalidArgument, "option x: read_for dion"));
  EXPECT_THAT(ParseOptionTable(TableWith(R"({"name": "x", "carrier": "group", "applies_to": ["muon"],
                                             "type": "int", "read_for": "qk_clip", "default": 1, "doc": "d"})")),
              StatusIs(absl::StatusCode::kInvalidArgument, "option x: read_for goes with a group's float"));
}

// ns_preconditioner aol brings Turbo-Muon's set and 4 steps (the table's choice_defaults), together:
// a group that gives either gets neither (the set is tuned for its four steps).
TEST(OptionTableTest, AChoiceBringsItsDefaultsOnlyWhenTheGroupGaveNoneOfThem) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.ns_preconditioner = NsPreconditioner::kAol;
  GroupOptions steps_given = o;
  GroupOptions set_given = o;
  ApplyChoiceDefaults(o, [](std::string_view) { return false; });
  EXPECT_EQ(o.ns_schedule.name, "aol");
  EXPECT_EQ(o.ns_steps, 4);
  ApplyChoiceDefaults(steps_given, [](std::string_view name) { return name == "ns_steps"; });
  EXPECT_EQ(steps_given.ns_schedule.name, "simple") << "the aol set is for four steps";
  EXPECT_EQ(steps_given.ns_steps, 5) << "the group's own ns_steps stays";
  set_given.ns_schedule = *NamedSchedule("quintic");
  ApplyChoiceDefaults(set_given, [](std::string_view name) { return name == "ns_coefficients"; });
  EXPECT_EQ(set_given.ns_schedule.name, "quintic");
  EXPECT_EQ(set_given.ns_steps, 5) << "quintic's five tuples, not aol's four steps";
  GroupOptions frobenius = DefaultOptions(OptimizerKind::kMuon);
  ApplyChoiceDefaults(frobenius, [](std::string_view) { return false; });
  EXPECT_EQ(frobenius.ns_schedule.name, "simple");
}

// Each member's type against its row's: the codec reads the wire's field of that type by name.
template <typename Member>
bool Fits(OptionType type) {
  if constexpr (std::is_enum_v<Member>) return type == OptionType::kChoice;
  if constexpr (std::is_same_v<Member, bool>) return type == OptionType::kBool;
  if constexpr (std::is_same_v<Member, int>) return type == OptionType::kInt;
  if constexpr (std::is_same_v<Member, double> || std::is_same_v<Member, std::optional<double>>) {
    return type == OptionType::kFloat;
  }
  return false;
}

TEST(OptionTableTest, EveryGroupRowHasOneMemberOfItsType) {
  GroupOptions o;
  std::set<std::string> visited;
  VisitOptionFields(o, [&](std::string_view name, auto& member) {
    const OptionSpec* spec = FindOption(name);
    ASSERT_NE(spec, nullptr) << name;
    EXPECT_TRUE(Fits<std::decay_t<decltype(member)>>(spec->type)) << name;
    EXPECT_TRUE(visited.insert(std::string(name)).second) << name << " visited twice";
  });
  // The optimizer and Newton–Schulz's schedule are converted on their own (options.h, NsSchedule).
  const std::set<std::string> own_rules = {"optimizer", "ns_coefficients", "ns_custom_coefficients",
                                           "ns_coefficients_after"};
  for (const OptionSpec& spec : GroupOptionTable().options) {
    // CheckOptionsAreRead reads both values through the members.
    if (!spec.read_for.empty()) {
      EXPECT_EQ(visited.count(spec.name), 1u) << spec.name << " is read only with QK-clip and has no member";
    }
    if (!spec.read_with.option.empty()) {
      EXPECT_EQ(visited.count(spec.name), 1u) << spec.name << " is read with another option and has no member";
      EXPECT_EQ(visited.count(spec.read_with.option), 1u) << spec.name << " is read with a row that has no member";
    }
    if (spec.carrier != OptionCarrier::kGroup || own_rules.count(spec.name) > 0) continue;
    EXPECT_EQ(visited.count(spec.name), 1u) << spec.name << " has no GroupOptions member";
  }
}

TEST(OptionTableTest, RangeRefusalsNameTheOptionAndItsRange) {
  EXPECT_THAT(CheckRange(*FindOption("lr"), -1),
              StatusIs(absl::StatusCode::kInvalidArgument, "lr must be in [0, 100], got -1"));
  EXPECT_THAT(CheckRange(*FindOption("ns_steps"), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "ns_steps must be >= 1, got 0"));
  EXPECT_THAT(CheckRange(*FindOption("ns_steps"), 101),
              StatusIs(absl::StatusCode::kInvalidArgument, "ns_steps must be <= 100, got 101"));
  EXPECT_THAT(CheckRange(*FindOption("qk_clip_threshold"), std::nan("")),
              StatusIs(absl::StatusCode::kInvalidArgument, "qk_clip_threshold must be > 0, got nan"));
  EXPECT_THAT(CheckRange(*FindOption("beta1"), 1.0),
              StatusIs(absl::StatusCode::kInvalidArgument, "betas[0] must be in [0, 1), got 1"));
  EXPECT_TRUE(CheckRange(*FindOption("momentum"), 0.0).ok());
  EXPECT_TRUE(CheckRange(*FindOption("telemetry"), 1.0).ok());  // no range
}

TEST(OptionTableTest, ChoicesAreTheEnumsInOrder) {
  EXPECT_EQ(*ChoiceIndex("clip_scope", "none"), static_cast<int>(ClipScope::kNone));
  EXPECT_EQ(*ChoiceIndex("ns_algorithm", "auto"), static_cast<int>(NsAlgorithm::kAuto));
  EXPECT_EQ(*ChoiceIndex("weight_decay_mode", "cautious"), static_cast<int>(WeightDecayMode::kCautious));
  EXPECT_EQ(*ChoiceIndex("moment2_method", "normuon"), static_cast<int>(Moment2Method::kNormuon));
  EXPECT_EQ(*ChoiceIndex("matmul_precision", "bf16"), static_cast<int>(kernels::MatmulPrecision::kBf16));
  EXPECT_EQ(*ChoiceIndex("master_dtype", "fp16"), static_cast<int>(kernels::StorageDtype::kFp16));
  EXPECT_THAT(ChoiceIndex("scale_mode", "spectrall"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown value 'spectrall'; expected one of shape_scaling, spectral, unit_rms_norm"));
  EXPECT_EQ(ChoicesOf("lr"), nullptr);
}

}  // namespace
}  // namespace muond::optim
