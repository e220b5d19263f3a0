"""``muondctl state digest DIR`` restores each session folder offline (its checkpoint, then its
journal's steps) and answers the digest the live daemon answered for the same state; ``muondctl
sessions digest`` asks a live daemon."""

import uuid

import muond
from helpers import TinyNet, loss_of
from test_ops_muondctl import ctl, ctl_json

import pytest

pytestmark = pytest.mark.ops


def train(model, opt, steps):
    for step in steps:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def test_offline_digest_equals_the_live_one(start_daemon, tmp_path):
    state_dir = tmp_path / "state"
    daemon = start_daemon("--state-dir", state_dir, "--durability", "journal")
    session = f"ctl-digest-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=85)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model, muon={"momentum_dtype": "bf16"}),
                                endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 3))
    opt.checkpoint()
    train(model, opt, range(3, 5))  # journaled after the checkpoint
    live = opt.state_digest()
    shown = ctl_json("-e", daemon.endpoint, "sessions", "digest", session)
    assert (shown["step"], shown["digest"], shown["algorithm"]) == (4, live.digest, "sha256")
    assert shown["num_tensors"] == live.num_tensors and shown["num_bytes"] == live.num_bytes
    code, out, _ = ctl("-e", daemon.endpoint, "sessions", "digest", session)
    assert code == 0 and f"step 4 sha256:{live.digest}" in out
    opt.close(keep_session=True)
    daemon.kill()  # as a crash: the last two steps are in the journal only

    offline = ctl_json("state", "digest", state_dir)
    [entry] = offline["sessions"]
    assert entry["session_id"] == session and entry["step"] == 4
    assert entry["digest"] == live.digest and entry["format"] == "muond-state-v1"
    assert entry["checkpoint_step"] == 2 and entry["journal_steps_replayed"] == 2
    assert ctl_json("state", "digest", state_dir, session)["sessions"] == [entry]
    code, out, _ = ctl("state", "digest", state_dir)
    assert code == 0 and f"step 4 sha256:{live.digest}" in out

    # The folder of a session that is not there, and a name that is not a session id.
    assert ctl("state", "digest", state_dir, "nobody")[0] == 4
    assert ctl("state", "digest", state_dir, "../etc")[0] == 2

    # After the restart the daemon answers the same digest.
    daemon = start_daemon("--state-dir", state_dir, "--durability", "journal")
    assert ctl_json("-e", daemon.endpoint, "sessions", "digest", session)["digest"] == live.digest
