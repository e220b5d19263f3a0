"""Parameter-group options: one vocabulary shared with the daemon and the C++ client.

A torch param group is a dict. ``resolve_group`` fills in every option that applies to the
group's optimizer with the documented default, checks names and values, and rejects options that
do not apply (``momentum`` in an AdamW group, a typo such as ``ns_step``). ``group_options_proto``
turns a resolved group into the ``muond.v1.GroupOptions`` message sent when a session is created.

| option                  | applies to   | default                                                  |
|-------------------------|--------------|----------------------------------------------------------|
| optimizer / use_muon    | all          | "muon" (``use_muon=False`` means "adamw")                 |
| lr                      | all          | muon 0.02, adamw 1e-3, lion 1e-4, sgd 1e-2               |
| weight_decay            | all          | muon 0, adamw 0.01, lion 0, sgd 0                        |
| weight_decay_mode       | muon, adamw  | "decoupled" (muon: "independent", "l2", "cautious";      |
|                         |              | adamw: "l2", i.e. Adam with coupled L2 as torch.optim.Adam) |
| momentum, nesterov      | muon, sgd    | muon 0.95 / True, sgd 0 / False                          |
| momentum_style          | muon         | "ema" ("sum")                                            |
| ns_steps                | muon         | 5                                                        |
| ns_coefficients         | muon         | "simple" (quintic, polar_express, cans, aol, deepseekv4, |
|                         |              | cubic5 with ns_steps=5, gram_polar_express) or a list    |
|                         |              | of (a, b, c) tuples (one tuple is accepted as well)       |
| ns_coefficients_after   | muon         | None: the set's own rule; a custom list cycles            |
| ns_algorithm            | muon         | "standard" ("gram": on the Gram matrix, gram_polar_express) |
| ns_eps, ns_norm_safety  | muon         | 1e-7, 1.0                                                |
| scale_mode              | muon         | "shape_scaling" ("spectral", "unit_rms_norm")            |
| extra_scale_factor      | muon         | 1.0                                                      |
| matmul_precision        | muon         | None: the daemon's backend default (CPU fp32, GPU bf16)  |
| qkv_split               | muon         | None; (q, k, v) rows, for every parameter of the group   |
| num_query_groups        | muon         | None (1 when qkv_split is given)                         |
| tp_blocks, tp_block_dim | muon         | None, 0; tensor-parallel blockwise Muon: every 2-D       |
|                         |              | parameter is tp_blocks shards along dim 0 (rows) or 1    |
| qk_clip_threshold/alpha | muon         | 100.0, 0.5                                               |
| moment2_method          | muon         | None ("adamuon", "normuon": a second moment on the update) |
| beta2, eps (muon)       | muon         | 0.95, 1e-8; only with a moment2_method                   |
| betas                   | adamw, lion  | adamw (0.9, 0.999), lion (0.9, 0.99)                     |
| eps                     | adamw        | 1e-8                                                     |
| master_dtype            | all          | None = "fp32" ("bf16", "fp16"; or torch.bfloat16, ...)   |
| momentum_dtype          | muon, sgd    | None = "fp32"; the momentum slot's storage format        |
| exp_avg_dtype           | adamw, lion  | None = "fp32"                                            |
| exp_avg_sq_dtype        | adamw, muon  | None = "fp32"; muon: only with a moment2_method (moment2) |

The *_dtype options choose how the daemon stores masters and optimizer state (Megatron-Core's
precision-aware optimizer); every step still computes in fp32 and rounds to nearest even when it
stores.

Pure functions; no shared state.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from ._stubs import pb

OPTIMIZERS = ("muon", "adamw", "lion", "sgd")

COEFFICIENT_SETS: Dict[str, Tuple[Tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
    # Keller Jordan's tuple ×8, then (2, -1.5, 0.5) ×2; meant for ns_steps=10.
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    # The Polar Express paper's first five tuples with safety 1.05 folded in (a/1.05, b/1.05**3,
    # c/1.05**5), for ns_algorithm="gram", which restarts before iteration 2.
    "gram_polar_express": tuple(
        (a / 1.05, b / 1.05 ** 3, c / 1.05 ** 5) for a, b, c in (
            (8.28721201814563, -23.595886519098837, 17.300387312530933),
            (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
            (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
            (3.3184196573706015, -2.488488024314874, 0.51004894012372),
            (2.300652019954817, -1.6689039845747493, 0.4188073119525673))),
    # Cubic steps (c = 0), tuned for exactly ns_steps=5.
    "cubic5": ((3.3656576, -3.3420992, 0.0), (2.5744352, -1.4957376, 0.0), (2.5368962, -1.4312570, 0.0),
               (2.4418906, -1.2764040, 0.0), (2.2230472, -0.9630650, 0.0)),
}
# What happens after a named list ends.
COEFFICIENTS_AFTER = {"simple": "cycle", "quintic": "cycle", "polar_express": "repeat_last",
                      "cans": "repeat_last", "aol": "cycle", "deepseekv4": "repeat_last",
                      "cubic5": "repeat_last", "gram_polar_express": "repeat_last"}
# Iterations before which ns_algorithm="gram" restarts from X (a named set's own schedule).
GRAM_RESTARTS = {"gram_polar_express": (2,)}

_CHOICES = {
    "weight_decay_mode": ("decoupled", "independent", "l2", "cautious"),
    "moment2_method": ("none", "adamuon", "normuon"),
    "ns_algorithm": ("standard", "gram"),
    "momentum_style": ("ema", "sum"),
    "ns_coefficients_after": ("cycle", "repeat_last"),
    "scale_mode": ("shape_scaling", "spectral", "unit_rms_norm"),
    "matmul_precision": ("bf16", "tf32", "fp32"),
    "master_dtype": ("fp32", "bf16", "fp16"),
    "momentum_dtype": ("fp32", "bf16", "fp16"),
    "exp_avg_dtype": ("fp32", "bf16", "fp16"),
    "exp_avg_sq_dtype": ("fp32", "bf16", "fp16"),
}
# Storage formats by torch's names too (Megatron-Core's configuration takes torch dtypes).
_DTYPE_ALIASES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                  "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# The option that sets the storage format of each state tensor.
_DTYPE_OPTION = {"master": "master_dtype", "momentum": "momentum_dtype",
                 "momentum_buffer": "momentum_dtype", "exp_avg": "exp_avg_dtype",
                 "exp_avg_sq": "exp_avg_sq_dtype", "moment2": "exp_avg_sq_dtype"}

_MUON_ONLY = ("momentum_style", "ns_steps", "ns_coefficients", "ns_algorithm",
              "ns_coefficients_after", "ns_eps", "ns_norm_safety", "scale_mode",
              "extra_scale_factor", "matmul_precision", "qkv_split", "num_query_groups",
              "tp_blocks", "tp_block_dim",
              "qk_clip_threshold", "qk_clip_alpha", "moment2_method")

DEFAULTS: Dict[str, Dict[str, Any]] = {
    "muon": {
        "lr": 0.02, "weight_decay": 0.0, "weight_decay_mode": "decoupled", "momentum": 0.95,
        "nesterov": True, "momentum_style": "ema", "ns_steps": 5, "ns_coefficients": "simple",
        "ns_algorithm": "standard",
        "ns_coefficients_after": None, "ns_eps": 1e-7, "ns_norm_safety": 1.0,
        "scale_mode": "shape_scaling", "extra_scale_factor": 1.0, "matmul_precision": None,
        "qkv_split": None, "num_query_groups": None, "tp_blocks": None, "tp_block_dim": 0,
        "qk_clip_threshold": 100.0,
        "qk_clip_alpha": 0.5, "moment2_method": None, "beta2": 0.95, "eps": 1e-8,
        "master_dtype": None, "momentum_dtype": None, "exp_avg_sq_dtype": None,
    },
    "adamw": {"lr": 1e-3, "weight_decay": 0.01, "weight_decay_mode": "decoupled", "betas": (0.9, 0.999),
              "eps": 1e-8, "master_dtype": None, "exp_avg_dtype": None, "exp_avg_sq_dtype": None},
    "lion": {"lr": 1e-4, "weight_decay": 0.0, "betas": (0.9, 0.99), "master_dtype": None,
             "exp_avg_dtype": None},
    "sgd": {"lr": 1e-2, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False, "master_dtype": None,
            "momentum_dtype": None},
}

ALL_OPTIONS = frozenset(k for d in DEFAULTS.values() for k in d)
# Options of a Muon group that only its second moment (moment2_method) reads.
_MUON_MOMENT2 = ("beta2", "eps", "exp_avg_sq_dtype")
# Keys a group may carry besides options: torch's own, lr schedulers', and a display name.
_PASSTHROUGH = frozenset({"params", "param_names", "initial_lr", "name"})
# Options a step may override (GroupOverride); every other option is fixed by the session.
OVERRIDABLE = ("lr", "momentum", "weight_decay")


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
    if key == "nesterov":
        return bool(value)
    if key == "tp_blocks" and (int(value) != value or value < 1):
        raise ValueError(f"tp_blocks must be an integer >= 1, got {value!r}")
    if key == "tp_block_dim" and value not in (0, 1):
        raise ValueError(f"tp_block_dim must be 0 (rows) or 1 (columns), got {value!r}")
    if key in ("ns_steps", "num_query_groups", "tp_blocks", "tp_block_dim"):
        if int(value) != value:
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if key == "betas":
        betas = tuple(float(b) for b in value)
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
    return float(value)


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
                raise ValueError(f"option {key!r} applies to a muon group only with moment2_method "
                                 "'adamuon' or 'normuon'")
    if name == "muon" and resolved["ns_coefficients"] == "cubic5" and resolved["ns_steps"] != 5:
        raise ValueError("ns_steps must be 5 with ns_coefficients cubic5 (its coefficients are tuned "
                         f"for exactly 5 steps), got {resolved['ns_steps']}")
    if name == "muon" and resolved["tp_block_dim"] != 0 and (resolved["tp_blocks"] or 1) == 1:
        raise ValueError("tp_block_dim applies only with tp_blocks > 1")
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


def coefficient_schedule(group: Mapping[str, Any]) -> Tuple[Tuple[Tuple[float, float, float], ...], str]:
    """The (a, b, c) list of a resolved Muon group and what happens after it ends."""
    value = group["ns_coefficients"]
    if isinstance(value, str):
        return COEFFICIENT_SETS[value], COEFFICIENTS_AFTER[value]
    return tuple(value), group.get("ns_coefficients_after") or "cycle"


_KIND = {"muon": pb.OPTIMIZER_MUON, "adamw": pb.OPTIMIZER_ADAMW, "lion": pb.OPTIMIZER_LION,
         "sgd": pb.OPTIMIZER_SGD}
_SCALAR_FIELDS = ("lr", "weight_decay", "weight_decay_mode", "momentum", "nesterov",
                  "momentum_style", "ns_steps", "ns_coefficients_after", "ns_eps", "ns_norm_safety",
                  "scale_mode", "extra_scale_factor", "matmul_precision", "qk_clip_threshold",
                  "qk_clip_alpha", "moment2_method", "ns_algorithm", "master_dtype",
                  "momentum_dtype", "exp_avg_dtype")


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


def check_parameter(group: Mapping[str, Any], shape: Tuple[int, ...]) -> None:
    """The daemon's checks of a Muon parameter's tp_blocks against its shape; ValueError."""
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


def matrix_shapes(group: Mapping[str, Any], shape: Tuple[int, ...]) -> list:
    """The (rows, cols) of each matrix Muon orthogonalizes in a parameter of ``shape``, in the
    daemon's order: tensor-parallel blocks, QKV blocks per query group, each expert of a 3-D
    stack, else (O, rest)."""
    shape = tuple(int(d) for d in shape)
    blocks = group.get("tp_blocks") or 1
    if blocks > 1:
        if group.get("tp_block_dim", 0) == 0:
            return [(shape[0] // blocks, shape[1])] * blocks
        return [(shape[0], shape[1] // blocks)] * blocks
    if group.get("qkv_split") is not None:
        cols = shape[1]
        return [(rows, cols) for _ in range(group.get("num_query_groups") or 1)
                for rows in group["qkv_split"]]
    if len(shape) == 3:
        return [(shape[1], shape[2])] * shape[0]
    numel = 1
    for d in shape:
        numel *= d
    return [(shape[0], numel // shape[0])]


def slot_shape(group: Mapping[str, Any], shape: Tuple[int, ...], slot: str) -> Tuple[int, ...]:
    """The shape of optimizer slot ``slot`` of a parameter of ``shape`` in ``group``: the
    parameter's, except NorMuon's second moment (one value per row, or per column of a wide
    matrix; torch's keepdim shape for a plain matrix, flat otherwise)."""
    shape = tuple(int(d) for d in shape)
    if slot != "moment2" or group.get("moment2_method") != "normuon":
        return shape
    if len(shape) == 2 and group.get("qkv_split") is None and (group.get("tp_blocks") or 1) == 1:
        return (shape[0], 1) if shape[0] >= shape[1] else (1, shape[1])
    return (sum(max(r, c) for r, c in matrix_shapes(group, shape)),)


def overrides_of(group: Mapping[str, Any], created: Mapping[str, Any]) -> Dict[str, float]:
    """Per-step overrides of a group: always its current lr, plus momentum and weight decay when
    they differ from their values at session creation (``created``)."""
    out = {"lr": float(_check_value("lr", group["lr"]))}
    for key in ("momentum", "weight_decay"):
        if key in created and group.get(key) != created[key]:
            out[key] = float(group[key])
    return out


def spec_options(group: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of a resolved group that the session fixes (everything but overridables)."""
    return {k: group[k] for k in DEFAULTS[group["optimizer"]] if k not in OVERRIDABLE}


def storage_dtype(group: Mapping[str, Any], slot: str) -> str:
    """How the daemon stores tensor ``slot`` ("master", "momentum", "exp_avg", ...) of a
    parameter of a resolved ``group``: "fp32", "bf16" or "fp16"."""
    option = _DTYPE_OPTION.get(slot)
    return (group.get(option) if option else None) or "fp32"
