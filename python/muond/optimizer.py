"""``RemoteOptimizer``: a ``torch.optim.Optimizer`` whose step runs on a muond daemon.

The daemon keeps the fp32 master parameters and the optimizer state (Muon momentum, Adam moments);
this object keeps only the session id and the step counter. ``step()`` streams every parameter's
``.grad`` to the daemon in the wire dtype, receives the updated parameters (fp32 by default, so the
local tensors equal the masters) and copies them into the parameter tensors in place, on whatever
device they live. Each step sends every group's current ``lr`` (and momentum or weight decay when
they were changed), so ``torch.optim.lr_scheduler`` works unchanged.

Sessions: construction creates the session, or attaches to an existing one with an identical spec
and resumes after its last applied step, refreshing the local tensors from the daemon's masters.
A session outlives this object unless ``close()`` ends it. ``checkpoint()`` asks a daemon run with
``--state-dir`` to write the session to disk now; after a daemon restart, constructing a
``RemoteOptimizer`` with the same session id (and token) attaches to the restored session.

Connection: where the daemons are, security (``auth_token`` is sent as ``authorization: Bearer
<token>`` with every call; ``tls_ca_file`` or ``use_tls`` makes the channel TLS, and
``tls_client_cert_file`` with ``tls_client_key_file`` mutual TLS), retries and the step transport
are one ``muond.ConnectionOptions`` (``connection=``), or its fields given one by one as keywords.

Shards: with ``endpoints=[...]`` the session spreads over several daemons, each holding whole
parameters (``muond.placement``); a step is prepared on every daemon (gradients in, sums of
squares out), then committed on every daemon with one decision — the global gradient norm for
clipping, or a skip when any shard saw a non-finite gradient — so the update is the one a single
daemon would apply, bit for bit (docs/sharding.md). Groups partitioned over the ranks work there
too: each rank sends each daemon its parts of the parameters placed on it.

Retries: a step that failed with UNAVAILABLE or DEADLINE_EXCEEDED is resent with the same step
number (the daemon applies each step once and answers a repeat with the same parameters), and the
calls that are safe to repeat are retried on UNAVAILABLE; ``max_step_attempts`` tries in all.

Asynchronous sessions (``sync_mode="async"``): each ``step()`` is this rank's next push, numbered
by the rank (``pushes``) and sent with the global step of the parameters the model holds
(``last_step``) as its base; the daemon applies it on arrival as the next global step and answers
the parameters after it. A push more than ``max_staleness`` global steps behind is dropped, and the
model takes the session's latest parameters instead (``last_info.stale``); docs/ranks.md.

Thread-safety: like every torch optimizer, one instance is used from one thread at a time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import grpc
import torch

from . import loss_scale
from . import options as opts
from . import partition as parts
from . import qk_clip as qk
from . import quantize
from . import ranks as ranks_of
from . import resume
from . import session_spec
from . import shard_step
from . import wire
from ._stubs import pb
from .chunk_fitting import ChunkFitting
from .client import Connection
from .connection_options import ConnectionOptions
from .delayed import DelayedUpdate
from .dtensor_params import DTensorParams
from .errors import MuondError
from .held_slots import held_entry
from .landing import ForwardLanding
from .naming import named_groups
from .optimizer_options import (RankOptions, Setup, StepOptions, TimingOptions, WireOptions,
                                setup_of)
from .overlap import GradientStream
from .param_watch import ParamWatch
from .state_digest import StateDigest
from .state_transfer import STATE_FORMAT, StateTransfer
from .stream_controls import StreamControls
from .state_digest import combine as combine_digests
from .step_info import StepInfo
from .shard_step import CutOffStep
from .step_tries import StepTries
from .transport.daemon_session import DaemonSession, StreamedStep
from .transport.streamed import IdentityChanged, Landing
from .transport.zero_copy import check_zero_copy

_log = logging.getLogger("muond")


class RemoteOptimizer(StepTries, StateTransfer, StreamControls, ChunkFitting, torch.optim.Optimizer):
    """A torch optimizer backed by a muond session.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``), or param
            group dicts. A group picks its optimizer with
            ``optimizer="muon"|"adamw"|"lion"|"sgd"|"dion2"`` or ``use_muon=True|False``
            (MuonWithAuxAdam style) and may set any option of the
            option table (docs/algorithms.md, Group options: ``lr``, ``momentum``, ``betas``, ...).
            ``muond.default_param_groups(model)`` builds the usual Muon + AdamW split.
        endpoint: the daemon's "host:port"; default ``$MUOND_ENDPOINT`` or 127.0.0.1:50051 (a
            shorthand for ``connection=ConnectionOptions(endpoint=...)``).
        session: session id to create or attach to; None makes a fresh random one.
        wire_dtype: a shorthand for ``wire=WireOptions(wire_dtype=...)``.

    The infrastructure comes in five option objects (``muond.optimizer_options``); each of their
    fields may instead be given as a keyword of its own, a shorthand for the object with that field
    set (giving one both ways is a TypeError naming it):

        connection: a ``muond.ConnectionOptions``: the daemons (``endpoints`` to spread the
            session over several), deadlines, token and TLS, retries (``max_step_attempts``),
            the step ``transport`` ("auto", "grpc", "shm", "cuda_ipc", "nccl") and the chunk
            size.
        ranks: a ``muond.RankOptions``: ``world_size``, ``rank``, ``sync_mode``, ``min_ranks``,
            ``grace_seconds``, ``max_staleness``, ``staleness_scaling``, ``labels`` (below).
        timing: a ``muond.TimingOptions``: ``overlap``, ``land_in_forward``, ``delay``,
            ``delay_warmup`` (below).
        wire: a ``muond.WireOptions``: ``wire_dtype``, ``return_dtype``, ``shm_zero_copy`` (below).
        step: a ``muond.StepOptions``: ``max_grad_norm``, ``log_num_zeros_in_grad``,
            ``loss_scaler``, ``qk_clip``, ``parameters_changed`` (below).

    Their fields:

        wire_dtype: dtype of gradients on the wire: "fp32" (default) or "bf16" (or "fp16"), or
            block-quantized "int8"/"int4" (gRPC only; what rounds away is lost unless the caller
            feeds it back, as ``muond.DiLoCo`` does).
        return_dtype: dtype of the returned parameters: "fp32" (default) or "bf16"/"fp16".
        max_grad_norm: clip the global gradient norm on the daemon before each step (a group's
            own limit is the group option of that name, with ``clip_scope="group"``).
        log_num_zeros_in_grad: count the gradient elements that are exactly 0 each step
            (Megatron-Core's option of that name); ``last_info.num_zeros_in_grad`` has the count.
        parameters_changed: a step after parameters were changed in place since the optimizer
            last wrote them (the daemon's answer overwrites such a change): ``"raise"`` (default,
            ValueError before anything is sent; ``upload_parameters()`` takes the change),
            ``"warn"`` (once) or ``"ignore"`` (a model that changes its weights itself, as
            ``nn.Embedding(max_norm=)`` does in forward).
        loss_scaler: a daemon-side dynamic loss scaler for fp16 training (``muond.loss_scale``):
            True for Megatron-Core's defaults or a dict of its options. Multiply each loss by
            ``loss_scale`` (``scale_loss(loss)``); the daemon divides the gradients by it.
        world_size, rank: data-parallel training with one optimizer per rank: every rank sends
            its own gradients for the same step and the daemon applies their average (in rank
            order) once and answers every rank with the same parameters — it replaces DDP's
            all-reduce of the gradients. Default: from an initialized ``torch.distributed``,
            else 1 and 0. All ranks must use the same ``session`` id; with ``torch.distributed``
            initialized and ``session=None``, rank 0's fresh id is broadcast to the others.
            Each step may carry this rank's ``weight`` (``step(weight=)``): the daemon applies
            Σ w·g / Σ w (docs/ranks.md).
        sync_mode, min_ranks, grace_seconds: how the ranks make a step (part of the session's
            spec, so every rank gives the same). ``"lockstep"`` (default): every step waits for
            every rank, up to the daemon's ``--straggler-timeout``. ``"quorum"``: step k is taken
            once every rank sent it, or once ``min_ranks`` (default ``world_size``) have and
            ``grace_seconds`` (default 0) have passed since the ``min_ranks``-th arrived; a rank
            left out gets the parameters after the session's last step with
            ``last_info.included`` False and continues from there. ``"async"``: see
            ``max_staleness``. Not with several endpoints.
        max_staleness, staleness_scaling: ``sync_mode="async"`` only (docs/ranks.md,
            Asynchronous). Every ``step()`` is then this rank's next push, applied on arrival as
            the next global step without waiting for any other rank. ``max_staleness`` S
            (required, an int >= 0): a push computed on parameters more than S global steps old
            is dropped (``last_info.stale``; the model takes the latest parameters; no
            exception). ``staleness_scaling``: "none" (default), or "inverse": every group's lr
            times 1 / (1 + s) for a push s global steps behind (Zhang et al., IJCAI 2016), or
            FedAsync's (Xie et al., arXiv 1903.03934) ("polynomial", a): (1 + s)^-a, or
            ("hinge", a, b): 1 for s <= b, else 1 / (a (s - b) + 1).
        labels: a dict of str to str that every client of the session must agree on and the
            daemon does not use (DiLoCo's fragments, a run's name; at most 16, keys of a-z, 0-9,
            '.', '_' and '-'): an attach whose labels differ from the session's is refused
            (``ALREADY_EXISTS`` naming the label); a session or client without labels attaches
            as before.
        qk_clip: QK-clip (MuonClip) pairs ``[(query, key, num_heads), ...]``, each weight a
            parameter tensor of this optimizer (or its name): (num_heads·head_dim, d) matrices in
            Muon groups. A step then takes ``qk_logits`` (see ``step``); τ and α are the query
            group's ``qk_clip_threshold`` and ``qk_clip_alpha``. The daemon checks the shapes
            and groups when the session is created.
        overlap: send each gradient while backward is still running (docs/overlap.md): every
            parameter gets a hook that hands its gradient to the daemon as soon as backward has
            accumulated it, and ``step()`` only finishes the step. Exactly the plain step's
            result; a gradient changed after backward (clipped or unscaled by hand) makes the
            step send them all again. With gradient accumulation, run the micro-batches but the
            last inside ``no_sync()``. One daemon only (not with several ``endpoints``).
        land_in_forward: with ``overlap=True``, the model (a ``torch.nn.Module``) whose next
            forward the parameters' way back overlaps (docs/overlap.md, "Landing during the next
            forward"): ``step()`` returns once the daemon's result is in (``last_info``,
            ``last_step`` and ``loss_scale`` are set), and each module's forward waits only for
            the parameters it holds, as they arrive, like ZeRO-3's parameter prefetch. Exactly
            the plain step's parameters, but a parameter read outside its module's forward
            before that forward ran may be stale: call ``flush()`` first (every call of this
            optimizer waits for them itself). A parameter no module of the model holds lands
            before ``step()`` returns. Over gRPC; on other transports the parameters are in
            place when ``step()`` returns. Not with ``delay`` or ``sync_mode="async"``.
        delay, delay_warmup: ``delay=1`` (ZeRO-Offload's delayed parameter update): after
            ``delay_warmup`` (default 0) ordinary steps, ``step()`` returns as soon as the step's
            gradients are taken, and the parameters after step k are copied in at step k+1's
            ``step()`` (or ``flush()``; ``state_dict``, ``checkpoint`` and ``close`` flush):
            step k+1's forward and backward run on the parameters after step k-1. Costs one copy
            of the parameters and one of the gradients in this process. ``last_info`` describes
            the last step whose parameters were copied in. Not with a loss scaler or
            ``sync_mode="async"``.
        shm_zero_copy: the model's parameters and gradients live in the session's shared-memory
            region (docs/transports.md, "Zero copy"): their ``.data`` and ``.grad`` become views
            of it at construction, backward accumulates there, and the daemon writes the updated
            parameters straight into the model, so a step copies nothing on this side. Needs the
            shm transport (a daemon on this host), fp32 CPU parameters, fp32 on the wire both
            ways and one daemon; not with overlap or delay. Zero the gradients in place
            (``zero_grad(set_to_none=False)``): a ``.grad`` that backward allocated anew is
            copied in at the next step (and pointed at the region again).
        **defaults: options applied to every group that leaves them unset and whose optimizer
            they apply to (e.g. ``lr=0.02, weight_decay=0.1``).

    Raises:
        MuondError: the daemon rejected a call (``.code`` is the ``grpc.StatusCode``).
        ValueError / TypeError: bad options or parameters, found before anything is sent.
    """

    def __init__(self, params: Iterable[Any], endpoint: Optional[str] = None,
                 session: Optional[str] = None, wire_dtype: Optional[wire.DTypeLike] = None, *,
                 connection: Optional[ConnectionOptions] = None, ranks: Optional[RankOptions] = None,
                 timing: Optional[TimingOptions] = None, wire: Optional[WireOptions] = None,
                 step: Optional[StepOptions] = None, **defaults: Any):
        setup = setup_of(defaults, endpoint=endpoint, wire_dtype=wire_dtype, connection=connection,
                         ranks=ranks, timing=timing, wire=wire, step=step)
        opts.check_defaults(setup.defaults)
        self._user_defaults = dict(setup.defaults)
        self._sealed = False
        self._closed = True
        self._sessions: List[DaemonSession] = []
        # What the last step ran with when this optimizer attached (resume_param_groups).
        self._last_step_record = resume.LastStepRecord(0, {})
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._dtensors = DTensorParams()  # FSDP2's parameters, held by their local shards
        groups, names = named_groups(params)
        super().__init__(groups, {})
        # Every option's resolved default, as torch's optimizers list them: schedulers read it
        # (OneCycleLR and CyclicLR cycle momentum, or betas when it is here).
        self.defaults = opts.resolved_defaults(self.param_groups, setup.defaults)
        self._take_setup(setup, session)
        self._index_parameters(names, setup.step.qk_clip)
        # torch's per-parameter state: the daemon holds it; an entry per parameter names what it
        # holds (held_slots.py), so that a tool that steps an optimizer without state once with zero
        # gradients to create it (torch.distributed.checkpoint's state-dict helpers) never steps
        # the session (a zero gradient still decays momentum and counts a step). Each group's
        # "muond" entry is the section a state dict's groups carry (StateTransfer), there for what
        # keeps only the keys the optimizer's own groups have.
        self.state = collections.defaultdict(dict, {
            p: held_entry(name, i) for i, (name, p) in enumerate(zip(self._names, self._given_params()))})
        for group in self.param_groups:
            group["muond"] = {"format": STATE_FORMAT}
        self._check_layout(setup)
        self._closed = False
        try:
            self._start(setup)
        except BaseException:
            # Nothing left behind: a session this constructor created (its upload refused, or no
            # transport for it) goes; one it attached to is never touched.
            for daemon in self._sessions:
                daemon.roll_back()
            self._shut_down(end_session=False)
            raise
        self._note_parameters()

    # -- construction helpers ------------------------------------------------------------------

    def _take_setup(self, setup: Setup, session: Optional[str]) -> None:
        """The infrastructure's settings as this optimizer keeps them, each object checked, and
        the counters of a fresh optimizer; nothing is sent."""
        self.wire_dtype, self.return_dtype = setup.wire.dtypes()
        self.max_grad_norm, self.loss_scaler = setup.step.resolve()
        self.log_num_zeros_in_grad = bool(setup.step.log_num_zeros_in_grad)
        self.parameters_changed = setup.step.parameters_changed  # checked by resolve() above
        # The scale to multiply the next loss by, with a loss scaler (from the daemon's answers).
        self.loss_scale: Optional[float] = None
        self._resolve_connection(setup.connection)
        if quantize.is_quantized(self.wire_dtype) and self._wanted_transport not in ("auto", "grpc"):
            # Block-quantized gradients are chunks of the gRPC stream: the other transports write
            # whole elements into place.
            raise ValueError(f"transport: '{self._wanted_transport}' is not possible with wire_dtype "
                             f"'{self.wire_dtype}': quantized gradients travel over grpc only")
        self.world_size, self.rank, self.sync, self.labels = setup.ranks.resolve(len(self.endpoints))
        self.delay, self.delay_warmup = setup.timing.resolve(
            loss_scaler=self.loss_scaler, sync_mode=self.sync.mode, num_daemons=len(self.endpoints))
        self._warned_old_daemon = False
        self.session_id = ranks_of.shared_session_id(session, self.world_size)
        # The step of the parameters the model holds: the session's step (in an asynchronous
        # session, the global step: the base_step of the next push).
        self.last_step = 0
        # Asynchronous sessions: this rank's pushes numbered so far (the next is pushes + 1), and
        # the pushes dropped as too stale.
        self.pushes = 0
        self.stale_pushes = 0
        self.last_info: Optional[StepInfo] = None
        self._stream: Optional[GradientStream] = None
        self._delayed: Optional[DelayedUpdate] = None
        self._forward: Optional[ForwardLanding] = None
        self._answer_landing: Optional[Landing] = None  # the answer's, until step() hands it on
        self._steps_sent = 0  # steps this optimizer has sent (delay_warmup counts them)
        # The step last answered while its parameters wait to be copied in (delay); None otherwise.
        self._answered_step: Optional[int] = None
        # A sharded step that failed once a shard may have applied it: the next of its number
        # resends it.
        self._cut_off: Optional[CutOffStep] = None
        # Steps whose gradients went out during backward (overlap) and were applied from there.
        self.streamed_steps = 0

    def _check_layout(self, setup: Setup) -> None:
        """The checks that need the parameters: parts held by ranks, and the zero-copy region."""
        timing = setup.timing
        self.partitioned = parts.check_groups(
            self._dtensors.local_groups(self.param_groups), self.world_size, self.rank,
            sync_mode=self.sync.mode, delay=self.delay, overlap=timing.overlap,
            shm_zero_copy=setup.wire.shm_zero_copy, land_in_forward=timing.land_in_forward)
        self.shm_zero_copy = bool(setup.wire.shm_zero_copy)
        if self.shm_zero_copy:
            self._wanted_transport = check_zero_copy(
                list(zip(self._names, self._params)), self.wire_dtype, self.return_dtype,
                self._wanted_transport, len(self.endpoints), overlap=timing.overlap, delay=self.delay)

    def _start(self, setup: Setup) -> None:
        """Connects, opens the session (rank 0 first), chooses the transport and sets up the
        overlap, landing and delay machinery."""
        self._connect(setup.connection)
        ranks_of.rank_zero_first(self.world_size, self.rank, self._open_session)
        chosen = {daemon.choose_transport(self._wanted_transport) for daemon in self._sessions}
        if self.shm_zero_copy:
            self._sessions[0].transport.ready()  # the model's tensors move into the region now
        self.transport = "+".join(sorted(chosen))
        _log.info("session %s: steps travel over %s", self.session_id, self.transport)
        if self.delay:
            self._delayed = DelayedUpdate(dict(zip(self._names, self._params)))
        if setup.timing.land_in_forward is not None:
            self._forward = ForwardLanding(setup.timing.land_in_forward, self._by_name,
                                           self._read_back_parameters)
        if setup.timing.overlap:
            self._stream = GradientStream(
                list(zip(self._names, self._params)), self._begin_stream,
                self._forward.observe if self._forward is not None else None)

    def _resolve_connection(self, connection: ConnectionOptions) -> None:
        """The connection options this optimizer keeps, checked (before anything is sent)."""
        connection.check()
        self.connection = connection
        self.chunk_bytes = connection.chunk_size()
        self.max_step_attempts = connection.step_attempts()
        self.retry_backoff = float(connection.retry_backoff)
        self._wanted_transport = connection.transport_name()
        self.transport = "grpc"
        self.endpoints = connection.endpoint_list()

    def _index_parameters(self, names: List[str], qk_clip: Any) -> None:
        """Names, indices and sizes of the parameters, the QK-clip pairs and the placement; the
        groups are sealed from here on."""
        # The tensors the optimizer reads and writes: a DTensor's local tensor in its place.
        self._params: List[torch.Tensor] = [self._dtensors.local(p) for g in self.param_groups
                                            for p in g["params"]]
        self._names: List[str] = names
        self._global_shapes: Dict[str, Tuple[int, ...]] = {
            name: shape for g in self.param_groups
            for name, shape in zip(g["param_names"], parts.global_shapes(g))}
        for name, shape in self._global_shapes.items():
            if 0 in shape:
                raise ValueError(
                    f"parameter {name!r} has no elements (shape {tuple(shape)}); a session holds "
                    f"parameters of at least one element: leave it out of the optimizer's params")
        self._index: Dict[str, int] = {name: i for i, name in enumerate(names)}
        self._by_name: Dict[str, torch.Tensor] = dict(zip(names, self._params))
        self._sizes: Dict[str, int] = {n: p.numel() for n, p in zip(names, self._params)}
        self._group_names = self._assign_group_names()
        # The weights as the trainer holds them: a DTensor parameter itself, not its local tensor.
        self.qk_clip = qk.pairs_of(qk_clip, self._given_params(), self._names)
        self._created = [dict(g) for g in self.param_groups]  # option values in the spec
        self._watch = ParamWatch(names, self._params, self.param_groups)
        self._sealed = True
        together = [(self._index[pair.query], self._index[pair.key]) for pair in self.qk_clip]
        self.placement = session_spec.place(self.param_groups, together, len(self.endpoints))
        # Per daemon, the indices of its parameters in the whole session, in order.
        self._indices_of = [self.placement.parameters_of(k) for k in range(len(self.endpoints))]

    def _given_params(self) -> List[Any]:
        """The parameters as the groups list them, in session order (FSDP2's DTensors themselves)."""
        return [p for g in self.param_groups for p in g["params"]]

    def _connect(self, connection: ConnectionOptions) -> None:
        """One ``DaemonSession`` per daemon, connected (waiting up to ``connect_timeout``), with
        chunks no larger than every daemon takes."""
        conns = [connection.connect(address) for address in self.endpoints]
        try:
            for conn in conns:
                conn.wait_ready(connection.connect_timeout)
            infos = [conn.server_info() for conn in conns]
        except BaseException:
            for conn in conns:  # no session holds them yet: nothing else would close them
                conn.close()
            raise
        self._fit_chunks_to(conns, infos)
        for k, (conn, info) in enumerate(zip(conns, infos)):
            names_here = [self._names[i] for i in self._indices_of[k]]
            daemon = DaemonSession(conn, self.session_id, names_here,
                                   self._by_name, wire_dtype=self.wire_dtype,
                                   partitioned=self.partitioned,
                                   return_dtype=self.return_dtype, chunk_bytes=self.chunk_bytes,
                                   rank=self.rank, zero_copy=self.shm_zero_copy,
                                   answer_first=self._answer_first, server_info=info)
            for name in names_here:
                shape = self._tensor_shape(name, "moment2")
                if shape != tuple(self._by_name[name].shape):
                    daemon.slot_sizes[(name, "moment2")] = math.prod(shape)
            self._sessions.append(daemon)
        if len(self._sessions) > 1:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(self._sessions), thread_name_prefix="muond-shard")

    @property
    def _conn(self) -> Connection:
        """The first daemon's connection."""
        return self._sessions[0].conn

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_sealed", False):
            raise RuntimeError("RemoteOptimizer: the daemon session is fixed at construction; "
                               "create a new RemoteOptimizer to add parameters")
        resolved = opts.resolve_group(self._dtensors.localize(param_group), self._user_defaults)
        opts.check_tensors(resolved["params"])
        parts.check_partition_of(resolved)
        # A partitioned group's local tensors are parts: the rules read the global shapes.
        opts.check_shapes(resolved, parts.global_shapes(resolved))
        super().add_param_group(resolved)
        self._dtensors.restore(self.param_groups[-1])  # the group lists the model's DTensors

    def _assign_group_names(self) -> List[str]:
        names = [g.get("name") or f"g{i}" for i, g in enumerate(self.param_groups)]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter group names must be unique, got {names}")
        return names

    def _shard_spec(self, shard: int) -> pb.SessionSpec:
        """The spec of daemon ``shard``'s session (the whole spec with one daemon)."""
        whole = session_spec.whole_spec(
            self.param_groups, self._group_names, self.qk_clip, world_size=self.world_size,
            wire_dtype=self.wire_dtype, return_dtype=self.return_dtype,
            loss_scaler=self.loss_scaler, sync=self.sync, labels=self.labels)
        if len(self.endpoints) == 1:
            return whole
        return session_spec.shard_spec(whole, shard, self._indices_of[shard], self.endpoints)

    def _open_session(self) -> None:
        try:
            rank = self.rank if self._async else None
            opened = self._on_every_session(lambda k, session: session.open(self._shard_spec(k), rank))
            self.attached = any(attached for attached, _ in opened)
            steps = [step for _, step in opened]
            answered = list(steps)  # the step each shard's attach answer is of
            if len(set(steps)) > 1:
                steps = self._finish_cut_off_step(steps)
            self.last_step = self._common_step(steps, "CreateSession")
            self._last_step_record = resume.LastStepRecord.of(
                [s.last_overrides for s in self._sessions], answered, self.last_step)
            if self._last_step_record.values is None:
                _log.warning("session %s: the daemon does not know what its step %d ran with (its "
                             "state was replaced by load_state_dict, or restored from a checkpoint of "
                             "an earlier muond, since; or the daemon is older); param_groups keep the "
                             "values given here", self.session_id, self.last_step)
            self.resume_param_groups()
            if self._async:
                # A restarted rank continues its own numbering where the daemon's record of it is.
                self.pushes = self._sessions[0].last_push
        except BaseException:
            # A refused attach (one daemon holds another session of this id, the shards disagree)
            # leaves nothing behind: the sessions this attach created on the other daemons go;
            # sessions that were there before it are never touched.
            if len(self._sessions) > 1:
                for session in self._sessions:
                    session.roll_back()
            raise
        if self.loss_scaler is not None:
            self.loss_scale = self._sessions[0].loss_scale

    def resume_param_groups(self, scheduler: Any = None) -> None:
        """Sets each group's ``lr``, ``momentum``, ``weight_decay`` and ``betas`` to what the
        session's last step ran with, as the daemon recorded it when this optimizer attached (the
        constructor does so itself when it attaches to a session that has stepped), as torch's
        ``load_state_dict`` restores ``param_groups``; RuntimeError once the session has stepped on.

        ``scheduler``: a torch LR scheduler made after the attach and loaded from its state dict.
        Its step after the session's last step moved the values on: each group's lr is taken from
        its record of its last learning rates, and momentum or betas[0] recomputed for its count
        where it cycles them (OneCycleLR, CyclicLR). The next ``step()`` then runs with the values
        of an uninterrupted run (python/README.md, Checkpoints and restarts)."""
        self._last_step_record.resume(self, self._created, self._group_names, scheduler)

    def _common_step(self, steps: List[int], rpc: str) -> int:
        """The step every shard is at; MuondError naming the shards behind when they differ."""
        if len(set(steps)) <= 1:
            return steps[0]
        raise self._common_step_error(steps, rpc)

    def _common_step_error(self, steps: List[int], rpc: str) -> MuondError:
        """The FAILED_PRECONDITION naming the shards behind the others of ``steps``."""
        ahead = max(steps)
        behind = ", ".join(f"shard {k} ({self.endpoints[k]}) at step {s}"
                           for k, s in enumerate(steps) if s != ahead)
        if self._cut_off is not None and self._cut_off.header.step == ahead == min(steps) + 1:
            return shard_step.cut_off_refusal(self.session_id, ahead, behind, rpc,
                                              resendable=self._cut_off.grads is not None)
        return MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"session '{self.session_id}': the shards are at different steps: "
                          f"{behind}, the others at step {ahead} (a daemon restarted from an older "
                          f"checkpoint, or a step was cut off mid-commit); restore every shard to "
                          f"one step (load_state_dict of a saved state_dict) before training on",
                          rpc)

    def _on_every_session(self, call: Callable[[int, DaemonSession], Any]) -> List[Any]:
        """``call(k, session)`` for every daemon, concurrently when there are several; the
        answers in daemon order. The first failure (in daemon order) is raised, naming its
        shard."""
        if self._pool is None:
            return [call(0, self._sessions[0])]
        futures = [self._pool.submit(call, k, session) for k, session in enumerate(self._sessions)]
        concurrent.futures.wait(futures)
        for k, future in enumerate(futures):
            err = future.exception()
            if isinstance(err, MuondError):
                raise MuondError(err.code, f"shard {k} ({self.endpoints[k]}): {err.details}",
                                 err.rpc, err.reason) from err
            if err is not None:
                raise err
        return [future.result() for future in futures]

    # -- the step ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RemoteOptimizer for session '{self.session_id}' is closed")

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the loss scale to use this step (``loss_scale`` with a loss scaler),
        unchanged without one."""
        return loss if self.loss_scale is None else loss * self.loss_scale

    @property
    def _async(self) -> bool:
        return self.sync.mode == "async"

    def _header(self, step: int, qk_logits: Dict[str, List[float]],
                grad_scale: Optional[float] = None, weight: Optional[float] = None) -> pb.StepHeader:
        header = pb.StepHeader(session_id=self.session_id, step=step, rank=self.rank,
                               return_dtype=wire.dtype_enum(self.return_dtype),
                               max_chunk_bytes=self.chunk_bytes)
        if self._async:
            header.base_step = self.last_step
        for index, (group, created) in enumerate(zip(self.param_groups, self._created)):
            opts.check_unchanged(index, group, created)
            self._watch.check_same_params(index, group)
        for index, (group, created, gname) in enumerate(
                zip(self.param_groups, self._created, self._group_names)):
            try:
                header.overrides.add(group=gname, **opts.overrides_of(group, created))
            except (TypeError, ValueError) as err:
                raise type(err)(f"param_groups[{index}]: {err}") from None
        if self.max_grad_norm is not None:
            header.max_grad_norm = float(self.max_grad_norm)
        header.log_num_zeros_in_grad = self.log_num_zeros_in_grad
        if grad_scale is not None:
            header.grad_scale = grad_scale
        if weight is not None:
            header.weight = weight
        for query, values in qk_logits.items():
            header.qk_logits.add(query=query, max_logits=values)
        return header

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``zero_grad`` (with ``overlap``, it also cancels a stream no step took:
        StreamControls). The groups list DTensor parameters (FSDP2's) themselves, so their
        gradients, which live on the DTensors, are cleared as torch clears any parameter's."""
        super().zero_grad(*args, **kwargs)

    def _grads(self) -> List[Tuple[str, torch.Tensor]]:
        self._dtensors.follow()  # before the step reads their gradients and writes their shards
        grads = []
        for name, p in zip(self._names, self._params):
            g = self._dtensors.grad(p)
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"parameter '{name}': sparse gradients are not supported")
            if g.shape != p.shape:
                raise ValueError(f"parameter '{name}': gradient shape {tuple(g.shape)} differs "
                                 f"from the parameter's {tuple(p.shape)}")
            if g.numel() == 0:
                continue  # a part holding none of its parameter: nothing to send
            grads.append((name, g))
        return grads

    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             qk_logits: Optional[Dict[Any, Any]] = None, grad_scale: Optional[float] = None,
             weight: Optional[float] = None) -> Any:
        """Sends the gradients, applies the daemon's update to the parameters in place and
        returns the closure's loss (None without a closure).
        ``qk_logits``: for QK-clip pairs (``qk_clip=`` at construction), ``{query: max_logits}``
        with the query weight (tensor or name) and its heads' maximum attention logits of this
        step's forward pass (a 1-D tensor or a list, one value per head). It is read after the
        closure has run, so a closure may fill in the dict it was given. After the update, the
        daemon scales the heads whose logit exceeds the threshold; pairs left out are not
        clipped this step, nor is any pair when the step is skipped (non-finite gradient).
        ValueError, before anything is sent, for a weight that is not the query of a pair or a
        wrong number of values, or for parameters changed in place since the last step
        (``upload_parameters``).

        ``grad_scale``: the factor the loss was multiplied by (a static loss scale), which the
        daemon divides the gradients by first; unset with ``loss_scaler=`` (``loss_scale``).

        ``weight``: with several ranks, this rank's weight (e.g. its tokens); the daemon applies
        Σ w·g / Σ w over the ranks the step uses (docs/ranks.md). Finite and > 0, else ValueError
        before anything is sent; None means 1. ``last_info`` reports ``contributors``,
        ``total_weight`` and ``included``: a quorum step that went on without this rank leaves it
        False, the parameters those after the session's last step (``last_info.step``), and the
        next ``step()`` continues after it.

        Asynchronously (``sync_mode="async"``) the call is this rank's push ``pushes`` + 1 from
        base_step ``last_step``, applied on arrival as global step ``last_info.global_step``
        (``staleness`` behind). One over ``max_staleness`` behind is dropped without an error:
        the model takes the latest parameters, ``last_info.stale`` is True, ``stale_pushes``
        counts it and its push number stays free (docs/ranks.md, Asynchronous)."""
        self._check_open()  # before the closure's forward and backward
        try:  # a step that fails before it goes out cancels what backward streamed of it
            loss, header, grads = self._before_sending(closure, qk_logits, grad_scale, weight)
        except BaseException:
            self._cancel_stream()
            raise
        streamed, rest = self._take_stream(grads)
        delayed = self._delay_now()
        self._steps_sent += 1
        if delayed:
            self._send_delayed(header, grads, streamed, rest, weight)
            return loss
        self._answer_landing = None
        try:
            self._run_step(header, grads, streamed, rest, None, weight)()
        finally:  # the parameters are in (or as they were, after a failure)
            self._note_parameters()
        landing, self._answer_landing = self._answer_landing, None
        if self._forward is not None:  # the parameters may still be arriving
            self._forward.begin(landing or Landing.landed(), self.last_step)
        return loss

    def _note_parameters(self) -> None:
        """Records each parameter's version (torch's count of in-place changes) once this
        optimizer has written it: after construction, load_state_dict and each step whose
        parameters are in when it returns. With land_in_forward or delay, parameters land
        later, outside this optimizer's calls, and only what happens before the first step is
        watched."""
        self._watch.note(self._steps_sent == 0 or (self._forward is None and self._delayed is None))

    def _check_untouched(self) -> None:
        """ValueError, before anything runs or is sent, for parameters changed in place since
        this optimizer last wrote them: the daemon holds the masters, and the step's answer
        would overwrite the change without a word."""
        message = None if self.parameters_changed == "ignore" else self._watch.changed_in_place()
        if self._forward is not None or self._delayed is not None:
            self._watch.note(False)  # from here on parameters land outside this optimizer's calls
        if message is None:
            return
        if self.parameters_changed == "warn":
            _log.warning("session %s: %s", self.session_id, message)
            self.parameters_changed = "ignore"  # said once
            return
        raise ValueError(message)

    def _before_sending(self, closure: Optional[Callable[[], Any]],
                        qk_logits: Optional[Dict[Any, Any]], grad_scale: Optional[float],
                        weight: Optional[float]
                        ) -> Tuple[Any, pb.StepHeader, List[Tuple[str, torch.Tensor]]]:
        """What ``step()`` does before the step goes out: its arguments checked, the closure
        run, the last step's parameters in; (the closure's loss, the step's header, its
        gradients). Every check that can refuse the step runs here."""
        weight = ranks_of.check_weight(weight)
        grad_scale = loss_scale.check_grad_scale(grad_scale)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_untouched()
        if self._forward is not None:  # the last step's parameters are all in before anything runs
            self._forward.wait_all()
            self._forward.check_use()
        logits = qk.logits_of(qk_logits, self.qk_clip, self._given_params(), self._names)
        grads = self._grads()
        if self._delayed is not None:  # the step before's, before this step goes out
            self._delayed.land()
        return loss, self._header(self._next_number(), logits, grad_scale, weight), grads

    def _send_delayed(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]],
                      streamed: Optional[StreamedStep], rest: Optional[List[Tuple[str, torch.Tensor]]],
                      weight: Optional[float]) -> None:
        """Sends a delayed step: it runs on while the trainer goes on, so what it sends, and sends
        again on a retry, is a copy, since the trainer's next backward overwrites .grad."""
        with torch.no_grad():
            kept = [(name, g.detach().clone()) for name, g in grads]
        if streamed is not None:
            try:
                streamed.send_rest(header, rest)  # every gradient is read before this returns
            except IdentityChanged:
                streamed = None
        self._delayed.submit(lambda out: self._run_step(header, kept, streamed, None, out, weight))

    def _next_number(self) -> int:
        """The number of the next step (of this rank's next push, asynchronously): after the step
        answered last, whose parameters may not be in the model yet (delay)."""
        if self._async:
            return self.pushes + 1
        return (self.last_step if self._answered_step is None else self._answered_step) + 1

    def _delay_now(self) -> bool:
        """Whether the coming step is a delayed one (past delay_warmup)."""
        return self._delayed is not None and self._steps_sent >= self.delay_warmup

    # -- state ---------------------------------------------------------------------------------

    def checkpoint(self) -> int:
        """Has the daemon write the session's masters, optimizer state and step counters to its
        ``--state-dir`` now, atomically; returns the step the checkpoint holds. A daemon
        restarted with the same ``--state-dir`` restores the session from its latest checkpoint
        (plus its journal under ``--durability journal``); attach to it by constructing a
        ``RemoteOptimizer`` with the same session id. ``MuondError(FAILED_PRECONDITION)`` when
        the daemon has no ``--state-dir``."""
        self.flush()
        self._refuse_shards_at_two_steps("Checkpoint")
        steps = self._on_every_session(lambda k, session: session.checkpoint())
        return self._common_step(steps, "Checkpoint")

    def state_digest(self) -> StateDigest:
        """The digest of the session's whole state on the daemon (masters, optimizer slots, step
        counters, loss scaler) at its last step: equal for equal states, different for any changed
        bit; a sharded session's combines its shards' (``muond.state_digest``)."""
        self.flush()  # the daemon's state after every step this optimizer has sent
        shards = self._on_every_session(
            lambda k, session: StateDigest.from_proto(session.conn.state_digest(session.session_id)))
        self._common_step([shard.step for shard in shards], "GetStateDigest")  # names a kept step
        return combine_digests(shards, self.endpoints)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self, keep_session: bool = False) -> None:
        """Ends the daemon session (unless ``keep_session``, to attach to it later) and closes
        the channel. Idempotent."""
        if self._closed:
            return
        self._shut_down(end_session=not keep_session and self.rank == 0)  # rank 0 ends a shared session

    def _shut_down(self, end_session: bool) -> None:
        """Closes every daemon's session (ending it when ``end_session``) and the worker threads;
        the first failure is raised after all are closed."""
        failure: Optional[BaseException] = None
        if self._stream is not None:
            self._stream.remove()
        if self._forward is not None:
            try:
                self._forward.wait_all()  # the parameters are in before anything closes
            except BaseException as err:  # noqa: BLE001 - raised once everything is closed
                failure = err
            self._forward.remove()
        if self._delayed is not None:
            try:
                self._delayed.land()  # the step in flight is answered before anything closes
            except BaseException as err:  # noqa: BLE001 - raised once everything is closed
                failure = err
            self._delayed.close()
        self._closed = True
        for session in self._sessions:
            try:
                session.close(end_session)
            except BaseException as err:  # noqa: BLE001 - every session is closed first
                failure = failure or err
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if failure is not None:
            raise failure

    def __enter__(self) -> "RemoteOptimizer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self) -> None:
        # Closes the channel only: a session is ended explicitly, never by garbage collection.
        # (At interpreter exit the connection's atexit hook has closed it already, and
        # Connection.close does nothing during finalization, where it could block.)
        if getattr(self, "_closed", True):
            return
        for session in getattr(self, "_sessions", []):
            try:
                session.conn.close()
            except Exception:  # noqa: BLE001 - garbage collection must not raise
                pass

    def __getstate__(self):
        raise TypeError("a RemoteOptimizer holds a live connection and can't be pickled; "
                        "save state_dict() instead")
