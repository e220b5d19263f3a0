"""Imports the generated protobuf and gRPC modules of the muond.v1 API.

They live in ``muond._proto`` and are produced at build or install time (see ``_codegen.py``), so
a source checkout has no copy of them. This module turns the bare ImportError of a missing copy
into a message that says how to make one.
"""

try:
    from ._proto import muond_pb2 as pb
    from ._proto import muond_pb2_grpc as pb_grpc
except ImportError as err:  # pragma: no cover - exercised only in a half-built checkout
    raise ImportError(
        "the muond gRPC stubs are missing (muond._proto); install the package with "
        "`pip install ./python`, build with `cmake --build build` and put build/python on "
        "PYTHONPATH, or run `python3 python/muond/_codegen.py --proto-root proto --out python`"
    ) from err

__all__ = ["pb", "pb_grpc"]
