"""Loss scaling for fp16 trainers: the options of a daemon-side dynamic loss scaler (Megatron-Core's
DynamicGradScaler) and the same scaler in Python for ``LocalOptimizer``.

Usage with either optimizer: make it with ``loss_scaler=True`` (Megatron-Core's defaults) or a dict
of ``initial_scale``, ``min_scale``, ``growth_factor``, ``backoff_factor``, ``window``,
``hysteresis``; multiply each loss by ``opt.loss_scale`` (``opt.scale_loss(loss)``) before
``backward()``; ``step()`` divides the gradients by it, skips a step whose gradients overflowed,
and moves the scale as Megatron-Core does. A static scale instead: ``step(grad_scale=s)``.

Pure functions and a small state class; one optimizer uses a state from one thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

# Megatron-Core's defaults (initial_loss_scale 2**32, min_loss_scale 1, loss_scale_window 1000,
# hysteresis 2, growth x2, back-off x0.5).
DEFAULTS: Dict[str, float] = {"initial_scale": 2.0 ** 32, "min_scale": 1.0, "growth_factor": 2.0,
                              "backoff_factor": 0.5, "window": 1000, "hysteresis": 2}
MAX_SCALE = 1e30  # the daemon's range (kMinLossScale, kMaxLossScale): scale and 1/scale stay
MIN_SCALE = 1e-30  # normal fp32 numbers


def resolve(value: Any) -> Optional[Dict[str, float]]:
    """The scaler options of ``loss_scaler=``: None/False for none, True for the defaults, or a
    dict overriding some of them; ValueError naming a bad key or value."""
    if value is None or value is False:
        return None
    given = {} if value is True else dict(value)
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"loss_scaler: unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    out = dict(DEFAULTS, **given)
    for key in ("window", "hysteresis"):
        if int(out[key]) != out[key] or out[key] < 1:
            raise ValueError(f"loss_scaler.{key} must be an integer >= 1, got {out[key]!r}")
        out[key] = int(out[key])
    if not (MIN_SCALE <= out["initial_scale"] <= MAX_SCALE):
        raise ValueError(f"loss_scaler.initial_scale must be in [{MIN_SCALE}, {MAX_SCALE}], got "
                         f"{out['initial_scale']}")
    if not (MIN_SCALE <= out["min_scale"] <= out["initial_scale"]):
        raise ValueError(f"loss_scaler.min_scale must be in [{MIN_SCALE}, initial_scale], got "
                         f"{out['min_scale']}")
    if not (1 < out["growth_factor"] <= 1000):
        raise ValueError(f"loss_scaler.growth_factor must be in (1, 1000], got {out['growth_factor']}")
    if not (0 < out["backoff_factor"] < 1):
        raise ValueError(f"loss_scaler.backoff_factor must be in (0, 1), got {out['backoff_factor']}")
    return out


def check_grad_scale(value: Any) -> Optional[float]:
    """None, or a scale in [MIN_SCALE, MAX_SCALE] (what the daemon accepts as header.grad_scale)."""
    if value is None:
        return None
    value = float(value)
    if not (MIN_SCALE <= value <= MAX_SCALE and math.isfinite(value)):
        raise ValueError(f"grad_scale must be finite, in [{MIN_SCALE}, {MAX_SCALE}], got {value}")
    return value


@dataclass
class ScalerState:
    """The dynamic scaler's state, updated after every step exactly as the daemon's."""
    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 0

    @classmethod
    def initial(cls, options: Dict[str, float]) -> "ScalerState":
        return cls(float(options["initial_scale"]), 0, int(options["hysteresis"]))

    def update(self, options: Dict[str, float], found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)  # as the daemon's
            if self.hysteresis_tracker == 0:
                self.scale = max(self.scale * options["backoff_factor"], options["min_scale"])
            return
        self.growth_tracker += 1
        if self.growth_tracker == options["window"]:
            self.growth_tracker = 0
            self.hysteresis_tracker = int(options["hysteresis"])
            self.scale = min(self.scale * options["growth_factor"], MAX_SCALE)
