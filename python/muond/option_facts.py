"""The facts of a parameter group's options, in one place for the Python client: the optimizers,
each optimizer's options with their defaults, the Newton–Schulz coefficient sets, the names each
named option accepts, and the shapes of the matrices Muon orthogonalizes and of the optimizer slots.

They are the daemon's facts (kernels/optim/options.cc, server/rpc/group_option_table.cc, the
optimizers' shape rules), written once here for ``options`` (the client's early checks),
``local`` (the in-process reference optimizer) and ``optimizer``; tests/python/test_option_table.py
compares them with what the daemon's print_option_table tool prints.

Constants and pure functions; no shared state.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

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

# The names each named option accepts, in the order of the daemon's enums
# (server/rpc/group_option_table.cc).
NAMED_VALUES: Dict[str, Tuple[str, ...]] = {
    "weight_decay_mode": ("decoupled", "independent", "l2", "cautious"),
    "moment2_method": ("none", "adamuon", "normuon"),
    "ns_algorithm": ("standard", "gram", "auto"),
    "momentum_style": ("ema", "sum"),
    "ns_coefficients_after": ("cycle", "repeat_last"),
    "scale_mode": ("shape_scaling", "spectral", "unit_rms_norm"),
    "matmul_precision": ("fp32", "tf32", "bf16"),
    "master_dtype": ("fp32", "bf16", "fp16"),
    "momentum_dtype": ("fp32", "bf16", "fp16"),
    "exp_avg_dtype": ("fp32", "bf16", "fp16"),
    "exp_avg_sq_dtype": ("fp32", "bf16", "fp16"),
    "clip_scope": ("global", "group", "none"),
}

# Each optimizer's options and their defaults, by the Python client's names (betas for beta1 and
# beta2; qkv_split, num_query_groups, tp_blocks and tp_block_dim travel with each parameter). None:
# left unset on the wire, so the daemon's default applies.
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
        "clip_scope": None, "max_grad_norm": None,
        "telemetry": True, "warn_clip_below": 0.01, "warn_clip_steps": 10,
        "warn_stale_steps": 100, "warn_residual_above": None,
    },
    "adamw": {"lr": 1e-3, "weight_decay": 0.01, "weight_decay_mode": "decoupled", "betas": (0.9, 0.999),
              "eps": 1e-8, "master_dtype": None, "exp_avg_dtype": None, "exp_avg_sq_dtype": None,
              "clip_scope": None, "max_grad_norm": None,
              "telemetry": True, "warn_stale_steps": 100},
    "lion": {"lr": 1e-4, "weight_decay": 0.0, "betas": (0.9, 0.99), "master_dtype": None,
             "exp_avg_dtype": None, "clip_scope": None, "max_grad_norm": None,
             "telemetry": True, "warn_stale_steps": 100},
    "sgd": {"lr": 1e-2, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False, "master_dtype": None,
            "momentum_dtype": None, "clip_scope": None, "max_grad_norm": None,
            "telemetry": True, "warn_stale_steps": 100},
}
# Options of a Muon group that only its second moment (moment2_method) reads.
MUON_MOMENT2 = ("beta2", "eps", "exp_avg_sq_dtype")


def coefficient_at(coefficients: Sequence[Tuple[float, float, float]], after: str,
                   t: int) -> Tuple[float, float, float]:
    """The (a, b, c) of Newton–Schulz iteration ``t``: the list's, then ``after`` it ends
    ("cycle" from the start, or "repeat_last")."""
    if t < len(coefficients):
        return coefficients[t]
    return coefficients[t % len(coefficients)] if after == "cycle" else coefficients[-1]


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
