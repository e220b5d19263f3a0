"""A trainer that ends without close() must still exit: normally, and with an uncaught exception
(a crashing training job), the interpreter exits promptly and with its usual status, and the
session it left behind stays on the daemon (only close() ends a session)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from muond.client import Connection

REPO_ROOT = Path(__file__).resolve().parents[2]

# Generous: an exit takes well under a second; the limit only turns a hang into a failure.
EXIT_LIMIT_SECONDS = 120

TRAINER = textwrap.dedent("""
    import sys
    import torch
    import muond

    endpoint, session, ending, delay = sys.argv[1:5]
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                session=session, delay=int(delay))
    for _ in range(3 if int(delay) else 1):  # with delay, the last step is in flight at the end
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    print("stepped", flush=True)
    if ending == "raise":
        raise RuntimeError("the training job crashed")
""")


def _run_trainer(endpoint: str, session: str, ending: str, delay: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "python")] + [p for p in sys.path if p and "muond-test-stubs" in p]
        + [env.get("PYTHONPATH", "")])
    try:
        return subprocess.run([sys.executable, "-c", TRAINER, endpoint, session, ending, str(delay)],
                              capture_output=True, text=True, env=env, timeout=EXIT_LIMIT_SECONDS)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the trainer ({ending}) did not exit within {EXIT_LIMIT_SECONDS} s after its "
                    f"last statement; output so far:\n{hung.stdout}\n{hung.stderr}")


def _assert_left_at(endpoint: str, session: str, step: int) -> None:
    """The session is on the daemon at `step`; then it is closed."""
    conn = Connection(endpoint)
    try:
        sessions = {s.session_id: s for s in conn.list_sessions()}
        assert sessions[session].last_step == step
        conn.close_session(session)
    finally:
        conn.close()


@pytest.mark.parametrize("ending,status", [("return", 0), ("raise", 1)])
def test_trainer_exits_without_close(endpoint, ending, status):
    session = f"exit-{ending}"
    done = _run_trainer(endpoint, session, ending)
    assert "stepped" in done.stdout, done.stderr
    assert done.returncode == status, done.stderr
    if ending == "raise":
        assert "the training job crashed" in done.stderr
    # The session was neither closed nor lost: it is there, at step 1, for a restarted trainer.
    _assert_left_at(endpoint, session, 1)


@pytest.mark.parametrize("ending,status", [("return", 0), ("raise", 1)])
def test_a_delayed_step_in_flight_at_exit_is_applied(endpoint, ending, status):
    # delay=1: step 3 is still on its worker thread when the script ends; the interpreter waits for
    # it, so the daemon has all three steps, once each.
    session = f"exit-delayed-{ending}"
    done = _run_trainer(endpoint, session, ending, delay=1)
    assert "stepped" in done.stdout, done.stderr
    assert done.returncode == status, done.stderr
    _assert_left_at(endpoint, session, 3)
