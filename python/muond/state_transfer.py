"""``StateTransfer``: ``RemoteOptimizer``'s ``state_dict``, ``load_state_dict`` and
``upload_parameters`` — the daemon's whole state (masters, optimizer slots, step counters, the loss
scaler) in torch's layout, read with ``GetState`` and written back with ``SetState``; a state dict
also loads as ``torch.distributed.checkpoint``'s state-dict helpers hand it back (``_in_own_layout``).

A mixin on the protocol ``OptimizerCore`` (optimizer_core.py): it uses the optimizer's sessions,
names, groups and step counters, and has no state of its own. Used by one thread at a time, as the optimizer is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Tuple

import torch

from . import options as opts
from . import wire
from ._stubs import pb
from .dtensor_params import is_dtensor, local_value
from .held_slots import held_entry
from .naming import check_saved_names
from .transport.daemon_session import copy_in

_log = logging.getLogger("muond")
STATE_FORMAT = 1
# What a rank's "muond" section holds of its own (the others' state dicts hold theirs).
# The parameters' names are in each group's "param_names" already.
_RANKS_OWN = ("rank", "parts", "pushes")
_NOT_IN_GROUPS = _RANKS_OWN + ("names",)


if TYPE_CHECKING:  # the members of RemoteOptimizer this mixin uses (optimizer_core.py)
    from .optimizer_core import OptimizerCore as _Core
else:
    _Core = object


def _hooks(optimizer: Any, table: str) -> List[Any]:
    """The hooks of one of torch's state-dict hook tables (``torch.optim.Optimizer`` sets them up
    from torch 2.1 on; none before), in their order."""
    return list(getattr(optimizer, table, {}).values())


class StateTransfer(_Core):
    """The state-dict half of ``RemoteOptimizer`` (see the module's docstring)."""

    def state_dict(self) -> Dict[str, Any]:
        """The daemon's whole state in torch's layout: ``state[i]`` holds parameter i's
        ``master`` and optimizer slots (e.g. ``momentum``, ``exp_avg``), each in the dtype the
        daemon stores it in (fp32 unless the group's *_dtype options say bf16 or fp16), and its
        ``step`` count;
        ``param_groups`` the group options; ``muond`` the session's last step and names, this
        optimizer's rank and, in an asynchronous session, its push counter (``pushes``), which
        ``load_state_dict`` restores so that a restarted rank resumes its numbering.

        Hooks registered with torch's ``register_state_dict_pre_hook`` and
        ``register_state_dict_post_hook`` (torch >= 2.1) run as torch runs them: the pre-hooks
        before the state is read, the post-hooks on the dict, each able to replace it."""
        for pre_hook in _hooks(self, "_optimizer_state_dict_pre_hooks"):
            pre_hook(self)
        out = self._read_state_dict()
        for post_hook in _hooks(self, "_optimizer_state_dict_post_hooks"):
            replaced = post_hook(self, out)
            if replaced is not None:
                out = replaced
        return out

    def _read_state_dict(self) -> Dict[str, Any]:
        """``state_dict`` without the hooks."""
        self.flush()
        parts = self._on_every_session(lambda k, session: session.get_state())
        last_step = self._common_step([int(header.last_step) for header, _ in parts], "GetState")
        counts = {c.name: int(c.count) for header, _ in parts for c in header.step_counts}
        index = self._index
        state: Dict[int, Dict[str, Any]] = {}
        for (name, slot), tensor in ((key, t) for _, tensors in parts for key, t in tensors.items()):
            entry = state.setdefault(index[name], {})
            slot = slot or "master"
            shape, is_part = self._slot_layout(name, slot)
            value = tensor.view(shape).to(self._storage_dtype(name, slot))
            # A DTensor parameter's part (its master and the slots cut like it) as a DTensor.
            entry[slot] = self._dtensors.as_saved(self._by_name[name], value) if is_part else value
        for name, i in index.items():
            state.setdefault(i, {})["step"] = counts.get(name, 0)
        self._name_held(state)
        meta = {"format": STATE_FORMAT, "last_step": last_step, "names": list(self._names),
                "session": self.session_id, "rank": self.rank}
        if self.partitioned:
            meta["parts"] = True  # this rank's parts of the partitioned parameters' state
        if self._async:
            meta["pushes"] = self.pushes
        header = parts[0][0]
        if header.HasField("loss_scaler"):
            meta["loss_scaler"] = {"scale": header.loss_scaler.scale,
                                   "growth_tracker": header.loss_scaler.growth_tracker,
                                   "hysteresis_tracker": header.loss_scaler.hysteresis_tracker}
        # Each group carries what every rank's state dict holds alike, so that a state dict
        # keeps it through torch.distributed.checkpoint, which keeps only "state" and
        # "param_groups" (and one rank's copy of values not sharded).
        common = {k: v for k, v in meta.items() if k not in _NOT_IN_GROUPS}
        return {"state": state, "param_groups": self._saved_groups(common), "muond": meta}

    def _saved_groups(self, common: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The groups' options as a state dict holds them, "params" as parameter indices, and
        ``common`` (the "muond" section without what is a rank's own) under "muond"."""
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["muond"] = dict(common)
            if saved.get("partition") is not None:  # plain data, as checkpoints' checks of values ask
                saved["partition"] = dataclasses.asdict(saved["partition"])
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return groups

    def _group_of(self, name: str) -> Dict[str, Any]:
        return next(g for g in self.param_groups if name in g["param_names"])

    def _storage_dtype(self, name: str, slot: str) -> torch.dtype:
        """The torch dtype the daemon stores a parameter's master or slot in."""
        return wire.torch_dtype(opts.storage_dtype(self._group_of(name), slot))

    def _tensor_shape(self, name: str, slot: str) -> Tuple[int, ...]:
        """The shape of a parameter's master or optimizer slot (``options.slot_shape``)."""
        return self._slot_layout(name, slot)[0]

    def _is_part(self, name: str, slot: str) -> bool:
        """Whether a parameter's master or slot is cut as the parameter is (of as many elements as
        its local tensor)."""
        return self._slot_layout(name, slot)[1]

    def _slot_layout(self, name: str, slot: str) -> Tuple[Tuple[int, ...], bool]:
        """The shape of a parameter's master or optimizer slot, and whether it is cut as the
        parameter is."""
        local = tuple(self._by_name[name].shape)
        if slot == "master":
            return local, True
        whole = tuple(self._global_shapes.get(name, local))
        shape = tuple(opts.slot_shape(self._group_of(name), whole, slot))
        # A partitioned parameter's slot of its own size comes as this rank's part, like the master;
        # of its size means as many elements (the daemon's rule, StatePartOf), whatever the shape:
        # NAMO-D's per-column moment of a (1, n) matrix is cut too, and is this rank's part, flat.
        if shape == whole:
            return local, True
        if self._group_of(name).get("partition") is not None and math.prod(shape) == math.prod(whole):
            return (math.prod(local),), True
        return shape, False

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replaces the daemon's state (masters, slots, step counters) with ``state_dict`` from
        ``state_dict()``, copies the masters into the parameters, and restores the groups' lr,
        momentum and weight decay. The session's other options must match the saved ones. A
        ``LocalOptimizer``'s state dict loads too: the parameters' current values become the
        masters, its slots and step counts the daemon's (``_from_local_state_dict``).

        In an asynchronous session the daemon's state is shared by ranks that wait for nobody:
        once the session has applied a push, loading restores this rank's place in it instead —
        its push counter (``pushes``, so that a restarted rank resumes its numbering: its first
        push is a resend when the daemon applied it already) — and keeps the daemon's state, which
        replacing would undo the pushes applied since the save; the model holds the session's
        latest parameters (read from the daemon), the base of the next push. A session with no
        push applied (new, or on a daemon that lost it) takes the saved state as in the other
        modes, and this rank's pushes start at 1 (the daemon's push records went with the
        session). ValueError for a state dict of another rank (its push counter is not this
        rank's). docs/ranks.md, Asynchronous.

        Hooks registered with torch's ``register_load_state_dict_pre_hook`` and
        ``register_load_state_dict_post_hook`` (torch >= 2.1) run as torch runs them: the
        pre-hooks on a shallow copy of ``state_dict``, each able to replace it, the post-hooks
        once it is loaded."""
        state_dict = dict(state_dict)
        for pre_hook in _hooks(self, "_optimizer_load_state_dict_pre_hooks"):
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        self._load_state_dict(state_dict)
        for post_hook in _hooks(self, "_optimizer_load_state_dict_post_hooks"):
            post_hook(self)

    def _load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """``load_state_dict`` without the hooks."""
        self.flush()
        if "muond" not in state_dict and "last_step" in state_dict:
            state_dict = self._from_local_state_dict(state_dict)
        state_dict, resharded = self._in_own_layout(state_dict)
        meta = state_dict.get("muond")
        if not meta or meta.get("format") != STATE_FORMAT or "last_step" not in meta:
            raise ValueError("not a RemoteOptimizer or LocalOptimizer state dict (no 'muond' section of "
                             "format 1 with the last step, in it or in its groups; no 'last_step')")
        check_saved_names(meta.get("names"), self._names)
        saved_groups = state_dict["param_groups"]
        self._check_saved_groups(saved_groups)
        state = state_dict["state"]
        if self._async:
            saved_rank = meta.get("rank", self.rank)
            if saved_rank != self.rank:
                raise ValueError(f"the state dict was saved by rank {saved_rank}, this optimizer is "
                                 f"rank {self.rank}: in an asynchronous session a rank's push "
                                 f"counter is its own")
        else:  # (an asynchronous load may keep the daemon's state instead: checked below)
            self._check_every_master(state, meta)
        if self.partitioned and not resharded and (not meta.get("parts") or meta.get("rank") != self.rank):
            held = (f"rank {meta.get('rank')}'s parts" if meta.get("parts") else
                    "whole tensors" if "rank" in meta else "parts of no known rank")
            raise ValueError(f"the state dict holds {held}; this optimizer is rank {self.rank} of a "
                             f"session with partitioned groups: each rank loads the state dict it "
                             f"saved (through torch.distributed.checkpoint only DTensor parameters' "
                             f"parts, which it reads for each rank)")
        if self._async:
            session_step = self._sessions[0].refresh()  # never sharded
            if session_step > 0:
                self._last_step_record.forget()  # param_groups come from the state dict from here on
                self.last_step = session_step
                # The saved count, even when the daemon's record (asked on attach) is further: the
                # rank redoes the work after its save, and those pushes are answered as resends.
                # (A state dict without this rank's section, as torch.distributed.checkpoint's
                # helpers hand it back, keeps the count asked on attach.)
                taken, self.pushes = self.pushes, int(meta.get("pushes", self.pushes))
                if taken > self.pushes:
                    _log.warning("session %s: rank %d's pushes %d to %d were taken before its state "
                                 "dict was loaded: redone, they are answered as resends and apply "
                                 "nothing", self.session_id, self.rank, self.pushes + 1, taken)
                self._restore_group_options(saved_groups)
                _log.info("session %s: rank %d resumes after its push %d at global step %d (the "
                          "state dict was saved at global step %d; the session's state is kept)",
                          self.session_id, self.rank, self.pushes, session_step,
                          int(meta["last_step"]))
                self._name_held(state)
                self._note_parameters()
                return
            self._check_every_master(state, meta)
        self._last_step_record.forget()  # param_groups come from the state dict from here on
        steps = self._with_chunks_fitted(lambda: self._on_every_session(
            lambda k, session: session.set_state(self._state_header(k, meta, state),
                                                 self._state_chunks(self._indices_of[k], state))))
        self.last_step = self._common_step(steps, "SetState")
        self._name_held(state)
        self._cut_off = None  # a step cut off before the load is not the loaded state's
        if self.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.loss_scale = float(meta["loss_scaler"]["scale"])
        copy_in(self._by_name, {name: state[i]["master"] for i, name in enumerate(self._names)
                                if "master" in state.get(i, {})})
        self._note_parameters()
        self._restore_group_options(saved_groups)

    def _check_every_master(self, state: Dict[int, Dict[str, Any]], meta: Dict[str, Any]) -> None:
        """ValueError, before anything is sent, when a state dict as torch.distributed.checkpoint's
        helpers hand it back (it names no rank) lacks a parameter's master: none at all (a flattened
        load asks for what opt.state names, filled in by this optimizer's state_dict()), or some (the
        helpers leave out the state of parameters that do not require grad). A value that is no
        tensor (what a checkpoint lacking the key hands back) counts as missing."""
        if "rank" in meta:
            return  # a rank's own state dict: SetState names what it lacks
        missing = [name for i, name in enumerate(self._names)
                   if not isinstance(state.get(i, {}).get("master"), torch.Tensor)]
        if not missing:
            return
        if len(missing) == len(self._names):
            raise ValueError("the state dict holds no parameter's state: through "
                             "torch.distributed.checkpoint with flatten_optimizer_state_dict=True, "
                             "the load asks the checkpoint for what opt.state names, which this "
                             "optimizer's state_dict() fills in: call get_optimizer_state_dict first "
                             "(as a checkpointer does to make what it loads into)")
        raise ValueError(f"the state dict holds no state of {missing[0]!r} ({len(missing)} parameters): "
                         f"torch.distributed.checkpoint leaves out the state of parameters that do "
                         f"not require grad; the session needs every parameter's")

    def _name_held(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Names in torch's ``state`` what the daemon holds of each parameter (held_slots.py), as
        ``state`` (by parameter index) has it."""
        given = self._given_params()
        for i, entry in state.items():
            if isinstance(i, int) and 0 <= i < len(given):
                self.state[given[i]] = held_entry(self._names[i], i, tuple(entry))

    def _in_own_layout(self, state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        """``state_dict`` as ``state_dict()`` makes it, from it or from what
        ``torch.distributed.checkpoint``'s helpers hand back of it: the "muond" section from the
        groups' when the top-level one is gone (without a rank's own entries; the names from the
        groups' "param_names"); the state by parameter index when keyed by what the groups'
        "params" list (the parameters' fully qualified names), by position; DTensor values as their
        local tensors (the parts the checkpoint read for this rank), a flat part in its shape. Also
        whether, in a state dict that names no rank, every partitioned parameter's master and cut
        slots came as DTensors placed as it is (``_came_as_dtensors``: its parts are then this
        rank's, whoever saved them)."""
        groups = list(state_dict.get("param_groups") or ())
        meta = state_dict.get("muond")
        if not meta and groups and groups[0].get("muond"):
            names = [name for group in groups for name in group.get("param_names", ())]
            meta = dict(groups[0]["muond"], names=names or None)
        keys = [key for group in groups for key in group.get("params", ())]
        state = dict(state_dict.get("state") or {})
        if keys != list(range(len(keys))):
            state = {i: state[key] for i, key in enumerate(keys) if key in state}
        parted = [i for i, name in enumerate(self._names)
                  if self._group_of(name).get("partition") is not None]
        # A rank's own state dict names the rank, which is then checked whatever its tensors.
        resharded = (bool(parted) and "rank" not in (meta or {})
                     and all(self._came_as_dtensors(i, state.get(i, {})) for i in parted))
        for i, entry in list(state.items()):
            if not isinstance(i, int) or not 0 <= i < len(self._names):
                continue
            local = {}
            for slot, value in entry.items():
                if is_dtensor(value):
                    value = local_value(value)
                    shape = self._tensor_shape(self._names[i], slot)
                    if value.numel() == math.prod(shape):
                        value = value.reshape(shape)
                local[slot] = value
            state[i] = local
        return dict(state_dict, state=state, muond=meta), resharded

    def _came_as_dtensors(self, i: int, entry: Mapping[str, Any]) -> bool:
        """Whether parameter ``i``'s saved master and every slot cut like it are DTensors placed as
        the parameter's DTensor is, on its mesh, of its global shape (so each holds the part the
        checkpoint read for this rank)."""
        name = self._names[i]
        dtensor = self._dtensors.dtensor_of(self._by_name[name])
        if dtensor is None or "master" not in entry:
            return False
        return all(is_dtensor(value) and tuple(value.shape) == tuple(dtensor.shape)
                   and tuple(value.placements) == tuple(dtensor.placements)
                   and value.device_mesh == dtensor.device_mesh
                   for slot, value in entry.items() if slot != "step" and self._is_part(name, slot))

    def _from_local_state_dict(self, local: Dict[str, Any]) -> Dict[str, Any]:
        """A ``LocalOptimizer``'s state dict as one of this optimizer's: its slots and step counts
        over the daemon's current state (which has every slot, so that a parameter the local
        optimizer never stepped keeps zeros, as it had there), the parameters' current values as
        the masters (a ``LocalOptimizer``'s masters are its parameters), its last step and loss
        scaler."""
        names = [n for group in local["param_groups"] for n in group.get("param_names", ())]
        check_saved_names(names or None, self._names)
        if self.partitioned:
            raise ValueError("a LocalOptimizer's state dict holds whole tensors; this optimizer is rank "
                             f"{self.rank} of a session with partitioned groups")
        current = self._read_state_dict()
        state = current["state"]
        for i, name in enumerate(self._names):
            entry = state.setdefault(i, {})
            if "master" in entry:
                master = entry["master"]
                entry["master"] = self._by_name[name].detach().to("cpu").reshape(master.shape).to(master.dtype)
            entry.update(local["state"].get(i, {}))
        meta = dict(current["muond"], last_step=int(local["last_step"]),
                    loss_scaler=local.get("loss_scaler") or current["muond"].get("loss_scaler"))
        return {"state": state, "param_groups": local["param_groups"], "muond": meta}

    def _restore_group_options(self, saved_groups: List[Dict[str, Any]]) -> None:
        """The groups' lr, momentum and weight decay (and initial_lr) as saved."""
        for group, saved in zip(self.param_groups, saved_groups):
            for key in opts.OVERRIDABLE + ("initial_lr",):
                if key in saved:
                    group[key] = saved[key]

    def _check_saved_groups(self, saved_groups: List[Dict[str, Any]]) -> None:
        """ValueError unless the saved groups hold as many parameters as these, with the options
        the session fixed."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"group {i}: the state dict has {len(saved['params'])} "
                                 f"parameters, this optimizer {len(group['params'])}")
            mine, theirs = opts.spec_options(group), opts.spec_options(saved)
            diff = [k for k in mine if mine[k] != theirs.get(k)]
            if diff:
                raise ValueError(f"group {i}: options {diff} differ from the state dict's; they "
                                 f"are fixed by the session")

    def upload_parameters(self) -> None:
        """Makes the model's current parameter values the daemon's masters (after loading
        weights, clamping or pruning them in place), keeping the optimizer state (momentum,
        moments, step counts): the daemon's state is read, its masters replaced by the
        parameters (rounded to the masters' storage dtype) and written back, as
        ``load_state_dict`` writes a state dict."""
        if self.sync.mode != "lockstep":
            raise ValueError(f"upload_parameters: not in a {self.sync.mode} session, whose other "
                             f"ranks step on between the state's read and its write; load weights "
                             f"before creating the optimizer")
        saved = self.state_dict()
        with torch.no_grad():
            for i, name in enumerate(self._names):
                entry = saved["state"].get(i)
                if entry is None or "master" not in entry:
                    continue
                master = local_value(entry["master"]).cpu()  # a DTensor parameter's: its local part
                value = self._by_name[name].detach().cpu().reshape(master.shape)
                # Only the elements the trainer changed: the others keep the master's bits, which
                # a 16-bit model (or answer) holds rounded.
                entry["master"] = torch.where(value != master.to(value.dtype), value.to(master.dtype), master)
        self.load_state_dict(saved)

    def _state_header(self, k: int, meta: Dict[str, Any],
                      state: Dict[int, Dict[str, Any]]) -> pb.StateHeader:
        """The SetState header of daemon ``k``: the last step, the loss scaler, its parameters'
        step counts."""
        header = pb.StateHeader(last_step=int(meta["last_step"]))
        if meta.get("loss_scaler") is not None:
            header.loss_scaler.CopyFrom(pb.LossScalerState(**meta["loss_scaler"]))
        for i in self._indices_of[k]:
            header.step_counts.add(name=self._names[i], count=int(state.get(i, {}).get("step", 0)))
        return header

    def _state_chunks(self, indices: List[int],
                      state: Dict[int, Dict[str, Any]]) -> Iterator[pb.TensorChunk]:
        """The saved tensors of the parameters ``indices``, each checked against its shape and
        encoded in the format the daemon stores it in (which rounds as the daemon would: 16-bit
        state travels in half the bytes)."""
        for i in indices:
            name = self._names[i]
            for slot, value in state.get(i, {}).items():
                if isinstance(value, torch.Tensor) and slot != "step":
                    expected = self._tensor_shape(name, slot)
                    if tuple(value.shape) != expected:
                        raise ValueError(f"state of '{name}' slot '{slot}' has shape "
                                         f"{tuple(value.shape)}, expected {expected}")
                    if value.numel() == 0:
                        continue  # a rank's empty part
                    stored = opts.storage_dtype(self._group_of(name), slot)
                    yield from wire.encode(name, value, stored, slot=slot,
                                           max_chunk_bytes=self.chunk_bytes)
