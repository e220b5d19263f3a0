"""Uneven and failing ranks: wall time to a target loss and goodput in lock-step, quorum and
asynchronous sessions, against the real CPU daemon.

Four worker processes train one small model through one muond daemon (--backend cpu, loopback,
started here with --straggler-timeout as given), each on its own stream of data:

  rank 0, rank 1   fast: each step is a fwd/bwd of the model on --batch samples, then a sleep that
                   fills the step to --period seconds
  rank 2           slow: the same, filled to 3 x --period
  rank 3           fast, and SIGKILLed halfway: when half the run's samples have been applied

The model is an MLP (32 -> 256 -> 256 -> 8; hidden matrices in Muon, biases and head in AdamW),
fitting a fixed random teacher network whose outputs have unit variance, from labels with noise
of variance 0.09. Rank 0 evaluates the mean squared error of its current parameters against the
clean teacher on 2048 held-out inputs after each of its steps (inside its step time). Every step
sends weight = --batch. A run ends once --budget-steps x 4 x --batch samples have been applied
(what --budget-steps lock-step steps of all four ranks apply), so every mode sees the same amount
of useful data; rank 3 dies once half of that is applied.

Modes (each on a fresh daemon):

  lock-step  world_size 4: every step waits for every rank, so the run goes at the slow rank's
             pace. When rank 3 dies, the next step waits --straggler-timeout seconds and is ABORTED
             for every rank; a lock-step session cannot go on with a rank missing, so the survivors
             do what a lock-step user does, restart at world_size 3: rank 0 reads the session's
             state (state_dict: masters, Muon momentum, Adam moments, step counts), opens a new
             session of world_size 3 and loads it; ranks 1 and 2 attach to it. Only the stall and
             that hand-over are counted: relaunching processes and reloading a checkpoint from disk,
             as an elastic launcher would, costs more, so this favours lock-step.
  quorum     world_size 4, min_ranks --quorum (2: the two fast ranks that survive; 3 would wait
             for the slow rank once rank 3 is gone), grace --grace: a step goes on once the quorum
             has sent it and the grace has passed; a rank that comes later (the slow one) is
             answered included = false with the current parameters and its gradients are dropped;
             the dead one is simply never waited for. Nothing is restarted.
  async      world_size 4, max_staleness --max-staleness, staleness scaling --staleness-scaling
             ("async:inverse": lr x 1 / (1 + staleness)): every push is applied on arrival as the
             next global step; a push computed on parameters more than max_staleness global steps
             old is refused and dropped. The slow rank's pushes are about 3 x (pushes per period of
             the others) ~ 7 to 10 steps behind, so the default 16 keeps them.

--modes (default lockstep,quorum,quorum:3,async,async:inverse) takes "quorum:Q" for another
min_ranks and "async:none" / "async:inverse" / "async:polynomial:a" / "async:hinge:a:b" for a
staleness scaling (docs/ranks.md).

DiLoCo modes ("diloco:lockstep", "diloco:quorum[:Q]", "diloco:async[:scaling...]"): the same four
workers, speeds and death, as muond.DiLoCo workers (docs/diloco.md): each inner step is a local
AdamW step (lr --inner-lr) on the worker's batch, and every --sync-every inner steps the worker
syncs its pseudo-gradient through the daemon's outer Nesterov SGD (lr --outer-lr; DiLoCo's
defaults otherwise: momentum 0.9, asynchronously 0.5 with delayed Nesterov N = 4; --outer-option
NAME=VALUE adds an option to the outer group, e.g. momentum=0.5, or heloco=true for HeLoCo's
correction), weighted by its samples; --overlap-steps τ and
--merge-alpha α overlap each sync with the next τ inner steps and merge its answer after them.
Rank 0 evaluates the global parameters after each of its merges. A sync's samples count as applied
when the sync used them.
Lock-step DiLoCo restarts at world size 3 when rank 3 dies, as lock-step does (the survivors open a
new session from rank 0's global parameters; the outer momentum starts afresh). The optimizer and its
options (Muon lr --lr, AdamW lr --adam-lr) are the same in every mode; --repeats N runs the modes in
turn N times and prints the medians.

An asynchronous push's answer can fail with ABORTED "the parameters after step N were replaced ...
before they could be sent" when another rank's push is applied between this push and its answer
(the push itself was applied). The worker then resends the push, which the daemon answers from the
rank's record with the latest parameters, applying nothing again; the count is printed per run
("answers lost").

Printed per mode: the wall time to the target eval loss (--target) and to the end of the run, the
eval loss at the end, the samples computed and applied per second (goodput: applied samples / run
time; "used" is applied / computed), and the ratios to lock-step. The wall time starts once every
worker has connected, so process start-up is not in it.

    python3 bench/heterogeneous_bench.py [--binary build/muond] [--period 0.1] [--budget-steps 80]
        [--target 0.15] [--straggler-timeout 5] [--quorum 2] [--grace 0.02] [--max-staleness 16]
        [--modes lockstep,quorum,quorum:3,async,async:inverse] [--repeats 1]
"""

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from bench_daemon import cpu_daemon

REPO = Path(__file__).resolve().parents[1]
D_IN, HIDDEN, D_OUT = 32, 256, 8
NOISE_STD = 0.3
EVAL_SAMPLES = 2048
WORLD = 4
SLOW_RANK, DYING_RANK = 2, 3
SPEEDS = {r: 3.0 if r == SLOW_RANK else 1.0 for r in range(WORLD)}  # step time in units of --period


# -- the problem ----------------------------------------------------------------------------------

def input_shift(rank, non_iid):
    """Worker ``rank``'s input mean under --non-iid S: S along input coordinate ``rank`` (None: IID)."""
    import torch

    if not non_iid:
        return None
    shift = torch.zeros(D_IN)
    shift[rank] = non_iid
    return shift


def make_problem(non_iid=0.0):
    """(teacher, model, eval inputs, eval targets); the same in every process and mode. Under
    --non-iid the evaluation inputs are the workers' distributions in equal parts."""
    import torch

    gen = torch.Generator().manual_seed(123)
    w1 = torch.randn(D_IN, 64, generator=gen) / D_IN ** 0.5
    w2 = torch.randn(64, D_OUT, generator=gen) / 8
    scale = (torch.tanh(1.5 * torch.randn(8192, D_IN, generator=gen) @ w1) @ w2).std()

    def teacher(x):
        return torch.tanh(1.5 * x @ w1) @ w2 / scale

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(D_IN, HIDDEN)
            self.l2 = torch.nn.Linear(HIDDEN, HIDDEN)
            self.head = torch.nn.Linear(HIDDEN, D_OUT)

        def forward(self, x):
            return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))

    torch.manual_seed(0)
    model = Net()
    eval_x = torch.randn(EVAL_SAMPLES, D_IN, generator=torch.Generator().manual_seed(7))
    if non_iid:
        eval_x[torch.arange(EVAL_SAMPLES), torch.arange(EVAL_SAMPLES) % WORLD] += non_iid
    return teacher, model, eval_x, teacher(eval_x)


# -- one worker process ---------------------------------------------------------------------------

class Shared:
    """What the workers and the harness share: per-rank counters (one writer each, no locks, so
    that a killed rank can hold none), rank 0's eval loss, and the events that order start-up."""

    def __init__(self, ctx):
        self.computed = ctx.RawArray("d", WORLD)  # samples whose gradients a rank computed and sent
        self.applied = ctx.RawArray("d", WORLD)   # ... of them that a step used
        self.eval = ctx.RawArray("d", 3)          # rank 0: eval loss, monotonic time, session step
        self.eval[0] = math.inf
        self.lost_answers = ctx.RawArray("i", WORLD)  # async: answers lost to the daemon's race
        self.restarts = ctx.RawValue("i", 0)
        self.heloco = ctx.RawArray("q", 3 * WORLD)    # DiLoCo with heloco: rank r's kept, reoriented, shrunk
        self.opened = ctx.Event()       # rank 0 created the session (the others attach after it)
        self.reopened = ctx.Event()     # lock-step: rank 0 opened the world-size-3 session
        self.ready = ctx.Barrier(WORLD + 1)
        self.stop = ctx.Event()


def sync_options(args, mode):
    """The RemoteOptimizer options of a mode: "lockstep", "quorum" (min_ranks --quorum) or
    "quorum:Q", "async" (staleness scaling --staleness-scaling) or "async:none|inverse|polynomial|
    hinge", the last two with their parameters after more colons ("async:polynomial:2",
    "async:hinge:1:4")."""
    kind, _, variant = mode.partition(":")
    if kind == "lockstep":
        return {"sync_mode": "lockstep"}
    if kind == "quorum":
        return {"sync_mode": "quorum", "min_ranks": int(variant or args.quorum),
                "grace_seconds": args.grace}
    if kind == "diloco":
        return sync_options(args, variant or "lockstep")
    if kind == "async":
        name, *params = (variant or args.staleness_scaling).split(":")
        scaling = (name, *[float(params[0]), *[int(p) for p in params[1:]]]) if params else name
        return {"sync_mode": "async", "max_staleness": args.max_staleness,
                "staleness_scaling": scaling}
    raise ValueError(f"--modes: unknown mode {mode!r}")


def compute_gradients(model, optimizer, teacher, data, batch, period, shift=None):
    """One step's gradients of ``model`` on the next ``batch`` samples of the rank's stream (inputs
    moved by ``shift``, input_shift), the step filled with a sleep to ``period`` seconds."""
    import torch

    started = time.monotonic()
    x = torch.randn(batch, D_IN, generator=data)
    if shift is not None:
        x += shift
    y = teacher(x) + NOISE_STD * torch.randn(batch, D_OUT, generator=data)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    time.sleep(max(0.0, period - (time.monotonic() - started)))


def worker(rank, mode, args, endpoint, shared):
    if mode.startswith("diloco"):
        diloco_worker(rank, mode, args, endpoint, shared)
        return
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import grpc
    import torch

    import muond  # noqa: E402 - after the path is set

    torch.set_num_threads(1)
    teacher, model, eval_x, eval_y = make_problem(args.non_iid)
    data = torch.Generator().manual_seed(1000 + rank)
    session = f"hetero-{mode.replace(':', '-')}"
    lockstep = sync_options(args, mode)["sync_mode"] == "lockstep"
    asynchronous = sync_options(args, mode)["sync_mode"] == "async"

    def open_optimizer(name, world_size, opts):
        return muond.RemoteOptimizer(
            muond.default_param_groups(model, muon={"lr": args.lr}, adamw={"lr": args.adam_lr}),
            endpoint=endpoint, session=name, world_size=world_size, rank=rank,
            transport=args.transport, **opts)

    if rank != 0:
        shared.opened.wait()
    opt = open_optimizer(session, WORLD, sync_options(args, mode))
    if rank == 0:
        shared.opened.set()
    shared.ready.wait()

    period = SPEEDS[rank] * args.period
    while not shared.stop.is_set():
        compute_gradients(model, opt, teacher, data, args.batch, period, input_shift(rank, args.non_iid))
        shared.computed[rank] += args.batch
        try:
            opt.step(weight=args.batch)
        except muond.MuondError as err:
            if err.code != grpc.StatusCode.ABORTED or not (lockstep or asynchronous):
                raise
            if asynchronous:
                # The daemon applied the push but another rank's push replaced the parameters
                # before its answer was sent ("the parameters after step N were replaced ...").
                # Resend the push (the same number): the daemon answers it from the rank's record
                # with the latest parameters and applies nothing again (docs/ranks.md, Resends).
                shared.lost_answers[rank] += 1
                resend(opt, muond, grpc)
                shared.applied[rank] += args.batch
                continue
            # A rank is gone and lock-step cannot step without it: restart at world size 3 from
            # the session's state, as a lock-step job restarts without its dead rank.
            if rank == 0:
                state = opt.state_dict()
                opt.close()
                opt = open_optimizer(session + "-world3", WORLD - 1, sync_options(args, mode))
                opt.load_state_dict(state)
                shared.restarts.value += 1
                shared.reopened.set()
            else:
                opt.close()
                shared.reopened.wait()
                opt = open_optimizer(session + "-world3", WORLD - 1, sync_options(args, mode))
            continue
        info = opt.last_info
        if rank == 0:
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(eval_x), eval_y).item()
            # The time and step before the loss, which the harness reads first.
            shared.eval[1], shared.eval[2] = time.monotonic(), opt.last_step
            shared.eval[0] = loss
        if info.included:
            shared.applied[rank] += args.batch
    opt.close(keep_session=True)


def sync_every_list(text):
    """--sync-every: one H for every worker, or WORLD of them separated by commas."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None
    if len(values) == 1:
        values *= WORLD
    if len(values) != WORLD or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or {WORLD} integers >= 1, got {text!r}")
    return values


def outer_option(text):
    """NAME=VALUE of --outer-option: true/false, an int or a float."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if value in ("true", "false"):
        return name, value == "true"
    try:
        return name, int(value)
    except ValueError:
        pass
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected true, false or a number, got {value!r}") from None


def diloco_worker(rank, mode, args, endpoint, shared):
    """One DiLoCo worker (see the module's docstring, DiLoCo modes)."""
    sys.path[:0] = [str(REPO / "python"), str(REPO / "build" / "python")]
    import grpc
    import torch

    import muond  # noqa: E402 - after the path is set

    torch.set_num_threads(1)
    teacher, model, eval_x, eval_y = make_problem(args.non_iid)
    _, evaluator, _, _ = make_problem(args.non_iid)
    data = torch.Generator().manual_seed(1000 + rank)
    session = f"hetero-{mode.replace(':', '-')}"
    options = sync_options(args, mode)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)

    def open_worker(name, world_size):
        outer = {"lr": args.outer_lr}
        if options["sync_mode"] == "async" and args.nesterov_delay:
            outer["nesterov_delay"] = args.nesterov_delay
        outer.update(args.outer_option)
        return muond.DiLoCo(model, inner, sync_every=args.sync_every[rank], outer=outer,
                            endpoint=endpoint, session=name, world_size=world_size, rank=rank,
                            transport=args.transport, overlap_steps=args.overlap_steps,
                            merge_alpha=args.merge_alpha, **options)

    if rank != 0:
        shared.opened.wait()
    diloco = open_worker(session, WORLD)
    if rank == 0:
        shared.opened.set()
    shared.ready.wait()

    period = SPEEDS[rank] * args.period
    pending = 0.0  # samples computed since this worker's last sync
    sent = 0.0     # ... those of the sync in flight (overlap_steps)
    while not shared.stop.is_set():
        compute_gradients(model, inner, teacher, data, args.batch, period, input_shift(rank, args.non_iid))
        shared.computed[rank] += args.batch
        pending += args.batch
        try:
            diloco.step(tokens=args.batch)
        except muond.MuondError as err:
            if err.code != grpc.StatusCode.ABORTED or options["sync_mode"] != "lockstep":
                raise
            # Rank 3 is gone: restart at world size 3 from rank 0's global parameters.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(diloco.global_parameters()[name])
            diloco.close(keep_session=True)
            if rank == 0:
                shared.restarts.value += 1
                diloco = open_worker(session + "-world3", WORLD - 1)
                shared.reopened.set()
            else:
                shared.reopened.wait()
                diloco = open_worker(session + "-world3", WORLD - 1)
            pending = sent = 0.0
            continue
        if diloco.last_sync is not None:
            sent, pending = pending, 0.0
        if diloco.last_merged is None:  # the answer of a sync, merged this step
            continue
        info = diloco.last_info
        if info.included and info.applied:
            shared.applied[rank] += sent
        # HeLoCo's cases: every push of an asynchronous session; a shared step once (rank 0's answer).
        for group in info.groups.values() if options["sync_mode"] == "async" or rank == 0 else ():
            if group.heloco is not None:
                for case, count in enumerate(group.heloco):
                    shared.heloco[3 * rank + case] += count
        if rank == 0:
            with torch.no_grad():
                for name, p in evaluator.named_parameters():
                    p.copy_(diloco.global_parameters()[name])
                loss = torch.nn.functional.mse_loss(evaluator(eval_x), eval_y).item()
            shared.eval[1], shared.eval[2] = time.monotonic(), diloco.remote.last_step
            shared.eval[0] = loss
    diloco.close(keep_session=True)


def resend(opt, muond, grpc, tries=20):
    """Resends an asynchronous rank's last push until an answer comes back."""
    for attempt in range(tries):
        pushes = opt.pushes
        try:
            opt.step()
        except muond.MuondError as err:
            if err.code != grpc.StatusCode.ABORTED or attempt == tries - 1:
                raise
            continue
        if not opt.last_info.replayed or opt.pushes != pushes + 1:
            raise RuntimeError(f"resent push {pushes + 1} was not answered as a resend")
        return


# -- one mode -------------------------------------------------------------------------------------

def run_mode(mode, args):
    ctx = mp.get_context("spawn")
    shared = Shared(ctx)
    budget = args.budget_steps * WORLD * args.batch
    with cpu_daemon(args.binary, args.threads, ["--straggler-timeout", str(args.straggler_timeout)],
                    log_level="error") as (_, endpoint):
        procs = [ctx.Process(target=worker, args=(r, mode, args, endpoint, shared), daemon=True)
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        shared.ready.wait(timeout=120)
        start = time.monotonic()
        killed_at = target_at = None
        while True:
            time.sleep(0.005)
            now = time.monotonic()
            applied = sum(shared.applied)
            if killed_at is None and applied >= budget / 2:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[DYING_RANK].pid, signal.SIGKILL)
                killed_at = now - start
            if target_at is None and shared.eval[0] <= args.target:
                target_at = shared.eval[1] - start
            if applied >= budget:
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r != DYING_RANK]
            if dead:
                raise RuntimeError(f"{mode}: rank {dead[0]} exited (code {procs[dead[0]].exitcode})")
            if now - start > args.max_seconds:
                raise RuntimeError(f"{mode}: no end after {args.max_seconds} s "
                                   f"({applied:.0f} of {budget} samples applied)")
        elapsed = now - start
        result = {"mode": mode, "target_s": target_at, "end_s": elapsed, "killed_s": killed_at,
                  "loss": shared.eval[0], "steps": int(shared.eval[2]),
                  "computed": sum(shared.computed), "applied": applied,
                  "restarts": shared.restarts.value, "lost_answers": sum(shared.lost_answers),
                  "heloco": [sum(shared.heloco[3 * r + c] for r in range(WORLD)) for c in range(3)]}
        shared.stop.set()
        for p in procs:
            p.kill()
            p.join()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=REPO / "build" / "muond")
    parser.add_argument("--threads", type=int, default=0, help="the daemon's --threads (0: one per core)")
    parser.add_argument("--modes", default="lockstep,quorum,quorum:3,async,async:inverse")
    parser.add_argument("--period", type=float, default=0.1, help="a fast rank's step time, seconds")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget-steps", type=int, default=80)
    parser.add_argument("--target", type=float, default=0.15, help="target eval loss (MSE)")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon lr")
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--straggler-timeout", type=float, default=5.0)
    parser.add_argument("--quorum", type=int, default=2, help="min_ranks of the quorum mode")
    parser.add_argument("--grace", type=float, default=0.02, help="grace_seconds of the quorum mode")
    parser.add_argument("--max-staleness", type=int, default=16)
    parser.add_argument("--staleness-scaling", default="none", choices=("none", "inverse"))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode (medians printed)")
    parser.add_argument("--max-seconds", type=float, default=300)
    parser.add_argument("--sync-every", type=sync_every_list, default=[8] * WORLD,
                        help="DiLoCo modes: H, inner steps per sync; one for all workers, or one per "
                             "worker (\"8,8,3,8\")")
    parser.add_argument("--inner-lr", type=float, default=3e-3, help="DiLoCo modes: the inner AdamW's lr")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo modes: the outer SGD's lr")
    parser.add_argument("--overlap-steps", type=int, default=0,
                        help="DiLoCo modes: inner steps a sync runs beside before its merge")
    parser.add_argument("--merge-alpha", type=float, default=0.0,
                        help="DiLoCo modes: the share of the local values a merge keeps")
    parser.add_argument("--nesterov-delay", type=int, default=0,
                        help="async DiLoCo: delayed Nesterov's N (0: DiLoCo's default, the 4 workers)")
    parser.add_argument("--outer-option", type=outer_option, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="DiLoCo: one more option of the outer SGD group, e.g. heloco=true (repeatable)")
    parser.add_argument("--non-iid", type=float, default=0.0, metavar="S",
                        help="worker r's inputs drawn around S along input coordinate r, the evaluation "
                             "set from all four (0: every worker draws from the same distribution)")
    parser.add_argument("--transport", default="auto", help="the step transport (auto: shm on loopback)")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        sync_options(args, mode)

    budget = args.budget_steps * WORLD * args.batch
    print(f"4 ranks, step times {args.period:g} : {args.period:g} : {3 * args.period:g} : "
          f"{args.period:g} s (rank 3 SIGKILLed when {budget // 2} samples are applied); "
          f"batch {args.batch}; run ends at {budget} applied samples; target eval loss {args.target:g}; "
          f"daemon --straggler-timeout {args.straggler_timeout:g}; quorum {args.quorum} of 4, "
          f"grace {args.grace:g} s; async max_staleness {args.max_staleness}")
    modes = args.modes.split(",")
    runs = {mode: [] for mode in modes}
    for repeat in range(args.repeats):  # the modes in turn, so that a change of load hits them all
        for mode in modes:
            r = run_mode(mode, args)
            r["goodput"] = r["applied"] / r["end_s"]
            runs[mode].append(r)
            print(f"  run {repeat + 1} {mode:<14} to target {fmt(r['target_s'], '.1f', 5)} s, end "
                  f"{r['end_s']:.1f} s, end loss {r['loss']:.4f}, {r['goodput']:.0f} applied samples/s"
                  + (f", rank 3 killed at {r['killed_s']:.1f} s, {r['restarts']} restart at world "
                     f"size 3" if r["restarts"] else "")
                  + (f", {r['lost_answers']} answers lost and the push resent" if r["lost_answers"] else "")
                  + (", HeLoCo kept/reoriented/shrunk {}/{}/{} parameter pushes".format(*r["heloco"])
                     if any(r["heloco"]) else ""),
                  flush=True)

    def median(mode, key):
        """The median over the runs; None when any run has none (never reached the target)."""
        values = [r[key] for r in runs[mode]]
        return None if any(v is None for v in values) else statistics.median(values)

    def base_of(mode):
        base = "diloco:lockstep" if mode.startswith("diloco") else "lockstep"
        return base if base in runs else None
    print(f"median of {args.repeats} run(s) ('-': a run never reached the target); 'vs lock': time to "
          f"target lock-step / mode, end loss mode / lock-step, goodput mode / lock-step (DiLoCo "
          f"modes against DiLoCo lock-step)")
    print(f"{'mode':<14} {'to target s':>11} {'vs lock':>7} {'end s':>6} {'end loss':>8} {'vs lock':>7} "
          f"{'steps':>6} {'computed/s':>10} {'applied/s':>9} {'used':>5} {'vs lock':>7}")
    for mode in modes:
        target_s, goodput, loss = median(mode, "target_s"), median(mode, "goodput"), median(mode, "loss")
        computed = statistics.median(r["computed"] / r["end_s"] for r in runs[mode])
        used = statistics.median(r["applied"] / r["computed"] for r in runs[mode])
        speedup = loss_ratio = goodput_ratio = None
        base = base_of(mode)
        if base:
            base_target = median(base, "target_s")
            speedup = base_target / target_s if base_target and target_s else None
            loss_ratio = loss / median(base, "loss")
            goodput_ratio = goodput / median(base, "goodput")
        print(f"{mode:<14} {fmt(target_s, '.1f', 11)} {ratio(speedup)} "
              f"{median(mode, 'end_s'):>6.1f} {loss:>8.4f} {fmt(loss_ratio, '.3f', 7)} "
              f"{median(mode, 'steps'):>6.0f} {computed:>10.0f} {goodput:>9.0f} {used:>5.0%} "
              f"{ratio(goodput_ratio)}")


def fmt(value, spec, width):
    return f"{'-' if value is None else format(value, spec):>{width}}"


def ratio(value):
    return f"{'-' if value is None else format(value, '.2f') + 'x':>7}"


if __name__ == "__main__":
    main()
