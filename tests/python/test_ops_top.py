"""`muondctl top` against a training daemon: in a real terminal (tmux: send-keys, capture-pane) it
shows each session's step, steps per second, ranks present, transport and per-group figures with
sparklines, and q ends it with exit 0; with stdout not a terminal it prints plain lines; over TLS with
a token like the other subcommands; and it exits 3 when the daemon goes away."""

import os
import shlex
import shutil
import subprocess
import threading
import time
import uuid

import pytest

import muond

from helpers import TinyNet, loss_of
from test_ops_muondctl import ctl, ctl_binary

pytestmark = pytest.mark.ops

WAIT = 120  # seconds: a bound on waiting for an event, never an expected duration


class Trainer:
    """Steps a session in a thread of its own until stopped."""

    def __init__(self, endpoint, session, transport="grpc", tls=None):
        self.steps = 0
        self._stop = threading.Event()
        model = TinyNet(seed=4)
        self._opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                          session=session, transport=transport, **(tls or {}))
        self._model = model
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        step = 0
        while not self._stop.is_set():
            step += 1
            loss_of(self._model, step).backward()
            self._opt.step()
            self._opt.zero_grad()
            self.steps = step
            self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join(WAIT)
        self._opt.close()


class Tmux:
    """A tmux server of its own (its own socket), one window running `command`; its exit status
    goes to `status_file` when it ends."""

    def __init__(self, command, status_file, width=220, height=50):
        if shutil.which("tmux") is None:
            pytest.fail("tmux is missing: scripts/setup.sh installs Debian's tmux package")
        self.socket = f"muond-top-{uuid.uuid4().hex[:8]}"
        self._status = status_file
        line = " ".join(shlex.quote(str(c)) for c in command)
        self._tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                   f"{line}; echo $? > {shlex.quote(str(status_file))}; sleep 600")

    def _tmux(self, *args):
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)

    def screen(self):
        return self._tmux("capture-pane", "-p", "-t", "top").stdout

    def send(self, *keys):
        self._tmux("send-keys", "-t", "top", *keys)

    def exit_status(self):
        """The command's exit status once it has ended, else None."""
        text = self._status.read_text().strip() if self._status.exists() else ""
        return int(text) if text else None

    def wait_for(self, predicate, what):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        pytest.fail(f"{what} within {WAIT} s; the screen:\n{self.screen()}")

    def close(self):
        self._tmux("kill-server")


def test_top_in_a_terminal_shows_the_training_session_and_q_ends_it(start_daemon, tmp_path):
    daemon = start_daemon()
    trainer = Trainer(daemon.endpoint, "top-watched", transport="shm")
    tmux = Tmux([ctl_binary(), "-e", daemon.endpoint, "top"], tmp_path / "status")
    try:
        # Two refreshes after steps went on: a rate above zero, and a history to draw.
        screen = tmux.wait_for(lambda s: "top-watched" in s and "GROUP" in s and _rate(s, "top-watched") > 0,
                               "no session with steps per second above 0")
        assert "(q quits)" in screen
        row = next(line for line in screen.splitlines() if line.startswith("top-watched"))
        fields = row.split()
        assert fields[3] == "1/1" and fields[4] == "shm", row
        groups = [line for line in screen.splitlines() if line.startswith("  g")]
        assert len(groups) == 2, screen  # TinyNet's Muon and AdamW groups
        assert any(ch in screen for ch in "▁▂▃▄▅▆▇█"), "no sparkline"
        tmux.send("q")
        deadline = time.monotonic() + WAIT
        while tmux.exit_status() is None:
            assert time.monotonic() < deadline, f"q did not end top:\n{tmux.screen()}"
            time.sleep(0.1)
        assert tmux.exit_status() == 0
        assert "top-watched" not in tmux.screen(), "the terminal's own screen is back"
    finally:
        tmux.close()
        trainer.stop()


def _rate(screen, session):
    for line in screen.splitlines():
        if line.startswith(session):
            try:
                return float(line.split()[2])
            except (IndexError, ValueError):
                return 0.0
    return 0.0


def test_top_without_a_terminal_prints_plain_lines(start_daemon):
    daemon = start_daemon()
    trainer = Trainer(daemon.endpoint, "top-plain")
    try:
        deadline = time.monotonic() + WAIT
        while trainer.steps < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, out, err = ctl("-e", daemon.endpoint, "top", "--iterations", "2", "--interval", "0.2")
    finally:
        trainer.stop()
    assert code == 0, err
    assert "\x1b" not in out, "escape codes on a pipe"
    assert out.count("muond " + daemon.endpoint) == 2, out
    assert "top-plain" in out and "GRAD NORM" in out and "(q quits)" not in out


def test_top_over_tls_with_a_token(start_daemon, tls_files, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("ops:s3cret-token\n")
    tokens.chmod(0o600)
    daemon = start_daemon("--tls-cert", tls_files["server_cert"], "--tls-key", tls_files["server_key"],
                          "--auth-token-file", tokens)
    tls = ("-e", daemon.endpoint, "--tls-ca-file", tls_files["ca"], "--tls-server-name", "localhost")
    code, out, err = ctl(*tls, "top", "-n", "1", env={"MUOND_AUTH_TOKEN": "s3cret-token"})
    assert code == 0 and "no sessions" in out, (code, out, err)
    code, _, err = ctl(*tls, "top", "-n", "1")
    assert code == 5 and "token" in err, err


def test_top_exits_3_when_the_daemon_goes_away(start_daemon):
    daemon = start_daemon()
    proc = subprocess.Popen([ctl_binary(), "-e", daemon.endpoint, "--timeout", "2", "top", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ})
    try:
        first = proc.stdout.readline()  # the first refresh is out: top is running
        assert first.startswith("muond "), first
        daemon.stop()
        out, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, (out, err)
    assert "went away" in err, err
