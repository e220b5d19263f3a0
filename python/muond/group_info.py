"""``GroupInfo``: one parameter group's account of a step, as ``StepInfo.groups[name]`` gives it —
its clipping and its telemetry (docs/algorithms.md, Telemetry) and the health warnings the step
raised for it (docs/operations.md, Warnings). Immutable; built from a daemon's ``StepResult``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple


class HelocoCounts(NamedTuple):
    """SGD with heloco: how many of the group's parameters had their gradient kept, reoriented and
    shrunk by HeLoCo's correction this step (docs/algorithms.md, SGD, HeLoCo)."""
    kept: int
    reoriented: int
    shrunk: int


@dataclass(frozen=True)
class GroupInfo:
    """One group's step: clipping, telemetry and warnings (None: not measured for this group)."""
    grad_norm: float              # the L2 norm of its gradients (unscaled), before clipping
    clip_coefficient: float       # what its gradients were multiplied by (1: not clipped)
    # The change of its masters this step (W_after - W_before): RMS, and norm over the masters'
    # norm before the step. None with the group option telemetry=False or on a skipped step.
    update_rms: Optional[float] = None
    update_ratio: Optional[float] = None
    # Muon: the norm of what Newton-Schulz received (the momentum), of its smallest matrix, and
    # the orthogonality residual ||G^2 - G||_F / ||G||_F (G = X X^T) of one Newton-Schulz output X
    # on the directions it has (a different matrix each step; docs/algorithms.md, Telemetry).
    momentum_norm: Optional[float] = None
    smallest_momentum_norm: Optional[float] = None
    orthogonality_residual: Optional[float] = None
    residual_parameter: str = ""
    stale_parameters: int = 0     # parameters without a gradient for warn_stale_steps steps or more
    # Kinds raised this step: "clip_stall", "momentum_below_eps", "parameter_stale", "residual_high".
    warnings: Tuple[str, ...] = ()
    heloco: Optional[HelocoCounts] = None  # SGD with the group option heloco


def _optional(message: Any, name: str) -> Optional[float]:
    return getattr(message, name) if message.HasField(name) else None


def groups_of(result: Any) -> Dict[str, GroupInfo]:
    """Every group's ``GroupInfo`` of a daemon's ``StepResult``, by group name (the telemetry only
    on an applied step; the clipping always)."""
    telemetry = {t.group: t for t in getattr(result, "group_telemetry", ())}
    groups: Dict[str, GroupInfo] = {}
    for clip in getattr(result, "group_clips", ()):
        t = telemetry.get(clip.group)
        if t is None:
            groups[clip.group] = GroupInfo(clip.grad_norm, clip.coefficient)
            continue
        groups[clip.group] = GroupInfo(
            clip.grad_norm, clip.coefficient,
            update_rms=_optional(t, "update_rms"), update_ratio=_optional(t, "update_ratio"),
            momentum_norm=_optional(t, "momentum_norm"),
            smallest_momentum_norm=_optional(t, "smallest_momentum_norm"),
            orthogonality_residual=_optional(t, "orthogonality_residual"),
            residual_parameter=t.residual_parameter, stale_parameters=int(t.stale_parameters),
            warnings=tuple(t.warnings),
            heloco=(HelocoCounts(int(t.heloco.kept), int(t.heloco.reoriented), int(t.heloco.shrunk))
                    if t.HasField("heloco") else None))
    return groups
