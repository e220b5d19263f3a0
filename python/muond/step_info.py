"""``StepInfo``: what an optimizer step reported (the daemon's answer, or ``LocalOptimizer``'s own
account of the same things). Immutable; no dependencies, so the local optimizer needs no gRPC."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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


def check_max_grad_norm(value):
    """None, or a finite number > 0 (as the daemon requires of header.max_grad_norm)."""
    if value is None:
        return None
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"max_grad_norm must be finite and > 0, got {value}")
    return value
