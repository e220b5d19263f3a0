"""The checks and the passing on of ``muond.DiLoCo``'s arguments: counts, tokens and merge_alpha
checked naming the argument, the number of asynchronous workers, F in the session's labels, and
DiLoCo's own arguments folded into ``RemoteOptimizer``'s option objects. Pure functions."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Dict, Optional

from .optimizer_options import RankOptions, WireOptions


def check_count(name: str, value: Any, low: int, high: Optional[int] = None,
                 why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: must be {bound}{why}, got {value}")
    return value


def check_tokens(tokens: Any) -> float:
    if tokens is None:
        return 1.0
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Real):
        raise TypeError(f"tokens: must be a number, got {tokens!r}")
    value = float(tokens)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"tokens: must be finite and >= 0, got {tokens!r}")
    return value


def check_alpha(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"merge_alpha: must be a number, got {value!r}")
    alpha = float(value)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge_alpha: must be in [0, 1], got {value!r}")
    return alpha


def workers_of(world_size: Optional[int]) -> int:
    """The number of workers of an asynchronous DiLoCo: ``world_size``, else torch.distributed's."""
    if world_size is not None:
        return check_count("world_size", world_size, 1)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raise ValueError("world_size: asynchronous DiLoCo needs the number of workers (world_size, or "
                     "an initialized torch.distributed) for its delayed Nesterov's default "
                     "nesterov_delay")


FRAGMENTS_LABEL = "diloco.fragments"
_MAX_LABELS = 16  # a session's (docs/protocol.md, Create or attach)


def label_fragments(remote_optimizer_kwargs: Dict[str, Any], fragments: int) -> None:
    """Adds F to the session's labels (``RemoteOptimizer(labels=)``, a keyword or in ``ranks=``):
    the daemon refuses a worker whose F differs from the session's, whose fragments would not be
    the others' (docs/diloco.md). Labels of another type are left for the optimizer to refuse."""
    ranks = remote_optimizer_kwargs.get("ranks")
    in_ranks = isinstance(ranks, RankOptions) and "labels" not in remote_optimizer_kwargs
    given = ranks.labels if in_ranks else remote_optimizer_kwargs.get("labels")
    if given is not None and not isinstance(given, dict):
        return
    if given and FRAGMENTS_LABEL in given:
        raise ValueError(f"labels: '{FRAGMENTS_LABEL}' is DiLoCo's own (from fragments)")
    if given and len(given) >= _MAX_LABELS:
        raise ValueError(f"labels: at most {_MAX_LABELS - 1} with DiLoCo, which adds "
                         f"'{FRAGMENTS_LABEL}' to them (a session holds {_MAX_LABELS}), got {len(given)}")
    labels = dict(given or {}, **{FRAGMENTS_LABEL: str(fragments)})
    if in_ranks:
        remote_optimizer_kwargs["ranks"] = dataclasses.replace(ranks, labels=labels)
    else:
        remote_optimizer_kwargs["labels"] = labels


# DiLoCo's own arguments that are fields of RemoteOptimizer's option objects, by object.
_OWN_FIELDS = {"ranks": (RankOptions, ("world_size", "rank", "sync_mode")), "wire": (WireOptions, ("wire_dtype",))}


def fold_own_arguments(remote_optimizer_kwargs: Dict[str, Any], own: Dict[str, Any]) -> None:
    """Passes DiLoCo's ``own`` arguments on to the optimizer: into ``ranks=`` or ``wire=`` when the
    caller gave that object (a keyword beside it would be taken as given twice), else as keywords
    (those left None unsaid). An object that sets one of them itself is a TypeError naming it: DiLoCo
    reads them (``wire_dtype``, ``world_size``, ``sync_mode``), so they are given to DiLoCo."""
    for keyword, (cls, fields) in _OWN_FIELDS.items():
        given = remote_optimizer_kwargs.get(keyword)
        mine = {f: own.pop(f) for f in fields}
        if not isinstance(given, cls):
            remote_optimizer_kwargs.update({f: v for f, v in mine.items() if v is not None})
            continue
        default = cls()
        for f in fields:
            if getattr(given, f) != getattr(default, f):
                raise TypeError(f"{keyword}.{f}: give {f} to DiLoCo itself, not in {keyword}=")
        remote_optimizer_kwargs[keyword] = dataclasses.replace(
            given, **{f: v for f, v in mine.items() if v is not None})
