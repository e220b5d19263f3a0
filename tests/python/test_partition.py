"""Ranks that hold parts of the parameters (docs/ranks.md, Ranks that hold parts), against the real
daemon with one process per rank, over gRPC and shared memory: each rank sends only its part of the
gradient and gets back only its part of the parameters, and every part equals, bit for bit, the
same part of a one-rank session stepping the whole gradient. Covers ``rows`` with fewer rows than
ranks (a rank holding nothing), ``flat`` with alignment padding and ranges cutting through
parameters, ``explicit``, DeepSpeed ZeRO's layouts (``zero``, stages 2 and 3), HSDP (replicas of a
partition, averaged by weight), mixed partitions per group, Muon on fused QKV and experts, clipping
on the assembled gradient, a rank killed and restarted mid-step, and the refusals. The model and the
rank processes are partition_ranks.py's; parts over several daemons are test_partition_shards.py's.
"""

import re
import threading
import uuid

import grpc
import pytest
import torch

import muond
from muond import partition as part
from muond._stubs import pb
from muond.transport import framing
from muond import wire

from helpers import no_gpu
from partition_ranks import (QK_OPTIONS, WAIT, WORLD, expect_parts, groups_for, one_group_spec, reference,
                             run_ranks, whole_grads)

@pytest.mark.slow
@pytest.mark.once  # both transports, named
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_rows_flat_and_explicit_parts_step_bit_for_bit_like_one_rank(endpoint, transport):
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds, transport), want, kinds)


@pytest.mark.slow
def test_fsdp2_dtensor_parameters_step_bit_for_bit_like_one_rank(endpoint):
    """A group of FSDP2's DTensor parameters themselves (their gradients on the DTensors, as
    FSDP2's reduce-scatter puts them): each rank's DTensor shards end bit for bit as the same
    parts of a one-rank session, and zero_grad clears the DTensors' gradients."""
    want = reference(endpoint)
    kinds = ["dtensor", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds), want, kinds)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_fsdp2_dtensor_parameters_reload_through_a_distributed_checkpoint(endpoint, layout):
    """Each rank's state dict of step 2, as torch.distributed.checkpoint's state-dict helpers keep
    it (keyed by the model's parameters, its DTensor parts as DTensors, no top-level "muond"
    section; flattened or not), loaded back at step 3: the session redoes step 3 and ends bit for
    bit as the one-rank one."""
    want = reference(endpoint)
    kinds = ["dtensor", None, None, None]
    expect_parts(run_ranks(endpoint, kinds, reload_at=2, through_checkpoint=layout), want, kinds)


@pytest.mark.skipif(no_gpu(), reason="needs a CUDA GPU and a daemon on the cuda backend")
def test_parts_over_cuda_ipc_step_bit_for_bit_like_one_rank(cuda_daemon):
    # Each rank's parts live on the GPU and travel through its own device buffer; rank 2 holds
    # nothing of "tiny" and of some flat and explicit parameters (empty slots).
    endpoint = cuda_daemon()[0].endpoint
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds, "cuda_ipc", device="cuda:0"), want, kinds)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs and a daemon on the cuda backend (NCCL refuses two "
                           "ranks on one GPU before 2.30, and without NCCL_MULTI_RANK_GPU_ENABLE=1)")
def test_parts_over_nccl_step_bit_for_bit_like_one_rank(cuda_daemon):
    # Every rank on cuda:0 opens its own channel with the daemon on cuda:1; an empty part is no
    # transfer on either side.
    daemon, info = cuda_daemon("--device", "1")
    endpoint = daemon.endpoint
    assert info.nccl_version > 0, f"the daemon on cuda:1 reports no NCCL: {info}"
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds, "nccl", device="cuda:0"), want, kinds)


@pytest.mark.slow
def test_mixed_partitions_and_clipping_on_the_assembled_gradient(endpoint):
    options = {"max_grad_norm": 0.5}
    want = reference(endpoint, options)
    kinds = ["flat", "rows", None, "explicit"]  # a replicated group beside partitioned ones
    expect_parts(run_ranks(endpoint, kinds, options=options), want, kinds)


def test_qk_clip_and_tensor_parallel_blocks_run_on_the_whole_matrices(endpoint):
    # q and k cut by rows over 3 ranks (3, 3, 2 rows) cut through the heads (4 rows each); tp's
    # column blocks are orthogonalized on whole columns. All on the assembled whole matrices.
    want = reference(endpoint, QK_OPTIONS, model="qk")
    kinds = ["rows", "flat"]
    expect_parts(run_ranks(endpoint, kinds, options=QK_OPTIONS, model="qk"), want, kinds, model="qk")


@pytest.mark.slow
def test_hsdp_replicas_average_their_parts_bit_for_bit_like_one_rank(endpoint):
    # Two replicas of 3-way partitions over 6 ranks (rank r holds shard r mod 3): rows, flat with
    # padding, explicit, where a shard holds nothing of "tiny" and of ex2. Each replica's gradients
    # are its own batch's, weighted 1 and 3: every part steps with their weighted mean, bit for bit
    # as one rank stepping that mean, with the same state digest.
    want = reference(endpoint, hsdp=True)
    kinds = ["hsdp_rows", "hsdp_rows", "hsdp_flat", "hsdp_explicit"]
    expect_parts(run_ranks(endpoint, kinds, world=6, hsdp=True), want, kinds, world=6)


@pytest.mark.parametrize("extra", [
    {"reload_at": 2},
    {"hold": (4, 1)},
    {"options": {"sync_mode": "quorum", "min_ranks": 6, "grace_seconds": 0}},
], ids=["state-dicts", "rank-killed", "quorum"])
@pytest.mark.slow
def test_hsdp_ranks_load_their_state_dicts_and_restart_like_other_ranks(endpoint, extra):
    # Every rank of both replicas saves its parts of the state after step 2, steps 3, loads them and
    # steps 3 again; or rank 4 (shard 1 of the second replica) is SIGKILLed while the others wait in
    # step 2, and a new process of it reads its parts back and sends step 2; or the session is a
    # quorum one (which HSDP allows), every rank in every step. The same parts and digest as one
    # rank stepping the replicas' mean.
    want = reference(endpoint, hsdp=True)
    kinds = ["hsdp_rows", "hsdp_rows", "hsdp_flat", "hsdp_explicit"]
    expect_parts(run_ranks(endpoint, kinds, world=6, hsdp=True, **{"options": {}, **extra}), want, kinds, world=6)


def open_shifted(endpoint, world, kinds, shifted):
    """One RemoteOptimizer per rank of a new session, opened in rank order, each rank's parameters
    of the groups at positions ``shifted`` first raised by its rank (values other than rank 0's);
    and each rank's parameters by name."""
    session = f"part-start-{uuid.uuid4().hex[:8]}"
    opts = []
    for rank in range(world):
        groups, _ = groups_for(world, rank, kinds)
        with torch.no_grad():
            for g in shifted:
                for _, p in groups[g]["params"]:
                    p.add_(float(rank))
        opts.append(muond.RemoteOptimizer(groups, endpoint=endpoint, session=session, world_size=world, rank=rank))
    return opts, [{n: p.detach() for n, p in zip(o._names, o._params)} for o in opts]


def close_in_reverse(opts):
    """Closes every rank's optimizer, rank 0's last: it ends the session."""
    for o in reversed(opts):
        o.close(keep_session=o is not opts[0])


def test_hsdp_replicas_start_from_the_first_replicas_parts(endpoint):
    # Ranks 2 and 3 (the second replica) upload other values after ranks 0 and 1: a part keeps the
    # first upload of it, as the replicated parameters are rank 0's, and ranks 2 and 3 take them.
    opts, params = open_shifted(endpoint, 4, ["hsdp_rows", None, None, None], shifted=[0])
    for name in ("w1", "experts"):
        assert torch.equal(params[2][name], params[0][name]), name
        assert torch.equal(params[3][name], params[1][name]), name
        assert not torch.equal(params[1][name], params[0][name]), name
    close_in_reverse(opts)


@pytest.mark.parametrize("replicas,message", [
    (4, r"replicas: must divide world_size \(6\), got 4"),
    (-1, r"replicas: must be >= 0, got -1"),
])
def test_replicas_that_do_not_divide_the_ranks_are_refused(endpoint, replicas, message):
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=message) as err:
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", one_group_spec(6, pb.Partition(kind=pb.PARTITION_KIND_ROWS,
                                                                                 replicas=replicas)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.groups[0].partition.replicas" in err.value.details


def test_deepspeed_zero_layouts_step_bit_for_bit_like_one_rank(endpoint):
    want = reference(endpoint)
    kinds = ["zero3", "zero2", "zero2", "zero3"]
    expect_parts(run_ranks(endpoint, kinds), want, kinds)


def test_a_part_of_the_wrong_size_is_refused_naming_it(endpoint):
    groups, _ = groups_for(WORLD, 0, ["rows", "rows", "flat", "explicit"])
    groups[0]["params"][0] = ("w1", torch.zeros(2, 6, requires_grad=True))  # rank 0 holds 3 rows
    with pytest.raises(ValueError, match=r"'w1': rank 0 holds elements \[0, 18\)"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="wrong-size", world_size=WORLD, rank=0)


def test_a_block_of_other_dimensions_or_a_frozen_part_is_refused(endpoint):
    # Rank 0's part of w1 (7, 6) under rows is (3, 6); a (6, 3) block of columns (DTensor Shard(1))
    # has as many elements but would scramble the whole matrix. A part that takes no gradient would
    # leave every step short of it.
    groups, _ = groups_for(WORLD, 0, ["rows", "rows", "flat", "explicit"])
    groups[0]["params"][0] = ("w1", torch.zeros(6, 3, requires_grad=True))
    with pytest.raises(ValueError, match=r"'w1': rank 0's part .* has shape \(3, 6\); the local tensor has \(6, 3\)"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="column-block", world_size=WORLD, rank=0)
    groups[0]["params"][0] = ("w1", torch.zeros(3, 6))
    with pytest.raises(ValueError, match="'w1': requires_grad is False"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="frozen-part", world_size=WORLD, rank=0)
    with pytest.raises(ValueError, match="partition: LocalOptimizer steps whole tensors"):
        muond.LocalOptimizer(groups)


def test_replicated_parameters_start_from_rank_0s_values(endpoint):
    # Rank 1's replicated parameters differ from rank 0's (another seed): as DDP broadcasts rank
    # 0's, the session keeps rank 0's and rank 1's model takes them when it opens.
    opts, (rank0, rank1) = open_shifted(endpoint, 2, ["rows", None, None, None], shifted=[1, 2, 3])
    for name in ("qkv", "emb", "bias", "scale", "ex1", "ex2"):
        assert torch.equal(rank1[name], rank0[name]), name
    assert not torch.equal(rank1["w1"], rank0["w1"]), "each rank keeps its own part"
    close_in_reverse(opts)


@pytest.mark.parametrize("replicas", [0, 2])
@pytest.mark.parametrize("ranges,message", [
    ([[("a", 0, 6)], [("a", 6, 13), ("b", 0, 5)]], r"range \[6, 13\) is outside 'a'"),
    ([[("a", 0, 7)], [("a", 6, 12), ("b", 0, 5)]], r"{holder}s 0 and 1 both claim elements \[6, 7\) of 'a'"),
    ([[("a", 0, 6)], [("a", 7, 12), ("b", 0, 5)]], r"elements \[6, 7\) of 'a' are held by no {holder}"),
    ([[("a", 0, 6), ("a", 6, 12)], [("b", 0, 5)]], r"{holder} 0 lists 'a' twice"),
    ([[("a", 0, 12)], [("c", 0, 5)]], r"unknown parameter 'c'"),
])
def test_bad_explicit_ranges_are_refused_at_creation(endpoint, ranges, message, replicas):
    # Under HSDP the entries are the shards' (2 replicas of 2 shards over 4 ranks).
    message = message.format(holder="shard" if replicas else "rank")
    given = pb.Partition(kind=pb.PARTITION_KIND_EXPLICIT, replicas=replicas)
    for per_rank in ranges:
        entry = given.ranks.add()
        for name, begin, end in per_rank:
            entry.ranges.add(parameter=name, begin=begin, end=end)
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=message) as err:
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", one_group_spec(4 if replicas else 2, given))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.groups[0].partition" in err.value.details


def test_quorum_and_async_are_refused_with_a_partition(endpoint):
    spec = one_group_spec(2, pb.Partition(kind=pb.PARTITION_KIND_ROWS))
    spec.sync.mode = pb.SYNC_MODE_QUORUM
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=r"spec.sync.mode: lock-step only with partitioned groups"):
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", spec)
    groups, _ = groups_for(WORLD, 0, ["rows", None, None, None])
    with pytest.raises(ValueError, match="partition: lock-step only"):
        muond.RemoteOptimizer(groups, endpoint=endpoint, session="async-part", world_size=WORLD, rank=0,
                              sync_mode="async", max_staleness=2)


@pytest.mark.slow
def test_a_rank_killed_mid_step_and_restarted_resends_its_part(endpoint):
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    # Rank 2 stops after step 1 and is SIGKILLed while ranks 0 and 1 wait in step 2; a new process
    # of it attaches, reads its parts back and sends step 2.
    expect_parts(run_ranks(endpoint, kinds, hold=(2, 1)), want, kinds)


@pytest.mark.slow
def test_the_daemon_killed_under_the_journal_comes_back_with_every_part(start_daemon, tmp_path):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags, workdir=tmp_path / "d")
    want = reference(daemon.endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    session = "journaled-parts"
    run_ranks(daemon.endpoint, kinds, steps=range(1, 3), session=session, keep=True)
    daemon.kill()
    daemon = start_daemon(*flags, workdir=tmp_path / "d")
    expect_parts(run_ranks(daemon.endpoint, kinds, session=session), want, kinds)


# -- refusals over the wire --------------------------------------------------------------------------

SMALL = {"a": (4, 3), "t": (2, 3), "r": (5,)}


def _small_spec(world, kind=pb.PARTITION_KIND_ROWS):
    spec = pb.SessionSpec(world_size=world)
    group = spec.groups.add(name="g", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    group.partition.kind = kind
    spec.groups.add(name="whole", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    spec.parameters.add(name="a", shape=[4, 3], group="g")
    spec.parameters.add(name="t", shape=[2, 3], group="g")
    spec.parameters.add(name="r", shape=[5], group="whole")
    return spec


def _raw_step(conn, session, rank, step, grads, into=None):
    header = pb.StepHeader(session_id=session, step=step, rank=rank)
    header.num_chunks, messages = framing.step_messages(list(grads.items()), "fp32", 1 << 20, False)
    sizes = {"a": (6, 6, 0)[rank], "t": (3, 3, 0)[rank], "r": 5}
    return conn.step(header, messages, wire.ChunkAssembler(sizes, into=into))


def _in_threads(world, body):
    """body(rank) for every rank, each in a thread of its own, all started before any is joined."""
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), f"a rank's thread did not finish within {WAIT} s"


def _raw_steps_at_once(conns, session, step, grads_of_rank, into_of_rank=None):
    """Each rank's raw step in a thread of its own; each rank's result or the error it got."""
    outcomes = {}

    def one(r):
        try:
            outcomes[r] = _raw_step(conns[r], session, r, step, grads_of_rank[r], (into_of_rank or {}).get(r))
        except muond.MuondError as err:
            outcomes[r] = err

    _in_threads(len(conns), one)
    return outcomes


def test_bad_parts_are_refused_naming_the_field_and_the_step_stays_to_come(endpoint):
    world = 3  # 'a' (4 rows): ranks hold 2, 2, 0 rows; 't' (2 rows): 1, 1, 0
    session = f"raw-{uuid.uuid4().hex[:6]}"
    conns = [muond.Connection(endpoint) for _ in range(world)]
    conns[0].create_session(session, _small_spec(world))
    whole = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) / 10 for n, s in SMALL.items()}
    for r in range(world):
        conns[r].create_session(session, _small_spec(world))
        rows_a = slice(2 * r, min(4, 2 * r + 2))
        rows_t = slice(r, min(2, r + 1))
        chunks = [c for name, value in (("a", whole["a"][rows_a]), ("t", whole["t"][rows_t]), ("r", whole["r"]))
                  if value.numel() for c in wire.encode(name, value, "fp32")]
        conns[r].upload(session, chunks, rank=r)
    good = {0: {"a": torch.ones(2, 3), "t": torch.ones(1, 3), "r": torch.ones(5)},
            1: {"a": torch.ones(2, 3), "t": torch.ones(1, 3), "r": torch.ones(5)},
            2: {"r": torch.ones(5)}}
    refusals = [
        (0, {"a": torch.ones(7), "t": torch.ones(3), "r": torch.ones(5)}, r"'a'.*rank 0's part of (it|'a') has 6 elements"),
        (2, {"t": torch.ones(3), "r": torch.ones(5)}, r"'t'.*rank 2's part of (it|'t') has 0 elements"),
        (0, {"a": torch.ones(6), "t": torch.ones(3), "r": torch.ones(4)}, r"'r' was sent with shape \[4\], the session has \[5\]"),
    ]
    for rank, grads, message in refusals:
        with pytest.raises(muond.MuondError, match=message) as err:
            _raw_step(conns[rank], session, rank, 1, grads)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing was applied for anyone: step 1 is still to come, and goes through once every rank sends.
    results = _raw_steps_at_once(conns, session, 1, good)
    assert all(results[r].step == 1 and results[r].applied for r in range(world))
    # A partitioned parameter comes from every rank holding a part of it, or from none: rank 1
    # leaving out 'a' while rank 0 sends its part is refused for every rank, nothing applied.
    partial = {0: good[0], 1: {"t": torch.ones(1, 3), "r": torch.ones(5)}, 2: good[2]}
    refused = _raw_steps_at_once(conns, session, 2, partial)
    for r in range(world):
        assert isinstance(refused[r], muond.MuondError), (r, refused[r])
        assert "'a': rank 0 sent its part and rank 1 did not" in str(refused[r]), str(refused[r])
        assert refused[r].code == grpc.StatusCode.INVALID_ARGUMENT
    # Unused this step on every rank ('a' has no gradient): the step goes on, 'a' stays as it was.
    unused = {0: {"t": torch.ones(1, 3), "r": torch.ones(5)}, 1: {"t": torch.ones(1, 3), "r": torch.ones(5)},
              2: {"r": torch.ones(5)}}
    a_after_1 = {r: torch.empty(2, 3) for r in (0, 1)}
    a_after_2 = {r: torch.empty(2, 3) for r in (0, 1)}
    again = _raw_steps_at_once(conns, session, 1, good, {r: {"a": a_after_1[r]} for r in (0, 1)})  # step 1's answer
    assert all(again[r].step == 1 for r in range(world))
    stepped = _raw_steps_at_once(conns, session, 2, unused, {r: {"a": a_after_2[r]} for r in (0, 1)})
    assert all(stepped[r].step == 2 and stepped[r].applied for r in range(world)), stepped
    for r in (0, 1):
        assert torch.equal(a_after_2[r], a_after_1[r]), f"rank {r}: 'a' changed in a step none of its parts came in"


def test_partitions_that_disagree_across_ranks_are_refused_at_attach(endpoint):
    session = f"disagree-{uuid.uuid4().hex[:6]}"
    conn = muond.Connection(endpoint)
    conn.create_session(session, _small_spec(2, pb.PARTITION_KIND_ROWS))
    with pytest.raises(muond.MuondError, match="partition") as err:
        conn.create_session(session, _small_spec(2, pb.PARTITION_KIND_FLAT))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_each_rank_saves_and_loads_its_parts_of_the_state(endpoint):
    # Every rank saves its state_dict after step 2, steps 3, loads the saved parts (the session goes
    # back to step 2) and steps 3 again: the parts and the digest are the one-rank session's after 3.
    want = reference(endpoint)
    kinds = ["rows", "rows", "flat", "explicit"]
    expect_parts(run_ranks(endpoint, kinds, options={}, reload_at=2), want, kinds)


def _set_part_grads(opt, world, rank, step):
    """Each parameter's .grad: rank ``rank``'s part of whole_grads(step) (all of it when whole)."""
    grads = whole_grads(step)
    for group in opt.param_groups:
        partition = group.get("partition")
        for k, (name, p) in enumerate(zip(group["param_names"], group["params"])):
            g = grads[name] if partition is None else part.cut(grads[name], partition, k, world, rank)
            p.grad = g.view(p.shape)


def test_a_load_under_way_when_the_daemon_restarts_is_still_waited_for(start_daemon, tmp_path):
    # Rank 0 loads its state dict of step 1, then the daemon is SIGKILLed and restarted from its
    # state directory: its checkpoint keeps what the ranks were loading, so step 2 still waits for
    # rank 1's load (rank 1's parts are of step 2), and goes on once rank 1 has loaded.
    flags = ("--state-dir", tmp_path / "state")
    daemon = start_daemon(*flags, workdir=tmp_path / "d")
    world, kinds, session = 2, ["rows", "rows", "flat", None], "restart-mid-load"
    saved, errors = {}, []

    def open_rank(rank):
        groups, _ = groups_for(world, rank, kinds)
        return muond.RemoteOptimizer(groups, endpoint=daemon.endpoint, session=session, world_size=world,
                                     rank=rank)

    def train(rank):
        try:
            opt = open_rank(rank)
            for step in (1, 2):
                _set_part_grads(opt, world, rank, step)
                opt.step()
                if step == 1:
                    saved[rank] = opt.state_dict()
            opt.close(keep_session=True)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append((rank, err))

    _in_threads(world, train)
    assert not errors, errors
    opt = open_rank(0)
    opt.load_state_dict(saved[0])
    opt.close(keep_session=True)
    daemon.kill()
    daemon = start_daemon(*flags, workdir=tmp_path / "d")
    opts = {r: open_rank(r) for r in range(world)}
    assert all(o.last_step == 1 for o in opts.values())

    def step_2(rank):
        try:
            _set_part_grads(opts[rank], world, rank, 2)
            opts[rank].step()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append((rank, err))

    _in_threads(world, step_2)
    assert sorted(r for r, _ in errors) == [0, 1], errors
    for _, err in errors:
        assert isinstance(err, muond.MuondError) and re.search(
            r"step 2: rank 1 sent it without loading its parts of the state of step 1 that rank 0 loaded",
            str(err)), err
    errors.clear()
    opts[1].load_state_dict(saved[1])
    _in_threads(world, step_2)
    assert not errors, errors
    assert all(o.last_step == 2 for o in opts.values())
    for o in opts.values():
        o.close()


def test_ranks_loading_state_dicts_of_different_steps_are_refused(endpoint):
    # Each rank of a partitioned session loads its own parts. A rank loading a state of another step
    # than the one another rank has loaded since, or stepping without loading while another rank
    # has, would leave the session holding two states mixed: both are refused, naming the ranks.
    world, kinds = 2, ["rows", "rows", "flat", None]
    session = f"mixed-{uuid.uuid4().hex[:6]}"
    together = threading.Barrier(world, timeout=WAIT)
    errors = []

    def set_grads(opt, rank, step):
        _set_part_grads(opt, world, rank, step)

    def rank_main(rank):
        try:
            groups, _ = groups_for(world, rank, kinds)
            opt = muond.RemoteOptimizer(groups, endpoint=endpoint, session=session, world_size=world, rank=rank)
            saved = {}
            for step in (1, 2):
                set_grads(opt, rank, step)
                opt.step()
                saved[step] = opt.state_dict()
            together.wait()
            if rank == 0:
                opt.load_state_dict(saved[1])  # back to step 1
            together.wait()
            if rank == 1:
                with pytest.raises(muond.MuondError, match=r"rank 1's state is of step 2, but rank 0 loaded its "
                                                           r"parts of a state of step 1"):
                    opt.load_state_dict(saved[2])
                # A rank that attaches again without loading its parts steps 2 with the others.
                opt.close(keep_session=True)
                groups, _ = groups_for(world, rank, kinds)
                opt = muond.RemoteOptimizer(groups, endpoint=endpoint, session=session, world_size=world, rank=rank)
                assert opt.last_step == 1
            together.wait()
            set_grads(opt, rank, 2)
            with pytest.raises(muond.MuondError, match=r"rank 1 sent it without loading its parts of the state "
                                                       r"of step 1 that rank 0 loaded"):
                opt.step()
            together.wait()
            if rank == 1:
                opt.load_state_dict(saved[1])
            together.wait()
            opt.step()  # every rank has loaded the state of step 1: step 2 again
            assert opt.last_step == 2
            opt.close(keep_session=rank != 0)
        except BaseException as err:  # noqa: BLE001 - reported below
            together.abort()
            errors.append((rank, err))

    _in_threads(world, rank_main)
    assert not errors, errors
