#!/usr/bin/env python3
"""Sharded training with the optimizer on a muond daemon: N processes (torch.distributed, gloo,
CPU), each holding only its part of every parameter, as FSDP and ZeRO do. Each step a rank gathers
the whole parameters for forward and backward, reduces the gradients and keeps its part of them,
and calls ``opt.step()`` in place of the local optimizer: it sends only its part of the gradient
and gets back only its part of the new parameters. The daemon assembles the whole gradient and
runs Muon on whole matrices (docs/ranks.md, Ranks that hold parts).

The matrices are cut by rows (DTensor ``Shard(0)``, FSDP2), the biases by a flat partition (ZeRO).
gloo has no reduce-scatter on CPU here, so the gradients are all-reduced and sliced, and the
parameters all-gathered by an all-reduce of zero-padded parts; an FSDP trainer has both done for it.

With ``--replicas R`` it is HSDP: R replicas of the model, each sharded over ranks / R ranks (rank r
holds shard r mod ranks/R). The collectives stay within a replica; the averaging across replicas,
HSDP's all-reduce over the replica group, is the daemon's (docs/ranks.md, HSDP).

    muond --listen 127.0.0.1:50051 --backend cpu &
    python3 examples/train_sharded.py --endpoint 127.0.0.1:50051 --ranks 2 --steps 50
    python3 examples/train_sharded.py --endpoint 127.0.0.1:50051 --ranks 4 --replicas 2

With several daemons (``--endpoint a,b``) the session spreads over them too: each daemon holds whole
parameters, assembled from the ranks' parts (docs/ranks.md, Over several daemons).

    muond --listen 127.0.0.1:50052 --backend cpu &
    python3 examples/train_sharded.py --endpoint 127.0.0.1:50051,127.0.0.1:50052 --ranks 2
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
from muond import partition  # noqa: E402


def make_data(seed: int, n: int = 4096):
    """A regression task every rank can rebuild: y = tanh(x·W / √32) for a fixed W."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    return x, torch.tanh(x @ w / 32 ** 0.5)


def gather_whole(model: nn.Module, groups, world: int, rank: int, replica) -> None:
    """The parts of this rank's replica into the model's whole parameters (an all-gather)."""
    with torch.no_grad():
        for group in groups:
            ranges = group["partition"].parts(world)
            for k, (name, local) in enumerate(group["params"]):
                whole = torch.zeros(group["partition"].numel(k))
                begin, end = ranges[k][rank]
                whole[begin:end] = local.reshape(-1)
                dist.all_reduce(whole, group=replica)
                model.get_parameter(name).copy_(whole.view(group["partition"].shapes[k]))


def keep_my_gradients(model: nn.Module, groups, world: int, rank: int, replica, shards: int) -> None:
    """The mean gradient over this rank's replica, of which each rank keeps its part (a
    reduce-scatter). Across replicas the daemon averages the parts."""
    for group in groups:
        for k, (name, local) in enumerate(group["params"]):
            grad = model.get_parameter(name).grad
            dist.all_reduce(grad, group=replica)
            grad /= shards
            local.grad = partition.cut(grad, group["partition"], k, world, rank).view(local.shape)


def train(rank: int, args: argparse.Namespace, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    # The ranks of each replica, as a (replicate, shard) mesh numbers them; every rank makes every group.
    shards = args.ranks // args.replicas
    replicas = [dist.new_group(list(range(i * shards, (i + 1) * shards))) for i in range(args.replicas)]
    replica = replicas[rank // shards]
    torch.manual_seed(0)  # every rank builds the same initial model, then keeps its parts of it
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
    named = list(model.named_parameters())
    matrices, rows = partition.shard_parameters([(n, p) for n, p in named if p.dim() >= 2], args.ranks, rank,
                                                "rows", replicas=args.replicas)
    biases, flat = partition.shard_parameters([(n, p) for n, p in named if p.dim() < 2], args.ranks, rank,
                                              "flat", replicas=args.replicas)
    groups = [
        {"params": matrices, "partition": rows},
        {"params": biases, "optimizer": "adamw", "lr": 3e-3, "partition": flat},
    ]
    daemons = args.endpoint.split(",")
    where = {"endpoints": daemons} if len(daemons) > 1 else {"endpoint": args.endpoint}
    opt = muond.RemoteOptimizer(groups, **where, lr=0.02)
    x, y = make_data(seed=1)
    shard = slice(rank, None, args.ranks)  # this rank's share of the examples
    xs, ys = x[shard], y[shard]
    sent = sum(t.numel() for group in groups for _, t in group["params"])
    whole = sum(p.numel() for _, p in named)
    if rank == 0:
        print(f"rank 0 holds {sent} of {whole} elements; steps travel over {opt.transport} to "
              f"{len(daemons)} daemon(s)", flush=True)
    for step in range(1, args.steps + 1):
        gather_whole(model, groups, args.ranks, rank, replica)
        idx = torch.randint(0, xs.shape[0], (args.batch,), generator=torch.Generator().manual_seed(step * 97 + rank))
        loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
        model.zero_grad()
        loss.backward()
        keep_my_gradients(model, groups, args.ranks, rank, replica, shards)
        opt.step()  # this rank's parts out, its parts of the new parameters back
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss(rank 0 batch) {loss.item():.4f}  grad norm {opt.last_info.grad_norm:.3f}",
                  flush=True)
    gather_whole(model, groups, args.ranks, rank, replica)
    with torch.no_grad():
        full = nn.functional.mse_loss(model(x), y).item()
    if rank == 0:
        layout = f", {args.replicas} replicas of {shards} shards" if args.replicas > 1 else ""
        print(f"final loss on all data: {full:.4f} (session {opt.session_id}, {args.ranks} ranks{layout})")
    dist.barrier()  # every rank is done before rank 0 ends the shared session
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("MUOND_ENDPOINT", "127.0.0.1:50051"),
                        help="the daemon, or several separated by commas (a session sharded over them)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=1, help="HSDP: replicas of the sharded model")
    args = parser.parse_args()
    if args.replicas < 1 or args.ranks % args.replicas:
        parser.error(f"--replicas must divide --ranks ({args.ranks}), got {args.replicas}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(args, os.path.join(tmp, "store")), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
