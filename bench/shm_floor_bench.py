"""An element-wise session over shared memory against its copy floor: opt.step() wall time over the
daemon's own compute time for AdamW sessions of 16 M, 64 M (and with --large 256 M) parameters,
through the ordinary shm transport and with shm_zero_copy, from the Python client against the real
daemon (--backend cpu, loopback, --threads as given).

The floor is the bytes each path must move per parameter over AdamW's own: AdamW reads and writes
28 bytes per fp32 parameter (parameter, gradient, two moments); the ordinary path adds four copies
of 8 bytes (the client's gradient into the region, the daemon's read of it with its sum of squares,
the daemon's write of the parameter, the client's copy out): 60 / 28 = 2.14; zero copy keeps the
daemon's two: 44 / 28 = 1.57. Targets: 2.3 and 1.7. Also printed: this machine's copy bandwidth
(torch copy_ of the same size) and the daemon's AdamW rate in ns per parameter.

    python3 bench/shm_floor_bench.py [--binary build/muond] [--threads 2] [--reps 6] [--large]
"""

import argparse
import statistics
import sys
import time

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon

FLOOR = {False: 60 / 28, True: 44 / 28}
TARGET = {False: 2.3, True: 1.7}


def copy_bandwidth(n: int) -> float:
    """GB/s (read + write) of torch's copy_ of `n` fp32 values, the best of five."""
    src, dst = torch.randn(n), torch.empty(n)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 8 * n / best / 1e9


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--large", action="store_true", help="also 256 M parameters (about 8 GiB in all)")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    sizes = [16_000_000, 64_000_000] + ([256_000_000] if args.large else [])
    print(f"AdamW over shm; daemon --threads {args.threads or 'all'}, torch {torch.get_num_threads()} threads; "
          f"copy bandwidth {copy_bandwidth(sizes[0]):.1f} GB/s (torch copy_, read + write)")
    print(f"  {'params':>8} {'path':<10}{'step ms':>9}{'compute ms':>12}{'ns/param':>10}{'ratio':>7}"
          f"{'floor':>7}{'target':>8}")
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        for n in sizes:
            for zero_copy in (False, True):
                torch.manual_seed(0)
                param = torch.nn.Parameter(torch.randn(n) * 0.02)
                param.grad = torch.randn(n) * 1e-3
                with muond.RemoteOptimizer([{"params": [param], "optimizer": "adamw"}], endpoint=endpoint,
                                           transport="shm", shm_zero_copy=zero_copy) as opt:
                    walls, computes = [], []
                    for i in range(args.reps + 1):
                        wall = _timed(opt.step)
                        if i:
                            walls.append(wall)
                            computes.append(opt.last_info.compute_seconds)
                wall, compute = statistics.median(walls), statistics.median(computes)
                ratio = wall / compute
                print(f"  {n / 1e6:7.0f}M {'zero copy' if zero_copy else 'copies':<10}{wall * 1e3:9.1f}"
                      f"{compute * 1e3:12.1f}{compute / n * 1e9:10.2f}{ratio:7.2f}{FLOOR[zero_copy]:7.2f}"
                      f"{TARGET[zero_copy]:8.1f}{'' if ratio <= TARGET[zero_copy] else '  (not met)'}", flush=True)
                del param, opt


if __name__ == "__main__":
    main()
