"""``HeldSlots``: an entry of ``RemoteOptimizer.state`` — the names of the tensors the daemon holds
for one parameter (its ``master``, its optimizer slots, its ``step`` count), as the last
``state_dict()`` read them, and not their values: those live on the daemon, and
``state_dict()["state"][i]`` reads them (a round trip of the whole state).

An entry exists for every parameter from the optimizer's creation, so that a tool that steps an
optimizer whose state is empty (or lacks a parameter) once with zero gradients to create it —
``torch.distributed.checkpoint``'s state-dict helpers — finds it there and never steps the
session. Its names are what those helpers' ``flatten_optimizer_state_dict=True`` load asks the
checkpoint for. Reading a value raises KeyError naming ``state_dict()``. Immutable.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence


class HeldSlots(Mapping[str, Any]):
    """The daemon's tensors of parameter ``name`` (number ``index``) by name (see the module's
    docstring)."""

    def __init__(self, name: str, index: int, slots: Sequence[str] = ()):
        self._name, self._index, self._slots = name, index, tuple(slots)

    def __contains__(self, slot: object) -> bool:
        return slot in self._slots

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, slot: str) -> Any:
        if slot in self._slots:
            raise KeyError(f"{slot!r} of parameter {self._name!r} is held by the daemon: "
                           f"opt.state_dict()['state'][{self._index}][{slot!r}] reads it")
        raise KeyError(slot)

    def __repr__(self) -> str:
        return f"HeldSlots({self._name!r}: {', '.join(self._slots) or 'none read yet'})"
