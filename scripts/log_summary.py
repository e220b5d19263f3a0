#!/usr/bin/env python3
"""Summarizes a muond log written with --log-format json: how many warnings and errors it holds, by
event, with the first message of each. scripts/demo.sh prints it when the demo ends.

    scripts/log_summary.py LOG
"""

import collections
import json
import sys


def summarize(path: str) -> str:
    by_event = collections.OrderedDict()  # (level, event) -> [count, first message]
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            for line in log:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # not an event (a line written before logging was set up)
                level = entry.get("level", "")
                if level not in ("warning", "error", "critical"):
                    continue
                key = (level, entry.get("event") or "other")
                if key not in by_event:
                    by_event[key] = [0, entry.get("message", "")]
                by_event[key][0] += 1
    except OSError as err:
        return f"muond's log {path}: cannot be read ({err.strerror})"
    if not by_event:
        return f"muond's log ({path}): no warnings, no errors"
    total = sum(count for count, _ in by_event.values())
    lines = [f"muond's log ({path}): {total} warning{'s' if total != 1 else ''} or error"
             f"{'s' if total != 1 else ''}"]
    for (level, event), (count, first) in by_event.items():
        lines.append(f"  {level} {event} x{count}, first: {first}")
    return "\n".join(lines)


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(summarize(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
