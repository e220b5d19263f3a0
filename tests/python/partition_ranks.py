"""What the tests of ranks that hold parts share (test_partition.py, test_partition_shards.py): the
model (its shapes, groups and partitions per rank, its gradients), the rank processes that train it
through real daemons (``run_ranks``), the one-rank reference and the check that every part equals
the reference's, and a small spec of one partitioned group.
"""

import io
import threading
import traceback
import uuid

import muond
from muond import partition as part
from muond._stubs import pb

from checkpoint_helpers import hand_back_as_set_optimizer_state_dict, keep_as_get_optimizer_state_dict
from fake_dtensor import FakeDTensor
from processes import rank_context

import torch

WORLD = 3
WAIT = 300  # seconds: a bound on waiting for an event, never an expected duration
STEPS = 3

# The model: name → (global shape, group). "qkv" is a fused QKV weight (q, k, v = 4, 2, 2 rows per
# query group, 2 groups); "experts" three 6×5 matrices; "tiny" has fewer rows (2) than ranks.
SHAPES = {
    "w1": (7, 6), "tiny": (2, 6), "qkv": (16, 6), "experts": (3, 6, 5),
    "emb": (5, 4), "bias": (7,), "scale": (1,),
    "ex1": (4, 3), "ex2": (5,),
}
# Explicit ranges of the last group: rank → {position: (begin, end)}; rank 1 holds nothing of ex2.
EXPLICIT = [{0: (0, 5), 1: (3, 5)}, {0: (5, 12)}, {1: (0, 3)}]


# The second model: a QK-clip pair (2 heads of 4 rows) and a tensor-parallel weight in column blocks.
QK_SHAPES = {"q": (8, 6), "k": (8, 6), "tp": (6, 8)}
QK_OPTIONS = {"qk_clip": [("q", "k", 2)], "qk_clip_threshold": 1.0}
QK_LOGITS = {"q": [5.0, 0.5]}  # head 0 above the threshold: clipped every step


def groups_for(world, rank, kinds, model="main"):
    """The parameter groups of rank ``rank`` (its parts, or whole tensors for ``kinds`` None) and
    the whole initial values. ``kinds``: the partition kind of each group of ``model``."""
    gen = torch.Generator().manual_seed(7)
    shapes_of = SHAPES if model == "main" else QK_SHAPES
    whole = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes_of.items()}
    layout = [
        (["w1", "tiny", "experts"], {"optimizer": "muon"}),
        (["qkv"], {"optimizer": "muon", "qkv_split": (4, 2, 2), "num_query_groups": 2}),
        (["emb", "bias", "scale"], {"optimizer": "adamw"}),
        (["ex1", "ex2"], {"optimizer": "adamw", "lr": 3e-3}),
    ] if model == "main" else [
        (["q", "k"], {"optimizer": "muon"}),
        (["tp"], {"optimizer": "muon", "tp_blocks": 2, "tp_block_dim": 1}),
    ]
    groups = []
    for (names, options), kind in zip(layout, kinds or [None] * len(layout)):
        shapes = [shapes_of[n] for n in names]
        base = kind[len("hsdp_"):] if kind and kind.startswith("hsdp_") else kind  # HSDP: 2 replicas of it
        shards = world // 2 if base != kind else world
        if base is None:
            partition = None
        elif base in ("rows", "dtensor"):  # dtensor: FSDP2's parameters themselves
            partition = part.rows(shapes)
        elif base == "flat":
            partition = part.flat(shapes, alignment=4)
        elif base in ("zero2", "zero3"):
            partition = part.zero(shapes, shards, stage=int(base[-1]))
        else:
            partition = part.explicit(shapes, EXPLICIT)
        if base != kind:
            partition = part.replicated(partition, 2)
        params = []
        for k, n in enumerate(names):
            value = whole[n] if partition is None else part.cut(whole[n], partition, k, world, rank)
            if base == "dtensor":
                params.append((n, FakeDTensor.make(value.clone(), shapes_of[n], world, rank)))
            else:
                params.append((n, value.clone().requires_grad_()))
        group = {"params": params, **options}
        if partition is not None:
            group["partition"] = partition
        groups.append(group)
    return groups, whole


def whole_grads(step, model="main", replica=0):
    gen = torch.Generator().manual_seed(100 + step + 1000 * replica)
    return {n: torch.randn(s, generator=gen) for n, s in (SHAPES if model == "main" else QK_SHAPES).items()}


# HSDP: each replica's ranks reduce their own batch, another one per replica, with its weight; a
# part steps with the weighted mean of its replicas' parts, as one rank stepping that mean does.
HSDP_WEIGHTS = (1.0, 3.0)


def hsdp_mean(step, model="main"):
    """The replicas' gradients averaged as the daemon averages them: in fp64, in replica order,
    rounded once to fp32."""
    grads = [whole_grads(step, model, replica) for replica in range(len(HSDP_WEIGHTS))]
    total = sum(HSDP_WEIGHTS)
    return {n: (sum(w * g[n].double() for w, g in zip(HSDP_WEIGHTS, grads)) / total).float() for n in grads[0]}


def _run_rank(rank, world, endpoint, session, kinds, transport, options, steps, out, hold_after=None,
              keep=False, held=None, reload_at=None, model="main", together=None, device="cpu", hsdp=False,
              through_checkpoint=False):
    """A rank's process: steps the gradients of the session's next steps up to ``max(steps)``
    (a restarted rank continues after the session's last step), then answers its parameters and
    the session's digest. ``hold_after``: after that step, says so and waits to be killed.
    ``device``: where the rank's parameters and gradients live (a GPU transport's are on CUDA).
    ``hsdp``: the ranks are two replicas (the first and second half), each with its own gradients
    and weight; one rank steps their mean. ``through_checkpoint`` ("nested" or "flat", with
    flatten_optimizer_state_dict): the state dict reloaded at ``reload_at`` goes through what
    torch.distributed.checkpoint keeps of it (``through_a_distributed_checkpoint``)."""
    torch.set_num_threads(1)
    try:
        groups, _ = groups_for(world, rank, kinds, model)
        dtensors = {n: p for g in groups for n, p in g["params"] if isinstance(p, FakeDTensor)}
        for group in groups:
            group["params"] = [(n, p if n in dtensors else p.detach().to(device).requires_grad_())
                               for n, p in group["params"]]
        chosen = {"transport": transport} if transport else {}  # unset: $MUOND_TRANSPORT, as ctest runs both
        where = {"endpoints": endpoint} if isinstance(endpoint, list) else {"endpoint": endpoint}  # a list: sharded
        opt = muond.RemoteOptimizer(groups, **where, session=session, world_size=world,
                                    rank=rank, **chosen, **options)
        saved = None
        while opt.last_step < max(steps):
            step = opt.last_step + 1
            if hold_after is not None and step > hold_after:
                held.set()  # not through `out`: a process killed while it holds the queue's lock blocks it
                threading.Event().wait()
            replica = rank * 2 // world if hsdp and world > 1 else 0
            grads = hsdp_mean(step, model) if hsdp and world == 1 else whole_grads(step, model, replica)
            opt.zero_grad(set_to_none=True)
            assert all(d.grad is None for d in dtensors.values()), "zero_grad left a DTensor's gradient"
            if step == 2:
                for d in dtensors.values():  # as FSDP2 may: a new local tensor for the same values
                    d._local_tensor = d._local_tensor.clone()
            for group in opt.param_groups:
                partition = group.get("partition")
                for k, (name, p) in enumerate(zip(group["param_names"], group["params"])):
                    g = grads[name] if partition is None else part.cut(grads[name], partition, k, world, rank)
                    if name in dtensors:  # as FSDP2's reduce-scatter: on the DTensor, never the shard
                        assert p is dtensors[name], "param_groups hold another tensor than the DTensor"
                        p.grad = FakeDTensor.make(g, p.shape, world, rank)
                    else:
                        p.grad = g.view(p.shape).to(device)
            opt.step(qk_logits=QK_LOGITS if model == "qk" else None,
                     weight=HSDP_WEIGHTS[replica] if hsdp and world > 1 else None)
            if reload_at is not None and opt.last_step == reload_at:
                if through_checkpoint:  # "nested" or "flat"
                    saved = through_a_distributed_checkpoint(opt, dtensors, through_checkpoint == "flat")
                else:
                    saved = opt.state_dict()
            if reload_at is not None and opt.last_step == reload_at + 1 and saved is not None:
                # As a trainer loads a checkpoint: every rank has its answer first (a load replaces
                # the parameters an answer still being sent would read), then each loads its parts.
                together.wait(WAIT)
                opt.load_state_dict(saved() if callable(saved) else saved)  # back to step reload_at: redone
                assert opt.last_step == reload_at
                saved = None
        params = {n: p.detach().cpu().clone() for n, p in zip(opt._names, opt._params)}
        # A DTensor's own shard is what FSDP2 gathers for the next forward: the answers landed there.
        params.update({n: d.to_local().detach().clone() for n, d in dtensors.items()})
        if rank == 0:  # rank 0 ends the session when it closes: the others may be done before
            params["digest"] = torch.tensor(list(bytes.fromhex(opt.state_digest().digest)), dtype=torch.uint8)
        opt.close(keep_session=keep)
        buffer = io.BytesIO()
        torch.save(params, buffer)
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, "error", traceback.format_exc()))


def through_a_distributed_checkpoint(opt, dtensors, flatten):
    """``opt``'s state dict (read now) as torch.distributed.checkpoint's helpers save it and hand
    it back to this rank (checkpoint_helpers.py; a function of the load): the groups hold the
    DTensors themselves, their masters are DTensors of their global shape, and the rest is one
    rank's copy (the same on every rank here)."""
    names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    for name, d in dtensors.items():
        assert names.get(id(d)) == name, f"the optimizer's groups do not hold the DTensor '{name}'"
    kept = keep_as_get_optimizer_state_dict(opt, names, flatten)
    for name in dtensors:
        master = kept[f"state.{name}.master"] if flatten else kept["state"][name]["master"]
        assert isinstance(master, FakeDTensor) and master.shape == dtensors[name].shape, name
    return lambda: hand_back_as_set_optimizer_state_dict(opt, names, kept, flatten)


def run_ranks(endpoint, kinds, transport=None, world=WORLD, options=None, steps=range(1, STEPS + 1),
              session=None, keep=False, hold=None, reload_at=None, model="main", device="cpu", hsdp=False,
              through_checkpoint=False):
    """Every rank in a process of its own, stepping up to ``max(steps)``; their final local
    parameters (and "digest"). ``hold``: (rank, step) — that rank stops after the step and is
    SIGKILLed while the others wait in the next one, then a new process of it attaches and
    continues."""
    context = rank_context()
    out = context.Queue()
    session = session or f"part-{uuid.uuid4().hex[:8]}"

    held = context.Event()
    together = context.Barrier(world)

    def start(r, hold_after=None):
        process = context.Process(target=_run_rank, daemon=True,
                                  args=(r, world, endpoint, session, kinds, transport, options or {},
                                        list(steps), out, hold_after, keep, held, reload_at, model,
                                        together, device, hsdp, through_checkpoint))
        process.start()
        return process

    processes = {r: start(r, hold[1] if hold and hold[0] == r else None) for r in range(world)}
    results = {}
    try:
        if hold:
            assert held.wait(WAIT), f"rank {hold[0]} did not reach step {hold[1] + 1}"
            processes[hold[0]].kill()
            processes[hold[0]].join(WAIT)
            processes[hold[0]] = start(hold[0])
        while len(results) < world:
            rank, status, body = out.get(timeout=WAIT)
            assert status == "ok", f"rank {rank} failed:\n{body}"
            results[rank] = torch.load(io.BytesIO(body))
    finally:
        for p in processes.values():
            if len(results) < world:
                p.kill()  # the others wait for the failed rank's part: no point waiting for them
            p.join(WAIT)
    return results


def reference(endpoint, options=None, steps=range(1, STEPS + 1), model="main", hsdp=False):
    """A one-rank session with whole tensors stepping the whole gradients (``hsdp``: the
    replicas' weighted mean)."""
    results = run_ranks(endpoint, None, world=1, options=options, steps=steps, model=model, hsdp=hsdp)
    return results[0]


def expect_parts(results, want, kinds, world=WORLD, model="main"):
    assert bytes(results[0]["digest"].tolist()) == bytes(want["digest"].tolist()), \
        "the state digest differs from the whole session's"
    for rank, got in results.items():
        rank_groups, _ = groups_for(world, rank, kinds, model)
        for group in rank_groups:
            partition = group.get("partition")
            for k, (name, _) in enumerate(group["params"]):  # noqa: B007
                expected = want[name] if partition is None else part.cut(want[name], partition, k, world, rank)
                assert got[name].shape == expected.shape, (rank, name)
                assert torch.equal(got[name], expected), f"rank {rank}: '{name}' differs from the whole session's"


def one_group_spec(world, partition):
    """A spec of world_size ``world`` whose one AdamW group "g" (a 4×3, b 5) is cut by ``partition``."""
    spec = pb.SessionSpec(world_size=world)
    group = spec.groups.add(name="g", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    group.partition.CopyFrom(partition)
    spec.parameters.add(name="a", shape=[4, 3], group="g")
    spec.parameters.add(name="b", shape=[5], group="g")
    return spec
