"""``DTensorParams``: the DTensor parameters of a ``RemoteOptimizer``'s partitioned groups (FSDP2's
sharded parameters), each held by a local tensor.

A group may list an FSDP2 model's parameters themselves (DTensors sharded ``Shard(0)``, or
``(Replicate(), Shard(0))`` under HSDP) with ``partition=rows(their global shapes)``. The
optimizer holds, in their place, a tensor sharing each one's local shard (``to_local()`` under
``no_grad``, detached): the parameters the daemon answers are written into it, and so into the
DTensor. FSDP2 puts a parameter's gradient on the DTensor — its reduce-scatter assigns a DTensor
``.grad`` to the parameter and never sets the local tensor's — so the gradient a step sends is that
gradient's local shard (``grad``), ``zero_grad`` clears the DTensors' gradients as torch's clears
the parameters', and each step first follows a DTensor given a new local tensor since (``follow``).
The optimizer's ``param_groups`` hold the local tensors, not the model's parameters: a tool that
matches an optimizer's parameters to the model's by identity (``torch.distributed.checkpoint``'s
optimizer state dict) does not find them; ``state_dict()`` is muond's own. Used from the
optimizer's thread only.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

import torch

from .partition import from_dtensor

# torch.optim.Optimizer.zero_grad's own default (False before torch 2.0, True since).
_SET_TO_NONE = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor: ``torch.distributed.tensor.DTensor``, or anything that
    carries its ``to_local``, ``placements`` and ``device_mesh``."""
    return all(hasattr(value, a) for a in ("to_local", "placements", "device_mesh"))


class DTensorParams:
    """The optimizer's DTensor parameters by the local tensors that hold them (see the module's
    docstring)."""

    def __init__(self) -> None:
        self._by_local: Dict[int, Any] = {}  # id(local tensor) → its DTensor
        self._held: List[Tuple[torch.Tensor, Any]] = []  # (local tensor, its DTensor)

    def localize(self, group: MutableMapping[str, Any]) -> None:
        """Replaces the DTensors among ``group["params"]`` (its tensors, as ``named_groups``
        leaves them) by their local tensors. ValueError unless the group has a ``rows`` partition
        and each DTensor is its parameter's part under it (``partition.from_dtensor``'s checks, and
        its global shape the partition's)."""
        params = list(group["params"])
        if not any(is_dtensor(p) for p in params):
            return
        partition = group.get("partition")
        if getattr(partition, "kind", None) != "rows":
            raise ValueError("partition: a group of DTensor parameters (FSDP2's, sharded Shard(0)) needs "
                             "partition=muond.partition.rows(their global shapes)")
        for k, value in enumerate(params):
            if not is_dtensor(value):
                continue
            local, shape = from_dtensor(value)
            if k < len(partition.shapes) and tuple(shape) != tuple(partition.shapes[k]):
                raise ValueError(f"partition: parameter {k} of the group is a DTensor of global shape "
                                 f"{tuple(shape)}; the partition gives {tuple(partition.shapes[k])}")
            held = local.detach().requires_grad_(bool(value.requires_grad))
            self._by_local[id(held)] = value
            self._held.append((held, value))
            params[k] = held
        group["params"] = params

    def follow(self) -> None:
        """Points each held tensor at its DTensor's shard as it is now: FSDP2 may give a parameter a
        new local tensor after the optimizer was made (its lazy initialization of padded shards,
        ``model.to()``, a load with ``assign=True``), and the answers must land where its next
        forward reads them."""
        with torch.no_grad():
            for held, dtensor in self._held:
                current = dtensor.to_local()
                if (current.data_ptr() != held.data_ptr() or current.shape != held.shape
                        or current.dtype != held.dtype):
                    held.data = current

    def grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """``param``'s gradient: its own ``.grad``, or for a DTensor's local tensor the local shard
        of the DTensor's ``.grad``."""
        dtensor = self._by_local.get(id(param))
        if dtensor is None:
            return param.grad
        grad = dtensor.grad
        if grad is None or not is_dtensor(grad):
            return grad
        with torch.no_grad():
            return grad.to_local()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clears the DTensors' gradients as ``torch.optim.Optimizer.zero_grad(set_to_none)``
        clears the parameters' (None: torch's default)."""
        set_to_none = _SET_TO_NONE if set_to_none is None else set_to_none
        for dtensor in self._by_local.values():
            if dtensor.grad is None:
                continue
            if set_to_none:
                dtensor.grad = None
            else:
                with torch.no_grad():
                    dtensor.grad.zero_()
