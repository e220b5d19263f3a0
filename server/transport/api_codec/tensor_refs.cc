#include "server/transport/api_codec/tensor_refs.h"

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/partition.h"

namespace muond::transport {

absl::StatusOr<std::vector<TensorRef>> ResolveTensorRefs(
    const session::SessionConfig& config, int count, absl::FunctionRef<RefFields(int)> at_index,
    absl::string_view field, bool require_all,
    absl::FunctionRef<absl::StatusOr<uint64_t>(const std::string& region, const std::string& field)> region_size) {
  std::vector<TensorRef> refs;
  std::vector<bool> seen(config.parameters.size(), false);
  for (int i = 0; i < count; ++i) {
    const RefFields ref = at_index(i);
    const std::string at = absl::StrCat(field, "[", i, "]");
    auto it = config.parameter_index.find(ref.name);
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat(at, ".name: unknown parameter '", Echo(ref.name), "'"));
    }
    if (seen[it->second]) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: '", Echo(ref.name), "' appears twice"));
    }
    seen[it->second] = true;
    const v1::DType dtype = ref.dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : ref.dtype;
    if (!wire::IsConcrete(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".dtype: unknown dtype ", static_cast<int>(ref.dtype)));
    }
    const bool part = ref.rank >= 0 && session::IsPartitioned(config, it->second);
    const uint64_t numel = static_cast<uint64_t>(part ? session::PartElements(config, it->second, ref.rank)
                                                      : config.parameters[it->second].numel);
    const uint64_t element = wire::ElementSize(dtype);
    const uint64_t want = numel * element;
    if (ref.byte_size != want) {
      const std::string what =
          part ? absl::StrCat("rank ", ref.rank, "'s part of '", ref.name, "'") : absl::StrCat("'", ref.name, "'");
      return absl::InvalidArgumentError(absl::StrCat(at, ".byte_size: ", what, " has ", numel, " elements, ", want,
                                                     " bytes in ", wire::DTypeName(dtype), "; got ", ref.byte_size));
    }
    if (ref.region != nullptr) {
      MUOND_ASSIGN_OR_RETURN(const uint64_t size, region_size(*ref.region, absl::StrCat(at, ".region")));
      // Overflow-safe: offset + bytes <= size without computing offset + bytes.
      if (ref.byte_size > size || ref.offset > size - ref.byte_size) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".offset: ", ref.byte_size, " bytes at offset ", ref.offset,
                                                       " end past region '", Echo(*ref.region), "' (", size,
                                                       " bytes)"));
      }
      if (ref.aligned && ref.offset % element != 0) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".offset: ", ref.offset, " is not a multiple of ", element,
                                                       " (the size of a ", wire::DTypeName(dtype), " element)"));
      }
    }
    refs.push_back({it->second, ref.offset, ref.byte_size, dtype});
  }
  if (require_all) {
    for (size_t p = 0; p < seen.size(); ++p) {
      if (!seen[p]) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": no place for parameter '", config.parameters[p].name,
                                                       "'; every parameter needs one"));
      }
    }
  }
  return refs;
}

}  // namespace muond::transport
