"""The ranks of one data-parallel job sharing a ``RemoteOptimizer`` session.

Every rank sends its own gradients for the same step and the daemon applies their weighted average
once (docs/ranks.md). Here: the world size and this rank (given, else from an initialized
``torch.distributed``), the session id they share, the order they open it in, how they synchronize
(``Sync``: lock-step, quorum or asynchronous), the labels every rank must agree on and the check of
a step's ``weight``.
"""

from __future__ import annotations

import math
import numbers
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def ranks(world_size: Optional[int], rank: Optional[int]) -> Tuple[int, int]:
    """(world_size, rank) as given, else from an initialized torch.distributed, else (1, 0)."""
    if world_size is None:
        world_size = torch.distributed.get_world_size() if dist_ready() else 1
    if rank is None:
        rank = torch.distributed.get_rank() if dist_ready() else 0
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    return world_size, rank


def shared_session_id(session: Optional[str], world_size: int) -> str:
    """The session id every rank uses: the one given, or a fresh one (broadcast from rank 0 when
    several ranks share it)."""
    if session:
        return session
    fresh = f"torch-{uuid.uuid4().hex[:16]}"
    if world_size == 1:
        return fresh
    if not dist_ready():
        raise ValueError("session: several ranks (world_size > 1) must name the same session id, "
                         "or initialize torch.distributed so that rank 0's id is shared")
    shared = [fresh]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def rank_zero_first(world_size: int, rank: int, open_session: Callable[[], None]) -> None:
    """Runs ``open_session`` on every rank, rank 0's first when torch.distributed is initialized:
    it creates the session and uploads its parameters before the others attach and read them
    back, so that every rank starts from rank 0's values."""
    distributed = world_size > 1 and dist_ready()
    if distributed and rank != 0:
        torch.distributed.barrier()
    try:
        open_session()
    finally:
        if distributed and rank == 0:
            torch.distributed.barrier()


SYNC_MODES = ("lockstep", "quorum", "async")
STALENESS_SCALINGS = ("none", "inverse", "polynomial", "hinge")


@dataclass(frozen=True)
class Sync:
    """How the ranks of a session make a step (docs/ranks.md): ``lockstep`` waits for every rank;
    ``quorum`` takes step k once ``min_ranks`` ranks sent it and ``grace_seconds`` passed since the
    ``min_ranks``-th arrived (or once every rank sent it), and answers a rank that came later
    ``included=False``; ``async`` applies every rank's push on arrival as the next global step,
    refusing one more than ``max_staleness`` global steps behind, its lrs scaled by
    ``staleness_scaling`` ("none"; "inverse": 1 / (1 + s); FedAsync's "polynomial":
    (1 + s)^-a, or "hinge": 1 for s <= b, else 1 / (a (s - b) + 1), with ``staleness_a``
    and ``staleness_b``)."""
    mode: str = "lockstep"
    min_ranks: int = 0         # quorum: Q, 1 <= Q <= world_size; otherwise 0
    grace_seconds: float = 0.0  # quorum: >= 0; otherwise 0
    max_staleness: int = 0     # async: S >= 0; otherwise 0
    staleness_scaling: str = "none"  # async: "none", "inverse", "polynomial" or "hinge"
    staleness_a: float = 0.0         # polynomial, hinge: a > 0
    staleness_b: int = 0             # hinge: b >= 0


_LABEL_KEY = re.compile(r"[a-z0-9._-]{1,64}")


def labels_of(labels: Any) -> Dict[str, str]:
    """``RemoteOptimizer(labels=)`` checked as the daemon checks ``spec.labels``, naming the
    argument: a dict of at most 16 labels, each key 1 to 64 characters of a-z, 0-9, '.', '_' and
    '-', each value a str of at most 256 bytes without control characters. None: no labels."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise TypeError(f"labels: must be a dict of str to str, got {type(labels).__name__}")
    if len(labels) > 16:
        raise ValueError(f"labels: {len(labels)} labels exceed the limit of 16")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"labels: key {key!r} must be 1 to 64 characters of a-z, 0-9, '.', "
                             f"'_' and '-'")
        if not isinstance(value, str):
            raise TypeError(f"labels[{key!r}]: must be a str, got {type(value).__name__}")
        if len(value.encode()) > 256 or any(ord(c) < 0x20 or ord(c) == 0x7f for c in value):
            raise ValueError(f"labels[{key!r}]: must be at most 256 bytes without control characters")
    return dict(labels)


def sync_of(sync_mode: Optional[str], min_ranks: Any, grace_seconds: Any, *, world_size: int,
            num_daemons: int, max_staleness: Any = None, staleness_scaling: Any = None) -> Sync:
    """The ``Sync`` of ``RemoteOptimizer(sync_mode=, min_ranks=, grace_seconds=, max_staleness=,
    staleness_scaling=)``, checked as the daemon checks ``spec.sync`` but naming the arguments:
    ValueError (TypeError for a value of the wrong type) before anything is sent. ``sync_mode``
    None is lock-step; a quorum's ``min_ranks`` None is ``world_size`` and its ``grace_seconds``
    None is 0 (take the step as soon as Q ranks sent it); an asynchronous session needs
    ``max_staleness`` (there is no default that suits every number of ranks) and its
    ``staleness_scaling`` None is "none"."""
    mode = "lockstep" if sync_mode is None else sync_mode
    if not isinstance(mode, str) or mode.lower() not in SYNC_MODES:
        raise ValueError(f"sync_mode: must be 'lockstep', 'quorum' or 'async', got {sync_mode!r}")
    mode = mode.lower()
    if mode != "quorum":
        if min_ranks is not None:
            raise ValueError("min_ranks: applies to sync_mode='quorum' only")
        if grace_seconds is not None:
            raise ValueError("grace_seconds: applies to sync_mode='quorum' only")
    if mode != "async":
        if max_staleness is not None:
            raise ValueError("max_staleness: applies to sync_mode='async' only")
        if staleness_scaling is not None:
            raise ValueError("staleness_scaling: applies to sync_mode='async' only")
    if mode == "lockstep":
        return Sync()
    if num_daemons > 1:
        kind = "quorum" if mode == "quorum" else "asynchronous"
        raise ValueError(f"sync_mode: {kind} steps are not available on a sharded session "
                         f"(several endpoints); use sync_mode='lockstep'")
    if mode == "async":
        name, a, b = _staleness_scaling(staleness_scaling)
        return Sync("async", max_staleness=_max_staleness(max_staleness), staleness_scaling=name,
                    staleness_a=a, staleness_b=b)
    if min_ranks is None:
        min_ranks = world_size
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, numbers.Integral):
        raise TypeError(f"min_ranks: must be an int, got {type(min_ranks).__name__}")
    if not 1 <= int(min_ranks) <= world_size:
        raise ValueError(f"min_ranks: must be between 1 and world_size ({world_size}), got {min_ranks}")
    grace = 0.0 if grace_seconds is None else _real("grace_seconds", grace_seconds)
    if not (math.isfinite(grace) and grace >= 0):
        raise ValueError(f"grace_seconds: must be finite and >= 0, got {grace}")
    return Sync("quorum", int(min_ranks), grace)


def _max_staleness(value: Any) -> int:
    """An asynchronous session's S: an int >= 0 (the daemon's spec.sync.max_staleness)."""
    if value is None:
        raise ValueError("max_staleness: required with sync_mode='async': the most global steps a "
                         "push's base_step may lag behind the session (0: every push must be "
                         "computed on the latest parameters)")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"max_staleness: must be an int, got {type(value).__name__}")
    if int(value) < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {value}")
    return int(value)


# The parameters FedAsync's functions take: (a,) and (a, b). None has a default that suits every
# number and speed of ranks, so they are given with the name.
STALENESS_PARAMETERS = {"polynomial": ("a",), "hinge": ("a", "b")}


def _staleness_scaling(value: Any) -> Tuple[str, float, int]:
    """(name, a, b) of the daemon's spec.sync.staleness_scaling from "none" (the default),
    "inverse", ("polynomial", a) or ("hinge", a, b)."""
    if value is None:
        return "none", 0.0, 0
    name, params = (value, ()) if isinstance(value, str) else \
        (value[0], tuple(value[1:])) if isinstance(value, tuple) and value else (None, ())
    if not isinstance(name, str) or name.lower() not in STALENESS_SCALINGS:
        raise ValueError(f"staleness_scaling: must be 'none', 'inverse', ('polynomial', a) or "
                         f"('hinge', a, b), got {value!r}")
    name = name.lower()
    wanted = STALENESS_PARAMETERS.get(name, ())
    if len(params) != len(wanted):
        form = f"('{name}', {', '.join(wanted)})" if wanted else f"'{name}'"
        raise ValueError(f"staleness_scaling: give {form}, got {value!r}")
    a = _real("staleness_scaling", params[0]) if params else 0.0
    if params and not (math.isfinite(a) and a > 0):
        raise ValueError(f"staleness_scaling: a must be finite and > 0, got {params[0]!r}")
    b = 0
    if len(params) == 2:
        if isinstance(params[1], bool) or not isinstance(params[1], numbers.Integral) or params[1] < 0:
            raise ValueError(f"staleness_scaling: b must be an int >= 0, got {params[1]!r}")
        b = int(params[1])
    return name, a, b


# The largest weight the daemon takes (kMaxStepWeight, server/session/step_plan.h): the weighted
# sums of any number of ranks' gradients stay finite below it.
MAX_WEIGHT = 1e30


def check_weight(weight: Any) -> Optional[float]:
    """None, or the weight of this rank's gradients in a step (``step(weight=)``): a number > 0 and
    at most ``MAX_WEIGHT``, as the daemon requires of ``header.weight``; ValueError or TypeError
    naming ``weight``."""
    if weight is None:
        return None
    value = _real("weight", weight)
    if not (0 < value <= MAX_WEIGHT):
        raise ValueError(f"weight: must be > 0 and at most {MAX_WEIGHT:g}, got {value}")
    return value


def _real(name: str, value: Any) -> float:
    """``value`` as a float (a Python or numpy number, or a one-element tensor); TypeError naming
    ``name`` for anything else, booleans included."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}") from None
