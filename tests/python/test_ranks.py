"""Data-parallel ranks from Python: two processes (torch.distributed, gloo, CPU) each send their own
gradients to one session and get back parameters bit-identical to one process stepping the average
of the two ranks' gradients (fp64 sum in rank order, halved, as the daemon averages)."""

import pytest
import torch
import torch.distributed as dist

import muond

from helpers import TinyNet, loss_of
from processes import run_rank_processes

STEPS = 3


def rank_batch(rank: int, step: int) -> int:
    return 100 * rank + step  # each rank sees different data


def _worker(rank: int, world: int, store: str, endpoint: str, out: str, transport: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = TinyNet(seed=50)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    transport=transport, max_grad_norm=1.0)
        assert (opt.world_size, opt.rank) == (world, rank)
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss_of(model, rank_batch(rank, step)).backward()
            opt.step()
            assert opt.last_info.applied
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}.{rank}")
        dist.barrier()  # nobody closes the shared session while another rank still steps
        opt.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.once  # both transports, named
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_two_ranks_equal_one_process_stepping_their_average(endpoint, tmp_path, transport):
    out = str(tmp_path / "params")
    run_rank_processes(_worker, args=(2, str(tmp_path / "store"), endpoint, out, transport), nprocs=2)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")

    torch.set_num_threads(1)
    model = TinyNet(seed=50)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               world_size=1, rank=0, max_grad_norm=1.0) as opt:
        for step in range(1, STEPS + 1):
            grads = []
            for rank in range(2):
                model.zero_grad()
                loss_of(model, rank_batch(rank, step)).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            for n, p in model.named_parameters():
                p.grad = ((grads[0][n].double() + grads[1][n].double()) / 2).float()
            opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(rank0[n], rank1[n]), f"ranks disagree on {n}"
        assert torch.equal(rank0[n], p.detach()), f"{n} differs from the averaged single-process step"


def test_ranks_need_one_session_id_without_torch_distributed(endpoint):
    model = TinyNet(seed=51)
    with pytest.raises(ValueError, match="session"):
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, world_size=2, rank=1)
    with pytest.raises(ValueError, match="rank"):
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, world_size=2, rank=2,
                              session="bad-rank")
