"""Many small tensors over gRPC: the transport and client overhead of a step of a small transformer's
parameters (12 layers, d=128: 61 tensors, 2.9 M parameters, most of them a few hundred KiB) from
the Python client, against raw TCP on the same loopback, with and without packed chunks.

Starts the real muond (--backend cpu) on loopback. Per mode, one untimed step and then --reps timed
ones of AdamW over every tensor (the daemon's compute is small and reported apart). Printed: the
median opt.step() wall time, the daemon's compute, their difference (what the transports and the
client cost), the bytes both ways over that difference as an effective rate, and the same bytes
over a raw TCP connection on loopback (one sendall, the peer reading in 1 MiB pieces) as the floor.
Target (docs/protocol.md, "Packed chunks"): at least 0.7 GB/s effective over gRPC.

    python3 bench/small_tensors_bench.py [--binary build/muond] [--reps 20] [--threads 2]
"""

import argparse
import socket
import statistics
import sys
import threading
import time

import torch

from bench_daemon import REPO, add_daemon_flags, cpu_daemon


def transformer_shapes(layers: int = 12, d: int = 128, vocab: int = 4096):
    shapes = [("embedding", (vocab, d))]
    for layer in range(layers):
        shapes += [(f"h{layer}.ln", (d,)), (f"h{layer}.qkv", (3 * d, d)), (f"h{layer}.proj", (d, d)),
                   (f"h{layer}.up", (4 * d, d)), (f"h{layer}.down", (d, 4 * d))]
    return shapes


def raw_tcp_seconds(nbytes: int, reps: int) -> float:
    """Median seconds to move `nbytes` one way over a loopback TCP connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    payload = bytes(nbytes)
    times = []

    def drain():
        left = nbytes
        while left:
            left -= len(receiver.recv(min(left, 1 << 20)))

    for _ in range(reps + 1):
        reader = threading.Thread(target=drain)
        started = time.perf_counter()
        reader.start()
        sender.sendall(payload)
        reader.join()
        times.append(time.perf_counter() - started)
    for s in (sender, receiver, server):
        s.close()
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_daemon_flags(parser)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import muond  # noqa: E402 - after the path is set
    from muond.transport import grpc_transport  # noqa: E402

    torch.manual_seed(0)
    shapes = transformer_shapes()
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for _, shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    total = sum(p.numel() for p in params)
    both_ways = 2 * 4 * total
    print(f"12 layers, d=128: {len(params)} tensors, {total / 1e6:.2f} M parameters, "
          f"{both_ways / 1e6:.1f} MB both ways (fp32); daemon --threads {args.threads or 'all'}; "
          f"torch {torch.get_num_threads()} threads")
    floor = raw_tcp_seconds(both_ways, args.reps)
    print(f"  raw TCP, loopback:    {floor * 1e3:7.1f} ms for the same bytes  = {both_ways / floor / 1e9:5.2f} GB/s")

    offer = grpc_transport.GrpcTransport.offer
    with cpu_daemon(args.binary, args.threads) as (_, endpoint):
        for label, transport, pack in (("gRPC, packed", "grpc", True), ("gRPC, one per tensor", "grpc", False),
                                       ("shared memory", "shm", True)):
            if not pack:  # as a client of a daemon without packed chunks would
                def unpacked(self):
                    info = type(offer(self))()
                    info.CopyFrom(offer(self))
                    info.packed_chunks = False
                    return info
                grpc_transport.GrpcTransport.offer = unpacked
            try:
                with muond.RemoteOptimizer([{"params": params, "optimizer": "adamw"}], endpoint=endpoint,
                                           transport=transport) as opt:
                    walls, computes = [], []
                    for i in range(args.reps + 1):
                        started = time.perf_counter()
                        opt.step()
                        if i:
                            walls.append(time.perf_counter() - started)
                            computes.append(opt.last_info.compute_seconds)
            finally:
                grpc_transport.GrpcTransport.offer = offer
            wall, compute = statistics.median(walls), statistics.median(computes)
            overhead = wall - compute
            print(f"  {label:<21} step {wall * 1e3:6.1f} ms, compute {compute * 1e3:5.1f} ms, overhead "
                  f"{overhead * 1e3:6.1f} ms = {both_ways / overhead / 1e9:5.2f} GB/s effective "
                  f"({floor / overhead:4.2f} x raw TCP)")


if __name__ == "__main__":
    main()
