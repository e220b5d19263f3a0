#!/usr/bin/env python3
"""Fails when a document names a path of this repository that does not exist: every `code span`
that looks like a path (it has a "/" and no spaces) in the given Markdown files (default:
docs/architecture.md), looked up from the repository's root and, for the short forms the document
uses inside a layer's section, from each top-level source folder (server/, kernels/, client/,
python/muond/, tools/). Placeholders are skipped: a folder `x` or a name with `x_` or `X` standing
for any module, a glob, `<...>`. scripts/test.sh runs it.

    scripts/check_doc_paths.py [FILE.md ...]
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASES = ["", "server/", "kernels/", "client/", "python/muond/", "python/", "tools/", "tests/"]
SPAN = re.compile(r"`([^`\s]+)`")


def looks_like_path(text: str) -> bool:
    if "/" not in text or text.startswith(("/", "http", "-", "$")) or "://" in text:
        return False
    if any(mark in text for mark in ("*", "<", ">", "{", "=", "(", "…", "...")):
        return False
    parts = text.rstrip("/").split("/")
    name = parts[-1]
    return not ("x" in parts or name.startswith("x_") or name.startswith("X") or "_x." in name)


def missing_in(document: Path):
    for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
        for match in SPAN.finditer(line):
            path = match.group(1).rstrip(".,:;")
            if looks_like_path(path) and not any((ROOT / base / path).exists() for base in BASES):
                yield number, path


def main(argv) -> int:
    documents = [Path(a) for a in argv[1:]] or [ROOT / "docs" / "architecture.md"]
    problems = [(doc, n, p) for doc in documents for n, p in missing_in(doc)]
    for doc, number, path in problems:
        print(f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}:{number}: `{path}` does not exist")
    if not problems:
        print(f"paths: every path {', '.join(d.name for d in documents)} names exists")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
