"""Ranks that hold parts of a session sharded over several real daemons (docs/ranks.md, Over several
daemons): each rank's parts go to the daemons holding their parameters, and every part steps bit
for bit as one rank with whole tensors on the same daemons — through state-dict reloads, HSDP, and a
rank and a daemon killed; what each daemon is given of a partition, the same from both clients; and
a flat partition refused on a shard.
"""

import uuid

import pytest

import muond
from muond import placement
from muond import session_spec
from muond._stubs import pb

from partition_ranks import SHAPES, WORLD, expect_parts, one_group_spec, reference, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("hsdp", [False, True], ids=["parts", "hsdp"])
def test_parts_on_a_session_sharded_over_daemons_step_bit_for_bit_like_one_rank(start_daemon, hsdp):
    # The session spread over 3 daemons: w1, tiny and experts of the first group on three different
    # ones, the flat group's emb and scale on one and bias on another (a flat range cuts through
    # them, so each daemon gets its ranges as explicit ones), ex1 and ex2 on a daemon that holds
    # nothing of the flat group. Each rank's parts go to the daemons holding their parameters, and
    # every part steps bit for bit as one rank with whole tensors on the same daemons, with the same
    # state digest — through a reload of every rank's state dict, and under HSDP.
    daemons = [start_daemon() for _ in range(3)]
    endpoints = [daemon.endpoint for daemon in daemons]
    names = list(SHAPES)
    tensors = [placement.Tensor(SHAPES[n], n in ("w1", "tiny", "experts", "qkv"),
                                (4, 2, 2) if n == "qkv" else None, 2 if n == "qkv" else 1) for n in names]
    shard_of = dict(zip(names, placement.place(tensors, len(endpoints)).shard_of))
    assert len({shard_of[n] for n in ("w1", "tiny", "experts")}) == 3
    assert shard_of["emb"] == shard_of["scale"] != shard_of["bias"]
    assert shard_of["ex1"] == shard_of["ex2"] not in (shard_of["emb"], shard_of["bias"])
    world = 6 if hsdp else WORLD
    # The first group FSDP2's DTensor parameters (rows), but under HSDP, where they are plain parts.
    kinds = ["hsdp_rows", "hsdp_rows", "hsdp_flat", "hsdp_explicit"] if hsdp else ["dtensor", "rows", "flat", "explicit"]
    want = reference(endpoints, hsdp=hsdp)
    expect_parts(run_ranks(endpoints, kinds, world=world, hsdp=hsdp, reload_at=None if hsdp else 2),
                 want, kinds, world=world)
    for daemon in daemons:
        assert daemon.alive(), f"a daemon died:\n{daemon.log_tail()}"


@pytest.mark.slow
def test_parts_over_daemons_survive_a_rank_and_a_shard_killed(start_daemon, tmp_path):
    # Three daemons under the journal. Rank 2 stops after step 1 and is SIGKILLed while the others
    # wait in step 2's prepare on every shard; a new process of it attaches, reads its parts back from
    # each daemon and sends step 2. Then shard 1 is SIGKILLed between steps and restarted at its
    # address: the ranks attach again and go on. Every part stays bit for bit the whole session's.
    def flags(k):
        return ("--state-dir", tmp_path / f"state{k}", "--durability", "journal")

    daemons = [start_daemon(*flags(k), workdir=tmp_path / f"d{k}") for k in range(3)]
    endpoints = [daemon.endpoint for daemon in daemons]
    want = reference([start_daemon().endpoint for _ in range(3)])
    kinds = ["rows", "rows", "flat", "explicit"]
    session = f"killed-{uuid.uuid4().hex[:8]}"
    run_ranks(endpoints, kinds, steps=range(1, 3), session=session, keep=True, hold=(2, 1))
    daemons[1].kill()
    daemons[1] = start_daemon(*flags(1), listen=endpoints[1], workdir=tmp_path / "d1")
    expect_parts(run_ranks(endpoints, kinds, session=session), want, kinds)


def test_partitions_reach_each_shard_as_the_cpp_client_gives_them():
    # The example of ShardSpecTest (tests/integration/sharded_parts_test.cc): ranks of either
    # client attach to a sharded session only with identical shard specs.
    whole = pb.SessionSpec(world_size=2)
    for name in ("flat", "explicit"):
        whole.groups.add(name=name, options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    whole.groups[0].partition.CopyFrom(pb.Partition(kind=pb.PARTITION_KIND_FLAT, alignment=4))
    for name, shape, group in (("x", [4, 3], "flat"), ("y", [5], "flat"), ("z", [6], "flat"),
                               ("u", [4], "explicit"), ("v", [4], "explicit")):
        whole.parameters.add(name=name, shape=shape, group=group)
    given = whole.groups[1].partition
    given.kind = pb.PARTITION_KIND_EXPLICIT
    given.ranks.add().ranges.extend([pb.ParameterRange(parameter="v", begin=0, end=2),
                                     pb.ParameterRange(parameter="u", begin=0, end=4)])
    given.ranks.add().ranges.extend([pb.ParameterRange(parameter="v", begin=2, end=4),
                                     pb.ParameterRange(parameter="u", begin=4, end=4)])

    def ranges_of(shard, mine):
        out = []
        for g in session_spec.shard_spec(whole, shard, mine, ["a:1", "b:2"]).groups:
            text = g.name + (":" if g.partition.kind == pb.PARTITION_KIND_EXPLICIT else ": not explicit")
            for r, rank in enumerate(g.partition.ranks):
                text += f" rank {r}:" + "".join(f" {x.parameter} {x.begin}-{x.end}" for x in rank.ranges)
            out.append(text)
        return out

    assert ranges_of(0, [0, 2, 3]) == ["flat: rank 0: x 0-12 rank 1: z 0-6", "explicit: rank 0: u 0-4 rank 1:"]
    assert ranges_of(1, [1, 4]) == ["flat: rank 0: y 0-2 rank 1: y 2-5", "explicit: rank 0: v 0-2 rank 1: v 2-4"]


def test_a_flat_partition_on_a_shard_is_refused_naming_its_kind(endpoint):
    # A shard holds some of a group's parameters: flat ranges of a subset would be another layout.
    spec = one_group_spec(2, pb.Partition(kind=pb.PARTITION_KIND_FLAT))
    spec.shard.endpoints.extend([endpoint, "127.0.0.1:1"])
    spec.shard.index = 0
    spec.shard.num_parameters = 3
    spec.shard.parameters.extend([0, 2])
    conn = muond.Connection(endpoint)
    with pytest.raises(muond.MuondError, match=r"spec.groups\[0\].partition.kind: flat cuts through the whole "
                                                r"group's parameters.*give each shard its ranges as an explicit"):
        conn.create_session(f"bad-{uuid.uuid4().hex[:6]}", spec)
    spec.groups[0].partition.CopyFrom(pb.Partition(kind=pb.PARTITION_KIND_ROWS))  # rows: the parameter's own
    conn.create_session(f"rows-{uuid.uuid4().hex[:6]}", spec)
