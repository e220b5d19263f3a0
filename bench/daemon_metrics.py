"""Where a daemon's time went, from its Prometheus metrics (--metrics-listen), for the benchmarks
that time steps from a client: each call's handler time (muond_call_duration_seconds, by method) and
each step phase's (muond_step_phase_duration_seconds: receive, compute, send, by transport), read
before and after the timed steps. What a step took beyond its handler is the client's side and the
call itself.
"""

import re
import urllib.request
from typing import Dict, NamedTuple, Optional, Tuple

_CALL = re.compile(r'muond_call_duration_seconds_(sum|count)\{method="(\w+)"[^}]*\} (\S+)')
_PHASE = re.compile(r'muond_step_phase_duration_seconds_(sum|count)\{phase="(\w+)",transport="(\w+)"\} (\S+)')
PHASES = ("receive", "compute", "send")

Totals = Dict[Tuple[str, ...], Tuple[float, float]]  # ("call", method) or ("phase", transport, phase) → (sum s, count)


def read(metrics_port: int) -> Totals:
    """The daemon's call and phase durations so far, summed over their other labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    totals: Totals = {}

    def add(key: Tuple[str, ...], kind: str, value: str) -> None:
        total, count = totals.get(key, (0.0, 0.0))
        totals[key] = (total + float(value), count) if kind == "sum" else (total, count + float(value))

    for kind, method, value in _CALL.findall(text):
        add(("call", method), kind, value)
    for kind, phase, transport, value in _PHASE.findall(text):
        add(("phase", transport, phase), kind, value)
    return totals


class Breakdown(NamedTuple):
    """Means over the steps between two readings: the handler of the call that carried them (the
    method whose count grew the most) and each phase of the transport's steps (None: no step)."""
    method: str
    handler: float
    phases: Dict[str, Optional[float]]

    def describe(self) -> str:
        phases = ", ".join(f"{p} {s * 1e3:.3f}" if s is not None else f"{p} -" for p, s in self.phases.items())
        return f"{self.method} handler {self.handler * 1e3:.3f} ms ({phases} ms)"


def _mean(before: Totals, after: Totals, key: Tuple[str, ...]) -> Optional[float]:
    total, count = after.get(key, (0.0, 0.0))
    total0, count0 = before.get(key, (0.0, 0.0))
    return (total - total0) / (count - count0) if count > count0 else None


def breakdown(before: Totals, after: Totals, transport: str) -> Breakdown:
    """The handler and phase means of the steps over ``transport`` between ``before`` and ``after``."""
    calls = [key for key in after if key[0] == "call"]
    grown = max(calls, key=lambda key: after[key][1] - before.get(key, (0.0, 0.0))[1])
    handler = _mean(before, after, grown)
    return Breakdown(grown[1], handler if handler is not None else float("nan"),
                     {phase: _mean(before, after, ("phase", transport, phase)) for phase in PHASES})
