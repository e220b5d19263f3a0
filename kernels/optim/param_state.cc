#include "kernels/optim/param_state.h"

namespace muond::optim {

StoredTensor* ParamState::Slot(const std::string& slot_name) {
  // A parameter has at most two slots; a linear scan beats any map here.
  for (StateSlot& slot : slots) {
    if (slot.name == slot_name) return &slot.tensor;
  }
  return nullptr;
}

}  // namespace muond::optim
