"""Prometheus metrics of a real daemon (--metrics-listen): what a scrape shows after steps over both
transports, a skipped step and a journal; the exposition passes `promtool check metrics`; and a real
Prometheus server scraping the daemon returns muond_steps_total through its HTTP API."""

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch

import muond

from conftest import REPO_ROOT, tied_to_this_process
from helpers import TinyNet, loss_of

pytestmark = pytest.mark.ops


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """The value of the one sample `name` whose labels include `labels`."""
    found = []
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append(float(match.group(3)))
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def metrics_address(endpoint: str) -> str:
    conn = muond.Connection(endpoint)
    try:
        return conn.server_info().metrics_address
    finally:
        conn.close()


def train(endpoint: str, session: str, transport: str, steps: int, nan_at: int = 0):
    model = TinyNet(seed=7)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, session=session,
                                transport=transport)
    for step in range(1, steps + 1):
        loss_of(model, step).backward()
        if step == nan_at:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad()
    opt.close(keep_session=True)


@pytest.fixture
def metered(start_daemon, tmp_path):
    return start_daemon("--metrics-listen", "127.0.0.1:0", "--state-dir", tmp_path / "state",
                        "--durability", "journal", "--max-total-bytes", "1GiB")


def test_a_scrape_counts_steps_calls_bytes_and_durable_writes(metered):
    address = metrics_address(metered.endpoint)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    before = scrape(address)
    assert sample(before, "muond_steps_total", outcome="applied", transport="grpc") == 0
    assert sample(before, "muond_sessions") == 0

    train(metered.endpoint, "over-grpc", "grpc", steps=4, nan_at=3)
    train(metered.endpoint, "over-shm", "shm", steps=2)
    text = scrape(address)

    assert sample(text, "muond_steps_total", outcome="applied", transport="grpc") == 3
    assert sample(text, "muond_steps_total", outcome="skipped", transport="grpc") == 1
    assert sample(text, "muond_steps_total", outcome="applied", transport="shm") == 2
    assert sample(text, "muond_steps_total", outcome="replayed", transport="shm") == 0
    for transport, steps in (("grpc", 4), ("shm", 2)):
        assert sample(text, "muond_step_duration_seconds_count", transport=transport) == steps
        for phase in ("receive", "compute", "send"):
            assert sample(text, "muond_step_phase_duration_seconds_count", phase=phase,
                          transport=transport) == steps
            assert sample(text, "muond_step_phase_duration_seconds_bucket", phase=phase,
                          transport=transport, le="+Inf") == steps
    # Every gradient byte crossed: TinyNet's fp32 parameters, per step, plus framing on gRPC.
    numel = sum(p.numel() for p in TinyNet(seed=7).parameters())
    assert sample(text, "muond_step_received_bytes_total", transport="shm") == 2 * 4 * numel
    assert sample(text, "muond_step_sent_bytes_total", transport="shm") == 2 * 4 * numel
    assert sample(text, "muond_step_received_bytes_total", transport="grpc") > 4 * 4 * numel
    # TinyNet's gRPC steps are small: each goes in one StepWhole call.
    assert sample(text, "muond_calls_total", method="StepWhole", code="OK") == 4
    assert sample(text, "muond_calls_total", method="StepShared", code="OK") == 2
    assert sample(text, "muond_calls_in_flight", method="StepWhole") == 0
    assert sample(text, "muond_sessions") == 2
    assert sample(text, "muond_state_bytes") > 0
    assert sample(text, "muond_state_bytes_limit", scope="total") == 2 ** 30
    # Journal mode: every step (applied or skipped) was appended and fsynced; uploads checkpointed.
    assert sample(text, "muond_journal_append_duration_seconds_count") == 6
    assert sample(text, "muond_checkpoint_duration_seconds_count") == 2
    assert sample(text, "muond_backend_memory_bytes", state="in_use") > 0
    assert sample(text, "muond_build_info", backend="cpu") == 1
    assert sample(text, "process_resident_memory_bytes") > 0


def test_refused_calls_are_counted_by_code(metered):
    address = metrics_address(metered.endpoint)
    conn = muond.Connection(metered.endpoint)
    try:
        with pytest.raises(muond.MuondError):
            conn.close_session("no-such-session")
    finally:
        conn.close()
    assert sample(scrape(address), "muond_calls_total", method="CloseSession", code="NOT_FOUND") == 1


def test_promtool_accepts_the_exposition(metered):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: scripts/setup.sh installs Debian's prometheus package")
    train(metered.endpoint, "linted", "grpc", steps=2)
    text = scrape(metrics_address(metered.endpoint))
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_metrics_listen_is_off_by_default_and_checked(endpoint, tmp_path):
    assert metrics_address(endpoint) == ""
    from conftest import _daemon_binary
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for value, code, message in ((f"127.0.0.1:{taken.getsockname()[1]}", 1, "cannot listen"),
                                     ("no-port", 2, "is not HOST:PORT")):
            result = subprocess.run([str(_daemon_binary()), "--listen", "127.0.0.1:0", "--backend", "cpu",
                                     "--metrics-listen", value], capture_output=True, text=True, timeout=60)
            assert result.returncode == code, result.stderr
            assert "--metrics-listen" in result.stderr and message in result.stderr
    finally:
        taken.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_scraping(address: str, tmp_path):
    """A real Prometheus scraping the daemon's metrics at `address` every second; yields the address
    of its HTTP API."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus is missing: scripts/setup.sh installs Debian's prometheus package")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: muond\n    static_configs:\n"
        f"      - targets: ['{address}']\n")
    # Port 0 is not an option for Prometheus' web listener; a port that was just free is taken
    # again at once, and a clash shows up as Prometheus exiting, which the waits report.
    web = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "prometheus.log"
    log = open(log_path, "wb")
    server = subprocess.Popen(tied_to_this_process([prometheus, f"--config.file={config}",
                                                    f"--web.listen-address={web}",
                                                    f"--storage.tsdb.path={tmp_path / 'tsdb'}"]),
                              stdout=log, stderr=subprocess.STDOUT)
    server.log_path = log_path
    try:
        yield web, server
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def query(web: str, server, expr: str):
    """The result of instant query `expr` (None while Prometheus is not listening yet)."""
    if server.poll() is not None:
        pytest.fail(f"prometheus exited: {server.log_path.read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(f"http://{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr}),
                                    timeout=5) as response:
            return json.load(response)["data"]["result"]
    except OSError:
        return None


def test_a_real_prometheus_scrapes_the_daemon(metered, tmp_path):
    address = metrics_address(metered.endpoint)
    train(metered.endpoint, "scraped", "grpc", steps=3)
    with prometheus_scraping(address, tmp_path) as (web, server):
        value = None
        deadline = time.monotonic() + 120
        while value is None:
            assert time.monotonic() < deadline, "prometheus returned no muond_steps_total within 120 s"
            result = query(web, server, 'sum(muond_steps_total{outcome="applied"})')
            value = float(result[0]["value"][1]) if result else None
            if value is None:
                time.sleep(0.2)
        assert value == 3
        with urllib.request.urlopen(f"http://{web}/api/v1/targets", timeout=5) as response:
            targets = json.load(response)["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets


DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "muond-dashboard.json"


def dashboard_queries():
    """(panel title, PromQL) of every target of deploy/grafana/muond-dashboard.json, with its
    variables as "All" gives them and the rate interval at 1m."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance", "session"} <= names
    found = []
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", "1m")
                    .replace("$instance", ".*").replace("$session", ".*"))
            assert "$" not in expr, expr
            found.append((panel["title"], expr))
    return found


def test_every_dashboard_panel_returns_a_series(metered, tmp_path):
    # A training daemon: steps over both transports, a Muon group measured, a health warning (a
    # Newton–Schulz that does nothing) and a refused call; every query of every panel must then
    # answer at least one series through Prometheus' HTTP API.
    queries = dashboard_queries()
    assert len({title for title, _ in queries}) >= 10
    address = metrics_address(metered.endpoint)
    with prometheus_scraping(address, tmp_path) as (web, server):
        train(metered.endpoint, "dash-grpc", "grpc", steps=4)
        train(metered.endpoint, "dash-shm", "shm", steps=4)
        torch.manual_seed(8)
        w = torch.nn.Parameter(torch.randn(64, 64) * 0.05)
        groups = [{"params": [w], "param_names": ["w"], "optimizer": "muon",
                   "ns_coefficients": [(1.0, 0.0, 0.0)]}]
        with muond.RemoteOptimizer(groups, endpoint=metered.endpoint, session="dash-fault") as opt:
            w.grad = torch.randn(64, 64)  # full rank: normalizing alone leaves it far from orthogonal
            opt.step()
            assert opt.last_info.groups["g0"].warnings == ("residual_high",)
        conn = muond.Connection(metered.endpoint)
        try:
            with pytest.raises(muond.MuondError):
                conn.checkpoint("no-such-session")
        finally:
            conn.close()
        empty = queries
        deadline = time.monotonic() + 120
        while empty and time.monotonic() < deadline:
            empty = [(title, expr) for title, expr in empty if not query(web, server, expr)]
            if empty:
                time.sleep(0.5)
        assert not empty, f"panels without a series after 120 s: {empty}"
