"""``DTensorParams``: the DTensor parameters of a ``RemoteOptimizer``'s partitioned groups (FSDP2's
sharded parameters), each held by a local tensor.

A group may list an FSDP2 model's parameters themselves (DTensors sharded ``Shard(0)``, or
``(Replicate(), Shard(0))`` under HSDP) with ``partition=rows(their global shapes)``. The
optimizer's ``param_groups`` keep the DTensors, as torch's optimizers do, so that tools matching an
optimizer's parameters to the model's by identity find them (``torch.distributed.checkpoint``'s
optimizer state dict) and torch's ``zero_grad`` clears their gradients. Inside, the optimizer works
on a tensor sharing each one's local shard (``to_local()`` under ``no_grad``, detached): the
parameters the daemon answers are written into it, and so into the DTensor. FSDP2 puts a
parameter's gradient on the DTensor — its reduce-scatter assigns a DTensor ``.grad`` to the
parameter and never sets the local tensor's — so the gradient a step sends is that gradient's local
shard (``grad``), and each step first follows a DTensor given a new local tensor since
(``follow``). A state dict holds a DTensor parameter's master and the slots cut like it as DTensors
placed as the parameter (``as_saved``), so that a checkpoint of every rank's state dict keeps each
rank's part. Used from the optimizer's thread only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import torch

from .partition import from_dtensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor: ``torch.distributed.tensor.DTensor``, or anything that
    carries its ``to_local``, ``placements`` and ``device_mesh``."""
    return all(hasattr(value, a) for a in ("to_local", "placements", "device_mesh"))


class DTensorParams:
    """The optimizer's DTensor parameters and the local tensors that hold them (see the module's
    docstring)."""

    def __init__(self) -> None:
        self._by_local: Dict[int, Any] = {}  # id(local tensor) → its DTensor
        self._local_of: Dict[int, torch.Tensor] = {}  # id(DTensor) → its local tensor
        self._held: List[Tuple[torch.Tensor, Any]] = []  # (local tensor, its DTensor)

    def localize(self, group: Mapping[str, Any]) -> Dict[str, Any]:
        """``group`` (its tensors as ``named_groups`` leaves them) with each DTensor among its
        ``params`` replaced by the local tensor that holds it from here on: what the optimizer's
        checks and torch's ``add_param_group`` take (``restore`` puts the DTensors back). ValueError
        unless the group has a ``rows`` partition and each DTensor is its parameter's part under it
        (``partition.from_dtensor``'s checks, and its global shape the partition's)."""
        params = list(group["params"])
        if not any(is_dtensor(p) for p in params):
            return dict(group)
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
            self._local_of[id(value)] = held
            self._held.append((held, value))
            params[k] = held
        return dict(group, params=params)

    def restore(self, group: MutableMapping[str, Any]) -> None:
        """Puts the DTensors back in place of their local tensors in ``group["params"]``."""
        group["params"] = [self._by_local.get(id(p), p) for p in group["params"]]

    def dtensor_of(self, local: torch.Tensor) -> Optional[Any]:
        """The DTensor ``local`` holds, or None when it holds none."""
        return self._by_local.get(id(local))

    def local(self, param: Any) -> Any:
        """The local tensor that holds ``param`` when it is one of the DTensors; else ``param``."""
        return self._local_of.get(id(param), param)

    def local_groups(self, groups: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Shallow copies of ``groups`` with their DTensors' local tensors as ``params``."""
        return [dict(g, params=[self.local(p) for p in g["params"]]) for g in groups]

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

    def as_saved(self, param: torch.Tensor, value: torch.Tensor) -> Any:
        """``value`` (a master or slot of ``param``'s local part, of as many elements) as a state
        dict holds it: for a DTensor's local tensor, a DTensor placed as the DTensor, of its global
        shape, whose local tensor is ``value`` where it is (on the host: a checkpoint needs no room
        on the GPU for the optimizer's state), built from the DTensor's spec as FSDP2 builds its
        parameters; on a torch whose DTensor is not built so, ``from_local`` (which moves it to the
        mesh's device). Else ``value`` itself."""
        dtensor = self._by_local.get(id(param))
        if dtensor is None:
            return value
        local = value.reshape(param.shape)
        spec = getattr(dtensor, "_spec", None)
        if spec is not None and getattr(spec, "tensor_meta", None) is not None:
            try:
                meta = spec.tensor_meta._replace(dtype=local.dtype)
                return type(dtensor)(local, dataclasses.replace(spec, tensor_meta=meta), requires_grad=False)
            except TypeError:
                pass  # another constructor (torch before 2.4)
        return type(dtensor).from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False,
                                        shape=dtensor.shape, stride=dtensor.stride())


def local_value(value: Any) -> Any:
    """A state dict's value as this rank's tensor: a DTensor's local tensor (its part, detached),
    anything else as it is."""
    if not is_dtensor(value):
        return value
    with torch.no_grad():
        return value.to_local().detach()
