#include "kernels/optim/param_state.h"

#include <utility>

namespace muond::optim {

const StoredTensor* ParamState::Slot(const std::string& slot_name) const {
  // A parameter has at most two slots; a linear scan beats any map here.
  for (const StateSlot& slot : slots) {
    if (slot.name == slot_name) return &slot.tensor;
  }
  return nullptr;
}

StoredTensor* ParamState::Slot(const std::string& slot_name) {
  return const_cast<StoredTensor*>(std::as_const(*this).Slot(slot_name));
}

}  // namespace muond::optim
