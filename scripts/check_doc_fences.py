#!/usr/bin/env python3
"""Fails when a Markdown file of this repository has a code fence that does not close: a closing
fence followed by text on its line is not one (CommonMark), so everything after it would render as
code, up to the next fence. Checks every tracked *.md file, or the given ones. scripts/test.sh
runs it.

    scripts/check_doc_fences.py [FILE.md ...]
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def fence_problems(document: Path):
    """(line, what) for each fence that fails to close, and for one left open at the end."""
    opened = None  # (line, fence characters) of the fence that opened the current block
    for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if not match:
            continue
        marks, rest = match.groups()
        if opened is None:
            opened = (number, marks)
        elif marks[0] == opened[1][0] and len(marks) >= len(opened[1]):
            if rest.strip():
                yield number, f"text after the fence that should close line {opened[0]}'s block"
            else:
                opened = None
    if opened is not None:
        yield opened[0], "a code block that never closes"


def main(argv) -> int:
    if argv[1:]:
        documents = [Path(a) for a in argv[1:]]
    else:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.md"], capture_output=True, text=True,
                                check=True).stdout.split()
        documents = [ROOT / name for name in listed]
    problems = [(doc, n, what) for doc in documents for n, what in fence_problems(doc)]
    for doc, number, what in problems:
        print(f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}:{number}: {what}")
    if not problems:
        print(f"fences: every code block of {len(documents)} Markdown files closes")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
