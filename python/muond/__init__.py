"""muond: the Python client of the muond optimizer daemon.

``RemoteOptimizer`` is a ``torch.optim.Optimizer`` whose ``step()`` runs Muon / AdamW / Lion / SGD
on a muond daemon that holds the fp32 master parameters and the optimizer state::

    import muond
    groups = muond.default_param_groups(model, adamw={"lr": 3e-4})
    with muond.RemoteOptimizer(groups, endpoint="127.0.0.1:50051") as opt:
        for batch in data:
            loss = model(batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()

``ConnectionOptions`` groups how the optimizer reaches its daemons (endpoints, deadlines, token and
TLS, retries, the step transport); ``RankOptions``, ``TimingOptions``, ``WireOptions`` and
``StepOptions`` the rest of its infrastructure (``muond.optimizer_options``). ``LocalOptimizer`` runs the same optimizers in-process;
``Connection`` is the protocol layer (one method per RPC); ``MuondError`` is what a failed daemon
call raises (``.code`` is a ``grpc.StatusCode``, ``.details`` the daemon's message).

The modules users see are at the top of the package; ``muond.transport`` holds the step
transports' plumbing (docs/architecture.md, "The Python client").
"""

# The generated stubs (muond._proto) may live in another folder on sys.path than this file, e.g.
# build/python when running from a CMake build tree; let the package span both.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .client import Connection  # noqa: E402
from .connection_options import ConnectionOptions  # noqa: E402
from .diloco import DiLoCo  # noqa: E402
from .errors import MuondError  # noqa: E402
from .group_info import GroupInfo, HelocoCounts  # noqa: E402
from .local import LocalOptimizer  # noqa: E402
from . import partition  # noqa: E402
from .optimizer import RemoteOptimizer  # noqa: E402
from .optimizer_options import RankOptions, StepOptions, TimingOptions, WireOptions  # noqa: E402
from .param_groups import default_param_groups  # noqa: E402
from .state_digest import StateDigest  # noqa: E402
from .step_info import StepInfo  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Connection", "ConnectionOptions", "DiLoCo", "GroupInfo", "HelocoCounts", "LocalOptimizer",
           "MuondError", "RankOptions", "RemoteOptimizer", "StateDigest", "StepInfo", "StepOptions",
           "TimingOptions", "WireOptions", "default_param_groups", "__version__"]
