"""How the tests start their rank and worker processes: one process per rank, as trainers run them,
but forked from a fork server that has imported torch once, instead of spawned interpreters that
import it each (about 2 CPU-seconds a process on the 2-core build machine: the five files that
start ranks took 292 s over gRPC so, 90 s forked).

The fork server imports torch and nothing else: it opens no CUDA device and no gRPC channel (the
BLAS library's threads, which torch's import starts, are forked safely by the library's own fork
handler), so each child begins as a spawned one would (its own gRPC channel, its own device), only
without the import. The child unpickles its target as under spawn (the test module is imported
there), so targets and arguments are what `spawn` takes. The children inherit the fork server's
environment as it was when the first rank_context() call of the test process started it: a variable
a test sets later reaches its ranks only through their arguments. Safe from any thread of the test.
"""

import multiprocessing

import torch.multiprocessing

_PRELOAD = ["torch"]


def rank_context():
    """The multiprocessing context to start rank processes from (Process, Queue, Pipe, Event...)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts, the first time
    return context


def run_rank_processes(target, args, nprocs):
    """torch.multiprocessing.spawn's call (``target(rank, *args)`` in each of ``nprocs`` processes,
    joined, a failure raised), from the same fork server."""
    rank_context()
    torch.multiprocessing.start_processes(target, args=args, nprocs=nprocs, join=True, start_method="forkserver")
