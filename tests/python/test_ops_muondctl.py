"""muondctl against real daemons: health, info, sessions list|show|checkpoint|close, export (from the
daemon and offline from a state directory), state inspect|verify, TLS and token options, --json, and
the exit codes scripts test."""

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

import muond

from helpers import TinyNet, loss_of

pytestmark = pytest.mark.ops

REPO_ROOT = Path(__file__).resolve().parents[2]


def ctl_binary() -> str:
    configured = os.environ.get("MUOND_CTL")
    if configured:
        return configured
    default = REPO_ROOT / "build" / "muondctl"
    if default.is_file():
        return str(default)
    pytest.skip("no muondctl binary: build it (cmake --build build) or set MUOND_CTL")


def ctl(*args, env=None):
    """Runs muondctl; returns (exit code, stdout, stderr)."""
    result = subprocess.run([ctl_binary(), *map(str, args)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **(env or {})})
    return result.returncode, result.stdout, result.stderr


def ctl_json(*args, expect=0, env=None):
    code, out, err = ctl("--json", *args, env=env)
    assert code == expect, f"exit {code}: {out}{err}"
    return json.loads(out)


def train(endpoint, session, steps, seed=3):
    model = TinyNet(seed=seed)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, session=session)
    for step in range(1, steps + 1):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def read_safetensors(path):
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[info["dtype"]]
        begin, end = info["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype).view(info["shape"])
    return header.get("__metadata__", {}), tensors


def test_health_and_info(endpoint):
    code, out, _ = ctl("--endpoint", endpoint, "health")
    assert (code, out) == (0, "SERVING\n")
    assert ctl_json("--endpoint", endpoint, "health") == {"status": "SERVING"}
    info = ctl_json("-e", endpoint, "info")
    assert info["version"] == muond.__version__ and info["backend"] == "cpu"
    assert info["optimizers"] == ["muon", "adamw", "lion", "sgd", "dion2"]
    assert info["max_sessions"] == 64 and info["durability"] == "" and info["metrics_address"] == ""
    code, out, _ = ctl("-e", endpoint, "info")
    assert code == 0 and "backend       cpu" in out and "metrics       off" in out
    # Global options may follow the subcommand, at any depth, as kubectl and docker take them.
    assert ctl("health", "--endpoint", endpoint)[:2] == (0, "SERVING\n")
    assert ctl_json("health", "--json", "-e", endpoint) == {"status": "SERVING"}
    code, out, _ = ctl("sessions", "list", "--endpoint", endpoint, "--timeout", "5")
    assert code == 0, out


def test_unreachable_daemon_exits_3(tmp_path):
    code, out, err = ctl("--endpoint", "127.0.0.1:1", "--timeout", "1", "health")
    assert code == 3 and "cannot reach muond at 127.0.0.1:1 within 1 s" in err and "--tls-ca-file" in err, err
    doc = ctl_json("--endpoint", "127.0.0.1:1", "--timeout", "1", "health", expect=3)
    assert doc["status"] == "UNREACHABLE" and doc["error"]["code"] == "UNAVAILABLE"
    assert ctl("-e", "127.0.0.1:1", "--timeout", "1", "sessions", "list")[0] == 3


def test_usage_errors_exit_2():
    assert ctl()[0] == 2
    assert ctl("sessions")[0] == 2
    assert ctl("sessions", "show")[0] == 2
    assert ctl("frobnicate")[0] == 2
    assert ctl("export", "s")[0] == 2  # --to is required
    assert ctl("--timeout", "-1", "health")[0] == 2
    for timeout in ("nan", "1e300", "1e-9"):  # each once converted to a nonsense of milliseconds
        code, _, err = ctl("--timeout", timeout, "health")
        assert code == 2 and "--timeout: must be between 0.001 and 86400 seconds" in err, err
    code, _, err = ctl("-e", "", "health")  # at once, not after the connect timeout
    assert code == 2 and "--endpoint: empty" in err, err
    # With --json a usage error is a document too.
    doc = ctl_json("sessions", "show", expect=2)
    assert doc["error"]["code"] == "INVALID_ARGUMENT" and "SESSION" in doc["error"]["message"], doc


def test_names_are_printed_without_their_control_characters(endpoint):
    # A group name is any UTF-8 without C0 controls: C1 controls and bidi overrides reach the text
    # output escaped, so that they cannot drive the terminal; --json keeps them as they are.
    odd = "g\u009b31m\u202eevil"
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with muond.RemoteOptimizer([{"params": [("w", w)], "name": odd, "optimizer": "sgd", "lr": 0.1}],
                               endpoint=endpoint, labels={"run": "r7", "a": "b"}) as opt:
        w.grad = torch.ones(4, 4)
        opt.step()
        code, out, _ = ctl("-e", endpoint, "sessions", "show", opt.session_id)
        assert code == 0 and "g\\u{009b}31m\\u{202e}evil" in out, out
        assert "labels        a=b, run=r7\n" in out, out  # what an attach must agree with
        assert "\u009b" not in out and "\u202e" not in out
        shown = ctl_json("-e", endpoint, "sessions", "show", opt.session_id)
        assert odd in json.dumps(shown, ensure_ascii=False)


def test_sessions_list_show_checkpoint_close(start_daemon, tmp_path):
    daemon = start_daemon("--state-dir", tmp_path / "state")
    model, opt = train(daemon.endpoint, "run-a", steps=3)
    e = ("--endpoint", daemon.endpoint)

    listed = ctl_json(*e, "sessions", "list")["sessions"]
    numel = sum(p.numel() for p in model.parameters())
    assert [(s["session_id"], s["last_step"], s["num_parameters"], s["initialized"]) for s in listed] == \
        [("run-a", 3, numel, True)]
    code, out, _ = ctl(*e, "sessions", "list")
    assert code == 0 and out.splitlines()[0].split()[0] == "SESSION" and "run-a" in out.splitlines()[1]

    shown = ctl_json(*e, "sessions", "show", "run-a")
    assert shown["last_step"] == 3 and shown["state_bytes"] > 0
    assert {p["name"] for p in shown["spec"]["parameters"]} == {n for n, _ in model.named_parameters()}
    code, out, _ = ctl(*e, "sessions", "show", "run-a")
    assert code == 0 and "last step     3" in out and ": muon" in out and ": adamw" in out

    assert ctl_json(*e, "sessions", "checkpoint", "run-a") == {"session_id": "run-a", "step": 3}
    assert (tmp_path / "state" / "run-a" / "checkpoint.json").is_file()

    assert ctl(*e, "sessions", "show", "nope")[0] == 4
    assert ctl(*e, "sessions", "checkpoint", "nope")[0] == 4
    assert ctl(*e, "sessions", "close", "nope")[0] == 4

    assert ctl_json(*e, "sessions", "close", "run-a") == {"session_id": "run-a", "closed": True}
    assert ctl_json(*e, "sessions", "list")["sessions"] == []
    assert not (tmp_path / "state" / "run-a").exists()
    opt.close(keep_session=True)


def test_a_session_whose_spec_no_answer_holds_is_shown_without_it(start_daemon, tmp_path):
    # --max-chunk-bytes 1024: a 1 MiB + 1 KiB message limit, which a spec of ~1 MB fits in (its
    # CreateSession) but a ListSessions page (the limit less 64 KiB) does not.
    daemon = start_daemon("--max-chunk-bytes", "1024")
    spec = muond.client.pb.SessionSpec()
    spec.groups.add(name="g").options.optimizer = muond.client.pb.OPTIMIZER_ADAMW
    for i in range(10400):
        spec.parameters.add(name=f"p{i:05d}" + "x" * 80, shape=[2], group="g")
    assert 984_064 < spec.ByteSize() < 1_040_000
    conn = muond.client.Connection(daemon.endpoint)
    conn.create_session("huge-spec", spec)
    e = ("--endpoint", daemon.endpoint)
    shown = ctl_json(*e, "sessions", "show", "huge-spec")
    assert shown["spec"] is None and shown["spec_omitted"] is True and shown["num_tensors"] == 10400
    code, out, _ = ctl(*e, "sessions", "show", "huge-spec")
    assert code == 0 and "spec          not shown: too large for one ListSessions answer" in out
    code, _, err = ctl(*e, "export", "huge-spec", "--to", tmp_path / "huge.safetensors")
    assert code == 1 and "too large for one ListSessions answer" in err, err
    assert [s.session_id for s in conn.list_sessions()] == ["huge-spec"]
    conn.close()


def test_checkpoint_without_state_dir_is_refused_with_exit_1(endpoint):
    _, opt = train(endpoint, "no-state-dir", steps=1)
    try:
        code, _, err = ctl("-e", endpoint, "sessions", "checkpoint", "no-state-dir")
        assert code == 1 and "state-dir" in err
    finally:
        opt.close()


def test_export_from_the_daemon_holds_every_slot(endpoint, tmp_path):
    model, opt = train(endpoint, "exported", steps=2)
    try:
        target = tmp_path / "exported.safetensors"
        doc = ctl_json("-e", endpoint, "export", "exported", "--to", target)
        assert doc["step"] == 2 and doc["file"] == str(target)
        metadata, tensors = read_safetensors(target)
        assert metadata["session_id"] == "exported" and metadata["last_step"] == "2"
        state = opt.state_dict()
        for name, p in model.named_parameters():
            assert torch.equal(tensors[f"{name}/master"], p.detach().float())
            slots = {k.split("/", 1)[1] for k in tensors if k.startswith(name + "/")}
            assert "master" in slots and len(slots) >= 2  # the optimizer's slots too
        assert len(tensors) == doc["tensors"] and state is not None
        assert ctl("-e", endpoint, "export", "nope", "--to", tmp_path / "x.safetensors")[0] == 4
    finally:
        opt.close()


def test_export_keeps_slot_shapes_and_the_loss_scaler(endpoint, tmp_path):
    """NorMuon's second moment is exported at its own shape, (rows, 1) or (1, cols), a bf16 momentum
    as BF16, and a session's loss scaler goes into the file's metadata."""
    model = TinyNet(seed=4)
    groups = muond.default_param_groups(model, muon={"moment2_method": "normuon", "beta2": 0.9,
                                                     "momentum_dtype": "bf16"})
    with muond.RemoteOptimizer(groups, endpoint=endpoint, session="exported-normuon",
                               loss_scaler={"initial_scale": 2.0 ** 10}) as opt:
        for step in range(1, 3):
            opt.scale_loss(loss_of(model, step)).backward()
            opt.step()
            opt.zero_grad()
        target = tmp_path / "normuon.safetensors"
        ctl_json("-e", endpoint, "export", "exported-normuon", "--to", target)
        metadata, tensors = read_safetensors(target)
        state = opt.state_dict()
        assert tuple(tensors["up.weight/moment2"].shape) == tuple(state["state"][0]["moment2"].shape) == (48, 1)
        assert tuple(tensors["down.weight/moment2"].shape) == (1, 48)
        assert torch.equal(tensors["up.weight/moment2"], state["state"][0]["moment2"])
        assert tensors["up.weight/momentum"].dtype == torch.bfloat16
        assert torch.equal(tensors["up.weight/momentum"], state["state"][0]["momentum"])
        assert tensors["up.weight/master"].dtype == torch.float32
        assert float(metadata["loss_scale"]) == opt.loss_scale == 2.0 ** 10
        assert metadata["loss_scale_growth_tracker"] == "2"


def test_state_inspect_verify_and_offline_export(start_daemon, tmp_path):
    state_dir = tmp_path / "state"
    daemon = start_daemon("--state-dir", state_dir, "--durability", "journal")
    model, opt = train(daemon.endpoint, "journaled", steps=4)
    daemon.kill()  # a crash: the checkpoint of the upload plus four journaled steps stay on disk
    opt.close(keep_session=True)

    doc = ctl_json("state", "inspect", state_dir)
    [session] = doc["sessions"]
    assert session["session_id"] == "journaled" and session["checkpoint"]["step"] == 0
    assert [r["step"] for r in session["journal"]["records"]] == [1, 2, 3, 4]
    assert session["last_step"] == 4 and len(session["checkpoint"]["sha256"]) == 64
    code, out, _ = ctl("state", "inspect", state_dir)
    assert code == 0 and "resumes at step 4" in out and "4 records (steps 1–4)" in out

    assert ctl_json("state", "verify", state_dir) == {
        "state_dir": str(state_dir), "sessions": [{"folder": "journaled", "ok": True, "problems": []}],
        "ok": True, "problems": 0}

    # Offline, the session as a daemon restoring the folder holds it: the checkpoint at step 0 and the
    # four journaled steps replayed, the same file `export` from that daemon writes.
    exported = tmp_path / "offline.safetensors"
    doc = ctl_json("export", "journaled", "--state-dir", state_dir, "--to", exported)
    assert (doc["step"], doc["checkpoint_step"], doc["journal_steps_replayed"], doc["source"]) == (4, 0, 4, "state_dir")
    metadata, tensors = read_safetensors(exported)
    assert metadata["last_step"] == "4"
    for name, p in model.named_parameters():
        assert torch.equal(tensors[f"{name}/master"], p.detach()), name
    shutil.copytree(state_dir, tmp_path / "copy")
    restored = start_daemon("--state-dir", tmp_path / "copy")
    assert ctl_json("-e", restored.endpoint, "export", "journaled", "--to", tmp_path / "online.safetensors")["step"] == 4
    assert exported.read_bytes() == (tmp_path / "online.safetensors").read_bytes()
    # The checkpoint alone: the upload's values, the journal left unread.
    doc = ctl_json("export", "journaled", "--state-dir", state_dir, "--checkpoint-only", "--to", exported)
    assert (doc["step"], doc["checkpoint_step"], doc["journal_steps_replayed"], doc["source"]) == (0, 0, 0, "checkpoint")
    assert read_safetensors(exported)[0]["last_step"] == "0"
    code, _, err = ctl("export", "journaled", "--checkpoint-only", "--to", exported)
    assert code == 2 and "--checkpoint-only requires --state-dir" in err, err

    # An altered tensors file is found and named; nothing is written to the state directory.
    [tensor_file] = (state_dir / "journaled").glob("checkpoint-*.safetensors")
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (state_dir / "journaled").iterdir())
    code, out, _ = ctl("state", "verify", state_dir)
    assert code == 1 and f"FAIL  journaled: checkpoint {tensor_file}" in out and "1 problems" in out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (state_dir / "journaled").iterdir()) == before
    assert ctl("state", "verify", tmp_path / "missing")[0] == 4


def test_tls_and_token_options(start_daemon, tls_files, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("ops:s3cret-token\n")
    tokens.chmod(0o600)
    daemon = start_daemon("--tls-cert", tls_files["server_cert"], "--tls-key", tls_files["server_key"],
                          "--auth-token-file", tokens, listen="127.0.0.1:0")
    tls = ("-e", daemon.endpoint, "--tls-ca-file", tls_files["ca"], "--tls-server-name", "localhost")
    token_file = tmp_path / "token"
    token_file.write_text("# the ops token\ns3cret-token\n")

    assert ctl(*tls, "health")[0] == 0  # the health service needs no token
    assert ctl(*tls, "--auth-token-file", token_file, "sessions", "list")[0] == 0
    assert ctl(*tls, "sessions", "list", env={"MUOND_AUTH_TOKEN": "s3cret-token"})[0] == 0
    code, _, err = ctl(*tls, "sessions", "list")
    assert code == 5 and "token" in err, err
    assert ctl(*tls, "sessions", "list", env={"MUOND_AUTH_TOKEN": "wrong"})[0] == 5
    # Plaintext against a TLS daemon, or a CA that does not trust it: unreachable.
    assert ctl("-e", daemon.endpoint, "--timeout", "2", "health")[0] == 3
    assert ctl("-e", daemon.endpoint, "--tls-ca-file", tls_files["other_ca"], "--tls-server-name", "localhost",
               "--timeout", "2", "health")[0] == 3


def test_health_is_not_serving_while_the_daemon_drains(start_daemon):
    """SIGTERM turns the health service to NOT_SERVING (muondctl exits 1) while a call is still in
    flight; when that call ends the daemon exits 0."""
    import signal
    import threading
    import time
    from muond._stubs import pb

    from test_ops_metrics import metrics_address, sample, scrape

    daemon = start_daemon("--shutdown-grace", "120", "--metrics-listen", "127.0.0.1:0")
    address = metrics_address(daemon.endpoint)
    model, opt = train(daemon.endpoint, "draining", steps=0)
    release = threading.Event()

    def upload():
        yield pb.UploadParametersRequest(session_id="draining")
        release.wait(timeout=120)  # holds the upload open: a call in flight

    conn = muond.Connection(daemon.endpoint)
    call = conn._stub.UploadParameters.future(upload())
    # The daemon has the call once its own metrics count it in flight.
    deadline = time.monotonic() + 60
    while sample(scrape(address), "muond_calls_in_flight", method="UploadParameters") != 1:
        assert time.monotonic() < deadline, "the upload never reached the daemon"
        time.sleep(0.02)
    daemon.proc.send_signal(signal.SIGTERM)
    while True:
        code, out, _ = ctl("-e", daemon.endpoint, "--timeout", "5", "health")
        if (code, out) == (1, "NOT_SERVING\n"):
            break
        assert code == 0 and time.monotonic() < deadline, (code, out)
        time.sleep(0.05)
    assert ctl_json("-e", daemon.endpoint, "health", expect=1) == {"status": "NOT_SERVING"}
    release.set()
    try:
        call.result(timeout=60)
    except Exception:
        pass  # an upload without chunks is refused; what matters is that the call ended
    assert daemon.proc.wait(timeout=60) == 0
    conn.close()
