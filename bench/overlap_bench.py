"""Overlap and delay across a slow link: iteration time of local torch, a remote step, a remote step
with overlap=True, with overlap=True and land_in_forward, with delay=1 and with overlap and delay,
against the real CPU daemon behind a rate-limited link (docs/overlap.md).

The daemon runs in its own network namespace, reached over a veth pair whose both ends are limited
with `tc qdisc ... tbf` to --rate (netem is not needed: tbf shapes the rate, which is what a slow
link between a trainer and its optimizer daemon is about). The trainer is this process, on the
host side, over gRPC. The model is an MLP of --layers square matrices of --width (AdamW on every
parameter, one group, so that the daemon's compute stays small beside the transfer and its answer
comes back in forward order) trained on random batches of --batch rows; by default the batch is
chosen here so that backward takes as long as sending the gradients over the measured link
(backward's time per row is measured first).

Pinning (unless --no-pin, with two CPUs or more): this process — the trainer, torch's threads
(its BLAS may start one per CPU it can use) and gRPC's threads — runs on the first CPU it may
use, the daemon (started under `taskset`) on the second. The daemon stands for a machine across
the link: unpinned, on a two-CPU machine, its work takes CPU time from backward while the
gradients arrive, which a trainer whose daemon is elsewhere does not pay. The trainer's own
sending (framing the chunks, its gRPC threads) stays on the trainer's CPU, as it would there;
"to bwd end" shows what it costs backward. --no-pin measures the shared case.

Other work on the machine slows whatever runs beside it, so the modes take turns: --rounds rounds,
each running every mode for one untimed iteration and --iters timed ones in a row (an iteration
begins while the last one's parameters may still be landing, as in training); each figure is the
median over the rounds, and each ratio the median of the ratios within a round. The load average
is printed at the start and at the end.

Printed, from the same run:
  - what is pinned where, and the load average;
  - the link's measured throughput (a raw TCP transfer across the same veth pair);
  - forward + backward alone, and a remote step alone (transfer + daemon compute + transfer);
  - each mode's iteration time, its ratio to the plain remote iteration, the time inside
    step() and the time from the iteration's start to the end of backward (with overlap, what
    sending the gradients costs backward; with land_in_forward, what the forward waited);
  - the targets: overlap <= 0.75 x remote; delay <= 1.15 x max(fwd+bwd, transfer+compute).

Needs root (ip netns, tc); without it, or without tbf, it says why and exits 0 having measured
nothing. Usage: sudo python3 bench/overlap_bench.py [--rate 1gbit] [--rounds 5] [--iters 5] [--no-pin]
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_daemon import cpu_daemon

REPO = Path(__file__).resolve().parents[1]
NS = f"muondbench{os.getpid()}"
HOST_IF, NS_IF = f"mb{os.getpid()}a", f"mb{os.getpid()}b"
HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"


def run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def shaped_namespace(rate: str):
    """A network namespace behind a veth pair shaped to `rate` both ways; removed after."""
    try:
        run("ip", "netns", "add", NS)
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        raise SystemExit(f"overlap_bench: skipped: cannot make a network namespace (needs root and "
                         f"iproute2): {getattr(err, 'stderr', err)}") from None
    try:
        run("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        run("ip", "link", "set", NS_IF, "netns", NS)
        run("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        run("ip", "link", "set", HOST_IF, "up")
        run("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        run("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        run("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        shape = ["root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"]
        try:
            run("tc", "qdisc", "add", "dev", HOST_IF, *shape)
            run("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", NS_IF, *shape)
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"overlap_bench: skipped: tc tbf is not available: {err.stderr}") from None
        yield
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


def link_throughput(megabytes: int = 64) -> float:
    """GB/s of a raw TCP transfer from the namespace to this side."""
    server = socket.socket()
    server.bind((HOST_IP, 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def receive():
        conn, _ = server.accept()
        with conn:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    return
                received[0] += len(data)

    thread = threading.Thread(target=receive)
    thread.start()
    sender = ("import socket,sys;s=socket.create_connection((sys.argv[1],int(sys.argv[2])));"
              "b=bytes(1<<20);[s.sendall(b) for _ in range(int(sys.argv[3]))];s.close()")
    started = time.perf_counter()
    run("ip", "netns", "exec", NS, sys.executable, "-c", sender, HOST_IP, str(port), str(megabytes))
    thread.join()
    seconds = time.perf_counter() - started
    server.close()
    return received[0] / seconds / 1e9


@contextlib.contextmanager
def daemon_in_namespace(binary: Path, threads: int, prefix=()):
    """The daemon in the namespace, its command line after `prefix` (taskset); its endpoint."""
    with cpu_daemon(binary, threads, ["--shm-socket", "none"], prefix=["ip", "netns", "exec", NS, *prefix],
                    host=NS_IP) as (_, endpoint):
        yield endpoint


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def loss_of(model, batch, width, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch, width, generator=gen)
    return F.mse_loss(model(x), torch.zeros(batch, width))


def backward_per_row(width: int, layers: int, rows: int = 256) -> float:
    """Seconds of backward per batch row (the median of five)."""
    model = make_model(width, layers)
    times = []
    for step in range(6):
        loss = loss_of(model, rows, width, step)
        started = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - started)
        model.zero_grad()
    return sorted(times[1:])[2] / rows


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (other work on the machine shows there)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def pin_this_process(cpu: int) -> None:
    """Every thread of this process, and so every thread it starts later (gRPC's, torch's), on
    `cpu` alone."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), {cpu})


class Mode:
    """One way of training, its model and optimizer kept over the rounds. `one(step)` is an
    iteration; `blocks` collects the mean iteration of each round's block, `in_step` and
    `to_backward_end` the time inside step() and from the iteration's start to the end of
    backward, of every iteration."""

    def __init__(self, name, one, settle=lambda: None, close=lambda: None):
        self.name, self.one, self.settle, self.close = name, one, settle, close
        self.blocks, self.in_step, self.to_backward_end = [], [], []


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the link, each way")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=0,
                        help="rows per batch (0: backward as long as the gradients' transfer)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every mode")
    parser.add_argument("--threads", type=int, default=1, help="the daemon's --threads")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the trainer and the daemon free to share every CPU")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) >= 2
    if pinned:
        trainer_cpu, daemon_cpu = cpus[0], cpus[1]
        pin_this_process(trainer_cpu)  # before gRPC starts any thread
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    params = args.width * args.width * args.layers
    print(f"overlap_bench: MLP {args.layers} x {args.width}^2 = {params / 1e6:.1f} M params "
          f"({4 * params / 1e6:.0f} MB of fp32 gradients), AdamW; link "
          f"{args.rate} each way (tc tbf); torch {torch.__version__}, {torch.get_num_threads()} threads")
    if pinned:
        print(f"  pinned: the trainer (torch, its gRPC threads) on CPU {trainer_cpu}, the daemon "
              f"(--threads {args.threads}) on CPU {daemon_cpu}: the daemon stands for a machine "
              f"across the link, so it takes no CPU from backward")
    else:
        print(f"  not pinned: the trainer and the daemon (--threads {args.threads}) share CPUs "
              f"{','.join(map(str, cpus))}")
    print(f"  load average at start: {loadavg()}")
    with shaped_namespace(args.rate):
        gbps = link_throughput()
        transfer = 4 * params / gbps / 1e9
        print(f"  link, raw TCP:            {gbps:.3f} GB/s (gradients one way: {transfer * 1e3:.0f} ms)")
        if args.batch == 0:
            args.batch = max(16, round(transfer / backward_per_row(args.width, args.layers)))
            print(f"  batch {args.batch}: backward about as long as the gradients' transfer")
        prefix = ["taskset", "-c", str(daemon_cpu)] if pinned else []
        with daemon_in_namespace(args.binary, args.threads, prefix) as endpoint:
            modes = [local_mode("forward + backward", args, None),
                     local_mode("local torch AdamW", args, torch.optim.AdamW)]
            for name, kwargs in (("remote", {}), ("remote, overlap", {"overlap": True}),
                                 ("remote, overlap + land", {"overlap": True, "land": True}),
                                 ("remote, delay=1", {"delay": 1}),
                                 ("remote, overlap + delay", {"overlap": True, "delay": 1})):
                modes.append(remote_mode(name, args, muond, endpoint, **kwargs))
            try:
                for _ in range(args.rounds):
                    for mode in modes:
                        run_block(mode, args.iters)
            finally:
                for mode in modes:
                    mode.close()
    report(modes, args)
    print(f"  load average at end: {loadavg()}")


def run_block(mode: Mode, iters: int) -> None:
    """One untimed iteration, then `iters` timed ones in a row (each begins while the last one's
    step may still be landing, as in training); what is in flight is settled after, untimed."""
    mode.one(0)
    started = time.perf_counter()
    for step in range(1, 1 + iters):
        mode.one(step)
    mode.blocks.append((time.perf_counter() - started) / iters)
    mode.settle()


def local_mode(name, args, optimizer) -> Mode:
    model = make_model(args.width, args.layers)
    opt = optimizer(model.parameters(), lr=1e-3) if optimizer is not None else None
    mode = Mode(name, None)

    def one(step):
        started = time.perf_counter()
        loss_of(model, args.batch, args.width, step).backward()
        mode.to_backward_end.append(time.perf_counter() - started)
        if opt is not None:
            opt.step()
        model.zero_grad()
    mode.one = one
    return mode


def remote_mode(name, args, muond, endpoint, land=False, **kwargs) -> Mode:
    model = make_model(args.width, args.layers)
    if land:
        kwargs["land_in_forward"] = model
    opt = muond.RemoteOptimizer([{"params": list(model.parameters()), "optimizer": "adamw",
                                  "lr": 1e-3}], endpoint=endpoint, transport="grpc", **kwargs)
    mode = Mode(name, None, opt.flush, opt.close)

    def one(step):
        started = time.perf_counter()
        loss_of(model, args.batch, args.width, step).backward()
        backward_end = time.perf_counter()
        opt.step()
        mode.in_step.append(time.perf_counter() - backward_end)
        mode.to_backward_end.append(backward_end - started)
        opt.zero_grad()
    mode.one = one
    return mode


def report(modes, args) -> None:
    by_name = {mode.name: mode for mode in modes}
    plain = by_name["remote"]
    timed = args.iters  # per block; the untimed first iteration of each block is left out

    def inside(values):
        kept = [v for k, v in enumerate(values) if k % (timed + 1)]  # drop each block's first
        return median(kept) if kept else None
    fwd_bwd = median(by_name["forward + backward"].blocks)
    step_alone = inside(plain.in_step)
    print(f"  {args.rounds} rounds of every mode in turn, {args.iters} timed iterations each; "
          f"medians over the rounds")
    print(f"  forward + backward:       {fwd_bwd * 1e3:8.1f} ms")
    print(f"  remote step alone:        {step_alone * 1e3:8.1f} ms (transfer + daemon compute + transfer)")
    print(f"  {'mode':<26}{'ms/iter':>9}{'x remote':>10}{'in step()':>12}{'to bwd end':>12}")
    ratios = {}
    for mode in modes[1:]:
        seconds = median(mode.blocks)
        ratios[mode.name] = median([b / p for b, p in zip(mode.blocks, plain.blocks)])
        in_step = inside(mode.in_step)
        step_text = "" if in_step is None else f"{in_step * 1e3:9.1f} ms"
        print(f"  {mode.name:<26}{seconds * 1e3:9.1f}{ratios[mode.name]:10.2f}{step_text:>12}"
              f"{inside(mode.to_backward_end) * 1e3:9.1f} ms")
    bound = max(fwd_bwd, step_alone)
    delay = median(by_name["remote, delay=1"].blocks)
    for name in ("remote, overlap", "remote, overlap + land"):
        print(f"  target {name} <= 0.75 x remote: {ratios[name]:.2f} "
              f"({'met' if ratios[name] <= 0.75 else 'not met'})")
    print(f"  target delay <= 1.15 x max(fwd+bwd, step) = {1.15 * bound * 1e3:.1f} ms: "
          f"{delay * 1e3:.1f} ms ({'met' if delay <= 1.15 * bound else 'not met'})")


if __name__ == "__main__":
    main()
