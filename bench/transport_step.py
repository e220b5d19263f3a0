"""A whole remote step of a GPT-2-small parameter set (124 M parameters, 85 M in Muon) from the
Python client, over each step transport, against the daemon's own compute time — and the local
pure-torch Muon + AdamW step of the same parameters (ns_throughput.py --mode step) in the same run.

Starts the real muond (--backend cpu) on loopback; builds the parameters as torch tensors with
random gradients; per transport, one untimed step and then --reps timed ones. Printed per
transport: the wall time of opt.step() (gradients in, parameters copied back into the tensors), the
daemon's compute time it reports, and their ratio (target over shared memory: at most 1.1).

    python3 bench/transport_step.py [--binary build/muond] [--reps 2] [--quick] [--no-torch]
"""

import argparse
import statistics
import sys
import time

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon
from ns_throughput import gpt2_params


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the small GPT-2 stand-in instead")
    parser.add_argument("--no-torch", action="store_true", help="skip the local torch step")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    torch.manual_seed(0)
    specs = gpt2_params(args.quick)
    params = {name: torch.nn.Parameter(torch.randn(shape) * 0.02) for name, shape, _ in specs}
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    muon = [p for (name, _, use) in specs if use for p in [params[name]]]
    other = [p for (name, _, use) in specs if not use for p in [params[name]]]
    total = sum(p.numel() for p in params.values())
    print(f"{'GPT-2 quick' if args.quick else 'GPT-2 small'}: {total / 1e6:.1f} M parameters, "
          f"{sum(p.numel() for p in muon) / 1e6:.1f} M in Muon; {args.threads or 'all'} threads")
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        for transport in ("shm", "grpc"):
            groups = [{"params": muon, "use_muon": True}, {"params": other, "use_muon": False}]
            with muond.RemoteOptimizer(groups, endpoint=endpoint, transport=transport) as opt:
                walls, computes = [], []
                for i in range(args.reps + 1):
                    start = time.perf_counter()
                    opt.step()
                    wall = time.perf_counter() - start
                    if i > 0:
                        walls.append(wall)
                        computes.append(opt.last_info.compute_seconds)
                wall, compute = statistics.median(walls), statistics.median(computes)
                print(f"muond over {opt.transport:4}: step {wall:7.3f} s, daemon compute {compute:7.3f} s, "
                      f"step / compute {wall / compute:5.2f}", flush=True)
    if not args.no_torch:
        import ns_throughput  # noqa: E402
        ns_args = argparse.Namespace(quick=args.quick, steps=5, warmup=1, reps=args.reps)
        result = ns_throughput.bench_step(ns_args, torch.device("cpu"), torch.float32)[0]
        print(f"local torch Muon + AdamW step (fp32): {result['ms_median'] / 1e3:7.3f} s")


if __name__ == "__main__":
    main()
