"""Resident memory of a CPU daemon against the optimizer state it holds.

Starts the real muond (--backend cpu) on loopback, reads its own resident set (VmRSS less the
clients' shared-memory regions, RssShmem) when idle, then
opens --sessions sessions through the Python client, each a two-layer MLP of width --width (matrices
in Muon, biases in AdamW), and runs --steps steps in every session. Printed: the idle RSS, the state
bytes the sessions hold (fp32 masters + gradients + optimizer slots: Muon 12 bytes per parameter,
AdamW 16), the RSS above idle after the first step and after the last, their ratio to the state
bytes, and how far RSS moved over the later steps (a long run should not wander). The target
(README, CPU performance) is RSS above idle <= 1.3 x state bytes.

    python3 bench/memory_bench.py [--binary build/muond] [--sessions 8] [--width 512] [--steps 20]
"""

import argparse
import time

import torch

from bench_daemon import add_daemon_flags, cpu_daemon, open_sessions


def rss_bytes(pid: int) -> int:
    """The daemon's own resident memory: VmRSS less RssShmem, the pages of shared-memory regions
    that clients registered (their memory, mapped by both; the shared-memory transport's)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with cpu_daemon(args.binary, args.threads) as (proc, endpoint):
        time.sleep(0.5)  # let start-up allocations settle before the idle figure
        idle = rss_bytes(proc.pid)
        sessions = open_sessions(endpoint, args.sessions, args.width, "memory")
        state = sum(p.numel() * (12 if p.dim() >= 2 else 16) for m, _ in sessions for p in m.parameters())
        x = torch.randn(16, args.width)
        samples = []
        for _ in range(args.steps):
            for model, opt in sessions:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            samples.append(rss_bytes(proc.pid) - idle)
        later = samples[len(samples) // 2:]
        spread = (max(later) - min(later)) / max(later)
        mib = 1 << 20
        print(f"muond --backend cpu: idle RSS {idle / mib:.1f} MiB")
        print(f"{args.sessions} sessions, {sum(p.numel() for m, _ in sessions for p in m.parameters()):,} "
              f"parameters; state (masters + gradients + slots) {state / mib:.1f} MiB")
        print(f"RSS above idle: after step 1 {samples[0] / mib:.1f} MiB ({samples[0] / state:.2f} x state), "
              f"after step {args.steps} {samples[-1] / mib:.1f} MiB ({samples[-1] / state:.2f} x state); "
              f"spread over the last {len(later)} steps {spread:.1%}")
        for _, opt in sessions:
            opt.close()


if __name__ == "__main__":
    main()
