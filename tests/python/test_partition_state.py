"""Ranks that hold parts of the parameters (docs/ranks.md, Ranks that hold parts): their state
dicts on one process — a rank holding whole parameters in a flat layout, a slot as large as its
parameter in another shape saved and loaded as parts, another rank's state dict refused, and FSDP2
DTensor parameters' state as DTensors (docs and python/README.md, ``torch.distributed.checkpoint``;
tests/python/fake_dtensor.py stands in for DTensor, which torch 1.13 lacks). The state dicts of
several rank processes, and loads through a re-enacted distributed checkpoint, are in
test_partition.py, whose layouts (``groups_for``) these use.
"""

import threading
import uuid

import pytest
import torch

import muond
from muond import partition as part

from fake_dtensor import FakeDTensor, Shard
from test_partition import WAIT, _in_threads, groups_for


def test_a_rank_holding_a_whole_parameter_in_its_flat_layout_loads_its_state(endpoint):
    """With one rank a flat partition hands it every parameter whole, in its flat layout (emb
    5x4 as 20 elements): its saved state loads back, shapes and all, as any rank's part does."""
    groups, _ = groups_for(1, 0, ["rows", "rows", "flat", None])
    assert tuple(dict(groups[2]["params"])["emb"].shape) == (20,)
    with muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"sd-{uuid.uuid4().hex[:6]}",
                               world_size=1, rank=0) as opt:
        params = [p for g in groups for _, p in g["params"]]
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        saved = opt.state_dict()
        opt.step()
        opt.load_state_dict(saved)
        assert opt.last_step == 1


def test_a_slot_as_large_as_its_parameter_in_another_shape_saves_and_loads_as_parts(endpoint):
    """NAMO-D keeps one second moment per column, flat: 8 values for a (1, 8) matrix, as many as it
    has elements, which the daemon cuts over the ranks as it cuts the master. Each rank saves its
    parts of it, steps, loads them back and steps again: the same parameters bit for bit."""
    world, shapes = 2, [(1, 8), (4, 8)]
    partition = part.flat(shapes)  # 8 + 32 elements: rank 0 holds (1, 8) and 12 of (4, 8)
    gen = torch.Generator().manual_seed(11)
    initial = [torch.randn(s, generator=gen) for s in shapes]
    grads = {step: [torch.randn(s, generator=gen) for s in shapes] for step in (1, 2)}
    session = f"namo-d-{uuid.uuid4().hex[:6]}"
    together = threading.Barrier(world, timeout=WAIT)
    errors, after = [], {}

    def rank_main(rank):
        try:
            params = [part.cut(w, partition, k, world, rank).requires_grad_() for k, w in enumerate(initial)]
            group = {"params": list(zip(["a", "b"], params)), "optimizer": "muon", "moment2_method": "namo_d",
                     "partition": partition}
            with muond.RemoteOptimizer([group], endpoint=endpoint, session=session, world_size=world,
                                       rank=rank) as opt:
                def step(k):
                    for i, p in enumerate(params):
                        p.grad = part.cut(grads[k][i], partition, i, world, rank).view(p.shape)
                    opt.step()
                step(1)
                saved = opt.state_dict()
                assert saved["state"][0]["moment2"].numel() == partition.parts(world)[0][rank][1] - \
                    partition.parts(world)[0][rank][0], "the saved moment is this rank's part"
                step(2)
                first = [p.detach().clone() for p in params]
                together.wait()  # every rank has its answer before any load replaces the parameters
                opt.load_state_dict(saved)
                assert opt.last_step == 1
                together.wait()
                step(2)
                after[rank] = (first, [p.detach().clone() for p in params])
                together.wait()  # rank 0 ends the session when it closes
        except BaseException as err:  # noqa: BLE001 - reported below
            together.abort()
            errors.append((rank, err))

    _in_threads(world, rank_main)
    assert not errors, errors
    for rank, (first, again) in after.items():
        for k, (x, y) in enumerate(zip(first, again)):
            assert torch.equal(x, y), f"rank {rank}: parameter {k} differs after the state was loaded back"


def test_a_state_dict_of_another_rank_is_refused(endpoint):
    groups, _ = groups_for(1, 0, ["rows", "rows", "flat", None])
    with muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"sd-{uuid.uuid4().hex[:6]}", world_size=1,
                               rank=0) as opt:
        saved = opt.state_dict()
        assert saved["muond"]["parts"] and saved["muond"]["rank"] == 0
        saved["muond"]["rank"] = 1
        with pytest.raises(ValueError, match="holds rank 1's parts; this optimizer is rank 0"):
            opt.load_state_dict(saved)


def test_dtensor_parameters_state_dict_upload_and_a_checkpoint_of_plain_parts(endpoint):
    """One rank's DTensor parameters: state_dict() holds their masters as DTensors of the global
    shape (a plain group's parts stay tensors); upload_parameters() takes a shard changed in place;
    a state dict as a distributed checkpoint hands it back (no top-level section) with plain parts
    is refused, their rank unknown, and so is another rank's own state dict. zero_grad clears
    the DTensor's gradient as torch clears any parameter's (zeroed or dropped)."""
    groups, _ = groups_for(1, 0, ["dtensor", "rows", None, None])
    dtensor = groups[0]["params"][0][1]
    plain = len(groups[0]["params"])  # the index of the rows group's first parameter
    with muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"dt-{uuid.uuid4().hex[:6]}", world_size=1,
                               rank=0) as opt, torch.no_grad():
        saved = opt.state_dict()
        master = saved["state"][0]["master"]
        assert isinstance(master, FakeDTensor) and master.shape == dtensor.shape
        assert torch.equal(master.to_local(), dtensor.to_local())
        assert type(saved["state"][plain]["master"]) is torch.Tensor
        dtensor.to_local().add_(1.0)  # the shard itself, changed in place
        opt.upload_parameters()
        assert torch.equal(opt.state_dict()["state"][0]["master"].to_local(), dtensor.to_local())
        with pytest.raises(ValueError, match="parts of no known rank"):
            opt.load_state_dict({"state": saved["state"], "param_groups": saved["param_groups"]})
        saved["muond"]["rank"] = 1  # another rank's own state dict: refused, DTensors or not
        dtensor.grad = FakeDTensor.make(torch.ones(dtensor.shape), dtensor.shape, 1, 0)
        opt.zero_grad(set_to_none=False)  # torch's own, on the DTensor the group lists
        assert dtensor.grad is not None and not dtensor.grad.to_local().any()
        opt.zero_grad(set_to_none=True)
        assert dtensor.grad is None
        with pytest.raises(ValueError, match="holds rank 1's parts; this optimizer is rank 0"):
            opt.load_state_dict(saved)


def test_dtensor_parts_of_no_named_rank_load_only_when_placed_as_their_parameters(endpoint):
    """A state dict naming no rank (as a distributed checkpoint hands it back) whose partitioned
    parameters' parts are all DTensors placed as the parameters loads as this rank's; one placed
    otherwise (Shard(1)) is refused, and so is one without a DTensor parameter's state (the
    helpers leave out a parameter that does not require grad), naming it."""
    groups, _ = groups_for(1, 0, ["dtensor", None, None, None])
    with muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"dt-{uuid.uuid4().hex[:6]}", world_size=1,
                               rank=0) as opt, torch.no_grad():
        saved = opt.state_dict()
        kept = {"state": saved["state"], "param_groups": saved["param_groups"]}
        opt.load_state_dict(kept)
        master = saved["state"][0]["master"]
        askew = FakeDTensor.make(master.to_local(), master.shape, 1, 0, Shard(1))
        kept["state"] = {**saved["state"], 0: dict(saved["state"][0], master=askew)}
        with pytest.raises(ValueError, match="parts of no known rank"):
            opt.load_state_dict(kept)
        kept["state"] = {i: e for i, e in saved["state"].items() if i != 0}
        with pytest.raises(ValueError, match=f"no state of '{opt._names[0]}'"):  # pylint: disable=protected-access
            opt.load_state_dict(kept)
