#include "proto/wire/chunk_frame.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "proto/wire/dtype_codec.h"

namespace muond::wire {
namespace {

constexpr int kDataField = 4;  // TensorChunk.data
constexpr int kLengthDelimited = 2;

// Reads protobuf wire data spread over several slices, without copying it.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  size_t position() const { return position_; }
  bool at_end() const { return slice_ == slices_.size(); }

  bool ReadByte(uint8_t* byte) {
    if (at_end()) return false;
    *byte = slices_[slice_].begin()[offset_];
    Advance(1);
    return true;
  }

  // A varint of at most 10 bytes.
  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      if (shift == 63 && byte > 1) return false;
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // The next n bytes as views into the slices; false when fewer remain.
  bool Take(size_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      if (at_end()) return false;
      const grpc::Slice& slice = slices_[slice_];
      const size_t k = std::min(n, slice.size() - offset_);
      pieces->emplace_back(reinterpret_cast<const char*>(slice.begin()) + offset_, k);
      Advance(k);
      n -= k;
    }
    return true;
  }

  // Appends the next n bytes to `out`.
  bool CopyTo(size_t n, std::string* out) {
    std::vector<absl::string_view> pieces;
    if (!Take(n, &pieces)) return false;
    for (absl::string_view piece : pieces) out->append(piece.data(), piece.size());
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
    if (offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t position_ = 0;
};

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Copies one field's value (its tag already read and appended to `out`) to `out`; false for wire
// types this reader leaves to protobuf (groups, unknown ones) or bytes that end early.
bool CopyFieldValue(SliceCursor& cursor, uint32_t wire_type, std::string* out) {
  switch (wire_type) {
    case 0: {  // varint
      uint64_t value;
      if (!cursor.ReadVarint(&value)) return false;
      AppendVarint(value, out);
      return true;
    }
    case 1:  // fixed64
      return cursor.CopyTo(8, out);
    case 2: {  // length-delimited
      uint64_t length;
      if (!cursor.ReadVarint(&length)) return false;
      AppendVarint(length, out);
      return cursor.CopyTo(length, out);
    }
    case 5:  // fixed32
      return cursor.CopyTo(4, out);
    default:
      return false;
  }
}

}  // namespace

bool ParseChunkFrame(const grpc::ByteBuffer& buffer, int chunk_field, FramedChunk* chunk) {
  chunk->slices.clear();
  chunk->data.clear();
  chunk->data_bytes = 0;
  if (!buffer.Dump(&chunk->slices).ok()) return false;
  SliceCursor cursor(chunk->slices);

  // The message: exactly one field, the chunk, running to the end.
  uint64_t tag;
  if (!cursor.ReadVarint(&tag) || tag != (static_cast<uint64_t>(chunk_field) << 3 | kLengthDelimited)) return false;
  uint64_t length;
  if (!cursor.ReadVarint(&length)) return false;
  const size_t end = cursor.position() + length;
  if (end < cursor.position() || end != buffer.Length()) return false;

  // The chunk: every field but data copied aside for protobuf; data (the last one, as protobuf
  // keeps the last value of a repeated scalar field) as views.
  std::string meta;
  while (cursor.position() < end) {
    if (!cursor.ReadVarint(&tag) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3);
    const uint32_t wire_type = static_cast<uint32_t>(tag & 7);
    if (field == kDataField && wire_type == kLengthDelimited) {
      if (!cursor.ReadVarint(&length) || length > end - cursor.position()) return false;
      chunk->data.clear();
      if (!cursor.Take(length, &chunk->data)) return false;
      chunk->data_bytes = length;
      continue;
    }
    AppendVarint(tag, &meta);
    if (!CopyFieldValue(cursor, wire_type, &meta) || cursor.position() > end) return false;
  }
  return chunk->meta.ParseFromString(meta) && chunk->meta.data().empty();
}

grpc::ByteBuffer FrameChunk(int chunk_field, const v1::TensorChunk& meta, grpc::Slice payload) {
  std::string inner = meta.SerializeAsString();
  inner.push_back(static_cast<char>(kDataField << 3 | kLengthDelimited));
  AppendVarint(payload.size(), &inner);
  const size_t chunk_length = inner.size() + payload.size();
  std::string prefix;
  prefix.reserve(1 + VarintSize(chunk_length) + inner.size());
  AppendVarint(static_cast<uint64_t>(chunk_field) << 3 | kLengthDelimited, &prefix);
  AppendVarint(chunk_length, &prefix);
  prefix += inner;
  const grpc::Slice slices[2] = {grpc::Slice(prefix), std::move(payload)};
  return grpc::ByteBuffer(slices, 2);
}

size_t ElementsPerChunk(v1::DType dtype, size_t max_chunk_bytes) {
  return std::max<size_t>(1, max_chunk_bytes / ElementSize(dtype));
}

size_t ChunkCount(size_t numel, v1::DType dtype, size_t max_chunk_bytes) {
  const size_t per_chunk = ElementsPerChunk(dtype, max_chunk_bytes);
  return std::max<size_t>(1, (numel + per_chunk - 1) / per_chunk);
}

grpc::ByteBuffer EncodeChunk(int chunk_field, const v1::TensorChunk& meta, std::span<const float> values,
                             SlicePool& pool) {
  char* data = nullptr;
  grpc::Slice payload = pool.Take(values.size() * ElementSize(meta.dtype()), &data);
  EncodeTo(meta.dtype(), values, data);
  return FrameChunk(chunk_field, meta, std::move(payload));
}

bool PayloadReader::Read(v1::DType dtype, std::span<float> out) {
  const size_t element = ElementSize(dtype);
  size_t done = 0;
  while (done < out.size()) {
    if (piece_ == pieces_.size()) return false;
    const absl::string_view piece = pieces_[piece_];
    const size_t left = piece.size() - offset_;
    if (left >= element) {  // whole elements of this piece, straight into `out`
      const size_t n = std::min(out.size() - done, left / element);
      Decode(dtype, piece.substr(offset_, n * element), out.subspan(done, n));
      done += n;
      offset_ += n * element;
    } else if (left > 0) {  // an element split across pieces: gather its bytes first
      char bytes[4];
      size_t have = 0;
      while (have < element) {
        if (piece_ == pieces_.size()) return false;
        const absl::string_view p = pieces_[piece_];
        const size_t k = std::min(element - have, p.size() - offset_);
        std::memcpy(bytes + have, p.data() + offset_, k);
        have += k;
        offset_ += k;
        if (offset_ == p.size()) {
          ++piece_;
          offset_ = 0;
        }
      }
      Decode(dtype, absl::string_view(bytes, element), out.subspan(done, 1));
      ++done;
      continue;
    }
    if (offset_ == piece.size()) {
      ++piece_;
      offset_ = 0;
    }
  }
  return true;
}

size_t PayloadReader::remaining() const {
  size_t n = 0;
  for (size_t i = piece_; i < pieces_.size(); ++i) n += pieces_[i].size();
  return n - offset_;
}

// A buffer lent out inside a slice: owns the storage until it is released.
struct SlicePool::Lent {
  std::shared_ptr<SlicePool> pool;
  std::unique_ptr<char[]> storage;
  size_t capacity;
};

std::shared_ptr<SlicePool> SlicePool::Create(size_t buffer_bytes, size_t keep) {
  std::shared_ptr<SlicePool> pool(new SlicePool(buffer_bytes, keep));
  pool->self_ = pool;
  return pool;
}

grpc::Slice SlicePool::Take(size_t bytes, char** data) {
  auto lent = std::make_unique<Lent>();
  lent->pool = self_.lock();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto fits = std::find_if(idle_.begin(), idle_.end(), [&](const Idle& buffer) { return buffer.capacity >= bytes; });
    if (fits != idle_.end()) {
      lent->storage = std::move(fits->storage);
      lent->capacity = fits->capacity;
      idle_.erase(fits);
    }
  }
  if (lent->storage == nullptr) {
    lent->capacity = std::max(bytes, buffer_bytes_);
    lent->storage.reset(new char[lent->capacity]);
  }
  *data = lent->storage.get();
  Lent* raw = lent.release();
  return grpc::Slice(raw->storage.get(), bytes, &SlicePool::Release, raw);
}

void SlicePool::Release(void* lent_ptr) {
  std::unique_ptr<Lent> lent(static_cast<Lent*>(lent_ptr));
  SlicePool& pool = *lent->pool;
  std::lock_guard<std::mutex> lock(pool.mu_);
  if (pool.idle_.size() < pool.keep_) pool.idle_.push_back(Idle{std::move(lent->storage), lent->capacity});
}

size_t SlicePool::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_.size();
}

}  // namespace muond::wire
