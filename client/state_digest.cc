#include "client/state_digest.h"

#include <openssl/evp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::client {
namespace {

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

}  // namespace

StateDigest FromProto(const v1::StateDigest& digest) {
  StateDigest out;
  out.step = digest.step();
  out.algorithm = digest.algorithm();
  out.digest = digest.digest();
  out.format = digest.format();
  out.num_tensors = digest.num_tensors();
  out.num_bytes = digest.num_bytes();
  return out;
}

absl::StatusOr<StateDigest> CombineShardDigests(const std::vector<StateDigest>& shards) {
  if (shards.empty()) return absl::InvalidArgumentError("shards: no shard digests to combine");
  if (shards.size() == 1) return shards.front();  // one daemon: its session's digest as it is
  StateDigest combined;
  combined.step = shards.front().step;
  combined.algorithm = shards.front().algorithm;
  combined.format = kShardedStateDigestFormat;
  std::string text = absl::StrCat(kShardedStateDigestFormat, "\n");
  std::vector<std::string> steps;
  for (size_t k = 0; k < shards.size(); ++k) {
    const StateDigest& shard = shards[k];
    if (shard.algorithm != combined.algorithm) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", k, " digests with ", shard.algorithm, ", shard 0 with ", combined.algorithm));
    }
    steps.push_back(absl::StrCat("shard ", k, " at step ", shard.step));
    absl::StrAppend(&text, shard.digest, "\n");
    combined.num_tensors += shard.num_tensors;
    combined.num_bytes += shard.num_bytes;
    combined.shards.push_back(shard.digest);
  }
  for (const StateDigest& shard : shards) {
    if (shard.step != combined.step) {
      return absl::FailedPreconditionError(absl::StrCat("the shards' states are at different steps (",
                                                        absl::StrJoin(steps, ", "),
                                                        "): restore every shard to one step before comparing digests"));
    }
  }
  combined.digest = Sha256Hex(text);
  return combined;
}

}  // namespace muond::client
