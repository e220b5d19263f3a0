"""Where the Python client's time goes in a step: the floor of one gRPC round trip on the daemon's
own endpoint, and a profile of a number of steps by function (cProfile), for the benchmarks that
measure a step's fixed cost (step_overhead_bench.py on the host, gpu_transport_bench.py on a GPU).

A profile's figures are per step, in microseconds; cProfile adds its own cost to every Python
call, so they rank the parts of a step rather than add up to an unprofiled one.
"""

import cProfile
import pstats
import statistics
import time
from typing import Callable, List, Tuple


def round_trip_floor(endpoint: str, warmup: int, calls: int) -> float:
    """The median seconds of a GetServerInfo call on a channel of its own: one unary gRPC round
    trip to the daemon with nothing in it."""
    import grpc  # noqa: PLC0415 - after the caller put muond's build on the path
    from muond._stubs import pb, pb_grpc  # noqa: PLC0415

    channel = grpc.insecure_channel(endpoint)
    try:
        stub = pb_grpc.MuondStub(channel)
        times = []
        for i in range(warmup + calls):
            started = time.perf_counter()
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            if i >= warmup:
                times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        channel.close()


def _where(key: Tuple[str, int, str]) -> str:
    """A function's short name: the last two parts of its file's path and its name, or the
    built-in's name."""
    filename, line, name = key
    if filename == "~" or line == 0:
        return name
    parts = filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({name})"


def profile_steps(step: Callable[[], None], steps: int, top: int = 12) -> List[str]:
    """Runs `step` `steps` times under cProfile; lines of the `top` functions by their own time and
    by their time with what they call, in microseconds per step, heaviest first."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    table = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, own s, with callees s, callers)
    whole = sum(own for _, _, own, _, _ in table.values()) / steps * 1e6
    lines = [f"{steps} steps profiled, {whole:.0f} us of a step's own time in all (profiled)"]
    for title, column in (("own time", 2), ("with what it calls", 3)):
        lines.append(f"by {title} (us per step, calls per step):")
        ranked = sorted(table.items(), key=lambda item: item[1][column], reverse=True)[:top]
        for key, row in ranked:
            lines.append(f"  {row[column] / steps * 1e6:9.1f}  {row[1] / steps:6.1f}  {_where(key)}")
    return lines
