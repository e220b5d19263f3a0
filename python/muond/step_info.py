"""``StepInfo``: what an optimizer step reported (the daemon's answer, or ``LocalOptimizer``'s own
account of the same things). Immutable; no dependencies, so the local optimizer needs no gRPC."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

from .group_info import GroupInfo, groups_of


@dataclass(frozen=True)
class StepInfo:
    """What the last step did, as the daemon reported it (or ``LocalOptimizer`` found it)."""
    step: int
    applied: bool          # False when skipped (non-finite gradient)
    replayed: bool         # the step had been applied before; no second update happened
    skip_reason: str
    grad_norm: float       # global L2 norm of the gradients, before clipping
    compute_seconds: float  # time the optimizer step took (on the daemon, for a remote one)
    round_trip_seconds: float  # wall time of the whole exchange, seen from here
    attempts: int = 1      # tries it took (more than 1 after UNAVAILABLE / DEADLINE_EXCEEDED)
    # Gradient elements exactly 0, when the optimizer was made with log_num_zeros_in_grad=True
    # (Megatron-Core's log_num_zeros_in_grad); None otherwise.
    num_zeros_in_grad: Optional[int] = None
    # With a loss scaler: the scale to multiply the next loss by (``opt.loss_scale``); else None.
    loss_scale: Optional[float] = None
    # The ranks whose gradients the step used (ascending) and the sum of their weights
    # (``step(weight=)``, 1 each by default); one rank: (0,) and its weight. Empty and 0 when the
    # daemon does not say: one older than weights and quorum steps, or the answer to a retry of a
    # step whose contributors it does not know (restored from a checkpoint of an older daemon, or
    # after a ``load_state_dict``; a one-rank session restored from a checkpoint).
    contributors: Tuple[int, ...] = (0,)
    total_weight: float = 1.0
    # Whether this rank's gradients were among them. False: a quorum step went on without this
    # rank (it came late, or had fallen behind); the parameters are those after ``step``, the
    # session's last step, and the next ``step()`` sends ``step + 1`` (docs/ranks.md).
    included: bool = True
    # Asynchronous sessions (``sync_mode="async"``; None otherwise). ``global_step``: the global
    # step this push became (for a resend of the rank's last push, the one it became the first
    # time; 0 where the daemon no longer knows it: an older push resent, or a state replaced since);
    # None for a stale push, which became none. ``staleness``: the global steps applied between the push's
    # base_step and it (for a stale push: between its base_step and the parameters it was given
    # instead, more than max_staleness). ``step`` is the global step of the parameters the model
    # now holds, the base_step of the next push.
    global_step: Optional[int] = None
    staleness: Optional[int] = None
    # A push refused as more than max_staleness global steps behind (PUSH_TOO_STALE): its
    # gradients were dropped, nothing was applied (``applied`` False, ``included`` False), and the
    # model took the session's latest parameters instead (docs/ranks.md, Asynchronous).
    stale: bool = False
    # Each group's clipping this step, by group name: the norm of its gradients and the coefficient
    # they were multiplied by (group option clip_scope; docs/algorithms.md, Clipping). Empty when
    # the daemon does not say (an older one, a sharded session's combined answer).
    group_clips: Mapping[str, "GroupClip"] = field(default_factory=dict)
    # Each group's clipping, telemetry and health warnings this step, by group name
    # (``muond.group_info.GroupInfo``; docs/algorithms.md, Telemetry). Empty when the daemon does
    # not say. ``LocalOptimizer`` gives the clipping alone (its telemetry fields None, no warnings).
    groups: Mapping[str, GroupInfo] = field(default_factory=dict)

    @classmethod
    def of_result(cls, result: Any, *, seconds: float, attempts: int, count_zeros: bool,
                  scaled: bool, ranks: Tuple[Tuple[int, ...], float, bool],
                  asynchronous: bool = False) -> "StepInfo":
        """The ``StepInfo`` of a daemon's ``StepResult``: ``seconds`` and ``attempts`` as seen
        from here, ``num_zeros_in_grad`` when ``count_zeros``, ``loss_scale`` when ``scaled`` (a
        loss scaler), ``ranks`` the (contributors, total_weight, included) of ``rank_report``,
        and an asynchronous push's ``global_step`` and ``staleness``."""
        contributors, total_weight, included = ranks
        return cls(result.step, result.applied, result.replayed, result.skip_reason,
                   result.grad_norm, result.compute_seconds, seconds, attempts,
                   num_zeros_in_grad=result.num_zeros_in_grad if count_zeros else None,
                   loss_scale=result.loss_scale if scaled else None,
                   contributors=contributors, total_weight=total_weight, included=included,
                   global_step=int(result.global_step) if asynchronous else None,
                   staleness=int(result.staleness) if asynchronous else None,
                   **group_fields(result))

    @classmethod
    def stale_push(cls, step: int, staleness: int, *, seconds: float, attempts: int,
                   loss_scale: Optional[float]) -> "StepInfo":
        """A push refused as too stale: nothing applied; the model holds global step ``step``."""
        return cls(step, False, False, "push too stale", math.nan, 0.0, seconds, attempts,
                   loss_scale=loss_scale, contributors=(), total_weight=0.0, included=False,
                   staleness=staleness, stale=True)


class GroupClip(NamedTuple):
    """One group's clipping in a step: its gradients' L2 norm (unscaled) and the coefficient."""
    grad_norm: float
    coefficient: float


def group_fields(result: Any) -> Dict[str, Any]:
    """The per-group fields of ``StepInfo`` (``group_clips``, ``groups``) of a daemon's answer."""
    return {"group_clips": group_clips_of(result), "groups": groups_of(result)}


def group_clips_of(result: Any) -> Dict[str, GroupClip]:
    """The ``group_clips`` of a daemon's ``StepResult``, by group name."""
    return {c.group: GroupClip(c.grad_norm, c.coefficient) for c in getattr(result, "group_clips", ())}


def rank_report(result: Any, quorum: bool) -> Tuple[Tuple[int, ...], float, bool]:
    """(contributors, total_weight, included) of a daemon's ``StepResult`` for a session in quorum
    mode or not. Without contributors the daemon does not know them: it is older than weights and
    quorum steps (it applied the plain mean of every rank's gradients in lock-step: this rank was
    included; its ``included`` field reads false as unset), or it answers a retry of a step whose
    contributors it does not know (docs/ranks.md, Daemon restarts) — included in a lock-step
    session, and in a quorum session what the daemon says (false when it cannot tell)."""
    if result.contributors:
        return tuple(int(r) for r in result.contributors), float(result.total_weight), bool(result.included)
    included = bool(result.included) if quorum and result.replayed else True
    return (), 0.0, included


def check_max_grad_norm(value):
    """None, or a finite number > 0 (as the daemon requires of header.max_grad_norm)."""
    if value is None:
        return None
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"max_grad_norm must be finite and > 0, got {value}")
    return value
