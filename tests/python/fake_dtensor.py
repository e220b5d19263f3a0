"""What muond reads of a ``torch.distributed.tensor.DTensor`` as FSDP2 holds a sharded parameter,
on plain objects (torch 1.13, which the suite runs on, has no DTensor): its placements, mesh,
global shape, ``requires_grad``, local shard and ``.grad``.

As DTensor does, ``to_local()`` answers the local shard itself under ``no_grad`` and, with grad
enabled on a parameter that requires it, an autograd view of it (a non-leaf, which torch.optim
refuses; a copy here, so that writes through it would not reach the shard either). A test sets
``.grad`` as FSDP2's reduce-scatter does (``foreach_reduce`` assigns the sharded parameter's
``.grad``): a FakeDTensor of the gradient's shard, never a ``.grad`` of the shard itself.
"""

import torch


class Shard:
    def __init__(self, dim):
        self.dim = dim

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class Mesh:
    ndim = 1

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


class FakeDTensor:
    def __init__(self, local, shape, world, rank, placement=None, requires_grad=True):
        self._local_tensor = local.detach()
        self.shape = torch.Size(shape)
        self.placements = (placement if placement is not None else Shard(0),)
        self.device_mesh = Mesh(world, rank)
        self.requires_grad = requires_grad
        self.grad = None

    @classmethod
    def of(cls, whole, world, rank, placement=None, requires_grad=True):
        """Rank ``rank``'s DTensor of ``whole`` cut into ``world`` shards by ``torch.chunk``."""
        chunks = whole.chunk(world)
        local = chunks[rank] if rank < len(chunks) else whole[:0]
        return cls(local.clone(), whole.shape, world, rank, placement, requires_grad)

    def to_local(self):
        if torch.is_grad_enabled() and self.requires_grad:
            return self._local_tensor.clone().requires_grad_() * 1
        return self._local_tensor

    def zero_(self):
        self._local_tensor.zero_()
        return self
