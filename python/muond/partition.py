"""Ranks that hold parts of the parameters (docs/ranks.md, Ranks that hold parts).

A trainer that shards its parameters (FSDP, ZeRO, DTensor) gives each ``RemoteOptimizer`` rank only
its local part of each parameter and of its reduced gradient; the daemon assembles the whole
gradient, steps on whole matrices (Muon needs them) and answers each rank its part. A parameter
group says how its parameters are cut with a ``Partition``, which also carries their global shapes
(the local tensors cannot tell them)::

    groups = [{"params": local_matrices, "partition": muond.partition.rows(global_shapes)}, ...]
    opt = muond.RemoteOptimizer(groups, endpoint, world_size=N, rank=r)

With ``endpoints=[...]`` the session spreads over several daemons, each holding whole parameters
assembled from the ranks' parts (``held_on_a_shard``: what each is given of a partition).

The rules, the same as the daemon's (it checks every size again):

- ``rows`` (DTensor ``Shard(0)``, FSDP2): rank r holds rows [r·c, min(m, (r+1)·c)) of m rows,
  c = ⌈m/N⌉ (``torch.chunk`` on dim 0); a 1-D parameter is cut the same way.
- ``flat`` (flat parameters): the group's parameters flattened in order, each padded to a
  multiple of ``alignment`` elements, the whole padded to a multiple of N and cut into N equal
  ranges; a range may cut through parameters.
- ``explicit``: each rank's range of each parameter, as given; together they cover every element
  once.

Any of the three may be repeated over ``replicas`` copies (HSDP: FSDP2's 2-D ``(replicate,
shard)`` mesh, ``HYBRID_SHARD``): the rule then cuts each parameter over N = world_size / replicas
shards, rank r holds shard r mod N (the mesh's row-major numbering), and the daemon averages each
shard's replicas by weight, as it averages replicated ranks, instead of the trainer's all-reduce
over the replica group.

A rank's part of a parameter is one contiguous range of its row-major flattening, possibly empty.
Adapters: ``from_dtensor`` (a DTensor's local tensor and global shape), ``from_fsdp1`` (an FSDP1
``FlatParameter``'s layout as an explicit partition), ``zero`` and ``zero_views`` (DeepSpeed ZeRO's
layouts, stages 1 to 3, as an explicit partition, and a rank's parts as views into its flat
partition) and ``shard_parameters`` (cuts a model's parameters for rank r, for a trainer without
FSDP).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

KINDS = ("rows", "flat", "explicit")
Shape = Tuple[int, ...]
Range = Tuple[int, int]


@dataclass(frozen=True)
class Partition:
    """How a group's parameters are cut over the ranks: ``kind`` (one of ``KINDS``), the global
    ``shapes`` of the group's parameters in order, ``alignment`` (flat), ``ranges`` (explicit:
    one mapping per shard from a parameter's position in the group to its [begin, end)) and
    ``replicas`` (HSDP: copies of the partition, each over world_size / replicas ranks; 0 or 1:
    none)."""

    kind: str
    shapes: Tuple[Shape, ...]
    alignment: int = 0
    ranges: Optional[Tuple[Tuple[Tuple[int, Range], ...], ...]] = None
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"partition kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for shape in self.shapes:
            if any(int(d) <= 0 for d in shape):
                raise ValueError(f"partition shapes: every dimension must be positive, got {shape}")
        if self.alignment < 0:
            raise ValueError(f"partition alignment must be >= 0, got {self.alignment}")
        if self.alignment and self.kind != "flat":
            raise ValueError("partition alignment applies to kind 'flat' only")
        if (self.ranges is not None) != (self.kind == "explicit"):
            raise ValueError("partition ranges are given for kind 'explicit', and only for it")
        if self.replicas < 0:
            raise ValueError(f"partition replicas must be >= 0, got {self.replicas}")

    def numel(self, k: int) -> int:
        return math.prod(self.shapes[k])

    def shards(self, world_size: int) -> int:
        """The number of ranks one copy of the partition spans: world_size without replicas.
        ValueError unless ``replicas`` divides world_size."""
        copies = max(1, self.replicas)
        if copies > world_size or world_size % copies:
            raise ValueError(f"partition replicas must divide world_size ({world_size}), got {self.replicas}")
        return world_size // copies

    def parts(self, world_size: int) -> List[List[Range]]:
        """parts[k][r]: the range of the group's k-th parameter that rank r holds (under HSDP,
        that of its shard r mod shards)."""
        n = self.shards(world_size)
        if self.kind == "rows":
            by_shard = [_row_parts(shape, n) for shape in self.shapes]
        elif self.kind == "flat":
            by_shard = _flat_parts([self.numel(k) for k in range(len(self.shapes))], max(1, self.alignment), n)
        else:
            by_shard = _explicit_parts(self, world_size, n)
        return [[ranges[r % n] for r in range(world_size)] for ranges in by_shard]

    def part(self, k: int, world_size: int, rank: int) -> Range:
        return self.parts(world_size)[k][rank]

    def local_shape(self, k: int, world_size: int, rank: int) -> Shape:
        """The shape of rank ``rank``'s part of parameter k: a block of rows under ``rows``,
        otherwise flat."""
        begin, end = self.part(k, world_size, rank)
        shape = self.shapes[k]
        if self.kind == "rows" and len(shape) >= 1:
            row = math.prod(shape[1:])
            return ((end - begin) // row, *shape[1:])
        return (end - begin,)


def _row_parts(shape: Sequence[int], world_size: int) -> List[Range]:
    rows = shape[0] if len(shape) else 1
    row = math.prod(shape[1:]) if len(shape) else 1
    c = -(-rows // world_size)
    return [(min(rows, r * c) * row, min(rows, (r + 1) * c) * row) for r in range(world_size)]


def _flat_parts(numels: Sequence[int], alignment: int, world_size: int) -> List[List[Range]]:
    starts, end = [], 0
    for n in numels:
        starts.append(end)
        end = -(-(end + n) // alignment) * alignment
    chunk = -(-end // world_size)
    return [_chunk_overlaps(start, n, chunk, world_size) for start, n in zip(starts, numels)]


def _chunk_overlaps(start: int, n: int, chunk: int, world_size: int) -> List[Range]:
    """By rank: the range of a parameter of ``n`` elements at offset ``start`` of a flat buffer
    that rank r's chunk [r·chunk, (r+1)·chunk) of the buffer covers (empty where none)."""
    ranks = []
    for r in range(world_size):
        first = min(max(r * chunk - start, 0), n)
        last = min(max((r + 1) * chunk - start, 0), n)
        ranks.append((first, max(first, last)))
    return ranks


def _explicit_parts(partition: Partition, world_size: int, shards: int) -> List[List[Range]]:
    assert partition.ranges is not None
    if len(partition.ranges) != shards:
        unit = (f"rank (world_size {world_size})" if shards == world_size
                else f"shard (world_size {world_size} over {partition.replicas} replicas: {shards})")
        raise ValueError(f"explicit partition: needs one entry per {unit}, got {len(partition.ranges)}")
    out: List[List[Range]] = [[(0, 0)] * shards for _ in partition.shapes]
    for r, given in enumerate(partition.ranges):
        for k, (begin, end) in given:
            out[k][r] = (begin, end)
    return out


def rows(shapes: Iterable[Sequence[int]], *, replicas: int = 0) -> Partition:
    """DTensor ``Shard(0)`` / FSDP2: each rank holds a block of rows (``torch.chunk``'s rule);
    with ``replicas``, HSDP: each shard's block held by that many ranks."""
    return Partition("rows", tuple(tuple(int(d) for d in s) for s in shapes), replicas=int(replicas))


def flat(shapes: Iterable[Sequence[int]], alignment: int = 0, *, replicas: int = 0) -> Partition:
    """ZeRO / flat parameters: the flattened group cut into world_size equal ranges (world_size /
    ``replicas`` under HSDP), each parameter first padded to a multiple of ``alignment`` elements
    (0: none)."""
    return Partition("flat", tuple(tuple(int(d) for d in s) for s in shapes), int(alignment),
                     replicas=int(replicas))


def replicated(partition: Partition, replicas: int) -> Partition:
    """``partition`` (laid out over one replica group's ranks: ``zero``'s or ``from_fsdp1``'s
    world_size is the shard count) repeated over ``replicas`` copies, HSDP."""
    return dataclasses.replace(partition, replicas=int(replicas))


def explicit(shapes: Iterable[Sequence[int]],
             ranges: Sequence[Mapping[int, Sequence[int]]], *, replicas: int = 0) -> Partition:
    """Each rank's range of each parameter: ``ranges[r][k] = (begin, end)`` for the group's k-th
    parameter (a parameter a rank does not list: none of it); with ``replicas``, one entry per
    shard."""
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    given = []
    for per_rank in ranges:
        entries = []
        for k, (begin, end) in sorted(per_rank.items()):
            if not 0 <= int(k) < len(shapes):
                raise ValueError(f"explicit partition: parameter position {k} is outside the group's "
                                 f"{len(shapes)} parameters")
            entries.append((int(k), (int(begin), int(end))))
        given.append(tuple(entries))
    return Partition("explicit", shapes, ranges=tuple(given), replicas=int(replicas))


def to_proto(partition: Partition, names: Sequence[str], pb: Any) -> Any:
    """The ``muond.v1.Partition`` message of ``partition`` for a group whose parameters are
    ``names``."""
    kinds = {"rows": pb.PARTITION_KIND_ROWS, "flat": pb.PARTITION_KIND_FLAT,
             "explicit": pb.PARTITION_KIND_EXPLICIT}
    message = pb.Partition(kind=kinds[partition.kind], alignment=partition.alignment,
                           replicas=partition.replicas)
    for per_rank in partition.ranges or ():
        entry = message.ranks.add()
        for k, (begin, end) in per_rank:
            entry.ranges.add(parameter=names[k], begin=begin, end=end)
    return message


def from_proto(message: Any, shapes: Sequence[Shape], names: Sequence[str], pb: Any) -> Partition:
    """The ``Partition`` of a ``muond.v1.Partition`` message of a group whose parameters are
    ``names`` of global ``shapes`` (``to_proto``'s inverse); the message is the client's own,
    checked when it was made."""
    kinds = {pb.PARTITION_KIND_ROWS: "rows", pb.PARTITION_KIND_FLAT: "flat",
             pb.PARTITION_KIND_EXPLICIT: "explicit"}
    position = {name: k for k, name in enumerate(names)}
    ranges = None
    if message.kind == pb.PARTITION_KIND_EXPLICIT:
        ranges = [{position[r.parameter]: (r.begin, r.end) for r in entry.ranges} for entry in message.ranks]
        return explicit(shapes, ranges, replicas=message.replicas)
    return Partition(kinds[message.kind], tuple(tuple(s) for s in shapes), message.alignment,
                     replicas=message.replicas)


def held_on_a_shard(partition: Partition, kept: Sequence[int], world_size: int) -> Partition:
    """The partition of the group's parameters at positions ``kept`` (in order: those one daemon
    of a sharded session holds) as that daemon is given it. A ``rows`` rule is the parameter's
    own and stays; a ``flat`` one cuts through the group's parameters in order, which the daemon
    holds only some of, so it (and an ``explicit`` one, whose other parameters the daemon does not
    know) becomes the explicit ranges those parameters have in the whole group."""
    shapes = tuple(partition.shapes[k] for k in kept)
    if partition.kind == "rows":
        return dataclasses.replace(partition, shapes=shapes)
    parts = partition.parts(world_size)
    ranges = [{new: parts[k][shard] for new, k in enumerate(kept) if parts[k][shard][0] < parts[k][shard][1]}
              for shard in range(partition.shards(world_size))]
    return explicit(shapes, ranges, replicas=partition.replicas)


def check_local(partition: Partition, tensors: Sequence[torch.Tensor], names: Sequence[str],
                world_size: int, rank: int) -> None:
    """ValueError naming the first local tensor whose element count is not its part's, whose
    shape is not its part's where it has the global shape's dimensions (a column block given for
    rows), or that takes no gradient (a parameter's parts come from every rank holding one, or
    from none)."""
    if len(tensors) != len(partition.shapes):
        raise ValueError(f"partition: {len(partition.shapes)} global shapes for the group's "
                         f"{len(tensors)} parameters")
    parts = partition.parts(world_size)
    for k, (tensor, name) in enumerate(zip(tensors, names)):
        begin, end = parts[k][rank]
        if tensor.numel() != end - begin:
            raise ValueError(f"parameter '{name}': rank {rank} holds elements [{begin}, {end}) of its "
                             f"global shape {partition.shapes[k]} under a {partition.kind} partition "
                             f"({end - begin} elements); the local tensor has {tensor.numel()}")
        expected = tuple(partition.local_shape(k, world_size, rank))
        if (partition.kind == "rows" and len(partition.shapes[k]) > 0  # a scalar: its one element
                and tensor.dim() == len(partition.shapes[k])
                and tuple(tensor.shape) != expected and tensor.numel() > 0):
            raise ValueError(f"parameter '{name}': rank {rank}'s part under a {partition.kind} partition "
                             f"of global shape {partition.shapes[k]} has shape {expected}; the local "
                             f"tensor has {tuple(tensor.shape)} (a block of other dimensions)")
        if not tensor.requires_grad:
            raise ValueError(f"parameter '{name}': requires_grad is False; a part that never takes a "
                             f"gradient makes every step the other ranks' parts of it come in refused "
                             f"(leave frozen parameters out of the optimizer)")


def cut(whole: torch.Tensor, partition: Partition, k: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of the group's k-th parameter, from its whole value (a copy)."""
    begin, end = partition.part(k, world_size, rank)
    local = whole.detach().reshape(-1)[begin:end].clone()
    return local.view(partition.local_shape(k, world_size, rank))


def shard_parameters(named: Iterable[Tuple[str, torch.Tensor]], world_size: int, rank: int,
                     kind: str = "rows", alignment: int = 0, replicas: int = 0
                     ) -> Tuple[List[Tuple[str, torch.Tensor]], Partition]:
    """Cuts whole parameters for rank ``rank``: their local parts as new leaf tensors (named as
    the originals, for a group's ``params``) and the partition that describes them (HSDP with
    ``replicas``). For a pure-torch trainer that shards without FSDP: it reduce-scatters (or
    all-reduces and slices) its gradients into these parts' ``.grad``."""
    named = list(named)
    shapes = [tuple(t.shape) for _, t in named]
    partition = (rows(shapes, replicas=replicas) if kind == "rows"
                 else flat(shapes, alignment, replicas=replicas) if kind == "flat" else None)
    if partition is None:
        raise ValueError(f"shard_parameters: kind must be 'rows' or 'flat', got {kind!r}")
    local = [(name, cut(t, partition, k, world_size, rank).requires_grad_(t.requires_grad))
             for k, (name, t) in enumerate(named)]
    return local, partition


def from_dtensor(param: Any) -> Tuple[torch.Tensor, Shape]:
    """A DTensor sharded ``Shard(0)`` on a one-dimensional mesh (FSDP2's layout), or placed
    ``(Replicate(), Shard(0))`` on a two-dimensional one (HSDP's): its local tensor (its shard,
    read under ``no_grad``) and global shape, for a ``rows`` partition — under HSDP ``rows(shapes, replicas=mesh.size(0))``, the
    session's world size the mesh's and each rank's muond rank its position in the mesh's row-major
    order (``mesh.mesh.flatten()``: replica · shards + shard). ValueError for another placement or
    mesh."""
    placements = tuple(getattr(param, "placements", ()))
    mesh = getattr(param, "device_mesh", None)
    ndim = getattr(mesh, "ndim", 1)
    if mesh is None or ndim not in (1, 2) or len(placements) != ndim:
        raise ValueError(f"from_dtensor: needs a DTensor on a one-dimensional mesh with one placement "
                         f"or a two-dimensional one with two, got placements {placements}")
    if ndim == 2 and type(placements[0]).__name__ != "Replicate":
        raise ValueError(f"from_dtensor: on a two-dimensional mesh only (Replicate(), Shard(0)) (HSDP) "
                         f"maps to a rows partition, got {placements}")
    placement = placements[-1]
    if type(placement).__name__ != "Shard" or getattr(placement, "dim", None) != 0:
        raise ValueError(f"from_dtensor: only Shard(0) maps to a rows partition, got {placement}")
    with torch.no_grad():  # the shard itself (with grad enabled, DTensor answers an autograd view)
        local = param.to_local()
    shape = tuple(int(d) for d in param.shape)
    world_size = int(mesh.size(ndim - 1)) if ndim == 2 else int(mesh.size())
    rank = int(mesh.get_local_rank(mesh_dim=ndim - 1)) if ndim == 2 else int(mesh.get_local_rank())
    want = rows([shape]).local_shape(0, world_size, rank)
    if tuple(local.shape) != want:
        raise ValueError(f"from_dtensor: the local tensor has shape {tuple(local.shape)}; rank {rank} "
                         f"of {world_size} holds {want} of {shape} under torch.chunk's rule (uneven "
                         f"sharding other than torch.chunk's is not a rows partition)")
    return local, shape


def _fsdp1_is_sharded(flat_param: Any, world_size: int) -> bool:
    """Whether an FSDP1 ``FlatParameter`` is cut over the ranks (not ``NO_SHARD``, where every
    rank holds all of it). torch >= 2.0 sets ``_sharded_size`` under every strategy, the whole
    size under ``NO_SHARD``; torch 1.13 sets ``_shard_indices`` under the sharding ones only."""
    sharded = getattr(flat_param, "_sharded_size", None)
    if sharded is None:
        return hasattr(flat_param, "_shard_indices")
    whole = math.prod(int(d) for d in flat_param._unpadded_unsharded_size)
    # One element over several ranks is the one size both strategies give: taken as sharded.
    return world_size == 1 or whole <= 1 or math.prod(int(d) for d in sharded) < whole


def from_fsdp1(flat_param: Any, world_size: int) -> Partition:
    """An FSDP1 ``FlatParameter``'s layout as an explicit partition of its original parameters:
    ``_shapes`` (their shapes as flattened: with tensor parallelism, each one's TP-local shape),
    ``_numels_with_padding`` and ``_is_padding_mask`` (the flat layout, alignment padding
    included; torch 1.13, which pads only the whole, has ``_numels`` alone), cut into world_size
    equal ranges after padding the whole to a multiple of world_size, as FSDP1 does. The ranks'
    local parts are the views ``use_orig_params=True`` gives (each ``param.data`` of this rank,
    flattened). ``NO_SHARD`` holds no partition: every rank has every parameter whole, a
    replicated group."""
    if not _fsdp1_is_sharded(flat_param, world_size):
        raise ValueError("from_fsdp1: the FlatParameter is not sharded (ShardingStrategy.NO_SHARD: every "
                         "rank holds all of it); give its parameters to a group without a partition")
    shapes = [tuple(int(d) for d in s) for s in flat_param._shapes]
    if hasattr(flat_param, "_numels_with_padding"):
        numels = [int(n) for n in flat_param._numels_with_padding]
        padding = [bool(p) for p in flat_param._is_padding_mask]
    else:  # torch 1.13: the parameters back to back
        numels = [int(n) for n in flat_param._numels]
        padding = [False] * len(numels)
    if len(numels) != len(padding) or sum(1 for p in padding if not p) != len(shapes):
        layout = "_numels_with_padding, _is_padding_mask" if hasattr(flat_param, "_numels_with_padding") else "_numels"
        raise ValueError(f"from_fsdp1: {layout} and _shapes disagree")
    total = sum(numels)
    chunk = -(-total // world_size)
    ranges: List[Dict[int, Range]] = [dict() for _ in range(world_size)]
    offset, k = 0, 0
    for n, is_padding in zip(numels, padding):
        if not is_padding:
            if n != math.prod(shapes[k]):
                raise ValueError(f"from_fsdp1: parameter {k} has {n} elements in the flat layout, "
                                 f"its shape {shapes[k]} has {math.prod(shapes[k])}")
            for r, (first, last) in enumerate(_chunk_overlaps(offset, n, chunk, world_size)):
                if last > first:
                    ranges[r][k] = (first, last)
            k += 1
        offset += n
    return explicit(shapes, ranges)


def _zero_flat_layout(numels: Sequence[int], world_size: int, alignment_factor: int,
                      round_robin: bool) -> Tuple[List[int], int]:
    """ZeRO-1/2's flat buffer of one group: each parameter's offset in it (by group position)
    and the number of elements of each rank's partition."""
    order = list(range(len(numels)))
    if round_robin:  # position k goes with the others of k mod world_size, in that order
        order = [k for j in range(world_size) for k in range(j, len(numels), world_size)]
    offsets, end = [0] * len(numels), 0
    for k in order:
        offsets[k] = end
        end += numels[k]
    unit = alignment_factor * world_size
    return offsets, -(-end // unit) * unit // world_size


def _check_zero_arguments(world_size: int, stage: int, alignment_factor: int) -> None:
    if world_size < 1:
        raise ValueError(f"zero: world_size must be >= 1, got {world_size}")
    if stage not in (1, 2, 3):
        raise ValueError(f"zero: stage must be 1, 2 or 3, got {stage}")
    if alignment_factor < 1:
        raise ValueError(f"zero: alignment_factor must be >= 1, got {alignment_factor}")


def zero(shapes: Iterable[Sequence[int]], world_size: int, stage: int = 2, *,
         alignment_factor: int = 2, round_robin: bool = False) -> Partition:
    """DeepSpeed ZeRO's layout of one parameter group (its trainable parameters, in the
    optimizer's order) as an explicit partition.

    - stages 1 and 2: the group flattened into one buffer, only the whole padded to a multiple of
      ``alignment_factor`` × world_size elements (DeepSpeed's ``nccl_start_alignment_factor``, 2),
      each rank holding one equal contiguous partition of it; ``round_robin`` for
      ``round_robin_gradients``, which orders the buffer by position modulo world_size. Not the
      ``flat`` kind, which pads each parameter to ``alignment`` and only the whole to a multiple
      of world_size.
    - stage 3: each parameter on its own, its flattening padded to a multiple of world_size and
      cut into equal chunks (``ds_tensor``): rank r holds [r·c, (r+1)·c) of it, c = ⌈numel/N⌉.

    A rank's parts are its gradients' pieces per parameter; under stages 1 and 2 they are the
    pieces of its flat gradient partition that ``zero_views`` cuts."""
    _check_zero_arguments(world_size, stage, alignment_factor)
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numels = [math.prod(s) for s in shapes]
    if stage == 3:  # each parameter its own buffer
        placed = [(0, -(-n // world_size)) for n in numels]
    else:
        offsets, size = _zero_flat_layout(numels, world_size, alignment_factor, round_robin)
        placed = [(start, size) for start in offsets]
    ranges: List[Dict[int, Range]] = [dict() for _ in range(world_size)]
    for k, (n, (start, chunk)) in enumerate(zip(numels, placed)):
        for r, (first, last) in enumerate(_chunk_overlaps(start, n, chunk, world_size)):
            if last > first:
                ranges[r][k] = (first, last)
    return explicit(shapes, ranges)


def zero_views(flat_part: torch.Tensor, shapes: Iterable[Sequence[int]], world_size: int, rank: int, *,
               alignment_factor: int = 2, round_robin: bool = False) -> List[torch.Tensor]:
    """Rank ``rank``'s parts of a group's parameters (in the group's order) as views into its
    ZeRO-1/2 flat partition ``flat_part`` (e.g. its reduced gradient partition): what the group's
    ``params`` hold and their ``.grad``s take under ``zero(shapes, world_size, stage=2)`` with the
    same options. A parameter the rank holds nothing of is an empty view."""
    _check_zero_arguments(world_size, 2, alignment_factor)
    if not 0 <= rank < world_size:
        raise ValueError(f"zero_views: rank must be in [0, {world_size}), got {rank}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numels = [math.prod(s) for s in shapes]
    offsets, size = _zero_flat_layout(numels, world_size, alignment_factor, round_robin)
    flat = flat_part.reshape(-1)
    if flat.numel() != size:
        raise ValueError(f"zero_views: rank {rank}'s flat partition has {flat.numel()} elements; the "
                         f"layout of {len(shapes)} parameters over {world_size} ranks has {size}")
    views = []
    for n, start in zip(numels, offsets):
        first = min(max(start, rank * size), (rank + 1) * size)
        last = max(first, min(start + n, (rank + 1) * size))
        views.append(flat[first - rank * size:last - rank * size])
    return views


def check_partition_of(group: Mapping[str, Any]) -> None:
    """TypeError or ValueError unless a group's ``partition``, when it has one, is a Partition with
    one global shape per parameter."""
    given = group.get("partition")
    if given is None:
        return
    if not isinstance(given, Partition):
        raise TypeError(f"a group's partition must be a muond.partition.Partition, got {type(given).__name__}")
    if len(given.shapes) != len(group["params"]):
        raise ValueError(f"partition: {len(given.shapes)} global shapes for the group's "
                         f"{len(group['params'])} parameters")


def global_shapes(group: Mapping[str, Any]) -> List[Shape]:
    """The global shapes of a parameter group's parameters: its partition's (the tensors are
    parts), else the tensors' own."""
    given = group.get("partition")
    if given is not None:
        return list(given.shapes)
    return [tuple(p.shape) for p in group["params"]]


def check_groups(groups: Sequence[Mapping[str, Any]], world_size: int, rank: int, *,
                 sync_mode: str, **features: Any) -> bool:
    """Whether any group is partitioned; with one, ValueError unless every local tensor is its
    part and nothing that needs whole tensors on the client's side is asked for (``features``
    named by their argument, e.g. ``overlap=True``)."""
    if not any(g.get("partition") is not None for g in groups):
        return False
    for group in groups:
        if group.get("partition") is not None:
            check_local(group["partition"], group["params"], group["param_names"], world_size, rank)
    replicated = all(g["partition"].replicas > 1 for g in groups if g.get("partition") is not None)
    if sync_mode != "lockstep" and not (sync_mode == "quorum" and replicated):
        raise ValueError(f"partition: lock-step only (a missing rank's part is a missing piece "
                         f"of the gradient), or quorum with replicas of every partition (HSDP); got "
                         f"sync_mode {sync_mode!r}")
    for name, value in features.items():
        if value:
            raise ValueError(f"partition: {name} is not available with partitioned groups")
    return True
