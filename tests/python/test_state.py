"""state_dict()/load_state_dict() round trips through GetState/SetState, and resuming a session
by attaching to it."""

import io
import uuid

import grpc
import pytest
import torch

import muond
from checkpoint_helpers import hand_back_as_set_optimizer_state_dict, keep_as_get_optimizer_state_dict
from helpers import TinyNet, loss_of, params_of


def groups(model):
    return muond.default_param_groups(model, muon={"weight_decay": 0.01})


def train(model, opt, steps):
    for step in steps:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip(endpoint):
    model = TinyNet(seed=20)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint)
    train(model, opt, range(1, 5))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    at_step_4 = params_of(model)
    train(model, opt, range(5, 8))
    expected = params_of(model)
    opt.close()

    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["muond"]["last_step"] == 4
    first = saved["state"][0]
    assert set(first) == {"master", "momentum", "step"} and first["step"] == 4
    assert {"master", "exp_avg", "exp_avg_sq", "step"} <= set(saved["state"][2])

    other = TinyNet(seed=99)  # different weights: load_state_dict must bring the masters back
    opt2 = muond.RemoteOptimizer(groups(other), endpoint=endpoint)
    opt2.load_state_dict(saved)
    assert opt2.last_step == 4
    for name, p in other.named_parameters():
        assert torch.equal(p.detach(), at_step_4[name]), name
    train(other, opt2, range(5, 8))
    assert opt2.last_step == 7
    for name, p in other.named_parameters():
        assert torch.allclose(p.detach(), expected[name], rtol=1e-6, atol=1e-7), name
    opt2.close()


@pytest.mark.parametrize("flatten", [False, True])
def test_a_state_dict_loads_as_torch_distributed_checkpoint_hands_it_back(endpoint, flatten):
    # The session never steps for the helpers (checkpoint_helpers.py re-enacts them), and a load
    # of what they keep (flattened or not) continues bit for bit.
    model = TinyNet(seed=22)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint)
    train(model, opt, range(1, 5))
    names = {id(p): name for name, p in model.named_parameters()}
    kept = keep_as_get_optimizer_state_dict(opt, names, flatten)
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    at_step_4 = params_of(model)
    train(model, opt, range(5, 8))
    expected = params_of(model)
    opt.close()

    other = TinyNet(seed=98)
    opt2 = muond.RemoteOptimizer(groups(other), endpoint=endpoint)
    names2 = {id(p): name for name, p in other.named_parameters()}
    buffer.seek(0)
    loaded = torch.load(buffer)
    if flatten:
        # Loaded before this optimizer read its state once: opt.state names nothing to ask for.
        with pytest.raises(ValueError, match="call get_optimizer_state_dict first"):
            opt2.load_state_dict(hand_back_as_set_optimizer_state_dict(opt2, names2, loaded, flatten))
        keep_as_get_optimizer_state_dict(opt2, names2, flatten)  # as a checkpointer makes what it loads into
        loaded = hand_back_as_set_optimizer_state_dict(opt2, names2, loaded, flatten)
    else:
        # Refused before anything is sent: a parameter's state left out (the helpers leave out
        # those that do not require grad).
        first = next(iter(loaded["state"]))
        frozen = dict(loaded, state={k: v for k, v in loaded["state"].items() if k != first})
        with pytest.raises(ValueError, match=f"no state of '{first}'"):
            opt2.load_state_dict(frozen)
        lacking = dict(loaded, state={**loaded["state"], first: dict(loaded["state"][first], master={})})
        with pytest.raises(ValueError, match=f"no state of '{first}'"):  # what a checkpoint lacking it hands back
            opt2.load_state_dict(lacking)
        loaded = hand_back_as_set_optimizer_state_dict(opt2, names2, loaded)
    assert opt2.last_step == 0
    opt2.load_state_dict(loaded)
    assert opt2.last_step == 4
    for name, p in other.named_parameters():
        assert torch.equal(p.detach(), at_step_4[name]), name
    train(other, opt2, range(5, 8))
    for name, p in other.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name
    # opt.state names what the daemon holds, with no tensors: code that walks it to move tensors
    # passes by, and a value used as a tensor says where it is read.
    first = opt2.param_groups[0]["params"][0]
    assert {"master", "step"} <= set(opt2.state[first])
    for entry in opt2.state.values():
        for key, value in entry.items():
            if torch.is_tensor(value):
                entry[key] = value.to("cpu")
    with pytest.raises(AttributeError, match=r"held by the daemon, not in opt.state: "
                                             r"opt.state_dict\(\)\['state'\]\[0\]\['master'\]"):
        opt2.state[first]["master"].norm()
    opt2.close()


def test_load_state_dict_restores_group_lr(endpoint):
    model = TinyNet(seed=21)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        opt.param_groups[0]["lr"] = 0.005
        saved = opt.state_dict()
        opt.param_groups[0]["lr"] = 0.1
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.005


def test_torchs_state_dict_hooks_run_as_torch_runs_them(endpoint):
    # torch >= 2.1's register_*state_dict*_hook fill these tables (OrderedDicts on the optimizer);
    # torch 1.13, which runs here, has neither the tables nor the register methods, so the test
    # fills them as those methods do.
    from collections import OrderedDict  # noqa: PLC0415
    model = TinyNet(seed=23)
    calls = []
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        train(model, opt, range(1, 3))

        def post(o, state_dict):
            calls.append(("post", o is opt, state_dict["muond"]["last_step"]))
            return dict(state_dict, extra="added by a hook")

        def load_pre(o, state_dict):
            calls.append(("load_pre", "extra" in state_dict))
            del state_dict["extra"]  # in place, on load_state_dict's copy
            return dict(state_dict, param_groups=[dict(g, lr=0.125) for g in state_dict["param_groups"]])

        opt._optimizer_state_dict_pre_hooks = OrderedDict({0: lambda o: calls.append(("pre", o is opt))})
        opt._optimizer_state_dict_post_hooks = OrderedDict({0: post})
        opt._optimizer_load_state_dict_pre_hooks = OrderedDict({0: load_pre})
        opt._optimizer_load_state_dict_post_hooks = OrderedDict(
            {0: lambda o: calls.append(("load_post", o.param_groups[0]["lr"]))})
        saved = opt.state_dict()
        assert saved["extra"] == "added by a hook"
        opt.load_state_dict(saved)
        assert "extra" in saved, "the hooks work on a copy: the caller's dict is unchanged"
        assert calls == [("pre", True), ("post", True, 2), ("load_pre", True), ("load_post", 0.125)]


def test_state_dict_with_different_fixed_options_is_refused(endpoint):
    model = TinyNet(seed=22)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint) as opt:
        saved = opt.state_dict()
    other = muond.default_param_groups(TinyNet(seed=22), muon={"ns_steps": 3})
    with muond.RemoteOptimizer(other, endpoint=endpoint) as opt2:
        with pytest.raises(ValueError, match="ns_steps"):
            opt2.load_state_dict(saved)


def test_resume_by_attaching_to_the_session(endpoint):
    session = f"resume-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=23)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint, session=session)
    assert not opt.attached
    train(model, opt, range(1, 4))
    at_step_3 = params_of(model)
    opt.close(keep_session=True)  # the trainer goes away; the session stays on the daemon

    restarted = TinyNet(seed=24)  # a restarted trainer with freshly initialized weights
    opt = muond.RemoteOptimizer(groups(restarted), endpoint=endpoint, session=session)
    assert opt.attached and opt.last_step == 3
    for name, p in restarted.named_parameters():
        assert torch.equal(p.detach(), at_step_3[name]), name
    train(restarted, opt, range(4, 7))
    assert opt.last_step == 6
    opt.close()

    straight = TinyNet(seed=23)  # the same six steps without the interruption
    with muond.RemoteOptimizer(groups(straight), endpoint=endpoint) as ref:
        train(straight, ref, range(1, 7))
    for (name, p), q in zip(restarted.named_parameters(), straight.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=1e-6, atol=1e-7), name


def test_attaching_with_a_different_spec_is_refused(endpoint):
    session = f"conflict-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=25)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, session=session):
        with pytest.raises(muond.MuondError) as info:
            muond.RemoteOptimizer(muond.default_param_groups(model, muon={"momentum": 0.9}),
                                  endpoint=endpoint, session=session)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details


def test_close_ends_the_session(endpoint):
    model = TinyNet(seed=26)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint)
    conn = muond.client.Connection(endpoint)
    assert opt.session_id in {s.session_id for s in conn.list_sessions()}
    opt.close()
    opt.close()  # idempotent
    assert opt.session_id not in {s.session_id for s in conn.list_sessions()}
    conn.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    calls = []
    with pytest.raises(RuntimeError, match="closed"):
        opt.step(lambda: calls.append(1))
    assert not calls, "a closed optimizer refuses before running the closure's forward and backward"


@pytest.mark.once  # a listing's pages: no step is taken
def test_sessions_past_one_answer_are_listed_page_by_page(start_daemon):
    # --max-chunk-bytes 1024 makes the daemon's message limit 1 MiB + 1 KiB; 240 sessions with
    # about 5 KiB of labels each pass it, so the daemon answers in pages.
    daemon = start_daemon("--max-chunk-bytes", "1024", "--max-sessions", "240")
    conn = muond.client.Connection(daemon.endpoint)
    spec = muond.client.pb.SessionSpec()
    spec.groups.add(name="g").options.optimizer = muond.client.pb.OPTIMIZER_ADAMW
    spec.parameters.add(name="w", shape=[2, 2], group="g")
    for i in range(16):
        spec.labels[f"label-{i}" + "k" * 50] = "v" * 256
    ids = [f"listed-{i:03d}" for i in range(240)]
    for session_id in ids:
        conn.create_session(session_id, spec)
    first = conn._stub.ListSessions(muond.client.pb.ListSessionsRequest(), timeout=30)
    assert 0 < len(first.sessions) < len(ids) and first.next_page_token
    assert [s.session_id for s in conn.list_sessions()] == ids
    conn.close()


@pytest.mark.once
def test_a_page_token_that_does_not_advance_is_refused(endpoint, monkeypatch):
    conn = muond.client.Connection(endpoint)
    listed = conn._stub.ListSessions

    def looping(request, **kwargs):
        page = listed(request, **kwargs)
        page.next_page_token = request.page_token or "a"  # then the same page again
        return page
    monkeypatch.setattr(conn._stub, "ListSessions", looping)
    with pytest.raises(muond.MuondError, match="next_page_token does not follow") as refused:
        conn.list_sessions()
    assert refused.value.code == grpc.StatusCode.INTERNAL
    conn.close()


def test_a_state_dict_of_other_names_is_refused(endpoint):
    # Two parameters of equal shapes saved as (a, b) and loaded where they are (b, a): loading by
    # position would swap their states without a word.
    def opt_of(names, seed):
        torch.manual_seed(seed)
        params = [(n, torch.nn.Parameter(torch.randn(3, 3))) for n in names]
        return muond.RemoteOptimizer([{"params": params, "optimizer": "adamw"}], endpoint=endpoint)

    saving = opt_of(["a", "b"], 1)
    for p in saving._params:
        p.grad = torch.ones_like(p)
    saving.step()
    saved = saving.state_dict()
    saving.close()
    loading = opt_of(["b", "a"], 2)
    with pytest.raises(ValueError, match=r"from position 0 on \(saved 'a', here 'b'\).*nothing was loaded"):
        loading.load_state_dict(saved)
    assert loading.last_step == 0
    loading.close()
