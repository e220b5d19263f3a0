// ShardedSession: one session spread over several daemons (docs/sharding.md). Each daemon holds
// whole parameters, placed by PlaceSpec; a step is prepared on every daemon (gradients in, sums of
// squares out), decided here (the global gradient norm summed in the whole session's parameter
// order, and a skip when any shard saw a non-finite gradient or refuses by its guard), then committed
// on every daemon with that decision — the update one daemon would apply, bit for bit. A step that
// failed anywhere is sent again as a whole, to every shard, with the same gradients: shards that
// committed it answer with their decision, the others commit it, so every shard applies it once.
// A step that failed after its tries once some shard may have applied it is kept (copies of its
// gradients and its options) and the next Step() of its number sends it again as it was.
//
// Owns one Client and one Session per daemon; the shards are driven concurrently, one thread each
// per phase. Thread-safety: as Session, one thread at a time.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/muond_client.h"
#include "client/shard_placement.h"

namespace muond::client {

class ShardedSession {
 public:
  // Connects to every endpoint (options.endpoint is not used), then creates the session on each —
  // or attaches, with the identical spec and endpoint list. A different endpoint list for an
  // existing session is ALREADY_EXISTS naming it. A step its trainer left between its commits
  // (some shards at k, the others at k - 1 holding k prepared) is committed on the others with the
  // decision of those that committed it, as a resend of the step would; shards found at different
  // steps otherwise are FAILED_PRECONDITION naming the shards behind.
  static absl::StatusOr<std::unique_ptr<ShardedSession>> Open(ClientOptions options, std::vector<std::string> endpoints,
                                                              const std::string& session_id,
                                                              const v1::SessionSpec& spec);

  const Placement& placement() const { return placement_; }
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  bool attached() const { return attached_; }
  bool initialized() const { return initialized_; }
  int64_t last_step() const { return last_step_; }
  // What last_step() ran with beyond the groups' options when the session was opened, as
  // Session::last_overrides(): the records of the shards whose attach answered for that step (a
  // shard whose cut-off step Open committed answered for the step before), one entry per group;
  // nullopt when any of them does not know it.
  const std::optional<std::vector<v1::GroupOverride>>& last_overrides() const { return last_overrides_; }

  // This handle is rank `rank` holding parts of the partitioned groups' parameters (docs/ranks.md,
  // Over several daemons): Session::HoldParts on every shard, each of which holds whole parameters
  // and takes this rank's parts of them. Uploads, steps and reads then carry its parts, and steps
  // must name it (StepOptions::rank). INVALID_ARGUMENT, naming the shard, as Session::HoldParts.
  absl::Status HoldParts(int rank);
  // Uploads every parameter's initial value (a rank holding parts: its parts), each to its daemon.
  absl::Status UploadParameters(std::span<const TensorView> parameters);
  // One step over every shard (see the class comment); the reply carries every parameter (or writes
  // those of options.parameters_out) as Session::Step does. An error after its tries once some shard
  // may have applied the step (its commit went out; with several ranks, its prepare) leaves it kept:
  // cut_off_step() names it, and the next Step() of its number sends it with the gradients and
  // options it was first sent with (the shards that committed it answer with their decision, the
  // others commit that decision with the gradients it was computed from), warning through
  // ClientOptions::warn; that call's gradients and options are not used, its parameters_out is.
  // Until then the shards may be at two steps, and calls that need one step name the kept one.
  absl::StatusOr<StepReply> Step(int64_t step, std::span<const TensorView> gradients, const StepOptions& options = {});
  // The number of the step kept by a failed Step() (see Step), nullopt when there is none. A later
  // step that fails while one is kept keeps nothing of its own unless every shard took its prepare
  // (then each is past the kept step, which is dropped): the kept one still goes out first.
  std::optional<int64_t> cut_off_step() const;
  // Forgets the kept step without sending it: for a caller that brought every shard to one step
  // another way (each restored from checkpoints of one step), after which resending it would apply
  // it a second time on the shards that had committed it. Opening the session again also forgets it.
  void DropCutOffStep();
  absl::StatusOr<ParameterMap> GetParameters(int64_t* last_step = nullptr);
  // Checkpoints every shard; their common step. Refused (FAILED_PRECONDITION, naming a kept step)
  // before any shard writes one when the shards are at different steps: checkpoints of two steps
  // restore to no step of the session.
  absl::StatusOr<int64_t> Checkpoint();
  // Every shard's state digest combined in shard order (CombineShardDigests, client/state_digest.h);
  // FAILED_PRECONDITION when the shards are at different steps (naming a kept step).
  absl::StatusOr<StateDigest> GetStateDigest();
  absl::Status Close();

 private:
  ShardedSession() = default;
  // Runs `call(k)` for every shard at once; the first failure (in shard order), naming its shard.
  template <typename T, typename Call>
  absl::StatusOr<std::vector<T>> OnEveryShard(Call call);
  // One try of a step; sets `may_apply` once a message that may have a shard apply this rank's
  // gradients went out (the first commit; with several ranks, the first prepare).
  absl::StatusOr<StepReply> StepOnce(int64_t step, const std::vector<std::vector<TensorView>>& gradients,
                                     const StepOptions& options, bool& may_apply);
  // Keeps a step that failed once some shard may have applied it, for the next Step() of its number;
  // nothing when a step is kept already (this one's resend, or an earlier step still to go out).
  void KeepCutOffStep(int64_t step, const std::vector<std::vector<TensorView>>& gradients, const StepOptions& options);
  v1::ShardDecision Decide(const std::vector<StepReply>& prepared) const;
  // Commits a step cut off mid-commit on the shards behind (see Open) and moves them to its number
  // in `steps`; leaves them as they are when that cannot be done (a shard further behind, one that
  // lost its prepared step, one that does not know how its step went).
  void FinishCutOffStep(std::vector<int64_t>& steps);
  // The common step of `steps` (one per shard), else FAILED_PRECONDITION naming the shards behind.
  absl::StatusOr<int64_t> CommonStep(const std::vector<int64_t>& steps) const;
  // Each shard's last step, as its daemon lists the session.
  absl::StatusOr<std::vector<int64_t>> ShardSteps();
  // A step refused for its number: CommonStep's refusal when the shards are at different steps (one
  // restored to an older checkpoint), else `refused` as it is.
  absl::Status NameShardsBehind(absl::Status refused);
  // last_overrides() from the shards' attach answers (`answered`: the step each answered for).
  void TakeLastOverrides(const std::vector<int64_t>& answered);

  std::vector<std::string> endpoints_;
  std::string session_id_;
  v1::SessionSpec spec_;
  Placement placement_;
  std::map<std::string, int> shard_of_;       // parameter name → its daemon
  std::vector<std::vector<int>> indices_of_;  // per daemon: its parameters' indices in spec_, in order
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::unique_ptr<Session>> sessions_;
  ClientOptions options_;
  bool attached_ = false;
  bool initialized_ = false;
  int64_t last_step_ = 0;
  std::optional<std::vector<v1::GroupOverride>> last_overrides_;
  // A step kept by KeepCutOffStep: its options (without parameters_out, which a resend takes from
  // its own call) and copies of its gradients by shard, `views` into `values` (both empty, and
  // gradients_kept false, when they could not be copied: its number is then refused).
  struct CutOffStep {
    int64_t step = 0;
    StepOptions options;
    bool gradients_kept = false;
    std::vector<std::vector<float>> values;
    std::vector<std::vector<TensorView>> views;
  };
  std::optional<CutOffStep> cut_off_;  // held in place: keeping one allocates only its copies
};

}  // namespace muond::client
