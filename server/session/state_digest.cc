#include "server/session/state_digest.h"

#include <algorithm>
#include <bit>
#include <span>
#include <vector>

#include "common/half_ranges.h"
#include "common/status_macros.h"
#include "server/durability/sha256_stream.h"

namespace muond::session {
namespace {

static_assert(std::endian::native == std::endian::little, "the digest hashes little-endian bytes as they are");

// Feeds the canonical encoding of values into a SHA-256 stream.
class Framer {
 public:
  explicit Framer(durability::Sha256Stream* stream) : stream_(stream) {}

  void U8(uint8_t value) { Raw(&value, 1); }
  void U64(uint64_t value) { Raw(&value, sizeof(value)); }
  void I64(int64_t value) { Raw(&value, sizeof(value)); }
  void F64(double value) { Raw(&value, sizeof(value)); }
  void String(std::string_view value) {
    U64(value.size());
    Raw(value.data(), value.size());
  }
  void Raw(const void* data, size_t size) { stream_->Update(data, size); }

 private:
  durability::Sha256Stream* stream_;
};

// Hashes `values` as the bytes `dtype` stores them and returns their count: fp32 as they are; a
// 16-bit tensor's values were widened from its stored elements exactly, so rounding them back gives
// those elements again.
uint64_t HashStored(Framer& framer, std::span<const float> values, kernels::StorageDtype dtype) {
  if (dtype == kernels::StorageDtype::kFp32) {
    framer.Raw(values.data(), values.size_bytes());
    return values.size_bytes();
  }
  constexpr size_t kBlock = 1 << 15;
  std::vector<uint16_t> bits(std::min(kBlock, values.size()));
  for (size_t begin = 0; begin < values.size(); begin += kBlock) {
    const size_t count = std::min(kBlock, values.size() - begin);
    (dtype == kernels::StorageDtype::kBf16 ? NarrowToBf16 : NarrowToFp16)(values.data() + begin, bits.data(), count);
    framer.Raw(bits.data(), count * sizeof(uint16_t));
  }
  return values.size() * sizeof(uint16_t);
}

}  // namespace

StateDigest DigestState(const SessionConfig& config, const SessionState& state, const TensorShapeFn& shape_of) {
  durability::Sha256Stream stream;
  Framer framer(&stream);
  framer.String(kStateDigestFormat);
  framer.I64(state.last_step);
  framer.U8(state.loss_scaler.has_value() ? 1 : 0);
  if (state.loss_scaler.has_value()) {
    framer.F64(state.loss_scaler->scale);
    framer.I64(state.loss_scaler->growth_tracker);
    framer.I64(state.loss_scaler->hysteresis_tracker);
  }
  // Each parameter's tensors: the master first, then the slots in byte order of their names.
  std::vector<std::vector<const StateTensor*>> tensors(config.parameters.size());
  for (const StateTensor& t : state.tensors) tensors[t.parameter].push_back(&t);
  for (std::vector<const StateTensor*>& list : tensors) {
    std::sort(list.begin(), list.end(), [](const StateTensor* a, const StateTensor* b) {
      const bool a_master = a->slot == kMasterSlot;
      const bool b_master = b->slot == kMasterSlot;
      if (a_master != b_master) return a_master;
      return a->slot < b->slot;
    });
  }
  StateDigest digest;
  digest.step = state.last_step;
  framer.U64(config.parameters.size());
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    const std::string& name = config.parameters[i].name;
    framer.String(name);
    framer.I64(i < state.step_counts.size() ? state.step_counts[i] : 0);
    framer.U64(tensors[i].size());
    for (const StateTensor* t : tensors[i]) {
      framer.String(name);
      framer.String(t->slot);
      framer.String(kernels::StorageDtypeName(t->dtype));
      const std::vector<int64_t> shape = shape_of(i, t->slot);
      framer.U64(shape.size());
      for (int64_t dim : shape) framer.I64(dim);
      framer.U64(t->values.size() * kernels::StorageBytes(t->dtype));
      digest.num_bytes += static_cast<int64_t>(HashStored(framer, t->values, t->dtype));
      ++digest.num_tensors;
    }
  }
  digest.hex = stream.FinishHex();
  return digest;
}

absl::StatusOr<StateDigest> DigestSession(const Session& session) {
  MUOND_ASSIGN_OR_RETURN(SessionState state, session.ExportState());
  return DigestState(session.config(), state,
                     [&](size_t parameter, std::string_view slot) { return session.TensorShape(parameter, slot); });
}

}  // namespace muond::session
