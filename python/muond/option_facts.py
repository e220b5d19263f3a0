"""The facts of a parameter group's options for the Python client: the optimizers, each optimizer's
options with their defaults, which of them a step may change, the Newton–Schulz coefficient sets,
the names each named option accepts, and the shapes of the matrices Muon orthogonalizes and of the
optimizer slots.

Every fact about an option comes from the one option table, proto/muond/v1/group_options.json,
which the package carries beside its gRPC stubs (``muond._proto``) and the daemon embeds; only the
Python client's spelling is decided here (``betas`` for beta1 and beta2 where an optimizer reads
both; the per-parameter options of carrier "parameter" given per group). ``options`` (the client's
early checks), ``local`` (the in-process reference optimizer) and ``optimizer`` read these names;
tests/python/test_option_table.py compares them with the daemon's use of the same table.

Constants and pure functions; no shared state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple

from ._stubs import pb

# Beside the stubs, in muond._proto (copied there by _codegen.py).
TABLE_FILE = Path(pb.__file__).with_name("group_options.json")
TABLE: Dict[str, Any] = json.loads(TABLE_FILE.read_text(encoding="utf-8"))

OPTIMIZERS: Tuple[str, ...] = tuple(TABLE["optimizers"])
# Rows of the table by name, in its order.
ROWS: Dict[str, Dict[str, Any]] = {row["name"]: row for row in TABLE["options"]}


def _applies(row: Mapping[str, Any], optimizer: str) -> bool:
    return row["applies_to"] == "all" or optimizer in row["applies_to"]


def _default(row: Mapping[str, Any], optimizer: str) -> Any:
    value = row["default"]
    return value.get(optimizer) if isinstance(value, dict) else value


def _fold(tuples: Sequence[Sequence[float]], safety: float) -> Tuple[Tuple[float, float, float], ...]:
    if safety == 1.0:
        return tuple((float(a), float(b), float(c)) for a, b, c in tuples)
    return tuple((a / safety, b / safety ** 3, c / safety ** 5) for a, b, c in tuples)


# The named Newton–Schulz sets, each with its safety factor folded in as (a/s, b/s³, c/s⁵).
COEFFICIENT_SETS: Dict[str, Tuple[Tuple[float, float, float], ...]] = {
    s["name"]: _fold(s["tuples"], s.get("safety", 1.0)) for s in TABLE["coefficient_sets"]}
# What happens after a named list ends.
COEFFICIENTS_AFTER: Dict[str, str] = {s["name"]: s["after"] for s in TABLE["coefficient_sets"]}
# Iterations before which ns_algorithm="gram" restarts from X (a named set's own schedule).
GRAM_RESTARTS: Dict[str, Tuple[int, ...]] = {
    s["name"]: tuple(s["gram_restarts"]) for s in TABLE["coefficient_sets"] if s.get("gram_restarts")}
# The only ns_steps a set is tuned for.
SET_STEPS: Dict[str, int] = {s["name"]: s["steps"] for s in TABLE["coefficient_sets"] if "steps" in s}

# The names each named option accepts, in the order of the daemon's enums.
NAMED_VALUES: Dict[str, Tuple[str, ...]] = {
    row["name"]: tuple(row["choices"]) for row in TABLE["options"]
    if row["type"] == "choice" and row.get("python", True) is not False}


def _python_options(optimizer: str) -> Dict[str, Any]:
    """The Python client's options of ``optimizer`` and their defaults, in the table's order: beta1
    and beta2 become ``betas`` where the optimizer reads both; None leaves the field unset, so the
    daemon's default applies."""
    out: Dict[str, Any] = {}
    pair = all(_applies(ROWS[name], optimizer) for name in ("beta1", "beta2"))
    for row in TABLE["options"]:
        if row.get("python", True) is False or not _applies(row, optimizer):
            continue
        value = None if row.get("unset_in_client") else _default(row, optimizer)
        if pair and str(row.get("python", "")).startswith("betas["):
            out["betas"] = (_default(ROWS["beta1"], optimizer), _default(ROWS["beta2"], optimizer))
            continue
        out[row["name"]] = value
    return out


# Each optimizer's options and their defaults, by the Python client's names. None: left unset on
# the wire, so the daemon's default applies.
DEFAULTS: Dict[str, Dict[str, Any]] = {name: _python_options(name) for name in OPTIMIZERS}
# What a choice brings: {option: {choice: {other option: value}}} (ns_preconditioner aol: the aol
# set and 4 steps), applied together when a group gives none of them, as the daemon applies them.
CHOICE_DEFAULTS: Dict[str, Dict[str, Dict[str, Any]]] = {
    row["name"]: row["choice_defaults"] for row in TABLE["options"] if "choice_defaults" in row}


def _bounds(text: Any) -> Tuple[str, Tuple[Tuple[str, float], ...]]:
    """A row's range as (its interval text or "", its bounds (op, value)), read as the daemon reads
    it (kernels/optim/option_table.cc, ParseRange)."""
    parts = text if isinstance(text, list) else [text]
    interval, bounds = "", []
    for part in (p.strip() for p in parts):
        if part[0] in "[(":
            lo, hi = (float(v) for v in part[1:-1].split(","))
            bounds += [(">=" if part[0] == "[" else ">", lo), ("<=" if part[-1] == "]" else "<", hi)]
            interval = part
        else:
            op = part[:len(part) - len(part.lstrip("<>="))]
            bounds.append((op, float(part[len(op):])))
    return interval, tuple(bounds)


# Each ranged option's range: (the name its refusals use, its interval text or "", its bounds).
RANGES: Dict[str, Tuple[str, str, Tuple[Tuple[str, float], ...]]] = {
    row["name"]: (row.get("label", row["name"]), *_bounds(row["range"]))
    for row in TABLE["options"] if "range" in row}
_HOLDS = {">": lambda v, b: v > b, ">=": lambda v, b: v >= b, "<": lambda v, b: v < b,
          "<=": lambda v, b: v <= b}


def range_error(name: str, value: float) -> str:
    """Why ``value`` is outside option ``name``'s range, in the daemon's words ("" when inside, or
    for an option without one); every value must also be finite."""
    if name not in RANGES:
        return ""
    label, interval, bounds = RANGES[name]
    finite = value == value and abs(value) != float("inf")
    got = int(value) if ROWS[name]["type"] == "int" and finite else f"{value:g}"
    if interval:
        inside = finite and all(_HOLDS[op](value, b) for op, b in bounds)
        return "" if inside else f"{label} must be in {interval}, got {got}"
    for op, b in bounds:
        if not (finite and _HOLDS[op](value, b)):
            return f"{label} must be {op} {b:g}, got {got}"
    return ""


# Options a group reads only while another holds one of some values (the table's read_with, e.g.
# heloco_kappa with heloco true): name → (that option, those values).
READ_WITH: Dict[str, Tuple[str, Tuple[Any, ...]]] = {
    row["name"]: (row["read_with"]["option"], tuple(row["read_with"]["values"]))
    for row in TABLE["options"] if "read_with" in row}

# Options only QK-clip reads (the table's read_for qk_clip): refused at other than their default in
# a session that names no QK-clip pair.
READ_FOR_QK_CLIP: Tuple[str, ...] = tuple(
    row["name"] for row in TABLE["options"] if row.get("read_for") == "qk_clip")


# Options of a Muon group that only its second moment (moment2_method) reads.
MUON_MOMENT2: Tuple[str, ...] = tuple(
    row["name"] for row in TABLE["options"] if row.get("muon_needs") == "moment2_method")


def _per_step(row: Mapping[str, Any]) -> Tuple[str, ...]:
    value = row.get("per_step", False)
    return OPTIMIZERS if value is True else tuple(value or ())


# Options a step may override (GroupOverride), by the Python client's names, and for which
# optimizers: what torch's schedulers and trainers change between steps.
PER_STEP: Dict[str, Tuple[str, ...]] = {}
for _row in TABLE["options"]:
    if _per_step(_row):
        _name = "betas" if str(_row.get("python", "")).startswith("betas[") else _row["name"]
        PER_STEP[_name] = tuple(dict.fromkeys(PER_STEP.get(_name, ()) + _per_step(_row)))


def coefficient_at(coefficients: Sequence[Tuple[float, float, float]], after: str,
                   t: int) -> Tuple[float, float, float]:
    """The (a, b, c) of Newton–Schulz iteration ``t``: the list's, then ``after`` it ends
    ("cycle" from the start, or "repeat_last")."""
    if t < len(coefficients):
        return coefficients[t]
    return coefficients[t % len(coefficients)] if after == "cycle" else coefficients[-1]


def matrix_shapes(group: Mapping[str, Any], shape: Tuple[int, ...]) -> list:
    """The (rows, cols) of each matrix Muon orthogonalizes in a parameter of ``shape``, in the
    daemon's order: heads (num_heads), tensor-parallel blocks, QKV blocks per query group, each
    expert of a 3-D stack, else (O, rest)."""
    shape = tuple(int(d) for d in shape)
    heads = group.get("num_heads") or 1
    if heads > 1 and len(shape) == 2:
        return [(head_rows(group, shape), shape[1])] * (shape[0] // head_rows(group, shape))
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


def head_rows(group: Mapping[str, Any], shape: Tuple[int, ...]) -> int:
    """The rows of one head of a 2-D parameter under num_heads: rows / num_heads, or with a fused
    QKV weight the query heads' size, q / (num_heads / num_query_groups)."""
    heads = group.get("num_heads") or 1
    if group.get("qkv_split") is not None:
        return group["qkv_split"][0] // max(1, heads // (group.get("num_query_groups") or 1))
    return int(shape[0]) // heads


def slot_shape(group: Mapping[str, Any], shape: Tuple[int, ...], slot: str) -> Tuple[int, ...]:
    """The shape of optimizer slot ``slot`` of a parameter of ``shape`` in ``group``: the
    parameter's, except NorMuon's second moment (one value per row, or per column of a wide
    matrix; torch's keepdim shape for a plain matrix, flat otherwise; NAMO's one value per matrix and
    NAMO-D's one per column of each, flat)."""
    shape = tuple(int(d) for d in shape)
    if slot == "moment2" and group.get("moment2_method") in ("namo", "namo_d"):
        per_column = group["moment2_method"] == "namo_d"
        return (sum(c if per_column else 1 for _, c in matrix_shapes(group, shape)),)
    if slot != "moment2" or group.get("moment2_method") != "normuon":
        return shape
    if len(shape) == 2 and group.get("qkv_split") is None and (group.get("tp_blocks") or 1) == 1 \
            and (group.get("num_heads") or 1) == 1:
        return (shape[0], 1) if shape[0] >= shape[1] else (1, shape[1])
    return (sum(max(r, c) for r, c in matrix_shapes(group, shape)),)


def muon_scale(group: Mapping[str, Any], rows: int, cols: int) -> float:
    """The update scale of a (rows × cols) matrix under the group's ``scale_mode``, times its
    ``extra_scale_factor`` (the daemon's UpdateScale)."""
    mode, factor = group["scale_mode"], group["extra_scale_factor"]
    if mode == "shape_scaling":
        return factor * math.sqrt(max(1.0, rows / cols))
    if mode == "spectral":
        return factor * math.sqrt(max(rows, cols))
    return factor * math.sqrt(rows / cols)  # unit_rms_norm
