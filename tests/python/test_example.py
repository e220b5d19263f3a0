"""examples/train_gpt.py trains through the daemon: a short run of a small configuration must
bring the loss clearly down, and --compare-local must track the daemon's loss curve."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# The examples train as a user runs them; the step transports have suites of their own.
pytestmark = [pytest.mark.once, pytest.mark.slow]


def run_example(endpoint, tmp_path, *extra):
    metrics = tmp_path / "metrics.json"
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "train_gpt.py"), "--endpoint", endpoint,
           "--steps", "60", "--d-model", "64", "--n-layer", "2", "--n-head", "2",
           "--context", "32", "--batch-size", "16", "--corpus-chars", "60000", "--warmup", "5",
           "--eval-every", "0", "--eval-batches", "2", "--sample", "40", "--no-progress",
           "--metrics-out", str(metrics), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(metrics.read_text()), proc.stdout


def test_example_trains_and_matches_local_torch(endpoint, tmp_path):
    metrics, stdout = run_example(endpoint, tmp_path, "--compare-local")
    losses = metrics["muond"]["losses"]
    start, end = losses[0], sum(losses[-5:]) / 5
    print(f"example: loss {start:.3f} -> {end:.3f}")
    assert len(losses) == 60
    assert end < 0.75 * start, (start, end)
    assert metrics["muond"]["val_loss"] < 0.8 * start
    local = metrics["local"]["losses"]
    worst = max(abs(a - b) for a, b in zip(losses, local))
    print(f"example: largest muond/local loss difference {worst:.2e}")
    # The parameters of the two runs agree to ≲ 1e-4 relative (test_equivalence's derivation); the
    # loss (2–4 nats) moves by at most its sensitivity to them (≲ 10 here) times that: ≤ 1e-3.
    assert worst < 1e-3
    assert "muond loss" in stdout and "local loss" in stdout and "sample:" in stdout


def test_ddp_example_trains_with_two_ranks(endpoint):
    """examples/train_ddp.py: two gloo ranks share one session and the loss comes down."""
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "train_ddp.py"), "--endpoint", endpoint,
           "--ranks", "2", "--steps", "40"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    first = float(lines[0].split("batch) ")[1].split()[0])
    final = float(proc.stdout.split("final loss on all data: ")[1].split()[0])
    assert "2 ranks" in proc.stdout
    assert final < 0.5 * first, proc.stdout


def run_sharded(endpoint, *args):
    """examples/train_sharded.py with ``args`` for 40 steps: its output, the first batch loss, the
    final loss on all data, and the elements rank 0 holds of the whole."""
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "train_sharded.py"), "--endpoint", endpoint,
           *args, "--steps", "40"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    first = float(lines[0].split("batch) ")[1].split()[0])
    final = float(proc.stdout.split("final loss on all data: ")[1].split()[0])
    held, whole = (int(n) for n in proc.stdout.split("rank 0 holds ")[1].split(" elements")[0].split(" of "))
    assert f"to {len(endpoint.split(','))} daemon(s)" in proc.stdout, proc.stdout
    return proc.stdout, first, final, held, whole


def test_sharded_example_trains_with_two_ranks_holding_parts(endpoint):
    """examples/train_sharded.py: two gloo ranks, each holding half of every parameter, step
    through one session and the loss comes down."""
    out, first, final, held, whole = run_sharded(endpoint, "--ranks", "2")
    assert held < 0.6 * whole, out  # about half of every parameter
    assert "2 ranks" in out
    assert final < 0.5 * first, out


def test_sharded_example_trains_as_hsdp_with_two_replicas(endpoint):
    """examples/train_sharded.py --replicas 2: four gloo ranks, two replicas of a model sharded
    over two, whose replicas the daemon averages; the loss comes down."""
    out, first, final, held, whole = run_sharded(endpoint, "--ranks", "4", "--replicas", "2")
    assert held < 0.6 * whole, out  # about half of every parameter: one of two shards
    assert "4 ranks, 2 replicas of 2 shards" in out
    assert final < 0.5 * first, out


def test_sharded_example_trains_with_parts_over_two_daemons(start_daemon):
    """examples/train_sharded.py --endpoint a,b: two ranks holding parts, the session spread over
    two daemons; the loss comes down."""
    endpoints = ",".join(start_daemon().endpoint for _ in range(2))
    out, first, final, held, whole = run_sharded(endpoints, "--ranks", "2")
    assert held < 0.6 * whole, out
    assert final < 0.5 * first, out
