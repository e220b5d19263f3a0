"""Resuming a session's per-step values after an attach: each group's lr, momentum, weight decay
and betas as the session's last step ran with them (the daemon's record, answered to the attach),
then moved on by a torch LR scheduler loaded from its state dict. What torch's ``load_state_dict``
restores in ``param_groups``, for a trainer that resumes by attaching instead (python/README.md,
Checkpoints and restarts). ``LastStepRecord`` is owned by the optimizer; the functions work on the
groups alone; no calls to a daemon."""

import bisect
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence


def apply_last_step(param_groups: List[Dict[str, Any]], created: Sequence[Mapping[str, Any]],
                    group_names: Sequence[str], last_step: Mapping[str, Any]) -> None:
    """Sets each group's values from ``last_step`` (group name → the step's GroupOverride for it;
    a group without one ran with its options, which are its own)."""
    for group, at_creation, name in zip(param_groups, created, group_names):
        o = last_step.get(name)
        if o is None:
            continue
        if o.HasField("lr"):
            # A scheduler made from here on starts from the session's creation lr, as one made
            # after torch's load_state_dict does from the initial_lr that state dict holds.
            group.setdefault("initial_lr", at_creation["lr"])
        for key in ("lr", "momentum", "weight_decay"):
            if o.HasField(key):
                group[key] = getattr(o, key)
        if o.HasField("beta1") or o.HasField("beta2"):
            beta1, beta2 = group["betas"]
            group["betas"] = (o.beta1 if o.HasField("beta1") else beta1,
                              o.beta2 if o.HasField("beta2") else beta2)


def _cycling(scheduler: Any) -> List[Any]:
    """The schedulers within ``scheduler`` that set momentum or betas[0] at their count: itself
    (OneCycleLR, CyclicLR with cycle_momentum), the one SequentialLR is at, every one a
    ChainedScheduler chains."""
    inner = getattr(scheduler, "_schedulers", None)
    if inner is None:
        return [scheduler] if getattr(scheduler, "cycle_momentum", False) else []
    milestones = getattr(scheduler, "_milestones", None)
    if milestones is not None:  # SequentialLR: the scheduler after the milestones passed
        return _cycling(inner[bisect.bisect_right(milestones, scheduler.last_epoch)])
    return [c for s in inner for c in _cycling(s)]


def apply_scheduler(optimizer: Any, scheduler: Any) -> None:
    """Moves the groups' values on as ``scheduler``'s last step did (it was made after the attach
    and loaded from its state dict): each group's lr from the scheduler's record of its last
    learning rates (``_last_lr``, which its state dict holds, ReduceLROnPlateau's too), and its
    momentum or betas[0] recomputed for the count where it cycles them (OneCycleLR, CyclicLR, also
    inside SequentialLR and ChainedScheduler). ValueError for a scheduler of another optimizer,
    TypeError for one without that record."""
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the scheduler drives another optimizer, not this one")
    lrs = getattr(scheduler, "_last_lr", None)
    if lrs is None:
        raise TypeError(f"{type(scheduler).__name__} keeps no record of its last learning rates "
                        f"(_last_lr, as torch's schedulers do once they have stepped): it cannot be "
                        f"resumed from; set param_groups' values by hand")
    groups = optimizer.param_groups
    if len(lrs) != len(groups):
        raise ValueError(f"the scheduler has {len(lrs)} learning rates for {len(groups)} parameter groups")
    for cycling in _cycling(scheduler):
        # Its get_lr() sets the groups' momentum (or betas[0]) for its count as its step() did;
        # outside step() torch warns that get_last_lr() gives the lr, which is taken below.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cycling.get_lr()
    for group, lr in zip(groups, lrs):
        group["lr"] = lr


class LastStepRecord:
    """What the session's last step (``step``) ran with when the optimizer attached: group name →
    its GroupOverride (``values``; None when the daemon did not know them, or after a
    load_state_dict replaced the state)."""

    def __init__(self, step: int, values: Optional[Dict[str, Any]]):
        self.step, self.values = step, values

    @classmethod
    def of(cls, records: Sequence[Optional[Mapping[str, Any]]], answered: Sequence[int],
           step: int) -> "LastStepRecord":
        """The record of ``step`` from each daemon's attach answer (``records``, the step each
        answered for in ``answered``): a shard whose cut-off step the attach finished since
        answered for the step before, and its record is not taken."""
        known = [r for r, at in zip(records, answered) if at == step]
        if step == 0 or any(r is None for r in known):
            return cls(step, {} if step == 0 else None)
        return cls(step, {name: o for r in known for name, o in r.items()})

    def forget(self) -> None:
        self.values = None

    def resume(self, optimizer: Any, created: Sequence[Mapping[str, Any]], group_names: Sequence[str],
               scheduler: Any) -> None:
        """``RemoteOptimizer.resume_param_groups``: the record's values, then ``scheduler``'s."""
        if optimizer.last_step != self.step:
            raise RuntimeError(f"resume_param_groups() resumes the values of the step this optimizer "
                               f"attached at ({self.step}); the session is at step "
                               f"{optimizer.last_step} since: param_groups already hold what it ran with")
        if self.values:
            apply_last_step(optimizer.param_groups, created, group_names, self.values)
        if scheduler is not None:
            apply_scheduler(optimizer, scheduler)
