"""``ForwardLanding``: a step's parameters landing while the model's next forward runs
(``RemoteOptimizer(overlap=True, land_in_forward=model)``, docs/overlap.md).

The step's answer is a ``StepResult`` followed by every parameter, in the order ``answer_first``
asks the daemon for (the order the modules ran forward, as first seen); with this mode ``step()``
returns once the result is in, and the parameters arrive on the answer's receiving
thread afterwards (a ``transport.streamed.Landing``). ZeRO-3 prefetches its parameters the same
way: each module of the model gets a forward pre-hook that waits for the parameters the module
itself holds, so a module's forward starts as soon as its own parameters are in while the later
ones are still on the way.

What waits, and for what:

- a module's forward (its pre-hook): the parameters it holds directly;
- ``step()`` as it returns: the parameters that no module of the model holds (they have no
  forward to wait in);
- every call that reads or writes parameters through the optimizer — the next ``step()``,
  ``flush()``, ``state_dict()``, ``load_state_dict()``, ``checkpoint()``, ``state_digest()``,
  ``close()`` — and interpreter exit (the receiving thread is an ordinary one): all of them.

A parameter read anywhere else before its module's next forward may be stale or half written: that
is this mode's contract, and why it is an opt-in. One such read is caught, whatever the timing: a
parameter held by a module that gets a gradient although no forward of that module (and no
``flush()``) waited for it since the step — the weight of a module that is never called, used by
another module's forward, say — may have been read before it landed, and the next ``step()``
refuses to send the step (RuntimeError naming it; nothing of the step is applied). The check does
not depend on whether the parameters happened to be in already, so a trainer learns of such a use
at its first step, on every transport.

A failure of the answer after its result (a broken connection mid-return) fails the landing: the
next wait raises it (a ``MuondError`` with the failure's code, naming the step and the first
parameter cut off), after reading every parameter back from the daemon with ``GetParameters`` (the
step is applied there), so the model holds the step's parameters once more when the trainer goes
on. Should that read fail too, the error says so and every later wait tries it again before going
on. Nothing proceeds on a model that holds parts of two steps.

Used from the optimizer's thread; ``observe`` also from backward's threads.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

import torch

from .errors import MuondError
from .transport.streamed import Landing


def check_land_in_forward(model: Any, overlap: bool, delay: int, sync_mode: str) -> None:
    """ValueError / TypeError naming ``land_in_forward`` when it cannot be used as given."""
    if model is None:
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"land_in_forward: must be the model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    if not overlap:
        raise ValueError("land_in_forward: needs overlap=True (the answer lands on the streamed "
                         "step's receiving thread)")
    if delay:
        raise ValueError("land_in_forward: not with delay (a delayed step's parameters land at "
                         "the next step() already)")
    if sync_mode == "async":
        raise ValueError("land_in_forward: not with sync_mode='async' (a push dropped as too "
                         "stale reads the parameters back instead)")


class ForwardLanding:
    """Forward pre-hooks on ``model``'s modules for the parameters ``by_name`` (the optimizer's
    names and tensors); ``read_back()`` reads every parameter from the daemon after a failure."""

    def __init__(self, model: torch.nn.Module, by_name: Dict[str, torch.Tensor],
                 read_back: Callable[[], None]):
        self._read_back = read_back
        self._lock = threading.Lock()
        self._landing: Optional[Landing] = None
        self._step = 0
        self._unwaited: Set[str] = set()  # held by a module whose forward has not waited yet
        self._misused: Dict[str, None] = {}  # given a gradient while unwaited (ordered)
        self._needs_read_back = False
        self._handles: List[Any] = []
        self._forward_order: Dict[str, None] = {}  # held parameters, by their module's first forward
        name_of = {id(p): name for name, p in by_name.items()}
        held: Dict[str, None] = {}
        for module in model.modules():
            names = list(dict.fromkeys(name_of[id(p)] for p in module._parameters.values()
                                       if p is not None and id(p) in name_of))
            held.update(dict.fromkeys(names))
            if names:
                self._handles.append(module.register_forward_pre_hook(
                    self._hook(names)))
        self._held = list(held)
        # Parameters of the optimizer that no module of the model holds: landed by step().
        self.unheld = [name for name in by_name if name not in held]

    def _hook(self, names: List[str]) -> Callable[..., None]:
        recorded = []  # non-empty once this module's forward has run

        def before_forward(module: torch.nn.Module, inputs: Any) -> None:
            if not recorded:
                recorded.append(True)
                with self._lock:
                    self._forward_order.update(dict.fromkeys(names))
            if self._landing is None and not self._needs_read_back:
                return
            self._wait(names)
        return before_forward

    def answer_first(self) -> List[str]:
        """The parameters in the order the trainer wants them back (``StepHeader.answer_order``):
        those no module holds (``step()`` waits for them), then the others in the order their
        modules first ran forward. Parameters of modules that never ran are left to the daemon's
        order, after these."""
        with self._lock:
            seen = list(self._forward_order)
        return self.unheld + seen

    @property
    def in_flight(self) -> bool:
        """Whether parameters of the last step may still be arriving."""
        return self._landing is not None and not self._landing.done

    def begin(self, landing: Landing, step: int) -> None:
        """Step ``step`` answered; its parameters arrive through ``landing`` (one already
        complete when the answer came whole). Waits for the parameters no module holds."""
        self._landing, self._step = landing, step
        with self._lock:
            self._unwaited = set(self._held)
            self._misused.clear()
        if self.unheld:
            self._wait(self.unheld)

    def wait_all(self) -> None:
        """Waits until every parameter has landed (raising a failed landing, see the module's
        docstring)."""
        if self._landing is None and not self._needs_read_back:
            return
        self._wait(None)
        self._landed()

    def _landed(self) -> None:
        self._landing = None
        with self._lock:
            self._unwaited.clear()

    def _wait(self, names: Optional[Iterable[str]]) -> None:
        if self._needs_read_back:
            self._read_back()  # raises again while the daemon cannot be read
            self._needs_read_back = False
        landing = self._landing
        if landing is None:
            return
        try:
            landing.wait(names)
        except BaseException as failure:  # noqa: BLE001 - raised below, described
            self._landed()
            raise self._failed(landing, failure) from failure
        if names is not None:
            with self._lock:
                self._unwaited.difference_update(names)

    def _failed(self, landing: Landing, failure: BaseException) -> BaseException:
        """The error a failed landing raises, once the parameters were read back (or not)."""
        missing = landing.missing()
        try:
            self._read_back()
            after = "every parameter was read back from the daemon, where the step is applied"
        except BaseException as err:  # noqa: BLE001 - named in the error; tried again later
            self._needs_read_back = True
            after = (f"reading them back from the daemon failed too ({err}); the next wait "
                     f"tries again before anything goes on")
        what = (f"the parameters after step {self._step} did not all land: {len(missing)} of "
                f"{landing.total} cut off, first '{missing[0]}'; {after}")
        if isinstance(failure, MuondError):
            return MuondError(failure.code, f"{what}: {failure.details}", failure.rpc or "Step",
                              failure.reason)
        return RuntimeError(f"{what}: {failure!r}")

    def observe(self, name: str) -> None:
        """Backward accumulated a gradient of ``name`` (from ``GradientStream``)."""
        with self._lock:
            if name in self._unwaited:
                self._misused.setdefault(name)

    def check_use(self) -> None:
        """RuntimeError when a forward since the last step used a parameter it did not wait for
        (see the module's docstring); the record starts afresh."""
        with self._lock:
            misused, self._misused = list(self._misused), {}
        if misused:
            raise RuntimeError(
                f"land_in_forward: parameter '{misused[0]}' (of {len(misused)}) got a gradient "
                f"although no forward waited for it to land after step {self._step}: it was used "
                f"without its module being called (a weight used by another module's forward, "
                f"say), so it may have been read before it landed. Use it through its module, or "
                f"call opt.flush() before such a forward. Nothing of this step was sent")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
