"""The ``SessionSpec`` a ``RemoteOptimizer`` creates its session with, and its shards' specs.

The whole spec lists every group (its options, ``options.group_options_proto``), every parameter
(shape, group, wire dtype, fused-QKV split, tensor-parallel blocks), the QK-clip pairs, the loss
scaler and how several ranks synchronize (``ranks.Sync``: quorum or asynchronous; lock-step leaves
``sync`` unset, as every spec before it did, so that such sessions still attach). With several
daemons each gets the parameters placed on it (``placement.py``), every group (a partitioned one's
``flat`` or ``explicit`` partition as the explicit ranges of the parameters it holds), the QK-clip
pairs whose query it holds and the placement itself with the whole session's count of pairs, by
which each daemon checks QK-clip's options (docs/sharding.md).
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Sequence

from . import options as opts
from . import partition
from . import placement
from . import wire
from .ranks import Sync
from ._stubs import pb


def whole_spec(param_groups: Sequence[Dict[str, Any]], group_names: Sequence[str],
               qk_clip: Sequence[Any], *, world_size: int, wire_dtype: str, return_dtype: str,
               loss_scaler: Optional[Dict[str, Any]], sync: Sync = Sync(),
               labels: Optional[Dict[str, str]] = None) -> pb.SessionSpec:
    """The spec of the whole session (global shapes: a partitioned group's tensors are parts)."""
    spec = pb.SessionSpec(world_size=world_size, return_dtype=wire.dtype_enum(return_dtype))
    spec.labels.update(labels or {})
    for group, gname in zip(param_groups, group_names):
        added = spec.groups.add(name=gname, options=opts.group_options_proto(group))
        if group.get("partition") is not None:
            added.partition.CopyFrom(partition.to_proto(group["partition"], group["param_names"], pb))
        for shape, pname in zip(partition.global_shapes(group), group["param_names"]):
            ps = spec.parameters.add(name=pname, shape=list(shape), group=gname,
                                     wire_dtype=wire.dtype_enum(wire_dtype))
            if group.get("qkv_split") is not None:
                ps.qkv_split.extend(group["qkv_split"])
                ps.num_query_groups = group.get("num_query_groups") or 1
            if (group.get("tp_blocks") or 1) > 1:
                ps.tp_blocks = group["tp_blocks"]
                ps.tp_block_dim = group.get("tp_block_dim", 0)
    for pair in qk_clip:
        added = spec.qk_clip.add(query=pair.query, key=pair.key, num_heads=pair.num_heads)
        if pair.mla is not None:
            added.mla.qk_nope_head_dim = pair.mla.qk_nope_head_dim
            added.mla.qk_rope_head_dim = pair.mla.qk_rope_head_dim
            added.mla.v_head_dim = pair.mla.v_head_dim
    if loss_scaler is not None:
        spec.loss_scaler.SetInParent()
        for key, value in loss_scaler.items():
            setattr(spec.loss_scaler, key, value)
    if sync.mode == "quorum":
        spec.sync.mode = pb.SYNC_MODE_QUORUM
        spec.sync.min_ranks = sync.min_ranks
        spec.sync.grace_seconds = sync.grace_seconds
    elif sync.mode == "async":
        spec.sync.mode = pb.SYNC_MODE_ASYNC
        spec.sync.max_staleness = sync.max_staleness
        spec.sync.staleness_scaling = _SCALINGS[sync.staleness_scaling]
        spec.sync.staleness_a = sync.staleness_a
        spec.sync.staleness_b = sync.staleness_b
    return spec


_SCALINGS = {"none": pb.STALENESS_SCALING_NONE, "inverse": pb.STALENESS_SCALING_INVERSE,
             "polynomial": pb.STALENESS_SCALING_POLYNOMIAL, "hinge": pb.STALENESS_SCALING_HINGE}


def shard_spec(whole: pb.SessionSpec, shard: int, mine: Sequence[int],
               endpoints: Sequence[str]) -> pb.SessionSpec:
    """The spec of daemon ``shard`` of ``endpoints``, which holds the parameters ``mine``
    (indices into ``whole.parameters``)."""
    names = {whole.parameters[i].name for i in mine}
    spec = pb.SessionSpec(world_size=whole.world_size, return_dtype=whole.return_dtype)
    spec.groups.extend(whole.groups)
    spec.parameters.extend(whole.parameters[i] for i in mine)
    for group in spec.groups:
        if group.partition.kind in (pb.PARTITION_KIND_FLAT, pb.PARTITION_KIND_EXPLICIT):
            _hold_on_shard(group.partition, [p for p in whole.parameters if p.group == group.name],
                           names, whole.world_size or 1)
    spec.qk_clip.extend(p for p in whole.qk_clip if p.query in names)
    if whole.HasField("loss_scaler"):
        spec.loss_scaler.CopyFrom(whole.loss_scaler)
    if whole.HasField("sync"):
        spec.sync.CopyFrom(whole.sync)
    spec.labels.update(whole.labels)
    spec.shard.endpoints.extend(endpoints)
    spec.shard.index = shard
    spec.shard.num_parameters = len(whole.parameters)
    spec.shard.parameters.extend(mine)
    spec.shard.qk_clip_pairs = len(whole.qk_clip)
    return spec


def _hold_on_shard(message: pb.Partition, members: Sequence[pb.ParameterSpec], held: Collection[str],
                   world_size: int) -> None:
    """Rewrites a group's partition ``message`` (of the whole session's group of parameters
    ``members``) as the shard holding the parameters ``held`` is given it
    (``partition.held_on_a_shard``)."""
    names = [p.name for p in members]
    whole = partition.from_proto(message, [tuple(p.shape) for p in members], names, pb)
    kept = [k for k, name in enumerate(names) if name in held]
    message.CopyFrom(partition.to_proto(partition.held_on_a_shard(whole, kept, world_size),
                                        [names[k] for k in kept], pb))


def place(param_groups: Sequence[Dict[str, Any]], together: List[tuple],
          num_daemons: int) -> placement.Placement:
    """The placement of the groups' parameters (in order) on ``num_daemons`` daemons, keeping the
    index pairs ``together`` on one daemon."""
    tensors = []
    for group in param_groups:
        split = group.get("qkv_split")
        for shape in partition.global_shapes(group):
            tensors.append(placement.Tensor(
                shape, group["optimizer"] in ("muon", "dion2"),
                tuple(split) if split is not None else None,
                group.get("num_query_groups") or 1))
    return placement.place(tensors, num_daemons, together)
