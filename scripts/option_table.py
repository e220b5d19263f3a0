#!/usr/bin/env python3
"""Writes or checks the docs' tables of group options, generated from the one option table.

The table is proto/muond/v1/group_options.json (docs/architecture.md, One table of group options).
README.md and docs/algorithms.md each hold its Markdown rendering between the two marker lines
below; this script renders it and either writes it there (--write) or fails, naming the file, when
a copy differs (--check, which scripts/test.sh runs).

    python3 scripts/option_table.py --check
    python3 scripts/option_table.py --write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "proto" / "muond" / "v1" / "group_options.json"
DOCS = (ROOT / "README.md", ROOT / "docs" / "algorithms.md")
BEGIN = ("<!-- group options: generated from proto/muond/v1/group_options.json by "
         "scripts/option_table.py --write; edit the table, not these lines -->")
END = "<!-- end of the generated group options -->"


def _number(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _show(row: dict, value) -> str:
    if value is None:
        return "none"
    if row["type"] in ("choice", "coefficients"):
        return f"`{value}`"
    return _number(value)


def applies_to(row: dict) -> str:
    names = "all" if row["applies_to"] == "all" else ", ".join(row["applies_to"])
    if row.get("read_with"):  # read only with another option's value (refused otherwise, docs/protocol.md)
        gate = row["read_with"]
        shown = " or ".join(_number(v) if isinstance(v, bool) else f"`{v}`" for v in gate["values"])
        names += f" with `{gate['option']}` {shown}"
    elif row.get("read_for") == "qk_clip":  # refused in a session without pairs (docs/protocol.md)
        names += " with QK-clip pairs"
    elif row.get("muon_needs"):
        others = [n for n in row["applies_to"] if n != "muon"]
        needs = f"muon with a `{row['muon_needs']}`"
        names = ", ".join(others) + f"; {needs}" if others else needs
    if row["carrier"] == "parameter":
        names += ", per parameter"
    return names


def values(row: dict) -> str:
    if "values" in row:
        return row["values"]
    kind = row["type"]
    if kind == "choice":
        return ", ".join(f"`{c}`" for c in row["choices"])
    if kind == "bool":
        return "bool"
    limits = row.get("range")
    if limits is None:
        return kind
    if isinstance(limits, list):
        limits = ", ".join(limits)
    if limits.startswith(("[", "(")):
        return f"{kind} in {limits}"
    return f"{kind} {limits}".replace(">=", "≥").replace("<=", "≤")


def default(row: dict) -> str:
    if "default_text" in row:
        return row["default_text"]
    value = row["default"]
    if isinstance(value, dict):
        return ", ".join(f"{name} {_show(row, v)}" for name, v in value.items())
    return _show(row, value)


def name_cell(row: dict) -> str:
    python = row.get("python")
    if isinstance(python, str) and python != row["name"]:
        return f"`{row['name']}` (Python `{python}`)"
    return f"`{row['name']}`"


def render(table: dict) -> str:
    lines = [BEGIN, "| option | applies to | values | default | what it does |", "|---|---|---|---|---|"]
    for row in table["options"]:
        if row.get("in_docs", True):
            cells = (name_cell(row), applies_to(row), values(row), default(row), row["doc"])
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| coefficient set | after its last tuple | steps | source |")
    lines.append("|---|---|---|---|")
    for s in table["coefficient_sets"]:
        steps = str(s.get("steps", "any"))
        lines.append(f"| `{s['name']}` | {s['after'].replace('_', ' ')} | {steps} | {s['doc']} |")
    lines.append(END)
    return "\n".join(lines)


def replaced(text: str, block: str, path: Path) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path.relative_to(ROOT)}: no generated group options between the markers")
    return text[:start] + block + text[end + len(END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail when a doc's copy differs")
    mode.add_argument("--write", action="store_true", help="rewrite the docs' copies")
    args = parser.parse_args(argv)
    block = render(json.loads(TABLE.read_text(encoding="utf-8")))
    stale = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        new = replaced(text, block, path)
        if new != text:
            if args.write:
                path.write_text(new, encoding="utf-8")
            stale.append(str(path.relative_to(ROOT)))
    if args.check and stale:
        print("the generated group options differ from proto/muond/v1/group_options.json in: "
              + ", ".join(stale) + "; run scripts/option_table.py --write", file=sys.stderr)
        return 1
    print(f"group options: {', '.join(stale) if stale else 'every copy'} "
          f"{'written' if args.write and stale else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
