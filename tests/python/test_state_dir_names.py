"""A folder of the state directory whose name is not a session id is left alone at start-up, and the
daemon says so in one warning naming it, escaped (an operator who renamed a session's folder learns
why it did not come back)."""

import os

import torch

import muond


def test_a_folder_that_is_not_a_session_is_named_in_a_warning(start_daemon, tmp_path):
    state = tmp_path / "state"
    daemon = start_daemon("--state-dir", state, workdir=tmp_path / "first")
    groups = [{"params": [("w", torch.zeros(4, 3, requires_grad=True))]}]
    opt = muond.RemoteOptimizer(groups, endpoint=daemon.endpoint, session="kept")
    opt.close(keep_session=True)
    daemon.stop()
    os.rename(state / "kept", os.path.join(os.fsencode(state), b"kept-\xff copy"))
    os.mkdir(state / "also not one!")
    os.mkdir(state / "lost+found")  # known folders that are not sessions: left alone quietly
    daemon = start_daemon("--state-dir", state, workdir=tmp_path / "second")
    assert muond.Connection(daemon.endpoint).list_sessions() == []
    log = daemon.log_tail(200)
    assert "kept-\\xff copy: the folder's name is not a session id" in log, log
    assert "also not one!: the folder's name is not a session id" in log, log
    assert "lost+found" not in log, log
    assert os.path.isdir(os.path.join(os.fsencode(state), b"kept-\xff copy"))  # left alone
