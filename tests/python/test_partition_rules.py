"""The partition rules and adapters of ``muond.partition`` (docs/ranks.md, Ranks that hold parts)
on their own, without a daemon: the layouts the daemon computes too (rows, flat, HSDP replicas,
DeepSpeed ZeRO's), and the adapters from plain objects carrying a DTensor's, a 2-D HSDP mesh's and
an FSDP1 FlatParameter's facts. tests/python/test_partition.py steps them through the daemon.
"""

import dataclasses

import pytest
import torch

from muond import partition as part
from muond._stubs import pb

from fake_dtensor import FakeDTensor, Shard


def test_rules_agree_with_the_daemon_layout():
    # rows: torch.chunk's rule, a rank may hold nothing
    assert part.rows([(2, 6)]).parts(3)[0] == [(0, 6), (6, 12), (12, 12)]
    assert [c.shape[0] for c in torch.arange(7).chunk(3)] == [3, 3, 1]
    assert part.rows([(7, 2)]).parts(3)[0] == [(0, 6), (6, 12), (12, 14)]
    # flat: 7 and 5 elements padded to 8 each, 16 cut into 3 ranges of 6
    assert part.flat([(7,), (5,)], alignment=4).parts(3) == [[(0, 6), (6, 7), (7, 7)],
                                                             [(0, 0), (0, 4), (4, 5)]]


def test_hsdp_rules_repeat_the_partition_over_the_replicas():
    # rank r holds shard r mod (world_size / replicas): a (replicate, shard) mesh's numbering
    assert part.rows([(2, 6)], replicas=2).parts(6)[0] == [(0, 6), (6, 12), (12, 12)] * 2
    assert part.flat([(7,), (5,)], alignment=4, replicas=3).parts(6) == [[(0, 7), (7, 7)] * 3,
                                                                          [(0, 0), (0, 5)] * 3]
    assert part.replicated(part.zero([(13,)], 2), 2).parts(4) == [[(0, 8), (8, 13)] * 2]
    message = part.to_proto(part.rows([(4, 3)], replicas=2), ["a"], pb)
    assert message.replicas == 2 and message.kind == pb.PARTITION_KIND_ROWS
    with pytest.raises(ValueError, match=r"replicas must divide world_size \(6\), got 4"):
        part.rows([(4, 3)], replicas=4).parts(6)
    with pytest.raises(ValueError, match=r"one entry per shard \(world_size 4 over 2 replicas: 2\), got 3"):
        part.explicit([(4, 3), (5,)], [{0: (0, 5)}, {0: (5, 12)}, {1: (0, 5)}], replicas=2).parts(4)


def test_zero_layouts_follow_deepspeeds_rules():
    # Stages 1 and 2: only the whole is padded, to a multiple of 2·N; 7 + 5 elements over 3 ranks
    # are 12, partitions of 4 cutting through the first parameter.
    assert part.zero([(7,), (5,)], 3).parts(3) == [[(0, 4), (4, 7), (0, 0)], [(0, 0), (0, 1), (1, 5)]]
    # 13 elements over 2 ranks: padded to 16, partitions of 8, where `flat` pads to 14 (7 each).
    assert part.zero([(13,)], 2).parts(2) == [[(0, 8), (8, 13)]]
    assert part.flat([(13,)]).parts(2) == [[(0, 7), (7, 13)]]
    # round_robin_gradients: positions 0 and 2, then 1 and 3, in the buffer (3 + 5 | 4 + 2).
    assert part.zero([(3,), (4,), (5,), (2,)], 2, round_robin=True).parts(2) == [
        [(0, 3), (0, 0)], [(0, 0), (0, 4)], [(0, 5), (0, 0)], [(0, 0), (0, 2)]]
    # Stage 3: each parameter alone, in chunks of ceil(numel / N).
    assert part.zero([(2, 3), (5,)], 3, stage=3).parts(3) == [[(0, 2), (2, 4), (4, 6)],
                                                              [(0, 2), (2, 4), (4, 5)]]
    # A rank's flat partition (built here as DeepSpeed builds its buffer) cut back into its parts.
    shapes, world = [(3,), (2, 2), (5,), (2,)], 2
    wholes = [torch.arange(float(torch.Size(s).numel())).view(s) + 100 * k for k, s in enumerate(shapes)]
    for round_robin, order in ((False, [0, 1, 2, 3]), (True, [0, 2, 1, 3])):
        partition = part.zero(shapes, world, round_robin=round_robin)
        buffer = torch.cat([wholes[k].reshape(-1) for k in order] + [torch.full((2,), -1.0)])  # 14 → 16
        for rank in range(world):
            views = part.zero_views(buffer[8 * rank:8 * (rank + 1)], shapes, world, rank, round_robin=round_robin)
            for k, view in enumerate(views):
                assert torch.equal(view, part.cut(wholes[k], partition, k, world, rank).reshape(-1)), (rank, k)
    with pytest.raises(ValueError, match="rank 1's flat partition has 7 elements; .* has 8"):
        part.zero_views(torch.zeros(7), shapes, world, 1)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        part.zero(shapes, world, stage=4)


# -- the adapters, on plain objects carrying a DTensor's and an FSDP1 FlatParameter's facts ------------

def test_from_dtensor_maps_shard0_to_rows_and_refuses_other_placements():
    whole = torch.arange(14.0).view(7, 2)
    for rank in range(3):
        local, shape = part.from_dtensor(FakeDTensor.of(whole, 3, rank, Shard(0)))
        assert shape == (7, 2)
        assert torch.equal(local, part.cut(whole, part.rows([shape]), 0, 3, rank))
    with pytest.raises(ValueError, match="only Shard\\(0\\)"):
        part.from_dtensor(FakeDTensor.of(whole, 3, 0, Shard(1)))


class Replicate:
    pass


class HsdpMesh:
    ndim = 2

    def __init__(self, replicas, shards, rank):
        self._sizes, self._rank = (replicas, shards), rank

    def size(self, mesh_dim):
        return self._sizes[mesh_dim]

    def get_local_rank(self, mesh_dim):
        return (self._rank // self._sizes[1], self._rank % self._sizes[1])[mesh_dim]


def test_from_dtensor_maps_hsdps_replicate_shard0_to_rows_with_replicas():
    # A (replicate, shard) mesh of 2 × 3: rank 4 is shard 1 of the second replica.
    whole = torch.arange(14.0).view(7, 2)
    dtensor = FakeDTensor.of(whole, 3, 1, Shard(0))
    dtensor._spec = dataclasses.replace(dtensor._spec, mesh=HsdpMesh(2, 3, 4), placements=(Replicate(), Shard(0)))
    local, shape = part.from_dtensor(dtensor)
    assert shape == (7, 2)
    assert torch.equal(local, part.cut(whole, part.rows([shape], replicas=2), 0, 6, 4))
    dtensor._spec = dataclasses.replace(dtensor._spec, placements=(Shard(0), Shard(0)))
    with pytest.raises(ValueError, match=r"only \(Replicate\(\), Shard\(0\)\) \(HSDP\)"):
        part.from_dtensor(dtensor)


def test_from_fsdp1_reads_the_flat_layout_with_its_padding():
    class Flat:
        _shapes = [(3, 2), (5,)]
        _numels_with_padding = [6, 2, 5]  # 2 elements of alignment padding between the two
        _is_padding_mask = [False, True, False]
        _unpadded_unsharded_size = (13,)
        _sharded_size = (7,)  # set by FlatParamHandle.shard: chunks of 7

    partition = part.from_fsdp1(Flat(), 2)  # 13 elements: ranks hold [0, 7) and [7, 13) of the flat layout
    assert partition.kind == "explicit" and partition.shapes == ((3, 2), (5,))
    assert partition.parts(2) == [[(0, 6), (0, 0)], [(0, 0), (0, 5)]]


def test_from_fsdp1_reads_torch_1_13s_layout_without_alignment_padding():
    class Flat:  # torch 1.13: _numels only, sharded (_shard_indices set)
        _shapes = [(3, 2), (5,)]
        _numels = [6, 5]
        _shard_indices = (0, 0)

    # 11 elements in torch.chunk's 3 chunks of 4 (by parameter, then rank): rank 1 holds the end of
    # one and the start of the other.
    assert part.from_fsdp1(Flat(), 3).parts(3) == [[(0, 4), (4, 6), (0, 0)], [(0, 0), (0, 2), (2, 5)]]


def test_from_fsdp1_refuses_no_shard():
    class Torch2NoShard:
        _shapes = [(3, 2)]
        _numels_with_padding = [6]
        _is_padding_mask = [False]
        _unpadded_unsharded_size = (6,)
        _sharded_size = (6,)  # NO_SHARD: the whole

    class Torch113NoShard:  # no _shard_indices: FlatParamHandle.shard returned before setting them
        _shapes = [(3, 2)]
        _numels = [6]

    for flat in (Torch2NoShard(), Torch113NoShard()):
        with pytest.raises(ValueError, match="not sharded .ShardingStrategy.NO_SHARD"):
            part.from_fsdp1(flat, 2)


def test_shard_parameters_cuts_a_model_for_each_rank():
    model = torch.nn.Linear(3, 5)
    pieces = [part.shard_parameters(model.named_parameters(), 2, r, kind="flat", alignment=4)
              for r in range(2)]
    weight = torch.cat([dict(local)["weight"].reshape(-1) for local, _ in pieces])
    assert torch.equal(weight, model.weight.detach().reshape(-1))
    assert all(t.requires_grad and t.is_leaf for local, _ in pieces for _, t in local)
    assert pieces[0][1] == pieces[1][1] == part.flat([(5, 3), (5,)], alignment=4)


def test_a_scalar_in_a_rows_group_is_rank_0s_whether_0_d_or_1_d():
    for local in (torch.tensor(2.0, requires_grad=True), torch.ones(1, requires_grad=True)):
        part.check_local(part.rows([()]), [local], ["scale"], 2, 0)
    with pytest.raises(ValueError, match="rank 1 holds elements \\[1, 1\\)"):
        part.check_local(part.rows([()]), [torch.tensor(2.0, requires_grad=True)], ["scale"], 2, 1)
    part.check_local(part.rows([()]), [torch.zeros(0, requires_grad=True)], ["scale"], 2, 1)
