"""Memory of a Muon session of square matrices against its state, with the Newton–Schulz
workspace bounded (--ns-workspace-bytes, default 256 MiB) and unbounded (0: batches of up to 2²⁶
floats per buffer, as before the bound).

Starts the real muond (--backend cpu) once per size and bound, reads its anonymous resident memory
(RssAnon) when idle, opens one session of --matrices square N×N matrices in Muon through the Python
client and runs --steps steps. Printed per run: the state bytes (fp32 master + gradient + momentum,
12 bytes per parameter, what the memory quota counts), RssAnon above idle after the last step and
its ratio to the state, the workspace held (muond_newton_schulz_workspace_bytes) and the milliseconds of the
last step's compute. The floor is 1.0× the state plus the workspace of one matrix, 4·N²·4 bytes
(docs/operations.md, Newton–Schulz workspace); the target is ≤ 1.4× for 4 × 4096².

    python3 bench/ns_memory_bench.py [--binary build/muond] [--sizes 1024 2048 4096] [--steps 2]
"""

import argparse
import re
import sys
import time
import urllib.request

import torch

from bench_daemon import REPO, cpu_daemon, free_port

DEFAULT_BOUND = 256 << 20


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")



def workspace_held(address: str) -> int:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    match = re.search(r'^muond_newton_schulz_workspace_bytes\{state="held"\} (\S+)$', text, re.M)
    return int(float(match.group(1))) if match else -1


def run(args, size: int, bound: int):
    import muond  # noqa: E402 - after the path is set

    metrics = f"127.0.0.1:{free_port()}"
    flags = ["--ns-workspace-bytes", str(bound), "--metrics-listen", metrics]
    with cpu_daemon(args.binary, args.threads, flags) as (proc, endpoint):
        time.sleep(0.5)  # let start-up allocations settle before the idle figure
        idle = rss_anon(proc.pid)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(size, size, bias=False) for _ in range(args.matrices)])
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    session=f"ns-memory-{size}")
        state = sum(12 * p.numel() for p in model.parameters())
        for _ in range(args.steps):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        above = rss_anon(proc.pid) - idle
        held = workspace_held(metrics)
        compute = opt.last_info.compute_seconds
        opt.close()
    return state, above, held, compute


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default=str(REPO / "build" / "muond"))
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--matrices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    mib = 1 << 20
    print(f"Muon session of {args.matrices} square matrices, {args.steps} steps, muond --backend cpu; "
          "memory = RssAnon above idle")
    print(f"{'N':>6} {'bound':>12} {'state MiB':>10} {'above MiB':>10} {'above/':>7} {'floor/':>7} "
          f"{'workspace':>10} {'step s':>7}")
    print(f"{'':>6} {'':>12} {'':>10} {'':>10} {'state':>7} {'state':>7} {'MiB':>10} {'':>7}")
    for size in args.sizes:
        for bound in (DEFAULT_BOUND, 0):
            state, above, held, compute = run(args, size, bound)
            floor = state + 16 * size * size
            label = "default" if bound == DEFAULT_BOUND else "none (before)"
            print(f"{size:>6} {label:>12} {state / mib:>10.0f} {above / mib:>10.0f} {above / state:>7.2f} "
                  f"{floor / state:>7.2f} {held / mib:>10.0f} {compute:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
