"""The ranks of one data-parallel job sharing a ``RemoteOptimizer`` session.

Every rank sends its own gradients for the same step and the daemon applies their average once
(docs/protocol.md). Here: the world size and this rank (given, else from an initialized
``torch.distributed``), the session id they share, and the order they open it in.
"""

from __future__ import annotations

import uuid
from typing import Callable, Optional, Tuple

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
