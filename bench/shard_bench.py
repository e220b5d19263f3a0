"""One session over 1, 2 and 3 daemons: step time next to the placement's predicted balance.

Starts three CPU daemons on loopback (each with --threads as given), then for K = 1, 2, 3 opens a
session of a small transformer's parameters (--layers blocks of width --width: q, k, v, o and the
MLP's two matrices in Muon, an embedding and the biases in AdamW, the q/k pair under QK-clip) over
the first K daemons through the Python client, takes one untimed step, and times --steps steps.
Printed per K: the placement's predicted balance (max/mean of the daemons' optimizer cost; 1.0 is
perfect), each daemon's share of the cost, the mean step time, and its ratio to one daemon.

All daemons share this machine's cores, so K daemons cannot run K times faster here than the cores
allow: on a 2-core machine the figure to read is how close K = 2 gets to half of K = 1, and that
K = 3 costs no more than K = 2. On separate hosts (or GPUs) each daemon has its own.

    python3 bench/shard_bench.py [--binary build/muond] [--layers 4] [--width 384] [--steps 5] [--threads 1]
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch

from bench_daemon import REPO, cpu_daemon


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)


def model_of(layers, width):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(4096, width)
    model.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default=str(REPO / "build" / "muond"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="each daemon's --threads")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set

    with contextlib.ExitStack() as stack:
        endpoints = [stack.enter_context(cpu_daemon(args.binary, args.threads))[1] for _ in range(3)]
        print(f"model: {args.layers} blocks of width {args.width}; {args.steps} timed steps; "
              f"each daemon --threads {args.threads}")
        print(f"{'daemons':>7} {'balance (max/mean)':>18} {'cost share per daemon':>28} {'step ms':>9} {'vs 1':>6}")
        baseline = None
        for k in (1, 2, 3):
            model = model_of(args.layers, args.width)
            pairs = [(b.q.weight, b.k.weight, 4) for b in model.blocks]
            opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoints=endpoints[:k],
                                        session=f"shard-bench-{k}", qk_clip=pairs, transport="grpc")
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 0.01
            logits = {b.q.weight: [1.0] * 4 for b in model.blocks}
            opt.step(qk_logits=logits)  # untimed: first touches
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                opt.step(qk_logits=logits)
                times.append(time.perf_counter() - start)
            mean_ms = 1e3 * statistics.mean(times)
            baseline = baseline or mean_ms
            total = sum(opt.placement.loads)
            shares = " ".join(f"{load / total:.2f}" for load in opt.placement.loads)
            print(f"{k:>7} {opt.placement.imbalance:>18.3f} {shares:>28} {mean_ms:>9.1f} {mean_ms / baseline:>6.2f}")
            opt.close()


if __name__ == "__main__":
    main()
