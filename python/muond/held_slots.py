"""The entries of ``RemoteOptimizer.state``: for each parameter, a plain dict from the name of each
tensor the daemon holds of it (its ``master``, its optimizer slots, its ``step`` count), as the last
``state_dict()`` or ``load_state_dict()`` saw them, to a ``HeldOnDaemon`` that stands for the
value. The values live on the daemon, and ``state_dict()["state"][i]`` reads them (a round trip of
the whole state).

An entry exists for every parameter from the optimizer's creation (empty until the state is first
read or loaded), so that a tool that steps an optimizer whose state is empty (or lacks a parameter)
once with zero gradients to create it — ``torch.distributed.checkpoint``'s state-dict helpers —
finds it there and never steps the session; its names are what those helpers'
``flatten_optimizer_state_dict=True`` load asks the checkpoint for. The entries are plain dicts of
non-tensors, so code that walks an optimizer's state to move or count its tensors passes them by.
Used from the optimizer's thread; a ``HeldOnDaemon`` is not changed once made.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence


class HeldOnDaemon:
    """Stands in ``opt.state[p]`` for tensor ``slot`` of parameter ``name`` (number ``index``):
    reading any attribute of it as of a tensor (``.norm()``, ``.to(...)``) raises AttributeError
    saying where the value is read; torch's functions refuse it as no tensor (TypeError)."""

    __slots__ = ("name", "index", "slot")

    def __init__(self, name: str, index: int, slot: str):
        self.name, self.index, self.slot = name, index, slot

    def where(self) -> str:
        return f"opt.state_dict()['state'][{self.index}][{self.slot!r}]"

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") or attribute in HeldOnDaemon.__slots__:  # (unset: made by copy)
            raise AttributeError(attribute)
        raise AttributeError(f"{self.slot!r} of parameter {self.name!r} is held by the daemon, not in "
                             f"opt.state: {self.where()} reads it")

    def __repr__(self) -> str:
        return f"<{self.slot} of {self.name!r}: held by the daemon, read {self.where()}>"


def held_entry(name: str, index: int, slots: Sequence[str] = ()) -> Dict[str, HeldOnDaemon]:
    """The entry of ``opt.state`` for parameter ``name`` (number ``index``) holding ``slots``."""
    return {slot: HeldOnDaemon(name, index, slot) for slot in slots}
