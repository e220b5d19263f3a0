"""Copies between a trainer's tensors and a shared-memory region, split over threads.

A shm step copies every gradient into the region and every parameter out of it (``slots.py``).
torch's ``copy_`` runs on torch's intra-op threads, often fewer than the cores this process may use
(torch counts physical cores; on some virtual machines it counts one), and two threads copy about
1.5 times as fast as one: the copies were the largest part of such a step on the trainer's side. ``copy_all`` splits large CPU copies into pieces run on a few threads of its own — as many
as make torch's threads times them the cores this process may use (``os.sched_getaffinity``) —
and leaves torch's own settings as they are. torch releases the GIL while it copies.

When the large copies add up to ``STREAMING_BYTES`` or more, their pieces of one dtype are copied
with streaming stores (``stream_copy``: 1.3 to 1.4 times as fast as ``copy_`` at these sizes,
since no destination line is read first) where the native copy was built; ``copy_`` otherwise.

Small copies (under ``MIN_PIECE`` elements a piece) and anything not on the CPU are copied as
before, on the calling thread. Thread-safe; the pool is made on first use (again in a forked
child, whose threads did not survive the fork).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import List, Optional, Sequence, Tuple

import torch

from . import stream_copy

MIN_PIECE = 1 << 20  # elements: below this a piece costs more to hand over than to copy
# Bytes: from this much copied in one call, what a copy writes would be evicted before it is read
# again anyway (the daemon streams from the same size, server/transport/api_codec/bulk_codec.cc).
STREAMING_BYTES = 16 << 20

Pair = Tuple[torch.Tensor, torch.Tensor]  # (destination, source), of one shape

_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_pid = 0
_pool_workers = 0


def threads() -> int:
    """How many threads a large copy is split over (this one included)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, torch.get_num_threads()))


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_pid, _pool_workers
    with _lock:
        if _pool is None or _pool_pid != os.getpid() or _pool_workers < workers:
            # The old pool (a smaller one, or one a fork left without threads) is dropped, not
            # waited for: its threads, if any, end when it is collected.
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                          thread_name_prefix="muond-copy")
            _pool_pid, _pool_workers = os.getpid(), workers
        return _pool


def _splittable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous() and dst.numel() == src.numel())


@torch.no_grad()
def _run(pieces: List[Pair], stream: bool = False) -> None:
    """Copies each pair; with ``stream``, the pairs (contiguous CPU ones, ``_splittable``) of one
    dtype with streaming stores, those that convert with ``copy_``."""
    for dst, src in pieces:
        if stream and dst.dtype == src.dtype:
            stream_copy.copy(dst, src)
        else:
            dst.copy_(src)


@torch.no_grad()
def copy_all(pairs: Sequence[Pair]) -> None:
    """``dst.copy_(src)`` for every pair, the large CPU ones split over ``threads()`` threads.
    Returns when every copy is done; raises the first failure after all have ended."""
    if (sum(dst.numel() for dst, _ in pairs) < 2 * MIN_PIECE
            and sum(dst.numel() * dst.element_size() for dst, _ in pairs) < STREAMING_BYTES):
        _run(list(pairs))  # nothing to split or stream: the many small tensors' path, kept short
        return
    splittable = [_splittable(dst, src) for dst, src in pairs]
    large = [pair for pair, split in zip(pairs, splittable) if split]
    total = sum(dst.numel() for dst, _ in large)
    stream = (sum(dst.numel() * dst.element_size() for dst, _ in large) >= STREAMING_BYTES
              and stream_copy.available())
    parts = min(threads(), total // MIN_PIECE)
    rest = [pair for pair, split in zip(pairs, splittable) if not split]
    if parts < 2:
        _run(rest)
        _run(large, stream)
        return
    # The large copies' elements laid end to end, cut into `parts` equal shares.
    share = -(-total // parts)
    work: List[List[Pair]] = [[] for _ in range(parts)]
    at = 0
    for dst, src in large:
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        begin, numel = 0, flat_dst.numel()
        while begin < numel:
            k = (at + begin) // share
            end = min(numel, (k + 1) * share - at)
            work[k].append((flat_dst[begin:end], flat_src[begin:end]))
            begin = end
        at += numel
    pool = _executor(parts - 1)
    futures = [pool.submit(_run, pieces, stream) for pieces in work[1:]]
    try:
        _run(rest)
        _run(work[0], stream)
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()  # raises a worker's failure
