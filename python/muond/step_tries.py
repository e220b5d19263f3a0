"""``StepTries``: how ``RemoteOptimizer`` runs one step: every try and retry of it, over one daemon
or prepared and committed over the shards of a sharded session, and what its answer leaves in the
optimizer (``last_step``, ``last_info``, ``pushes``, ``stale_pushes``, ``loss_scale``).

A mixin on the protocol ``OptimizerCore`` (optimizer_core.py): ``RemoteOptimizer.step`` builds the
header and reads the gradients, then calls ``_run_step``; the retries resend the same step number,
which the daemon answers without a second update (docs/protocol.md). Its one state of its own is
``_cut_off``: a sharded step that failed once some shard may have applied it, kept to be sent again.
Used from the optimizer's thread, or from the delayed update's sender thread for a delayed step
(one step at a time: ``DelayedUpdate`` lands a step before the next is submitted).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import grpc
import torch

from . import shard_step, wire
from .shard_step import CutOffStep
from ._stubs import pb
from .errors import PUSH_TOO_STALE, STEP_NOT_PREPARED, MuondError, after_tries, on_later_try
from .step_info import StepInfo, rank_report
from .transport.daemon_session import StreamedStep
from .transport.streamed import IdentityChanged

# A step that failed with these may have been applied or not; the daemon answers a resend of the
# same step number without a second update, so resending is safe.
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_log = logging.getLogger("muond")


if TYPE_CHECKING:  # the members of RemoteOptimizer this mixin uses (optimizer_core.py)
    from .optimizer_core import OptimizerCore as _Core
else:
    _Core = object


class StepTries(_Core):
    """The tries and answers of a step, half of ``RemoteOptimizer``'s step (see the module's
    docstring)."""

    def _run_step(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]],
                  streamed: Optional[StreamedStep], rest: Optional[List[Tuple[str, torch.Tensor]]],
                  out: Optional[Dict[str, torch.Tensor]], weight: Optional[float]
                  ) -> Callable[[], None]:
        """The step ``header`` with ``grads``, every try and retry; returns what notes its answer
        (``last_step``, ``last_info``), to call once its parameters are in the model.
        The first try finishes ``streamed`` when there is one (sending ``rest`` first, unless
        None: sent already); the others, and a stream begun as another step, send ``grads``.
        The parameters go into ``out`` (None: the model).
        Over several daemons, a step that failed once some shard may have applied it is kept
        (``_cut_off``), and the next step of its number is sent as it (``_resend_of_cut_off``)."""
        header, grads, weight = self._resend_of_cut_off(header, grads, weight)
        may_be_applied = False

        def may_apply() -> None:
            nonlocal may_be_applied
            may_be_applied = True

        def plain() -> pb.StepResult:
            if len(self._sessions) == 1:
                return self._sessions[0].step(header, grads, out)
            return self._sharded_step(header, self._grads_by_session(grads), out, may_apply)

        def once() -> Optional[pb.StepResult]:
            nonlocal streamed
            first, streamed = streamed, None
            try:
                if first is None:
                    return plain()
                try:
                    if rest is not None:
                        first.send_rest(header, rest)
                except IdentityChanged:
                    return plain()
                if self._forward is not None and out is None:
                    answered, self._answer_landing = first.answer()
                else:
                    answered = first.result()
                self.streamed_steps += 1
                return answered
            except MuondError as err:
                if self._async and err.reason == PUSH_TOO_STALE:
                    return None
                raise

        try:
            result, seconds, attempts = self._try_step(once)
        except BaseException:
            if may_be_applied:
                self._keep_cut_off(header, grads, weight)
            raise
        finally:
            if streamed is not None:
                streamed.cancel()
        self._cut_off = None
        if result is not None:
            self._answered_step = int(result.step)

        def note() -> None:
            self._answered_step = None
            if not self._async:
                self._stepped(header, result, seconds, attempts, weight)
            elif result is None:
                self._dropped_as_stale(header, seconds, attempts)
            else:
                self._pushed(header, result, seconds, attempts, weight)
        return note

    @property
    def cut_off_step(self) -> Optional[int]:
        """The number of a sharded step that failed once some shard may have applied it (its
        commit went out; with several ranks, its prepare), which the next step() sends again as it
        was (docs/sharding.md, A failed step); None when there is none. Until then the shards may
        be at two steps."""
        return None if self._cut_off is None else int(self._cut_off.header.step)

    def _resend_of_cut_off(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]],
                           weight: Optional[float]
                           ) -> Tuple[pb.StepHeader, List[Tuple[str, torch.Tensor]], Optional[float]]:
        """The step to send for ``header``: itself, or, when a sharded step of its number was cut
        off (it failed once some shard may have applied it), that step, with its gradients and
        options. Some
        shards may have committed it: they answer the resend with the decision they applied, and
        the others must commit that decision with the gradients it was computed from, not this
        call's (docs/sharding.md, A failed step). This call's gradients are not used, as when one
        daemon answers a resend of a step it applied."""
        cut_off = self._cut_off
        if cut_off is None or cut_off.header.step != header.step:
            return header, grads, weight
        if cut_off.grads is None:
            raise MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"session '{self.session_id}': step {header.step} failed once some "
                             f"shards may have applied it, and its gradients could not be kept to "
                             f"send it again; "
                             f"restore every shard to one step (load_state_dict of a saved "
                             f"state_dict) before training on", "Step")
        _log.warning("session %s: step %d failed once some shards may have applied it; it is "
                     "sent again with its own gradients and options (this call's gradients are "
                     "not used)", self.session_id, header.step)
        return cut_off.header, cut_off.grads, cut_off.weight

    def _keep_cut_off(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]],
                      weight: Optional[float]) -> None:
        """Keeps a sharded step that failed once some shard may have applied it, for the next step
        of its number: copies of its gradients, which the trainer's next backward overwrites."""
        if self._cut_off is not None:
            # Kept already: this step's resend failed too, or this step failed while an earlier
            # one is kept, which must still be sent with its own gradients.
            return
        try:
            with torch.no_grad():
                kept: Optional[List[Tuple[str, torch.Tensor]]] = [
                    (name, g.detach().clone()) for name, g in grads]
        except Exception as err:  # noqa: BLE001 - the step's own failure is the one raised
            # Out of memory, say: the step is still kept, so that its number is never sent with
            # other gradients (the next step of it is refused instead).
            _log.error("session %s: step %d failed once some shards may have applied it, and its "
                       "gradients cannot be kept (%s): the next step of its number is refused",
                       self.session_id, header.step, err)
            kept = None
        self._cut_off = CutOffStep(header, kept, weight)

    def _stepped(self, header: pb.StepHeader, result: pb.StepResult, seconds: float,
                 attempts: int, weight: Optional[float]) -> None:
        """A step answered: the model holds the parameters after step ``result.step``."""
        # The answer's step, which a quorum session's answer to a rank it went on without (its
        # parameters are those after the session's last step) names: the next step follows it.
        self.last_step = result.step
        report = rank_report(result, self.sync.mode == "quorum")
        included = report[2]
        self.last_info = StepInfo.of_result(result, seconds=seconds, attempts=attempts,
                                            count_zeros=self.log_num_zeros_in_grad,
                                            scaled=self.loss_scaler is not None, ranks=report)
        if self.loss_scaler is not None:
            self.loss_scale = result.loss_scale
        if not included:
            _log.info("session %s: step %d went on without rank %d (it sent step %d); the "
                      "parameters are those after step %d, the next step is %d", self.session_id,
                      result.step, self.rank, header.step, result.step, result.step + 1)
        if not result.contributors and not result.replayed:  # a new step: an older daemon
            self._warn_old_daemon(weight)

    def _pushed(self, header: pb.StepHeader, result: pb.StepResult, seconds: float, attempts: int,
                weight: Optional[float]) -> None:
        """An asynchronous push answered: applied as global step ``result.global_step`` now, or
        before (a resend, answered from the rank's record). The model holds the parameters after
        global step ``result.step`` (the latest), the base of the next push."""
        self.pushes = int(header.step)
        self.last_step = int(result.step)
        if result.replayed:
            # The answer carries the push's own outcome from the rank's record (docs/ranks.md,
            # Resends): this rank's push, alone.
            report = ((self.rank,), 1.0 if weight is None else weight, True)
        else:
            report = rank_report(result, False)[:2] + (True,)
        self.last_info = StepInfo.of_result(result, seconds=seconds, attempts=attempts,
                                            count_zeros=self.log_num_zeros_in_grad,
                                            scaled=self.loss_scaler is not None, ranks=report,
                                            asynchronous=True)
        if self.loss_scaler is not None:
            self.loss_scale = result.loss_scale

    def _dropped_as_stale(self, header: pb.StepHeader, seconds: float, attempts: int) -> None:
        """An asynchronous push refused as too stale (PUSH_TOO_STALE): nothing was applied and its
        push number stays free. The model takes the session's latest parameters, which become
        the base of the next push."""
        self.last_step = self._sessions[0].refresh()
        self.stale_pushes += 1
        staleness = self.last_step - int(header.base_step)
        self.last_info = StepInfo.stale_push(self.last_step, staleness, seconds=seconds,
                                             attempts=attempts, loss_scale=self.loss_scale)
        _log.info("session %s: rank %d's push %d was computed on global step %d, %d global steps "
                  "behind, more than max_staleness %d: its gradients were dropped; the model "
                  "holds the parameters of global step %d now", self.session_id, self.rank,
                  header.step, header.base_step, staleness, self.sync.max_staleness,
                  self.last_step)

    def _warn_old_daemon(self, weight: Optional[float]) -> None:
        """Says once that a daemon that reports no contributors (older than weights and quorum
        steps) ignored what this optimizer asked of them."""
        if self._warned_old_daemon or (weight is None and self.sync.mode == "lockstep"):
            return
        self._warned_old_daemon = True
        _log.warning("session %s: the daemon reports no contributors (a version without weights "
                     "or quorum steps): it ignored step(weight=) and sync_mode=%r and averaged "
                     "every rank's gradients in lock-step", self.session_id, self.sync.mode)

    def _grads_by_session(self, grads: List[Tuple[str, torch.Tensor]]
                       ) -> List[List[Tuple[str, torch.Tensor]]]:
        by_session: List[List[Tuple[str, torch.Tensor]]] = [[] for _ in self._sessions]
        for name, g in grads:
            by_session[self.placement.shard_of[self._index[name]]].append((name, g))
        return by_session

    def _sharded_step(self, header: pb.StepHeader, by_session: List[List[Tuple[str, torch.Tensor]]],
                      out: Optional[Dict[str, torch.Tensor]] = None,
                      may_apply: Callable[[], None] = lambda: None) -> pb.StepResult:
        """One try of a step over every shard: prepare everywhere, decide, commit everywhere
        (``shard_step.py``). Safe to repeat as a whole after any failure, with the same
        gradients. ``may_apply`` is called before the first message that may have a shard apply
        this rank's gradients goes out: the first commit, or with several ranks the first prepare
        (a shard holds a rank's prepared part after its call ends, and another rank's commit
        applies it)."""
        prepares = [shard_step.prepare_header(header, session.by_name)
                    for session in self._sessions]
        if self.world_size > 1:
            may_apply()
        try:
            prepared = self._on_every_session(
                lambda k, session: session.step(prepares[k], by_session[k]))
        except MuondError as err:
            if err.code == grpc.StatusCode.FAILED_PRECONDITION and "header.step" in err.details:
                self._name_shards_behind(err)
            raise
        # Every shard took this step's prepare, so each is at the step before it or beyond: an
        # earlier kept step is applied everywhere, and a failure from here keeps this one.
        if self._cut_off is not None and self._cut_off.header.step < header.step:
            self._cut_off = None
        commit = shard_step.commit_header(
            header, shard_step.decide(prepared, self._indices_of, self._names))
        may_apply()
        committed = self._on_every_session(lambda k, session: session.step(commit, [], out))
        # Every shard answers the step it committed (lock-step only: a quorum session is never
        # sharded), so they agree; a disagreement is named rather than averaged away.
        step = self._common_step([int(r.step) for r in committed], "Step")
        return shard_step.result_of(commit, committed, step)

    def _name_shards_behind(self, refused: MuondError) -> None:
        """A prepare refused for its step number: when the shards are at different steps (a
        daemon restored to an older checkpoint), raises the error naming the shards behind
        instead (docs/sharding.md); returns when they are not, or cannot be asked."""
        try:
            steps = self._shard_steps()
        except MuondError:
            return
        if len(set(steps)) > 1:
            raise self._common_step_error(steps, "Step") from refused

    def _refuse_shards_at_two_steps(self, rpc: str) -> None:
        """Over several daemons, raises the FAILED_PRECONDITION naming the shards behind (or the
        kept step) when they are at different steps, before ``rpc`` writes anything: checkpoints
        of two steps restore to no step of the session. A shard without the session is left to
        ``rpc`` itself, which the daemon refuses with its reason."""
        if len(self._sessions) <= 1:
            return
        try:
            steps = self._shard_steps()
        except MuondError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise
            return
        self._common_step(steps, rpc)

    def _shard_steps(self) -> List[int]:
        """Each shard's last step, as its daemon lists the session; ``MuondError`` when a daemon
        cannot be asked or no longer holds the session."""
        steps = []
        for session in self._sessions:
            found = [s.last_step for s in session.conn.list_sessions()
                     if s.session_id == self.session_id]
            if not found:
                raise MuondError(grpc.StatusCode.NOT_FOUND,
                                 f"session '{self.session_id}' is not open on {session.conn.endpoint}",
                                 "ListSessions")
            steps.append(int(found[0]))
        return steps

    def _finish_cut_off_step(self, steps: List[int]) -> List[int]:
        """The shards' steps ``steps`` (as an attach found them) after finishing a step cut off
        mid-commit: a trainer that stopped between its commits leaves the shards that committed
        step k at k and the others at k - 1, holding k prepared. The shards ahead answer a resent
        prepare of k with the decision they applied (docs/sharding.md); the others commit k with
        it, as the trainer's own resend would have. ``steps`` unchanged when that is not the case
        (a shard further behind, one that lost its prepared step in a restart, one that does not
        know its decision): the shards then stay as they are, for the caller to refuse."""
        ahead = max(steps)
        if min(steps) != ahead - 1:
            return steps
        header = pb.StepHeader(session_id=self.session_id, step=ahead, rank=self.rank,
                               return_dtype=wire.dtype_enum(self.return_dtype),
                               max_chunk_bytes=self.chunk_bytes)
        done = [k for k, step in enumerate(steps) if step == ahead]
        try:  # every shard ahead applied the same decision: one of them says which
            replay = self._sessions[done[0]].step(shard_step.prepare_header(header, ()), [])
        except MuondError as err:
            _log.warning("session %s: step %d was committed on shards %s only, and shard %d "
                         "cannot say how it went: %s", self.session_id, ahead, done, done[0], err)
            return steps
        if not replay.replayed:
            return steps
        commit = shard_step.commit_header(header, shard_step.applied_decision(replay))
        finished = list(steps)
        for k, step in enumerate(steps):
            if step == ahead:
                continue
            try:
                result = self._sessions[k].step(commit, [])
            except MuondError as err:
                _log.warning("session %s: step %d was committed on shards %s only; shard %d (%s) "
                             "cannot commit it: %s", self.session_id, ahead, done, k,
                             self.endpoints[k], err)
                return finished
            self._sessions[k].loss_scale = float(result.loss_scale)
            finished[k] = ahead
        _log.warning("session %s: step %d was committed on shards %s only (its trainer stopped "
                     "between the commits); committed it on the others with their decision",
                     self.session_id, ahead, done)
        return finished

    def _try_step(self, once: Callable[[], Optional[pb.StepResult]]
                  ) -> Tuple[Optional[pb.StepResult], float, int]:
        """Runs ``once`` up to max_step_attempts times on transient failures (the same step
        number each time); returns (result, seconds, attempts). A sharded step is also tried
        again when a shard lost its prepared step (a restart between prepare and commit)."""
        started = time.perf_counter()
        backoff = self.retry_backoff
        before: Optional[MuondError] = None
        for attempt in range(1, self.max_step_attempts + 1):
            try:
                result = self._with_chunks_fitted(once)
                return result, time.perf_counter() - started, attempt
            except MuondError as err:
                lost_prepare = err.reason == STEP_NOT_PREPARED
                if err.code not in _RETRIED and not lost_prepare:
                    if before is None:
                        raise
                    raise on_later_try(err, attempt, before) from err
                if attempt == 1 == self.max_step_attempts:
                    raise
                if attempt == self.max_step_attempts:
                    raise after_tries(err, attempt) from err
                before = err
            pause = backoff
            self._on_every_session(lambda k, session: session.conn.pause_before_retry(pause))
            backoff *= 2
        raise AssertionError("unreachable")

