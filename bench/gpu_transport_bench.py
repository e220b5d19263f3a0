"""The step exchange of CUDA parameters over each transport, against a device-to-device copy of the
same bytes.

Starts the real muond (--backend cuda, on --daemon-device) on loopback, and with two or more GPUs a
second one on --nccl-daemon-device for NCCL (NCCL refuses two ranks on one GPU). For each total
size (--sizes-m, in millions of fp32 elements, spread over --tensors tensors on --device), a plain
SGD session with a tiny lr (so the daemon's compute is negligible) is stepped --warmup times and then
--steps timed times per transport; a step's time is opt.step() up to torch.cuda.synchronize() (the
parameters are in place on the device). Printed per size, as medians: the copy figure (the
gradients to the daemon's device and the parameters back, two torch copies of the same bytes: what
any transport has to move), each transport's step, the daemon's compute time, and for cuda_ipc the
ratio copy / step (target: at least 0.8). Then, per size and transport, where a step's time went:
the daemon's handler of the call that carried it and its phases (receive: the gradients, for CUDA
IPC the wait for the client's event; compute; send: the answer, for CUDA IPC the final
synchronize), as means from the daemon's metrics (daemon_metrics.py), and the rest (the client and
the call): the floor under that rest is one empty gRPC round trip to the same daemon (GetServerInfo),
and --profile STEPS more cuda_ipc steps are profiled by function (client_profile.py) to show which
parts of the client's own step it spends.

    python3 bench/gpu_transport_bench.py [--binary build/muond] [--sizes-m 1 16 64] [--steps 20] [--profile 100]
"""

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import client_profile
import daemon_metrics
from bench_daemon import free_port

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def cuda_daemon(binary: Path, device: int):
    """Yields (the endpoint, the metrics port) of `muond --backend cuda --device DEVICE` on free
    loopback ports."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        log = Path(tmp) / "muond.log"
        metrics_port = free_port()
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(binary), "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                                     "--backend", "cuda", "--device", str(device), "--log-level", "warn",
                                     "--metrics-listen", f"127.0.0.1:{metrics_port}"],
                                    stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 60
                while not (port_file.exists() and port_file.read_text().strip()):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"muond --backend cuda --device {device} did not start:\n"
                                           + log.read_text(errors="replace")[-4000:])
                    time.sleep(0.02)
                yield f"127.0.0.1:{int(port_file.read_text())}", metrics_port
            finally:
                proc.terminate()
                proc.wait()


def make_params(total: int, tensors: int, device: torch.device):
    """`tensors` fp32 parameters of about total / tensors elements each, with gradients."""
    each = max(1, total // tensors)
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for i in range(tensors):
        n = each if i < tensors - 1 else total - each * (tensors - 1)
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
        p.grad = torch.randn(n, generator=gen).to(device) * 1e-3
        params.append(p)
    return params


def median_seconds(fn, warmup: int, steps: int, device: torch.device, timed_start=lambda: None):
    """The median time of `steps` calls of `fn` after `warmup` untimed ones (`timed_start` is
    called between them)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    timed_start()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_figure(total: int, device: torch.device, peer: torch.device, warmup: int, steps: int) -> float:
    """Median time of the two copies a step has to make: gradients to the daemon's device,
    parameters back (the same fp32 bytes each way)."""
    grads = torch.randn(total, device=device)
    params = torch.empty(total, device=device)
    there = torch.empty(total, device=peer)

    def both_ways():
        there.copy_(grads, non_blocking=True)
        params.copy_(there, non_blocking=True)
        torch.cuda.synchronize(peer)
    return median_seconds(both_ways, warmup, steps, device)


def step_time(muond, endpoint: str, transport: str, params, warmup: int, steps: int, device,
              timed_start=lambda: None, timed_end=lambda: None, profile_steps: int = 0):
    """(median step seconds, median daemon compute seconds, chosen transport, the profile's lines)
    of an SGD session over `transport`, or None with the reason when it cannot be used;
    `timed_start` and `timed_end` are called around the timed steps, and `profile_steps` more steps
    are then profiled by function (none: no lines)."""
    groups = [{"params": params, "optimizer": "sgd", "lr": 1e-12}]
    try:
        opt = muond.RemoteOptimizer(groups, endpoint=endpoint, transport=transport,
                                    max_step_attempts=1)
    except RuntimeError as err:
        return None, str(err)
    computes = []
    try:
        def one():
            opt.step()
            computes.append(opt.last_info.compute_seconds)
        seconds = median_seconds(one, warmup, steps, device, timed_start)
        timed_end()
        compute = statistics.median(computes[warmup:])

        def synchronized():
            opt.step()
            torch.cuda.synchronize(device)
        profile = client_profile.profile_steps(synchronized, profile_steps) if profile_steps else []
        return (seconds, compute, opt.transport, profile), ""
    finally:
        opt.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--sizes-m", type=float, nargs="+", default=[1, 16, 64],
                        help="total fp32 elements per step, in millions")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", type=int, default=0, help="the trainer's CUDA device")
    parser.add_argument("--daemon-device", type=int, default=0,
                        help="the daemon's device for cuda_ipc and the host transports")
    parser.add_argument("--nccl-daemon-device", type=int, default=None,
                        help="the daemon's device for nccl (default: 1 with two or more GPUs; none with one)")
    parser.add_argument("--transports", nargs="+", default=["cuda_ipc", "nccl", "shm", "grpc"])
    parser.add_argument("--profile", type=int, default=100, metavar="STEPS",
                        help="cuda_ipc steps profiled by function after the timed ones, per size (0: none)")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    if not torch.cuda.is_available():
        sys.exit("gpu_transport_bench: needs a CUDA GPU (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    nccl_device = args.nccl_daemon_device
    if nccl_device is None and count >= 2:
        nccl_device = 1 if args.device != 1 else 0
    device = torch.device("cuda", args.device)
    print(f"trainer on {torch.cuda.get_device_name(device)} (cuda:{args.device}); daemon on cuda:{args.daemon_device}"
          f"{f', NCCL daemon on cuda:{nccl_device}' if nccl_device is not None else ' (one GPU: no NCCL)'}; "
          f"torch {torch.__version__}; {args.tensors} tensors, median of {args.steps} steps", flush=True)

    with contextlib.ExitStack() as stack:
        main_endpoint, main_metrics = stack.enter_context(cuda_daemon(args.binary, args.daemon_device))
        nccl_endpoint, nccl_metrics = None, None
        if "nccl" in args.transports and nccl_device is not None:
            nccl_endpoint, nccl_metrics = stack.enter_context(cuda_daemon(args.binary, nccl_device))
        header = f"{'elements':>9} {'MiB/way':>8} {'copy ms':>8}"
        for t in args.transports:
            header += f" {t + ' ms':>12}"
        header += f" {'compute ms':>10} {'copy/ipc':>8} {'ipc GB/s':>8}"
        print(header, flush=True)
        floor = client_profile.round_trip_floor(main_endpoint, args.warmup, max(args.steps, 100))
        notes, spent, profiles = [], [], []
        for size_m in args.sizes_m:
            total = int(size_m * 1_000_000)
            params = make_params(total, args.tensors, device)
            peer = torch.device("cuda", args.daemon_device)
            copy_s = copy_figure(total, device, peer, args.warmup, args.steps)
            row = f"{total / 1e6:>8.0f}M {total * 4 / 2**20:>8.0f} {copy_s * 1e3:>8.2f}"
            ipc_s, compute = None, None
            for transport in args.transports:
                endpoint = nccl_endpoint if transport == "nccl" else main_endpoint
                if endpoint is None:
                    row += f" {'n/a':>12}"
                    notes.append(f"{transport}: needs a second GPU for the daemon")
                    continue
                metrics_port = nccl_metrics if transport == "nccl" else main_metrics
                read = {}
                timing, why = step_time(
                    muond, endpoint, transport, params, args.warmup, args.steps, device,
                    lambda port=metrics_port: read.update(before=daemon_metrics.read(port)),
                    lambda port=metrics_port: read.update(after=daemon_metrics.read(port)),
                    args.profile if transport == "cuda_ipc" else 0)

                if timing is None:
                    row += f" {'n/a':>12}"
                    notes.append(f"{total / 1e6:.0f}M {transport}: {why}")
                    continue
                seconds, daemon_compute, chosen, profile = timing
                row += f" {seconds * 1e3:>12.2f}"
                # Means over the timed steps.
                where = daemon_metrics.breakdown(read["before"], read["after"], chosen)
                spent.append(f"{total / 1e6:>8.0f}M {chosen:<9} step {seconds * 1e3:8.3f} ms: {where.describe()}, "
                             f"the rest {(seconds - where.handler) * 1e3:.3f} ms")
                profiles += [f"{total / 1e6:.0f}M {chosen}: " + profile[0], *profile[1:]] if profile else []
                if transport == "cuda_ipc":
                    ipc_s, compute = seconds, daemon_compute
                elif compute is None:
                    compute = daemon_compute
            row += f" {compute * 1e3 if compute is not None else float('nan'):>10.2f}"
            if ipc_s is not None:
                row += f" {copy_s / ipc_s:>8.2f} {2 * total * 4 / ipc_s / 1e9:>8.1f}"
            print(row, flush=True)
            del params
            torch.cuda.empty_cache()
        for note in dict.fromkeys(notes):
            print(f"  note: {note}")
        print("where a step went (the step a median; the handler and its phases means over the timed steps, "
              "from the daemon's metrics; the rest: the client and the call):")
        for line in spent:
            print(f"  {line}")
        print(f"the floor under the rest: one empty gRPC round trip to the daemon (GetServerInfo), "
              f"{floor * 1e3:.3f} ms (a median)")
        if profiles:
            print("the client's side of a cuda_ipc step by function (cProfile adds its own cost to each call):")
            for line in profiles:
                print(f"  {line}")
    print("copy/ipc: the copy figure over the cuda_ipc step (target >= 0.8); ipc GB/s: both ways' "
          "bytes over the cuda_ipc step")


if __name__ == "__main__":
    main()
