"""The fixed cost of a step: tiny steps from the Python client against the cheapest call there is.

Starts the real muond (--backend cpu, with --metrics-listen) on loopback. A session of --tensors
parameters of --elements fp32 elements each (SGD, so that the daemon's compute is negligible) is
stepped --warmup times and then --steps timed times per transport. Printed, as medians: the floor
(a GetServerInfo call on a channel of its own: one unary gRPC round trip on the same loopback,
nothing in it), each transport's opt.step(), its ratio to the floor, and the part spent in the
daemon's handler (muond_call_duration_seconds of the call that carried the steps, a mean over the
timed steps) with its step phases (daemon_metrics.py), the rest being the client's: the Python around
the call and gRPC's own cost. --profile STEPS then profiles that many more steps of each transport by
function (client_profile.py).

"grpc" steps this small go in one StepWhole call (docs/protocol.md, Steps in one call);
"grpc-stream" forces them onto the Step stream, as larger steps go, for the comparison.

CUDA IPC steps take the same path as shared-memory ones on the client (a StepShared-like unary
call, slot views, the step's answer), so the shm row bounds what its fixed cost can fall to.

    python3 bench/step_overhead_bench.py [--binary build/muond] [--steps 500] [--tensors 8] [--profile 300]
"""

import argparse
import statistics
import sys
import time

import torch

import client_profile
import daemon_metrics
from bench_daemon import REPO, cpu_daemon, free_port


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default=str(REPO / "build" / "muond"))
    parser.add_argument("--threads", type=int, default=1, help="the daemon's --threads")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--elements", type=int, default=64)
    parser.add_argument("--transports", nargs="+", default=["grpc-stream", "grpc", "shm"])
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, profile this many more of each transport by function")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set
    from muond.transport import grpc_transport  # noqa: E402

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.elements)) for _ in range(args.tensors)]
    metrics_port = free_port()
    print(f"{args.tensors} tensors of {args.elements} fp32 elements, SGD; daemon --threads {args.threads}; "
          f"medians of {args.steps} steps")
    with cpu_daemon(args.binary, args.threads, ["--metrics-listen", f"127.0.0.1:{metrics_port}"]) as (_, endpoint):
        floor = client_profile.round_trip_floor(endpoint, args.warmup, args.steps)
        print(f"  floor (GetServerInfo round trip)   {floor * 1e3:7.3f} ms")
        whole_step_bytes = grpc_transport.WHOLE_STEP_BYTES
        for name in args.transports:
            transport = "grpc" if name == "grpc-stream" else name
            grpc_transport.WHOLE_STEP_BYTES = -1 if name == "grpc-stream" else whole_step_bytes
            with muond.RemoteOptimizer([{"params": params, "optimizer": "sgd", "lr": 1e-9}], endpoint=endpoint,
                                       transport=transport, session=f"overhead-{name}") as opt:
                def one_step(timed=None):
                    for p in params:
                        p.grad = torch.ones_like(p)
                    started = time.perf_counter()
                    opt.step()
                    if timed is not None:
                        timed.append(time.perf_counter() - started)
                for _ in range(args.warmup):
                    one_step()
                before = daemon_metrics.read(metrics_port)
                walls = []
                for _ in range(args.steps):
                    one_step(walls)
                after = daemon_metrics.read(metrics_port)
                profile = client_profile.profile_steps(one_step, args.profile) if args.profile else []
            spent = daemon_metrics.breakdown(before, after, transport)
            wall = statistics.median(walls)
            print(f"  {name:<11} opt.step() {wall * 1e3:7.3f} ms = {wall / floor:5.2f} x the floor; "
                  f"{spent.describe()}, the rest {(wall - spent.handler) * 1e3:6.3f} ms")
            for line in profile:
                print(f"    {line}")


if __name__ == "__main__":
    main()
