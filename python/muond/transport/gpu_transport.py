"""Which GPU transport, if any, carries one daemon's steps: ``cuda_ipc`` or ``nccl``.

``SessionLink.choose_transport`` asks ``candidates`` first for "auto", "cuda_ipc" and "nccl"; an
empty answer to "auto" means the host transports decide (shm, else grpc). The rules
(docs/transports.md):

- ``cuda_ipc`` needs a daemon that offers it (``ServerInfo.cuda_ipc``: its backend is a CUDA GPU),
  on this host (``host_id``), and every parameter of the session on one CUDA device. It works on
  the daemon's own GPU and on another GPU of the node (peer access).
- ``nccl`` needs NCCL on both sides (``ServerInfo.nccl_version``, this process's libnccl), every
  parameter on one CUDA device, and a daemon on another GPU: NCCL refuses two ranks on one device
  ("Duplicate GPU detected").
- "auto" takes ``cuda_ipc`` when it fits (then ``nccl``, when that fits too, should registering the
  memory fail), ``nccl`` for a daemon on another host, else nothing.

An explicit choice that does not fit is a RuntimeError naming the transport and every reason.
``decide`` is pure (no GPU, no daemon); ``Here.of`` gathers this side's facts.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import shm

GPU_TRANSPORTS = ("cuda_ipc", "nccl")


class Here(NamedTuple):
    """This side's facts: the CUDA device index holding every parameter (None: not so, and why),
    this host's id, that device's UUID ("GPU-…") and this process's NCCL version (0: none)."""
    device: Optional[int]
    why_no_device: str
    host_id: str
    uuid: str
    nccl_version: int

    @staticmethod
    def of(tensors: Iterable[torch.Tensor], *, with_nccl: bool = True) -> "Here":
        device, why = parameter_device(tensors)
        uuid = ""
        nccl_version = 0
        if device is not None:
            from . import cuda_runtime  # noqa: PLC0415 - CUDA only
            try:
                uuid = cuda_runtime.device_uuid(device)
            except Exception:  # noqa: BLE001 - unknown UUID: never taken for the daemon's
                uuid = ""
            if with_nccl:
                from . import nccl  # noqa: PLC0415 - CUDA only
                nccl_version = nccl.local_version()
        return Here(device, why, shm.local_host_id(), uuid, nccl_version)


def parameter_device(tensors: Iterable[torch.Tensor]) -> Tuple[Optional[int], str]:
    """(index, "") of the one CUDA device holding every tensor, else (None, why not)."""
    devices = sorted({str(t.device) for t in tensors})
    if not devices:
        return None, "the session has no parameters"
    if any(not d.startswith("cuda") for d in devices):
        return None, f"the parameters are on {', '.join(devices)}, not on a CUDA device"
    if len(devices) > 1:
        return None, f"the parameters are on several CUDA devices ({', '.join(devices)})"
    device = torch.device(devices[0])
    return (device.index if device.index is not None else torch.cuda.current_device()), ""


def _reasons(transport: str, info, here: Here, endpoint: str) -> List[str]:
    """Why ``transport`` cannot carry the steps between ``here`` and the daemon of ``info``."""
    why = []
    daemon_uuid = getattr(info, "cuda_device_uuid", "")
    if transport == "cuda_ipc":
        if not getattr(info, "cuda_ipc", False):
            why.append(f"the daemon offers no CUDA IPC (its backend is "
                       f"'{getattr(info, 'backend', '') or 'unknown'}'; CUDA IPC needs --backend cuda)")
        if not info.host_id or info.host_id != here.host_id:
            why.append("the daemon runs on another host (CUDA IPC works within one node)")
    else:
        if getattr(info, "nccl_version", 0) <= 0:
            why.append("the daemon has no NCCL (ServerInfo.nccl_version is 0)")
        if here.device is not None and here.nccl_version <= 0:
            why.append("this process cannot load NCCL (libnccl.so.2)")
        if (here.device is not None and _same_uuid(here.uuid, daemon_uuid)
                and not several_ranks_per_gpu(min(here.nccl_version,
                                                  getattr(info, "nccl_version", 0)))):
            why.append(f"the daemon computes on this process's own GPU ({daemon_uuid}), and NCCL "
                       f"refuses two ranks on one GPU (\"Duplicate GPU detected\"); "
                       f"transport='auto' uses cuda_ipc there")
    if here.device is None:
        why.append(here.why_no_device or "the parameters are not on a CUDA device")
    return why


def several_ranks_per_gpu(nccl_version: int) -> bool:
    """Whether NCCL puts two ranks on one GPU: 2.30 and later with NCCL_MULTI_RANK_GPU_ENABLE=1 (in
    both processes' environments); earlier versions refuse ("Duplicate GPU detected")."""
    return nccl_version >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"


def _same_uuid(a: str, b: str) -> bool:
    return bool(a) and bool(b) and a.strip().lower() == b.strip().lower()


def decide(wanted: str, info, here: Here, endpoint: str = "the daemon") -> List[str]:
    """The GPU transports to try for ``wanted``, best first. For "auto" an empty list means
    none fits; for "cuda_ipc" or "nccl" it is that one, or a RuntimeError saying why not."""
    if wanted in GPU_TRANSPORTS:
        why = _reasons(wanted, info, here, endpoint)
        if why:
            raise RuntimeError(f"transport='{wanted}' is not possible with {endpoint}: "
                               + "; ".join(why))
        return [wanted]
    if wanted != "auto":
        return []
    ipc = not _reasons("cuda_ipc", info, here, endpoint)
    nccl = not _reasons("nccl", info, here, endpoint)
    if ipc:
        return ["cuda_ipc", "nccl"] if nccl else ["cuda_ipc"]
    same_host = bool(info.host_id) and info.host_id == here.host_id
    return ["nccl"] if nccl and not same_host else []


class GpuLink:
    """What both GPU transports of one session hold: the daemon's connection, the session, its
    parameters (``names`` in order, ``sizes`` elements each), the CUDA device they live on and the
    dtypes of gradients and answers."""

    def __init__(self, conn, session_id: str, names: Sequence[str], sizes: Dict[str, int],
                 device: int, *, wire_dtype: str, return_dtype: str):
        self.conn = conn
        self.session_id = session_id
        self.names: List[str] = list(names)
        self.sizes = dict(sizes)
        self.device = int(device)
        self.wire_dtype = wire_dtype
        self.return_dtype = return_dtype
