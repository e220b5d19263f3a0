"""The torch peer of elementwise_bench: one optimizer step of torch.optim.AdamW and torch.optim.SGD
(momentum 0.9), each with foreach=False (one tensor at a time) and foreach=True (torch's multi-tensor
path), and Lion written with torch ops the same two ways (torch has no Lion), over 8 fp32 tensors
holding --params parameters in all, on the CPU with --threads threads. One JSON object per line
with --json, else a table; the median of --reps timed steps after one warm-up step.
"""

import argparse
import json
import statistics
import time

import torch

TENSORS = 8


def lion_step(params, exp_avgs, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0, foreach=False):
    """Lion (Chen et al. 2023) as muond computes it: u = sign(β1·m + (1−β1)·g);
    p ← p·(1−η·λ) − η·u; m ← β2·m + (1−β2)·g."""
    grads = [p.grad for p in params]
    if foreach:
        update = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(update, grads, alpha=1 - beta1)
        for u in update:  # torch 1.13 has no _foreach_sign_
            u.sign_()
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_add_(params, update, alpha=-lr)
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)
        return
    for p, g, m in zip(params, grads, exp_avgs):
        update = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        p.add_(update, alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)


def make_params(total):
    params = []
    for _ in range(TENSORS):
        p = torch.full((total // TENSORS,), 0.5, requires_grad=True)
        p.grad = torch.full_like(p, 0.01)
        params.append(p)
    return params


def time_steps(step, reps):
    step()  # warm-up: torch allocates the optimizer state here
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=int, nargs="+", default=[16_000_000, 64_000_000])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.json:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {TENSORS} tensors per run")
        print(f"{'step':<16} {'params':>12} {'Gparam/s':>12}")
    for total in args.params:
        for name in ("adamw", "lion", "sgd"):
            for foreach in (False, True):
                params = make_params(total)
                if name == "adamw":
                    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
                    step = opt.step
                elif name == "sgd":
                    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach)
                    step = opt.step
                else:
                    exp_avgs = [torch.zeros_like(p) for p in params]
                    step = lambda: lion_step(params, exp_avgs, foreach=foreach)  # noqa: E731
                with torch.no_grad():
                    seconds = time_steps(step, args.reps)
                gparams = total / seconds / 1e9
                variant = "foreach" if foreach else "plain"
                if args.json:
                    print(json.dumps({"bench": "step", "optimizer": name, "variant": variant,
                                      "params": total, "ms_median": seconds * 1e3,
                                      "gparams": gparams}))
                else:
                    print(f"{name + ' ' + variant:<16} {total:>12} {gparams:>12.3f}")
                del params, step


if __name__ == "__main__":
    main()
