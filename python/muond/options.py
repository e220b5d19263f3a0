"""Parameter-group options: one vocabulary shared with the daemon and the C++ client.

A torch param group is a dict. ``resolve_group`` fills in every option that applies to the
group's optimizer with the documented default, checks names and values, and rejects options that
do not apply (``momentum`` in an AdamW group, a typo such as ``ns_step``). ``group_options_proto``
turns a resolved group into the ``muond.v1.GroupOptions`` message sent when a session is created.

Every option, the optimizers it applies to, its values and its default are the option table's
(proto/muond/v1/group_options.json, through ``option_facts``); docs/algorithms.md, Group options,
shows it as a table. The Python client spells beta1 and beta2 as ``betas`` where an optimizer reads
both, takes ``optimizer="adamw"`` or ``use_muon=False``, and takes the per-parameter options
(qkv_split, num_query_groups, tp_blocks, tp_block_dim) per group.

The *_dtype options choose how the daemon stores masters and optimizer state (Megatron-Core's
precision-aware optimizer); every step still computes in fp32 and rounds to nearest even when it
stores.

Between steps a trainer or a scheduler may change a group's ``lr``, ``momentum``, ``weight_decay``
and (adamw, lion) ``betas`` (the table's ``per_step``): each step sends them (``overrides_of``).
Every other option is fixed by the session; ``check_unchanged`` raises at the next step when one
changed.

The facts these checks use (defaults, coefficient sets, named values, matrix and slot shapes) are
``option_facts``'; this module holds the checks and the conversion to the wire.

Pure functions; no shared state.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Sequence, Tuple

import torch

from ._stubs import pb
from .option_facts import (CHOICE_DEFAULTS, COEFFICIENT_SETS, COEFFICIENTS_AFTER, DEFAULTS,
                           GRAM_RESTARTS, MUON_MOMENT2 as _MUON_MOMENT2, NAMED_VALUES as _CHOICES,
                           OPTIMIZERS, PER_STEP, RANGES, READ_FOR_QK_CLIP as _READ_FOR_QK_CLIP, READ_WITH as _READ_WITH, ROWS, SET_STEPS, matrix_shapes,
                           range_error, slot_shape)

__all__ = ["ALL_OPTIONS", "COEFFICIENT_SETS", "COEFFICIENTS_AFTER", "DEFAULTS", "GRAM_RESTARTS",
           "OPTIMIZERS", "OVERRIDABLE", "check_defaults", "check_ranges", "check_parameter", "check_read", "check_shapes",
           "check_tensors", "check_unchanged", "coefficient_schedule", "group_options_proto",
           "matrix_shapes", "optimizer_of", "overrides_of", "resolve_group", "resolved_defaults",
           "slot_shape", "spec_options", "storage_dtype"]

# Storage formats by torch's names too (Megatron-Core's configuration takes torch dtypes).
_DTYPE_ALIASES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                  "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# The option that sets the storage format of each state tensor.
_DTYPE_OPTION = {"master": "master_dtype", "momentum": "momentum_dtype",
                 "momentum_buffer": "momentum_dtype", "exp_avg": "exp_avg_dtype",
                 "exp_avg_sq": "exp_avg_sq_dtype", "moment2": "exp_avg_sq_dtype"}

ALL_OPTIONS = frozenset(k for d in DEFAULTS.values() for k in d)
# Keys a group may carry besides options: torch's own, lr schedulers', and a display name.
_PASSTHROUGH = frozenset({"params", "param_names", "initial_lr", "name", "partition"})
# Options a step may override (GroupOverride): what torch's schedulers and trainers change between
# steps (betas only where they are AdamW's and Lion's). Every other option is fixed by the session:
# changing one raises at the next step (check_unchanged).
OVERRIDABLE = tuple(PER_STEP)
_BETAS_OVERRIDABLE = PER_STEP["betas"]


def optimizer_of(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """The optimizer name of a group: its ``optimizer`` or ``use_muon``, else the defaults'."""
    for source in (group, defaults):
        name = source.get("optimizer")
        use_muon = source.get("use_muon")
        if name is None and use_muon is None:
            continue
        if name is not None:
            name = str(name).lower()
            if name not in OPTIMIZERS:
                raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
            if use_muon is not None and bool(use_muon) != (name == "muon"):
                raise ValueError(f"use_muon={use_muon} contradicts optimizer={name!r}")
            return name
        return "muon" if use_muon else "adamw"
    return "muon"


def _coefficients(value: Any) -> Any:
    if isinstance(value, str):
        if value not in COEFFICIENT_SETS:
            raise ValueError(f"unknown ns_coefficients {value!r}; use one of "
                             f"{', '.join(COEFFICIENT_SETS)} or a list of (a, b, c)")
        return value
    tuples = list(value)
    if len(tuples) == 3 and all(isinstance(v, (int, float)) for v in tuples):
        tuples = [tuples]  # torch.optim.Muon style: one (a, b, c) tuple
    if not tuples:
        raise ValueError("ns_coefficients: an empty list")
    out = []
    for t in tuples:
        t = tuple(float(v) for v in t)
        if len(t) != 3:
            raise ValueError(f"ns_coefficients: each entry must be (a, b, c), got {t}")
        out.append(t)
    return tuple(out)


def _check_value(key: str, value: Any) -> Any:
    if value is None:
        if key in ("lr", "weight_decay", "momentum", "nesterov", "betas", "eps"):
            raise ValueError(f"option {key!r} may not be None")
        return None
    if key in _CHOICES:
        value = str(value)
        if key.endswith("_dtype"):
            value = _DTYPE_ALIASES.get(value, value)
        if value not in _CHOICES[key]:
            raise ValueError(f"{key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
        return value
    if key == "ns_coefficients":
        return _coefficients(value)
    kind = ROWS[key]["type"] if key in ROWS else None
    if kind == "bool":
        return bool(value)
    if key == "tp_blocks" and (int(value) != value or value < 1):
        raise ValueError(f"tp_blocks must be an integer >= 1, got {value!r}")
    if key == "tp_block_dim" and value not in (0, 1):
        raise ValueError(f"tp_block_dim must be 0 (rows) or 1 (columns), got {value!r}")
    if kind == "int":
        if int(value) != value:
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if key == "betas":
        if isinstance(value, (str, bytes)):
            raise TypeError(f"betas must be (beta1, beta2), got {value!r}")
        betas = tuple(_float(key, b) for b in value)
        if len(betas) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {value!r}")
        return betas
    if key == "qkv_split":
        split = tuple(int(v) for v in value)
        if len(split) != 3 or min(split) <= 0:
            raise ValueError(f"qkv_split must be three positive row counts, got {value!r}")
        return split
    if key == "lr" and hasattr(value, "item"):  # a 0-dim tensor lr
        value = value.item()
    return _float(key, value)


def _float(key: str, value: Any) -> float:
    """``value`` as a float; TypeError naming ``key`` for one that is not a number (a string
    included, as torch's optimizers refuse it)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{key} must be a number, got {value!r}") from None


def check_ranges(group: Mapping[str, Any]) -> None:
    """ValueError, in the daemon's words, for a resolved group's value outside its option's range
    in the table (the daemon checks these itself; LocalOptimizer, which has no daemon, here)."""
    values = [(key, value) for key, value in group.items() if key in RANGES]
    if isinstance(group.get("betas"), (tuple, list)) and len(group["betas"]) == 2:
        values += list(zip(("beta1", "beta2"), group["betas"]))
    for key, value in values:
        if isinstance(value, bool) or value is None:
            continue
        try:
            number = float(value)  # a float, an int, a 0-dim tensor (an lr), a numpy scalar
        except (TypeError, ValueError):
            continue  # not a number: the option's own check names it
        error = range_error(key, number)
        if error:
            raise ValueError(error)


def resolve_group(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``group`` with ``optimizer`` set and every applicable option filled in.

    Precedence: the group's own value, then ``defaults`` (the optimizer's keyword arguments) when
    the option applies to this group's optimizer, then the table above. An option in the group
    that does not apply to its optimizer, or that nobody knows, is a ValueError.
    """
    name = optimizer_of(group, defaults)
    table = DEFAULTS[name]
    resolved: Dict[str, Any] = {}
    for key, value in group.items():
        if key in _PASSTHROUGH or key in ("optimizer", "use_muon"):
            continue
        if key not in ALL_OPTIONS:
            raise ValueError(f"unknown option {key!r} in a parameter group; known options: "
                             f"{', '.join(sorted(ALL_OPTIONS))}")
        if key not in table:
            raise ValueError(f"option {key!r} does not apply to optimizer {name!r}")
    for key, fallback in table.items():
        if key in group:
            value = group[key]
        elif key in defaults and not (name == "muon" and key in _MUON_MOMENT2):
            value = defaults[key]
        else:
            value = fallback
        resolved[key] = _check_value(key, value)
    for key, brings in CHOICE_DEFAULTS.items():  # e.g. Turbo-Muon's set and steps with aol
        # Together: a group that gives any of them (or whose constructor defaults do) gets none.
        chosen = brings.get(resolved.get(key), {})
        if not any(other in group or other in defaults for other in chosen):
            resolved.update(chosen)
    if name in ("muon", "dion2") and resolved["ns_preconditioner"] == "aol":
        if resolved.get("ns_algorithm") == "gram":
            raise ValueError("ns_preconditioner aol applies with ns_algorithm standard or auto (its first "
                             "iteration reuses X·Xᵀ of the standard iteration)")
    if name == "muon":
        if resolved["moment2_method"] == "none":
            resolved["moment2_method"] = None
        # A Muon group reads beta2 and eps only for its second moment; the constructor's own
        # beta2/eps are AdamW's and Lion's unless the group asks for a second moment.
        method = group.get("moment2_method", defaults.get("moment2_method"))
        for key in _MUON_MOMENT2:
            if method not in (None, "none") and key not in group and key in defaults:
                resolved[key] = _check_value(key, defaults[key])
            if resolved["moment2_method"] is None and key in group:
                raise ValueError(f"option {key!r} applies to a muon group only with a moment2_method")
        if resolved["moment2_method"] in ("namo", "namo_d") and resolved["weight_decay_mode"] == "l2":
            raise ValueError(f"weight_decay_mode l2 cannot be combined with moment2_method "
                             f"{resolved['moment2_method']} (its second moment is of the raw gradient's norm)")
    steps = SET_STEPS.get(resolved["ns_coefficients"]) if name in ("muon", "dion2") and isinstance(
        resolved["ns_coefficients"], str) else None
    if steps is not None and resolved["ns_steps"] != steps:
        raise ValueError(f"ns_steps must be {steps} with ns_coefficients {resolved['ns_coefficients']} "
                         f"(its coefficients are tuned for exactly {steps} steps), got {resolved['ns_steps']}")
    if name == "dion2" and resolved["weight_decay_mode"] not in ("decoupled", "independent"):
        raise ValueError(f"weight_decay_mode {resolved['weight_decay_mode']} does not apply to dion2, which takes "
                         "decoupled (dion's) or independent")
    if name == "muon" and resolved["post_normalization"] not in (None, "none") and \
            resolved["moment2_method"] == "normuon":
        raise ValueError("post_normalization applies without moment2_method normuon (NorMuon rescales "
                         "the same lines of the orthogonalized update after Newton-Schulz)")
    if name == "muon" and resolved["tp_block_dim"] != 0 and (resolved["tp_blocks"] or 1) == 1:
        raise ValueError("tp_block_dim applies only with tp_blocks > 1")
    limit = resolved.get("max_grad_norm")
    if limit is not None:
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"max_grad_norm must be > 0, got {limit!r}")
        if resolved.get("clip_scope") != "group":
            raise ValueError("max_grad_norm applies with clip_scope 'group' only (the group's own limit)")
    if name == "adamw" and resolved["weight_decay_mode"] in ("independent", "cautious"):
        raise ValueError(f"weight_decay_mode {resolved['weight_decay_mode']} applies to muon only; adamw "
                         "takes decoupled (AdamW) or l2 (Adam with coupled L2)")
    if resolved.get("ns_coefficients_after") is not None and isinstance(
            resolved["ns_coefficients"], str):
        raise ValueError("ns_coefficients_after applies to a custom ns_coefficients list only")
    out = {k: v for k, v in group.items() if k in _PASSTHROUGH}
    out["optimizer"] = name
    out["use_muon"] = name == "muon"
    out.update(resolved)
    return out


def check_defaults(defaults: Mapping[str, Any]) -> None:
    """Rejects unknown keyword arguments of an optimizer constructor (typos)."""
    for key in defaults:
        if key not in ALL_OPTIONS and key not in ("optimizer", "use_muon"):
            raise TypeError(f"unexpected keyword argument {key!r}; known options: "
                            f"{', '.join(sorted(ALL_OPTIONS))}")
    optimizer_of({}, defaults)


def _written(value: Any) -> str:
    """A value as the daemon's refusals write it: true/false, a number, a choice's name."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def check_read(group: Mapping[str, Any], qk_clip_reads: bool = True) -> None:
    """ValueError, in the daemon's words, when a resolved group holds an option it reads only with
    another one's value (the table's read_with: heloco_kappa with heloco true) at other than its
    default while that one has another value, or, with ``qk_clip_reads`` false (no QK-clip pair), an
    option only QK-clip reads (qk_clip_threshold, qk_clip_alpha) at other than its default. The
    daemon refuses such a group when a session is
    created (and only then: a session an earlier muond created keeps its spec, which is why
    RemoteOptimizer sends the group as given and leaves the refusal to the daemon); LocalOptimizer,
    which has no daemon, calls this."""
    table = DEFAULTS[group["optimizer"]]
    for key in () if qk_clip_reads else _READ_FOR_QK_CLIP:
        if key in table and group.get(key) is not None and group[key] != table[key]:
            raise ValueError(f"{key}: only QK-clip reads it, and this session names no QK-clip pair "
                             f"(spec.qk_clip); name the query and key weights or leave {key} at its "
                             f"default {_written(table[key])}")
    for key, (gate, values) in _READ_WITH.items():
        if group.get(key) is None or group[key] == table[key]:
            continue
        has = "none" if group[gate] is None else group[gate]
        if has in values:
            continue
        raise ValueError(f"{key}: this {group['optimizer']} group reads it only with {gate} "
                         f"{' or '.join(_written(v) for v in values)}, and has {gate} "
                         f"{_written(has)}; set {gate} or leave {key} at its default {_written(table[key])}")


def coefficient_schedule(group: Mapping[str, Any]) -> Tuple[Tuple[Tuple[float, float, float], ...], str]:
    """The (a, b, c) list of a resolved Muon group and what happens after it ends."""
    value = group["ns_coefficients"]
    if isinstance(value, str):
        return COEFFICIENT_SETS[value], COEFFICIENTS_AFTER[value]
    return tuple(value), group.get("ns_coefficients_after") or "cycle"


_KIND = {"muon": pb.OPTIMIZER_MUON, "adamw": pb.OPTIMIZER_ADAMW, "lion": pb.OPTIMIZER_LION,
         "sgd": pb.OPTIMIZER_SGD, "dion2": pb.OPTIMIZER_DION2}
# The GroupOptions fields a resolved group's own value fills as it is (betas, the second moment's
# options and ns_coefficients are converted below).
_SCALAR_FIELDS = tuple(
    name for name, row in ROWS.items()
    if row["carrier"] == "group" and row.get("python", True) is not False and name != "optimizer"
    and row["type"] in ("float", "int", "bool", "choice") and not row.get("muon_needs")
    and not str(row.get("python", "")).startswith("betas["))


def group_options_proto(group: Mapping[str, Any]) -> pb.GroupOptions:
    """The GroupOptions message of a resolved group (options left None stay unset)."""
    msg = pb.GroupOptions(optimizer=_KIND[group["optimizer"]])
    for key in _SCALAR_FIELDS:
        if group.get(key) is not None:
            setattr(msg, key, group[key])
    coefficients = group.get("ns_coefficients")
    if isinstance(coefficients, str):
        msg.ns_coefficients = coefficients
    elif coefficients is not None:
        msg.ns_custom_coefficients.extend(
            pb.NsCoefficients(a=a, b=b, c=c) for a, b, c in coefficients)
    if group.get("betas") is not None:
        msg.beta1, msg.beta2 = group["betas"]
    if group["optimizer"] == "adamw" or group.get("moment2_method") is not None:
        for key in _MUON_MOMENT2:
            if group.get(key) is not None:
                setattr(msg, key, group[key])
    return msg


def check_tensors(params: Sequence[Any]) -> None:
    """TypeError or ValueError unless every parameter is a leaf tensor, as torch.optim requires."""
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
        if not p.is_leaf:
            raise ValueError("can't optimize a non-leaf tensor")


def check_shapes(group: Mapping[str, Any], shapes: Sequence[Tuple[int, ...]]) -> None:
    """ValueError unless a resolved Muon group's parameters, of these global shapes, are matrices
    its options fit (check_parameter)."""
    if group["optimizer"] == "dion2":
        for shape in shapes:
            if len(shape) < 2:
                raise ValueError(f"Dion2 needs matrices; a parameter of shape {tuple(shape)} must go to an "
                                 f"AdamW group (see muond.default_param_groups)")
        return
    if group["optimizer"] != "muon":
        return
    for shape in shapes:
        if len(shape) < 2:
            raise ValueError(f"Muon needs matrices; a parameter of shape {tuple(shape)} must go to an "
                             f"AdamW group (see muond.default_param_groups)")
        check_parameter(group, tuple(shape))


def check_parameter(group: Mapping[str, Any], shape: Tuple[int, ...]) -> None:
    """The daemon's checks of a Muon parameter's tp_blocks and num_heads against its shape;
    ValueError."""
    _check_heads(group, tuple(shape))
    blocks = group.get("tp_blocks") or 1
    if blocks == 1:
        return
    if len(shape) != 2:
        raise ValueError(f"tp_blocks needs 2-D parameters, got shape {tuple(shape)}")
    if group.get("qkv_split") is not None:
        raise ValueError("tp_blocks and qkv_split cannot be combined")
    dim = group.get("tp_block_dim", 0)
    if shape[dim] % blocks:
        raise ValueError(f"tp_blocks {blocks} does not divide dimension {dim} of shape {tuple(shape)}")


def _check_heads(group: Mapping[str, Any], shape: Tuple[int, ...]) -> None:
    heads = group.get("num_heads") or 1
    if heads == 1:
        return
    if len(shape) != 2:
        raise ValueError(f"num_heads needs 2-D parameters, got shape {shape}")
    if (group.get("tp_blocks") or 1) > 1:
        raise ValueError("num_heads and tp_blocks cannot be combined")
    split = group.get("qkv_split")
    if split is None:
        if shape[0] % heads:
            raise ValueError(f"num_heads {heads} does not divide the {shape[0]} rows of shape {shape}")
        return
    q, k, v = split
    groups = group.get("num_query_groups") or 1
    if heads % groups or q % (heads // groups):
        raise ValueError(f"num_heads {heads} with qkv_split {tuple(split)} and num_query_groups {groups}: "
                         "each query group's q rows must hold num_heads / num_query_groups heads of equal size")
    rows = q // (heads // groups)
    if k % rows or v % rows:
        raise ValueError(f"num_heads {heads} gives heads of {rows} rows, which do not divide qkv_split's "
                         f"k {k} and v {v}")


def overrides_of(group: Mapping[str, Any], created: Mapping[str, Any]) -> Dict[str, float]:
    """Per-step overrides of a group: always its current lr, plus momentum, weight decay and (AdamW,
    Lion) betas when they differ from their values at session creation (``created``)."""
    out = {"lr": float(_check_value("lr", group["lr"]))}
    for key in ("momentum", "weight_decay"):
        if key in created and group.get(key) != created[key]:
            out[key] = _check_value(key, group.get(key))
    if created.get("optimizer") in _BETAS_OVERRIDABLE and "betas" in created:
        betas = _check_value("betas", group["betas"])
        if betas != tuple(created["betas"]):
            for name, value in zip(("beta1", "beta2"), betas):
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"betas must each be in [0, 1), got {group['betas']!r}")
                out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_unchanged(index: int, group: Mapping[str, Any], created: Mapping[str, Any]) -> None:
    """ValueError naming the first option of param_groups[index] that changed since the session
    was created and that no step may change (all but OVERRIDABLE): raised before a step sends
    anything, so that no change is ignored silently."""
    optimizer = created.get("optimizer")
    for key in group:
        if key in ALL_OPTIONS and key not in DEFAULTS.get(optimizer, {}) and key not in created:
            raise ValueError(
                f"param_groups[{index}][{key!r}] was set, but {key!r} is not an option of {optimizer}; "
                f"a scheduler that cycles one key over groups of different optimizers (OneCycleLR, "
                f"CyclicLR) needs cycle_momentum=False here")
    for key in DEFAULTS.get(optimizer, {}):
        if key not in created or key not in group:
            continue
        if key in OVERRIDABLE and (key != "betas" or optimizer in _BETAS_OVERRIDABLE):
            continue
        if not _same(group[key], created[key]):
            raise ValueError(
                f"param_groups[{index}][{key!r}] changed from {created[key]!r} to {group[key]!r}, but the "
                f"session fixed it at creation; between steps only lr, momentum, weight_decay and (adamw, "
                f"lion) betas may change")


def resolved_defaults(groups: Sequence[Mapping[str, Any]], given: Mapping[str, Any]) -> Dict[str, Any]:
    """``optimizer.defaults`` as torch's optimizers have it: the resolved default of every option
    that applies to every group (one optimizer: all of its options; Muon with AdamW: those they
    share, so a scheduler finds momentum or betas only where every group has it), the constructor's
    keyword where one is given (else the first group's optimizer's default), and the constructor's
    other keywords that are not options of only some groups."""
    names = list(dict.fromkeys(g["optimizer"] for g in groups))
    out: Dict[str, Any] = {}
    if names:
        for key, fallback in DEFAULTS[names[0]].items():
            if all(key in DEFAULTS[n] for n in names):
                out[key] = given.get(key, fallback)
    for key, value in given.items():
        if key not in ALL_OPTIONS or all(key in DEFAULTS[n] for n in names):
            out.setdefault(key, value)
    return out


def spec_options(group: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of a resolved group that the session fixes (everything but overridables)."""
    return {k: group[k] for k in DEFAULTS[group["optimizer"]] if k not in OVERRIDABLE}


def storage_dtype(group: Mapping[str, Any], slot: str) -> str:
    """How the daemon stores tensor ``slot`` ("master", "momentum", "exp_avg", ...) of a
    parameter of a resolved ``group``: "fp32", "bf16" or "fp16"."""
    option = _DTYPE_OPTION.get(slot)
    return (group.get(option) if option else None) or "fp32"
