"""``GradientStream``: a ``RemoteOptimizer``'s gradients sent while backward is still running.

With ``overlap=True`` every parameter gets a hook that runs once backward has accumulated its
gradient (torch's post-accumulate-grad hook; on torch < 2.1 a hook on the parameter's
AccumulateGrad node, kept alive here as DDP keeps its own). The first such hook of a step opens a
streamed try (``transport/streamed.py``) through ``begin``; each hook adds its parameter's gradient;
``take()`` hands the open try to ``opt.step()``, which adds the gradients no hook sent and ends it.

What ``step()`` then sends must equal what a plain step would, bit for bit. So ``take()`` reports
each sent gradient with the tensor and the version counter it had, and the step falls back to a
plain try (cancelling the stream: nothing of it is applied) when any of them changed since — the
trainer clipped or unscaled ``.grad`` by hand, or ran a second backward without ``no_sync()`` —
or when a parameter was sent whose gradient is gone. Within ``no_sync()`` (gradient accumulation
over micro-batches, like DDP's) nothing is sent; the backward after it sends the sums.

``observe``, when given, is told every parameter whose gradient backward accumulated, inside
``no_sync()`` too (``RemoteOptimizer(land_in_forward=)`` checks there that a forward waited for
each parameter it used).

The hooks run on backward's threads; a lock orders them against ``take()`` and ``cancel()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

_log = logging.getLogger("muond")

# (the gradient tensor, its version counter) as it was when it was sent
Sent = Dict[str, Tuple[torch.Tensor, int]]


class GradientStream:
    """Hooks on ``params`` (names and tensors, in the optimizer's order) that feed the streamed
    try ``begin()`` opens (an object with ``add``, ``send_rest``, ``result`` and ``cancel``)."""

    def __init__(self, params: Sequence[Tuple[str, torch.Tensor]], begin: Callable[[], Any],
                 observe: Optional[Callable[[str], None]] = None):
        self._begin = begin
        self._observe = observe
        self._lock = threading.Lock()
        self._syncing = True
        self._open: Optional[Any] = None
        self._sent: Sent = {}
        self._broken = ""  # why this step's stream cannot be used (a plain try then)
        self._handles: List[Any] = []
        self._accumulators: List[Any] = []  # torch < 2.1: the AccumulateGrad nodes hooked
        for name, param in params:
            if param.requires_grad:
                self._hook(name, param)

    def _hook(self, name: str, param: torch.Tensor) -> None:
        def on_grad(*_: Any) -> None:
            self._on_gradient(name, param)
        if hasattr(param, "register_post_accumulate_grad_hook"):
            self._handles.append(param.register_post_accumulate_grad_hook(on_grad))
            return
        accumulator = param.view_as(param).grad_fn.next_functions[0][0]
        self._handles.append(accumulator.register_hook(on_grad))
        self._accumulators.append(accumulator)

    def _on_gradient(self, name: str, param: torch.Tensor) -> None:
        if self._observe is not None:
            self._observe(name)
        grad = param.grad
        with self._lock:
            if not self._syncing or self._broken or grad is None:
                return
            if name in self._sent:
                self._break(f"'{name}' received a second gradient in one step (a second "
                            "backward without no_sync())")
                return
            try:
                if self._open is None:
                    self._open = self._begin()
                self._open.add(name, grad)
            except Exception as err:  # noqa: BLE001 - the step sends them plainly instead
                self._break(f"the stream could not take '{name}': {err}")
                return
            self._sent[name] = (grad, grad._version)

    def _break(self, why: str) -> None:
        """Gives up this step's stream (called under the lock)."""
        self._broken = why
        if self._open is not None:
            opened, self._open = self._open, None
            opened.cancel()

    @property
    def in_flight(self) -> int:
        """How many gradients of the coming step have been handed to the daemon so far."""
        with self._lock:
            return len(self._sent)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside send nothing: their gradients accumulate for a later one."""
        with self._lock:
            before, self._syncing = self._syncing, False
        try:
            yield
        finally:
            with self._lock:
                self._syncing = before

    def take(self, grads: Sequence[Tuple[str, torch.Tensor]]
             ) -> Tuple[Optional[Any], List[Tuple[str, torch.Tensor]], str]:
        """At ``step()``, with the gradients a plain step would send: (the open try or None, the
        gradients still to send through it, why it cannot be used — "" when it can). A try that
        cannot be used is already cancelled. The stream starts afresh for the next step."""
        with self._lock:
            opened, sent, broken = self._open, self._sent, self._broken
            self._open, self._sent, self._broken = None, {}, ""
        if opened is None:
            return None, list(grads), broken
        now = dict(grads)
        # The version counter sees edits through the tensor, its views and detach(); not through
        # .data, which counts its own (docs/overlap.md says so).
        changed = [name for name, (grad, version) in sent.items()
                   if now.get(name) is not grad or grad._version != version]
        if changed:
            opened.cancel()
            return None, list(grads), (f"the gradient of '{changed[0]}' changed after backward "
                                       "had produced it")
        return opened, [(name, g) for name, g in grads if name not in sent], ""

    def cancel(self) -> None:
        """Abandons the step's stream, if one is open (close, or a step that failed before it)."""
        with self._lock:
            self._break("cancelled")
            self._sent, self._broken = {}, ""

    def remove(self) -> None:
        """Removes the hooks (close)."""
        self.cancel()
        for handle in self._handles:
            handle.remove()
        self._handles, self._accumulators = [], []
