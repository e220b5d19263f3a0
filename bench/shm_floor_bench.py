"""An element-wise session over shared memory against its copy floor: opt.step() wall time over the
daemon's own compute time for AdamW sessions of 16 M, 64 M (and with --large 256 M) parameters,
through the ordinary shm transport and with shm_zero_copy, from the Python client against the real
daemon (--backend cpu, loopback, --threads as given).

The floor is the bytes each path must move per parameter over AdamW's own: AdamW reads and writes
28 bytes per fp32 parameter (parameter, gradient, two moments); the ordinary path adds four copies
of 8 bytes (the client's gradient into the region, the daemon's read of it with its sum of squares,
the daemon's write of the parameter, the client's copy out): 60 / 28 = 2.14; zero copy keeps the
daemon's two: 44 / 28 = 1.57. Targets: 2.3 and 1.7. Also printed: the machine and its load, this
machine's copy bandwidth (torch copy_ of the same size, on torch's threads and split over the
client's copy threads) and the daemon's AdamW rate in ns per parameter.

Those floors count bytes as if a copy's moved as fast as AdamW's; on machines where copies (half
writes) run slower than AdamW (mostly reads), the time the copies must take is more. "bw floor" is
that time: the run's AdamW compute plus each copy of the path (4 or 2, 8 bytes a parameter) at the
bandwidth of the client's copies of that size, measured just before (the daemon's copies stream the
same way on as many threads), over the compute.

--phases splits each step (medians, ms): the client's side (its copies into and out of the region
and its Python: opt.step() less the StepShared call), the call's own cost (gRPC and the handler: the
call less the daemon's phases) and the daemon's phases from its metrics (--metrics-listen): receive
(the gradients copied out of the region with their sums of squares), compute (AdamW), send (the
parameters written into the region).

    python3 bench/shm_floor_bench.py [--binary build/muond] [--threads 2] [--reps 10] [--large] [--phases]
"""

import argparse
import os
import re
import statistics
import sys
import time
import urllib.request

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon, free_port

FLOOR = {False: 60 / 28, True: 44 / 28}
COPIES = {False: 4, True: 2}  # copies of 8 bytes a parameter each path adds to AdamW's 28
TARGET = {False: 2.3, True: 1.7}
PHASES = ("receive", "compute", "send")


def copy_bandwidth(n: int, copy) -> float:
    """GB/s (read + write) of `copy(dst, src)` of `n` fp32 values, the best of five."""
    src, dst = torch.randn(n), torch.empty(n)
    best = min(_timed(lambda: copy(dst, src)) for _ in range(5))
    return 8 * n / best / 1e9


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def machine() -> str:
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs, load {load}"



def phase_sums(port: int) -> dict:
    """The daemon's shm phase totals so far, seconds."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    sums = {}
    for phase in PHASES:
        found = re.search(r'muond_step_phase_duration_seconds_sum\{phase="%s",transport="shm"\} (\S+)' % phase, text)
        sums[phase] = float(found.group(1)) if found else 0.0
    return sums


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--large", action="store_true", help="also 256 M parameters (about 8 GiB in all)")
    parser.add_argument("--phases", action="store_true", help="split each step into the client's, the call's "
                        "and the daemon's phases")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set
    from muond.transport import host_copy, shm_transport  # noqa: E402

    # The StepShared call, timed around the transport's send (--phases).
    calls = []
    send = shm_transport.ShmTransport.send

    def timed_send(self, request):
        started = time.perf_counter()
        try:
            return send(self, request)
        finally:
            calls.append(time.perf_counter() - started)

    shm_transport.ShmTransport.send = timed_send

    from muond.transport import stream_copy  # noqa: E402
    streaming = (f"streaming ({stream_copy.kind()})" if stream_copy.available()
                 else f"not streaming ({stream_copy.reason()})")
    sizes = [16_000_000, 64_000_000] + ([256_000_000] if args.large else [])
    print(f"machine: {machine()}")
    client_copies = lambda d, s: host_copy.copy_all([(d, s)])  # noqa: E731
    first_copy_gbs = copy_bandwidth(sizes[0], client_copies)
    print(f"AdamW over shm; daemon --threads {args.threads or 'all'}, torch {torch.get_num_threads()} threads, "
          f"client copies on {host_copy.threads()}, {streaming}; copy bandwidth {copy_bandwidth(sizes[0], torch.Tensor.copy_):.1f} "
          f"GB/s (torch copy_), {first_copy_gbs:.1f} GB/s "
          f"(the client's copies), read + write")
    print(f"  {'params':>8} {'path':<10}{'step ms':>9}{'compute ms':>12}{'ns/param':>10}{'ratio':>7}"
          f"{'floor':>7}{'bw floor':>10}{'target':>8}")
    port = free_port()
    extra = ["--metrics-listen", f"127.0.0.1:{port}"] if args.phases else []
    with cpu_daemon(args.binary, args.threads, extra) as (_, endpoint):
        for n in sizes:
            copy_gbs = first_copy_gbs if n == sizes[0] else copy_bandwidth(n, client_copies)
            for zero_copy in (False, True):
                torch.manual_seed(0)
                param = torch.nn.Parameter(torch.randn(n) * 0.02)
                param.grad = torch.randn(n) * 1e-3
                with muond.RemoteOptimizer([{"params": [param], "optimizer": "adamw"}], endpoint=endpoint,
                                           transport="shm", shm_zero_copy=zero_copy) as opt:
                    walls, computes, rpcs, daemon = [], [], [], {phase: [] for phase in PHASES}
                    for i in range(args.reps + 1):
                        before = phase_sums(port) if args.phases else None
                        calls.clear()
                        wall = _timed(opt.step)
                        if i:
                            walls.append(wall)
                            computes.append(opt.last_info.compute_seconds)
                            rpcs.append(sum(calls))
                            if args.phases:
                                after = phase_sums(port)
                                for phase in PHASES:
                                    daemon[phase].append(after[phase] - before[phase])
                wall, compute = statistics.median(walls), statistics.median(computes)
                ratio = wall / compute
                bw_floor = (compute + COPIES[zero_copy] * 8 * n / (copy_gbs * 1e9)) / compute
                print(f"  {n / 1e6:7.0f}M {'zero copy' if zero_copy else 'copies':<10}{wall * 1e3:9.1f}"
                      f"{compute * 1e3:12.1f}{compute / n * 1e9:10.2f}{ratio:7.2f}{FLOOR[zero_copy]:7.2f}"
                      f"{bw_floor:10.2f}{TARGET[zero_copy]:8.1f}{'' if ratio <= TARGET[zero_copy] else '  (not met)'}", flush=True)
                if args.phases:
                    client = statistics.median(w - r for w, r in zip(walls, rpcs))
                    own = statistics.median(r - sum(p) for r, *p in zip(rpcs, *daemon.values()))
                    parts = " ".join(f"{phase} {statistics.median(daemon[phase]) * 1e3:.1f}" for phase in PHASES)
                    print(f"             ms: client {client * 1e3:.1f}, call {own * 1e3:.1f}, daemon {parts}; "
                          f"copies at {copy_gbs:.1f} GB/s", flush=True)
                del param, opt


if __name__ == "__main__":
    main()
