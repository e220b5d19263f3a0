"""Placement of a session's parameters on K daemons (docs/sharding.md, Placement).

Whole tensors are placed, balanced by their optimizer cost: a Muon matrix costs what its
Newton–Schulz iteration does, max(m, n)·min(m, n)² per orthogonalized block (each q, k, v block of
a fused QKV weight on its own), an element-wise parameter (AdamW, Lion, SGD) its fp32 bytes. Units
that must stay together — the query and key weights of a QK-clip pair — are placed as one. The
units go longest-processing-time first (cost descending, then spec order) onto the least-loaded
daemon (the lowest index among equals), as Megatron's layer-sharded Muon does: deterministic, so
every client computes the same placement from the same spec and endpoint count.

The C++ client computes the same placement (client/shard_placement.h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Tensor:
    """What placement needs of one parameter."""
    shape: Tuple[int, ...]
    muon: bool
    qkv_split: Optional[Tuple[int, int, int]] = None
    num_query_groups: int = 1


def cost(t: Tensor) -> float:
    """The optimizer cost of one parameter (see the module's docstring)."""
    numel = math.prod(t.shape) if t.shape else 1
    if not t.muon or len(t.shape) < 2 or numel == 0:  # an empty one: the daemon names its shape
        return 4.0 * numel
    cols = numel // t.shape[0]
    if t.qkv_split is not None:
        rows = [r for r in t.qkv_split if r > 0] * max(t.num_query_groups, 1)
    else:
        rows = [t.shape[0]]
    return float(sum(max(r, cols) * min(r, cols) ** 2 for r in rows))


@dataclass(frozen=True)
class Placement:
    """``shard_of[i]``: the daemon of parameter i; ``loads[k]``: daemon k's summed cost."""
    shard_of: Tuple[int, ...]
    loads: Tuple[float, ...]

    def parameters_of(self, shard: int) -> List[int]:
        return [i for i, s in enumerate(self.shard_of) if s == shard]

    @property
    def imbalance(self) -> float:
        """max/mean load: 1.0 is a perfect balance."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0


def place(tensors: Sequence[Tensor], num_daemons: int,
          together: Sequence[Tuple[int, int]] = ()) -> Placement:
    """Places ``tensors`` on ``num_daemons``; each pair of ``together`` (indices) on one daemon."""
    if num_daemons < 1:
        raise ValueError(f"endpoints: need at least one daemon, got {num_daemons}")
    # Union the pairs into units, each named by its first (lowest) index.
    unit_of = list(range(len(tensors)))

    def root(i: int) -> int:
        while unit_of[i] != i:
            i = unit_of[i]
        return i

    for a, b in together:
        ra, rb = root(a), root(b)
        if ra != rb:
            unit_of[max(ra, rb)] = min(ra, rb)
    members: dict = {}
    for i in range(len(tensors)):
        members.setdefault(root(i), []).append(i)
    units = sorted(((sum(cost(tensors[i]) for i in m), first, m) for first, m in members.items()),
                   key=lambda u: (-u[0], u[1]))
    loads = [0.0] * num_daemons
    shard_of = [0] * len(tensors)
    for unit_cost, _, m in units:
        target = min(range(num_daemons), key=lambda k: (loads[k], k))
        loads[target] += unit_cost
        for i in m:
            shard_of[i] = target
    return Placement(tuple(shard_of), tuple(loads))
