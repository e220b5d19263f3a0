"""Many sessions on few cores: the same steps run one session after another, then all sessions at
once, against the real CPU daemon.

Starts muond (--backend cpu, --threads as given) on loopback, opens --sessions sessions through the
Python client (each a two-layer MLP of width --width: matrices in Muon, biases in AdamW), takes one
untimed step in each, then times --rounds rounds twice: sequentially (session 1's step, then
session 2's, ...) and concurrently (one thread per session, all stepping their next step at once,
the round ending when the last is answered). Printed: both wall times and concurrent/sequential.
The target (README, CPU performance) is a ratio of at most 1.0: stepping at once must not cost more
than stepping in turn.

    python3 bench/concurrency_bench.py [--binary build/muond] [--sessions 8] [--width 512] [--rounds 5]
"""

import argparse
import threading
import time

import torch

from bench_daemon import add_daemon_flags, cpu_daemon, open_sessions


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        sessions = open_sessions(endpoint, args.sessions, args.width, "concurrency")
        for model, opt in sessions:
            model(torch.randn(16, args.width)).square().mean().backward()  # the same gradients every step
            opt.step()

        start = time.perf_counter()
        for _ in range(args.rounds):
            for _, opt in sessions:
                opt.step()
        sequential = time.perf_counter() - start

        barrier = threading.Barrier(args.sessions + 1)

        def worker(opt):
            for _ in range(args.rounds):
                barrier.wait()
                opt.step()
            barrier.wait()

        threads = [threading.Thread(target=worker, args=(opt,)) for _, opt in sessions]
        for t in threads:
            t.start()
        start = time.perf_counter()
        for _ in range(args.rounds + 1):
            barrier.wait()
        concurrent = time.perf_counter() - start
        for t in threads:
            t.join()
        params = sum(p.numel() for m, _ in sessions for p in m.parameters())
        print(f"{args.sessions} sessions, {params:,} parameters, {args.rounds} rounds: "
              f"one after another {sequential:.2f} s, all at once {concurrent:.2f} s, "
              f"at once / in turn {concurrent / sequential:.2f}")
        for _, opt in sessions:
            opt.close()


if __name__ == "__main__":
    main()
