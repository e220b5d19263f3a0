"""``DiLoCo``: local training, with a periodic outer step on a muond daemon (Streaming too).

Each worker trains its own copy of the model with its own (inner) torch optimizer. Every
``sync_every`` (H) inner steps it sends its pseudo-gradient, Δ = (global parameters at the last
sync) − (local parameters), as the gradient of one ``RemoteOptimizer`` step weighted by the tokens
it processed since that sync. The daemon averages the workers' Δ by weight, applies the outer
optimizer (Nesterov SGD by default, or any muond group: Muon for the matrices) and answers every
worker with the new global parameters, which become its local ones. With ``fragments`` F the
parameters are split into F fragments that sync in turn, one every H/F inner steps (Streaming
DiLoCo). With ``overlap_steps`` τ a sync runs in a thread of its own beside the next τ inner steps,
and its answer is merged into the local parameters after them (``merge_alpha`` α keeps α of the
local values). docs/diloco.md has the order of operations and the schedule.

The global parameters are a separate set of fp32 tensors (one per trained parameter of the model)
registered with the ``RemoteOptimizer``: a sync puts Δ into their ``.grad`` (``None`` for the
parameters of fragments that do not sync), steps, and copies the answered values into the model.

Thread-safety: one instance is used from one thread at a time, like a torch optimizer. With
``overlap_steps`` a sync's ``RemoteOptimizer`` step runs in a thread the instance starts and joins
itself; while it runs, the caller's thread touches neither the ``RemoteOptimizer`` nor the global
parameters.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import torch
from torch import nn

from . import options as opts
from . import quantize, wire
from .optimizer import RemoteOptimizer
from .diloco_arguments import (check_alpha, check_count, check_tokens, fold_own_arguments,
                               label_fragments, workers_of)
from .diloco_layout import OUTER_SGD, muon_outer_groups, split_fragments
from .errors import MuondError

__all__ = ["ASYNC_OUTER_MOMENTUM", "DiLoCo", "OUTER_SGD", "muon_outer_groups", "split_fragments"]

_log = logging.getLogger("muond")
_STATE_FORMAT = 1

# Asynchronous DiLoCo's default outer momentum in place of OUTER_SGD's 0.9: stale pushes act as
# momentum of their own, which 0.9 adds to (docs/diloco.md, Asynchronous outer steps, Outer momentum).
ASYNC_OUTER_MOMENTUM = 0.5

OuterSpec = Union[None, str, Mapping[str, Any], Sequence[Mapping[str, Any]]]


class _Sync:
    """A sync of one fragment from its sending to its merge: the session step it was sent as, the
    inner step after which it is merged, and, once answered, whether the answer replaces every
    local parameter (the step went on without this worker) or is merged into the fragment's."""

    def __init__(self, fragment: int, sent: int, weight: float, lands_at: int):
        self.fragment, self.sent, self.weight, self.lands_at = fragment, sent, weight, lands_at
        # Sent again after a try of the same session step failed: that try's weight (its tokens
        # were counted again into this one's), else None. See DiLoCo._retry_was_applied.
        self.retry_of: Optional[float] = None
        # For a retry over a quantized wire, what its failed try rounded away (when that was the
        # step's only failed try): the feedback, should the retry be answered as its replay.
        self.failed_rounding: Optional[Dict[int, torch.Tensor]] = None
        # Answered as the replay of an applied first try: this worker is a sync behind the others,
        # who sent the next session step at the point this retry went out.
        self.realign = False
        # A retry sent as its failed try was (the same Δ and weight): over a sharded outer session.
        self.resent = False
        self.thread: Optional[threading.Thread] = None
        self.stream: Optional[Any] = None  # the CUDA stream the step's GPU work goes on, if any
        self.error: Optional[BaseException] = None
        self.answered = False
        self.whole = False

    def run(self, remote: RemoteOptimizer) -> None:
        try:
            if self.stream is None:
                remote.step(weight=self.weight)
                return
            # A side stream: the GPU transports queue their copies (NCCL its receive, which waits
            # for the daemon's answer) on the current stream, which must not hold up the caller's
            # inner steps queued meanwhile.
            with torch.cuda.stream(self.stream):
                remote.step(weight=self.weight)
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
            self.error = err


class DiLoCo:
    """A DiLoCo worker: the inner optimizer steps every call, the daemon takes the outer step.

    Args:
        model: the worker's model; its parameters with ``requires_grad`` are trained and synced.
        inner_optimizer: the worker's local torch optimizer over those parameters (e.g.
            ``torch.optim.AdamW``, or ``muond.LocalOptimizer`` with Muon groups as in MuLoCo).
        sync_every: H, the inner steps between two syncs of the same parameters (>= 1).
        outer: the outer optimizer, as muond parameter groups over the model's parameters:
            None or "sgd": Nesterov SGD with DiLoCo's lr 0.7 and momentum 0.9 (``OUTER_SGD``;
            asynchronously momentum ``ASYNC_OUTER_MOMENTUM``) on every parameter; "muon":
            ``muon_outer_groups(model)``; a dict of options for one group of every parameter; or
            a list of group dicts whose ``params`` are the model's parameters (tensors, names or
            ``(name, tensor)`` pairs), each parameter in exactly one group
            (``muond.default_param_groups(model)`` output works). A group that names no
            optimizer is SGD, and an SGD group gets those defaults of lr, momentum and nesterov
            for those it leaves unset (and the keyword options below do not set).
        wire_dtype: the pseudo-gradients' dtype on the wire: "fp32" (default), "bf16", or
            block-quantized "int8" or "int4" (``muond/quantize.py``; over gRPC), with error
            feedback: what the quantization rounds away is added to this worker's next
            pseudo-gradient of the same parameter (kept in ``state_dict``).
        endpoint, session, world_size, rank: as ``RemoteOptimizer``'s. Every worker
            is one rank of the session: K workers give ``world_size=K`` and the same ``session``
            (or an initialized ``torch.distributed``). The worker that opens the session first
            uploads its parameters; the others attach and take the session's values, so start
            every worker from the same parameters or let rank 0 open first (torch.distributed).
        sync_mode: "lockstep" (default), "quorum" (with ``min_ranks``, ``grace_seconds`` among
            the keyword options) or "async" (with ``max_staleness``, ``staleness_scaling``), as
            ``RemoteOptimizer``'s. Asynchronous: each worker's pseudo-gradient is applied on
            arrival, and the outer SGD is delayed Nesterov (``nesterov_delay``, by default the
            number of workers) with momentum ``ASYNC_OUTER_MOMENTUM`` (0.5) unless given
            (docs/diloco.md, Asynchronous outer steps). Not with fragments > 1.
        fragments: F, the fragments the parameters are split into (Streaming DiLoCo): 1 to the
            number of trained parameters, and H must be a multiple of F. ``split_fragments``
            says which parameters form each fragment; ``fragment_names`` lists them.
        overlap_steps: τ, 0 to H/F − 1 (Streaming DiLoCo's overlap; torchft's
            ``fragment_sync_delay``): a sync is sent and the next τ inner steps run while the
            daemon answers it; after them its answer is merged. 0 (default): the answer is taken
            before the next inner step. Not with ``sync_mode="async"``.
        merge_alpha: α in [0, 1]: a fragment's local parameters become α·local + (1 − α)·global
            when its sync's answer is merged (``torch.lerp``). 0 (default): the global values.
        **remote_optimizer_kwargs: the other ``RemoteOptimizer`` options (``connection``,
            ``transport``, ``max_grad_norm``, ``return_dtype``, ``labels``, option defaults for
            every group), as keywords or in its option objects (``ranks=``, ``wire=``, ...);
            ``world_size``, ``rank``, ``sync_mode`` and ``wire_dtype`` are DiLoCo's own and given
            to it, not in an object. The session's labels also carry F (``diloco.fragments``).

    Raises:
        ValueError / TypeError: bad arguments, naming the argument, before anything is sent.
        MuondError: the daemon refused a call.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, *, outer: OuterSpec = None, endpoint: Optional[str] = None,
                 session: Optional[str] = None, world_size: Optional[int] = None,
                 rank: Optional[int] = None, sync_mode: Optional[str] = None, fragments: int = 1,
                 wire_dtype: Any = "fp32", overlap_steps: int = 0, merge_alpha: float = 0.0,
                 **remote_optimizer_kwargs: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model: has no parameters with requires_grad")
        self.sync_every = check_count("sync_every", sync_every, 1)
        self.fragments = check_count(
            "fragments", fragments, 1, len(named),
            " (at most one fragment per trained parameter of the model)")
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments: sync_every ({self.sync_every}) must be a multiple of "
                             f"fragments ({self.fragments}), so that each fragment syncs every "
                             f"sync_every inner steps")
        self.overlap_steps = check_count(
            "overlap_steps", overlap_steps, 0, self.sync_every // self.fragments - 1,
            f" (below sync_every / fragments = {self.sync_every // self.fragments}: a sync is "
            f"merged before the next one is sent)")
        self.merge_alpha = check_alpha(merge_alpha)
        self.wire_dtype = wire.gradient_dtype_name(wire_dtype)
        self.model = model
        self.inner = inner_optimizer
        self.names: List[str] = [n for n, _ in named]
        self._params: List[torch.Tensor] = [p for _, p in named]
        self._fragment_of = split_fragments([p.numel() for p in self._params], self.fragments)
        self._members: List[List[int]] = [[i for i, f in enumerate(self._fragment_of) if f == k]
                                          for k in range(self.fragments)]
        # The global parameters at the last sync: fp32, on the parameters' devices.
        self._globals: List[torch.Tensor] = [
            torch.empty_like(p, dtype=torch.float32).copy_(p.detach()) for p in self._params]
        if sync_mode is not None and sync_mode not in ("lockstep", "quorum", "async"):
            raise ValueError(f"sync_mode: DiLoCo syncs in 'lockstep', 'quorum' or 'async', got "
                             f"{sync_mode!r}")
        self.asynchronous = sync_mode == "async"
        if self.asynchronous and self.fragments > 1:
            raise ValueError(f"fragments: asynchronous DiLoCo syncs every parameter at once, got "
                             f"fragments={self.fragments} (an asynchronous answer carries every "
                             f"global parameter, which would overwrite the other fragments' values "
                             f"of their own last syncs; docs/diloco.md, Asynchronous outer steps)")
        if self.asynchronous and self.overlap_steps:
            raise ValueError(f"overlap_steps: not with sync_mode='async', got {self.overlap_steps} "
                             f"(an asynchronous push is answered at once, never waited for)")
        timing = remote_optimizer_kwargs.get("timing")
        if remote_optimizer_kwargs.get("delay") or getattr(timing, "delay", 0):
            raise ValueError("delay: DiLoCo takes no delayed update (a sync's answer is merged "
                             "after overlap_steps inner steps, 0 by default)")
        delay = workers_of(world_size) if self.asynchronous else None
        groups = self._outer_groups(outer, model, remote_optimizer_kwargs, delay)
        label_fragments(remote_optimizer_kwargs, self.fragments)
        fold_own_arguments(remote_optimizer_kwargs, {"wire_dtype": wire_dtype, "world_size": world_size,
                                                      "rank": rank, "sync_mode": sync_mode})
        self.remote = RemoteOptimizer(groups, endpoint=endpoint, session=session,
                                      **remote_optimizer_kwargs)
        self.inner_steps = 0                       # calls of step() so far
        self.tokens = 0.0                          # tokens counted by step() so far
        self._since_sync = [0.0] * self.fragments  # tokens since each fragment's last sync
        self.last_sync: Optional[int] = None       # the fragment the last step() sent
        self.last_merged: Optional[int] = None     # ... whose answer the last step() merged
        self._sync_in_flight: Optional[_Sync] = None  # sent, not yet merged (overlap_steps)
        # The session step and weight of the last sync that failed, until a sync of that step is
        # answered: the next one is its retry.
        self._failed: Optional[Tuple[int, float]] = None
        # With a quantized wire, what the failed sync's Δ rounded away, for its retry (_Sync's
        # failed_rounding).
        self._failed_rounding: Optional[Dict[int, torch.Tensor]] = None
        self._side_streams: Dict[torch.device, Any] = {}  # by CUDA device, for syncs in flight
        self._deltas: Dict[int, torch.Tensor] = {}  # Δ buffers, made at a parameter's first sync
        # Error feedback of quantized syncs: what the last sync of each parameter rounded away.
        self._feedback: Dict[int, torch.Tensor] = {}
        self.last_sync_bytes = 0  # payload bytes of the pseudo-gradients the last sync sent
        self.sync_bytes = 0       # ... of every sync so far
        self._take_globals(range(len(self._params)))  # an attached worker starts from the session's

    # -- construction helpers ----------------------------------------------------------------------

    def _outer_groups(self, outer: OuterSpec, model: nn.Module, kwargs: Mapping[str, Any],
                      delay: Optional[int]) -> List[Dict[str, Any]]:
        """The outer groups over the global copies, each model parameter in exactly one."""
        if outer is None or (isinstance(outer, str) and outer.lower() in ("sgd", "nesterov")):
            given: List[Mapping[str, Any]] = [{"params": list(self.names)}]  # SGD, filled below
        elif isinstance(outer, str) and outer.lower() == "muon":
            given = muon_outer_groups(model)
        elif isinstance(outer, str):
            raise ValueError(f"outer: unknown outer optimizer {outer!r}; give 'sgd', 'muon', a "
                             f"dict of group options or a list of parameter groups")
        elif isinstance(outer, Mapping):
            given = [outer] if "params" in outer else [{"params": list(self.names), **outer}]
        else:
            try:
                given = list(outer)
            except TypeError:
                raise TypeError(f"outer: 'sgd', 'muon', a dict of group options or a list of "
                                f"parameter groups, got {type(outer).__name__}") from None
        index = {name: i for i, name in enumerate(self.names)}
        by_id = {id(p): i for i, p in enumerate(self._params)}
        group_of: Dict[int, int] = {}
        groups = []
        for g, group in enumerate(given):
            if not isinstance(group, Mapping) or "params" not in group:
                raise TypeError(f"outer: group {g} must be a dict with 'params'")
            params = group["params"]
            try:
                params = [params] if isinstance(params, (torch.Tensor, str)) else list(params)
            except TypeError:
                raise TypeError(f"outer: group {g}'s 'params' must be parameters or their names, "
                                f"got {type(params).__name__}") from None
            members = [self._member(item, index, by_id, g) for item in params]
            for i in members:
                if i in group_of:
                    raise ValueError(f"outer: parameter '{self.names[i]}' is in groups "
                                     f"{group_of[i]} and {g}")
                group_of[i] = g
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            options = self._sgd_defaults(options, kwargs, delay)
            try:  # the daemon would refuse these too, but only once the session is asked for
                opts.check_ranges(opts.resolve_group(options, kwargs))
            except ValueError as err:
                raise ValueError(f"outer: group {g}: {err}") from None
            groups.append({**options, "params": [self._globals[i] for i in members],
                           "param_names": [self.names[i] for i in members]})
        missing = [n for i, n in enumerate(self.names) if i not in group_of]
        if missing:
            raise ValueError(f"outer: the parameters {missing} are in no group; every trained "
                             f"parameter of the model needs an outer optimizer")
        return groups

    def _member(self, item: Any, index: Dict[str, int], by_id: Dict[int, int], g: int) -> int:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[1]
        if isinstance(item, str):
            if item not in index:
                raise ValueError(f"outer: group {g} names '{item}', not a trained parameter of "
                                 f"the model")
            return index[item]
        if isinstance(item, torch.Tensor) and id(item) in by_id:
            return by_id[id(item)]
        raise ValueError(f"outer: group {g} holds a tensor that is not a trained parameter of "
                         f"the model")

    @staticmethod
    def _sgd_defaults(options: Dict[str, Any], kwargs: Mapping[str, Any],
                      delay: Optional[int]) -> Dict[str, Any]:
        """``options`` with DiLoCo's outer SGD settings for what neither it nor the keyword
        options set, when the group is SGD (a group that names no optimizer is); asynchronously,
        also ``nesterov_delay`` = ``delay`` (the number of workers), and the momentum is
        ``ASYNC_OUTER_MOMENTUM``."""
        named = [s for s in (options, kwargs) if "optimizer" in s or "use_muon" in s]
        if named and str(named[0].get("optimizer", "")).lower() != "sgd":
            return options
        filled = dict(options)
        defaults = dict(OUTER_SGD)
        if delay is not None:
            defaults.update(nesterov_delay=delay, momentum=ASYNC_OUTER_MOMENTUM)
        for key, value in defaults.items():
            if key not in options and key not in kwargs:
                filled[key] = value
        return filled

    # -- the schedule ------------------------------------------------------------------------------

    @property
    def fragment_names(self) -> List[List[str]]:
        """The names of each fragment's parameters, fragment 0 first."""
        return [[self.names[i] for i in members] for members in self._members]

    @property
    def interval(self) -> int:
        """Inner steps between two syncs (of any fragment): sync_every / fragments."""
        return self.sync_every // self.fragments

    def fragment_due(self, inner_step: int) -> Optional[int]:
        """The fragment that syncs after inner step ``inner_step`` (counted from 1, as
        ``inner_steps`` after that step), or None. A sync comes after every ``interval`` inner
        steps; the session's step s carries fragment (s − 1) mod F, so this worker's next sync
        carries fragment ``remote.last_step mod F``, or the one after while a sync is in flight."""
        if inner_step < 1 or inner_step % self.interval:
            return None
        return self._next_session_step() % self.fragments

    def _next_session_step(self) -> int:
        """The session step this worker's next sync goes after: the last answered one, or the
        one in flight."""
        pending = self._sync_in_flight
        return self.remote.last_step if pending is None or pending.answered else pending.sent

    # -- the training loop -------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None, *, tokens: Any = None) -> Any:
        """Replaces ``inner_optimizer.step()``: runs it (with ``closure``), counts ``tokens``
        (the tokens, or samples, this step trained on; None counts 1), merges the answer of a sync
        sent ``overlap_steps`` inner steps ago, and, when a fragment is due (``fragment_due``),
        syncs it. Returns the closure's loss."""
        amount = check_tokens(tokens)
        due = self.fragment_due(self.inner_steps + 1)
        if due is not None and self._since_sync[due] + amount <= 0:
            raise ValueError(f"tokens: no tokens counted since fragment {due}'s last sync; the "
                             f"weight of a sync must be > 0")
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.inner_steps += 1
        self.tokens += amount
        self._since_sync = [t + amount for t in self._since_sync]
        self.last_sync, self.last_merged = due, None
        pending = self._sync_in_flight
        if pending is not None and self.inner_steps >= pending.lands_at:
            self._merge(pending)
        if due is not None:
            self._sync(due)
        return loss

    @property
    def sync_in_flight(self) -> Optional[int]:
        """The fragment whose sync was sent and is not merged yet (``overlap_steps``), or None."""
        pending = self._sync_in_flight
        return None if pending is None else pending.fragment

    def finish_sync(self) -> Optional[int]:
        """Waits for a sync in flight and merges its answer now, before its ``overlap_steps``
        inner steps are over: before evaluating the local model, or at the end of training
        (``close`` does not merge). Returns the fragment merged, or None when none was in flight.
        Raises the sync's error, as the merge would."""
        pending = self._sync_in_flight
        if pending is None:
            return None
        self._merge(pending)
        return pending.fragment

    def _sync(self, fragment: int, at_once: bool = False) -> None:
        """Sends one outer step of ``fragment``: Δ of its parameters as their gradients, weighted
        by the tokens since its last sync. Its answer is merged at once (``at_once``, or without
        ``overlap_steps``), or after ``overlap_steps`` inner steps during which the step runs in a
        thread."""
        weight = self._since_sync[fragment]
        members = self._members[fragment]
        for g in self._globals:
            g.grad = None
        sent = self.remote.last_step + 1
        retry_of = self._failed[1] if self._failed is not None and self._failed[0] == sent else None
        if retry_of is not None and len(self.remote.endpoints) > 1:
            self._resend(fragment, sent, retry_of, at_once)
            return
        with torch.no_grad():
            for i in members:
                g = self._globals[i]
                delta = self._deltas.get(i)
                if delta is None:
                    delta = self._deltas[i] = torch.empty_like(g)
                torch.sub(g, self._params[i].detach(), out=delta)
                if i in self._feedback:
                    delta.add_(self._feedback[i])
                g.grad = delta
            # The globals are the daemon's (always finite): a non-finite Δ means the local
            # parameters diverged, and the inner optimizer's state with them. Sent, it would skip
            # the outer step for every worker, at every sync from here on.
            finite = torch.stack([torch.isfinite(self._deltas[i]).all() for i in members]).all()
            bad = None if bool(finite) else next(  # one device sync a sync; the name only on failure
                i for i in members if not torch.isfinite(self._deltas[i]).all())
        if bad is not None:
            for g in self._globals:
                g.grad = None
            raise RuntimeError(
                f"DiLoCo rank {self.remote.rank}: the pseudo-gradient of '{self.names[bad]}' is not "
                f"finite (the local parameters diverged; the inner optimizer's state is likely "
                f"non-finite too); nothing was sent. "
                + ("Rebuild its inner optimizer and its model from global_parameters() (an "
                   "asynchronous worker does not resume from a state dict)" if self.asynchronous else
                   "Resume this worker from a state dict saved before, or rebuild its inner "
                   "optimizer and its model from global_parameters()"))
        sync = _Sync(fragment, sent, weight, lands_at=self.inner_steps + self.overlap_steps)
        sync.retry_of = retry_of
        sync.failed_rounding, self._failed_rounding = (
            self._failed_rounding if retry_of is not None else None), None
        # The tokens from here on count toward the fragment's next sync.
        self._since_sync[fragment] = 0.0
        self._send(sync, at_once)

    def _resend(self, fragment: int, sent: int, weight: float, at_once: bool) -> None:
        """Sends session step ``sent`` of ``fragment`` again as its failed try was sent: the same
        Δ (its buffers are untouched until this fragment's next sync, which this is) at the same
        weight. Over a sharded outer session some shards may have committed that try: the others
        must commit the same gradients (docs/sharding.md, A failed step). The tokens since the
        failed try count toward the fragment's next sync."""
        with torch.no_grad():
            for i in self._members[fragment]:
                self._globals[i].grad = self._deltas[i]
        sync = _Sync(fragment, sent, weight, lands_at=self.inner_steps + self.overlap_steps)
        sync.retry_of, sync.resent = weight, True
        self._failed_rounding = None  # the same Δ goes again: its own rounding is kept as usual
        self._since_sync[fragment] -= weight
        self._send(sync, at_once)

    def _send(self, sync: _Sync, at_once: bool) -> None:
        """Runs ``sync``'s step: now, merging its answer, or in a thread (``overlap_steps``)."""
        self._sync_in_flight = sync
        if self.overlap_steps == 0 or at_once:
            sync.run(self.remote)
            self._merge(sync)
            return
        device = self._cuda_device()
        if device is not None:  # the side stream starts once Δ is computed on the caller's
            sync.stream = self._side_streams.setdefault(device, torch.cuda.Stream(device))
            sync.stream.wait_stream(torch.cuda.current_stream(device))
        sync.thread = threading.Thread(target=sync.run, args=(self.remote,), daemon=True,
                                       name=f"muond-diloco-sync-{sync.sent}")
        sync.thread.start()

    def _cuda_device(self) -> Optional[torch.device]:
        """The one CUDA device the global parameters are on, or None (on the CPU, or on several
        devices, whose syncs then go on each device's current stream)."""
        devices = {g.device for g in self._globals if g.is_cuda}
        return devices.pop() if len(devices) == 1 else None

    def _wait_for_answer(self, sync: _Sync) -> None:
        """Joins ``sync``'s step and takes in its answer: the counters and error feedback, and
        whether the merge takes every parameter. Raises the step's error (the fragment's tokens
        are counted again, for a retry)."""
        if sync.answered:
            return
        if sync.thread is not None:
            sync.thread.join()
        sync.answered = True
        for g in self._globals:
            g.grad = None
        if sync.stream is not None:  # the caller's stream reads what the answer wrote
            torch.cuda.current_stream(sync.stream.device).wait_stream(sync.stream)
        if sync.error is not None:
            self._sync_in_flight = None
            self._since_sync[sync.fragment] += sync.weight
            # A retry that failed too: the first try's weight is what a replay would have used.
            self._failed = (sync.sent, sync.weight if sync.retry_of is None else sync.retry_of)
            # Two failed tries of one step: which was applied, if either, is not known.
            self._failed_rounding = (self._rounding(self._members[sync.fragment])
                                     if sync.retry_of is None and quantize.is_quantized(self.wire_dtype)
                                     else None)
            raise sync.error
        self._failed = None
        self.last_sync_bytes = sum(wire.payload_bytes(self._params[i].numel(), self.wire_dtype)
                                   for i in self._members[sync.fragment])
        self.sync_bytes += self.last_sync_bytes
        info = self.remote.last_info
        if self.asynchronous and info is not None and info.stale:
            # Too stale (more than max_staleness global steps behind): nothing was applied and the
            # session's latest parameters are in the global copies.
            _log.warning("DiLoCo rank %d: push dropped as too stale (%d global steps behind); "
                         "taking the session's parameters, local progress since the last sync "
                         "is dropped", self.remote.rank, info.staleness)
            sync.whole = True
            return
        # Lock-step or quorum: an answer for another step than this worker's means the step went
        # on without it. An asynchronous answer names the latest global step, whoever pushed it.
        moved_on = not self.asynchronous and info is not None and info.step != sync.sent
        if info is not None and (moved_on or not getattr(info, "included", True)):
            sync.whole = True
            if getattr(info, "included", False):
                # This worker's Δ went into step sync.sent, and the session moved on after it.
                _log.warning("DiLoCo rank %d: sync step %d was answered after the session moved on "
                             "to step %d; taking the session's parameters, local progress since "
                             "the sync is dropped", self.remote.rank, sync.sent, info.step)
                if quantize.is_quantized(self.wire_dtype):
                    self._settle_feedback(sync, info)
                return
            # A quorum step went on without this worker: take the session's parameters whole.
            _log.warning("DiLoCo rank %d: sync step %d went on without this worker (the session "
                         "is at step %d); taking the session's parameters, local progress since "
                         "the last sync is dropped", self.remote.rank, sync.sent, info.step)
            return
        if sync.resent and info is not None and info.replayed:
            # The failed try's Δ and weight, applied once whichever try it was; when it was the
            # first, the others went on to the next session step at this retry's point.
            sync.realign = not self.asynchronous and info.attempts == 1
        elif sync.retry_of is not None and info is not None and info.replayed:
            if info.attempts == 1:  # the step was applied before this retry began: the first try
                self._retry_was_applied(sync)
                return
            # A later try of the retry answered as a replay: the first try or an earlier try of
            # this one was applied; which is not known here.
            _log.warning("DiLoCo rank %d: the retry of sync step %d was answered as a replay after "
                         "%d tries: taken as the retry's own step (it is the first try's if that "
                         "was applied before its answer was lost)", self.remote.rank, sync.sent,
                         info.attempts)
        if info is not None and not info.applied:
            _log.warning("DiLoCo rank %d: outer step %d skipped (%s); fragment %d %s its global "
                         "values", self.remote.rank, info.step, info.skip_reason, sync.fragment,
                         "goes back to" if self.merge_alpha == 0.0 else "is merged with")
        elif quantize.is_quantized(self.wire_dtype):
            self._keep_rounding(self._members[sync.fragment])

    def _settle_feedback(self, sync: _Sync, info: Any) -> None:
        """Error feedback after an answer for a later session step that says this worker's
        ``sync.sent`` was included (the session moved on meanwhile; the parameters are taken
        whole): the Δ sent, carrying the feedback, was applied — this one (the rounding of it is
        kept), or, for a retry answered as a replay, the first try (its rounding, kept when it
        failed, is the feedback, as ``_retry_was_applied`` takes it).
        Either way the old feedback is not sent again. (Whether step ``sync.sent`` was skipped
        is not in such an answer, whose ``applied`` is the later step's: a skipped one's rounding
        is kept too.)"""
        members = self._members[sync.fragment]
        if sync.retry_of is not None and not sync.resent and info.replayed:
            self._take_failed_rounding(sync)
        else:
            self._keep_rounding(members)

    def _retry_was_applied(self, sync: _Sync) -> None:
        """``sync`` was sent again after its first try failed, and the daemon answers it as a
        replay: the first try had been applied (its answer was lost), with the first try's Δ and
        weight; this one's were not used. The tokens counted again go back to what came since the
        first try, toward the fragment's next sync; the merge takes the step's answer as usual,
        as an overlapped sync landing this late would; the feedback of a quantized wire is what
        the first try rounded away (kept when it failed), not this one's, which was not applied."""
        self._since_sync[sync.fragment] += sync.weight - sync.retry_of
        self._take_failed_rounding(sync)
        sync.realign = not self.asynchronous
        _log.warning("DiLoCo rank %d: sync step %d of fragment %d had been applied before its "
                     "answer was lost (its retry was answered as a replay); the tokens since "
                     "its first try count toward the fragment's next sync", self.remote.rank,
                     sync.sent, sync.fragment)

    def _merge(self, sync: _Sync) -> None:
        """Waits for ``sync``'s answer if need be, then merges it into the local parameters: the
        fragment's become α·local + (1 − α)·global, or every parameter takes the session's
        values (the step went on without this worker)."""
        self._wait_for_answer(sync)
        self._sync_in_flight = None
        self.last_merged = sync.fragment
        if sync.whole:
            self._take_globals(range(len(self._params)))
            self._since_sync = [0.0] * self.fragments
            return
        members = self._members[sync.fragment]
        if self.merge_alpha == 0.0:
            self._take_globals(members)
        else:
            with torch.no_grad():
                for i in members:
                    local = self._params[i]
                    local.copy_(torch.lerp(local.detach().float(), self._globals[i],
                                           1.0 - self.merge_alpha))
        if sync.realign:
            # The others sent the next session step when this retry went out: send it now, and
            # wait for it, so that this worker's syncs meet theirs again from the next one on.
            due = self.remote.last_step % self.fragments
            if self._since_sync[due] > 0:
                self._sync(due, at_once=True)

    def _decoded(self, i: int) -> torch.Tensor:
        """What the daemon decodes of the Δ + e in parameter ``i``'s buffer on this worker's wire."""
        sent = self._deltas[i]
        return quantize.round_trip(sent, self.wire_dtype).view_as(sent).to(sent.device)

    @torch.no_grad()
    def _keep_rounding(self, members: Iterable[int]) -> None:
        """Error feedback: e ← (Δ + e) − what the daemon decoded of it, for the next sync."""
        for i in members:
            feedback = self._feedback.get(i)
            if feedback is None:
                feedback = self._feedback[i] = torch.empty_like(self._deltas[i])
            torch.sub(self._deltas[i], self._decoded(i), out=feedback)

    @torch.no_grad()
    def _rounding(self, members: Iterable[int]) -> Dict[int, torch.Tensor]:
        """What the Δ + e in the buffers of ``members`` rounds away: _keep_rounding's e, aside."""
        return {i: self._deltas[i] - self._decoded(i) for i in members}

    def _take_failed_rounding(self, sync: _Sync) -> None:
        """The failed try before the retry ``sync`` was applied: its rounding (kept when it failed)
        is the fragment's feedback; none when it is not known (two tries failed)."""
        kept = sync.failed_rounding or {}
        for i in self._members[sync.fragment]:
            if i in kept:
                self._feedback[i] = kept[i]
            else:
                self._feedback.pop(i, None)

    @torch.no_grad()
    def _take_globals(self, indices: Iterable[int]) -> None:
        for i in indices:
            self._params[i].copy_(self._globals[i])

    def global_parameters(self) -> Dict[str, torch.Tensor]:
        """The global parameters at each fragment's last sync (fp32; the tensors themselves, do
        not modify them). While a sync is in flight (``sync_in_flight``) its answer may be
        landing in them."""
        return dict(zip(self.names, self._globals))

    @property
    def last_info(self):
        """The ``StepInfo`` of the last sync answered (None before the first): with
        ``overlap_steps``, read it after the step that merged it (``last_merged``)."""
        return self.remote.last_info

    @property
    def session_id(self) -> str:
        return self.remote.session_id

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This worker's state: the inner optimizer's state dict, the global parameters at the
        last sync, the local parameters, the error feedback of quantized syncs, and the counters.
        A sync in flight is waited for first (its error, if it failed, is raised here and nothing
        is saved); its merge, still to come, is part of the state (``pending_merge``). The outer
        optimizer's state stays in the daemon's session (``remote.checkpoint()`` with a
        ``--state-dir`` daemon makes it durable); the model's buffers are not included.
        MuondError (FAILED_PRECONDITION) between a sync cut off in the commits of a sharded outer
        session and its resend, when the shards are at two steps."""
        pending = self._sync_in_flight
        if pending is not None:
            self._wait_for_answer(pending)
        self._check_no_cut_off("state_dict")
        meta = {"format": _STATE_FORMAT, "session": self.remote.session_id,
                "outer_step": self.remote.last_step, "inner_steps": self.inner_steps,
                "tokens": self.tokens, "tokens_since_sync": list(self._since_sync),
                "sync_every": self.sync_every, "fragments": self.fragments,
                "names": list(self.names), "rank": self.remote.rank,
                "world_size": self.remote.world_size, "wire_dtype": self.wire_dtype,
                "overlap_steps": self.overlap_steps, "merge_alpha": self.merge_alpha,
                "pending_merge": None if pending is None else {
                    "fragment": pending.fragment, "step": pending.sent,
                    "lands_at": pending.lands_at, "whole": pending.whole,
                    "realign": pending.realign}}
        return {"diloco": meta, "inner": self.inner.state_dict(),
                "global": {n: g.detach().clone() for n, g in zip(self.names, self._globals)},
                "local": {n: p.detach().clone() for n, p in zip(self.names, self._params)},
                "error_feedback": {self.names[i]: e.clone() for i, e in self._feedback.items()}}

    def _check_no_cut_off(self, call: str) -> None:
        """MuondError (FAILED_PRECONDITION) while the outer session's shards are at two steps: a
        sync cut off in its commits, which the next sync sends again (docs/diloco.md)."""
        step = self.remote.cut_off_step
        if step is not None:
            raise MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{call}: outer step {step} was cut off in the shards' commits (some "
                             f"applied it); the next sync sends it again: call {call} after it",
                             "DiLoCo")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``'s state onto this worker, attached to the same session at the
        same outer step (ValueError otherwise, before anything changes). Not for an asynchronous
        worker (ValueError): its session moves on without it. MuondError (FAILED_PRECONDITION)
        between a sync cut off in a sharded outer session's commits and its resend."""
        if self.asynchronous:
            raise ValueError("load_state_dict: an asynchronous DiLoCo worker does not resume from a "
                             "state dict (the session moves on without it); start it afresh: it "
                             "attaches and takes the session's latest parameters")
        meta = state_dict.get("diloco") if isinstance(state_dict, Mapping) else None
        if not meta or meta.get("format") != _STATE_FORMAT:
            raise ValueError("not a DiLoCo state dict (no 'diloco' section of format 1)")
        # States saved before these keys existed: what they meant then.
        saved = {"wire_dtype": "fp32", "overlap_steps": 0, "merge_alpha": 0.0, **meta}
        for key, mine in (("names", self.names), ("sync_every", self.sync_every),
                          ("fragments", self.fragments), ("wire_dtype", self.wire_dtype),
                          ("overlap_steps", self.overlap_steps),
                          ("merge_alpha", self.merge_alpha)):
            if saved[key] != mine:
                raise ValueError(f"{key}: the state dict has {saved[key]}, this worker {mine}")
        self._check_no_cut_off("load_state_dict")
        if self._sync_in_flight is not None:
            raise ValueError(f"load_state_dict: this worker's sync of fragment "
                             f"{self._sync_in_flight.fragment} is in flight; load a state dict "
                             f"before the first step()")
        if meta["outer_step"] != self.remote.last_step:
            raise ValueError(
                f"the state dict was saved after outer step {meta['outer_step']}, the session "
                f"'{self.remote.session_id}' is at step {self.remote.last_step}: resume every "
                f"worker from states saved at the same step, on the session they were saved from "
                f"(a daemon with --state-dir keeps it across restarts)")
        self._check_state_tensors(state_dict, saved)
        saved_globals = state_dict["global"]
        for name, g in zip(self.names, self._globals):
            if not torch.equal(saved_globals[name].to(g.device, g.dtype), g):
                raise ValueError(f"the state dict's global value of '{name}' differs from the "
                                 f"session's: it was saved from another session or run")
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for name, p in zip(self.names, self._params):
                p.copy_(state_dict["local"][name])
        index = {name: i for i, name in enumerate(self.names)}
        self._feedback = {index[name]: e.to(self._params[index[name]].device, torch.float32).clone()
                          for name, e in state_dict.get("error_feedback", {}).items()}
        self.inner_steps = int(meta["inner_steps"])
        self.tokens = float(meta["tokens"])
        self._since_sync = [float(t) for t in meta["tokens_since_sync"]]
        self._failed = None  # a sync that failed before the load is not this state's
        self._failed_rounding = None
        merge = saved.get("pending_merge")
        if merge is not None:  # answered before the save, merged after overlap_steps inner steps
            sync = _Sync(int(merge["fragment"]), int(merge["step"]), 0.0, int(merge["lands_at"]))
            sync.answered, sync.whole = True, bool(merge["whole"])
            sync.realign = bool(merge.get("realign", False))
            self._sync_in_flight = sync

    def _check_state_tensors(self, state_dict: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
        """ValueError, before anything changes, for a state dict of another worker or one whose
        parts are missing or of other shapes."""
        for key, mine in (("rank", self.remote.rank), ("world_size", self.remote.world_size)):
            if key in saved and saved[key] != mine:
                raise ValueError(f"{key}: the state dict is of a worker with {key} {saved[key]}, "
                                 f"this worker has {mine}: each worker resumes from its own state")
        since = saved.get("tokens_since_sync")
        if not isinstance(since, (list, tuple)) or len(since) != self.fragments:
            raise ValueError(f"tokens_since_sync: the state dict needs one count per fragment "
                             f"({self.fragments}), got {since!r}")
        for key in ("inner", "global", "local"):
            if not isinstance(state_dict.get(key), Mapping):
                raise ValueError(f"{key}: the state dict has no '{key}' section")
        for key in ("global", "local"):
            for name, p in zip(self.names, self._params):
                value = state_dict[key].get(name)
                if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise ValueError(f"{key}['{name}']: the state dict needs a tensor of shape "
                                     f"{tuple(p.shape)}, got {got!r}")
        shapes = dict(zip(self.names, (p.shape for p in self._params)))
        for name, value in state_dict.get("error_feedback", {}).items():
            if name not in shapes or not isinstance(value, torch.Tensor) or \
                    value.shape != shapes[name]:
                raise ValueError(f"error_feedback['{name}']: not a tensor of one of this worker's "
                                 f"parameters' shapes")

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self, keep_session: bool = False) -> None:
        """Closes the ``RemoteOptimizer`` (rank 0 ends the session unless ``keep_session``),
        after a sync in flight has been answered. Its merge does not happen (``finish_sync``
        first for it), and its error, if it failed, is logged."""
        pending, self._sync_in_flight = self._sync_in_flight, None
        if pending is not None and pending.thread is not None:
            pending.thread.join()
            if pending.error is not None:
                _log.warning("DiLoCo rank %d: the sync of fragment %d in flight at close failed: "
                             "%s", self.remote.rank, pending.fragment, pending.error)
        self.remote.close(keep_session=keep_session)

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
