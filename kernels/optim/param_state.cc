#include "kernels/optim/param_state.h"

namespace muond::optim {

kernels::DeviceBuffer* ParamState::Slot(const std::string& slot_name) {
  // A parameter has at most two slots; a linear scan beats any map here.
  for (StateSlot& slot : slots) {
    if (slot.name == slot_name) return slot.buffer.get();
  }
  return nullptr;
}

}  // namespace muond::optim
