// PrometheusMetrics: what each report adds to the exposition, the histogram's cumulative buckets,
// every outcome and transport, the quotas and the backend sampler; and MetricsEndpoint serving it
// over HTTP (cpp-httplib's client on loopback).
#include "server/metrics/prometheus_metrics.h"

#include <map>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/metrics/metrics_endpoint.h"

namespace muond::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Every sample line "name{labels} value", keyed by "name{labels}".
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> samples;
  const std::regex line(R"(^([a-z_]+(\{[^}]*\})?) (\S+)$)");
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    const std::string one = text.substr(begin, end - begin);
    std::smatch match;
    if (std::regex_match(one, match, line)) samples[match[1]] = std::stod(match[3] == "+Inf" ? "inf" : match[3].str());
    begin = end + 1;
  }
  return samples;
}

PrometheusOptions Options() {
  PrometheusOptions options;
  options.version = "9.9.9";
  options.backend = "cpu";
  options.max_sessions = 8;
  options.max_total_bytes = 1 << 20;
  options.backend_memory = [] { return std::make_pair<int64_t, int64_t>(100, 250); };
  options.ns_workspace = [] { return std::make_pair<int64_t, int64_t>(64, 1024); };
  return options;
}

TEST(PrometheusMetricsTest, EveryFamilyIsThereBeforeAnyReport) {
  PrometheusMetrics metrics(Options());
  const std::string text = metrics.Render();
  for (const char* family : {"muond_build_info",
                             "muond_steps_total",
                             "muond_step_duration_seconds",
                             "muond_step_phase_duration_seconds",
                             "muond_step_received_bytes_total",
                             "muond_step_sent_bytes_total",
                             "muond_calls_total",
                             "muond_calls_in_flight",
                             "muond_call_duration_seconds",
                             "muond_sessions",
                             "muond_sessions_limit",
                             "muond_state_bytes",
                             "muond_state_bytes_limit",
                             "muond_journal_append_duration_seconds",
                             "muond_journal_append_failures_total",
                             "muond_checkpoint_duration_seconds",
                             "muond_checkpoint_failures_total",
                             "muond_quarantined_sessions_total",
                             "muond_backend_memory_bytes",
                             "muond_newton_schulz_workspace_bytes",
                             "process_resident_memory_bytes",
                             "process_start_time_seconds"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + family + " ")) << family;
  }
  const auto samples = Samples(text);
  EXPECT_EQ(samples.at(R"(muond_build_info{version="9.9.9",backend="cpu"})"), 1);
  EXPECT_EQ(samples.at(R"(muond_steps_total{outcome="applied",transport="grpc"})"), 0);
  EXPECT_EQ(samples.at(R"(muond_steps_total{outcome="prepared",transport="shm"})"), 0);
  EXPECT_EQ(samples.at("muond_sessions_limit"), 8);
  EXPECT_EQ(samples.at(R"(muond_state_bytes_limit{scope="total"})"), 1 << 20);
  EXPECT_EQ(samples.count(R"(muond_state_bytes_limit{scope="session"})"), 0u);  // no per-session quota set
  EXPECT_EQ(samples.at(R"(muond_backend_memory_bytes{state="in_use"})"), 100);
  EXPECT_EQ(samples.at(R"(muond_backend_memory_bytes{state="reserved"})"), 250);
  EXPECT_EQ(samples.at(R"(muond_newton_schulz_workspace_bytes{state="held"})"), 64);
  EXPECT_EQ(samples.at(R"(muond_newton_schulz_workspace_bytes{state="limit"})"), 1024);
}

TEST(PrometheusMetricsTest, StepsCountByOutcomeAndTransportWithPhasesAndBytes) {
  PrometheusMetrics metrics(Options());
  StepReport applied;
  applied.transport = "shm";
  applied.receive_seconds = 0.0002;  // bucket le=0.00025
  applied.compute_seconds = 0.03;    // bucket le=0.05
  applied.send_seconds = 100;        // beyond the last bound: +Inf only
  applied.bytes_received = 400;
  applied.bytes_sent = 300;
  metrics.StepAnswered(applied);
  StepReport skipped;
  skipped.applied = false;
  metrics.StepAnswered(skipped);
  StepReport replayed;
  replayed.replayed = true;
  metrics.StepAnswered(replayed);
  StepReport prepared;
  prepared.prepared = true;
  metrics.StepAnswered(prepared);

  const auto s = Samples(metrics.Render());
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="applied",transport="shm"})"), 1);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="applied",transport="grpc"})"), 0);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="skipped",transport="grpc"})"), 1);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="replayed",transport="grpc"})"), 1);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="prepared",transport="grpc"})"), 1);
  const std::string receive = R"(muond_step_phase_duration_seconds_bucket{phase="receive",transport="shm",le=)";
  EXPECT_EQ(s.at(receive + R"("0.0001"})"), 0);
  EXPECT_EQ(s.at(receive + R"("0.00025"})"), 1);
  EXPECT_EQ(s.at(receive + R"("60"})"), 1);  // cumulative
  const std::string send = R"(muond_step_phase_duration_seconds_bucket{phase="send",transport="shm",le=)";
  EXPECT_EQ(s.at(send + R"("60"})"), 0);
  EXPECT_EQ(s.at(send + R"("+Inf"})"), 1);
  EXPECT_DOUBLE_EQ(s.at(R"(muond_step_phase_duration_seconds_sum{phase="compute",transport="shm"})"), 0.03);
  EXPECT_EQ(s.at(R"(muond_step_duration_seconds_count{transport="shm"})"), 1);
  EXPECT_DOUBLE_EQ(s.at(R"(muond_step_duration_seconds_sum{transport="shm"})"), 100.0302);
  EXPECT_EQ(s.at(R"(muond_step_received_bytes_total{transport="shm"})"), 400);
  EXPECT_EQ(s.at(R"(muond_step_sent_bytes_total{transport="shm"})"), 300);
  EXPECT_EQ(s.at(R"(muond_step_duration_seconds_count{transport="grpc"})"), 3);
}

TEST(PrometheusMetricsTest, EachGpuTransportHasItsOwnSeriesAndAnUnknownNameCountsAsGrpc) {
  PrometheusMetrics metrics(Options());
  const auto before = Samples(metrics.Render());
  for (const char* transport : {"cuda_ipc", "nccl"}) {
    EXPECT_EQ(before.at(absl::StrCat(R"(muond_steps_total{outcome="applied",transport=")", transport, R"("})")), 0)
        << transport;
  }
  StepReport cuda_ipc;
  cuda_ipc.transport = "cuda_ipc";
  cuda_ipc.bytes_received = 64;
  metrics.StepAnswered(cuda_ipc);
  StepReport nccl;
  nccl.transport = "nccl";
  nccl.replayed = true;
  metrics.StepAnswered(nccl);
  StepReport unknown;
  unknown.transport = "carrier-pigeon";
  metrics.StepAnswered(unknown);

  const auto s = Samples(metrics.Render());
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="applied",transport="cuda_ipc"})"), 1);
  EXPECT_EQ(s.at(R"(muond_step_received_bytes_total{transport="cuda_ipc"})"), 64);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="replayed",transport="nccl"})"), 1);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="applied",transport="nccl"})"), 0);
  EXPECT_EQ(s.at(R"(muond_steps_total{outcome="applied",transport="grpc"})"), 1);
  for (const auto& [series, value] : s) {
    EXPECT_EQ(series.find("carrier-pigeon"), std::string::npos) << series;
  }
}

TEST(PrometheusMetricsTest, CallsSessionsAndDurableWrites) {
  PrometheusMetrics metrics(Options());
  metrics.CallStarted("Step");
  metrics.CallStarted("Step");
  metrics.CallEnded("Step", absl::StatusCode::kOk, absl::Milliseconds(3));
  metrics.CallStarted("CreateSession");
  metrics.CallEnded("CreateSession", absl::StatusCode::kInvalidArgument, absl::Milliseconds(1));
  metrics.SessionsHeld(3, 4096);
  metrics.JournalAppended(absl::Microseconds(700), true);
  metrics.JournalAppended(absl::Microseconds(700), false);
  metrics.JournalRecordWithdrawn(true);
  metrics.JournalRecordWithdrawn(true);
  metrics.JournalRecordWithdrawn(false);
  metrics.CheckpointWritten(absl::Milliseconds(20), true);
  metrics.CheckpointWritten(absl::Milliseconds(20), false);
  metrics.SessionQuarantined();
  metrics.SessionQuarantined();

  const auto s = Samples(metrics.Render());
  EXPECT_EQ(s.at(R"(muond_calls_total{method="Step",code="OK"})"), 1);
  EXPECT_EQ(s.at(R"(muond_calls_total{method="CreateSession",code="INVALID_ARGUMENT"})"), 1);
  EXPECT_EQ(s.at(R"(muond_calls_in_flight{method="Step"})"), 1);
  EXPECT_EQ(s.at(R"(muond_calls_in_flight{method="CreateSession"})"), 0);
  EXPECT_EQ(s.at(R"(muond_call_duration_seconds_count{method="Step"})"), 1);
  EXPECT_EQ(s.at("muond_sessions"), 3);
  EXPECT_EQ(s.at("muond_state_bytes"), 4096);
  EXPECT_EQ(s.at("muond_journal_append_duration_seconds_count"), 1);
  EXPECT_EQ(s.at(R"(muond_journal_append_duration_seconds_bucket{le="0.001"})"), 1);
  EXPECT_EQ(s.at(R"(muond_journal_append_duration_seconds_bucket{le="0.0005"})"), 0);
  EXPECT_EQ(s.at("muond_journal_append_failures_total"), 1);
  EXPECT_EQ(s.at("muond_journal_withdrawals_total"), 2);
  EXPECT_EQ(s.at("muond_journal_withdrawal_failures_total"), 1);
  EXPECT_EQ(s.at("muond_checkpoint_duration_seconds_count"), 1);
  EXPECT_EQ(s.at("muond_checkpoint_failures_total"), 1);
  EXPECT_EQ(s.at("muond_quarantined_sessions_total"), 2);
}

// A group's series exist for an open session only: a step answered after its session was closed (a
// call that held it) brings none back, so the series stay bounded by the sessions held, nor shows on
// a new session of the same id.
TEST(PrometheusMetricsTest, GroupSeriesFollowTheSessionsOpen) {
  PrometheusMetrics metrics(Options());
  StepReport report;
  report.session = "s";
  report.session_serial = 7;
  GroupFigures figures;
  figures.group = "matrices";
  figures.grad_norm = 2.5;
  report.groups = {figures};
  const std::string series = R"(muond_group_grad_norm{session="s",group="matrices"})";
  metrics.StepAnswered(report);
  EXPECT_FALSE(Samples(metrics.Render()).contains(series)) << "a session never opened";
  metrics.SessionOpened("s", 7, {});
  EXPECT_FALSE(Samples(metrics.Render()).contains(series)) << "no step yet";
  metrics.StepAnswered(report);
  EXPECT_EQ(Samples(metrics.Render()).at(series), 2.5);
  metrics.SessionClosed("s");
  EXPECT_FALSE(Samples(metrics.Render()).contains(series));
  metrics.StepAnswered(report);
  EXPECT_FALSE(Samples(metrics.Render()).contains(series)) << "a step answered after the close";
  metrics.SessionOpened("s", 8, {});  // a new session of the same id
  metrics.StepAnswered(report);
  EXPECT_FALSE(Samples(metrics.Render()).contains(series)) << "the closed one's step on the new one";
  report.session_serial = 8;
  metrics.StepAnswered(report);
  EXPECT_EQ(Samples(metrics.Render()).at(series), 2.5);
  EXPECT_EQ(Samples(metrics.Render()).at(R"(muond_steps_total{outcome="applied",transport="grpc"})"), 5)
      << "the step itself still counts";
}

// A session restored with its last step's figures (a journal replay measured it) shows them from
// the start, before any step of the restored daemon; the next step replaces them.
TEST(PrometheusMetricsTest, ARestoredSessionShowsItsLastStepsFigures) {
  PrometheusMetrics metrics(Options());
  GroupFigures replayed;
  replayed.group = "matrices";
  replayed.grad_norm = 1.5;
  replayed.update_rms = 0.25;
  replayed.heloco = std::array<int64_t, 3>{3, 2, 1};
  metrics.SessionOpened("s", 3, {replayed});
  const std::map<std::string, double> restored = Samples(metrics.Render());
  EXPECT_EQ(restored.at(R"(muond_group_grad_norm{session="s",group="matrices"})"), 1.5);
  EXPECT_EQ(restored.at(R"(muond_group_update_rms{session="s",group="matrices"})"), 0.25);
  EXPECT_EQ(restored.at(R"(muond_group_heloco_parameters{session="s",group="matrices",case="reoriented"})"), 2);
  EXPECT_FALSE(restored.contains(R"(muond_group_orthogonality_residual{session="s",group="matrices"})"))
      << "not measured";
  const auto applied = restored.find(R"(muond_steps_total{outcome="applied",transport="grpc"})");
  EXPECT_TRUE(applied == restored.end() || applied->second == 0) << "a restore answers no step";
  StepReport next;
  next.session = "s";
  next.session_serial = 3;
  GroupFigures figures;
  figures.group = "matrices";
  figures.grad_norm = 4;
  next.groups = {figures};
  metrics.StepAnswered(next);
  const std::map<std::string, double> stepped = Samples(metrics.Render());
  EXPECT_EQ(stepped.at(R"(muond_group_grad_norm{session="s",group="matrices"})"), 4);
  EXPECT_FALSE(stepped.contains(R"(muond_group_update_rms{session="s",group="matrices"})"));
}

TEST(PrometheusMetricsTest, LabelValuesAreEscaped) {
  PrometheusOptions options = Options();
  options.version = "1.0 \"dev\"\\x\ny";
  PrometheusMetrics metrics(options);
  EXPECT_THAT(metrics.Render(), HasSubstr(R"(muond_build_info{version="1.0 \"dev\"\\x\ny",backend="cpu"} 1)"));
}

TEST(MetricsEndpointTest, ServesTheRenderedTextOnLoopback) {
  int scrapes = 0;
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", [&scrapes] {
    ++scrapes;
    return std::string("muond_sessions 7\n");
  });
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  ASSERT_GT(port, 0);
  httplib::Client client("127.0.0.1", port);
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->body, "muond_sessions 7\n");
  EXPECT_EQ(response->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(client.Get("/nothing")->status, 404);
  EXPECT_EQ(scrapes, 1);
}

TEST(MetricsEndpointTest, RefusesMalformedAndTakenAddresses) {
  for (const char* bad : {"9464", "host:", "host:port", ":70000", "127.0.0.1:-1"}) {
    auto endpoint = MetricsEndpoint::Start(bad, [] { return std::string(); });
    ASSERT_FALSE(endpoint.ok()) << bad;
    EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(endpoint.status().message(), HasSubstr("--metrics-listen")) << bad;
  }
  auto first = MetricsEndpoint::Start("127.0.0.1:0", [] { return std::string(); });
  ASSERT_TRUE(first.ok());
  auto second = MetricsEndpoint::Start((*first)->address(), [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), Not(HasSubstr("HOST:PORT")));
}

}  // namespace
}  // namespace muond::metrics
