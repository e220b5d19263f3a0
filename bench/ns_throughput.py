#!/usr/bin/env python3
"""The torch side of muond's benchmarks: the peer figures that run_ns_bench.sh prints next to
ns_bench's and step_bench's.

--mode ns:   Newton-Schulz the seeds' way (Keller Jordan's zeropower_via_newtonschulz5: cast to
             the GEMM dtype, transpose tall matrices to wide, divide by the Frobenius norm + 1e-7,
             5 iterations of the `simple` coefficients, batched over a leading dimension), on the
             shapes of bench/bench_common.h, in TFLOP/s with 4*m^2*n + 2*m^3 FLOPs per iteration
             (m <= n).
--mode step: a pure-torch Muon + AdamW step on the GPT-2-small parameter set of step_bench.cc:
             Muon per matrix as in Keller Jordan's muon_update (EMA momentum with Nesterov, NS,
             scale sqrt(max(1, rows/cols)), decoupled decay, update), torch.optim.AdamW for the rest.

Output: a table, or with --json one JSON object per line. Works with torch 1.13 on the CPU.
"""
import argparse
import json
import statistics
import time

import torch

SIMPLE = (3.4445, -4.7750, 2.0315)


def ns_shapes(quick):
    # (rows, cols, batch); the same lists as NsShapes() in bench_common.h.
    if quick:
        return [(256, 256, 1), (1024, 1024, 1), (192, 768, 1), (1024, 2752, 1), (192, 768, 6)]
    return [(1024, 1024, 1), (4096, 4096, 1), (768, 3072, 1), (1024, 2752, 1), (4096, 11008, 1), (768, 3072, 24)]


def shape_name(rows, cols, batch):
    name = f"{rows}x{cols}"
    return name if batch == 1 else f"{batch}x({name})"


def ns_flops(rows, cols, batch, steps):
    m, n = min(rows, cols), max(rows, cols)
    return steps * batch * (4 * m * m * n + 2 * m * m * m)


def newton_schulz(g, steps, dtype):
    a, b, c = SIMPLE
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.mT if tall else x


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ns(args, device, dtype):
    results = []
    for rows, cols, batch in ns_shapes(args.quick):
        g = torch.randn((batch, rows, cols) if batch > 1 else (rows, cols), device=device)
        for _ in range(args.warmup):
            newton_schulz(g, args.steps, dtype)
        sync(device)
        start = time.perf_counter()
        for _ in range(args.reps):
            newton_schulz(g, args.steps, dtype)
        sync(device)
        seconds = (time.perf_counter() - start) / args.reps
        results.append({"bench": "ns", "impl": "torch", "shape": shape_name(rows, cols, batch),
                        "device": device.type, "dtype": str(dtype).replace("torch.", ""),
                        "ms": seconds * 1e3,
                        "tflops": ns_flops(rows, cols, batch, args.steps) / seconds / 1e12})
    return results


def gpt2_params(quick):
    """(name, shape, use_muon): the same list as Gpt2Params() in step_bench.cc."""
    layers, d = (2, 192) if quick else (12, 768)
    vocab, context = (2048, 256) if quick else (50257, 1024)
    params = [("wte", (vocab, d), False), ("wpe", (context, d), False)]
    for layer in range(layers):
        p = f"h{layer}."
        params += [(p + "attn.c_attn.weight", (d, 3 * d), True),
                   (p + "attn.c_proj.weight", (d, d), True),
                   (p + "mlp.c_fc.weight", (d, 4 * d), True),
                   (p + "mlp.c_proj.weight", (4 * d, d), True)]
        params += [(p + v, (d,), False) for v in ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias",
                                                  "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")]
        params += [(p + "attn.c_attn.bias", (3 * d,), False), (p + "mlp.c_fc.bias", (4 * d,), False)]
    params += [("ln_f.weight", (d,), False), ("ln_f.bias", (d,), False)]
    return params


def bench_step(args, device, dtype):
    # muond's defaults (docs/algorithms.md, Group options): Muon lr 0.02, momentum 0.95, Nesterov,
    # no decay; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    lr, beta, wd = 0.02, 0.95, 0.0
    specs = gpt2_params(args.quick)
    params = [torch.randn(shape, device=device) * 0.02 for _, shape, _ in specs]
    saved = [torch.randn(shape, device=device) * 0.02 for _, shape, _ in specs]
    muon = [(p, torch.zeros_like(p)) for p, (_, _, m) in zip(params, specs) if m]
    adam_params = [p for p, (_, _, m) in zip(params, specs) if not m]
    adamw = torch.optim.AdamW(adam_params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    @torch.no_grad()
    def step():
        for p, momentum in muon:
            grad = p.grad
            momentum.lerp_(grad, 1 - beta)
            update = grad.lerp_(momentum, beta)  # Nesterov, in place as muon_update does
            update = newton_schulz(update, args.steps, dtype)
            update = update * max(1, p.size(-2) / p.size(-1)) ** 0.5
            p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr)
        adamw.step()

    times = []
    for i in range(args.warmup + args.reps):
        for p, g in zip(params, saved):
            p.grad = g.clone()
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return [{"bench": "step", "impl": "torch", "model": "gpt2-quick" if args.quick else "gpt2-small",
             "device": device.type, "dtype": str(dtype).replace("torch.", ""),
             "params": sum(p.numel() for p in params),
             "muon_params": sum(p.numel() for p, _ in muon),
             "ms_median": statistics.median(times), "ms_mean": statistics.mean(times)}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["ns", "step", "all"], default="all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"],
                        help="NS GEMM dtype (default: bf16 on CUDA, fp32 on the CPU, as muond)")
    parser.add_argument("--quick", action="store_true", help="the small shapes of ns_bench --quick")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: keep)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32

    results = []
    if args.mode in ("ns", "all"):
        results += bench_ns(args, device, dtype)
    if args.mode in ("step", "all"):
        results += bench_step(args, device, dtype)
    for r in results:
        if args.json:
            print(json.dumps(r), flush=True)
        elif r["bench"] == "ns":
            print(f"torch NS {r['shape']:<20} {r['ms']:10.3f} ms {r['tflops']:8.3f} TFLOP/s "
                  f"({r['device']}, {r['dtype']})")
        else:
            print(f"torch step {r['model']} ({r['params']} params): median {r['ms_median']:.3f} ms, "
                  f"mean {r['ms_mean']:.3f} ms ({r['device']}, {r['dtype']})")


if __name__ == "__main__":
    main()
