// OneParameterSpec: the smallest session spec the integration tests build by hand — one parameter
// "w" of a given shape in one group "g" of a given optimizer. Header-only; a pure function.
#pragma once

#include <cstdint>
#include <vector>

#include "muond/v1/muond.pb.h"

namespace muond::testing {

inline v1::SessionSpec OneParameterSpec(const std::vector<int64_t>& shape,
                                        v1::OptimizerKind optimizer = v1::OPTIMIZER_MUON) {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("g");
  group->mutable_options()->set_optimizer(optimizer);
  auto* w = spec.add_parameters();
  w->set_name("w");
  for (int64_t d : shape) w->add_shape(d);
  w->set_group("g");
  return spec;
}

}  // namespace muond::testing
