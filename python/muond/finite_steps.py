"""The daemon's finiteness guard (docs/algorithms.md, Finite steps), for ``LocalOptimizer``.

A step is applied only when upper bounds on the magnitudes it can leave in each parameter's master
and optimizer slots, and compute on the way, stay within the limits that keep them finite (1e36, or
fp16's 65504 for a tensor stored in fp16). The bounds are the daemon's (``BoundStep`` of
kernels/optim/muon.cc, dion2.cc, adamw.cc, lion.cc and sgd.cc), term by term in Python floats (fp64).

``MagnitudeGuard`` keeps a bound per optimizer slot as the daemon's sessions do: measured exactly
when unknown (the first step, after ``load_state_dict``), advanced by each applied step's bound,
and tried first with the gradient's L2 norm bounding every |g|; only when that is not good enough
are the slots' exact magnitudes read and the largest |g| taken. The master is the parameter itself
here, which a trainer may change in ways torch does not count (through ``.data``), so its largest
|x| is read at every step; and a parameter stored in fewer bits than its ``master_dtype`` says
(an fp16 model) is held to its own dtype's limit. The loose bound only ever asks for the exact
one, so whether a step is applied depends on the tensors alone, as on the daemon.

Thread-safety: none; one ``LocalOptimizer`` owns its guard and uses it from one thread.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from . import option_facts as facts
from . import options as opts

ROUNDING = 1.0 + 2.0 ** -20  # a step rounds a handful of times in fp32 (ε = 2⁻²⁴)
MAGNITUDE_LIMIT = 1e36
MAX_NS_GROWTH = 1000.0  # the daemon refuses a Newton–Schulz schedule whose bound exceeds it
_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
_MAX_FINITE = {"fp32": 3.4028234663852886e38, "bf16": 3.3895313892515355e38, "fp16": 65504.0}


class StepBounds(NamedTuple):
    """Bounds after one step of one parameter: its master, each slot (by name, in the daemon's
    slot order) and the largest value the step computes on the way."""
    master: float
    slots: Dict[str, float]
    peak: float


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as the daemon's decay factors are."""
    return struct.unpack("f", struct.pack("f", x))[0]


# How far rounding can carry Newton–Schulz's singular values (the daemon's ``NsRoundingOf``): the
# normalized input's largest one up to a factor 1 + input above 1/norm_safety, each step's result
# by up to 1 + step.
NS_INPUT_ROUNDING = {"fp32": 2.0 ** -16, "tf32": 2.0 ** -10, "bf16": 2.0 ** -7}
NS_STEP_ROUNDING = 2.0 ** -20
_SAFETY_LADDER = (1.001, 1.002, 1.005, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0)


@functools.lru_cache(maxsize=64)
def ns_singular_value_bound(coefficients: Tuple[Tuple[float, float, float], ...], after: str, steps: int,
                            norm_safety: float, input_rounding: float = 0.0, step_rounding: float = 0.0) -> float:
    """Twice the largest |σ| the scalar map σ ← (aσ + bσ³ + cσ⁵)·(1 + step_rounding) of the
    schedule reaches over 4097 points of [0, (1 + input_rounding)/norm_safety] in ``steps`` steps
    (infinity when it overflows): a bound on the singular values of Newton–Schulz's output."""
    points = 4097
    top = (1.0 + input_rounding) / norm_safety
    grow = 1.0 + step_rounding
    largest = top
    for i in range(points):
        sigma = top * i / (points - 1)
        for t in range(steps):
            a, b, c = facts.coefficient_at(coefficients, after, t)
            s2 = sigma * sigma
            sigma = sigma * (a + s2 * (b + s2 * c)) * grow
            if not math.isfinite(sigma):
                return math.inf
            largest = max(largest, abs(sigma))
    return 2 * largest


def _input_safety(group: Mapping[str, Any]) -> float:
    return 1.0 if group.get("ns_preconditioner") == "aol" else group["ns_norm_safety"]


def _precision(group: Mapping[str, Any]) -> str:
    return group.get("matmul_precision") or "fp32"


def _group_bound(group: Mapping[str, Any], safety: float) -> float:
    coefficients, after = opts.coefficient_schedule(group)
    return ns_singular_value_bound(tuple(tuple(float(v) for v in co) for co in coefficients), after,
                                   int(group["ns_steps"]), float(safety), NS_INPUT_ROUNDING[_precision(group)],
                                   NS_STEP_ROUNDING)


def ns_bound(group: Mapping[str, Any]) -> float:
    """``ns_singular_value_bound`` of a Muon or Dion2 group's iteration, with its precision's
    rounding."""
    return _group_bound(group, _input_safety(group))


def _safety_hint(group: Mapping[str, Any]) -> str:
    if group.get("ns_preconditioner") == "aol":
        return ""
    for safety in _SAFETY_LADDER:
        if safety > group["ns_norm_safety"] and _group_bound(group, safety) <= MAX_NS_GROWTH:
            return f"; ns_norm_safety {safety:g} keeps them bounded"
    return "; no ns_norm_safety up to 2 keeps them bounded"


def check_ns_growth(group: Mapping[str, Any]) -> None:
    """ValueError in the daemon's words for a Muon or Dion2 group whose iteration can grow
    singular values beyond ``MAX_NS_GROWTH``."""
    if group["optimizer"] not in ("muon", "dion2"):
        return
    growth = ns_bound(group)
    if not growth <= MAX_NS_GROWTH:
        precision = _precision(group)
        raise ValueError(f"ns_coefficients: with {group['ns_steps']} steps, ns_norm_safety "
                         f"{group['ns_norm_safety']:g} and matmul_precision {precision} the iteration grows "
                         f"singular values to about {growth:g}; at most {MAX_NS_GROWTH:g} is accepted "
                         f"(Newton-Schulz must keep them near 1, also for inputs that rounding puts up to "
                         f"{NS_INPUT_ROUNDING[precision]:g} above 1/ns_norm_safety){_safety_hint(group)}")


def slot_names(group: Mapping[str, Any]) -> List[str]:
    """The group's optimizer slots in the daemon's order (``SlotNames``)."""
    kind = group["optimizer"]
    if kind == "muon":
        return ["momentum"] if group.get("moment2_method") is None else ["momentum", "moment2"]
    if kind == "dion2":
        return ["momentum"]
    if kind == "adamw":
        return ["exp_avg", "exp_avg_sq"]
    if kind == "lion":
        return ["exp_avg"]
    if (group.get("nesterov_delay") or 1) > 1:
        return ["momentum_buffer", "delay_buffer"]
    return ["momentum_buffer"]


def _chosen(group: Mapping[str, Any], option: str) -> bool:
    """Whether a choice option other than "none" is set."""
    return group.get(option) not in (None, "none")


def _aol_gram(rows: int, cols: int, input_bound: float) -> float:
    return 2.0 * max(rows, cols) * input_bound * input_bound


def _muon(group, shape, master: float, slots: Mapping[str, float], g: float, step_count: int) -> StepBounds:
    R = ROUNDING
    mu, wd, lr = group["momentum"], group["weight_decay"], group["lr"]
    mode = group["weight_decay_mode"]
    m = slots.get("momentum", 0.0)
    g_decayed = (g + wd * master) * R if mode == "l2" else g
    if group["momentum_style"] == "ema":
        m_next = (mu * m + (1 - mu) * g_decayed) * R
        u = (g_decayed + mu * (m_next + g_decayed)) * R if group["nesterov"] else m_next
    else:
        m_next = (mu * m + g_decayed) * R
        u = (g_decayed + mu * m_next) * R if group["nesterov"] else m_next
    shapes = facts.matrix_shapes(group, shape)
    sigma = ns_bound(group)
    scale = max([0.0] + [facts.muon_scale(group, r, c) for r, c in shapes])
    step = scale * (max(sigma, 1.0) if _chosen(group, "post_normalization") else sigma)
    moment2 = moment2_peak = 0.0
    v = slots.get("moment2", 0.0)
    min_dim = max([0] + [min(r, c) for r, c in shapes])
    most_rows = max([0] + [r for r, _ in shapes])
    most_elements = max([0] + [r * c for r, c in shapes])
    method = group.get("moment2_method")
    if method == "adamuon":  # v′ ≥ (1−β2)·x², so |x/(√v′ + ε)| ≤ 1/√(1−β2)
        x2 = step * step * R
        moment2 = max(v, x2) * R
        moment2_peak = x2
        step = R / math.sqrt(1.0 - group["beta2"])
    elif method == "normuon":  # ‖O‖_F ≤ √min(m, n)·σ bounds every element
        moment2 = max(v, sigma * sigma) * R
        moment2_peak = moment2
        step *= math.sqrt(float(min_dim)) * R
    elif method in ("namo", "namo_d"):
        diagonal = method == "namo_d"
        line = float(most_rows if diagonal else most_elements)
        moment2 = max(v, line * g * g) * R
        moment2_peak = moment2
        size = math.sqrt(line) * u
        alpha = (size / math.sqrt(group["eps"]) / max(1.0 - mu, 1e-300) if diagonal
                 else size / group["eps"])
        step *= alpha * R
    if mode == "decoupled":
        decay = _f32(1.0 - lr * wd)
    elif mode == "independent":
        decay = _f32(1.0 - wd)
    else:  # l2 (in the gradient) and cautious (element by element with the update)
        decay = 1.0
    master_next = (abs(decay) * master + lr * step) * R
    out = {"momentum": m_next}
    if method is not None:
        out["moment2"] = moment2
    normalized = 1.0 if _chosen(group, "momentum_normalization") else 0.0
    gram = 0.0
    if group.get("ns_preconditioner") == "aol":
        source = 1.0 if normalized > 0 else u
        gram = max([0.0] + [_aol_gram(r, c, source) for r, c in shapes])
    peak = max(master_next, m_next, u, g_decayed + m, moment2_peak, step, normalized, gram)
    return StepBounds(master_next, out, peak)


def _dion2(group, shape, master: float, slots: Mapping[str, float], g: float, step_count: int) -> StepBounds:
    R = ROUNDING
    lr, wd = group["lr"], group["weight_decay"]
    m_next = (slots.get("momentum", 0.0) + g) * R
    if len(shape) == 3:
        rows, cols = shape[1], shape[2]
    else:
        numel = math.prod(shape)
        rows, cols = shape[0], (numel // shape[0] if shape[0] > 0 else 0)
    step = facts.muon_scale(group, rows, cols) * ns_bound(group) * R
    decay = _f32(1.0 - wd) if group["weight_decay_mode"] == "independent" else _f32(1.0 - lr * wd)
    master_next = (abs(decay) * master + lr * step) * R
    gram = _aol_gram(rows, cols, m_next) if group.get("ns_preconditioner") == "aol" else 0.0
    return StepBounds(master_next, {"momentum": m_next}, max(master_next, m_next, step, gram))


def _adamw(group, shape, master: float, slots: Mapping[str, float], g: float, step_count: int) -> StepBounds:
    R = ROUNDING
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    b1, b2 = group["betas"]
    m, v = slots.get("exp_avg", 0.0), slots.get("exp_avg_sq", 0.0)
    coupled = group["weight_decay_mode"] == "l2"
    if coupled:
        g = (g + wd * master) * R
    decay = 1.0 if coupled else abs(1.0 - lr * wd)
    bc1 = 1.0 - math.pow(b1, float(step_count + 1))
    m_next = (b1 * m + (1 - b1) * g) * R
    v_next = (b2 * v + (1 - b2) * g * g) * R
    quotient = m_next / eps
    master_next = (decay * master + lr / bc1 * quotient) * R
    return StepBounds(master_next, {"exp_avg": m_next, "exp_avg_sq": v_next},
                      max(master_next, m_next, v_next, g * g, g + m, quotient))


def _lion(group, shape, master: float, slots: Mapping[str, float], g: float, step_count: int) -> StepBounds:
    R = ROUNDING
    lr, wd = group["lr"], group["weight_decay"]
    _, b2 = group["betas"]
    m = slots.get("exp_avg", 0.0)
    m_next = (b2 * m + (1 - b2) * g) * R
    master_next = (abs(1.0 - lr * wd) * master + lr) * R
    return StepBounds(master_next, {"exp_avg": m_next}, max(master_next, m_next, m + g))


def _sgd(group, shape, master: float, slots: Mapping[str, float], g: float, step_count: int) -> StepBounds:
    R = ROUNDING
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    if group.get("heloco"):  # each element stays within (1 + √n)·bound, kept, shrunk or reoriented
        g *= (1 + math.sqrt(float(math.prod(shape)))) * R
    delay = group.get("nesterov_delay") or 1
    if delay > 1:
        c = group.get("momentum_activation") or 0.0
        total = (slots.get("delay_buffer", 0.0) + g) * R
        m = (mu * slots.get("momentum_buffer", 0.0) + total / delay) * R
        step = lr * (max(1.0 - c * delay + c, c) * mu * m + g / delay) * R
        master_next = (master + step) * R
        return StepBounds(master_next, {"momentum_buffer": m, "delay_buffer": total}, max(master_next, m, total, g))
    b = slots.get("momentum_buffer", 0.0)
    g_decayed = (g + wd * master) * R
    b_next, d = b, g_decayed
    if mu != 0:
        b_next = (mu * b + g_decayed) * R
        d = (g_decayed + mu * b_next) * R if group["nesterov"] else b_next
    master_next = (master + lr * d) * R
    return StepBounds(master_next, {"momentum_buffer": b_next}, max(master_next, b_next, d, g_decayed))


_BOUND_RULES = {"muon": _muon, "dion2": _dion2, "adamw": _adamw, "lion": _lion, "sgd": _sgd}


def bound_step(group: Mapping[str, Any], shape: Sequence[int], master: float, slots: Mapping[str, float],
               grad_bound: float, step_count: int) -> StepBounds:
    """Bounds after one step of a parameter of ``shape`` in ``group`` from bounds on its master,
    its slots (missing ones: 0, not yet created) and every |g| (after clipping), at the
    parameter's ``step_count`` steps so far."""
    return _BOUND_RULES[group["optimizer"]](group, tuple(int(d) for d in shape), master, slots, grad_bound,
                                            step_count)


_TIGHTNESS = {"fp32": 0, "bf16": 1, "fp16": 2}  # by limit, then by rounding
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def master_dtype(group: Mapping[str, Any], param: Optional[torch.Tensor] = None) -> str:
    """The format the master is held to: the group's ``master_dtype``, or the parameter's own
    dtype where that is narrower (a LocalOptimizer's masters are the parameters)."""
    stored = opts.storage_dtype(group, "master")
    own = _DTYPE_NAMES.get(param.dtype, "fp32") if param is not None else "fp32"
    return own if _TIGHTNESS[own] > _TIGHTNESS[stored] else stored


def beyond_limits(group: Mapping[str, Any], bounds: StepBounds,
                  param: Optional[torch.Tensor] = None) -> Tuple[str, StepBounds]:
    """(where ``bounds`` pass a storage limit, in the daemon's words, or "") and the bounds widened
    by the rounding of storing each tensor in its format, as the daemon keeps them; the master's
    format is ``master_dtype(group, param)``."""
    def limit(dtype: str, bound: float, what: str) -> Tuple[str, float]:
        bound *= 1.0 + _ROUNDOFF[dtype]
        most = min(MAGNITUDE_LIMIT, _MAX_FINITE[dtype])
        if bound <= most:
            return "", bound
        return (f"{what} to magnitudes up to {bound:.6g}, beyond the limit of {most:.6g} that keeps "
                f"{dtype} finite"), bound

    beyond, master = limit(master_dtype(group, param), bounds.master, "(its master)")
    slots = dict(bounds.slots)
    for name in slot_names(group):
        if beyond or name not in slots:
            continue
        beyond, slots[name] = limit(opts.storage_dtype(group, name), slots[name], f"(its {name})")
    widened = StepBounds(master, slots, bounds.peak)
    if beyond:
        return beyond, widened
    if bounds.peak > MAGNITUDE_LIMIT:
        return (f"or its optimizer state to magnitudes up to {bounds.peak:.6g}, beyond the limit of "
                f"{MAGNITUDE_LIMIT:.6g} that keeps fp32 finite"), widened
    return "", widened


def largest_magnitudes(tensors: Sequence[torch.Tensor]) -> List[float]:
    """Each tensor's largest |x| (0 for an empty one), read back once per device rather than once
    per tensor (a CUDA read is a synchronization)."""
    out = [0.0] * len(tensors)
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([tensors[i].detach().abs().max().double() for i in indices]).tolist()
        for i, value in zip(indices, values):
            out[i] = value
    return out


def _max_abs(t: Optional[torch.Tensor]) -> float:
    return float(t.detach().abs().max()) if t is not None and t.numel() > 0 else 0.0


class MagnitudeGuard:
    """The slots' bounds of one optimizer's parameters between steps, and the check of a step."""

    def __init__(self) -> None:
        self._slots: Dict[int, Dict[str, float]] = {}  # by id() of the parameter

    def forget(self) -> None:
        """Drops every bound (the state was replaced): the next step measures again."""
        self._slots.clear()

    def check(self, name: str, p: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any],
              state: Mapping[str, Any], master: float, grad_norm: float, coefficient: float,
              step_count: int) -> Tuple[str, Any]:
        """The skip reason of a step of parameter ``p`` ("" when it may go on) and a token for
        ``applied``. ``master`` is the parameter's largest |x| (``largest_magnitudes``),
        ``grad_norm`` the gradient's L2 norm, ``coefficient`` the factor it is multiplied by
        (clipping over the loss scale). Reads ``state``, never changes it."""
        if p.numel() == 0:  # nothing to take anywhere
            return "", StepBounds(0.0, {}, 0.0)
        slots = self._slots.get(id(p))
        if slots is None:
            slots = self._measure(p, group, state)
        bounds = bound_step(group, p.shape, master, slots, grad_norm * coefficient * ROUNDING, step_count)
        beyond, widened = beyond_limits(group, bounds, p)
        if beyond:
            slots = self._measure(p, group, state)
            bounds = bound_step(group, p.shape, master, slots, _max_abs(grad) * coefficient * ROUNDING,
                                step_count)
            beyond, widened = beyond_limits(group, bounds, p)
            if beyond:
                return f"the update could take '{name}' {beyond}; nothing was changed", None
        return "", widened

    def applied(self, p: torch.Tensor, token: Any) -> None:
        """Records the slots' bounds a checked step left in ``p`` (call once it is written)."""
        self._slots[id(p)] = dict(token.slots)

    def _measure(self, p: torch.Tensor, group: Mapping[str, Any], state: Mapping[str, Any]) -> Dict[str, float]:
        slots = {name: _max_abs(state.get(name)) for name in slot_names(group)}
        self._slots[id(p)] = slots
        return slots
