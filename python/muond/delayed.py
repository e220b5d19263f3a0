"""``DelayedUpdate``: a ``RemoteOptimizer``'s step k running while the trainer computes step k+1
(``delay=1``, ZeRO-Offload's delayed parameter update).

``submit(run)`` starts step k on a worker thread: ``run(out)`` is the whole step (every try and
retry) writing the parameters after it into ``out``, a staging copy of the parameters allocated
once, and returns what notes its answer. ``land()`` waits for it, copies the staged parameters into
the model and then notes the answer: ``opt.step()`` k+1
calls it first, so step k+1's forward and backward ran on the parameters after step k-1. ``wait()``
waits without copying (a streamed step k+1 cannot begin on the daemon before step k is applied, and
backward still reads the parameters). A failure of step k, after its retries, is raised by the
next ``land()``.

The worker is an ordinary thread of ``concurrent.futures``: interpreter exit waits for the step in
flight, so the daemon never sees half of one. One owner thread calls these methods; ``wait()`` may
also come from a backward hook while that thread is inside backward.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, Optional, Tuple

import torch


def check_delay(delay: Any, delay_warmup: Any, loss_scaler: Any, sync_mode: str) -> Tuple[int, int]:
    """(delay, delay_warmup), checked; ValueError naming the argument."""
    if isinstance(delay, bool) or delay not in (0, 1):
        raise ValueError(f"delay: must be 0 (none) or 1 (one step), got {delay!r}")
    if isinstance(delay_warmup, bool) or not isinstance(delay_warmup, int) or delay_warmup < 0:
        raise ValueError(f"delay_warmup: must be an int >= 0, got {delay_warmup!r}")
    if delay and loss_scaler is not None:
        raise ValueError("delay: not with a loss scaler (the next loss is scaled before the step "
                         "that sets its scale has answered)")
    if delay and sync_mode == "async":
        raise ValueError("delay: not with sync_mode='async' (a push already waits for no other "
                         "rank, and its base step would name parameters the model no longer holds)")
    return int(delay), int(delay_warmup)


class DelayedUpdate:
    """At most one step in flight for the parameters ``by_name``."""

    def __init__(self, by_name: Dict[str, torch.Tensor]):
        self._by_name = by_name
        self._staging: Optional[Dict[str, torch.Tensor]] = None
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[concurrent.futures.Future] = None
        self._landed = True  # the staged parameters are in the model

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def staging(self) -> Dict[str, torch.Tensor]:
        """Where the step in flight writes the parameters (one copy of them, made once)."""
        if self._staging is None:
            with torch.no_grad():
                self._staging = {name: p.detach().clone() for name, p in self._by_name.items()}
        return self._staging

    def submit(self, run: Callable[[Dict[str, torch.Tensor]], Callable[[], None]]) -> None:
        """Starts ``run(staging)`` on the worker; the step before must have landed."""
        if self._pending is not None or not self._landed:
            raise RuntimeError("a delayed step is still in flight")
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muond-delayed")
        self._landed = False
        self._pending = self._worker.submit(run, self.staging())

    def wait(self) -> None:
        """Waits for the step in flight (if any) to end; its failure is kept for ``land()``."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    @torch.no_grad()
    def land(self) -> None:
        """Waits for the step in flight and copies its parameters into the model. After a
        failure nothing is copied (the model keeps the parameters it has) and the failure is
        raised."""
        pending, self._pending = self._pending, None
        try:
            note = pending.result() if pending is not None else None
        except BaseException:
            self._landed = True
            raise
        if not self._landed:
            for name, param in self._by_name.items():
                param.copy_(self._staging[name])
            self._landed = True
        if note is not None:
            note()

    def close(self) -> None:
        """Lets the worker go; the step in flight, if any, must have been waited for."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
