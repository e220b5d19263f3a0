"""Shared pieces of the Python benchmarks that drive the real daemon (memory_bench.py,
concurrency_bench.py and the others): their common flags, a CPU daemon (on loopback, or wherever a
prefix puts it) for the length of a `with` block, a free port, and sessions of a two-layer MLP (matrices in Muon, biases in AdamW) through the Python client.
"""

import argparse
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

REPO = Path(__file__).resolve().parents[1]


def add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="the daemon's --threads (0: one per core)")


@contextlib.contextmanager
def cpu_daemon(binary: Path, threads: int, extra_flags: Sequence[str] = (), log_level: str = "warn",
               prefix: Sequence[str] = (), host: str = "127.0.0.1"):
    """Yields (process, endpoint) of `muond --backend cpu` (plus `extra_flags`) on a free port of
    `host` (loopback by default), its command line after `prefix` (e.g. `ip netns exec`, taskset);
    stops it after."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen([*prefix, str(binary), "--listen", f"{host}:0", "--port-file", str(port_file),
                                 "--backend", "cpu", "--threads", str(threads), "--log-level", log_level,
                                 *extra_flags],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("muond did not start")
                time.sleep(0.02)
            yield proc, f"{host}:{int(port_file.read_text())}"
        finally:
            proc.terminate()
            proc.wait()


def free_port() -> int:
    """A TCP port free on loopback now (for a daemon's --metrics-listen)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_sessions(endpoint: str, count: int, width: int, prefix: str):
    """`count` (model, RemoteOptimizer) pairs, each model Linear(width, 4·width) then back."""
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    torch.manual_seed(0)
    sessions = []
    for s in range(count):
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width))
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, session=f"{prefix}-{s}")
        sessions.append((model, opt))
    return sessions
