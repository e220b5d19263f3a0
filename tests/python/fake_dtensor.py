"""What muond reads of a ``torch.distributed.tensor.DTensor`` as FSDP2 holds a sharded parameter,
on plain objects (torch 1.13, which the suite runs on, has no DTensor): its placements, mesh,
global shape, ``requires_grad``, local shard and ``.grad``.

As DTensor does, ``to_local()`` answers the local shard itself under ``no_grad`` and, with grad
enabled on a parameter that requires it, an autograd view of it (a non-leaf, which torch.optim
refuses; a copy here, so that writes through it would not reach the shard either). A test sets
``.grad`` as FSDP2's reduce-scatter does (``foreach_reduce`` assigns the sharded parameter's
``.grad``): a FakeDTensor of the gradient's shard, never a ``.grad`` of the shard itself.
A FakeDTensor is made as torch >= 2.4 makes a DTensor from a spec (``DTensor(local, spec,
requires_grad=...)``, FSDP2's way, which leaves the local tensor where it is; an optimizer's state
dict holds its parts so), and a gradient answers what ``torch.optim.Optimizer.zero_grad`` asks of
one (``grad_fn``, ``requires_grad_``, ``zero_``).
"""

import dataclasses
from typing import Any, NamedTuple, Optional, Tuple

import torch


def contiguous_stride(shape):
    """The strides of a contiguous tensor of ``shape``."""
    stride, out = 1, []
    for size in reversed(tuple(shape)):
        out.append(stride)
        stride *= max(int(size), 1)
    return tuple(reversed(out))


class Shard:
    def __init__(self, dim):
        self.dim = dim

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __eq__(self, other):  # as DTensor's placements compare
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self):
        return hash(("Shard", self.dim))


class Mesh:
    ndim = 1

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


class TensorMeta(NamedTuple):  # as torch.distributed.tensor._dtensor_spec's
    shape: torch.Size
    stride: Tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class Spec:  # as DTensorSpec: the mesh, the placements and the global tensor's facts
    mesh: Mesh
    placements: Tuple[Any, ...]
    tensor_meta: Optional[TensorMeta] = None


class FakeDTensor:
    def __init__(self, local, spec, *, requires_grad):
        """As DTensor's own constructor (torch >= 2.4, which FSDP2 uses to make its parameters):
        ``local`` is kept where it is."""
        assert spec.tensor_meta.dtype == local.dtype, "the spec's dtype is not the local tensor's"
        self._local_tensor = local.detach()
        self._spec = spec
        self.requires_grad = requires_grad
        self.grad = None

    @classmethod
    def make(cls, local, shape, world, rank, placement=None, requires_grad=True):
        """Rank ``rank`` of ``world``'s DTensor of global ``shape`` whose shard is ``local``."""
        meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
        spec = Spec(Mesh(world, rank), (placement if placement is not None else Shard(0),), meta)
        return cls(local, spec, requires_grad=requires_grad)

    @classmethod
    def of(cls, whole, world, rank, placement=None, requires_grad=True):
        """Rank ``rank``'s DTensor of ``whole`` cut into ``world`` shards by ``torch.chunk``."""
        chunks = whole.chunk(world)
        local = chunks[rank] if rank < len(chunks) else whole[:0]
        return cls.make(local.clone(), whole.shape, world, rank, placement, requires_grad)

    @property
    def shape(self):
        return self._spec.tensor_meta.shape

    @property
    def placements(self):
        return self._spec.placements

    @property
    def device_mesh(self):
        return self._spec.mesh

    def stride(self):
        return self._spec.tensor_meta.stride

    grad_fn = None

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    def to_local(self):
        if torch.is_grad_enabled() and self.requires_grad:
            return self._local_tensor.clone().requires_grad_() * 1
        return self._local_tensor

    def zero_(self):
        self._local_tensor.zero_()
        return self
