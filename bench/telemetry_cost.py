"""The cost of per-group telemetry (docs/algorithms.md, Telemetry) on every optimizer: the daemon's
compute time of a step with the group option telemetry on (the default: update RMS and ratio, and
for Muon one orthogonality residual a step) against off, on the CPU backend. Target: a measured step
within 3% of an unmeasured one (with / without ≤ 1.03).

Cases: AdamW, Lion and SGD on 8 tensors of 16 M and of 64 M parameters in all, and Muon (with AdamW
for the rest) on GPT-2 small (124 M parameters, 85 M in Muon; `--quick`: the small stand-in).

Starts the real muond (--backend cpu) on loopback; per case two sessions of the same parameters and
gradients, one with telemetry and one without, stepped in turn, which goes first alternating (so
drift in the machine's speed and the order fall on both alike); one untimed step each, then --reps
timed ones. Printed per case: the median compute time the daemon reports (StepInfo.compute_seconds)
of each, their ratio, and the ratio of the fastest of each (less sensitive to a busy machine).

    python3 bench/telemetry_cost.py [--binary build/muond] [--threads 2] [--reps 7] [--quick]
                                    [--cases adamw-16M,muon-gpt2]
"""

import argparse
import statistics
import sys

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon
from ns_throughput import gpt2_params

TARGET = 1.03


def element_wise(optimizer, total):
    """8 tensors of total/8 elements each, all in one `optimizer` group."""
    return [(f"t{i}", (total // 8,), optimizer) for i in range(8)]


def muon_case(quick):
    return [(name, shape, "muon" if use else "adamw") for name, shape, use in gpt2_params(quick)]


def session(muond, endpoint, specs, telemetry, name):
    """A RemoteOptimizer over fresh parameters (seed 0, the same for both) with random gradients."""
    torch.manual_seed(0)
    params = {pname: torch.nn.Parameter(torch.randn(shape) * 0.02) for pname, shape, _ in specs}
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    groups = []
    for optimizer in dict.fromkeys(opt for _, _, opt in specs):
        names = [pname for pname, _, opt in specs if opt == optimizer]
        groups.append({"params": [params[n] for n in names], "param_names": names, "optimizer": optimizer,
                       "telemetry": telemetry})
    return muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"{name}-{telemetry}".lower())


def measure(muond, endpoint, name, specs, reps):
    on = session(muond, endpoint, specs, True, name)
    off = session(muond, endpoint, specs, False, name)
    seconds = {True: [], False: []}
    try:
        for i in range(reps + 1):
            order = ((True, on), (False, off)) if i % 2 == 0 else ((False, off), (True, on))
            for telemetry, opt in order:
                opt.step()
                if i > 0:
                    seconds[telemetry].append(opt.last_info.compute_seconds)
        measured = on.last_info.groups
    finally:
        on.close()
        off.close()
    return seconds, measured


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="Muon on the small GPT-2 stand-in")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    cases = {}
    for optimizer in ("adamw", "lion", "sgd"):
        for millions in (16, 64):
            cases[f"{optimizer}-{millions}M"] = element_wise(optimizer, millions << 20)
    cases["muon-gpt2" + ("-quick" if args.quick else "")] = muon_case(args.quick)
    wanted = args.cases.split(",") if args.cases else list(cases)
    unknown = [c for c in wanted if c not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(cases)}")
    print(f"telemetry on / off, daemon compute seconds, CPU backend, {args.threads or 'all'} threads, "
          f"{args.reps} timed steps each; target with / without <= {TARGET}", flush=True)
    print(f"{'case':<18} {'params':>8} {'with (ms)':>10} {'without (ms)':>12} {'ratio':>7} {'fastest':>8}  verdict")
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        for name in wanted:
            specs = cases[name]
            total = sum(torch.Size(shape).numel() for _, shape, _ in specs)
            seconds, measured = measure(muond, endpoint, name, specs, args.reps)
            with_, without = statistics.median(seconds[True]), statistics.median(seconds[False])
            fastest = min(seconds[True]) / min(seconds[False])
            ratio = with_ / without
            print(f"{name:<18} {total / 1e6:7.1f}M {1e3 * with_:10.2f} {1e3 * without:12.2f} {ratio:7.3f} "
                  f"{fastest:8.3f}  {'ok' if ratio <= TARGET else 'above target'}", flush=True)
            for group, info in measured.items():
                residual = "" if info.orthogonality_residual is None else \
                    f", residual {info.orthogonality_residual:.3g}"
                print(f"    {group}: update_rms {info.update_rms:.3g}, update_ratio {info.update_ratio:.3g}{residual}")


if __name__ == "__main__":
    main()
