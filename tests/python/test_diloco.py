"""muond.DiLoCo against the real daemon: K workers (processes, or threads each with its own rank)
train locally with AdamW and sync through one session, and must equal, bit for bit, a pure-torch
DiLoCo written here: every worker's inner AdamW on its own data, every H inner steps the average of
the pseudo-gradients weighted by tokens (Σ w·Δ / Σ w summed in rank order in fp64, rounded once to
fp32, as the daemon averages) and the outer step on the global parameters. Also: outer Muon equals
muond's own Muon fed the averaged pseudo-gradients, the Streaming DiLoCo schedule of fragments=2,
resuming from a state dict across a daemon restart, and the example. Failures and refusals:
test_diloco_failures.py."""

import concurrent.futures
import io
import os
import subprocess
import sys

import pytest
import torch

import muond
from muond import quantize
from muond.diloco import muon_outer_groups, split_fragments

from conftest import REPO_ROOT
from diloco_helpers import INNER, SEED, SIZES, TWO_FRAGMENTS, end_session, inner_step, session_name
from helpers import TinyNet, assert_bitwise
from processes import run_rank_processes


# -- the pure-torch reference ----------------------------------------------------------------------

class NesterovSGD:
    """The outer step of DiLoCo: torch.optim.SGD(lr, momentum, nesterov=True) with dampening 0 and
    no weight decay, each product rounded to fp32 before the sum it enters (docs/algorithms.md, SGD;
    kernels/elementwise.h SgdElement). torch.optim.SGD's own CPU kernels evaluate
    ``add(x, alpha=μ)`` as one fused multiply-add where the CPU has FMA (AVX2 here), so it rounds
    once where this formula rounds twice, and so differs from itself on a CPU without FMA; the
    formula is what is pinned, written out op by op. The buffer starts as the first gradient."""

    def __init__(self, lr=0.7, momentum=0.9):
        self.lr, self.momentum, self.buffers = lr, momentum, {}

    def __call__(self, globals_, averages) -> None:
        for name, g in averages.items():
            b = self.buffers.get(name)
            b = g.clone() if b is None else b * self.momentum + g
            self.buffers[name] = b
            d = g + b * self.momentum
            globals_[name].copy_(globals_[name] - d * self.lr)


class MuondOuter:
    """The outer step as a plain muond session (world size 1) over its own copy of the initial
    global parameters, fed the averaged pseudo-gradients as their gradients."""

    def __init__(self, endpoint, groups_of):
        twin = TinyNet(seed=SEED)
        self.params = dict(twin.named_parameters())
        self.opt = muond.RemoteOptimizer(groups_of(twin), endpoint=endpoint)

    def __call__(self, globals_, averages) -> None:
        for name, p in self.params.items():
            p.grad = averages.get(name)  # None: left out of the step
        self.opt.step()
        for name in averages:
            globals_[name].copy_(self.params[name].detach())


def reference_diloco(workers: int, steps: int, sync_every: int, fragments, outer,
                     wire_dtype: str = "fp32", overlap: int = 0, alpha: float = 0.0):
    """Pure-torch DiLoCo: returns (each worker's local parameters, the global parameters). With a
    quantized ``wire_dtype`` each worker sends Δ + e, the daemon takes it as ``quantize`` rounds
    it, and e becomes what was rounded away (error feedback). With ``overlap`` τ a sync's outer
    step is merged into the workers' local parameters τ inner steps later, as
    ``torch.lerp(local, global, 1 − alpha)`` (Streaming DiLoCo's overlap and merge)."""
    feedback = [{} for _ in range(workers)]
    init = TinyNet(seed=SEED)
    global_params = {n: p.detach().clone() for n, p in init.named_parameters()}
    models = [TinyNet(seed=SEED) for _ in range(workers)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in models]
    locals_ = [dict(m.named_parameters()) for m in models]
    since = [[0.0] * len(fragments) for _ in range(workers)]
    interval, syncs, pending = sync_every // len(fragments), 0, None  # pending: (fragment, t)

    def merge(f):
        with torch.no_grad():
            for r in range(workers):
                for name in fragments[f]:
                    local = locals_[r][name]
                    merged = global_params[name] if alpha == 0 else torch.lerp(
                        local.detach(), global_params[name], 1.0 - alpha)
                    local.copy_(merged)

    for t in range(1, steps + 1):
        for r in range(workers):
            inner_step(models[r], inners[r], r, t)
            inners[r].step()
            since[r] = [s + SIZES[r] for s in since[r]]
        if pending is not None and t == pending[1]:
            merge(pending[0])
            pending = None
        if t % interval:
            continue
        f = syncs % len(fragments)
        syncs += 1
        total = sum(since[r][f] for r in range(workers))
        averages = {}
        for name in fragments[f]:
            acc = torch.zeros_like(global_params[name], dtype=torch.float64)
            for r in range(workers):  # rank order, fp64, each weight times the fp32 Δ
                delta = global_params[name] - locals_[r][name].detach()
                if quantize.is_quantized(wire_dtype):
                    delta = delta + feedback[r].get(name, torch.zeros_like(delta))
                    sent = quantize.round_trip(delta, wire_dtype).view_as(delta)
                    feedback[r][name] = delta - sent
                    delta = sent
                acc += since[r][f] * delta.double()
            averages[name] = (acc / total).float()
        outer(global_params, averages)
        for r in range(workers):
            since[r][f] = 0.0
        if overlap:
            pending = (f, t + overlap)
        else:
            merge(f)
    return [{n: p.detach().clone() for n, p in loc.items()} for loc in locals_], global_params


def reference_diloco_per_worker(sync_every, syncs: int, outer):
    """Pure-torch DiLoCo whose worker r takes ``sync_every[r]`` inner steps between syncs (one
    fragment): each outer step averages the workers' Δ weighted by their tokens since the last
    sync, H_r · SIZES[r]. Returns (each worker's local parameters, the global parameters)."""
    workers = len(sync_every)
    init = TinyNet(seed=SEED)
    global_params = {n: p.detach().clone() for n, p in init.named_parameters()}
    models = [TinyNet(seed=SEED) for _ in range(workers)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in models]
    locals_ = [dict(m.named_parameters()) for m in models]
    t = [0] * workers
    for _ in range(syncs):
        for r in range(workers):
            for _ in range(sync_every[r]):
                t[r] += 1
                inner_step(models[r], inners[r], r, t[r])
                inners[r].step()
        weights = [float(sync_every[r] * SIZES[r]) for r in range(workers)]
        averages = {}
        for name, g in global_params.items():
            acc = torch.zeros_like(g, dtype=torch.float64)
            for r in range(workers):
                acc += weights[r] * (g - locals_[r][name].detach()).double()
            averages[name] = (acc / sum(weights)).float()
        outer(global_params, averages)
        with torch.no_grad():
            for r in range(workers):
                for name, g in global_params.items():
                    locals_[r][name].copy_(g)
    return [{n: p.detach().clone() for n, p in loc.items()} for loc in locals_], global_params


# -- DiLoCo workers --------------------------------------------------------------------------------

def _process_worker(rank, world, endpoint, session, out, sync_every, fragments, steps):
    torch.set_num_threads(1)
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = muond.DiLoCo(model, inner, sync_every=sync_every, endpoint=endpoint, session=session,
                          world_size=world, rank=rank, fragments=fragments)
    weights = []
    for t in range(1, steps + 1):
        inner_step(model, inner, rank, t)
        diloco.step(tokens=SIZES[rank])
        if diloco.last_sync is not None:
            weights.append(diloco.last_info.total_weight)
    torch.save({"local": {n: p.detach().clone() for n, p in model.named_parameters()},
                "global": {n: g.clone() for n, g in diloco.global_parameters().items()},
                "outer_steps": diloco.remote.last_step, "total_weights": weights}, f"{out}.{rank}")
    diloco.close(keep_session=True)  # the test ends the session once every worker is done


def run_threads(endpoint, workers, steps, sync_every, fragments=1, outer=None, record=None,
                **kwargs):
    """``workers`` DiLoCo workers in threads of this process, each its own rank of one session;
    rank 0 opens the session first. ``steps`` and ``sync_every`` are one number for every worker
    or a list of each worker's. ``record(rank, t, diloco)`` runs after every step."""
    session = session_name()
    steps = list(steps) if isinstance(steps, (list, tuple)) else [steps] * workers
    every = list(sync_every) if isinstance(sync_every, (list, tuple)) else [sync_every] * workers
    runs = []
    for r in range(workers):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        runs.append((model, muond.DiLoCo(model, inner, sync_every=every[r], endpoint=endpoint,
                                         session=session, world_size=workers, rank=r,
                                         fragments=fragments,
                                         outer=outer(model) if callable(outer) else outer,
                                         **kwargs)))

    def train(r):
        model, diloco = runs[r]
        for t in range(1, steps[r] + 1):
            inner_step(model, diloco.inner, r, t)
            diloco.step(tokens=SIZES[r])
            if record is not None:
                record(r, t, diloco)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(train, r) for r in range(workers)]:
            future.result()
    result = [({n: p.detach().clone() for n, p in model.named_parameters()},
               {n: g.clone() for n, g in diloco.global_parameters().items()})
              for model, diloco in runs]
    for _, diloco in runs:
        diloco.close(keep_session=True)
    end_session(endpoint, session)
    return result


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_three_worker_processes_equal_pure_torch_diloco(endpoint, tmp_path):
    """K = 3 processes, H = 4, 16 inner steps: 4 outer steps of Nesterov SGD (0.7, 0.9) on the
    token-weighted average of the pseudo-gradients (weights 32, 64, 96 per sync)."""
    workers, steps, sync_every = 3, 16, 4
    session, out = session_name(), str(tmp_path / "worker")
    try:
        run_rank_processes(_process_worker, args=(workers, endpoint, session, out, sync_every, 1, steps),
                           nprocs=workers)
    finally:
        end_session(endpoint, session)
    torch.set_num_threads(1)
    locals_, global_params = reference_diloco(workers, steps, sync_every,
                                              [list(dict(TinyNet().named_parameters()))],
                                              NesterovSGD())
    for r in range(workers):
        saved = torch.load(f"{out}.{r}")
        assert saved["outer_steps"] == steps // sync_every
        assert saved["total_weights"] == [float(sync_every * sum(SIZES))] * 4
        assert_bitwise(saved["global"], global_params, f"worker {r}'s global parameters")
        assert_bitwise(saved["local"], locals_[r], f"worker {r}'s local parameters")
        assert_bitwise(saved["local"], global_params, f"worker {r} after the last sync")


def test_workers_with_their_own_sync_every_equal_the_token_weighted_reference(endpoint):
    # Mixed hardware: worker 1 is three times as fast as worker 0, so it takes 3× the inner steps
    # between syncs (each a batch of its own size); every sync is one lock-step outer step, and each
    # Δ weighs the tokens behind it.
    sync_every, syncs = [2, 6, 4], 3
    weights = []

    def record(rank, t, diloco):
        if rank == 0 and diloco.last_sync is not None:
            weights.append(diloco.last_info.total_weight)

    got = run_threads(endpoint, 3, [h * syncs for h in sync_every], sync_every, record=record)
    locals_, global_params = reference_diloco_per_worker(sync_every, syncs, NesterovSGD())
    assert weights == [float(sum(h * n for h, n in zip(sync_every, SIZES)))] * syncs
    for r, (local, glob) in enumerate(got):
        assert_bitwise(local, locals_[r], f"worker {r}'s local parameters")
        assert_bitwise(glob, global_params, f"worker {r}'s global parameters")


@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
def test_quantized_pseudo_gradients_with_error_feedback_equal_the_reference(endpoint, wire_dtype):
    workers, steps, sync_every = 3, 12, 3
    sizes = []
    # transport "grpc" whatever $MUOND_TRANSPORT says: quantized chunks travel over gRPC only.
    got = run_threads(endpoint, workers, steps, sync_every, wire_dtype=wire_dtype, transport="grpc",
                      record=lambda r, t, d: sizes.append(d.last_sync_bytes)
                      if r == 0 and d.last_sync is not None else None)
    names = [n for n, _ in TinyNet(seed=SEED).named_parameters()]
    locals_, global_params = reference_diloco(workers, steps, sync_every, [names],
                                              NesterovSGD(), wire_dtype=wire_dtype)
    for r, (local, glob) in enumerate(got):
        assert_bitwise(local, locals_[r], f"worker {r}'s local parameters")
        assert_bitwise(glob, global_params, f"worker {r}'s global parameters")
    numel = sum(p.numel() for p in TinyNet(seed=SEED).parameters())
    assert sizes and all(size < numel * 4 / (7 if wire_dtype == "int4" else 3.5) for size in sizes)


def test_error_feedback_is_part_of_the_state_dict(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, wire_dtype="int4",
                      transport="grpc") as diloco:
        for t in range(1, 3):
            inner_step(model, inner, 0, t)
            diloco.step()
        state = diloco.state_dict()
        assert state["diloco"]["wire_dtype"] == "int4"
        assert set(state["error_feedback"]) == set(diloco.names)
        assert any(e.abs().sum() > 0 for e in state["error_feedback"].values())
        diloco._feedback.clear()
        diloco.load_state_dict(state)
        for i, name in enumerate(diloco.names):
            assert torch.equal(diloco._feedback[i], state["error_feedback"][name])
        session = diloco.session_id
    # A worker of another wire dtype would send that error feedback at every sync, never
    # replacing it (only a quantized sync does): refused naming wire_dtype, nothing changed.
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, session=session) as other:
        with pytest.raises(ValueError, match="wire_dtype: the state dict has int4, this worker fp32"):
            other.load_state_dict(state)
        assert not other._feedback and other.inner_steps == 0  # pylint: disable=protected-access


def test_outer_muon_equals_muond_muon_on_the_averaged_pseudo_gradient(endpoint):
    """Outer Muon (the hidden matrices; Nesterov SGD for the rest) with two workers equals a plain
    muond session with the same groups stepping the token-weighted average."""
    muon = dict(lr=0.05, momentum=0.9, weight_decay=0.01)

    def groups_of(model):
        return muon_outer_groups(model, muon=muon)

    torch.set_num_threads(1)
    got = run_threads(endpoint, 2, 12, 4, outer=groups_of)
    reference = MuondOuter(endpoint, groups_of)
    try:
        locals_, global_params = reference_diloco(
            2, 12, 4, [list(dict(TinyNet().named_parameters()))], reference)
    finally:
        reference.opt.close()
    assert [g["optimizer"] for g in groups_of(TinyNet())] == ["muon", "sgd"]
    for r, (local, glob) in enumerate(got):
        assert_bitwise(glob, global_params, f"worker {r}'s global parameters")
        assert_bitwise(local, locals_[r], f"worker {r}'s local parameters")


def test_two_fragments_sync_in_turn_and_equal_streaming_reference(endpoint):
    """fragments=2, H = 4: a sync after every 2 inner steps, fragment 0 after steps 2, 6, 10, ...,
    fragment 1 after 4, 8, 12, ...; a fragment's global values change at its syncs only."""
    workers, steps, sync_every = 2, 12, 4
    seen = {}

    def record(rank, t, diloco):
        if rank == 0:
            glob = {n: g.clone() for n, g in diloco.global_parameters().items()}
            local = {n: p.detach().clone() for n, p in diloco.model.named_parameters()}
            seen[t] = (diloco.last_sync, glob, local)

    torch.set_num_threads(1)
    got = run_threads(endpoint, workers, steps, sync_every, fragments=2, record=record)
    assert [seen[t][0] for t in range(1, steps + 1)] == [
        None, 0, None, 1, None, 0, None, 1, None, 0, None, 1]
    initial = dict(TinyNet(seed=SEED).named_parameters())
    before = {n: p.detach() for n, p in initial.items()}
    for t in range(1, steps + 1):
        synced, glob, local = seen[t]
        for f, names in enumerate(TWO_FRAGMENTS):
            for name in names:
                changed = not torch.equal(glob[name], before[name])
                assert changed == (synced == f), (t, name, synced)
                if synced == f:
                    assert torch.equal(local[name], glob[name]), (t, name)
        before = glob
    locals_, global_params = reference_diloco(workers, steps, sync_every, TWO_FRAGMENTS,
                                              NesterovSGD())
    for r, (local, glob) in enumerate(got):
        assert_bitwise(glob, global_params, f"worker {r}'s global parameters")
        assert_bitwise(local, locals_[r], f"worker {r}'s local parameters")


@pytest.mark.parametrize("fragments,overlap,alpha,steps,wire_dtype,save_in_flight", [
    (2, 1, 0.5, 13, "fp32", False), (1, 3, 0.0, 15, "fp32", False), (2, 1, 0.25, 13, "int8", True)])
def test_overlapped_syncs_merge_late_and_equal_the_reference(endpoint, fragments, overlap, alpha,
                                                             steps, wire_dtype, save_in_flight):
    """overlap_steps τ: each sync runs beside the next τ inner steps, whose progress on the
    fragment the merge then keeps α of. Three workers, H = 4; the last sync (after step 12) is
    merged after step 12 + τ. Between its sending and its merge the fragment's local parameters
    are the worker's own; at the merge they become lerp(local, global, 1 − α). With int8 (error
    feedback), rank 0 also saves a state dict while each of its syncs is in flight, before the
    other workers may have sent theirs, and trains on: nothing is taken in twice."""
    workers, sync_every = 3, 4
    seen = {}

    merged_bytes = []

    def record(rank, t, diloco):
        if rank == 0:
            seen[t] = (diloco.last_sync, diloco.sync_in_flight, diloco.last_merged)
            if save_in_flight and diloco.sync_in_flight is not None:
                assert diloco.state_dict()["diloco"]["pending_merge"]["lands_at"] == t + overlap
            if diloco.last_merged is not None:
                merged_bytes.append(diloco.last_sync_bytes)
            if t == steps:  # each sync's bytes counted once, saved in flight or not
                assert diloco.sync_bytes == sum(merged_bytes) > 0

    torch.set_num_threads(1)
    transport = {"transport": "grpc"} if wire_dtype != "fp32" else {}  # quantized: gRPC only
    got = run_threads(endpoint, workers, steps, sync_every, fragments=fragments, record=record,
                      overlap_steps=overlap, merge_alpha=alpha, wire_dtype=wire_dtype, **transport)
    interval = sync_every // fragments
    for t in range(1, steps + 1):
        sent, in_flight, merged = seen[t]
        assert (sent is not None) == (t % interval == 0), t
        assert (in_flight is not None) == (t >= interval and t % interval < overlap), t
        assert (merged is not None) == (t > interval and t % interval == overlap), t
    split = TWO_FRAGMENTS if fragments == 2 else [TWO_FRAGMENTS[0] + TWO_FRAGMENTS[1]]
    locals_, global_params = reference_diloco(workers, steps, sync_every, split, NesterovSGD(),
                                              wire_dtype=wire_dtype, overlap=overlap, alpha=alpha)
    no_overlap, _ = reference_diloco(workers, steps, sync_every, split, NesterovSGD(),
                                     wire_dtype=wire_dtype)
    assert any(not torch.equal(locals_[0][n], no_overlap[0][n]) for n in locals_[0])
    for r, (local, glob) in enumerate(got):
        assert_bitwise(glob, global_params, f"worker {r}'s global parameters")
        assert_bitwise(local, locals_[r], f"worker {r}'s local parameters")


def test_a_state_dict_saved_with_a_sync_in_flight_resumes_exactly(start_daemon, tmp_path):
    """Saved after inner step 6 with overlap_steps 1 (fragment 0's sync sent after step 6, merged
    after step 7, α = 0.5): the save waits for the answer and keeps the merge to come; a fresh
    worker on a restarted daemon loads it and ends where an uninterrupted run does, bit for bit."""
    torch.set_num_threads(1)
    state_dir, workdir = tmp_path / "state", tmp_path / "daemon"
    daemon = start_daemon("--state-dir", state_dir, workdir=workdir)
    options = dict(overlap_steps=1, merge_alpha=0.5)
    whole = _resumable_run(daemon.endpoint, session_name(), 13, **options)
    session = session_name()
    state = _resumable_run(daemon.endpoint, session, 13, stop_at=6, **options)
    assert state["diloco"]["pending_merge"] == {"fragment": 0, "step": 3, "lands_at": 7,
                                                "whole": False, "realign": False}
    assert state["diloco"]["outer_step"] == 3
    daemon.stop()
    daemon = start_daemon("--state-dir", state_dir, workdir=workdir)
    resumed = _resumable_run(daemon.endpoint, session, 13, model_seed=SEED + 1, state=state,
                             **options)
    assert resumed[2:] == whole[2:] == (13, 13.0 * SIZES[0], 6)
    assert_bitwise(resumed[0], whole[0], "local parameters")
    assert_bitwise(resumed[1], whole[1], "global parameters")
    model = TinyNet(seed=SEED)
    with muond.DiLoCo(model, torch.optim.AdamW(model.parameters(), **INNER), sync_every=4,
                      fragments=2, endpoint=daemon.endpoint, session=session) as other:
        with pytest.raises(ValueError, match="overlap_steps: the state dict has 1, this worker 0"):
            other.load_state_dict(state)


def test_finish_sync_merges_a_sync_in_flight_at_once(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with muond.DiLoCo(model, inner, sync_every=4, endpoint=endpoint, overlap_steps=3,
                      merge_alpha=0.5) as diloco:
        assert diloco.finish_sync() is None
        for t in range(1, 5):
            inner_step(model, inner, 0, t)
            diloco.step()
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert diloco.finish_sync() == 0 and diloco.sync_in_flight is None
        for name, p in model.named_parameters():
            expected = torch.lerp(local[name], diloco.global_parameters()[name], 0.5)
            assert torch.equal(p.detach(), expected), name
        for t in range(5, 8):  # nothing left to merge after the next three steps
            inner_step(model, inner, 0, t)
            diloco.step()
            assert diloco.last_merged is None


def test_fragments_follow_the_documented_split(endpoint):
    sizes = [p.numel() for p in TinyNet().parameters()]
    assert split_fragments(sizes, 1) == [0] * 8
    assert split_fragments(sizes, 2) == [0, 0, 0, 0, 0, 1, 1, 1]
    assert split_fragments(sizes, 8) == list(range(8))
    assert split_fragments([1000, 1, 1, 1], 3) == [0, 1, 2, 2]  # at least one parameter each
    model = TinyNet(seed=SEED)
    with muond.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=4, fragments=2,
                      endpoint=endpoint) as diloco:
        assert diloco.fragment_names == TWO_FRAGMENTS
        assert diloco.interval == 2
        assert [diloco.fragment_due(t) for t in range(1, 5)] == [None, 0, None, 0]  # at step 0


def _resumable_run(endpoint, session, steps, model_seed=SEED, state=None, stop_at=None,
                   **options):
    """One worker (fragments=2, H = 4, ``options`` for DiLoCo): from ``state`` when given, until
    ``stop_at`` (returning its state dict, the session kept) or the end (returning the
    parameters)."""
    model = TinyNet(seed=model_seed)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = muond.DiLoCo(model, inner, sync_every=4, fragments=2, endpoint=endpoint,
                          session=session, **options)
    if state is not None:
        diloco.load_state_dict(state)
    for t in range(diloco.inner_steps + 1, steps + 1):
        inner_step(model, inner, 0, t)
        diloco.step(tokens=SIZES[0])
        if t == stop_at:
            saved = io.BytesIO()
            torch.save(diloco.state_dict(), saved)
            diloco.remote.checkpoint()
            diloco.close(keep_session=True)
            saved.seek(0)
            return torch.load(saved)
    result = ({n: p.detach().clone() for n, p in model.named_parameters()},
              {n: g.clone() for n, g in diloco.global_parameters().items()},
              diloco.inner_steps, diloco.tokens, diloco.remote.last_step)
    diloco.close()
    return result


def test_state_dict_resumes_across_a_daemon_restart(start_daemon, tmp_path):
    """Saved mid-interval (after inner step 5: fragment 0 counts 3 steps' tokens, fragment 1 one),
    the daemon restarted from its --state-dir, a fresh worker attaches and loads the state: the
    run ends where an uninterrupted one does, bit for bit."""
    torch.set_num_threads(1)
    state_dir = tmp_path / "state"
    workdir = tmp_path / "daemon"
    daemon = start_daemon("--state-dir", state_dir, workdir=workdir)
    whole = _resumable_run(daemon.endpoint, session_name(), 14)
    session = session_name()
    state = _resumable_run(daemon.endpoint, session, 14, stop_at=5)
    assert state["diloco"]["tokens_since_sync"] == [3.0 * SIZES[0], 1.0 * SIZES[0]]
    assert state["diloco"]["outer_step"] == 2
    daemon.stop()
    daemon = start_daemon("--state-dir", state_dir, workdir=workdir)
    resumed = _resumable_run(daemon.endpoint, session, 14, model_seed=SEED + 1, state=state)
    assert resumed[2:] == whole[2:] == (14, 14.0 * SIZES[0], 7)
    assert_bitwise(resumed[0], whole[0], "local parameters")
    assert_bitwise(resumed[1], whole[1], "global parameters")


@pytest.mark.parametrize("overlap", [0, 1])
def test_quorum_worker_left_out_takes_the_session_parameters(endpoint, overlap):
    """Quorum of 1 without grace: rank 0's sync is taken alone; rank 1, late, is answered with
    the parameters after that step (included False), takes them whole and starts counting anew —
    at once, or with overlap_steps 1 at the merge one inner step later, whose progress it drops."""
    session, runs = session_name(), []
    for r in range(2):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        runs.append((model, muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint,
                                         session=session, world_size=2, rank=r,
                                         sync_mode="quorum", min_ranks=1, grace_seconds=0,
                                         overlap_steps=overlap)))
    try:
        for r, (model, diloco) in enumerate(runs):
            for t in range(1, 3 + overlap):
                inner_step(model, diloco.inner, r, t)
                diloco.step(tokens=SIZES[r])
            assert diloco.last_merged == 0 and diloco.sync_in_flight is None
        first, late = runs[0][1].last_info, runs[1][1].last_info
        assert (first.step, first.contributors, first.total_weight, first.included) == (
            1, (0,), 2.0 * SIZES[0], True)
        assert (late.step, late.contributors, late.included) == (1, (0,), False)
        assert_bitwise({n: p.detach() for n, p in runs[1][0].named_parameters()},
                       runs[0][1].global_parameters(), "the late worker's parameters")
        assert runs[1][1]._since_sync == [0.0]
    finally:
        for _, diloco in runs:
            diloco.close(keep_session=True)
        end_session(endpoint, session)


def test_outer_options_default_to_diloco_nesterov(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters())
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint) as diloco:
        (group,) = diloco.remote.param_groups
        assert (group["optimizer"], group["lr"], group["momentum"], group["nesterov"]) == (
            "sgd", 0.7, 0.9, True)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, outer={"lr": 0.5}) as diloco:
        (group,) = diloco.remote.param_groups
        assert (group["optimizer"], group["lr"], group["momentum"]) == ("sgd", 0.5, 0.9)
    groups = muond.default_param_groups(model)  # Muon + AdamW, as the outer optimizer
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, outer=groups) as diloco:
        assert [g["optimizer"] for g in diloco.remote.param_groups] == ["muon", "adamw"]
        assert diloco.remote.param_groups[0]["param_names"] == ["up.weight", "down.weight"]


@pytest.mark.slow
def test_example_trains_two_workers(endpoint):
    """examples/train_diloco.py: two worker processes on one session, two fragments whose syncs
    overlap two inner steps and merge half the local values; the loss comes down."""
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "train_diloco.py"), "--endpoint", endpoint,
           "--workers", "2", "--steps", "60", "--sync-every", "10", "--fragments", "2",
           "--overlap-steps", "2", "--merge-alpha", "0.5"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = float(proc.stdout.split("initial loss on all data: ")[1].split()[0])
    final = float(proc.stdout.split("final loss on all data: ")[1].split()[0])
    assert "2 workers" in proc.stdout
    assert "step    7  sync 1 (fragment 0)" in proc.stdout, proc.stdout  # sent after 5, merged after 7
    assert final < 0.5 * first, proc.stdout
