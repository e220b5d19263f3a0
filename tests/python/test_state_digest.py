"""The state digest against real daemons (``RemoteOptimizer.state_digest()``, ``GetStateDigest``):
equal for equal states (two sessions given the same steps, a session after a restart from
--state-dir in either durability mode), different after one more step and after any one bit of a
master or an optimizer slot (fp32 or bf16), a step count or the loss scaler's state changed; it
follows the documented format; a sharded session's digest combines its shards' by the documented
rule, and survives a restart of every shard."""

import hashlib
import struct
import uuid

import grpc
import pytest
import torch

import muond
from helpers import TinyNet, loss_of


def groups(model):
    # A bf16 momentum, so that one slot is hashed as its 16-bit values.
    return muond.default_param_groups(model, muon={"momentum_dtype": "bf16"})


def train(model, opt, steps):
    for step in steps:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def flip_one_bit(tensor):
    """``tensor`` with the lowest bit of its first element flipped (as its stored bits)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[tensor.dtype]
    flipped = tensor.clone()
    flat = flipped.view(-1).view(bits)
    flat[0] ^= 1
    return flipped


def test_same_steps_same_digest_and_one_more_step_changes_it(endpoint):
    digests = []
    for _ in range(2):
        model = TinyNet(seed=81)
        with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
            train(model, opt, range(1, 4))
            digests.append(opt.state_digest())
            assert opt.state_digest() == digests[-1]  # reading it changes nothing
            train(model, opt, range(4, 5))
            digests.append(opt.state_digest())
    first, after_one_more, again, _ = digests
    assert first == again  # another session, the same steps: the same state
    assert first.step == 3 and after_one_more.step == 4
    assert first.algorithm == "sha256" and len(first.digest) == 64
    assert first.format == "muond-state-v1" and first.shards == ()
    assert after_one_more.digest != first.digest
    # Masters of every parameter; muon momentum (bf16) and adamw's two moments.
    model = TinyNet(seed=81)
    assert first.num_tensors > len(list(model.parameters()))
    assert first.num_bytes > 0


def test_any_changed_bit_changes_the_digest(endpoint):
    model = TinyNet(seed=82)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        train(model, opt, range(1, 3))
        before = opt.state_digest()
        saved = opt.state_dict()
        names = [name for name, _ in model.named_parameters()]
        muon_index = names.index("up.weight")
        assert saved["state"][muon_index]["momentum"].dtype == torch.bfloat16
        edits = [(muon_index, "master"), (muon_index, "momentum"), (names.index("up.bias"), "exp_avg_sq")]
        seen = {before.digest}
        for index, slot in edits:
            changed = {**saved, "state": {i: dict(s) for i, s in saved["state"].items()}}
            changed["state"][index][slot] = flip_one_bit(saved["state"][index][slot])
            opt.load_state_dict(changed)
            digest = opt.state_digest()
            assert digest.step == before.step
            assert digest.digest not in seen, (index, slot)
            seen.add(digest.digest)
        changed = {**saved, "state": {i: dict(s) for i, s in saved["state"].items()}}
        changed["state"][muon_index]["step"] = saved["state"][muon_index]["step"] - 1
        opt.load_state_dict(changed)
        assert opt.state_digest().digest not in seen  # a step count is state too
        opt.load_state_dict(saved)
        assert opt.state_digest() == before  # the same bits again: the same digest


def documented_digest(opt, spec):
    """The digest of ``opt``'s state computed here from ``state_dict()`` by the format
    docs/protocol.md gives (muond-state-v1), for a session without a loss scaler."""
    saved = opt.state_dict()
    index = {name: i for i, name in enumerate(saved["muond"]["names"])}
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()

    out = string("muond-state-v1") + struct.pack("<q", saved["muond"]["last_step"]) + b"\0"
    out += struct.pack("<Q", len(spec.parameters))
    for p in spec.parameters:
        entry = saved["state"][index[p.name]]
        slots = ["master"] + sorted(slot for slot in entry if slot not in ("master", "step"))
        out += string(p.name) + struct.pack("<q", entry["step"]) + struct.pack("<Q", len(slots))
        for slot in slots:
            tensor = entry[slot].contiguous()
            data = (tensor if tensor.dtype == torch.float32 else tensor.view(torch.int16)).numpy().tobytes()
            out += string(p.name) + string(slot) + string(dtypes[tensor.dtype])
            out += struct.pack("<Q", tensor.dim()) + b"".join(struct.pack("<q", d) for d in tensor.shape)
            out += struct.pack("<Q", len(data)) + data
    return hashlib.sha256(out).hexdigest()


def test_the_digest_follows_the_documented_format(endpoint):
    model = TinyNet(seed=86)
    session = f"digest-format-{uuid.uuid4().hex[:8]}"
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, session=session) as opt:
        train(model, opt, range(1, 3))
        conn = muond.Connection(endpoint)
        [summary] = [s for s in conn.list_sessions() if s.session_id == session]
        conn.close()
        assert opt.state_digest().digest == documented_digest(opt, summary.spec)


def test_the_loss_scalers_state_is_part_of_the_digest(endpoint):
    model = TinyNet(seed=87)
    scaler = {"initial_scale": 2.0 ** 16, "window": 3, "hysteresis": 2}
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, loss_scaler=scaler) as opt:
        for step in range(1, 3):
            opt.scale_loss(loss_of(model, step)).backward()
            opt.step()
            opt.zero_grad()
        before = opt.state_digest()
        saved = opt.state_dict()
        tracker = saved["muond"]["loss_scaler"]["growth_tracker"]
        changed = {**saved, "muond": {**saved["muond"],
                                      "loss_scaler": {**saved["muond"]["loss_scaler"],
                                                      "growth_tracker": (tracker + 1) % 3}}}
        opt.load_state_dict(changed)
        assert opt.state_digest().digest != before.digest
        opt.load_state_dict(saved)
        assert opt.state_digest() == before


def test_unknown_or_empty_sessions_are_refused(endpoint):
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError) as info:
        conn.state_digest(f"missing-{uuid.uuid4().hex[:8]}")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.rpc == "GetStateDigest"
    with pytest.raises(muond.MuondError) as info:
        conn.state_digest("no spaces allowed")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    conn.close()


@pytest.mark.parametrize("durability", ["snapshot", "journal"])
def test_a_restart_restores_the_same_digest(start_daemon, tmp_path, durability):
    state_dir = tmp_path / "state"
    flags = ("--state-dir", state_dir, "--durability", durability)
    daemon = start_daemon(*flags, workdir=tmp_path / "daemon")
    session = f"digest-{durability}-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=83)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session)
    train(model, opt, range(1, 3))
    if durability == "snapshot":
        opt.checkpoint()
    else:
        opt.checkpoint()
        train(model, opt, range(3, 5))  # in the journal only
    live = opt.state_digest()
    opt.close(keep_session=True)
    if durability == "snapshot":
        daemon.stop()
    else:
        daemon.kill()  # no final checkpoint: the restart replays the journal
    daemon = start_daemon(*flags, workdir=tmp_path / "daemon")
    model = TinyNet(seed=83)
    with muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session) as resumed:
        assert resumed.last_step == live.step
        assert resumed.state_digest() == live
        train(model, resumed, range(live.step + 1, live.step + 2))
        assert resumed.state_digest().digest != live.digest


def test_a_sharded_digest_combines_the_shards_in_order(start_daemon, tmp_path):
    flags = [("--state-dir", tmp_path / f"state-{k}") for k in range(2)]
    daemons = [start_daemon(*flags[k], workdir=tmp_path / f"daemon-{k}") for k in range(2)]
    endpoints = [d.endpoint for d in daemons]
    session = f"digest-shards-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=84)
    with muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session) as opt:
        train(model, opt, range(1, 3))
        combined = opt.state_digest()
        parts = []
        for endpoint in endpoints:
            conn = muond.Connection(endpoint)
            parts.append(conn.state_digest(session))
            conn.close()
        text = "muond-sharded-state-v1\n" + "".join(p.digest + "\n" for p in parts)
        assert combined.digest == hashlib.sha256(text.encode()).hexdigest()
        assert combined.format == "muond-sharded-state-v1" and combined.step == 2
        assert combined.shards == tuple(p.digest for p in parts)
        assert combined.num_tensors == sum(p.num_tensors for p in parts)
        assert combined.num_bytes == sum(p.num_bytes for p in parts)
        assert opt.state_digest() == combined
        opt.close(keep_session=True)

    # Both daemons restarted (each checkpoints on SIGTERM): the same combined digest, at the same
    # step; one more step changes it.
    for k, daemon in enumerate(daemons):
        daemon.stop()
        daemons[k] = start_daemon(*flags[k], workdir=tmp_path / f"daemon-{k}", listen=endpoints[k])
    model = TinyNet(seed=84)
    with muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session) as opt:
        assert opt.last_step == 2
        assert opt.state_digest() == combined
        train(model, opt, range(3, 4))
        assert opt.state_digest().digest != combined.digest


def test_combining_shards_at_different_steps_is_refused():
    shards = [muond.StateDigest(step, "sha256", f"{step:064x}", "muond-state-v1", 1, 4) for step in (3, 4)]
    with pytest.raises(muond.MuondError) as info:
        muond.state_digest.combine(shards, ["a:1", "b:2"])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "shard 0 (a:1) at step 3" in info.value.details
    assert muond.state_digest.combine(shards[:1]) == shards[0]
