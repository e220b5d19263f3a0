"""QK-clip (MuonClip) on the client side: naming the query/key pairs and the per-step logits.

An optimizer is given ``qk_clip=[(query, key, num_heads), ...]``, each weight as the parameter
tensor itself or as its name, and for multi-head latent attention a fourth element, the row layout
``{"qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv}`` (``MlaLayout``); ``pairs_of`` turns that into ``QkPair``s of parameter names (the
names the daemon knows). A step is given ``qk_logits={query: max_logits}`` — per head, the
largest attention logit S_h seen in the forward pass — which ``logits_of`` checks against the
pairs and turns into ``{query name: [S_0, ..., S_{H-1}]}``.

After the update, for every head h with a finite S_h > τ (and > 0), γ = τ/S_h: the query's rows
[h·hd, (h+1)·hd) are multiplied by γ^α and the key's rows of head h by γ^(1−α); τ and α are the
query group's ``qk_clip_threshold`` and ``qk_clip_alpha``. With an MLA layout (Kimi K2's MuonClip
Algorithm 1) a head's query rows are [q_nope, q_rope] and its key rows [k_nope, v]: q_nope is
scaled by γ^α, q_rope by γ, k_nope by γ^(1−α), v not at all. ``apply`` does this in torch (used by
``LocalOptimizer``; the daemon does the same on its masters). ``check_shapes`` holds the checks the
daemon makes when a session is created, for ``LocalOptimizer``, which has no daemon to make them.

Pure functions; no shared state.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class MlaLayout:
    """The rows of one head of an MLA query, [q_nope, q_rope], and of its key, [k_nope, v]."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def query_rows(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def key_rows(self) -> int:
        return self.qk_nope_head_dim + self.v_head_dim


@dataclass(frozen=True)
class QkPair:
    """One query/key pair, by parameter name."""
    query: str
    key: str
    num_heads: int
    mla: Optional[MlaLayout] = None


def _mla_of(value: Any, what: str) -> MlaLayout:
    if isinstance(value, MlaLayout):
        layout = value
    elif isinstance(value, Mapping):
        unknown = set(value) - {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
        if unknown:
            raise ValueError(f"{what}: unknown key(s) {sorted(unknown)}")
        layout = MlaLayout(**{k: int(v) for k, v in value.items()})
    else:
        raise TypeError(f"{what}: expected a dict of qk_nope_head_dim, qk_rope_head_dim, "
                        f"v_head_dim, got {type(value).__name__}")
    if layout.qk_nope_head_dim < 1 or layout.qk_rope_head_dim < 0 or layout.v_head_dim < 0:
        raise ValueError(f"{what}: qk_nope_head_dim must be >= 1 and qk_rope_head_dim, v_head_dim "
                         f">= 0, got {layout}")
    return layout


def _name_of(param: Any, names_by_id: Mapping[int, str], known: Iterable[str], what: str) -> str:
    if isinstance(param, str):
        if param not in known:
            raise ValueError(f"{what}: no parameter named '{param}' in this optimizer")
        return param
    if isinstance(param, torch.Tensor):
        name = names_by_id.get(id(param))
        if name is None:
            raise ValueError(f"{what}: the tensor of shape {tuple(param.shape)} is not a "
                             f"parameter of this optimizer")
        return name
    raise TypeError(f"{what}: expected a parameter tensor or its name, got "
                    f"{type(param).__name__}")


def pairs_of(qk_clip: Optional[Iterable[Any]], params: Sequence[torch.Tensor],
             names: Sequence[str]) -> List[QkPair]:
    """The ``qk_clip`` argument as ``QkPair``s; ValueError / TypeError for an entry that is not
    ``(query, key, num_heads)``, a weight that is not one of ``params`` (named ``names``), or a
    head count that is not an integer. Shapes and groups are left to the daemon
    (``check_shapes`` for ``LocalOptimizer``)."""
    if qk_clip is None:
        return []
    if isinstance(qk_clip, (tuple, list)) and len(qk_clip) == 3 \
            and not isinstance(qk_clip[0], (tuple, list)):
        raise TypeError("qk_clip is a list of (query, key, num_heads) triples; wrap a single "
                        "pair in a list")
    names_by_id = {id(p): n for p, n in zip(params, names)}
    known = set(names)
    pairs = []
    for i, entry in enumerate(qk_clip):
        what = f"qk_clip[{i}]"
        try:
            query, key, num_heads, *rest = entry
        except (TypeError, ValueError):
            raise TypeError(f"{what}: expected (query, key, num_heads), got {entry!r}") from None
        if len(rest) > 1:
            raise TypeError(f"{what}: expected (query, key, num_heads[, mla layout]), got {entry!r}")
        mla = _mla_of(rest[0], f"{what}.mla") if rest else None
        try:
            heads = operator.index(num_heads)
        except TypeError:
            heads = None
        if heads is None or isinstance(num_heads, bool):
            raise TypeError(f"{what}.num_heads: expected an int, got {num_heads!r}")
        pairs.append(QkPair(_name_of(query, names_by_id, known, f"{what}.query"),
                            _name_of(key, names_by_id, known, f"{what}.key"), heads, mla))
    return pairs


def check_shapes(pairs: Sequence[QkPair], param_of: Mapping[str, torch.Tensor],
                 optimizer_of: Mapping[str, str]) -> None:
    """The daemon's checks of ``spec.qk_clip``, as ValueErrors naming ``qk_clip[i].<field>``:
    at least one head, both weights matrices in Muon groups whose rows split into the heads, no
    weight in two pairs."""
    used: Dict[str, int] = {}
    for i, pair in enumerate(pairs):
        field = f"qk_clip[{i}]"
        if pair.num_heads < 1:
            raise ValueError(f"{field}.num_heads: must be >= 1, got {pair.num_heads}")
        for role, name in (("query", pair.query), ("key", pair.key)):
            p = param_of[name]
            if optimizer_of[name] != "muon" or p.dim() != 2:
                raise ValueError(f"{field}.{role}: '{name}' must be a matrix in a Muon group")
            if p.shape[0] % pair.num_heads:
                raise ValueError(f"{field}.num_heads: '{name}' has {p.shape[0]} rows, not a "
                                 f"multiple of {pair.num_heads} heads")
            if pair.mla is not None:
                per_head = pair.mla.query_rows() if role == "query" else pair.mla.key_rows()
                if p.shape[0] != per_head * pair.num_heads:
                    raise ValueError(f"{field}.mla: '{name}' has {p.shape[0]} rows ({pair.num_heads} "
                                     f"heads of {p.shape[0] // pair.num_heads}); the MLA layout does "
                                     f"not add up to it")
            if name in used:
                raise ValueError(f"{field}.{role}: '{name}' is already in a qk_clip pair")
            used[name] = i


def _values(value: Any, what: str) -> List[float]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{what}: expected a 1-D tensor (one value per head), got shape "
                             f"{tuple(value.shape)}")
        return [float(v) for v in value.detach().to("cpu", torch.float64).tolist()]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what}: expected a tensor or a list of floats (one per head), got "
                        f"{type(value).__name__}")
    return [float(v) for v in value]


def logits_of(qk_logits: Optional[Mapping[Any, Any]], pairs: Sequence[QkPair],
              params: Sequence[torch.Tensor], names: Sequence[str]) -> Dict[str, List[float]]:
    """``{query name: max logits}`` of a step's ``qk_logits``; ValueError for a key that is not
    the query of a pair, a query given twice, or a count that is not the pair's ``num_heads``."""
    if not qk_logits:
        return {}
    if not isinstance(qk_logits, Mapping):
        raise TypeError(f"qk_logits: expected a dict {{query parameter: max logits per head}}, "
                        f"got {type(qk_logits).__name__}")
    by_query = {pair.query: pair for pair in pairs}
    names_by_id = {id(p): n for p, n in zip(params, names)}
    out: Dict[str, List[float]] = {}
    for query, value in qk_logits.items():
        name = _name_of(query, names_by_id, set(names), "qk_logits")
        pair = by_query.get(name)
        if pair is None:
            raise ValueError(f"qk_logits: '{name}' is not the query of a qk_clip pair (pairs: "
                             f"{', '.join(repr(p.query) for p in pairs) or 'none'})")
        if name in out:
            raise ValueError(f"qk_logits: '{name}' is given twice")
        values = _values(value, f"qk_logits['{name}']")
        if len(values) != pair.num_heads:
            raise ValueError(f"qk_logits['{name}']: expected {pair.num_heads} values (one per "
                             f"head), got {len(values)}")
        out[name] = values
    return out


def factors(max_logits: Sequence[float], threshold: float, exponent: float) -> List[float]:
    """Per head, (τ/S_h)^exponent where S_h is finite and above τ (and > 0), else 1."""
    return [(threshold / s) ** exponent if math.isfinite(s) and s > threshold and s > 0 else 1.0
            for s in max_logits]


@torch.no_grad()
def apply(query: torch.Tensor, key: torch.Tensor, max_logits: Sequence[float], threshold: float,
          alpha: float, mla: Optional[MlaLayout] = None) -> None:
    """Scales ``query`` and ``key`` in place, head by head (heads are contiguous row blocks)."""
    heads = len(max_logits)
    if mla is not None:
        nope_q = factors(max_logits, threshold, alpha)
        rope_q = factors(max_logits, threshold, 1.0)
        nope_k = factors(max_logits, threshold, 1.0 - alpha)
        dn, dr, dv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        for h in range(heads):
            q0, k0 = h * (dn + dr), h * (dn + dv)
            for weight, rows, factor in ((query, slice(q0, q0 + dn), nope_q[h]),
                                         (query, slice(q0 + dn, q0 + dn + dr), rope_q[h]),
                                         (key, slice(k0, k0 + dn), nope_k[h])):
                if factor != 1.0:
                    weight[rows].mul_(factor)
        return
    for weight, exponent in ((query, alpha), (key, 1.0 - alpha)):
        rows = weight.shape[0] // heads
        for h, factor in enumerate(factors(max_logits, threshold, exponent)):
            if factor != 1.0:
                weight[h * rows:(h + 1) * rows].mul_(factor)
