"""``StreamControls``: ``RemoteOptimizer``'s controls of overlapped and delayed steps — the
streamed try backward opens (``overlap=True``), ``no_sync``, ``gradients_in_flight``, ``flush``,
``zero_grad`` (which cancels a stream no step took) and the read-back after a failed landing
(docs/overlap.md).

A mixin on the protocol ``OptimizerCore`` (optimizer_core.py): it uses the optimizer's sessions,
header, stream (``GradientStream``), delayed update (``DelayedUpdate``) and forward landing
(``ForwardLanding``), and has no state of its own. Used from the optimizer's thread; ``_begin_stream`` also from backward's first gradient hook.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ContextManager, List, Optional, Tuple

import torch

from . import wire
from .transport.daemon_session import StreamedStep, copy_in

_log = logging.getLogger("muond")


if TYPE_CHECKING:  # the members of RemoteOptimizer this mixin uses (optimizer_core.py)
    from .optimizer_core import OptimizerCore as _Core
else:
    _Core = object


class StreamControls(_Core):
    """The overlap-and-delay half of ``RemoteOptimizer`` (see the module's docstring)."""

    def _answer_first(self) -> List[str]:
        """The parameters a streamed answer should bring first: with ``land_in_forward``, in the
        order the model's forward uses them (``ForwardLanding.answer_first``); else none."""
        forward = self._forward
        return forward.answer_first() if forward is not None else []

    def _begin_stream(self) -> StreamedStep:
        """A streamed try of the coming step, opened by backward's first gradient (overlap). A
        delayed step still in flight is waited for first: the daemon takes steps in order."""
        delayed = self._delay_now()
        if delayed:
            self._delayed.wait()
        out = self._delayed.staging() if delayed else None
        return self._sessions[0].begin_streamed(self._header(self._next_number(), {}), out)

    def _take_stream(self, grads: List[Tuple[str, torch.Tensor]]
                     ) -> Tuple[Optional[StreamedStep], List[Tuple[str, torch.Tensor]]]:
        """The streamed try backward opened for this step, if it can be used, and the gradients
        it has yet to get."""
        if self._stream is None:
            return None, grads
        streamed, rest, why = self._stream.take(grads)
        if why and streamed is None:
            _log.debug("session %s: step %d sends every gradient at once: %s", self.session_id,
                       self._next_number(), why)
        return streamed, rest

    @property
    def gradients_in_flight(self) -> int:
        """With ``overlap=True``: the gradients of the coming step that backward has handed to
        the daemon so far (0 after ``step()``)."""
        return self._stream.in_flight if self._stream is not None else 0

    def _cancel_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``zero_grad``; with ``overlap=True`` it also cancels what backward streamed
        of a step that was not taken (a backward or a step that raised): those gradients are
        gone, and the next backward streams its own."""
        self._cancel_stream()
        super().zero_grad(*args, **kwargs)

    def no_sync(self) -> ContextManager[None]:
        """With ``overlap=True``: backward passes inside send no gradient (accumulate
        micro-batches inside it, all but the last, as with DDP's ``no_sync``). Without overlap
        it does nothing."""
        return self._stream.no_sync() if self._stream is not None else contextlib.nullcontext()

    def flush(self) -> None:
        """With ``delay``: waits for the step in flight and copies its parameters into the model
        (before evaluating, say); raises that step's failure. With ``land_in_forward``: waits
        until every parameter of the last step has landed (before reading parameters outside
        the model's forward); raises a failed landing. Nothing otherwise."""
        self._check_open()
        if self._delayed is not None:
            self._delayed.land()
        if self._forward is not None:
            self._forward.wait_all()

    def _read_back_parameters(self) -> None:
        """Reads every parameter from the daemon in the answers' dtype, as a step's answer
        would have brought them (after a landing that failed)."""
        session = self._sessions[0]
        into = wire.ChunkAssembler(session.sizes, self.return_dtype)
        session.conn.get_parameters(session.session_id, into,
                                    dtype=wire.dtype_enum(self.return_dtype),
                                    max_chunk_bytes=self.chunk_bytes)
        copy_in(session.by_name, {name: t for (name, _), t in into.tensors().items()})
