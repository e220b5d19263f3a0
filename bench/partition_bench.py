"""Ranks that hold parts against replicated ranks: bytes on the wire per rank and step, step time
and daemon memory, against the real CPU daemon (docs/ranks.md, Ranks that hold parts).

N rank processes (--ranks, default "2,4") share one session on a fresh `muond --backend cpu` over
loopback gRPC. The model: --matrices Muon matrices of --dim x --dim (default 8 of 1024²) and an
AdamW embedding of --vocab x --dim/4. Modes:

  replicated  every rank sends the whole gradient and receives the whole parameters (today's
              data-parallel ranks; the daemon averages)
  rows        the matrices and the embedding cut by rows (DTensor Shard(0), FSDP2)
  flat        each group flattened and cut into N equal ranges (ZeRO)

Each rank steps --warmup untimed steps, then --steps timed ones; rank 0 times its opt.step() (the
median is printed). Printed per mode:

  sent, received   the daemon's own step byte counters (muond_step_received_bytes_total and
                   muond_step_sent_bytes_total, gRPC framing included) per rank and step, and their
                   ratio to replicated's with the target 1/N + 1%
  step ms          rank 0's median opt.step() time; target: <= replicated
  daemon MiB       the daemon's peak resident memory (VmHWM) above its resident memory once the
                   session was open and the ranks' parts uploaded (idle); target: <= replicated + one
                   step's whole gradient (printed)

    python3 bench/partition_bench.py [--binary build/muond] [--ranks 2,4] [--dim 1024] [--matrices 8]
        [--vocab 8192] [--steps 3] [--warmup 1] [--threads 0]
"""

import argparse
import io
import multiprocessing
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from bench_daemon import REPO, cpu_daemon, free_port  # noqa: E402

sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
import muond  # noqa: E402
from muond import partition  # noqa: E402

MODES = ("replicated", "rows", "flat")


def shapes(args):
    muon = [(args.dim, args.dim)] * args.matrices
    return muon, [(args.vocab, args.dim // 4)]


def whole(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _rank(rank, world, mode, endpoint, session, args, ready, out):
    torch.set_num_threads(1)
    try:
        muon, adam = shapes(args)
        groups = []
        for k, (group_shapes, options) in enumerate(((muon, {}), (adam, {"optimizer": "adamw"}))):
            rule = None if mode == "replicated" else partition.rows(group_shapes) if mode == "rows" else \
                partition.flat(group_shapes)
            params = []
            for i, shape in enumerate(group_shapes):
                value = whole(shape, 100 * k + i)
                local = value if rule is None else partition.cut(value, rule, i, world, rank)
                params.append((f"g{k}.p{i}", local.clone().requires_grad_()))
            group = {"params": params, **options}
            if rule is not None:
                group["partition"] = rule
            groups.append(group)
        opt = muond.RemoteOptimizer(groups, endpoint=endpoint, session=session, world_size=world, rank=rank,
                                    transport="grpc")
        ready.wait()
        times = []
        for step in range(args.warmup + args.steps):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.full_like(p, 1e-3 * (step + 1))
            start = time.perf_counter()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        opt.close()
        out.put((rank, "ok", statistics.median(times)))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        out.put((rank, "error", repr(err)))


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("muond_step_received_bytes_total", "muond_step_sent_bytes_total")) and \
                'transport="grpc"' in line:
            values[line.split("{")[0]] = float(line.split()[-1])
    return values


def status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def run(args, world, mode):
    port = free_port()
    context = multiprocessing.get_context("spawn")
    with cpu_daemon(args.binary, args.threads, ["--metrics-listen", f"127.0.0.1:{port}"]) as (proc, endpoint):
        ready = context.Barrier(world + 1)
        out = context.Queue()
        session = f"bench-{uuid.uuid4().hex[:6]}"
        ranks = [context.Process(target=_rank, args=(r, world, mode, endpoint, session, args, ready, out))
                 for r in range(world)]
        for r in ranks:
            r.start()
        ready.wait()  # every rank's session is open and its parameters uploaded
        before = scrape(port)
        idle_kib = status_kib(proc.pid, "VmRSS")
        results = [out.get(timeout=1800) for _ in ranks]
        for r in ranks:
            r.join()
        after = scrape(port)
        peak_kib = status_kib(proc.pid, "VmHWM")
    for rank, status, body in results:
        if status != "ok":
            raise RuntimeError(f"rank {rank}: {body}")
    steps = (args.warmup + args.steps) * world
    received = (after["muond_step_received_bytes_total"] - before["muond_step_received_bytes_total"]) / steps
    sent = (after["muond_step_sent_bytes_total"] - before["muond_step_sent_bytes_total"]) / steps
    step_ms = 1e3 * next(body for rank, _, body in results if rank == 0)
    return {"sent": received, "received": sent, "step_ms": step_ms, "daemon_mib": (peak_kib - idle_kib) / 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--matrices", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    muon, adam = shapes(args)
    elements = sum(a * b for a, b in muon + adam)
    gradient_mib = elements * 4 / 2 ** 20
    print(f"{args.matrices} Muon matrices {args.dim}x{args.dim} + AdamW {args.vocab}x{args.dim // 4}: "
          f"{elements:,} parameters, one whole fp32 gradient {gradient_mib:.1f} MiB; gRPC on loopback, "
          f"{args.steps} timed steps after {args.warmup}")
    print(f"{'ranks':>5} {'mode':>10} {'sent MiB':>9} {'recv MiB':>9} {'vs repl':>8} {'target':>7} "
          f"{'step ms':>8} {'vs repl':>8} {'daemon MiB':>11} {'target':>8}")
    for world in (int(n) for n in args.ranks.split(",")):
        base = None
        for mode in MODES:
            r = run(args, world, mode)
            base = base or r
            ratio = max(r["sent"] / base["sent"], r["received"] / base["received"])
            target = 1 / world + 0.01 if mode != "replicated" else 1.0
            print(f"{world:>5} {mode:>10} {r['sent'] / 2**20:>9.2f} {r['received'] / 2**20:>9.2f} {ratio:>8.3f} "
                  f"{target:>7.3f} {r['step_ms']:>8.1f} {r['step_ms'] / base['step_ms']:>8.2f} "
                  f"{r['daemon_mib']:>11.1f} {base['daemon_mib'] + gradient_mib:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
