#include "server/session/rank_gather.h"

namespace muond::session {

uint64_t RankGather::Add(StepPlan plan, std::vector<HostTensor> gradients) {
  if (step_ != plan.request.step) {
    step_ = plan.request.step;
    arrived_ = 0;
    ranks_.assign(world_size_, std::nullopt);
    ++generation_;
  }
  auto& slot = ranks_[plan.request.rank];
  if (!slot) ++arrived_;
  slot.emplace(std::move(plan), std::move(gradients));
  return generation_;
}

std::pair<StepPlan, std::vector<HostTensor>> RankGather::TakeAverage(size_t num_parameters) {
  std::vector<HostTensor> mean(num_parameters);
  for (size_t p = 0; p < num_parameters; ++p) {
    std::vector<double> sum;
    int count = 0;
    for (const auto& rank : ranks_) {
      const HostTensor& g = rank->second[p];
      if (!g.present()) continue;
      if (sum.empty()) sum.assign(g.values.size(), 0.0);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += g.values[i];
      ++count;
    }
    if (count == 0) continue;
    HostTensor& out = mean[p];
    out.values.resize(sum.size());
    for (size_t i = 0; i < sum.size(); ++i) {
      out.values[i] = static_cast<float>(sum[i] / count);
      out.sum_squares += static_cast<double>(out.values[i]) * out.values[i];
    }
    out.received = static_cast<int64_t>(sum.size());
  }
  StepPlan plan = std::move(ranks_[0]->first);
  End();
  return {std::move(plan), std::move(mean)};
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
  arrived_ = 0;
  ranks_.clear();
  ++generation_;
}

}  // namespace muond::session
