"""``StepTransport``: the one interface every client step transport implements.

A step transport carries one try of a step's tensors between this process and a daemon: the
gradients in, the parameters out (the control, the ``StepHeader`` and ``StepResult``, travels on
gRPC in every case). The daemon's side of the same seam is ``server/transport/step_transport.h``.

A transport class says whether it can carry a session's steps (``viable``, from ``Facts``: the
daemon's ``ServerInfo`` and this process's ``Here``), and an instance, made for one session
(``TransportContext``), sets up what it needs (``open``), runs tries (``step``) and lets go
(``close``). ``choice.py`` holds the order "auto" tries them in.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterable, Iterator,
                    Optional, Sequence, Tuple)

import torch

from .._stubs import pb
from . import shm

from .streamed import GatheredTry, Grads, StreamedTry

if TYPE_CHECKING:  # client.py imports this package's framing: no import of it at run time here
    from ..client import Connection


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


class Here:
    """This process's side of a session: the CUDA device index holding every parameter
    (``device``; None when not so, ``why_no_device`` says why), this host's id (``host_id``), that
    device's UUID (``uuid``, "GPU-…") and this process's NCCL version (``nccl_version``, 0: none).

    Each fact is found on first use, so a transport whose checks stop earlier never loads the CUDA
    runtime or NCCL. Facts given as keywords are taken as they are (tests)."""

    def __init__(self, tensors: Iterable[torch.Tensor] = (), **known: Any):
        self._tensors = list(tensors)
        self.__dict__.update(known)  # a value in the instance wins over the cached property

    @functools.cached_property
    def _located(self) -> Tuple[Optional[int], str]:
        return parameter_device(self._tensors)

    @functools.cached_property
    def device(self) -> Optional[int]:
        return self._located[0]

    @functools.cached_property
    def why_no_device(self) -> str:
        return self._located[1]

    @functools.cached_property
    def host_id(self) -> str:
        return shm.local_host_id()

    @functools.cached_property
    def uuid(self) -> str:
        if self.device is None:
            return ""
        from . import cuda_runtime  # noqa: PLC0415 - CUDA only
        try:
            return cuda_runtime.device_uuid(self.device)
        except Exception:  # noqa: BLE001 - unknown UUID: never taken for the daemon's
            return ""

    @functools.cached_property
    def nccl_version(self) -> int:
        if self.device is None:
            return 0
        from . import nccl  # noqa: PLC0415 - CUDA only
        return nccl.local_version()


class Facts:
    """What decides which transports can carry one daemon's steps: ``daemon``, its ``ServerInfo``
    (from ``server_info`` on first use: choosing ``grpc`` by name needs none), and ``here``."""

    def __init__(self, server_info: Callable[[], Any], here: Here):
        self._server_info = server_info
        self.here = here

    @functools.cached_property
    def daemon(self) -> pb.ServerInfo:
        return self._server_info()


@dataclass(frozen=True)
class TransportContext:
    """What a transport of one session works with: the daemon's connection, the session, its
    parameters (``names`` in order, ``sizes`` elements each, the tensors ``by_name``), the dtypes
    of gradients and answers, the gRPC chunk size, this trainer's rank, and whether the parameters
    and gradients are to live in shared memory (``zero_copy``: the shm transport only), and which
    parameters to answer first (``answer_first``: the gRPC transport only)."""
    conn: "Connection"
    session_id: str
    names: Sequence[str]
    sizes: Dict[str, int]
    by_name: Dict[str, torch.Tensor]
    wire_dtype: str
    return_dtype: str
    chunk_bytes: int
    rank: int = 0
    zero_copy: bool = False
    # The parameters the trainer wants back first, in that order (names; others of this session's
    # follow in its order): asked again at every step, for transports that answer in a stream.
    answer_first: Callable[[], Sequence[str]] = tuple

    @property
    def endpoint(self) -> str:
        return self.conn.endpoint


class StepTransport(abc.ABC):
    """One session's step transport. ``name`` is what ``transport=`` calls it.

    ``viable`` says why the transport cannot carry steps between the two sides of ``facts`` (None
    when it can), from ``reasons_against``: every reason, joined, for a transport asked for by name;
    the first alone for "auto", which only needs to know whether to pass it over (``auto`` adds
    the reasons "auto" has to prefer another).

    An instance is used by one thread at a time."""

    name: ClassVar[str]

    def __init__(self, ctx: TransportContext, facts: Facts):
        self.ctx = ctx

    @classmethod
    def viable(cls, facts: Facts, *, auto: bool = False) -> Optional[str]:
        reasons = cls.reasons_against(facts, auto=auto)
        if auto:
            return next(reasons, None)
        return "; ".join(reasons) or None

    @classmethod
    @abc.abstractmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        """Why this transport cannot carry the steps, one reason at a time."""

    def open(self) -> None:
        """Sets up what the steps need ahead of the first one (memory registered, a channel
        joined); a failure here makes "auto" try the next transport. Nothing by default."""

    @abc.abstractmethod
    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try of ``header`` (session id set) with ``grads``; the result and the parameter
        values to copy into ``out`` (None: the parameters; none to copy when the transport wrote
        them there itself, or for a prepare), valid until the next try."""

    def begin_streamed(self, header: pb.StepHeader,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> "StreamedTry":
        """A try of the step ``header`` names whose gradients are handed over as they are
        produced (``streamed.py``). By default they are gathered and sent at the end."""
        return GatheredTry(self, header, out)

    def close(self) -> None:
        """Lets go of what ``open`` or a step set up (best effort). Nothing by default."""
