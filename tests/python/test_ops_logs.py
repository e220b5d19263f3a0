"""--log-format json: one JSON object per line, with session, step and event on the lines about a
session's events; --log-format text stays as it was; flags also come from MUOND_<FLAG>."""

import json
import subprocess

import pytest

import muond

from helpers import TinyNet, loss_of

pytestmark = pytest.mark.ops


def run_session(endpoint):
    model = TinyNet(seed=11)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, session="logged")
    for step in (1, 2):
        loss_of(model, step).backward()
        if step == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
    opt.close()


def test_json_lines_carry_session_step_and_event(start_daemon):
    daemon = start_daemon("--log-format", "json", "--log-level", "info")
    run_session(daemon.endpoint)
    daemon.stop()
    lines = daemon.log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "message"} <= r.keys() for r in records)
    assert all(r["time"].endswith("Z") for r in records)
    events = {r["event"]: r for r in records if "event" in r}
    assert events["session_created"]["session"] == "logged" and events["session_created"]["step"] == 0
    assert events["parameters_uploaded"]["session"] == "logged" and "step" not in events["parameters_uploaded"]
    skipped = events["step_skipped"]
    assert (skipped["session"], skipped["step"], skipped["level"]) == ("logged", 2, "warning")
    assert "non-finite" in skipped["message"] or "inf" in skipped["message"]
    assert events["session_closed"]["step"] == 2
    assert any(r["message"].startswith("muond listening on") and "event" not in r for r in records)


def test_text_is_the_default(start_daemon):
    daemon = start_daemon("--log-level", "info")
    run_session(daemon.endpoint)
    daemon.stop()
    text = daemon.log_path.read_text()
    assert "info session logged created" in text and not text.lstrip().startswith("{")


def test_flags_come_from_the_environment_and_the_command_line_wins(tmp_path):
    from conftest import _daemon_binary
    result = subprocess.run([str(_daemon_binary()), "--backend", "cpu"], capture_output=True, text=True,
                            timeout=60, env={"MUOND_LOG_FORMAT": "yaml"})
    assert result.returncode == 2 and "--log-format" in result.stderr
    result = subprocess.run([str(_daemon_binary()), "--backend", "cpu", "--listen", "nonsense"],
                            capture_output=True, text=True, timeout=60,
                            env={"MUOND_LOG_FORMAT": "json", "MUOND_LISTEN": "127.0.0.1:0"})
    assert result.returncode == 1
    last = json.loads(result.stderr.splitlines()[-1])
    assert "cannot listen on nonsense" in last["message"]
