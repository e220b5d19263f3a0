"""Names for the parameters of a RemoteOptimizer.

The daemon addresses every tensor by name. Parameters given as ``(name, tensor)`` pairs (as from
``model.named_parameters()``) or with a group's ``param_names`` keep their names; the rest are
called ``p<i>`` by their position across all groups. Pure functions.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def _group_dicts(params: Iterable[Any]) -> List[Dict[str, Any]]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors "
                        f"or dicts, but got {torch.typename(params)}")
    if isinstance(params, dict):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts; "
                        "wrap a single group dict in a list")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        return [{"params": items}]
    return [dict(g) for g in items]


def named_groups(params: Iterable[Any], held: Sequence[Tuple[str, torch.Tensor]] = ()
                 ) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Group dicts whose ``params`` are tensors and whose ``param_names`` are filled in, and the
    flat list of names in parameter order. ``held``: the (name, tensor) pairs an optimizer holds
    already, when a group is added to it: unnamed parameters are numbered after them, and their
    names and tensors may not be given again."""
    groups = _group_dicts(params)
    all_names: List[str] = [name for name, _ in held]
    for gi, group in enumerate(groups):
        raw = group["params"]
        if isinstance(raw, torch.Tensor):
            raw = [raw]
        elif isinstance(raw, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs")
        tensors, names = [], []
        for p in raw:
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                names.append(p[0])
                tensors.append(p[1])
            else:
                names.append(None)
                tensors.append(p)
        given = group.get("param_names")
        if given is not None:
            given = list(given)
            if len(given) != len(tensors):
                raise ValueError(f"group {gi}: {len(given)} param_names for {len(tensors)} params")
            names = [g if g else n for g, n in zip(given, names)]
        for i, name in enumerate(names):
            if not name:
                names[i] = f"p{len(all_names) + i}"
            elif not isinstance(name, str):
                raise TypeError(f"parameter names must be strings, got {name!r}")
        group["params"] = tensors
        group["param_names"] = names
        all_names.extend(names)
    seen = set()
    for name in all_names:
        if name in seen:
            raise ValueError(f"parameter name '{name}' is used twice")
        seen.add(name)
    _check_tensors(groups, held)
    return groups, all_names[len(held):]


def _check_tensors(groups: List[Dict[str, Any]], held: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """TypeError for a complex tensor (the masters are real fp32: its imaginary part would be
    dropped), ValueError for one tensor given twice, or given again after ``held`` (its gradient
    would count twice in the norm and its update be applied twice), each naming the parameter."""
    first_name: Dict[int, str] = {id(tensor): name for name, tensor in held}
    for group in groups:
        for tensor, name in zip(group["params"], group["param_names"]):
            if not isinstance(tensor, torch.Tensor):
                continue  # torch's own check names the type
            if tensor.is_complex():
                raise TypeError(f"parameter '{name}': a complex tensor ({tensor.dtype}); the optimizers "
                                f"take real tensors (optimize its real and imaginary parts as real "
                                f"parameters)")
            other = first_name.setdefault(id(tensor), name)
            if other != name:
                raise ValueError(f"parameters '{other}' and '{name}' are the same tensor; give each "
                                 f"tensor once (tied weights are one parameter)")


def numbered(names: Sequence[str]) -> bool:
    """Whether every name is the one ``named_groups`` gives an unnamed parameter (``p<index>``):
    such names say nothing, and state dicts holding them load by position."""
    return all(name == f"p{i}" for i, name in enumerate(names))


def check_saved_names(saved: Optional[Sequence[str]], here: Sequence[str]) -> None:
    """ValueError unless a state dict's parameter names (``saved``; None: it holds none) are the
    loading optimizer's (``here``), or one side's are ``p<index>``: loading by position would swap
    the states of equal shapes."""
    if saved is None or list(saved) == list(here) or numbered(saved) or numbered(here):
        return
    saved, here = list(saved), list(here)
    differ = next(i for i, pair in enumerate(zip(saved + [None] * len(here), here + [None] * len(saved)))
                  if pair[0] != pair[1])
    was = saved[differ] if differ < len(saved) else None
    now = here[differ] if differ < len(here) else None
    raise ValueError(f"the state dict's {len(saved)} parameter names differ from this optimizer's "
                     f"{len(here)} from position {differ} on (saved {was!r}, here {now!r}): loading by "
                     f"position would swap their states; nothing was loaded")
