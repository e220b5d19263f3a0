"""The infrastructure choices of a ``RemoteOptimizer``, as typed option objects.

``RemoteOptimizer(params, **defaults)`` takes the group options of torch's optimizers (``lr``,
``betas``, ``momentum``, ... — the option table) as keywords. Everything else it needs to know is
infrastructure, in five objects, each given by one keyword:

====================  =====================================================================
``connection=``       ``ConnectionOptions``: the daemons, deadlines, token and TLS, retries, the
                      step transport, the chunk size
``ranks=``            ``RankOptions``: world size and rank, how the ranks make a step
                      (``sync_mode``, quorum and asynchronous settings)
``timing=``           ``TimingOptions``: when gradients leave and parameters land (``overlap``,
                      ``land_in_forward``, ``delay``)
``wire=``             ``WireOptions``: the dtypes on the wire both ways, ``shm_zero_copy``
``step=``             ``StepOptions``: what the daemon does in each step besides the update
                      (global ``max_grad_norm``, loss scaler, QK-clip, zero counting)
====================  =====================================================================

Every field of these objects may also be given as a keyword of its own, as before the objects
existed (``RemoteOptimizer(params, world_size=2, rank=0, overlap=True)``): a shorthand for the
object with that field set. Giving a field both ways is a TypeError naming it. ``max_grad_norm``
as a keyword is ``StepOptions.max_grad_norm``, the clip of the global gradient norm; a group's own
limit is the group option of that name, given in the group (with ``clip_scope="group"``).

Each object checks its own fields and combinations when the optimizer is built, naming the field it
refuses (``ranks.min_ranks: ...``); ``check_together`` checks what spans objects (a sharded session
is lock-step; ``delay`` with a loss scaler; zero copy and overlap). Frozen values; thread-safe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

from . import loss_scale
from . import ranks as rank_rules
from . import wire as wire_dtypes
from .connection_options import ConnectionOptions
from .delayed import check_delay
from .landing import check_land_in_forward
from .step_info import check_max_grad_norm

__all__ = ["RankOptions", "TimingOptions", "WireOptions", "StepOptions", "Setup", "setup_of"]


@dataclass(frozen=True)
class RankOptions:
    """Ranks (docs/ranks.md). ``world_size``, ``rank``: default from an initialized
    ``torch.distributed``, else 1 and 0. ``sync_mode``: "lockstep" (default), "quorum" (with
    ``min_ranks``, default world_size, and ``grace_seconds``, default 0) or "async" (with
    ``max_staleness``, required, and ``staleness_scaling``: "none", "inverse",
    ("polynomial", a) or ("hinge", a, b)). ``labels``: a dict of str to str that every client of
    the session must agree on and the daemon does not use (DiLoCo's fragments, a run's name): an
    attach whose labels differ is refused naming the label."""
    world_size: Optional[int] = None
    rank: Optional[int] = None
    sync_mode: Optional[str] = None
    min_ranks: Optional[int] = None
    grace_seconds: Optional[float] = None
    max_staleness: Optional[int] = None
    staleness_scaling: Optional[Any] = None
    labels: Optional[Dict[str, str]] = dataclasses.field(default=None, hash=False)  # a dict: not hashable

    def resolve(self, num_daemons: int) -> Tuple[int, int, rank_rules.Sync, Dict[str, str]]:
        """(world_size, rank, sync, labels), checked; ValueError or TypeError naming the field."""
        world_size, rank = rank_rules.ranks(self.world_size, self.rank)
        sync = rank_rules.sync_of(self.sync_mode, self.min_ranks, self.grace_seconds,
                                  world_size=world_size, num_daemons=num_daemons,
                                  max_staleness=self.max_staleness,
                                  staleness_scaling=self.staleness_scaling)
        return world_size, rank, sync, rank_rules.labels_of(self.labels)


@dataclass(frozen=True)
class TimingOptions:
    """When gradients leave and parameters land (docs/overlap.md). ``overlap``: send each gradient
    while backward runs; ``land_in_forward``: the model whose next forward the parameters' way back
    overlaps (with ``overlap``); ``delay`` 1 and ``delay_warmup``: the delayed parameter update."""
    overlap: bool = False
    land_in_forward: Optional[torch.nn.Module] = None
    delay: int = 0
    delay_warmup: int = 0

    def resolve(self, *, loss_scaler: Any, sync_mode: str, num_daemons: int) -> Tuple[int, int]:
        """(delay, delay_warmup), checked with what they depend on; ValueError naming the field."""
        delay, warmup = check_delay(self.delay, self.delay_warmup, loss_scaler, sync_mode)
        if self.overlap and num_daemons > 1:
            raise ValueError("overlap: needs one daemon (a sharded step prepares on every shard "
                             "before anything is applied); got several endpoints")
        check_land_in_forward(self.land_in_forward, self.overlap, delay, sync_mode)
        return delay, warmup


@dataclass(frozen=True)
class WireOptions:
    """The dtypes of gradients on the wire (``wire_dtype``: "fp32" (default), "bf16", "fp16", or
    block-quantized "int8" or "int4", over gRPC only: ``muond/quantize.py``) and of the returned
    parameters (``return_dtype``: "fp32", "bf16" or "fp16"); ``shm_zero_copy``: the model's tensors
    live in the session's shared-memory region (docs/transports.md, Zero copy)."""
    wire_dtype: wire_dtypes.DTypeLike = "fp32"
    return_dtype: wire_dtypes.DTypeLike = "fp32"
    shm_zero_copy: bool = False

    def dtypes(self) -> Tuple[str, str]:
        """(wire_dtype, return_dtype) by name; ValueError naming the field for an unknown dtype."""
        named = []
        for field, read in (("wire_dtype", wire_dtypes.gradient_dtype_name), ("return_dtype", wire_dtypes.dtype_name)):
            try:
                named.append(read(getattr(self, field)))
            except ValueError as err:
                raise ValueError(f"{field}: {err}") from None
        return named[0], named[1]


@dataclass(frozen=True)
class StepOptions:
    """What the daemon does in each step besides the update. ``max_grad_norm``: clip the global
    gradient norm; ``loss_scaler``: True or a dict of Megatron-Core's options (``muond.loss_scale``);
    ``qk_clip``: MuonClip pairs ``[(query, key, num_heads), ...]``; ``log_num_zeros_in_grad``:
    count the gradient's zeros; ``parameters_changed``: what a step does about parameters changed
    in place since the optimizer last wrote them — ``"raise"`` (ValueError), ``"warn"`` (once) or
    ``"ignore"`` (for a model that changes its weights itself, as ``nn.Embedding(max_norm=)``)."""
    max_grad_norm: Optional[float] = None
    log_num_zeros_in_grad: bool = False
    loss_scaler: Any = None
    qk_clip: Optional[Iterable[Tuple[Any, Any, int]]] = None
    parameters_changed: str = "raise"

    def resolve(self) -> Tuple[Optional[float], Optional[Dict[str, float]]]:
        """(max_grad_norm, the loss scaler's options), checked; ValueError naming the field."""
        if self.parameters_changed not in ("raise", "warn", "ignore"):
            raise ValueError(f"parameters_changed: 'raise', 'warn' or 'ignore', got "
                             f"{self.parameters_changed!r}")
        return check_max_grad_norm(self.max_grad_norm), loss_scale.resolve(self.loss_scaler)


class Setup(NamedTuple):
    """A ``RemoteOptimizer``'s arguments sorted: the five objects, and the group defaults left."""
    connection: ConnectionOptions
    ranks: RankOptions
    timing: TimingOptions
    wire: WireOptions
    step: StepOptions
    defaults: Dict[str, Any]


def _take(cls: type, given: Any, keywords: Dict[str, Any], keyword: str) -> Any:
    """``given`` (a ``cls`` or None) with its fields given one by one in ``keywords`` taken out of
    them; TypeError naming a field given both ways, or a ``given`` of another type."""
    mine = {f.name: keywords.pop(f.name) for f in dataclasses.fields(cls) if f.name in keywords}
    if given is None:
        return cls(**mine)
    if not isinstance(given, cls):
        raise TypeError(f"{keyword}: a muond.{cls.__name__}, not {type(given).__name__}")
    if mine:
        raise TypeError(f"'{sorted(mine)[0]}' was given both as an argument and in {keyword}=; "
                        f"give it in one place")
    return given


def setup_of(keywords: Dict[str, Any], *, endpoint: Optional[str] = None,
             wire_dtype: Optional[wire_dtypes.DTypeLike] = None,
             connection: Optional[ConnectionOptions] = None, ranks: Optional[RankOptions] = None,
             timing: Optional[TimingOptions] = None, wire: Optional[WireOptions] = None,
             step: Optional[StepOptions] = None) -> Setup:
    """The ``Setup`` of ``RemoteOptimizer(params, endpoint, session, wire_dtype, connection=...,
    ranks=..., timing=..., wire=..., step=..., **keywords)``: every shorthand keyword moved into its
    object; the keywords left are the group defaults."""
    connection, rest = ConnectionOptions.from_arguments(connection, endpoint, dict(keywords))
    if wire_dtype is not None:
        rest["wire_dtype"] = wire_dtype
    return Setup(connection, _take(RankOptions, ranks, rest, "ranks"),
                 _take(TimingOptions, timing, rest, "timing"), _take(WireOptions, wire, rest, "wire"),
                 _take(StepOptions, step, rest, "step"), rest)
