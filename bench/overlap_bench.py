"""Overlap and delay across a slow link: iteration time of local torch, a remote step, a remote step
with overlap=True, with delay=1 and with both, against the real CPU daemon behind a rate-limited
link (docs/overlap.md).

The daemon runs in its own network namespace, reached over a veth pair whose both ends are limited
with `tc qdisc ... tbf` to --rate (netem is not needed: tbf shapes the rate, which is what a slow
link between a trainer and its optimizer daemon is about). The trainer is this process, on the
host side, over gRPC. The model is an MLP of --layers square matrices of --width (AdamW on every
parameter, so that the daemon's compute stays small beside the transfer) trained on random batches
of --batch rows; by default the batch is chosen here so that backward takes as long as sending the
gradients over the measured link (backward's time per row is measured first).

Printed, from the same run:
  - the link's measured throughput (a raw TCP transfer across the same veth pair);
  - forward + backward alone, and a remote step alone (transfer + daemon compute + transfer);
  - each mode's mean iteration time and its ratio to the plain remote iteration;
  - the targets: overlap <= 0.75 x remote; delay <= 1.15 x max(fwd+bwd, transfer+compute).

Needs root (ip netns, tc); without it, or without tbf, it says why and exits 0 having measured
nothing. Usage: sudo python3 bench/overlap_bench.py [--rate 1gbit] [--iters 12]
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

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
def daemon_in_namespace(binary: Path, threads: int):
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(["ip", "netns", "exec", NS, str(binary), "--listen", f"{NS_IP}:0",
                                 "--port-file", str(port_file), "--backend", "cpu", "--threads",
                                 str(threads), "--log-level", "warn", "--shm-socket", "none"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("muond did not start in the namespace")
                time.sleep(0.02)
            yield f"{NS_IP}:{int(port_file.read_text())}"
        finally:
            proc.terminate()
            proc.wait()


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


def timed(iters, one) -> float:
    """Mean seconds of `one(step)` over `iters`, after two untimed iterations."""
    for step in range(2):
        one(step)
    started = time.perf_counter()
    for step in range(2, 2 + iters):
        one(step)
    return (time.perf_counter() - started) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the link, each way")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=0,
                        help="rows per batch (0: backward as long as the gradients' transfer)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="the daemon's --threads")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    params = args.width * args.width * args.layers
    print(f"overlap_bench: MLP {args.layers} x {args.width}^2 = {params / 1e6:.1f} M params "
          f"({4 * params / 1e6:.0f} MB of fp32 gradients), AdamW; link "
          f"{args.rate} each way (tc tbf); torch {torch.__version__}, {torch.get_num_threads()} threads")
    with shaped_namespace(args.rate):
        gbps = link_throughput()
        transfer = 4 * params / gbps / 1e9
        print(f"  link, raw TCP:            {gbps:.3f} GB/s (gradients one way: {transfer * 1e3:.0f} ms)")
        if args.batch == 0:
            args.batch = max(16, round(transfer / backward_per_row(args.width, args.layers)))
            print(f"  batch {args.batch}: backward about as long as the gradients' transfer")

        def local_torch():
            model = make_model(args.width, args.layers)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def one(step):
                loss_of(model, args.batch, args.width, step).backward()
                opt.step()
                opt.zero_grad()
            return timed(args.iters, one)

        def forward_backward():
            model = make_model(args.width, args.layers)

            def one(step):
                loss_of(model, args.batch, args.width, step).backward()
                model.zero_grad()
            return timed(args.iters, one)

        fwd_bwd = forward_backward()
        local = local_torch()
        with daemon_in_namespace(args.binary, args.threads) as endpoint:
            def remote(**kwargs):
                model = make_model(args.width, args.layers)
                opt = muond.RemoteOptimizer([{"params": list(model.parameters()), "optimizer": "adamw",
                                              "lr": 1e-3}], endpoint=endpoint, transport="grpc", **kwargs)
                step_seconds = []

                def one(step):
                    loss_of(model, args.batch, args.width, step).backward()
                    started = time.perf_counter()
                    opt.step()
                    step_seconds.append(time.perf_counter() - started)
                    opt.zero_grad()
                try:
                    return timed(args.iters, one), sum(step_seconds[2:]) / args.iters
                finally:
                    opt.close()

            plain, step_alone = remote()
            overlap, overlap_step = remote(overlap=True)
            delay, delay_step = remote(delay=1)
            both, both_step = remote(overlap=True, delay=1)
        bound = max(fwd_bwd, step_alone)
        print(f"  forward + backward:       {fwd_bwd * 1e3:8.1f} ms")
        print(f"  remote step alone:        {step_alone * 1e3:8.1f} ms (transfer + daemon compute)")
        print(f"  {'mode':<24}{'ms/iter':>10}{'x remote':>10}{'in step()':>12}")
        for name, seconds, in_step in (("local torch", local, None), ("remote", plain, step_alone),
                                       ("remote, overlap", overlap, overlap_step),
                                       ("remote, delay=1", delay, delay_step),
                                       ("remote, overlap + delay", both, both_step)):
            inside = "" if in_step is None else f"{in_step * 1e3:10.1f} ms"
            print(f"  {name:<24}{seconds * 1e3:10.1f}{seconds / plain:10.2f}{inside:>12}")
        print(f"  target overlap <= 0.75 x remote: {overlap / plain:.2f} "
              f"({'met' if overlap <= 0.75 * plain else 'not met'})")
        print(f"  target delay <= 1.15 x max(fwd+bwd, step) = {1.15 * bound * 1e3:.1f} ms: "
              f"{delay * 1e3:.1f} ms ({'met' if delay <= 1.15 * bound else 'not met'})")


if __name__ == "__main__":
    main()
