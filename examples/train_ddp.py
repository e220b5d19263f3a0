#!/usr/bin/env python3
"""Data-parallel training with the optimizer on a muond daemon: N processes (torch.distributed,
gloo, CPU), each computing gradients on its own shard of the data; the daemon averages the ranks'
gradients and applies one Muon + AdamW step, which every rank receives. The daemon's average
replaces DDP's all-reduce, so the model is not wrapped in DistributedDataParallel here; with a DDP
model, run backward under ``model.no_sync()`` so DDP does not all-reduce gradients the daemon
averages anyway.

    muond --listen 127.0.0.1:50051 --backend cpu &
    python3 examples/train_ddp.py --endpoint 127.0.0.1:50051 --ranks 2 --steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import muond  # noqa: E402


def make_data(seed: int, n: int = 4096):
    """A regression task every rank can rebuild: y = tanh(x·W / √32) for a fixed W."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    return x, torch.tanh(x @ w / 32 ** 0.5)


def train(rank: int, args: argparse.Namespace, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)  # rank 0's initial values go to the daemon; the others read them back
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
    # world_size and rank come from torch.distributed; rank 0's fresh session id is shared.
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=args.endpoint, lr=0.02)
    x, y = make_data(seed=1)
    shard = slice(rank, None, args.ranks)  # this rank's share of the examples
    xs, ys = x[shard], y[shard]
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, xs.shape[0], (args.batch,), generator=torch.Generator().manual_seed(step * 97 + rank))
        loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()  # sends this rank's gradients; returns once every rank's have been averaged and applied
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss(rank 0 batch) {loss.item():.4f}  grad norm {opt.last_info.grad_norm:.3f}  "
                  f"via {opt.transport}", flush=True)
    with torch.no_grad():
        full = nn.functional.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"final loss on all data: {full:.4f} (session {opt.session_id}, {args.ranks} ranks)")
    dist.barrier()  # every rank is done before rank 0 ends the shared session
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("MUOND_ENDPOINT", "127.0.0.1:50051"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(args, os.path.join(tmp, "store")), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
