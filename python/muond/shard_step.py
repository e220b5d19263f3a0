"""The messages of a step over several daemons: prepare everywhere, decide, commit everywhere.

A sharded step (docs/sharding.md) prepares on every shard (gradients in, sums of squares out),
takes one decision from all the answers (``decide``: the global gradient norm, or a skip) and
commits it on every shard, so that the update is the one a single daemon would apply, bit for bit.
Pure functions of messages, which ``RemoteOptimizer`` sends, and ``CutOffStep``, a step it keeps to
send again as it was (a step that failed once some shard may have applied it).
"""

from __future__ import annotations

import math
from typing import Collection, List, NamedTuple, Optional, Sequence, Tuple

import grpc
import torch

from ._stubs import pb
from .errors import MuondError


def prepare_header(header: pb.StepHeader, held: Collection[str]) -> pb.StepHeader:
    """The prepare of ``header`` for the shard holding the parameters ``held``: with the QK-clip
    logits of its own pairs only."""
    prepare = pb.StepHeader.FromString(header.SerializeToString())
    prepare.phase = pb.STEP_PHASE_PREPARE
    del prepare.qk_logits[:]
    prepare.qk_logits.extend(logits for logits in header.qk_logits if logits.query in held)
    return prepare


def decide(prepared: Sequence[pb.StepResult], indices_of: Sequence[Sequence[int]],
           names: Sequence[str]) -> pb.ShardDecision:
    """The decision every shard applies, from the answers ``prepared`` of the shards holding the
    parameters ``indices_of[k]`` (of ``names``): the one a shard that already committed this step
    took, else the global norm summed in the whole session's parameter order (as one daemon sums
    it) and a skip when any gradient is not finite or any shard's guard refuses."""
    for result in prepared:
        if result.replayed:
            return applied_decision(result)
    sums = [0.0] * len(names)
    for k, result in enumerate(prepared):
        for i, value in zip(indices_of[k], result.sum_squares):
            sums[i] = value
    total, first_bad = 0.0, None
    for i, value in enumerate(sums):
        total += value
        if first_bad is None and not math.isfinite(value):
            first_bad = names[i]
    if first_bad is not None:
        reason = f"non-finite gradient in '{first_bad}'"
    else:
        reason = next((r.skip_reason for r in prepared if r.skip_reason), "")
    return pb.ShardDecision(grad_norm=math.sqrt(total), skip_reason=reason)


def applied_decision(replayed: pb.StepResult) -> pb.ShardDecision:
    """The decision a shard applied, from its answer to a resent prepare of that step."""
    return pb.ShardDecision(grad_norm=replayed.grad_norm,
                            skip_reason="" if replayed.applied else replayed.skip_reason)


def commit_header(header: pb.StepHeader, decision: pb.ShardDecision) -> pb.StepHeader:
    """The commit of ``header`` with ``decision``, the same for every shard."""
    commit = pb.StepHeader(step=header.step, rank=header.rank, phase=pb.STEP_PHASE_COMMIT,
                           return_dtype=header.return_dtype,
                           max_chunk_bytes=header.max_chunk_bytes)
    commit.decision.CopyFrom(decision)
    return commit


def result_of(commit: pb.StepHeader, committed: List[pb.StepResult], step: int) -> pb.StepResult:
    """The step's result over every shard, from their answers to ``commit``, which all named
    ``step``. The ranks that contributed are every shard's (lock-step: all of them); this rank was
    included when every shard says so."""
    return pb.StepResult(step=step, applied=committed[0].applied,
                         replayed=all(r.replayed for r in committed),
                         skip_reason=commit.decision.skip_reason,
                         grad_norm=commit.decision.grad_norm,
                         compute_seconds=max(r.compute_seconds for r in committed),
                         num_zeros_in_grad=sum(r.num_zeros_in_grad for r in committed),
                         loss_scale=committed[0].loss_scale,
                         contributors=committed[0].contributors,
                         total_weight=committed[0].total_weight,
                         included=all(r.included for r in committed))


class CutOffStep(NamedTuple):
    """A sharded step that failed once some shard may have applied it: its header (number,
    options, weight) and copies of its gradients, to send again as they were (None: they could
    not be copied)."""
    header: pb.StepHeader
    grads: Optional[List[Tuple[str, torch.Tensor]]]
    weight: Optional[float]


def cut_off_refusal(session_id: str, step: int, behind: str, rpc: str,
                    resendable: bool = True) -> MuondError:
    """The FAILED_PRECONDITION for shards at two steps while this optimizer keeps ``step``, cut
    off in its commit on the shards ``behind`` (named with their steps); ``resendable``: whether
    its gradients were kept, to send it again."""
    what = (f"the next step() sends it again (with its own gradients) and brings every shard to "
            f"step {step}" if resendable else
            "its gradients could not be kept, so the next step() is refused: restore every shard "
            "to one step (load_state_dict of a saved state_dict)")
    return MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                      f"session '{session_id}': step {step} was cut off in its commit: {behind}, "
                      f"the others at step {step}; {what}", rpc)
