"""``LocalOptimizer``: the daemon's optimizers (Muon, AdamW, Lion, SGD), in-process, in torch.

Same constructor options and param groups as ``RemoteOptimizer``, same math as the daemon's CPU
backend (docs/algorithms.md, Newton–Schulz in fp32) and the same step semantics: a step with a
non-finite gradient is skipped whole, and so is one whose update could take a master or an optimizer
slot beyond the range that keeps it finite (the daemon's bounds and rule, ``finite_steps.py``),
``max_grad_norm`` clips the global norm like ``torch.nn.utils.clip_grad_norm_``, and ``last_info``
says what happened. The state lives in this
process. It
is the baseline for side-by-side comparisons (``examples/train_gpt.py --compare-local``) and a
drop-in fallback when no daemon is running. Masters are the parameter tensors themselves, so keep
parameters in fp32 for results comparable with the daemon. The precision-aware options
(``master_dtype``, ``momentum_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``) are followed as the
daemon follows them: 16-bit slots are kept in that dtype, each step computes in fp32 and rounds what
it stores, and a 16-bit master is an fp32 parameter holding rounded values.

Thread-safety: like every torch optimizer, one instance is used from one thread at a time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import finite_steps
from . import loss_scale
from . import option_facts as facts
from . import options as opts
from . import qk_clip as qk
from . import ranks
from . import wire
from .naming import check_saved_names, named_groups
from .group_info import GroupInfo
from .step_info import GroupClip, StepInfo, check_max_grad_norm


class _Clipping(NamedTuple):
    global_norm: float
    coefficients: List[float]  # by group
    by_name: Dict[str, GroupClip]


def _stored_slots(group: Dict[str, Any], state: Dict[str, Any]) -> list:
    """The tensor slots of ``state`` that ``group`` stores in 16 bits."""
    return [slot for slot, value in state.items()
            if isinstance(value, torch.Tensor) and opts.storage_dtype(group, slot) != "fp32"]


def _store_slots(group: Dict[str, Any], state: Dict[str, Any]) -> None:
    """Puts the 16-bit slots of ``state`` in their storage dtype (rounded to nearest even)."""
    for slot in _stored_slots(group, state):
        state[slot] = state[slot].to(wire.torch_dtype(opts.storage_dtype(group, slot)))


def _round_master(p: torch.Tensor, group: Dict[str, Any]) -> None:
    """Rounds the parameter to the group's master_dtype in place, as the daemon stores it."""
    stored = opts.storage_dtype(group, "master")
    if stored != "fp32":
        p.copy_(p.to(wire.torch_dtype(stored)))


def newton_schulz(u: torch.Tensor, steps: int, coefficients: Sequence[Tuple[float, float, float]],
                  after: str, eps: float, norm_safety: float,
                  gram_restarts: Optional[Sequence[int]] = None, aol: bool = False) -> torch.Tensor:
    """Orthogonalizes the last two dims of ``u`` (fp32): X ← U (wide), X ← X/(s‖X‖_F + ε), then
    ``steps`` times X ← aX + (bA + cA²)X with A = XXᵀ, (a, b, c) from ``coefficients``.

    With ``gram_restarts`` (a sequence, possibly empty) the same map is computed as the daemon's
    ns_algorithm "gram" does, on the Gram matrix R = XXᵀ with Q accumulating the polynomials and
    a restart X ← QX before each listed iteration; square matrices use the standard form.

    With ``aol`` (Turbo-Muon) X is scaled instead by s_i = max(Σ_j |A_ij|, eps)^(-1/2) per row, A =
    XXᵀ, and the first iteration reuses diag(s)·A·diag(s), as the daemon does (always the standard
    form: ``gram_restarts`` is ignored, as the daemon refuses or never picks the Gram form then)."""
    x = u.to(torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    gram = None  # the first iteration's A, when the scaling computed it already (AOL)
    if aol:
        x, gram = _aol_scaled(x, eps)
    else:
        norm = torch.linalg.norm(x, dim=(-2, -1), keepdim=True) if x.dim() > 2 else torch.linalg.norm(x)
        x = x / (norm_safety * norm + eps)
    if gram_restarts is not None and not aol and x.size(-2) != x.size(-1):
        x = _gram_iterations(x, steps, coefficients, after, gram_restarts)
    else:
        for t in range(steps):
            a, b, c = facts.coefficient_at(coefficients, after, t)
            if t > 0 or gram is None:
                gram = x @ x.transpose(-2, -1)
            if c == 0:  # a cubic step (cubic5): one product fewer, as the daemon computes it
                x = a * x + b * (gram @ x)
                continue
            poly = b * gram + c * (gram @ gram)
            x = a * x + poly @ x
    if tall:
        x = x.transpose(-2, -1)
    return x


def _aol_scaled(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Turbo-Muon's AOL scaling of a wide ``x``: (diag(s)·X, diag(s)·A·diag(s)) with A = XXᵀ and
    s_i = max(Σ_j |A_ij|, eps)^(-1/2) (eps 0 taken as 1e-30), summed in fp64 as the daemon does."""
    gram = x @ x.transpose(-2, -1)
    s = gram.double().abs().sum(dim=-1).clamp_min(eps if eps > 0 else 1e-30).rsqrt().float()
    return x * s.unsqueeze(-1), gram * s.unsqueeze(-1) * s.unsqueeze(-2)


def _gram_iterations(x: torch.Tensor, steps: int, coefficients, after: str, restarts) -> torch.Tensor:
    """The Gram form of the iterations on a normalized wide ``x``: polynomials in R = XXᵀ."""
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    r, q = x @ x.transpose(-2, -1), None
    for t in range(steps):
        a, b, c = facts.coefficient_at(coefficients, after, t)
        if t != 0 and t in restarts:
            x, q = q @ x, None
            r = x @ x.transpose(-2, -1)
        z = b * r if c == 0 else b * r + c * (r @ r)
        q = a * eye + z if q is None else a * q + q @ z
        if t < steps - 1 and (t + 1) not in restarts:
            rz = a * r + r @ z
            r = a * rz + z @ rz
    return x if q is None else q @ x


# The daemon's CPU backend's weight of an m×m product against a wide one in ns_algorithm "auto"'s
# cost rule (kernels/optim/newton_schulz.h, kCpuSquareWeight).
CPU_SQUARE_WEIGHT = 1.1


def prefer_gram(rows: int, cols: int, coefficients, after: str, steps: int, restarts: Sequence[int],
                square_weight: float = CPU_SQUARE_WEIGHT) -> bool:
    """Whether ns_algorithm "auto" runs the Gram iteration on a rows × cols matrix: its wide
    (m²n) plus square_weight times its square (m³) multiply-adds are fewer than the standard
    iteration's (docs/algorithms.md, Muon step 2). Never for a square matrix."""
    m, n = min(rows, cols), max(rows, cols)
    if m == n or m <= 0:
        return False
    std_wide = std_square = 0.0
    gram_wide, gram_square, have_q = float(m * m * n), 0.0, False
    for t in range(steps):
        c = facts.coefficient_at(coefficients, after, t)[2]
        std_wide += 2 * m * m * n
        std_square += m ** 3 if c != 0 else 0
        if t != 0 and t in restarts:
            gram_wide += 2 * m * m * n
            have_q = False
        gram_square += (m ** 3 if c != 0 else 0) + (m ** 3 if have_q else 0)
        have_q = True
        if t + 1 < steps and (t + 1) not in restarts:
            gram_square += 2 * m ** 3
    gram_wide += m * m * n if have_q else 0
    return gram_wide + square_weight * gram_square < std_wide + square_weight * std_square


def _gram_restarts(group: Dict[str, Any], rows: int, cols: int) -> Optional[Tuple[int, ...]]:
    """None for standard Newton–Schulz; for "gram" (or "auto" where it picks Gram on this shape,
    as the daemon's CPU backend does) the set's restart iterations."""
    algorithm = group.get("ns_algorithm")
    if algorithm not in ("gram", "auto"):
        return None
    name = group["ns_coefficients"]
    restarts = facts.GRAM_RESTARTS.get(name, ()) if isinstance(name, str) else ()
    if algorithm == "auto":
        coefficients, after = opts.coefficient_schedule(group)
        if not prefer_gram(rows, cols, coefficients, after, group["ns_steps"], restarts):
            return None
    return restarts


# The epsilons of MuonEq's and Muon+'s references (docs/algorithms.md, MuonEq and Muon+).
_MOMENTUM_NORMALIZATION_EPS = 1e-8
_FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32
_FP32_MAX = torch.finfo(torch.float32).max
_POST_NORMALIZATION_EPS = 1e-7
# Muon+'s orders of lines: -1 scales rows, -2 columns.
_POST_ORDERS = {"row": (-1,), "col": (-2,), "row_col": (-1, -2), "muon_plus": (-1, -2), "col_row": (-2, -1)}


def heloco_aligned(g: torch.Tensor, m: Optional[torch.Tensor], group: Dict[str, Any]) -> torch.Tensor:
    """HeLoCo's correction of the gradient ``g`` against the momentum buffer ``m`` (arXiv 2606.00271;
    docs/algorithms.md, SGD, HeLoCo; the daemon's kernels/optim/momentum_alignment.h): kept when
    their cosine c ≥ heloco_keep_cosine, shrunk along the momentum when c < 0, partly turned toward
    it otherwise. Norms and the cosine in fp64; the result a·g + b·m in fp32."""
    if m is None:
        return g
    g64, m64 = g.double().flatten(), m.double().flatten()
    g_norm, m_norm = g64.norm().item(), m64.norm().item()
    if not (g_norm > 0 and m_norm >= _FP32_TINY):  # no momentum, or no usable direction in it
        return g
    c = min(max(torch.dot(g64, m64).item() / (g_norm * m_norm), -1.0), 1.0)
    keep = group["heloco_keep_cosine"]
    if c >= keep:
        return g
    eps = 1e-12
    confidence = g_norm / (g_norm + group["heloco_kappa"] * m_norm + eps)
    if c < 0:
        beta = min(group["heloco_shrink"] * -c * confidence, group["heloco_shrink_max"])
        a, b = 1.0, -beta * c * g_norm / m_norm
    else:
        lam = min(group["heloco_reorient"] * (keep - c) * confidence, 1.0)
        u_norm = max(math.sqrt((1 - lam) ** 2 + lam ** 2 + 2 * lam * (1 - lam) * c), eps)
        a, b = (1 - lam) / u_norm, lam * g_norm / (m_norm * u_norm)
    if abs(b) > _FP32_MAX:  # |m| negligible against |g|: b·m would overflow in fp32
        return g
    return g.float() * a + m.float() * b


def _line_scales(m: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """fp32(1/√(Σ m² + eps)) along ``dim`` (-1: each row, -2: each column), summed in fp64 as the
    daemon does."""
    return (m.double().square().sum(dim=dim, keepdim=True) + eps).rsqrt().float()


def _momentum_normalized(m: torch.Tensor, mode: Optional[str]) -> torch.Tensor:
    """MuonEq: U's rows, columns, or both (both scales from the same U, rows applied first) at
    unit norm."""
    if mode in (None, "none"):
        return m
    rows = _line_scales(m, -1, _MOMENTUM_NORMALIZATION_EPS) if mode in ("row", "rowcol") else None
    cols = _line_scales(m, -2, _MOMENTUM_NORMALIZATION_EPS) if mode in ("col", "rowcol") else None
    out = m * rows if rows is not None else m
    return out * cols if cols is not None else out


def _post_normalized(o: torch.Tensor, mode: Optional[str]) -> torch.Tensor:
    """Muon+: the orthogonalized update's rows and/or columns at unit norm, one after the other."""
    for dim in _POST_ORDERS.get(mode or "none", ()):
        o = o * _line_scales(o, dim, _POST_NORMALIZATION_EPS)
    return o


def _polar(m: torch.Tensor, group: Dict[str, Any], coefficients, after: str) -> torch.Tensor:
    """The matrices ``m`` (one, or a batch on the first dim) through MuonEq's normalization,
    Newton–Schulz and Muon+'s normalization, as the group asks."""
    m = _momentum_normalized(m, group.get("momentum_normalization"))
    out = newton_schulz(m, group["ns_steps"], coefficients, after, group["ns_eps"],
                        group["ns_norm_safety"], _gram_restarts(group, m.size(-2), m.size(-1)),
                        aol=group.get("ns_preconditioner") == "aol")
    return _post_normalized(out, group.get("post_normalization"))


def _orthogonalize_scaled(u: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
    """NS(U) times its scale, for the parameter shapes of docs/algorithms.md, Shapes (2-D, 4-D
    conv as (O, I·kh·kw), 3-D experts one by one, fused QKV block by block)."""
    coefficients, after = opts.coefficient_schedule(group)

    def ortho(m: torch.Tensor) -> torch.Tensor:
        return _polar(m, group, coefficients, after) * facts.muon_scale(group, m.size(-2), m.size(-1))

    shape = u.shape
    if (group.get("num_heads") or 1) > 1 and u.dim() == 2:  # heads, each on its own shape
        rows = facts.head_rows(group, tuple(shape))
        return ortho(u.reshape(-1, rows, shape[1])).reshape(shape)
    if (group.get("tp_blocks") or 1) > 1:  # tensor-parallel blocks, each on its own shape
        parts = torch.chunk(u, group["tp_blocks"], dim=group.get("tp_block_dim", 0))
        return torch.cat([ortho(part) for part in parts], dim=group.get("tp_block_dim", 0))
    if group.get("qkv_split") is not None:
        q, k, v = group["qkv_split"]
        groups = group.get("num_query_groups") or 1
        blocks = u.reshape(groups, q + k + v, -1)
        parts = torch.split(blocks, [q, k, v], dim=1)
        return torch.cat([ortho(part) for part in parts], dim=1).reshape(shape)
    if u.dim() >= 4:  # convolutions (conv2d, conv3d, ...) as (out, the rest)
        return ortho(u.reshape(shape[0], -1)).reshape(shape)
    return ortho(u)  # 2-D, or 3-D expert stacks batched over the first dim


def _matrix_views(t: torch.Tensor, group: Dict[str, Any]) -> list:
    """2-D views of ``t`` (contiguous, a parameter's shape) over the matrices Muon orthogonalizes,
    in the daemon's order (``option_facts.matrix_shapes``)."""
    shapes = facts.matrix_shapes(group, tuple(t.shape))
    if (group.get("num_heads") or 1) > 1 and t.dim() == 2:
        return list(t.reshape(len(shapes), shapes[0][0], t.size(1)).unbind(0))
    if (group.get("tp_blocks") or 1) > 1:
        return list(torch.chunk(t, group["tp_blocks"], dim=group.get("tp_block_dim", 0)))
    if group.get("qkv_split") is not None:
        blocks = t.reshape(-1, sum(group["qkv_split"]), t.size(-1))
        bounds, start = [], 0
        for rows in group["qkv_split"]:
            bounds.append((start, start + rows))
            start += rows
        return [blocks[g, a:b] for g in range(blocks.size(0)) for a, b in bounds]
    if t.dim() == 3:
        return [t[e] for e in range(t.size(0))]
    return [t.reshape(shapes[0])]


def _namo_update(u: torch.Tensor, g: torch.Tensor, group: Dict[str, Any], moment2: torch.Tensor,
                 step: int) -> torch.Tensor:
    """NAMO (Emerging-Optimizers) and NAMO-D (the authors' code), matrix by matrix in the daemon's
    order (docs/algorithms.md, NAMO and NAMO-D), advancing ``moment2`` in place; the step is lr
    times it. Per line (the matrix, or each column): v ← lerp(v, Σ G², 1−β2); NAMO: α = ‖M̃‖/(√v + ε);
    NAMO-D: d = bias·‖M̃_col‖/√(v + ε), clamped to [c·mean, mean/c]; then scale·NS(M̃)·α (or ·D)."""
    coefficients, after = opts.coefficient_schedule(group)
    beta2, eps = group["beta2"], group["eps"]
    diagonal = group["moment2_method"] == "namo_d"
    out = torch.empty_like(u)
    flat = moment2.reshape(-1)
    line = 0
    for m, raw, o_view in zip(_matrix_views(u, group), _matrix_views(g.contiguous(), group),
                              _matrix_views(out, group)):
        rows, cols = m.shape
        lines = cols if diagonal else 1
        v = flat[line:line + lines]
        line += lines
        g_sums = raw.double().square().sum(dim=0) if diagonal else raw.double().square().sum().reshape(1)
        m_sums = m.double().square().sum(dim=0) if diagonal else m.double().square().sum().reshape(1)
        v.lerp_(g_sums.float(), 1 - beta2)
        if diagonal:
            bias = math.sqrt(1 - beta2 ** step) / (1 - group["momentum"] ** step)
            d = bias * m_sums.sqrt() / (v.double() + eps).sqrt()
            c, mean = group["namo_clamp"], float(d.mean())
            if 0 < c <= 1 and 0 < mean < math.inf:
                d = d.clamp(mean * c, mean / c)
        else:
            d = m_sums.sqrt() / (v.double().sqrt() + eps)
        o = _polar(m, group, coefficients, after)
        scale = facts.muon_scale(group, rows, cols)
        o_view.copy_(o * d.float()[None, :] * scale if diagonal else o * float(d.float()) * scale)
    return out


def _adaptive_update(u: torch.Tensor, group: Dict[str, Any], moment2: torch.Tensor) -> torch.Tensor:
    """The update of a Muon group with a second moment, matrix by matrix in the daemon's order
    (docs/algorithms.md, Adaptive Muon), advancing ``moment2`` in place; the step is lr times it.

    adamuon (Megatron-Core): x = scale·NS(U); v ← lerp(v, x², 1−β2); x/(√v + ε).
    normuon (modded-nanogpt): O = NS(U); per row (rows ≥ cols) or column, v ← lerp(v, mean(O²),
    1−β2); s = 1/√max(v, ε); scale·O·s·‖O‖_F/‖O·s‖_F (0 for an all-zero O)."""
    coefficients, after = opts.coefficient_schedule(group)
    beta2, eps = group["beta2"], group["eps"]
    out = torch.empty_like(u)
    adamuon = group["moment2_method"] == "adamuon"
    moments = _matrix_views(moment2, group) if adamuon else None
    flat_moment = moment2.reshape(-1)
    line = 0
    for i, (m, o_view) in enumerate(zip(_matrix_views(u, group), _matrix_views(out, group))):
        rows, cols = m.shape
        o = _polar(m, group, coefficients, after)
        scale = facts.muon_scale(group, rows, cols)
        if adamuon:
            x = o * scale
            moments[i].lerp_(x * x, 1 - beta2)
            o_view.copy_(x / (moments[i].sqrt() + eps))
            continue
        per_row = rows >= cols
        length = rows if per_row else cols
        v = flat_moment[line:line + length]
        line += length
        v.lerp_(o.square().mean(dim=1 if per_row else 0), 1 - beta2)
        s = v.double().clamp_min(eps).rsqrt()
        line_sums = o.double().square().sum(dim=1 if per_row else 0)
        norm2, scaled2 = float(line_sums.sum()), float((s * s * line_sums).sum())
        factor = (s * (math.sqrt(norm2 / scaled2) if scaled2 > 0 else 0.0)).float()
        o_view.copy_(o * (factor[:, None] if per_row else factor[None, :]) * scale)
    return out


class LocalOptimizer(torch.optim.Optimizer):
    """In-process Muon / AdamW / Lion / SGD with the daemon's options and semantics.

    Args:
        params: tensors, ``(name, tensor)`` pairs or group dicts, as for ``RemoteOptimizer``.
        qk_clip: QK-clip pairs ``[(query, key, num_heads), ...]`` as for ``RemoteOptimizer``;
            the daemon's checks of them are made here and raise ValueError.
        max_grad_norm: clip the global gradient norm before each step, as the daemon does.
        log_num_zeros_in_grad: count the gradient elements that are exactly 0 each step
            (Megatron-Core's option of that name); ``last_info.num_zeros_in_grad`` has the count.
        loss_scaler: a dynamic loss scaler, as ``RemoteOptimizer``'s (``muond.loss_scale``).
        **defaults: options for every group that leaves them unset (see ``muond.options``).

    A value outside its option's range in the option table is a ValueError in the daemon's words,
    at construction and at each step (a scheduler may have changed ``lr``), before any change.
    """

    def __init__(self, params: Iterable[Any], *,
                 qk_clip: Optional[Iterable[Tuple[Any, Any, int]]] = None,
                 max_grad_norm: Optional[float] = None, log_num_zeros_in_grad: bool = False,
                 loss_scaler: Any = None, **defaults: Any):
        opts.check_defaults(defaults)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self.loss_scaler = loss_scale.resolve(loss_scaler)
        self._scaler = (loss_scale.ScalerState.initial(self.loss_scaler)
                        if self.loss_scaler is not None else None)
        self.last_step = 0
        self.last_info: Optional[StepInfo] = None
        self._user_defaults = dict(defaults)
        self._guard = finite_steps.MagnitudeGuard()
        groups, names = named_groups(params)
        super().__init__(groups, {})
        self.defaults = opts.resolved_defaults(self.param_groups, defaults)  # as torch lists them
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._names = names
        self._by_name = dict(zip(names, self._params))
        self.qk_clip = qk.pairs_of(qk_clip, self._params, self._names)
        qk.check_shapes(self.qk_clip, self._by_name,
                        {n: g["optimizer"] for g in self.param_groups for n in g["param_names"]})
        # The daemon's last check of a new session, group by group, now that the pairs are known.
        for group in self.param_groups:
            opts.check_read(group, qk_clip_reads=bool(self.qk_clip))
        # Every check passed: only now are the parameters changed.
        with torch.no_grad():  # 16-bit masters hold the parameters rounded, as the daemon's upload
            for group in self.param_groups:
                for p in group["params"]:
                    _round_master(p, group)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group``; after construction the new parameters are named as at
        construction (``param_names``, ``(name, tensor)`` pairs, else ``p<index>``), checked and
        stepped like the others."""
        if param_group.get("partition") is not None:
            raise ValueError("partition: LocalOptimizer steps whole tensors (a rank's part would be "
                             "orthogonalized and clipped on its own); give it the whole parameters")
        constructed = hasattr(self, "_params")
        if constructed:
            param_group = self._named_new_group(param_group)
        resolved = opts.resolve_group(param_group, self._user_defaults)
        opts.check_ranges(resolved)
        if constructed:  # during construction, once the QK-clip pairs are known (__init__)
            opts.check_read(resolved, qk_clip_reads=bool(self.qk_clip))
        finite_steps.check_ns_growth(resolved)
        opts.check_shapes(resolved, [tuple(p.shape) for p in resolved["params"]])
        super().add_param_group(resolved)
        if constructed:
            added = self.param_groups[-1]
            with torch.no_grad():
                for p in added["params"]:
                    _round_master(p, added)
            self._params.extend(added["params"])
            self._names.extend(added["param_names"])
            self._by_name.update(zip(added["param_names"], added["params"]))

    def _named_new_group(self, param_group: Dict[str, Any]) -> Dict[str, Any]:
        """A group added after construction with its tensors and names as ``named_groups`` makes
        them, unnamed ones numbered after the parameters already held; ValueError for a name or
        tensor this optimizer already holds."""
        (group,), _ = named_groups([param_group], held=list(zip(self._names, self._params)))
        return group

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict, plus ``last_step`` and the loss scaler's state under
        ``loss_scaler`` when there is one."""
        out = super().state_dict()
        out["last_step"] = self.last_step
        if self._scaler is not None:
            out["loss_scaler"] = {"scale": self._scaler.scale,
                                  "growth_tracker": self._scaler.growth_tracker,
                                  "hysteresis_tracker": self._scaler.hysteresis_tracker}
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's ``load_state_dict``; a saved ``loss_scaler`` state replaces this one's. A
        ``RemoteOptimizer`` state dict loads too: its masters (``state[i]["master"]``) become the
        parameters' values, as ``RemoteOptimizer.load_state_dict`` copies them in."""
        state_dict = dict(state_dict)
        remote = state_dict.pop("muond", None) or {}  # a RemoteOptimizer's section
        # A RemoteOptimizer's groups carry that section's shared entries too: not options.
        groups = [dict(g) for g in state_dict.get("param_groups", ())]
        for group in groups:
            remote = remote or group.get("muond") or {}
            group.pop("muond", None)
        state_dict["param_groups"] = groups
        check_saved_names(remote.get("names"), self._names)
        scaler = state_dict.pop("loss_scaler", None) or remote.get("loss_scaler")
        last_step = state_dict.pop("last_step", None)
        if last_step is None:
            last_step = remote.get("last_step")
        super().load_state_dict(state_dict)
        self._guard.forget()
        if last_step is not None:
            self.last_step = int(last_step)
        # torch casts the state to the parameters' dtype: 16-bit slots go back to their storage
        # dtype (rounded, as the daemon's SetState rounds), and 16-bit masters are rounded too.
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state.get(p, {}).pop("master", None)
                    if master is not None:
                        p.copy_(master.view(p.shape))
                    _round_master(p, group)
                    _store_slots(group, self.state.get(p, {}))
        if scaler is not None and self._scaler is not None:
            self._scaler = loss_scale.ScalerState(float(scaler["scale"]), int(scaler["growth_tracker"]),
                                                  int(scaler["hysteresis_tracker"]))

    @property
    def loss_scale(self) -> Optional[float]:
        """With a loss scaler, the scale to multiply the next loss by; else None."""
        return None if self._scaler is None else self._scaler.scale

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times ``loss_scale`` (unchanged without a loss scaler)."""
        return loss if self._scaler is None else loss * self._scaler.scale

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             qk_logits: Optional[Dict[Any, Any]] = None, grad_scale: Optional[float] = None,
             weight: Optional[float] = None) -> Any:
        """One step of every group, then QK-clip of the pairs in ``qk_logits`` (as for
        ``RemoteOptimizer.step``); returns the closure's loss. ``grad_scale`` and a loss scaler
        divide the gradients as the daemon does. ``weight`` is checked as ``RemoteOptimizer``
        checks it; with one rank it changes nothing but ``last_info.total_weight``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        total_weight = ranks.check_weight(weight) or 1.0
        for group in self.param_groups:  # the daemon's checks of a step's values, before any change
            opts.check_ranges(group)  # a scheduler may have changed lr, momentum, weight decay
            if group.get("heloco") and not group["momentum"] > 0:
                raise ValueError(f"momentum: heloco needs momentum > 0 (the correction's reference "
                                 f"is the momentum buffer), got {group['momentum']}")
        for name, p in zip(self._names, self._params):
            if p.grad is not None and p.grad.is_sparse:  # as RemoteOptimizer says it
                raise RuntimeError(f"parameter '{name}': sparse gradients are not supported")
        logits = qk.logits_of(qk_logits, self.qk_clip, self._params, self._names)
        grad_scale = loss_scale.check_grad_scale(grad_scale)
        if self._scaler is not None:
            if grad_scale is not None and grad_scale != self._scaler.scale:
                raise ValueError(f"grad_scale {grad_scale} differs from the loss scaler's current "
                                 f"scale {self._scaler.scale}")
            grad_scale = self._scaler.scale
        unscale = 1.0 / grad_scale if grad_scale is not None else 1.0
        started = time.perf_counter()
        self.last_step += 1
        # The daemon's norm: each gradient's sum of squares in fp64, summed over the parameters
        # (read back once, not once per parameter, so that CUDA gradients cost one sync).
        named = [(n, p.grad) for n, p in zip(self._names, self._params) if p.grad is not None]
        sums = (torch.stack([g.detach().to(torch.float32).double().square().sum() for _, g in named]).tolist()
                if named else [])
        sum_squares = sum(sums)
        non_finite = next((n for (n, _), s in zip(named, sums) if not math.isfinite(s)), "")
        clips = self._clipping(named, sums, unscale)
        norm = clips.global_norm if math.isfinite(sum_squares) else float("nan")
        zeros = (sum(int((g == 0).sum()) for _, g in named) if self.log_num_zeros_in_grad else None)
        if non_finite:
            return self._skipped(f"non-finite gradient in '{non_finite}'", norm, started, zeros, total_weight,
                                 loss)
        # The magnitude guard, before anything changes: bounds on what each step could leave.
        checked = {}
        norms = {name: math.sqrt(s) for (name, _), s in zip(named, sums)}
        names = {id(p): name for name, p in zip(self._names, self._params)}
        stepped = [p for p in self._params if p.grad is not None]
        masters = dict(zip(map(id, stepped), finite_steps.largest_magnitudes(stepped)))
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p, {})  # (self.state creates an entry for a key it lacks)
                reason, checked[id(p)] = self._guard.check(
                    names[id(p)], p, p.grad, group, state, masters[id(p)], norms[names[id(p)]],
                    clips.coefficients[gi] * unscale, state.get("step", 0))
                if reason:
                    return self._skipped(reason, norm, started, zeros, total_weight, loss, clips)
        for gi, group in enumerate(self.param_groups):
            kind = group["optimizer"]
            # One fp32 multiply of each gradient, by the group's clip coefficient over the loss scale.
            clip = clips.coefficients[gi] * unscale
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                g = p.grad.detach().to(torch.float32)
                if clip != 1.0:
                    g = g * torch.tensor(clip, dtype=torch.float32)  # one fp32 multiply, as there
                # 16-bit storage (the *_dtype options): load as fp32, compute, round on store. The
                # master is the parameter, rounded since construction and after every store.
                for slot in _stored_slots(group, state):
                    state[slot] = state[slot].float()
                if kind == "muon":
                    self._muon(p, g, state, group)
                elif kind == "dion2":
                    self._dion2(p, g, state, group)
                elif kind == "adamw":
                    self._adamw(p, g, state, group)
                elif kind == "lion":
                    self._lion(p, g, state, group)
                else:
                    self._sgd(p, g, state, group)
                _store_slots(group, state)
                _round_master(p, group)
                self._guard.applied(p, checked[id(p)])
        pairs = {pair.query: pair for pair in self.qk_clip}
        for query, max_logits in logits.items():
            query_weight = self._by_name[query]
            group = next(g for g in self.param_groups if any(p is query_weight for p in g["params"]))
            key = self._by_name[pairs[query].key]
            qk.apply(query_weight, key, max_logits,
                     group["qk_clip_threshold"], group["qk_clip_alpha"], pairs[query].mla)
            _round_master(query_weight, group)
            _round_master(key, next(g for g in self.param_groups if any(p is key for p in g["params"])))
        if self._scaler is not None:
            self._scaler.update(self.loss_scaler, found_inf=False)
        elapsed = time.perf_counter() - started
        self.last_info = StepInfo(self.last_step, True, False, "", norm, elapsed, elapsed,
                                  num_zeros_in_grad=zeros, loss_scale=self.loss_scale,
                                  total_weight=total_weight, group_clips=clips.by_name,
                                  groups={name: GroupInfo(c.grad_norm, c.coefficient)
                                          for name, c in clips.by_name.items()})
        return loss

    def _skipped(self, reason: str, norm: float, started: float, zeros: Optional[int], total_weight: float,
                 loss: Any, clips: Optional["_Clipping"] = None) -> Any:
        """Ends a step that changed nothing: ``last_info`` says why, and a loss scaler backs off
        (an overflow, as the daemon counts a skipped step). Returns ``loss``."""
        if self._scaler is not None:
            self._scaler.update(self.loss_scaler, found_inf=True)
        elapsed = time.perf_counter() - started
        by_name = clips.by_name if clips is not None else {}
        self.last_info = StepInfo(self.last_step, False, False, reason, norm, elapsed, elapsed,
                                  num_zeros_in_grad=zeros, loss_scale=self.loss_scale,
                                  total_weight=total_weight, group_clips=by_name,
                                  groups={name: GroupInfo(c.grad_norm, c.coefficient) for name, c in by_name.items()})
        return loss

    def _clipping(self, named, sums, unscale: float) -> "_Clipping":
        """The daemon's clipping (docs/algorithms.md, Clipping): the global norm over the groups of
        clip_scope "global" (None counts as global), each group's own norm, and the coefficient
        each group's gradients are multiplied by; the sums run in parameter order."""
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        by_name = dict(zip(self._names, self._params))
        squares = [0.0] * len(self.param_groups)
        global_squares = 0.0
        for (name, _), s in zip(named, sums):
            gi = group_of[id(by_name[name])]
            squares[gi] += s
            if (self.param_groups[gi].get("clip_scope") or "global") == "global":
                global_squares += s
        global_norm = math.sqrt(global_squares) * unscale
        coefficients, report = [], {}
        for gi, group in enumerate(self.param_groups):
            scope = group.get("clip_scope") or "global"
            own = math.sqrt(squares[gi]) * unscale
            limit = self.max_grad_norm if scope == "global" else (
                group.get("max_grad_norm") or self.max_grad_norm if scope == "group" else None)
            norm = global_norm if scope == "global" else own
            coefficient = 1.0 if limit is None else min(1.0, limit / (norm + 1e-6))
            coefficients.append(coefficient)
            report[group.get("name") or f"g{gi}"] = GroupClip(own, coefficient)
        return _Clipping(global_norm, coefficients, report)

    @staticmethod
    def _muon(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]):
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        mode = group["weight_decay_mode"]
        if mode == "l2" and wd:
            g = g + wd * p.float()
        m = state.get("momentum")
        if m is None:
            m = state["momentum"] = torch.zeros_like(g)
        if group["momentum_style"] == "ema":
            m.mul_(beta).add_(g, alpha=1 - beta)
            u = (1 - beta) * g + beta * m if group["nesterov"] else m
        else:
            m.mul_(beta).add_(g)
            u = g + beta * m if group["nesterov"] else m
        if group.get("moment2_method") is None:
            update = _orthogonalize_scaled(u, group)
        else:
            moment2 = state.get("moment2")
            if moment2 is None:
                moment2 = state["moment2"] = torch.zeros(
                    facts.slot_shape(group, tuple(p.shape), "moment2"), dtype=torch.float32,
                    device=p.device)
            if group["moment2_method"] in ("namo", "namo_d"):
                update = _namo_update(u.contiguous(), g, group, moment2, state["step"])
            else:
                update = _adaptive_update(u.contiguous(), group, moment2)
        if mode == "decoupled":
            p.mul_(1 - lr * wd)
        elif mode == "independent":
            p.mul_(1 - wd)
        elif mode == "cautious":  # decay only where the update and the weight agree in sign
            p.sub_(p * (update * p >= 0).to(p.dtype), alpha=lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)

    @staticmethod
    def _dion2(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]):
        """Dion2 (docs/algorithms.md, Dion2): M ← M + G; per matrix the ⌈fraction·lines⌉ rows or
        columns of largest L1 norm (ties to the lower index) are orthogonalized together, their
        momentum lines decay by dion2_ef_decay, and W ← β·W − lr·scale·U with U = O on them, 0
        elsewhere, the scale on the whole matrix's shape."""
        m = state.get("momentum")
        if m is None:
            m = state["momentum"] = torch.zeros_like(g)
        m.add_(g)
        stored = opts.storage_dtype(group, "momentum")
        if stored != "fp32":  # the sum is stored before the lines are chosen, as the daemon does
            m.copy_(m.to(wire.torch_dtype(stored)))
        coefficients, after = opts.coefficient_schedule(group)
        update = torch.zeros_like(m)
        stacks = (m, update) if m.dim() == 3 else (m.reshape(1, m.size(0), -1), update.reshape(1, m.size(0), -1))
        for mv, uv in zip(*(s.unbind(0) for s in stacks)):
            rows, cols = mv.shape
            select = group["dion2_select"]
            columns = select == "cols" or (select == "auto" and rows > cols)
            lines, target = (mv.T, uv.T) if columns else (mv, uv)
            k = max(1, min(lines.size(0), math.ceil(group["dion2_fraction"] * lines.size(0))))
            order = torch.sort(lines.double().abs().sum(dim=1), descending=True, stable=True).indices
            chosen = torch.sort(order[:k]).values
            picked = lines[chosen].clone()
            lines[chosen] = picked * group["dion2_ef_decay"]
            # The chosen columns as the parameter has them (rows × k): AOL scales their rows, which
            # for a square block are not the stored lines' (the daemon's stored_transposed).
            block = picked.T if columns else picked
            ortho = newton_schulz(block, group["ns_steps"], coefficients, after, group["ns_eps"],
                                  group["ns_norm_safety"], None, aol=group.get("ns_preconditioner") == "aol")
            target[chosen] = ortho.T if columns else ortho
            uv.mul_(facts.muon_scale(group, rows, cols))
        lr, wd = group["lr"], group["weight_decay"]
        p.mul_(1 - wd if group["weight_decay_mode"] == "independent" else 1 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)

    @staticmethod
    def _adamw(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(g)
            state["exp_avg_sq"] = torch.zeros_like(g)
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        coupled = group["weight_decay_mode"] == "l2"  # torch.optim.Adam's weight_decay
        if coupled and wd:
            g = g + wd * p.float()
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2 ** t)).sqrt_().add_(eps)
        if not coupled:
            p.mul_(1 - lr * wd)
        p.add_((m / (1 - beta1 ** t) / denom).to(p.dtype), alpha=-lr)

    @staticmethod
    def _lion(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]):
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        m = state.get("exp_avg")
        if m is None:
            m = state["exp_avg"] = torch.zeros_like(g)
        u = torch.sign(beta1 * m + (1 - beta1) * g)
        p.mul_(1 - lr * wd)
        p.add_(u.to(p.dtype), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)

    @staticmethod
    def _sgd(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]):
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        if group.get("heloco"):
            g = heloco_aligned(g, state.get("momentum_buffer"), group)
        delay = group.get("nesterov_delay") or 1
        if delay > 1:  # delayed Nesterov (docs/algorithms.md, SGD); the daemon refuses weight decay
            c = group.get("momentum_activation") or 0.0
            t = state.get("delay_step", 0)
            sums = state.setdefault("delay_buffer", torch.zeros_like(g, dtype=torch.float32))
            buf = state.setdefault("momentum_buffer", torch.zeros_like(g, dtype=torch.float32))
            sums.add_(g)
            if (t + 1) % delay == 0:
                buf.mul_(mu).add_(sums, alpha=1.0 / delay)
                p.add_(buf.to(p.dtype), alpha=-lr * (1.0 - c * delay + c) * mu)
                sums.zero_()
            elif c:
                p.add_(buf.to(p.dtype), alpha=-lr * c * mu)
            p.add_(g.to(p.dtype), alpha=-lr / delay)
            state["delay_step"] = t + 1
            return
        d = g + wd * p.float() if wd else g
        if mu:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d.clone()
            else:
                buf.mul_(mu).add_(d)
            d = d + mu * buf if group["nesterov"] else buf
        p.add_(d.to(p.dtype), alpha=-lr)
