"""Resident memory of a CPU daemon against the optimizer state it holds.

Starts the real muond (--backend cpu) on loopback, reads its resident set (VmRSS) when idle, then
opens --sessions sessions through the Python client, each a two-layer MLP of width --width (matrices
in Muon, biases in AdamW), and runs --steps steps in every session. Printed: the idle RSS, the state
bytes the sessions hold (fp32 masters + gradients + optimizer slots: Muon 12 bytes per parameter,
AdamW 16), the RSS above idle after the first step and after the last, their ratio to the state
bytes, and how far RSS moved over the later steps (a long run should not wander). The target
(README, Performance) is RSS above idle <= 1.3 x state bytes.

    python3 bench/memory_bench.py [--binary build/muond] [--sessions 8] [--width 512] [--steps 20]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_daemon(binary: Path, threads: int, workdir: Path):
    port_file = workdir / "port"
    proc = subprocess.Popen([str(binary), "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                             "--backend", "cpu", "--threads", str(threads), "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("muond did not start")
        time.sleep(0.02)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, endpoint = start_daemon(args.binary, args.threads, Path(tmp))
        try:
            time.sleep(0.5)
            idle = rss_bytes(proc.pid)
            models, opts = [], []
            state = 0
            for s in range(args.sessions):
                d = args.width
                model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d))
                opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                            session=f"memory-{s}")
                for p in model.parameters():
                    state += p.numel() * (12 if p.dim() >= 2 else 16)
                models.append(model)
                opts.append(opt)
            x = torch.randn(16, args.width)
            samples = []
            for step in range(args.steps):
                for model, opt in zip(models, opts):
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                samples.append(rss_bytes(proc.pid) - idle)
            later = samples[len(samples) // 2:]
            spread = (max(later) - min(later)) / max(later)
            mib = 1 << 20
            print(f"muond --backend cpu: idle RSS {idle / mib:.1f} MiB")
            print(f"{args.sessions} sessions, {sum(p.numel() for m in models for p in m.parameters()):,} "
                  f"parameters; state (masters + gradients + slots) {state / mib:.1f} MiB")
            print(f"RSS above idle: after step 1 {samples[0] / mib:.1f} MiB "
                  f"({samples[0] / state:.2f} x state), after step {args.steps} {samples[-1] / mib:.1f} MiB "
                  f"({samples[-1] / state:.2f} x state); spread over the last {len(later)} steps "
                  f"{spread:.1%}")
            for opt in opts:
                opt.close()
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
