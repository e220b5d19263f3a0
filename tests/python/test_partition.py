"""Ranks that hold parts of the parameters (docs/ranks.md, Ranks that hold parts), against the real
daemon with one process per rank, over gRPC and shared memory: each rank sends only its part of the
gradient and gets back only its part of the parameters, and every part equals, bit for bit, the
same part of a one-rank session stepping the whole gradient. Covers ``rows`` with fewer rows than
ranks (a rank holding nothing), ``flat`` with alignment padding and ranges cutting through
parameters, ``explicit``, mixed partitions per group, Muon on fused QKV and experts, clipping on
the assembled gradient, a rank killed and restarted mid-step, and the refusals.
"""

import io
import multiprocessing
import traceback
import uuid

import grpc
import pytest
import torch

import muond
from muond import partition as part

WORLD = 3
WAIT = 300  # seconds: a bound on waiting for an event, never an expected duration
STEPS = 3

# The model: name → (global shape, group). "qkv" is a fused QKV weight (q, k, v = 4, 2, 2 rows per
# query group, 2 groups); "experts" three 6×5 matrices; "tiny" has fewer rows (2) than ranks.
SHAPES = {
    "w1": (7, 6), "tiny": (2, 6), "qkv": (16, 6), "experts": (3, 6, 5),
    "emb": (5, 4), "bias": (7,), "scale": (1,),
    "ex1": (4, 3), "ex2": (5,),
}
# Explicit ranges of the last group: rank → {position: (begin, end)}; rank 1 holds nothing of ex2.
EXPLICIT = [{0: (0, 5), 1: (3, 5)}, {0: (5, 12)}, {1: (0, 3)}]


def groups_for(world, rank, kinds):
    """The parameter groups of rank ``rank`` (its parts, or whole tensors for ``kinds`` None) and
    the whole initial values. ``kinds``: the partition kind of each of the four groups."""
    gen = torch.Generator().manual_seed(7)
    whole = {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()}
    layout = [
        (["w1", "tiny", "experts"], {"optimizer": "muon"}),
        (["qkv"], {"optimizer": "muon", "qkv_split": (4, 2, 2), "num_query_groups": 2}),
        (["emb", "bias", "scale"], {"optimizer": "adamw"}),
        (["ex1", "ex2"], {"optimizer": "adamw", "lr": 3e-3}),
    ]
    groups = []
    for (names, options), kind in zip(layout, kinds or [None] * 4):
        shapes = [SHAPES[n] for n in names]
        if kind is None:
            partition = None
        elif kind == "rows":
            partition = part.rows(shapes)
        elif kind == "flat":
            partition = part.flat(shapes, alignment=4)
        else:
            partition = part.explicit(shapes, EXPLICIT)
        params = []
        for k, n in enumerate(names):
            value = whole[n] if partition is None else part.cut(whole[n], partition, k, world, rank)
            params.append((n, value.clone().requires_grad_()))
        group = {"params": params, **options}
        if partition is not None:
            group["partition"] = partition
        groups.append(group)
    return groups, whole


def whole_grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _run_rank(rank, world, endpoint, session, kinds, transport, options, steps, out):
    torch.set_num_threads(1)
    try:
        groups, _ = groups_for(world, rank, kinds)
        opt = muond.RemoteOptimizer(groups, endpoint=endpoint, session=session, world_size=world,
                                    rank=rank, transport=transport, **options)
        for step in steps:
            grads = whole_grads(step)
            for group in opt.param_groups:
                partition = group.get("partition")
                for k, (name, p) in enumerate(zip(group["param_names"], group["params"])):
                    g = grads[name] if partition is None else part.cut(grads[name], partition, k, world, rank)
                    p.grad = g.view(p.shape)
            opt.step()
        params = {n: p.detach().clone() for n, p in zip(opt._names, opt._params)}
        opt.close()
        buffer = io.BytesIO()
        torch.save(params, buffer)
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(endpoint, kinds, transport="grpc", world=WORLD, options=None, steps=range(1, STEPS + 1)):
    """Every rank in a process of its own, all stepping ``steps``; their final local parameters."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    session = f"part-{uuid.uuid4().hex[:8]}"
    processes = [context.Process(target=_run_rank, daemon=True,
                                 args=(r, world, endpoint, session, kinds, transport, options or {},
                                       list(steps), out)) for r in range(world)]
    for p in processes:
        p.start()
    results = {}
    try:
        for _ in processes:
            rank, status, body = out.get(timeout=WAIT)
            assert status == "ok", f"rank {rank} failed:\n{body}"
            results[rank] = torch.load(io.BytesIO(body))
    finally:
        for p in processes:
            if len(results) < len(processes):
                p.kill()  # the others wait for the failed rank's part: no point waiting for them
            p.join(WAIT)
    return results


def reference(endpoint, options=None, steps=range(1, STEPS + 1)):
    """A one-rank session with whole tensors stepping the whole gradients."""
    results = run_ranks(endpoint, None, world=1, options=options, steps=steps)
    return results[0]


def expect_parts(results, want, kinds, world=WORLD):
    groups, _ = groups_for(world, 0, kinds)
    for rank, got in results.items():
        rank_groups, _ = groups_for(world, rank, kinds)
        for group in rank_groups:
            partition = group.get("partition")
            for k, (name, _) in enumerate(group["params"]):
                expected = want[name] if partition is None else part.cut(want[name], partition, k, world, rank)
                assert got[name].shape == expected.shape, (rank, name)
                assert torch.equal(got[name], expected), f"rank {rank}: '{name}' differs from the whole session's"


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_rows_flat_and_explicit_parts_step_bit_for_bit_like_one_rank(endpoint, transport):
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds, transport), want, kinds)


def test_mixed_partitions_and_clipping_on_the_assembled_gradient(endpoint):
    options = {"max_grad_norm": 0.5}
    want = reference(endpoint, options)
    kinds = ["flat", "rows", None, "explicit"]  # a replicated group beside partitioned ones
    expect_parts(run_ranks(endpoint, kinds, options=options), want, kinds)


def test_rules_agree_with_the_daemon_layout():
    # rows: torch.chunk's rule, a rank may hold nothing
    assert part.rows([(2, 6)]).parts(3)[0] == [(0, 6), (6, 12), (12, 12)]
    assert [c.shape[0] for c in torch.arange(7).chunk(3)] == [3, 3, 1]
    assert part.rows([(7, 2)]).parts(3)[0] == [(0, 6), (6, 12), (12, 14)]
    # flat: 7 and 5 elements padded to 8 each, 16 cut into 3 ranges of 6
    assert part.flat([(7,), (5,)], alignment=4).parts(3) == [[(0, 6), (6, 7), (7, 7)],
                                                             [(0, 0), (0, 4), (4, 5)]]


def test_a_part_of_the_wrong_size_is_refused_naming_it(endpoint):
    groups, _ = groups_for(WORLD, 0, ["rows", "rows", "flat", "explicit"])
    groups[0]["params"][0] = ("w1", torch.zeros(2, 6, requires_grad=True))  # rank 0 holds 3 rows
    with pytest.raises(ValueError, match=r"'w1': rank 0 holds elements \[0, 18\)"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="wrong-size", world_size=WORLD, rank=0)


def _spec(world, partition):
    from muond._stubs import pb
    spec = pb.SessionSpec(world_size=world)
    group = spec.groups.add(name="g", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    group.partition.CopyFrom(partition)
    spec.parameters.add(name="a", shape=[4, 3], group="g")
    spec.parameters.add(name="b", shape=[5], group="g")
    return spec


@pytest.mark.parametrize("ranges,message", [
    ([[("a", 0, 6)], [("a", 6, 13), ("b", 0, 5)]], r"range \[6, 13\) is outside 'a'"),
    ([[("a", 0, 7)], [("a", 6, 12), ("b", 0, 5)]], r"ranks 0 and 1 both claim elements \[6, 7\) of 'a'"),
    ([[("a", 0, 6)], [("a", 7, 12), ("b", 0, 5)]], r"elements \[6, 7\) of 'a' are held by no rank"),
    ([[("a", 0, 6), ("a", 6, 12)], [("b", 0, 5)]], r"rank 0 lists 'a' twice"),
    ([[("a", 0, 12)], [("c", 0, 5)]], r"unknown parameter 'c'"),
])
def test_bad_explicit_ranges_are_refused_at_creation(endpoint, ranges, message):
    from muond._stubs import pb
    given = pb.Partition(kind=pb.PARTITION_KIND_EXPLICIT)
    for per_rank in ranges:
        entry = given.ranks.add()
        for name, begin, end in per_rank:
            entry.ranges.add(parameter=name, begin=begin, end=end)
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=message) as err:
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", _spec(2, given))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.groups[0].partition" in err.value.details


def test_quorum_and_async_are_refused_with_a_partition(endpoint):
    from muond._stubs import pb
    spec = _spec(2, pb.Partition(kind=pb.PARTITION_KIND_ROWS))
    spec.sync.mode = pb.SYNC_MODE_QUORUM
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=r"spec.sync.mode: lock-step only with partitioned groups"):
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", spec)
    groups, _ = groups_for(WORLD, 0, ["rows", None, None, None])
    with pytest.raises(ValueError, match="partition: lock-step only"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="async-part", world_size=WORLD, rank=0,
                              sync_mode="async", max_staleness=2)
