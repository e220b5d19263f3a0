#!/usr/bin/env python3
"""DiLoCo with the outer optimizer on a muond daemon: K workers each train their own copy of a small
model with AdamW on their own share of the data, and every --sync-every inner steps send their
pseudo-gradient (global parameters at the last sync minus local parameters), weighted by the
samples they trained on since. The daemon averages them and applies the outer step (Nesterov SGD,
lr 0.7, momentum 0.9; or Muon for the matrices with --outer muon); every worker continues from the
new global parameters. With --fragments F the parameters sync in F fragments, one every
sync_every/F steps (Streaming DiLoCo). docs/diloco.md explains the schedule.

    muond --listen 127.0.0.1:50051 --backend cpu &
    python3 examples/train_diloco.py --endpoint 127.0.0.1:50051 --workers 4 --steps 200

The workers share no process group: they only name the same session. Here they run as local
processes; on separate machines run one per machine with --rank r --world-size K --session NAME
(the session then stays on the daemon when they finish, until it is closed there).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import muond  # noqa: E402


def make_data(seed: int = 1, n: int = 4096):
    """Targets of a fixed random teacher network, y = relu(x·A)·B; every worker rebuilds them."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(32, 64, generator=g) / 32 ** 0.5, torch.randn(64, 8, generator=g) / 8
    x = torch.randn(n, 32, generator=g)
    return x, torch.relu(x @ a) @ b


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every worker starts from the same parameters
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


@torch.no_grad()
def loss_with(model: nn.Module, parameters, x, y) -> float:
    """The loss on (x, y) of ``model`` with ``parameters`` (by name) in place of its own."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.copy_(parameters[n])
    loss = nn.functional.mse_loss(model(x), y).item()
    for n, p in model.named_parameters():
        p.copy_(saved[n])
    return loss


def train(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
    outer = "muon" if args.outer == "muon" else None  # None: DiLoCo's Nesterov SGD (0.7, 0.9)
    diloco = muond.DiLoCo(model, inner, sync_every=args.sync_every, fragments=args.fragments, outer=outer,
                          endpoint=args.endpoint, session=args.session, world_size=args.world_size, rank=rank,
                          wire_dtype=args.wire_dtype, overlap_steps=args.overlap_steps,
                          merge_alpha=args.merge_alpha)
    x, y = make_data()
    xs, ys = x[rank::args.world_size], y[rank::args.world_size]  # this worker's share of the examples
    batch = args.batch + 16 * rank  # workers may differ in batch size: the weights follow the samples
    if rank == 0:
        print(f"initial loss on all data: {loss_with(model, diloco.global_parameters(), x, y):.4f}", flush=True)
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, xs.shape[0], (batch,), generator=torch.Generator().manual_seed(step * 97 + rank))
        loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
        diloco.zero_grad()
        loss.backward()
        diloco.step(tokens=batch)  # the inner AdamW step; a sync when one is due
        if rank == 0 and diloco.last_merged is not None:  # a sync's answer merged by this step
            info = diloco.last_info
            print(f"step {step:4d}  sync {info.step} (fragment {diloco.last_merged})  weights {info.total_weight:g}  "
                  f"global loss {loss_with(model, diloco.global_parameters(), x, y):.4f}", flush=True)
    if rank == 0:
        final = loss_with(model, diloco.global_parameters(), x, y)
        print(f"final loss on all data: {final:.5f} (global parameters; session {diloco.session_id}, "
              f"{args.world_size} workers)")
        syncs = max(1, diloco.remote.last_step)
        print(f"pseudo-gradient bytes per outer step ({args.wire_dtype}): {diloco.sync_bytes / syncs:.0f}")
    diloco.close(keep_session=True)  # the launcher ends the session once every worker is done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("MUOND_ENDPOINT", "127.0.0.1:50051"))
    parser.add_argument("--workers", type=int, default=2, help="local worker processes to start")
    parser.add_argument("--rank", type=int, help="run only this worker (one per machine)")
    parser.add_argument("--world-size", type=int, help="the number of workers, with --rank")
    parser.add_argument("--session", help="the session id every worker names (default: a fresh one)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=20, help="H: inner steps between syncs of a fragment")
    parser.add_argument("--fragments", type=int, default=1, help="F: Streaming DiLoCo fragments (H must be a multiple)")
    parser.add_argument("--overlap-steps", type=int, default=0,
                        help="tau: inner steps a sync runs beside before its answer is merged (< H/F)")
    parser.add_argument("--merge-alpha", type=float, default=0.0,
                        help="alpha: the share of the local values a merge keeps")
    parser.add_argument("--outer", choices=["sgd", "muon"], default="sgd")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--wire-dtype", choices=["fp32", "bf16", "int8", "int4"], default="fp32",
                        help="the pseudo-gradients on the wire (int8/int4: block-quantized, error feedback)")
    args = parser.parse_args()
    if args.rank is not None:
        if args.world_size is None or args.session is None:
            parser.error("--rank needs --world-size and --session (the same on every worker)")
        train(args.rank, args)
        return
    args.world_size = args.workers
    args.session = args.session or f"diloco-{uuid.uuid4().hex[:12]}"
    try:
        mp.spawn(train, args=(args,), nprocs=args.workers, join=True)
    finally:
        conn = muond.Connection(args.endpoint)
        try:
            conn.close_session(args.session)
        except muond.MuondError:
            pass  # never opened (a worker failed first): its error is the one to see
        finally:
            conn.close()


if __name__ == "__main__":
    main()
