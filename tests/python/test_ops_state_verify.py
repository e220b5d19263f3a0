"""``muondctl state verify`` runs the daemon's own restore checks, so every folder a daemon would
refuse fails verify, naming the file, with the daemon's own words (a repeated journal record, a
folder whose name is not a session id); ``state inspect`` exits 1 when it prints UNREADABLE; and
``export --state-dir`` takes only a valid session id, so it never reads outside the state directory."""

import hashlib
import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from test_ops_muondctl import ctl, ctl_json, train

pytestmark = pytest.mark.ops


def rehash_metadata(folder: Path, edit) -> None:
    """Applies ``edit`` to checkpoint.json and gives it a matching digest again (muond's digest is
    the SHA-256 of the compact, key-sorted JSON without the digest field)."""
    path = folder / "checkpoint.json"
    metadata = json.loads(path.read_text())
    edit(metadata)
    metadata.pop("metadata_sha256", None)
    text = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    metadata["metadata_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    path.write_text(json.dumps(metadata, indent=2))


def rewrite_tensors(folder: Path, edit) -> None:
    """Applies ``edit(header, body)`` to the safetensors file and records its new size and SHA-256."""
    [tensor_file] = folder.glob("checkpoint-*.safetensors")
    data = tensor_file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = bytearray(data[8 + length:])
    edit(header, body)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    data = struct.pack("<Q", len(text)) + text + bytes(body)
    tensor_file.write_bytes(data)

    def record(metadata):
        metadata["tensors"]["bytes"] = len(data)
        metadata["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    rehash_metadata(folder, record)


def journal_records(folder: Path):
    """The journal's records as (offset, payload) pairs."""
    data = (folder / "journal.log").read_bytes()
    records, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"MJR4"
        (length,) = struct.unpack("<Q", data[pos + 4:pos + 12])
        records.append((pos, data[pos + 20:pos + 20 + length]))
        pos += 20 + length
    return records


def frame(payload: bytes) -> bytes:
    head = b"MJR4" + struct.pack("<QI", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def shorten_first_gradient(folder: Path) -> None:
    """Rewrites the journal's first record with its first gradient one element short (framed and
    checksummed as muond writes it, so only the size is wrong)."""
    records = journal_records(folder)
    payload = records[0][1]
    # The payload: the checkpoint generation (u64), the request's length (u32) and the request, the
    # gradient count (u32), then the gradients.
    (request_length,) = struct.unpack("<I", payload[8:12])
    pos = 8 + 4 + request_length + 4
    index, count = struct.unpack("<IQ", payload[pos:pos + 12])
    shorter = payload[:pos] + struct.pack("<IQ", index, count - 1) + payload[pos + 12:pos + 20 + 4 * (count - 1)] + \
        payload[pos + 20 + 4 * count:]
    rest = b"".join(frame(p) for _, p in records[1:])
    (folder / "journal.log").write_bytes(frame(shorter) + rest)


def repeat_second_record(folder: Path) -> None:
    """The journal's second record written twice (each copy framed and checksummed as muond writes
    it): steps 1, 2, 2, 3, 4."""
    payloads = [p for _, p in journal_records(folder)]
    (folder / "journal.log").write_bytes(b"".join(frame(p) for p in payloads[:2] + payloads[1:]))


def retype_first_step(folder: Path) -> None:
    """The journal's first record with its request's step a string (framed and checksummed as muond
    writes it, so only the type is wrong)."""
    records = [p for _, p in journal_records(folder)]
    payload = records[0]
    (request_length,) = struct.unpack("<I", payload[8:12])
    request = json.loads(payload[12:12 + request_length])
    request["step"] = "x"
    text = json.dumps(request).encode()
    retyped = payload[:8] + struct.pack("<I", len(text)) + text + payload[12 + request_length:]
    (folder / "journal.log").write_bytes(b"".join(frame(p) for p in [retyped] + records[1:]))


def inflate_third_length(folder: Path) -> None:
    data = bytearray((folder / "journal.log").read_bytes())
    offset = journal_records(folder)[2][0]
    data[offset + 4:offset + 12] = struct.pack("<Q", 0x7fffffff)
    (folder / "journal.log").write_bytes(bytes(data))


def transpose_first_matrix(header, body):
    for name, info in header.items():
        if name != "__metadata__" and len(info["shape"]) == 2 and info["shape"][0] != info["shape"][1]:
            info["shape"] = info["shape"][::-1]
            return
    raise AssertionError("no non-square matrix")


def nan_master(header, body):
    for name, info in header.items():
        if name.endswith("/master") and info["dtype"] == "F32":
            begin = info["data_offsets"][0]
            body[begin:begin + 4] = struct.pack("<f", float("nan"))
            return
    raise AssertionError("no F32 master")


DAMAGE = {
    "another session's checkpoint": lambda f: rehash_metadata(f, lambda m: m.update(session_id="someone-else")),
    "a step count above last_step": lambda f: rehash_metadata(
        f, lambda m: m["step_counts"].update({k: 99 for k in m["step_counts"]})),
    "an unknown optimizer": lambda f: rehash_metadata(
        f, lambda m: m["spec"]["groups"][0].setdefault("options", {}).update(optimizer="OPTIMIZER_NOPE")),
    "a transposed tensor": lambda f: rewrite_tensors(f, transpose_first_matrix),
    "a NaN master": lambda f: rewrite_tensors(f, nan_master),
    "a journal gradient one element short": shorten_first_gradient,
    "an inflated journal length": inflate_third_length,
    "a repeated journal record": repeat_second_record,
    "a journal step that is no number": retype_first_step,
    "a linked journal": lambda f: ((f / "journal.log").unlink(), (f / "journal.log").symlink_to("/dev/zero")),
    "deeply nested JSON": lambda f: (f / "checkpoint.json").write_text("[" * 200000 + "]" * 200000),
}


@pytest.fixture(scope="module")
def journaled_state(tmp_path_factory):
    """A state directory left by a killed daemon: a checkpoint at step 0 and four journaled steps."""
    from conftest import Daemon, _daemon_binary
    root = tmp_path_factory.mktemp("journaled")
    daemon = Daemon(_daemon_binary(), root / "daemon", ("--state-dir", root / "state", "--durability", "journal"),
                    listen="127.0.0.1:0")
    try:
        _, opt = train(daemon.endpoint, "run", steps=4)
        daemon.kill()
        opt.close(keep_session=True)
    finally:
        daemon.stop()
    return root / "state"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_verify_fails_every_folder_the_daemon_refuses(journaled_state, tmp_path, damage):
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    assert ctl("state", "verify", state_dir)[0] == 0, "the undamaged copy verifies"
    DAMAGE[damage](state_dir / "run")
    code, out, err = ctl("state", "verify", state_dir)
    assert code == 1, f"{damage}: exit {code}: {out}{err}"
    assert "FAIL  run: " in out and str(state_dir / "run") in out, out


def restored_by_a_daemon(state_dir, tmp_path):
    """(the sessions a daemon on `state_dir` restored, its log)."""
    from conftest import Daemon, _daemon_binary
    import muond
    daemon = Daemon(_daemon_binary(), tmp_path / "daemon", ("--state-dir", state_dir, "--log-level", "info"))
    try:
        conn = muond.Connection(daemon.endpoint)
        try:
            sessions = [s.session_id for s in conn.list_sessions()]
        finally:
            conn.close()
        return sessions, daemon.log_tail(200)
    finally:
        daemon.stop()


def test_verify_refuses_what_restore_refuses_with_the_same_words(journaled_state, tmp_path):
    # A repeated journal record: the daemon quarantines the folder, verify fails it, the same message.
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    repeat_second_record(state_dir / "run")
    code, out, _ = ctl("state", "verify", state_dir)
    assert code == 1 and "is unusable: step 2 follows step 2" in out, out
    sessions, log = restored_by_a_daemon(state_dir, tmp_path)
    assert sessions == [] and "is unusable: step 2 follows step 2" in log, log


def test_verify_fails_a_folder_the_daemon_ignores_with_its_words(journaled_state, tmp_path):
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    shutil.copytree(state_dir / "run", state_dir / "run copy")  # renamed by hand: not a session id
    (state_dir / "+quarantine").mkdir()  # known, not a session: passes without a word
    code, out, _ = ctl("state", "verify", state_dir)
    message = f"ignoring {state_dir}/run copy: the folder's name is not a session id"
    assert code == 1 and f"FAIL  {message}" in out and "+quarantine" not in out, out
    assert "ok    run:" in out, "the session beside it still verifies"
    sessions, log = restored_by_a_daemon(state_dir, tmp_path)
    assert sessions == ["run"] and message in log, log


def test_inspect_exits_1_when_a_folder_is_unreadable(journaled_state, tmp_path):
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    assert ctl("state", "inspect", state_dir)[0] == 0
    inflate_third_length(state_dir / "run")
    code, out, _ = ctl("state", "inspect", state_dir)
    assert code == 1 and "run: UNREADABLE: " in out and "journal.log" in out, out
    assert ctl("--json", "state", "inspect", state_dir)[0] == 1


def test_a_journal_record_of_the_wrong_types_is_named_by_every_command(journaled_state, tmp_path):
    # Decoded as a restore decodes it: exit 1 naming the record, where inspect and verify aborted.
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    retype_first_step(state_dir / "run")
    for command in ("inspect", "verify", "digest"):
        code, out, err = ctl("state", command, state_dir)
        assert code == 1 and "the step request does not decode" in out, f"{command}: exit {code}: {out}{err}"
    assert "journal.log: record 1: " in ctl("state", "inspect", state_dir)[1]


def test_a_linked_checkpoint_is_refused_by_every_command(journaled_state, tmp_path):
    # The daemon quarantines a folder whose checkpoint.json is a link: no command calls it empty.
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    metadata = state_dir / "run" / "checkpoint.json"
    metadata.unlink()
    metadata.symlink_to(tmp_path / "nowhere.json")
    for args in (("state", "digest", state_dir), ("state", "verify", state_dir), ("state", "inspect", state_dir),
                 ("export", "run", "--state-dir", state_dir, "--to", tmp_path / "out.safetensors")):
        code, out, err = ctl(*args)
        assert code == 1 and "symbolic link" in out + err, f"{args}: exit {code}: {out}{err}"
    assert not (tmp_path / "out.safetensors").exists()


def test_inspect_counts_an_asynchronous_session_in_global_steps(tmp_path):
    # Each record of an asynchronous session is a rank's push; the restore replays it as the global
    # step it made, and inspect says the step a restore resumes from.
    from conftest import Daemon, _daemon_binary
    import muond
    from helpers import TinyNet, loss_of
    daemon = Daemon(_daemon_binary(), tmp_path / "daemon",
                    ("--state-dir", tmp_path / "state", "--durability", "journal"), listen="127.0.0.1:0")
    try:
        ranks = []
        for rank in range(2):
            model = TinyNet(seed=5)
            ranks.append((model, muond.RemoteOptimizer(
                muond.default_param_groups(model), endpoint=daemon.endpoint, session="pushes", world_size=2,
                rank=rank, sync_mode="async", max_staleness=10)))
        for push in range(1, 4):
            for model, opt in ranks:
                loss_of(model, push).backward()
                opt.step()
                opt.zero_grad()
        daemon.kill()
        for _, opt in ranks:
            opt.close(keep_session=True)
    finally:
        daemon.stop()
    [session] = ctl_json("state", "inspect", tmp_path / "state")["sessions"]
    assert [r["step"] for r in session["journal"]["records"]] == [1, 2, 3, 4, 5, 6]
    assert [r["rank"] for r in session["journal"]["records"]] == [0, 1, 0, 1, 0, 1]
    assert session["last_step"] == 6
    assert ctl("state", "verify", tmp_path / "state")[0] == 0


def test_export_takes_only_a_session_id(journaled_state, tmp_path):
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    outside = tmp_path / "outside"
    shutil.copytree(state_dir / "run", outside / "x")
    code, out, err = ctl("export", "../outside/x", "--state-dir", state_dir, "--to", tmp_path / "out.safetensors")
    assert code == 2 and "SESSION: '../outside/x' is not a session id" in err, f"{out}{err}"
    assert not (tmp_path / "out.safetensors").exists()
    assert ctl_json("export", "run", "--state-dir", state_dir, "--to", tmp_path / "run.safetensors")["step"] == 4


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_export_refuses_every_folder_the_daemon_refuses(journaled_state, tmp_path, damage):
    """An offline export restores the folder as the daemon does: what the restore refuses is refused,
    exit 1, naming the folder's file, and no file is written."""
    state_dir = tmp_path / "state"
    shutil.copytree(journaled_state, state_dir, symlinks=True)
    DAMAGE[damage](state_dir / "run")
    out_file = tmp_path / "run.safetensors"
    code, out, err = ctl("export", "run", "--state-dir", state_dir, "--to", out_file)
    assert code == 1 and out == "", f"{damage}: exit {code}: {out}{err}"
    assert str(state_dir / "run") in err, f"{damage}: {err}"
    assert not out_file.exists()
    if "journal" in damage:  # the checkpoint alone still comes out, its journal unread
        doc = ctl_json("export", "run", "--state-dir", state_dir, "--checkpoint-only", "--to", out_file)
        assert (doc["step"], doc["source"]) == (0, "checkpoint")


def test_a_session_under_raised_limits_is_restored_offline_under_the_same(tmp_path):
    """A daemon started with --max-tensor-rank 10 holds a 9-D parameter; restoring its state
    directory offline under the default limits refuses it, as a daemon started without the flag
    would, and muondctl's flags of the same names restore it: verify, digest and export."""
    from conftest import Daemon, _daemon_binary
    import torch
    import muond
    state_dir = tmp_path / "state"
    daemon = Daemon(_daemon_binary(), tmp_path / "daemon",
                    ("--state-dir", state_dir, "--durability", "journal", "--max-tensor-rank", "10"),
                    listen="127.0.0.1:0")
    try:
        p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(1, 1, 1, 1, 1, 1, 1, 2, 3))
        opt = muond.RemoteOptimizer([{"params": [p], "optimizer": "adamw", "lr": 0.01}],
                                    endpoint=daemon.endpoint, session="deep")
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        digest = opt.state_digest()
        opt.close(keep_session=True)
    finally:
        assert daemon.stop() == 0
    code, out, err = ctl("state", "verify", state_dir)
    assert code == 1 and "--max-tensor-rank" in out + err, f"exit {code}: {out}{err}"
    raised = ("--max-tensor-rank", "10")
    assert ctl("state", "verify", state_dir, *raised)[0] == 0
    [session] = ctl_json("state", "digest", state_dir, "deep", *raised)["sessions"]
    assert (session["step"], session["digest"]) == (2, digest.digest)
    exported = ctl_json("export", "deep", "--state-dir", state_dir, "--to", tmp_path / "deep.safetensors", *raised)
    assert exported["step"] == 2
    assert ctl("export", "deep", "--state-dir", state_dir, "--to", tmp_path / "refused.safetensors")[0] == 1
    assert not (tmp_path / "refused.safetensors").exists()
