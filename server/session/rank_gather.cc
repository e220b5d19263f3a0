#include "server/session/rank_gather.h"

#include <cmath>

#include "server/session/partition.h"

namespace muond::session {
namespace {

// Each head's largest finite logit over the ranks (each saw its own tokens; MuonClip wants the
// maximum over the whole batch); a head no rank gave a finite logit for keeps the lowest rank's
// value. The plan's pairs and the request's (which the journal keeps) stay in step, one for one.
void MergeQkLogits(const StepPlan& other, StepPlan& plan) {
  for (size_t j = 0; j < other.qk_logits.size(); ++j) {
    const auto& [pair, logits] = other.qk_logits[j];
    size_t k = 0;
    while (k < plan.qk_logits.size() && plan.qk_logits[k].first != pair) ++k;
    if (k == plan.qk_logits.size()) {
      plan.qk_logits.push_back(other.qk_logits[j]);
      plan.request.qk_logits.push_back(other.request.qk_logits[j]);
      continue;
    }
    std::vector<double>& merged = plan.qk_logits[k].second;
    for (size_t h = 0; h < merged.size() && h < logits.size(); ++h) {
      if (std::isfinite(logits[h]) && (!std::isfinite(merged[h]) || logits[h] > merged[h])) merged[h] = logits[h];
    }
    plan.request.qk_logits[k].max_logits = merged;
  }
}

}  // namespace

uint64_t RankGather::Add(StepPlan plan, std::vector<HostTensor> gradients, double grad_scale, absl::Time now) {
  if (step_ != plan.request.step) {
    step_ = plan.request.step;
    arrival_times_.clear();
    ranks_.assign(world_size_, std::nullopt);
    grad_scales_.assign(world_size_, 1.0);
    sends_.assign(world_size_, 0);
    ++generation_;
  }
  const int rank = plan.request.rank;
  sends_[rank] = ++sends_made_;
  auto& slot = ranks_[rank];
  if (!slot) arrival_times_.push_back(now);
  slot.emplace(std::move(plan), std::move(gradients));
  grad_scales_[rank] = grad_scale;
  return generation_;
}

absl::Time RankGather::reached(int n) const {
  if (n < 1 || n > arrived()) return absl::InfiniteFuture();
  return arrival_times_[n - 1];
}

std::vector<const std::vector<HostTensor>*> RankGather::ByRank() const {
  std::vector<const std::vector<HostTensor>*> by_rank;
  for (const auto& rank : ranks_) by_rank.push_back(rank ? &rank->second : nullptr);
  return by_rank;
}

absl::Status RankGather::CheckParts(const SessionConfig& config) const { return CheckPartsAgree(config, ByRank()); }

bool RankGather::CoversParts(const SessionConfig& config) const { return PartsCovered(config, ByRank()); }

std::pair<StepPlan, std::vector<HostTensor>> RankGather::TakeAverage(const SessionConfig& config) {
  const size_t num_parameters = config.parameters.size();
  int lowest = 0;
  while (!ranks_[lowest]) ++lowest;  // taken only once a rank arrived
  // Each rank's gradients brought to the lowest rank's scale: exactly 1 when the scales agree.
  std::vector<double> rescale(world_size_, 1.0), weight(world_size_, 0.0);
  for (int r = 0; r < world_size_; ++r) {
    if (!ranks_[r]) continue;
    if (grad_scales_[r] != grad_scales_[lowest]) rescale[r] = grad_scales_[lowest] / grad_scales_[r];
    weight[r] = ranks_[r]->first.request.weight;
  }
  std::vector<HostTensor> mean(num_parameters);
  AssembleParts(config, ByRank(), weight, rescale, mean);
  for (size_t p = 0; p < num_parameters; ++p) {
    if (IsPartitioned(config, p)) continue;  // assembled from its parts above
    std::vector<double> sum;
    double weights = 0;
    for (int r = 0; r < world_size_; ++r) {
      if (!ranks_[r]) continue;
      const HostTensor& g = ranks_[r]->second[p];
      if (!g.present()) continue;
      const double w = weight[r];
      const double scaled_w = w * rescale[r];  // w itself when the scales agree
      if (sum.empty()) sum.assign(g.values.size(), 0.0);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += scaled_w * g.values[i];
      weights += w;
    }
    if (weights == 0) continue;
    HostTensor& out = mean[p];
    out.values.resize(sum.size());
    for (size_t i = 0; i < sum.size(); ++i) {
      out.values[i] = static_cast<float>(sum[i] / weights);
      out.sum_squares += static_cast<double>(out.values[i]) * out.values[i];
    }
    out.received = static_cast<int64_t>(sum.size());
  }
  std::vector<int> contributors;
  double total_weight = 0;
  for (int r = 0; r < world_size_; ++r) {
    if (!ranks_[r]) continue;
    contributors.push_back(r);
    total_weight += ranks_[r]->first.request.weight;
  }
  StepPlan plan = std::move(ranks_[lowest]->first);  // contributors.front()
  for (size_t c = 1; c < contributors.size(); ++c) MergeQkLogits(ranks_[contributors[c]]->first, plan);
  plan.request.contributors = std::move(contributors);
  plan.request.total_weight = total_weight;
  taken_sends_[generation_] = sends_;
  constexpr size_t kRememberedGatherings = 16;
  while (taken_sends_.size() > kRememberedGatherings) taken_sends_.erase(taken_sends_.begin());
  End();
  return {std::move(plan), std::move(mean)};
}

bool RankGather::Superseded(uint64_t generation, int rank, uint64_t send) const {
  auto it = taken_sends_.find(generation);
  return it != taken_sends_.end() && it->second[static_cast<size_t>(rank)] != send;
}

std::vector<int> RankGather::Abort() {
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r) {
    if (!ranks_[r]) missing.push_back(r);
  }
  End();
  return missing;
}

void RankGather::End() {
  step_ = 0;
  arrival_times_.clear();
  ranks_.clear();
  ++generation_;
}

}  // namespace muond::session
