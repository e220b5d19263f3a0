"""Checkpoints and restarts against the real daemon: ``RemoteOptimizer.checkpoint()`` writes the
session to --state-dir and returns its step; a daemon restarted on the same folder gives a new
trainer the session back at its last step with the same parameters and optimizer state; steps
and idempotent calls are retried with the same step number across a restart."""

import json
import threading
import time
import uuid

import grpc
import pytest
import torch

import muond
from helpers import TinyNet, loss_of, params_of

TOKENS = {"alice": "alice-0d41c8b5e2", "bob": "bob-7e2f58a6"}


def groups(model):
    return muond.default_param_groups(model, muon={"weight_decay": 0.01})


def train(model, opt, steps):
    for step in steps:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def assert_same_params(model, expected, exact=True):
    for name, p in model.named_parameters():
        if exact:
            assert torch.equal(p.detach(), expected[name]), name
        else:
            assert torch.allclose(p.detach(), expected[name], rtol=1e-6, atol=1e-7), name


def uninterrupted(endpoint, seed, steps):
    """The parameters after ``steps`` on the shared daemon, with no restart in between."""
    model = TinyNet(seed=seed)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        train(model, opt, steps)
    return params_of(model)


def test_checkpoint_returns_the_step_and_writes_it(start_daemon, tmp_path):
    state_dir = tmp_path / "state"
    daemon = start_daemon("--state-dir", state_dir)
    session = f"ckpt-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=70)
    with muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session) as opt:
        assert opt.checkpoint() == 0  # the initial parameters
        train(model, opt, range(1, 4))
        assert opt.checkpoint() == 3
        assert opt.checkpoint() == 3  # again: same step, nothing new
        conn = muond.Connection(daemon.endpoint)
        assert conn.checkpoint(session) == 3
        conn.close()

        folder = state_dir / session
        assert (folder / "checkpoint-000000000003.safetensors").is_file()
        meta = json.loads((folder / "checkpoint.json").read_text())
        assert meta["session_id"] == session and meta["last_step"] == 3
        train(model, opt, range(4, 5))
        assert opt.checkpoint() == 4
        assert (folder / "checkpoint-000000000004.safetensors").is_file()
        assert json.loads((folder / "checkpoint.json").read_text())["last_step"] == 4


def test_checkpoint_without_state_dir_is_failed_precondition(endpoint):
    model = TinyNet(seed=71)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        train(model, opt, range(1, 2))
        with pytest.raises(muond.MuondError) as info:
            opt.checkpoint()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.rpc == "Checkpoint" and "--state-dir" in info.value.details
        train(model, opt, range(2, 3))  # the session is unharmed
        assert opt.last_step == 2


def test_restarted_daemon_resumes_the_session(start_daemon, tmp_path, endpoint):
    state_dir = tmp_path / "state"
    daemon = start_daemon("--state-dir", state_dir)
    session = f"restart-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=72)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 4))
    assert opt.checkpoint() == 3
    train(model, opt, range(4, 6))  # written by the daemon's final checkpoint on SIGTERM
    at_step_5 = params_of(model)
    opt.close(keep_session=True)
    assert daemon.stop() == 0

    daemon = start_daemon("--state-dir", state_dir, workdir=daemon.workdir)
    restarted = TinyNet(seed=99)  # a new trainer with fresh weights
    opt = muond.RemoteOptimizer(groups(restarted), endpoint=daemon.endpoint, session=session)
    assert opt.attached and opt.last_step == 5
    assert_same_params(restarted, at_step_5)
    # The optimizer state came back too: going on matches a run that was never interrupted.
    train(restarted, opt, range(6, 9))
    assert opt.last_step == 8
    opt.close()
    assert_same_params(restarted, uninterrupted(endpoint, 72, range(1, 9)), exact=False)


def test_crash_keeps_the_last_checkpoint(start_daemon, tmp_path):
    state_dir = tmp_path / "state"
    daemon = start_daemon("--state-dir", state_dir)
    session = f"crash-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=73)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 4))
    assert opt.checkpoint() == 3
    at_step_3 = params_of(model)
    train(model, opt, range(4, 6))  # never checkpointed
    opt.close(keep_session=True)
    daemon.kill()

    daemon = start_daemon("--state-dir", state_dir, workdir=daemon.workdir)
    restarted = TinyNet(seed=73)
    with muond.RemoteOptimizer(groups(restarted), endpoint=daemon.endpoint,
                               session=session) as opt:
        assert opt.attached and opt.last_step == 3
        assert_same_params(restarted, at_step_3)
        train(restarted, opt, range(4, 6))  # the trainer redoes steps 4 and 5
        assert opt.last_step == 5


def test_journal_keeps_every_acknowledged_step_through_a_crash(start_daemon, tmp_path):
    state_dir = tmp_path / "state"
    flags = ("--state-dir", state_dir, "--durability", "journal")
    daemon = start_daemon(*flags)
    session = f"journal-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=74)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 3))
    assert opt.checkpoint() == 2
    train(model, opt, range(3, 6))  # journaled only
    at_step_5 = params_of(model)
    opt.close(keep_session=True)
    daemon.kill()

    daemon = start_daemon(*flags, workdir=daemon.workdir)
    restarted = TinyNet(seed=0)
    with muond.RemoteOptimizer(groups(restarted), endpoint=daemon.endpoint,
                               session=session) as opt:
        assert opt.last_step == 5
        assert_same_params(restarted, at_step_5)


def test_restored_session_keeps_its_owner(start_daemon, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{n}:{t}\n" for n, t in TOKENS.items()))
    tokens.chmod(0o600)
    flags = ("--state-dir", tmp_path / "state", "--auth-token-file", tokens)
    daemon = start_daemon(*flags)
    session = f"owned-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=75)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session,
                                auth_token=TOKENS["alice"])
    train(model, opt, range(1, 3))
    assert opt.checkpoint() == 2
    opt.close(keep_session=True)
    daemon.stop()

    daemon = start_daemon(*flags, workdir=daemon.workdir)
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet(seed=75)), endpoint=daemon.endpoint,
                              session=session, auth_token=TOKENS["bob"])
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with muond.RemoteOptimizer(groups(TinyNet(seed=75)), endpoint=daemon.endpoint,
                               session=session, auth_token=TOKENS["alice"]) as opt:
        assert opt.attached and opt.last_step == 2


def test_a_connection_finds_its_daemon_back_after_a_restart_it_did_not_watch(start_daemon):
    """A connection whose calls failed while its daemon was down, and which then sat idle while the
    daemon came back at the same address, reconnects by itself and reaches it with its next call.
    Without a watcher, nothing moved the channel's reconnection along between calls that failed at
    once: calls every 0.5 s kept failing for 10 s after the daemon was back."""
    daemon = start_daemon()
    conn = muond.Connection(daemon.endpoint, max_attempts=1)
    conn.list_sessions()
    daemon.kill()
    for _ in range(3):  # a trainer's tries while the daemon is down
        with pytest.raises(muond.MuondError) as info:
            conn.list_sessions()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.05)
    # Started and ready (its port file written) without a gRPC channel of this process touching
    # it: another channel to the same address would connect the connection's shared subchannel.
    daemon = start_daemon(listen=daemon.endpoint, workdir=daemon.workdir)
    # The event: the channel became ready again while nothing called (the connection's watcher,
    # started by the failed calls, saw it); the next call then finds the daemon.
    conn._reconnecting.result(timeout=60)  # pylint: disable=protected-access
    assert len(conn.list_sessions()) == 0
    conn.close()


def test_step_and_checkpoint_are_retried_across_a_restart(start_daemon, tmp_path, endpoint):
    # Journal durability, so that a SIGKILL loses no acknowledged step.
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    session = f"retry-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=76)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session,
                                max_step_attempts=8, retry_backoff=0.05)
    restarted = [daemon]

    def crash_and_restart_soon():
        """Kills the daemon now and starts it again on the same port half a second later."""
        old = restarted[-1]
        old.kill()

        def start():
            restarted.append(start_daemon(*flags, listen=old.endpoint, workdir=old.workdir))
        timer = threading.Timer(0.5, start)
        timer.start()
        return timer

    train(model, opt, range(1, 3))
    timer = crash_and_restart_soon()
    train(model, opt, range(3, 4))  # sent while the daemon is down: retried until it is back
    timer.join()
    assert len(restarted) == 2 and restarted[-1].alive()
    assert opt.last_step == 3 and opt.last_info.applied
    assert opt.last_info.attempts > 1

    timer = crash_and_restart_soon()
    assert opt.checkpoint() == 3  # an idempotent call, retried the same way
    timer.join()
    assert len(restarted) == 3
    train(model, opt, range(4, 5))
    assert opt.last_step == 4
    opt.close()
    assert_same_params(model, uninterrupted(endpoint, 76, range(1, 5)), exact=False)


def test_retry_settings(endpoint):
    model = TinyNet(seed=77)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        assert opt.max_step_attempts == 4 and opt._conn.max_attempts == 4
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, max_step_attempts=1) as opt:
        assert opt.max_step_attempts == 1 and opt._conn.max_attempts == 1
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, max_step_attempts=6,
                               retry_backoff=0.5) as opt:
        assert opt._conn.max_attempts == 6 and opt._conn.retry_backoff == 0.5


def test_normuon_state_survives_a_checkpoint_and_a_crash(start_daemon, tmp_path):
    """NorMuon's second moment is smaller than its parameter (one value per row or column): the
    checkpoint stores it at its own shape, the journal replays over it, and a session restored
    after a crash goes on exactly as one that never stopped."""
    def normuon(model):
        return muond.default_param_groups(model, muon={"moment2_method": "normuon", "beta2": 0.9})

    state_dir = tmp_path / "state"
    flags = ("--state-dir", state_dir, "--durability", "journal")
    daemon = start_daemon(*flags)
    session = f"normuon-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=75)
    twin = TinyNet(seed=75)
    opt = muond.RemoteOptimizer(normuon(model), endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 4))
    assert opt.checkpoint() == 3
    train(model, opt, range(4, 6))  # journaled only
    saved = opt.state_dict()
    assert tuple(saved["state"][0]["moment2"].shape) in ((48, 1), (1, 48))
    opt.close(keep_session=True)
    daemon.kill()

    daemon = start_daemon(*flags, workdir=daemon.workdir)
    with muond.RemoteOptimizer(normuon(twin), endpoint=daemon.endpoint, session=session) as opt:
        assert opt.last_step == 5
        restored = opt.state_dict()
        for i, entry in saved["state"].items():
            for slot in ("master", "momentum", "moment2"):
                if slot in entry:
                    assert torch.equal(restored["state"][i][slot], entry[slot]), (i, slot)
        opt.load_state_dict(restored)  # and it goes back in at its own shape
        train(twin, opt, range(6, 8))
