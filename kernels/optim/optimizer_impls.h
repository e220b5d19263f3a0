// Constructors of the concrete optimizers behind Optimizer::Create, one per .cc file (muon.cc,
// adamw.cc, lion.cc, sgd.cc, dion2.cc). Internal to kernels/optim/ and its tests; other modules go through
// Optimizer::Create. Each returns a fresh optimizer owned by the caller; see optimizer.h for
// thread-safety.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kernels/optim/optimizer.h"

namespace muond::optim {

std::unique_ptr<Optimizer> NewMuon(const GroupOptions& options);
std::unique_ptr<Optimizer> NewAdamW(const GroupOptions& options);
std::unique_ptr<Optimizer> NewLion(const GroupOptions& options);
std::unique_ptr<Optimizer> NewSgd(const GroupOptions& options);
std::unique_ptr<Optimizer> NewDion2(const GroupOptions& options);

}  // namespace muond::optim
