"""The cost of per-group telemetry (docs/algorithms.md, Telemetry): the daemon's compute time of a
GPT-2-small step (124 M parameters, 85 M in Muon) with the group option telemetry on (the default:
update RMS and ratio, one orthogonality residual a step) and off, on the CPU backend.

Starts the real muond (--backend cpu) on loopback; two sessions of the same parameters and
gradients, one with telemetry and one without, stepped in turn, which goes first alternating (so
drift in the machine's speed and the order fall on both alike); one untimed step each, then --reps
timed ones. Printed: the median compute time the daemon reports (StepInfo.compute_seconds) of each
and their ratio (target: at most 1.02), and the fastest of each.

    python3 bench/telemetry_cost.py [--binary build/muond] [--reps 3] [--quick]
"""

import argparse
import statistics
import sys

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon
from ns_throughput import gpt2_params


def session(muond, endpoint, specs, telemetry):
    """A RemoteOptimizer over fresh parameters (seed 0, the same for both) with random gradients."""
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(shape) * 0.02) for name, shape, _ in specs}
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    muon = [params[name] for name, _, use in specs if use]
    other = [params[name] for name, _, use in specs if not use]
    groups = [{"params": muon, "use_muon": True, "telemetry": telemetry},
              {"params": other, "use_muon": False, "telemetry": telemetry}]
    return muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"telemetry-{telemetry}".lower())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the small GPT-2 stand-in instead")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    specs = gpt2_params(args.quick)
    total = sum(torch.Size(shape).numel() for _, shape, _ in specs)
    print(f"{'GPT-2 quick' if args.quick else 'GPT-2 small'}: {total / 1e6:.1f} M parameters; "
          f"{args.threads or 'all'} threads; CPU backend", flush=True)
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        on, off = session(muond, endpoint, specs, True), session(muond, endpoint, specs, False)
        seconds = {True: [], False: []}
        for i in range(args.reps + 1):
            order = ((True, on), (False, off)) if i % 2 == 0 else ((False, off), (True, on))
            for telemetry, opt in order:
                opt.step()
                if i > 0:
                    seconds[telemetry].append(opt.last_info.compute_seconds)
        measured = on.last_info.groups
        on.close()
        off.close()
    with_, without = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"step compute with telemetry    {with_:8.3f} s  (median of {args.reps})")
    print(f"step compute without telemetry {without:8.3f} s")
    print(f"with / without                 {with_ / without:8.4f}")
    fastest_with, fastest_without = min(seconds[True]), min(seconds[False])
    print(f"fastest: with {fastest_with:.3f} s, without {fastest_without:.3f} s, "
          f"ratio {fastest_with / fastest_without:.4f} (less sensitive to a busy machine)")
    for name, info in measured.items():
        residual = "-" if info.orthogonality_residual is None else f"{info.orthogonality_residual:.3g}"
        print(f"  group {name}: update_rms {info.update_rms:.3g}, update_ratio {info.update_ratio:.3g}, "
              f"orthogonality residual {residual}")


if __name__ == "__main__":
    main()
