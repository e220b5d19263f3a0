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

Security: ``auth_token`` is sent as ``authorization: Bearer <token>`` with every call;
``tls_ca_file`` (or ``use_tls``) makes the channel TLS, and ``tls_client_cert_file`` with
``tls_client_key_file`` mutual TLS. See ``muond.client.Connection``.

Shards: with ``endpoints=[...]`` the session spreads over several daemons, each holding whole
parameters (``muond.placement``); a step is prepared on every daemon (gradients in, sums of
squares out), then committed on every daemon with one decision — the global gradient norm for
clipping, or a skip when any shard saw a non-finite gradient — so the update is the one a single
daemon would apply, bit for bit (docs/sharding.md).

Retries: a step that failed with UNAVAILABLE or DEADLINE_EXCEEDED is resent with the same step
number (the daemon applies each step once and answers a repeat with the same parameters), and the
calls that are safe to repeat are retried on UNAVAILABLE; ``max_step_attempts`` tries in all.

Thread-safety: like every torch optimizer, one instance is used from one thread at a time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import time
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc
import torch
import torch.distributed

from . import options as opts
from . import placement
from . import qk_clip as qk
from . import wire
from ._stubs import pb
from .client import (DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_RETRY_BACKOFF,
                     Connection)
from .errors import STEP_NOT_PREPARED, MuondError
from .naming import named_groups
from .transport import choice
from .transport.daemon_session import DaemonSession, copy_in
from . import loss_scale
from .step_info import StepInfo, check_max_grad_norm

DEFAULT_ENDPOINT = "127.0.0.1:50051"
# A step that failed with these may have been applied or not; the daemon answers a resend of the
# same step number without a second update, so resending is safe.
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_log = logging.getLogger("muond")
_STATE_FORMAT = 1


class RemoteOptimizer(torch.optim.Optimizer):
    """A torch optimizer backed by a muond session.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``), or param
            group dicts. A group picks its optimizer with ``optimizer="muon"|"adamw"|"lion"|"sgd"``
            or ``use_muon=True|False`` (MuonWithAuxAdam style) and may set any option of the
            table in ``muond.options`` (``lr``, ``momentum``, ``betas``, ``ns_steps``, ...).
            ``muond.default_param_groups(model)`` builds the usual Muon + AdamW split.
        endpoint: the daemon's "host:port"; default ``$MUOND_ENDPOINT`` or 127.0.0.1:50051.
        endpoints: several daemons ("host:port" each, in a fixed order) to spread the session
            over instead of one ``endpoint``; each holds whole parameters, placed by optimizer
            cost (``muond.placement``). Attaching later needs the same list in the same order.
        session: session id to create or attach to; None makes a fresh random one.
        wire_dtype: dtype of gradients on the wire: "fp32" (default) or "bf16" (or "fp16").
        return_dtype: dtype of the returned parameters: "fp32" (default) or "bf16"/"fp16".
        max_grad_norm: clip the global gradient norm on the daemon before each step.
        log_num_zeros_in_grad: count the gradient elements that are exactly 0 each step
            (Megatron-Core's option of that name); ``last_info.num_zeros_in_grad`` has the count.
        loss_scaler: a daemon-side dynamic loss scaler for fp16 training (``muond.loss_scale``):
            True for Megatron-Core's defaults or a dict of its options. Multiply each loss by
            ``loss_scale`` (``scale_loss(loss)``); the daemon divides the gradients by it.
        chunk_bytes: size of the tensor chunks sent and asked for.
        timeout: deadline in seconds of each call (None: none).
        connect_timeout: seconds to wait for the daemon at construction.
        max_step_attempts: tries of a step that fails with UNAVAILABLE or DEADLINE_EXCEEDED,
            each resent with the same step number (the daemon applies each step exactly once, so
            a resend after a lost answer does not update twice); also the tries of the calls
            that are safe to repeat (attach, reading parameters or state, checkpoint) on
            UNAVAILABLE. Default 4.
        retry_backoff: seconds before the second try, doubled after each further one.
        auth_token: bearer token (a token of the daemon's ``--auth-token-file``), sent as
            ``authorization: Bearer <token>`` with every call. The session belongs to it.
        use_tls: TLS with the default roots; implied by any ``tls_*`` file.
        tls_ca_file: PEM roots to verify the daemon's certificate with.
        tls_client_cert_file, tls_client_key_file: this client's PEM certificate chain and key,
            for a daemon that requires mutual TLS; both or neither.
        tls_server_name: verify the daemon's certificate against this name instead of the
            endpoint's host (tests).
        credentials: ``grpc.ChannelCredentials`` for TLS built by the caller, instead of the
            ``tls_*`` options; None for plaintext.
        world_size, rank: data-parallel training with one optimizer per rank: every rank sends
            its own gradients for the same step and the daemon applies their average (in rank
            order) once and answers every rank with the same parameters — it replaces DDP's
            all-reduce of the gradients. Default: from an initialized ``torch.distributed``,
            else 1 and 0. All ranks must use the same ``session`` id; with ``torch.distributed``
            initialized and ``session=None``, rank 0's fresh id is broadcast to the others.
        transport: how steps' tensors travel: "grpc" (chunked streams), "shm" (a shared-memory
            region registered with a daemon on this host; gradients are copied into it and the
            parameters out of it, one copy each way), "cuda_ipc" (CUDA parameters, a daemon on
            ``--backend cuda`` on this node: one device buffer shared with the daemon over CUDA
            IPC, gradients and parameters copied device to device, on the daemon's GPU or another
            one of the node), "nccl" (CUDA parameters, a daemon on ``--backend cuda`` with NCCL on
            another GPU, typically another node: the tensors travel over a two-rank NCCL
            communicator; NCCL refuses two ranks on one GPU, so the daemon's own GPU is an error,
            for which "auto" takes cuda_ipc) or "auto": cuda_ipc when the parameters are on a CUDA
            device and the daemon offers CUDA IPC on this host (nccl should registering the memory
            fail and it fits), nccl for a daemon with NCCL on another host, else shm when the
            daemon is on this host and offers it, else grpc. Default ``$MUOND_TRANSPORT`` or
            "auto". A transport named explicitly that cannot work is a RuntimeError naming it and
            saying why. ``opt.transport`` says which was chosen (also logged on the "muond"
            logger; with several daemons, each chooses its own, e.g. "grpc+shm"). Every step
            semantic is the same on all of them (retries, replays, ranks, shards).
        qk_clip: QK-clip (MuonClip) pairs ``[(query, key, num_heads), ...]``, each weight a
            parameter tensor of this optimizer (or its name): (num_heads·head_dim, d) matrices in
            Muon groups. A step then takes ``qk_logits`` (see ``step``); τ and α are the query
            group's ``qk_clip_threshold`` and ``qk_clip_alpha``. The daemon checks the shapes
            and groups when the session is created.
        **defaults: options applied to every group that leaves them unset and whose optimizer
            they apply to (e.g. ``lr=0.02, weight_decay=0.1``).

    Raises:
        MuondError: the daemon rejected a call (``.code`` is the ``grpc.StatusCode``).
        ValueError / TypeError: bad options or parameters, found before anything is sent.
    """

    def __init__(self, params: Iterable[Any], endpoint: Optional[str] = None,
                 session: Optional[str] = None, wire_dtype: wire.DTypeLike = "fp32", *,
                 return_dtype: wire.DTypeLike = "fp32", max_grad_norm: Optional[float] = None,
                 chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, timeout: Optional[float] = None,
                 connect_timeout: float = 10.0,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 auth_token: Optional[str] = None, use_tls: bool = False,
                 tls_ca_file: Optional[str] = None, tls_client_cert_file: Optional[str] = None,
                 tls_client_key_file: Optional[str] = None, tls_server_name: Optional[str] = None,
                 max_step_attempts: Optional[int] = None,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF,
                 transport: Optional[str] = None,
                 world_size: Optional[int] = None, rank: Optional[int] = None,
                 qk_clip: Optional[Iterable[Tuple[Any, Any, int]]] = None,
                 endpoints: Optional[Sequence[str]] = None, log_num_zeros_in_grad: bool = False,
                 loss_scaler: Any = None, **defaults: Any):
        opts.check_defaults(defaults)
        self._user_defaults = dict(defaults)
        self._sealed = False
        self._closed = True
        self._sessions: List[DaemonSession] = []
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        groups, names = named_groups(params)
        super().__init__(groups, {})
        self.defaults = dict(defaults)

        self.wire_dtype = wire.dtype_name(wire_dtype)
        self.return_dtype = wire.dtype_name(return_dtype)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self.loss_scaler = loss_scale.resolve(loss_scaler)
        # The scale to multiply the next loss by, with a loss scaler (from the daemon's answers).
        self.loss_scale: Optional[float] = None
        self.chunk_bytes = int(chunk_bytes)
        self.max_step_attempts = _step_attempts(max_step_attempts)
        self.retry_backoff = float(retry_backoff)
        self.world_size, self.rank = _ranks(world_size, rank)
        self.session_id = _shared_session_id(session, self.world_size)
        self.last_step = 0
        self.last_info: Optional[StepInfo] = None
        wanted = transport if transport is not None else os.environ.get("MUOND_TRANSPORT") or "auto"
        self._wanted_transport = choice.check_name(wanted)
        self.transport = "grpc"
        self.endpoints = _endpoint_list(endpoint, endpoints)

        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._names: List[str] = names
        self._index: Dict[str, int] = {name: i for i, name in enumerate(names)}
        self._by_name: Dict[str, torch.Tensor] = dict(zip(names, self._params))
        self._sizes: Dict[str, int] = {n: p.numel() for n, p in zip(names, self._params)}
        self._group_names = self._assign_group_names()
        self.qk_clip = qk.pairs_of(qk_clip, self._params, self._names)
        self._created = [dict(g) for g in self.param_groups]  # option values in the spec
        self._sealed = True
        self.placement = self._place()
        # Per daemon, the indices of its parameters in the whole session, in order.
        self._indices_of = [self.placement.parameters_of(k) for k in range(len(self.endpoints))]

        self._closed = False
        try:
            for k, address in enumerate(self.endpoints):
                conn = Connection(address, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                                  timeout=timeout, credentials=credentials, auth_token=auth_token,
                                  use_tls=use_tls, tls_ca_file=tls_ca_file,
                                  tls_client_cert_file=tls_client_cert_file,
                                  tls_client_key_file=tls_client_key_file,
                                  tls_server_name=tls_server_name,
                                  max_attempts=self.max_step_attempts,
                                  retry_backoff=self.retry_backoff)
                names_here = [self._names[i] for i in self._indices_of[k]]
                daemon = DaemonSession(conn, self.session_id, names_here, self._by_name,
                                       wire_dtype=self.wire_dtype, return_dtype=self.return_dtype,
                                       chunk_bytes=self.chunk_bytes, rank=self.rank)
                for name in names_here:
                    shape = self._tensor_shape(name, "moment2")
                    if shape != tuple(self._by_name[name].shape):
                        daemon.slot_sizes[(name, "moment2")] = math.prod(shape)
                self._sessions.append(daemon)
            if len(self._sessions) > 1:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=len(self._sessions), thread_name_prefix="muond-shard")
            for daemon in self._sessions:
                daemon.conn.wait_ready(connect_timeout)
            self._open_session()
            chosen = {daemon.choose_transport(wanted) for daemon in self._sessions}
            self.transport = "+".join(sorted(chosen))
            _log.info("session %s: steps travel over %s", self.session_id, self.transport)
        except BaseException:
            self._shut_down(end_session=False)
            raise

    @property
    def _conn(self) -> Connection:
        """The first daemon's connection."""
        return self._sessions[0].conn

    # -- construction helpers ------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_sealed", False):
            raise RuntimeError("RemoteOptimizer: the daemon session is fixed at construction; "
                               "create a new RemoteOptimizer to add parameters")
        resolved = opts.resolve_group(param_group, self._user_defaults)
        params = resolved["params"]
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf tensor")
            if resolved["optimizer"] == "muon" and p.dim() < 2:
                raise ValueError(
                    f"Muon needs matrices; a parameter of shape {tuple(p.shape)} must go to an "
                    f"AdamW group (see muond.default_param_groups)")
            if resolved["optimizer"] == "muon":
                opts.check_parameter(resolved, tuple(p.shape))
        super().add_param_group(resolved)

    def _assign_group_names(self) -> List[str]:
        names = [g.get("name") or f"g{i}" for i, g in enumerate(self.param_groups)]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter group names must be unique, got {names}")
        return names

    def _place(self) -> placement.Placement:
        tensors = []
        for group in self.param_groups:
            split = group.get("qkv_split")
            for p in group["params"]:
                tensors.append(placement.Tensor(
                    tuple(p.shape), group["optimizer"] == "muon",
                    tuple(split) if split is not None else None,
                    group.get("num_query_groups") or 1))
        pairs = [(self._index[pair.query], self._index[pair.key]) for pair in self.qk_clip]
        return placement.place(tensors, len(self.endpoints), pairs)

    def _shard_spec(self, shard: int) -> pb.SessionSpec:
        """The spec of daemon ``shard``'s session: the whole spec with one daemon, else its
        parameters, every group, its QK-clip pairs and the placement."""
        whole = self._spec()
        if len(self.endpoints) == 1:
            return whole
        mine = self._indices_of[shard]
        names = {self._names[i] for i in mine}
        spec = pb.SessionSpec(world_size=whole.world_size, return_dtype=whole.return_dtype)
        spec.groups.extend(whole.groups)
        spec.parameters.extend(whole.parameters[i] for i in mine)
        spec.qk_clip.extend(p for p in whole.qk_clip if p.query in names)
        if whole.HasField("loss_scaler"):
            spec.loss_scaler.CopyFrom(whole.loss_scaler)
        spec.shard.endpoints.extend(self.endpoints)
        spec.shard.index = shard
        spec.shard.num_parameters = len(self._names)
        spec.shard.parameters.extend(mine)
        return spec

    def _spec(self) -> pb.SessionSpec:
        spec = pb.SessionSpec(world_size=self.world_size, return_dtype=wire.dtype_enum(self.return_dtype))
        for group, gname in zip(self.param_groups, self._group_names):
            spec.groups.add(name=gname, options=opts.group_options_proto(group))
            for p, pname in zip(group["params"], group["param_names"]):
                ps = spec.parameters.add(name=pname, shape=list(p.shape), group=gname,
                                         wire_dtype=wire.dtype_enum(self.wire_dtype))
                if group.get("qkv_split") is not None:
                    ps.qkv_split.extend(group["qkv_split"])
                    ps.num_query_groups = group.get("num_query_groups") or 1
                if (group.get("tp_blocks") or 1) > 1:
                    ps.tp_blocks = group["tp_blocks"]
                    ps.tp_block_dim = group.get("tp_block_dim", 0)
        for pair in self.qk_clip:
            added = spec.qk_clip.add(query=pair.query, key=pair.key, num_heads=pair.num_heads)
            if pair.mla is not None:
                added.mla.qk_nope_head_dim = pair.mla.qk_nope_head_dim
                added.mla.qk_rope_head_dim = pair.mla.qk_rope_head_dim
                added.mla.v_head_dim = pair.mla.v_head_dim
        if self.loss_scaler is not None:
            spec.loss_scaler.SetInParent()
            for key, value in self.loss_scaler.items():
                setattr(spec.loss_scaler, key, value)
        return spec

    def _open_session(self) -> None:
        # With torch.distributed, rank 0 creates the session and uploads its parameters before the
        # others attach and read them back, so every rank starts from rank 0's values.
        distributed = self.world_size > 1 and _dist_ready()
        if distributed and self.rank != 0:
            torch.distributed.barrier()
        try:
            self._open_session_now()
        finally:
            if distributed and self.rank == 0:
                torch.distributed.barrier()

    def _open_session_now(self) -> None:
        try:
            opened = self._on_every_session(lambda k, session: session.open(self._shard_spec(k)))
            self.attached = any(attached for attached, _ in opened)
            self.last_step = self._common_step([step for _, step in opened], "CreateSession")
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

    def _common_step(self, steps: List[int], rpc: str) -> int:
        """The step every shard is at; MuondError naming the shards behind when they differ."""
        if len(set(steps)) <= 1:
            return steps[0]
        ahead = max(steps)
        behind = ", ".join(f"shard {k} ({self.endpoints[k]}) at step {s}"
                           for k, s in enumerate(steps) if s != ahead)
        raise MuondError(grpc.StatusCode.FAILED_PRECONDITION,
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

    def _header(self, step: int, qk_logits: Dict[str, List[float]],
                grad_scale: Optional[float] = None) -> pb.StepHeader:
        header = pb.StepHeader(session_id=self.session_id, step=step, rank=self.rank,
                               return_dtype=wire.dtype_enum(self.return_dtype),
                               max_chunk_bytes=self.chunk_bytes)
        for group, created, gname in zip(self.param_groups, self._created, self._group_names):
            header.overrides.add(group=gname, **opts.overrides_of(group, created))
        if self.max_grad_norm is not None:
            header.max_grad_norm = float(self.max_grad_norm)
        header.log_num_zeros_in_grad = self.log_num_zeros_in_grad
        if grad_scale is not None:
            header.grad_scale = grad_scale
        for query, values in qk_logits.items():
            header.qk_logits.add(query=query, max_logits=values)
        return header

    def _grads(self) -> List[Tuple[str, torch.Tensor]]:
        grads = []
        for name, p in zip(self._names, self._params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"parameter '{name}': sparse gradients are not supported")
            if g.shape != p.shape:
                raise ValueError(f"parameter '{name}': gradient shape {tuple(g.shape)} differs "
                                 f"from the parameter's {tuple(p.shape)}")
            grads.append((name, g))
        return grads

    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             qk_logits: Optional[Dict[Any, Any]] = None, grad_scale: Optional[float] = None) -> Any:
        """Sends the gradients, applies the daemon's update to the parameters in place and
        returns the closure's loss (None without a closure).

        ``qk_logits``: for QK-clip pairs (``qk_clip=`` at construction), ``{query: max_logits}``
        with the query weight (tensor or name) and its heads' maximum attention logits of this
        step's forward pass (a 1-D tensor or a list, one value per head). It is read after the
        closure has run, so a closure may fill in the dict it was given. After the update, the
        daemon scales the heads whose logit exceeds the threshold; pairs left out are not
        clipped this step, nor is any pair when the step is skipped (non-finite gradient).
        ValueError, before anything is sent, for a weight that is not the query of a pair or a
        wrong number of values.

        ``grad_scale``: the factor the loss was multiplied by (a static loss scale); the daemon
        divides the gradients by it before the norm, clipping and the non-finite check. With
        ``loss_scaler=`` leave it unset: the daemon divides by its own scale (``loss_scale``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        logits = qk.logits_of(qk_logits, self.qk_clip, self._params, self._names)
        grads = self._grads()
        header = self._header(self.last_step + 1, logits, loss_scale.check_grad_scale(grad_scale))
        if len(self._sessions) == 1:
            session = self._sessions[0]
            result, seconds, attempts = self._try_step(lambda: session.step(header, grads))
        else:
            by_session = self._grads_by_session(grads)
            result, seconds, attempts = self._try_step(
                lambda: self._sharded_step(header, by_session))
        self.last_step = result.step
        self.last_info = StepInfo(result.step, result.applied, result.replayed, result.skip_reason,
                                  result.grad_norm, result.compute_seconds, seconds, attempts,
                                  result.num_zeros_in_grad if self.log_num_zeros_in_grad else None,
                                  result.loss_scale if self.loss_scaler is not None else None)
        if self.loss_scaler is not None:
            self.loss_scale = result.loss_scale
        return loss

    def _grads_by_session(self, grads: List[Tuple[str, torch.Tensor]]
                       ) -> List[List[Tuple[str, torch.Tensor]]]:
        by_session: List[List[Tuple[str, torch.Tensor]]] = [[] for _ in self._sessions]
        for name, g in grads:
            by_session[self.placement.shard_of[self._index[name]]].append((name, g))
        return by_session

    def _sharded_step(self, header: pb.StepHeader,
                      by_session: List[List[Tuple[str, torch.Tensor]]]) -> pb.StepResult:
        """One try of a step over every shard: prepare everywhere, decide, commit everywhere
        (docs/sharding.md). Safe to repeat as a whole after any failure."""
        prepares = []
        for session in self._sessions:  # each shard gets the QK-clip logits of its own pairs
            prepare = pb.StepHeader.FromString(header.SerializeToString())
            prepare.phase = pb.STEP_PHASE_PREPARE
            mine = [l for l in header.qk_logits if l.query in session.by_name]
            del prepare.qk_logits[:]
            prepare.qk_logits.extend(mine)
            prepares.append(prepare)
        prepared = self._on_every_session(
            lambda k, session: session.step(prepares[k], by_session[k]))
        commit = pb.StepHeader(step=header.step, rank=header.rank, phase=pb.STEP_PHASE_COMMIT,
                               return_dtype=header.return_dtype,
                               max_chunk_bytes=header.max_chunk_bytes)
        commit.decision.CopyFrom(self._decide(prepared))
        committed = self._on_every_session(lambda k, session: session.step(commit, []))
        result = pb.StepResult(step=header.step, applied=committed[0].applied,
                               replayed=all(r.replayed for r in committed),
                               skip_reason=commit.decision.skip_reason,
                               grad_norm=commit.decision.grad_norm,
                               compute_seconds=max(r.compute_seconds for r in committed),
                               num_zeros_in_grad=sum(r.num_zeros_in_grad for r in committed),
                               loss_scale=committed[0].loss_scale)
        return result

    def _decide(self, prepared: List[pb.StepResult]) -> pb.ShardDecision:
        """The decision every shard applies: the one a shard that already committed this step
        took, else the global norm summed in the whole session's parameter order (as one daemon
        sums it) and a skip when any gradient is not finite or any shard's guard refuses."""
        for result in prepared:
            if result.replayed:
                return pb.ShardDecision(grad_norm=result.grad_norm,
                                        skip_reason="" if result.applied else result.skip_reason)
        sums = [0.0] * len(self._names)
        for k, result in enumerate(prepared):
            for i, value in zip(self._indices_of[k], result.sum_squares):
                sums[i] = value
        total, first_bad = 0.0, None
        for i, value in enumerate(sums):
            total += value
            if first_bad is None and not math.isfinite(value):
                first_bad = self._names[i]
        if first_bad is not None:
            reason = f"non-finite gradient in '{first_bad}'"
        else:
            reason = next((r.skip_reason for r in prepared if r.skip_reason), "")
        return pb.ShardDecision(grad_norm=math.sqrt(total), skip_reason=reason)

    def _try_step(self, once: Callable[[], pb.StepResult]) -> Tuple[pb.StepResult, float, int]:
        """Runs ``once`` up to max_step_attempts times on transient failures (the same step
        number each time); returns (result, seconds, attempts). A sharded step is also tried
        again when a shard lost its prepared step (a restart between prepare and commit)."""
        started = time.perf_counter()
        backoff = self.retry_backoff
        for attempt in range(1, self.max_step_attempts + 1):
            try:
                result = once()
                return result, time.perf_counter() - started, attempt
            except MuondError as err:
                lost_prepare = err.reason == STEP_NOT_PREPARED
                if (err.code not in _RETRIED and not lost_prepare) or attempt == self.max_step_attempts:
                    raise
            pause = backoff
            self._on_every_session(lambda k, session: session.conn.pause_before_retry(pause))
            backoff *= 2
        raise AssertionError("unreachable")

    # -- state ---------------------------------------------------------------------------------

    def checkpoint(self) -> int:
        """Has the daemon write the session's masters, optimizer state and step counters to its
        ``--state-dir`` now, atomically; returns the step the checkpoint holds. A daemon
        restarted with the same ``--state-dir`` restores the session from its latest checkpoint
        (plus its journal under ``--durability journal``); attach to it by constructing a
        ``RemoteOptimizer`` with the same session id. ``MuondError(FAILED_PRECONDITION)`` when
        the daemon has no ``--state-dir``."""
        self._check_open()
        steps = self._on_every_session(lambda k, session: session.checkpoint())
        return self._common_step(steps, "Checkpoint")

    def state_dict(self) -> Dict[str, Any]:
        """The daemon's whole state in torch's layout: ``state[i]`` holds parameter i's
        ``master`` and optimizer slots (e.g. ``momentum``, ``exp_avg``), each in the dtype the
        daemon stores it in (fp32 unless the group's *_dtype options say bf16 or fp16), and its
        ``step`` count;
        ``param_groups`` the group options; ``muond`` the session's last step and names."""
        self._check_open()
        parts = self._on_every_session(lambda k, session: session.get_state())
        last_step = self._common_step([int(header.last_step) for header, _ in parts], "GetState")
        counts = {c.name: int(c.count) for header, _ in parts for c in header.step_counts}
        index = self._index
        state: Dict[int, Dict[str, Any]] = {}
        for (name, slot), tensor in ((key, t) for _, tensors in parts for key, t in tensors.items()):
            entry = state.setdefault(index[name], {})
            slot = slot or "master"
            entry[slot] = tensor.view(self._tensor_shape(name, slot)).to(self._storage_dtype(name, slot))
        for name, i in index.items():
            state.setdefault(i, {})["step"] = counts.get(name, 0)
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        meta = {"format": _STATE_FORMAT, "last_step": last_step, "names": list(self._names),
                "session": self.session_id}
        header = parts[0][0]
        if header.HasField("loss_scaler"):
            meta["loss_scaler"] = {"scale": header.loss_scaler.scale,
                                   "growth_tracker": header.loss_scaler.growth_tracker,
                                   "hysteresis_tracker": header.loss_scaler.hysteresis_tracker}
        return {"state": state, "param_groups": groups, "muond": meta}

    def _storage_dtype(self, name: str, slot: str) -> torch.dtype:
        """The torch dtype the daemon stores a parameter's master or slot in."""
        group = next(g for g in self.param_groups if name in g["param_names"])
        return wire.torch_dtype(opts.storage_dtype(group, slot))

    def _tensor_shape(self, name: str, slot: str) -> Tuple[int, ...]:
        """The shape of a parameter's master or optimizer slot (``options.slot_shape``)."""
        shape = tuple(self._by_name[name].shape)
        if slot == "master":
            return shape
        group = next(g for g in self.param_groups if name in g["param_names"])
        return opts.slot_shape(group, shape, slot)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replaces the daemon's state (masters, slots, step counters) with ``state_dict`` from
        ``state_dict()``, copies the masters into the parameters, and restores the groups' lr,
        momentum and weight decay. The session's other options must match the saved ones."""
        self._check_open()
        meta = state_dict.get("muond")
        if not meta or meta.get("format") != _STATE_FORMAT:
            raise ValueError("not a RemoteOptimizer state dict (no 'muond' section of format 1)")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"group {i}: the state dict has {len(saved['params'])} "
                                 f"parameters, this optimizer {len(group['params'])}")
            mine, theirs = opts.spec_options(group), opts.spec_options(saved)
            diff = [k for k in mine if mine[k] != theirs.get(k)]
            if diff:
                raise ValueError(f"group {i}: options {diff} differ from the state dict's; they "
                                 f"are fixed by the session")
        state = state_dict["state"]

        def set_state(k: int, session: DaemonSession) -> int:
            header = pb.StateHeader(last_step=int(meta["last_step"]))
            if meta.get("loss_scaler") is not None:
                header.loss_scaler.CopyFrom(pb.LossScalerState(**meta["loss_scaler"]))
            for i in self._indices_of[k]:
                header.step_counts.add(name=self._names[i], count=int(state.get(i, {}).get("step", 0)))
            return session.set_state(header, chunks(self._indices_of[k]))

        def chunks(indices: List[int]) -> Iterator[pb.TensorChunk]:
            for i in indices:
                name = self._names[i]
                for slot, value in state.get(i, {}).items():
                    if isinstance(value, torch.Tensor) and slot != "step":
                        expected = self._tensor_shape(name, slot)
                        if tuple(value.shape) != expected:
                            raise ValueError(f"state of '{name}' slot '{slot}' has shape "
                                             f"{tuple(value.shape)}, expected {expected}")
                        # In the format the daemon stores the tensor in (which rounds as the
                        # daemon would): 16-bit state travels in half the bytes.
                        stored = opts.storage_dtype(
                            next(g for g in self.param_groups if name in g["param_names"]), slot)
                        yield from wire.encode(name, value, stored,
                                               slot="master" if slot == "master" else slot,
                                               max_chunk_bytes=self.chunk_bytes)

        self.last_step = self._common_step(self._on_every_session(set_state), "SetState")
        if self.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.loss_scale = float(meta["loss_scaler"]["scale"])
        copy_in(self._by_name, {name: state[i]["master"] for i, name in enumerate(self._names)
                                if "master" in state.get(i, {})})
        for group, saved in zip(self.param_groups, saved_groups):
            for key in opts.OVERRIDABLE + ("initial_lr",):
                if key in saved:
                    group[key] = saved[key]

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
        self._closed = True
        failure: Optional[BaseException] = None
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


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _ranks(world_size: Optional[int], rank: Optional[int]) -> Tuple[int, int]:
    """(world_size, rank) as given, else from an initialized torch.distributed, else (1, 0)."""
    if world_size is None:
        world_size = torch.distributed.get_world_size() if _dist_ready() else 1
    if rank is None:
        rank = torch.distributed.get_rank() if _dist_ready() else 0
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    return world_size, rank


def _shared_session_id(session: Optional[str], world_size: int) -> str:
    """The session id every rank uses: the one given, or a fresh one (broadcast from rank 0 when
    several ranks share it)."""
    if session:
        return session
    fresh = f"torch-{uuid.uuid4().hex[:16]}"
    if world_size == 1:
        return fresh
    if not _dist_ready():
        raise ValueError("session: several ranks (world_size > 1) must name the same session id, "
                         "or initialize torch.distributed so that rank 0's id is shared")
    shared = [fresh]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def _step_attempts(max_step_attempts: Optional[int]) -> int:
    attempts = DEFAULT_MAX_ATTEMPTS if max_step_attempts is None else int(max_step_attempts)
    if attempts < 1:
        raise ValueError(f"max_step_attempts must be at least 1, got {attempts}")
    return attempts


def _env_endpoint() -> str:
    return os.environ.get("MUOND_ENDPOINT") or DEFAULT_ENDPOINT


def _endpoint_list(endpoint: Optional[str], endpoints: Optional[Sequence[str]]) -> List[str]:
    """The daemons of the session: ``endpoints`` as given, or the one ``endpoint``."""
    if endpoints is None:
        return [endpoint or _env_endpoint()]
    if endpoint is not None:
        raise ValueError("endpoint and endpoints: give one or the other")
    if isinstance(endpoints, str):
        raise TypeError("endpoints: a list of \"host:port\" strings, not one string")
    listed = [str(e) for e in endpoints]
    if not listed:
        raise ValueError("endpoints: needs at least one daemon")
    for i, address in enumerate(listed):
        if not address:
            raise ValueError(f"endpoints[{i}]: empty")
        if listed.index(address) != i:
            raise ValueError(f"endpoints[{i}]: '{address}' is listed twice (endpoints[{listed.index(address)}])")
    return listed
