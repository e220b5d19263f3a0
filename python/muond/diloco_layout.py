"""DiLoCo's layout of a model's parameters: the default outer optimizer (``OUTER_SGD``), outer
groups with Muon for the hidden matrices (``muon_outer_groups``), and the split of the parameters
into fragments that sync in turn (``split_fragments``). Pure functions of their arguments; the
``DiLoCo`` worker (diloco.py) uses them, and ``muond.diloco`` exports them.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from torch import nn

from .param_groups import default_param_groups

# DiLoCo's outer optimizer (arXiv 2311.08105, torchft's values): Nesterov SGD, lr 0.7, momentum 0.9.
OUTER_SGD: Dict[str, Any] = {"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}


def muon_outer_groups(model: nn.Module, *, muon: Optional[Mapping[str, Any]] = None,
                      sgd: Optional[Mapping[str, Any]] = None,
                      head: Optional[Iterable[Any]] = None) -> List[Dict[str, Any]]:
    """Outer groups with Muon for the hidden matrices and Nesterov SGD for the rest.

    The split is ``muond.default_param_groups``' (embeddings, the output head and parameters with
    fewer than 2 dimensions leave Muon). ``muon``: options of the Muon group (muond's Muon
    defaults otherwise; no published outer-Muon setting exists, so tune its ``lr``). ``sgd``:
    options of the SGD group over ``OUTER_SGD``. Give the result to ``DiLoCo(outer=...)``."""
    groups = []
    for group in default_param_groups(model, head=head):
        if group["optimizer"] == "muon":
            groups.append({**group, **dict(muon or {}), "optimizer": "muon"})
        else:
            groups.append({"params": group["params"], "param_names": group["param_names"],
                           **OUTER_SGD, **dict(sgd or {})})
    return groups


def split_fragments(sizes: Sequence[int], fragments: int) -> List[int]:
    """The fragment of each parameter, given the parameters' element counts in order:
    ``fragments`` (F) contiguous runs of the list, each holding at least one parameter, of about
    equal size. Walking the list in order, the current fragment f closes before parameter i when
    the middle of parameter i lies at or past (f + 1)/F of all elements, or when the parameters
    left are exactly as many as the fragments still to open."""
    count = len(sizes)
    total = sum(sizes)
    owner: List[int] = []
    current, before, filled = 0, 0, 0
    for i, size in enumerate(sizes):
        to_open = fragments - 1 - current
        middle_past = (2 * before + size) * fragments >= 2 * total * (current + 1)
        if filled and to_open > 0 and (count - i == to_open or middle_past):
            current += 1
            filled = 0
        owner.append(current)
        filled += 1
        before += size
    return owner
