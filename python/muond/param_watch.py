"""``ParamWatch``: what a trainer does to ``RemoteOptimizer``'s parameters behind its back — a
tensor added to or taken from a group's ``params`` (the session's parameters are fixed at its
creation), and in-place changes since the optimizer last wrote the values (the daemon holds the
masters, and the next answer would overwrite such a change without a word).

Owned by the optimizer, used from its thread; holds the tensors each group was created with and,
while it watches, each parameter's version (torch's count of in-place changes)."""

from typing import Any, Dict, List, Optional, Sequence

import torch


class ParamWatch:
    """The optimizer's parameters as the session was created with them (see the module's docstring)."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor],
                 groups: Sequence[Dict[str, Any]]):
        self._names, self._params = list(names), list(params)
        self._created = [tuple(g["params"]) for g in groups]
        self._versions: Optional[List[int]] = None

    def note(self, watched: bool) -> None:
        """Records the versions now (the optimizer has just written the values), or stops
        watching when ``watched`` is false (parameters land outside the optimizer's calls)."""
        self._versions = [p._version for p in self._params] if watched else None

    def check_same_params(self, index: int, group: Dict[str, Any]) -> None:
        """ValueError when ``group`` (param_groups[index]) no longer holds the tensors it was
        created with, in order: raised before a step sends anything, so that no parameter is
        silently left out of the optimizer."""
        now, created = group["params"], self._created[index]
        if len(now) != len(created) or any(a is not b for a, b in zip(now, created)):
            raise ValueError(
                f"param_groups[{index}]['params'] changed since the optimizer was created "
                f"({len(created)} tensors then, {len(now)} now); the session's parameters are fixed "
                f"at creation: create another RemoteOptimizer (a new session) for other parameters")

    def changed_in_place(self) -> Optional[str]:
        """Why the next step may not run, naming the parameters changed in place since the last
        ``note`` (None when none was, or nothing is watched)."""
        if self._versions is None:
            return None
        changed = [n for n, p, v in zip(self._names, self._params, self._versions) if p._version != v]
        if not changed:
            return None
        shown = ", ".join(repr(n) for n in changed[:3]) + (" ..." if len(changed) > 3 else "")
        return (f"parameters changed in place since the optimizer last wrote them: {shown} "
                f"({len(changed)} of {len(self._params)}). The daemon holds their masters and "
                f"this step's answer overwrites the change: load weights before creating the "
                f"optimizer, or call upload_parameters() to make the model's values the masters "
                f"(python/README.md, Parameters changed by the trainer)")
