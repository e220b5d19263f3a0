"""The Python client's option facts (muond.option_facts) against the daemon's use of the same option
table (kernels/optim/option_table.h, option_fields.h, options.h; printed by the print_option_table
tool the build makes): the optimizers, the coefficient sets tuple for tuple, the accepted values of
every named option in the daemon's order, which optimizer each option applies to, and every default
as DefaultOptions sets it. And GetServerInfo's lists against the same table, and the package's copy
of the table against proto/'s."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from muond import option_facts, options
from muond._stubs import pb, pb_grpc

import grpc

# Options the Python client spells differently from the wire, or keeps per parameter rather than
# per group: (betas) is beta1 and beta2; qkv_split, num_query_groups, tp_blocks and tp_block_dim
# travel with the parameter;
# a custom coefficient list is given as ns_coefficients.
_PYTHON_TO_WIRE = {"betas": ("beta1", "beta2"), "qkv_split": (), "num_query_groups": (),
                   "tp_blocks": (), "tp_block_dim": ()}
_WIRE_ONLY = {"optimizer", "ns_custom_coefficients"}


@pytest.fixture(scope="module")
def table():
    tool = os.environ.get("MUOND_OPTION_TABLE_TOOL")
    if not tool or not os.path.exists(tool):
        pytest.skip("no print_option_table tool: build the tests (cmake --build build) or set "
                    "MUOND_OPTION_TABLE_TOOL")
    return json.loads(subprocess.run([tool], check=True, capture_output=True, text=True).stdout)


def test_optimizers_and_coefficient_sets(table):
    assert list(options.OPTIMIZERS) == table["options"]["optimizer"]["choices"]
    assert sorted(options.COEFFICIENT_SETS) == sorted(table["coefficient_sets"])
    assert sorted(options.COEFFICIENTS_AFTER) == sorted(table["coefficient_sets"])


def test_named_values(table):
    named = {name: o["choices"] for name, o in table["options"].items()
             if o["choices"] and name != "optimizer"}
    assert {name: list(values) for name, values in option_facts.NAMED_VALUES.items()} == named
    assert options._CHOICES is option_facts.NAMED_VALUES


def test_coefficient_sets_tuple_for_tuple(table):
    for name, daemon in table["coefficients"].items():
        ours = [v for t in option_facts.COEFFICIENT_SETS[name] for v in t]
        assert ours == pytest.approx([v for t in daemon["tuples"] for v in t], rel=1e-15), name
        assert option_facts.COEFFICIENTS_AFTER[name] == daemon["after"], name
        assert list(option_facts.GRAM_RESTARTS.get(name, ())) == daemon["gram_restarts"], name


def test_defaults(table):
    """The defaults the daemon's DefaultOptions sets, each through its own GroupOptions member, are
    the Python client's; where the client leaves an option unset (None), the table's default is
    what the daemon applies."""
    for optimizer, daemon in table["defaults"].items():
        ours = dict(option_facts.DEFAULTS[optimizer])
        if "betas" in ours:
            ours["beta1"], ours["beta2"] = ours.pop("betas")
        for name, value in ours.items():
            if value is None and name in daemon:
                row = option_facts.ROWS[name]
                ours[name] = row["default"].get(optimizer) if isinstance(row["default"], dict) \
                    else row["default"]
        assert {name: ours[name] for name in daemon} == daemon, optimizer
        assert any(v is None for v in option_facts.DEFAULTS[optimizer].values()), optimizer


def test_which_optimizer_each_option_applies_to(table):
    for optimizer in options.OPTIMIZERS:
        wire_names = set()
        for name in options.DEFAULTS[optimizer]:
            wire_names.update(_PYTHON_TO_WIRE.get(name, (name,)))
        if optimizer in ("muon", "dion2"):
            wire_names.add("ns_custom_coefficients")  # ns_coefficients=[(a, b, c), ...]
        expected = {name for name, o in table["options"].items()
                    if optimizer in o["applies_to"] and name != "optimizer"}
        assert wire_names == expected, optimizer


def test_server_info_lists_the_table(table, endpoint):
    with grpc.insecure_channel(endpoint) as channel:
        info = pb_grpc.MuondStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert list(info.optimizers) == table["options"]["optimizer"]["choices"]
    assert list(info.ns_coefficient_sets) == table["coefficient_sets"]


def test_the_package_carries_the_tables_own_copy():
    source = Path(__file__).resolve().parents[2] / "proto" / "muond" / "v1" / "group_options.json"
    assert option_facts.TABLE_FILE.read_bytes() == source.read_bytes()
    assert option_facts.TABLE_FILE.parent.name == "_proto"


@pytest.mark.parametrize("group,refusal", [
    (dict(optimizer="dion2", dion2_fraction=1.5), "dion2_fraction must be in (0, 1], got 1.5"),
    (dict(optimizer="dion2", dion2_ef_decay=-1.0), "dion2_ef_decay must be in [0, 1], got -1"),
    (dict(optimizer="muon", moment2_method="namo_d", namo_clamp=1.5),
     "namo_clamp must be in [0, 1], got 1.5"),
    (dict(optimizer="adamw", betas=(0.9, 1.0)), "betas[1] must be in [0, 1), got 1"),
    (dict(optimizer="muon", ns_steps=0), "ns_steps must be >= 1, got 0"),
    (dict(optimizer="adamw", lr=float("inf")), "lr must be in [0, 100], got inf"),
    # Under fp32's normal range eps rounds to 0 (or a subnormal) in the kernels: 0/0 on a zero gradient.
    (dict(optimizer="adamw", eps=1e-46), "eps must be in [1e-30, 1], got 1e-46"),
])
def test_local_optimizer_refuses_an_option_out_of_range_as_the_daemon_does(endpoint, group,
                                                                            refusal):
    """LocalOptimizer has no daemon to check the table's ranges: it checks them itself (and each
    step's values again), in the daemon's words, where it used to compute with them."""
    import torch  # noqa: PLC0415 - the rest of this file needs no torch
    import muond  # noqa: PLC0415

    w = torch.nn.Parameter(torch.ones(8, 4))
    with pytest.raises((muond.MuondError, ValueError)) as remote:
        muond.RemoteOptimizer([{"params": [w], **group}], endpoint=endpoint)
    name, rule = refusal.split(" must ")
    assert name in str(remote.value) and f" must {rule}" in str(remote.value)  # "beta2 (betas[1]) must"
    with pytest.raises(ValueError) as local:
        muond.LocalOptimizer([{"params": [w], **group}])
    assert str(local.value) == refusal
    ok = muond.LocalOptimizer([{"params": [w], "optimizer": group["optimizer"]}])
    ok.param_groups[0]["lr"] = float("inf")  # a scheduler gone wrong: refused at the step
    w.grad = torch.ones(8, 4)
    with pytest.raises(ValueError, match="lr must be in"):
        ok.step()
    assert torch.equal(w.detach(), torch.ones(8, 4))


# An option the group reads only with another one's value (the table's read_with), given a value
# other than its default while that one has another: (group, the daemon's words, the group's wire
# options, the same with the option read). The daemon refuses it when the session is created (the
# Python client sends the group as given: a session an earlier muond created keeps its spec), and
# LocalOptimizer in the same words. The default is accepted, as the clients send it for every group.
_UNREAD = [
    (dict(optimizer="sgd", momentum=0.9, heloco_kappa=2.0),
     "heloco_kappa: this sgd group reads it only with heloco true, and has heloco false; set "
     "heloco or leave heloco_kappa at its default 1",
     dict(optimizer=pb.OPTIMIZER_SGD, momentum=0.9, heloco_kappa=2.0),
     dict(optimizer=pb.OPTIMIZER_SGD, momentum=0.9, heloco_kappa=2.0, heloco=True)),
    (dict(optimizer="sgd", momentum=0.9, heloco=False, heloco_keep_cosine=0.5),
     "heloco_keep_cosine: this sgd group reads it only with heloco true, and has heloco false; "
     "set heloco or leave heloco_keep_cosine at its default 0.1",
     dict(optimizer=pb.OPTIMIZER_SGD, momentum=0.9, heloco=False, heloco_keep_cosine=0.5),
     dict(optimizer=pb.OPTIMIZER_SGD, momentum=0.9, heloco=True, heloco_keep_cosine=0.5)),
    (dict(optimizer="muon", moment2_method="namo", namo_clamp=0.5),
     "namo_clamp: this muon group reads it only with moment2_method namo_d, and has "
     "moment2_method namo; set moment2_method or leave namo_clamp at its default 0.75",
     dict(optimizer=pb.OPTIMIZER_MUON, moment2_method="namo", namo_clamp=0.5),
     dict(optimizer=pb.OPTIMIZER_MUON, moment2_method="namo_d", namo_clamp=0.5)),
]


@pytest.mark.parametrize("group,refusal,unread,read", _UNREAD, ids=["kappa", "keep-cosine", "namo-clamp"])
def test_an_option_the_group_would_not_read_is_refused_naming_it(endpoint, group, refusal, unread, read):
    import torch  # noqa: PLC0415 - the rest of this file needs no torch
    import muond  # noqa: PLC0415

    w = torch.nn.Parameter(torch.ones(8, 4))
    with pytest.raises(muond.MuondError) as remote:
        muond.RemoteOptimizer([{"params": [w], **group}], endpoint=endpoint)
    assert remote.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert remote.value.details == f"spec.groups[0].options.{refusal}"
    with pytest.raises(ValueError) as local:
        muond.LocalOptimizer([{"params": [w], **group}])
    assert str(local.value) == refusal
    # Whichever client sends it, and nothing is created.
    spec = pb.SessionSpec()
    spec.groups.add(name="g0", options=pb.GroupOptions(**unread))
    spec.parameters.add(name="w", shape=[8, 4], group="g0", wire_dtype=pb.DTYPE_FP32)
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.MuondStub(channel)
        with pytest.raises(grpc.RpcError) as daemon:
            stub.CreateSession(pb.CreateSessionRequest(session_id="unread", spec=spec), timeout=10)
        assert daemon.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert daemon.value.details() == f"spec.groups[0].options.{refusal}"
        listed = stub.ListSessions(pb.ListSessionsRequest(), timeout=10)
        assert "unread" not in [s.session_id for s in listed.sessions]
        # Read, or left at its default: created.
        gated = next(k for k in group if k.startswith(("heloco_", "namo_clamp")))
        at_default = dict(unread, **{gated: options.DEFAULTS[group["optimizer"]][gated]})
        for fields in (read, at_default):
            spec.groups[0].options.CopyFrom(pb.GroupOptions(**fields))
            stub.CreateSession(pb.CreateSessionRequest(session_id="read", spec=spec), timeout=10)
            stub.CloseSession(pb.CloseSessionRequest(session_id="read"), timeout=10)


def test_a_constructor_default_a_group_would_not_read_is_refused_for_that_group(endpoint):
    """A constructor default goes to every group it applies to, as torch.optim's do; one that a group
    would not read is refused for that group, naming it (give it to the groups that read it)."""
    import torch  # noqa: PLC0415
    import muond  # noqa: PLC0415

    a, b = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
    groups = [{"params": [a], "heloco": True}, {"params": [b]}]
    words = ("heloco_kappa: this sgd group reads it only with heloco true, and has heloco false; set heloco "
             "or leave heloco_kappa at its default 1")
    with pytest.raises(muond.MuondError) as remote:
        muond.RemoteOptimizer(groups, endpoint=endpoint, optimizer="sgd", momentum=0.9, heloco_kappa=2.0)
    assert remote.value.details == f"spec.groups[1].options.{words}"
    with pytest.raises(ValueError, match=f"^{words}$"):
        muond.LocalOptimizer(groups, optimizer="sgd", momentum=0.9, heloco_kappa=2.0)
    groups[0]["heloco_kappa"] = 2.0
    for opt in (muond.RemoteOptimizer(groups, endpoint=endpoint, optimizer="sgd", momentum=0.9),
                muond.LocalOptimizer(groups, optimizer="sgd", momentum=0.9)):
        assert [g["heloco_kappa"] for g in opt.param_groups] == [2.0, 1.0]
        if isinstance(opt, muond.RemoteOptimizer):
            opt.close()


def test_qk_clip_options_in_a_session_without_pairs_are_refused(endpoint):
    """qk_clip_threshold and qk_clip_alpha are read only for a QK-clip pair's query: given to a
    session that names no pair (qk_clip forgotten), they are refused naming the option, by the
    daemon and by LocalOptimizer alike. With pairs, a constructor default also reaches the groups
    that hold no query, as torch.optim's defaults do, and is accepted there."""
    import torch  # noqa: PLC0415
    import muond  # noqa: PLC0415

    torch.manual_seed(0)
    q, k, w = (torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3))
    groups = [{"params": [("q", q), ("k", k)]}, {"params": [("w", w)]}]
    words = ("qk_clip_threshold: only QK-clip reads it, and this session names no QK-clip pair (spec.qk_clip); "
             "name the query and key weights or leave qk_clip_threshold at its default 100")
    with pytest.raises(muond.MuondError) as remote:
        muond.RemoteOptimizer(groups, endpoint=endpoint, qk_clip_threshold=50.0)
    assert remote.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert remote.value.details == f"spec.groups[0].options.{words}"
    with pytest.raises(ValueError) as local:
        muond.LocalOptimizer(groups, qk_clip_threshold=50.0)
    assert str(local.value) == words
    with pytest.raises(ValueError, match="^qk_clip_alpha: only QK-clip reads it, "):
        muond.LocalOptimizer(groups, qk_clip_alpha=0.25)
    pairs = [("q", "k", 2)]
    remote_opt = muond.RemoteOptimizer(groups, endpoint=endpoint, qk_clip=pairs, qk_clip_threshold=50.0)
    local_opt = muond.LocalOptimizer(groups, qk_clip=pairs, qk_clip_threshold=50.0)
    for opt in (remote_opt, local_opt):
        assert [g["qk_clip_threshold"] for g in opt.param_groups] == [50.0, 50.0]
    remote_opt.close()
    # Refused before anything changed: a bf16 master would have rounded the parameter in place.
    exact = q.detach().clone()
    with pytest.raises(ValueError, match="^qk_clip_threshold: only QK-clip reads it, "):
        muond.LocalOptimizer([{"params": [("q", q)], "master_dtype": "bf16"}], qk_clip_threshold=50.0)
    assert torch.equal(q.detach(), exact)
    # A group added later to a LocalOptimizer without pairs is checked as at construction.
    plain = muond.LocalOptimizer([{"params": [("w", w)]}])
    with pytest.raises(ValueError, match="^qk_clip_threshold: only QK-clip reads it, "):
        plain.add_param_group({"params": [("q", q)], "qk_clip_threshold": 50.0})
