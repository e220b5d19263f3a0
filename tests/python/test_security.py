"""TLS, mutual TLS and bearer tokens against the real daemon: a trainer with the right settings
trains as over plaintext; a transport mismatch is UNAVAILABLE, a missing token UNAUTHENTICATED,
another token's session PERMISSION_DENIED; bad client settings are ValueErrors before any call."""

import os
import uuid

import grpc
import pytest
import torch

import muond
from muond._stubs import pb
from muond.wire import ChunkAssembler
from helpers import TinyNet, loss_of, params_of

TOKENS = {"alice": "alice-3f9c2b7e0a6d41c8", "bob": "bob-91ab0c4d7e2f58a6"}


def groups(model):
    return muond.default_param_groups(model)


def train(model, opt, steps):
    for step in steps:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# muond test tokens\n" + "".join(f"{n}:{t}\n" for n, t in TOKENS.items()))
    path.chmod(0o600)
    return path


def tls_flags(tls_files, mutual=False):
    flags = ["--tls-cert", tls_files["server_cert"], "--tls-key", tls_files["server_key"]]
    if mutual:
        flags += ["--tls-client-ca", tls_files["ca"]]
    return flags


def client_cert(tls_files):
    return {"tls_client_cert_file": tls_files["client_cert"],
            "tls_client_key_file": tls_files["client_key"]}


def assert_unavailable(info):
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value


# -- TLS ---------------------------------------------------------------------------------------


def test_training_over_tls_matches_plaintext(start_daemon, tls_files, endpoint):
    daemon = start_daemon(*tls_flags(tls_files))
    model = TinyNet(seed=60)
    with muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint,
                               tls_ca_file=tls_files["ca"]) as opt:
        assert opt._conn.uses_tls
        train(model, opt, range(1, 4))
        assert opt.last_step == 3 and opt.last_info.applied
        state = opt.state_dict()
        assert state["muond"]["last_step"] == 3

    plain = TinyNet(seed=60)  # the same steps on the plaintext daemon
    with muond.RemoteOptimizer(groups(plain), endpoint=endpoint) as ref:
        train(plain, ref, range(1, 4))
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=1e-6, atol=1e-7), name


def test_plaintext_client_against_tls_daemon_is_unavailable(start_daemon, tls_files):
    daemon = start_daemon(*tls_flags(tls_files))
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=daemon.endpoint, connect_timeout=1.0)
    assert_unavailable(info)
    assert "set tls_ca_file or use_tls" in info.value.details  # says what to check
    conn = muond.Connection(daemon.endpoint, max_attempts=2, retry_backoff=0.05)
    with pytest.raises(muond.MuondError) as info:
        conn.server_info()
    assert_unavailable(info)
    conn.close()
    assert daemon.alive()


def test_untrusted_daemon_certificate_is_unavailable(start_daemon, tls_files):
    daemon = start_daemon(*tls_flags(tls_files))
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=daemon.endpoint, connect_timeout=1.0,
                              tls_ca_file=tls_files["other_ca"])
    assert_unavailable(info)
    assert "TLS: check tls_ca_file" in info.value.details


def test_tls_server_name_overrides_the_name_checked(start_daemon, tls_files):
    daemon = start_daemon(*tls_flags(tls_files))
    # The certificate names 127.0.0.1 and localhost, not this name.
    with pytest.raises(muond.MuondError) as info:
        muond.Connection(daemon.endpoint, tls_ca_file=tls_files["ca"],
                         tls_server_name="muond.example.org").wait_ready(1.0)
    assert_unavailable(info)
    conn = muond.Connection(daemon.endpoint, tls_ca_file=tls_files["ca"],
                            tls_server_name="localhost")
    assert conn.server_info().backend == os.environ.get("MUOND_TEST_BACKEND", "cpu")
    conn.close()


def test_mutual_tls(start_daemon, tls_files):
    daemon = start_daemon(*tls_flags(tls_files, mutual=True))
    model = TinyNet(seed=61)
    with muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint,
                               tls_ca_file=tls_files["ca"], **client_cert(tls_files)) as opt:
        train(model, opt, range(1, 3))
        assert opt.last_step == 2

    # Without a client certificate the handshake fails (under TLS 1.3 possibly only after the
    # client thinks it connected, so at the first call rather than at connect).
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=daemon.endpoint, connect_timeout=1.0,
                              tls_ca_file=tls_files["ca"], retry_backoff=0.05)
    assert_unavailable(info)
    assert daemon.alive()


# -- tokens ------------------------------------------------------------------------------------


def test_missing_or_unknown_token_is_unauthenticated(start_daemon, tmp_path):
    daemon = start_daemon("--auth-token-file", token_file(tmp_path))
    for token in (None, "not-a-token"):
        open_before = set(muond.client._OPEN_CONNECTIONS)
        with pytest.raises(muond.MuondError) as info:
            muond.RemoteOptimizer(groups(TinyNet()), endpoint=daemon.endpoint, auth_token=token)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED, info.value
        assert info.value.rpc == "GetServerInfo"  # the first call: the daemon's chunk limit
        assert set(muond.client._OPEN_CONNECTIONS) == open_before  # the refused one was closed
        assert TOKENS["alice"] not in info.value.details
    conn = muond.Connection(daemon.endpoint)
    with pytest.raises(muond.MuondError) as info:
        conn.list_sessions()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    conn.close()


def test_sessions_belong_to_their_token(start_daemon, tmp_path):
    daemon = start_daemon("--auth-token-file", token_file(tmp_path))
    session = f"alice-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=62)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session,
                                auth_token=TOKENS["alice"])
    train(model, opt, range(1, 3))
    before = params_of(model)

    # Bob can neither attach to Alice's session nor use it through any call.
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet(seed=62)), endpoint=daemon.endpoint,
                              session=session, auth_token=TOKENS["bob"])
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, info.value
    assert session in info.value.details
    bob = muond.Connection(daemon.endpoint, auth_token=TOKENS["bob"])
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    denied = {
        "GetParameters": lambda: bob.get_parameters(session, ChunkAssembler(sizes)),
        "GetState": lambda: bob.get_state(session, ChunkAssembler(sizes)),
        "Step": lambda: bob.step(pb.StepHeader(session_id=session, step=3), [],
                                 ChunkAssembler(sizes)),
        "StepWhole": lambda: bob.step_whole(pb.StepHeader(session_id=session, step=3), [],
                                            ChunkAssembler(sizes)),
        "Checkpoint": lambda: bob.checkpoint(session),
        "GetStateDigest": lambda: bob.state_digest(session),
        "CloseSession": lambda: bob.close_session(session),
    }
    for rpc, call in denied.items():
        with pytest.raises(muond.MuondError) as info:
            call()
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, (rpc, info.value)
        assert info.value.rpc == rpc
    assert session not in {s.session_id for s in bob.list_sessions()}
    bob.close()

    # Alice's session is untouched and hers to go on with.
    conn = muond.Connection(daemon.endpoint, auth_token=TOKENS["alice"])
    into = ChunkAssembler(sizes)
    assert conn.get_parameters(session, into) == 2
    for (name, _), value in into.tensors().items():
        assert torch.equal(value.view(before[name].shape), before[name]), name
    conn.close()
    alice = muond.Connection(daemon.endpoint, auth_token=TOKENS["alice"])
    assert session in {s.session_id for s in alice.list_sessions()}
    alice.close()
    train(model, opt, range(3, 4))
    assert opt.last_step == 3
    opt.close()


def test_token_and_mutual_tls_together(start_daemon, tls_files, tmp_path):
    daemon = start_daemon(*tls_flags(tls_files, mutual=True),
                          "--auth-token-file", token_file(tmp_path))
    model = TinyNet(seed=63)
    with muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint,
                               tls_ca_file=tls_files["ca"], **client_cert(tls_files),
                               auth_token=TOKENS["bob"]) as opt:
        train(model, opt, range(1, 3))
        assert opt.last_step == 2
    # The right certificate is not enough without a token.
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=daemon.endpoint,
                              tls_ca_file=tls_files["ca"], **client_cert(tls_files))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


# -- client-side checks (no daemon needed) -----------------------------------------------------


def test_client_certificate_needs_its_key(tls_files):
    with pytest.raises(ValueError, match="tls_client_cert_file was given without "
                                         "tls_client_key_file"):
        muond.Connection("127.0.0.1:1", tls_ca_file=tls_files["ca"],
                         tls_client_cert_file=tls_files["client_cert"])
    with pytest.raises(ValueError, match="tls_client_key_file was given without "
                                         "tls_client_cert_file"):
        muond.RemoteOptimizer(groups(TinyNet()), endpoint="127.0.0.1:1",
                              tls_client_key_file=tls_files["client_key"])


def test_bad_tls_and_token_settings_are_value_errors(tmp_path, tls_files):
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match="tls_ca_file: cannot read .*missing.pem"):
        muond.Connection("127.0.0.1:1", tls_ca_file=missing)
    with pytest.raises(ValueError, match="tls_server_name applies to TLS only"):
        muond.Connection("127.0.0.1:1", tls_server_name="localhost")
    with pytest.raises(ValueError, match="not both"):
        muond.Connection("127.0.0.1:1", credentials=grpc.ssl_channel_credentials(),
                         tls_ca_file=tls_files["ca"])
    for token in ("two words", "Bearer abc", "caf\u00e9"):
        with pytest.raises(ValueError, match="auth_token"):
            muond.Connection("127.0.0.1:1", auth_token=token)
    with pytest.raises(ValueError, match="max_step_attempts must be at least 1"):
        muond.RemoteOptimizer(groups(TinyNet()), endpoint="127.0.0.1:1", max_step_attempts=0)

