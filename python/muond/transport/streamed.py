"""Streamed tries: one try of a step whose gradients are handed over one at a time, as a backward
pass produces them, and whose options (``StepEnd``) are known only when it ends.

``StepTransport.begin_streamed(header, out)`` returns a ``StreamedTry`` for the step ``header``
names (its identity: session, step, rank, answer format; no options, no chunk count):

- ``add(name, grad)`` takes one gradient that is final for this step. It is called from backward
  hooks, so it must return quickly, and ``grad`` must stay unchanged until ``send_rest`` returns.
- ``send_rest(header, more)`` hands over the gradients not added yet and ends the input with the
  step's full header (the identity it began with, the options as they are now); once it returns,
  no gradient tensor is read again.
- ``result()`` waits for the answer: what ``StepTransport.step`` returns. The parameters go into
  ``out`` (None: the parameter tensors) or come back as views to copy.
- ``answer()`` waits for the step's result only: (the result, the values to copy as ``result()``
  gives them, a ``Landing`` of the parameters still arriving). A transport that receives the
  answer tensor by tensor (gRPC) returns as soon as the result is in and the parameters land after
  it, in the order the daemon sends them; the default waits for all of them (``result()``) and
  returns a landing already complete. Used by ``RemoteOptimizer(land_in_forward=)``.
- ``cancel()`` abandons the try: nothing of it is applied. Safe at any point, and more than once.

Whatever the ending, a try is ended by ``result()``, ``answer()`` or ``cancel()``. A header whose
identity differs from the one the try began with raises ``IdentityChanged`` from ``send_rest`` (the
caller cancels and runs an ordinary try). ``GatheredTry``, the default, only collects the gradients and
runs one ordinary try at the end: a transport that cannot start early still serves streamed steps.

Used by one thread at a time, except ``add``, which backward may call from its own thread.
"""

from __future__ import annotations

import abc
import threading
from typing import Dict, Iterable, List, Optional, Protocol, Set, Tuple

import torch

from .._stubs import pb

# One step's gradients: (parameter name, gradient) pairs.
Grads = List[Tuple[str, torch.Tensor]]


class OneTry(Protocol):
    """What a gathered try needs of its transport (base.StepTransport has it): one ordinary try."""

    def step(self, header: pb.StepHeader, grads: Grads, out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]: ...

# The StepHeader fields a streamed step gives in its StepEnd (docs/protocol.md, "Streamed steps").
OPTION_FIELDS = ("overrides", "max_grad_norm", "qk_logits", "grad_scale", "weight")


class IdentityChanged(Exception):
    """The step's header at the end names another step than the one the try began with."""


def identity_of(header: pb.StepHeader) -> pb.StepHeader:
    """``header`` without its options and chunk count: what a streamed try is begun with."""
    out = pb.StepHeader()
    out.CopyFrom(header)
    for field in OPTION_FIELDS + ("num_chunks",):
        out.ClearField(field)
    return out


def end_of(header: pb.StepHeader, num_chunks: int) -> pb.StepEnd:
    """The ``StepEnd`` carrying ``header``'s options after ``num_chunks`` chunks."""
    end = pb.StepEnd(num_chunks=num_chunks)
    end.overrides.extend(header.overrides)
    end.qk_logits.extend(header.qk_logits)
    for field in ("max_grad_norm", "grad_scale", "weight"):
        if header.HasField(field):
            setattr(end, field, getattr(header, field))
    return end


def check_identity(begun: pb.StepHeader, header: pb.StepHeader) -> None:
    """IdentityChanged unless ``header`` is the step ``begun`` (what the transport set on the
    begun header aside: the session id, streamed, packed_answer, answer_order)."""
    final = identity_of(header)
    final.session_id = begun.session_id
    final.streamed = begun.streamed
    final.packed_answer = begun.packed_answer
    final.answer_order[:] = begun.answer_order
    if final.SerializeToString(deterministic=True) != begun.SerializeToString(deterministic=True):
        raise IdentityChanged(f"the step began as step {begun.step} and ends as step {header.step}")


class Landing:
    """The parameters of an answered step arriving one tensor at a time, on the thread that
    receives them: ``arrived(name)`` once a tensor is wholly written where it belongs, then
    ``end(failure)`` when the answer is over (``failure`` None: every tensor came). The trainer
    waits with ``wait(names)``; the first failure is raised by every wait after it is known.

    A tensor said to have arrived is never written again by this answer."""

    def __init__(self, names: Iterable[str]):
        self._cond = threading.Condition()
        self._order = list(names)
        self._missing: Set[str] = set(self._order)
        self._total = len(self._missing)
        self._ended = False
        self._failure: Optional[BaseException] = None

    @classmethod
    def landed(cls) -> "Landing":
        """A landing with nothing left to arrive."""
        done = cls(())
        done._ended = True
        return done

    def arrived(self, name: str) -> None:
        with self._cond:
            self._missing.discard(name)
            self._cond.notify_all()

    def end(self, failure: Optional[BaseException] = None) -> None:
        with self._cond:
            if self._ended:
                return
            self._ended = True
            if failure is None:
                self._missing.clear()  # a tensor the answer left out keeps its value
            elif self._missing:  # a failure after the last tensor left nothing behind
                self._failure = failure
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Whether the answer is over (every tensor in, or a failure)."""
        with self._cond:
            return self._ended

    @property
    def failure(self) -> Optional[BaseException]:
        with self._cond:
            return self._failure

    def missing(self) -> List[str]:
        """The tensors that have not arrived (after a failure: the ones that never will), in the
        order they were named."""
        with self._cond:
            return [name for name in self._order if name in self._missing]

    @property
    def total(self) -> int:
        return self._total

    def wait(self, names: Optional[Iterable[str]] = None) -> None:
        """Waits until ``names`` (None: all) have arrived or the answer is over; raises the
        failure once one is known."""
        wanted = None if names is None else set(names)
        with self._cond:
            while not self._ended and (self._missing if wanted is None
                                       else not wanted.isdisjoint(self._missing)):
                self._cond.wait()
            if self._failure is not None:
                raise self._failure


class StreamedTry(abc.ABC):
    """One streamed try (see the module's docstring)."""

    @abc.abstractmethod
    def add(self, name: str, grad: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def send_rest(self, header: pb.StepHeader, more: Grads) -> None: ...

    @abc.abstractmethod
    def result(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def cancel(self) -> None: ...

    def answer(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor], Landing]:
        """The result as soon as it is in, the values to copy, and the parameters' landing (see
        the module's docstring). By default the whole answer is waited for."""
        result, values = self.result()
        return result, values, Landing.landed()

    def finish(self, header: pb.StepHeader, more: Grads
               ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """``send_rest`` then ``result``; cancelled when ``send_rest`` fails."""
        try:
            self.send_rest(header, more)
        except BaseException:
            self.cancel()
            raise
        return self.result()


class GatheredTry(StreamedTry):
    """Collects the gradients and runs one ordinary try of ``transport`` when the input ends. The
    gradients are copied when added, so the trainer may change them afterwards."""

    def __init__(self, transport: OneTry, header: pb.StepHeader,
                 out: Optional[Dict[str, torch.Tensor]]):
        self._transport = transport
        self._begun = identity_of(header)
        self._out = out
        self._grads: List[Tuple[str, torch.Tensor]] = []
        self._header: Optional[pb.StepHeader] = None

    def add(self, name: str, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self._grads.append((name, grad.detach().clone()))

    def send_rest(self, header: pb.StepHeader, more: Grads) -> None:
        check_identity(self._begun, header)
        with torch.no_grad():
            self._grads.extend((name, g.detach().clone()) for name, g in more)
        self._header = header

    def result(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        if self._header is None:
            raise RuntimeError("a streamed try's result was asked for before its input ended")
        header, grads = self._header, self._grads
        self._header, self._grads = None, []
        return self._transport.step(header, grads, self._out)

    def cancel(self) -> None:
        self._header, self._grads = None, []
