"""``OptimizerCore``: what ``RemoteOptimizer`` provides to the three mixins it is built from.

``RemoteOptimizer`` (optimizer.py: construction, the step's gradients and header, sessions) is
completed by three mixins, each with no state of its own:

- ``StateTransfer`` (state_transfer.py): ``state_dict``, ``load_state_dict`` and ``upload_parameters``;
- ``StreamControls`` (stream_controls.py): overlapped and delayed steps — ``no_sync``,
  ``gradients_in_flight``, ``flush`` and the streamed try backward opens;
- ``StepTries`` (step_tries.py): every try and retry of a step, over one daemon or the shards, and
  what its answer leaves in the optimizer.

They read and call the members below, and nothing else of the optimizer; the optimizer sets every
attribute in its constructor and keeps it for its life (``last_step``, ``pushes``, ``last_info``,
``stale_pushes``, ``streamed_steps``, ``loss_scale`` and the step's bookkeeping below change with
each step). A type checker holds the optimizer to this protocol (the
mixins annotate ``self`` with it), and a test checks that every member exists on a built optimizer
(tests/python/test_optimizer_options.py). Used from the optimizer's thread, as the optimizer is;
a delayed step's tries run on the delayed update's thread, one step at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Tuple, TypeVar

import torch

if TYPE_CHECKING:
    from .delayed import DelayedUpdate
    from .dtensor_params import DTensorParams
    from .landing import ForwardLanding
    from .overlap import GradientStream
    from .placement import Placement
    from .ranks import Sync
    from .step_info import StepInfo
    from .shard_step import CutOffStep
    from .transport.streamed import Landing
    from .transport.daemon_session import DaemonSession

_T = TypeVar("_T")


class OptimizerCore(Protocol):
    """The members of ``RemoteOptimizer`` its mixins use (see the module's docstring)."""

    # torch.optim.Optimizer's.
    param_groups: List[Dict[str, Any]]
    state: Dict[Any, Any]

    # The session and this rank's place in it.
    session_id: str
    endpoints: List[str]        # the daemons, in the order the session was created with
    rank: int
    world_size: int
    sync: "Sync"
    partitioned: bool           # some group's parameters are held in parts by the ranks
    last_step: int              # the step of the parameters the model holds
    pushes: int                 # asynchronous sessions: this rank's pushes so far
    loss_scaler: Optional[Dict[str, float]]
    loss_scale: Optional[float]
    chunk_bytes: int
    return_dtype: str
    last_info: Optional["StepInfo"]  # the last step's answer
    stale_pushes: int               # asynchronous sessions: pushes dropped as too stale
    streamed_steps: int             # steps whose first try was streamed (overlap)
    log_num_zeros_in_grad: bool
    max_step_attempts: int          # tries of a step on transient failures
    retry_backoff: float            # seconds before the second try, doubled after each

    # The parameters: names in session order, by name, their index, their global shapes (a
    # rank holding parts holds less), and per daemon the indices of its parameters.
    _names: List[str]
    _by_name: Dict[str, torch.Tensor]
    _index: Dict[str, int]
    _global_shapes: Dict[str, Tuple[int, ...]]
    _indices_of: List[List[int]]
    _dtensors: "DTensorParams"  # FSDP2's DTensor parameters and the local tensors holding them
    placement: "Placement"      # which daemon holds which parameter

    # A step's bookkeeping: the step its answer named, until the answer is noted; the answer's
    # landing (land_in_forward), until step() hands it on; whether an older daemon was warned of.
    _answered_step: Optional[int]
    _cut_off: Optional["CutOffStep"]  # a sharded step some shard may have applied, sent again next
    _answer_landing: Optional["Landing"]
    _warned_old_daemon: bool

    # One DaemonSession per daemon (several: a sharded session), and the machinery of overlapped,
    # landed and delayed steps (None when not asked for).
    _sessions: List["DaemonSession"]
    _stream: Optional["GradientStream"]
    _forward: Optional["ForwardLanding"]
    _delayed: Optional["DelayedUpdate"]

    @property
    def _async(self) -> bool:
        """Whether the session's ranks push asynchronously."""

    def _check_open(self) -> None:
        """RuntimeError once the optimizer was closed."""

    def _next_number(self) -> int:
        """The number of the next step (of this rank's next push, asynchronously)."""

    def _delay_now(self) -> bool:
        """Whether the coming step is a delayed one."""

    def _header(self, step: int, qk_logits: Dict[str, List[float]],
                grad_scale: Optional[float] = None, weight: Optional[float] = None) -> Any:
        """The ``StepHeader`` of step ``step``: every group's overrides and the step's options."""

    def _common_step(self, steps: List[int], rpc: str) -> int:
        """The one step every daemon of a sharded session reports; MuondError naming ``rpc``
        when they differ."""

    def _common_step_error(self, steps: List[int], rpc: str) -> Any:
        """The MuondError naming the shards behind the others of ``steps``."""

    def _on_every_session(self, call: Callable[[int, "DaemonSession"], Any]) -> List[Any]:
        """``call(k, daemon)`` for every daemon, in parallel on a sharded session; the answers
        in daemon order."""

    def _with_chunks_fitted(self, call: Callable[[], _T]) -> _T:
        """``call()``, made again with smaller chunks when a daemon refuses them as larger than
        it takes (a daemon restarted with a smaller ``--max-chunk-bytes``)."""

    def _given_params(self) -> List[Any]:
        """The parameters as the groups list them, in session order (FSDP2's DTensors themselves)."""

    def _note_parameters(self) -> None:
        """Records the parameters' versions once this optimizer has written them (their
        in-place changes are refused at the next step)."""
