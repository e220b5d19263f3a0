"""Streaming host copies: the client's native ``memcpy`` whose stores bypass the caches.

``muond/_stream_copy.c`` is built with the package (``pip install ./python``, where it is optional:
without a C compiler the package installs without it) and by the CMake build (into
``build/python/muond``). This module finds it beside the package and loads it with ctypes, which
releases the GIL around each call. ``MUOND_STREAM_COPY=sse2`` keeps it to 16-byte stores (what a
CPU without AVX runs). When it is missing, or ``MUOND_STREAM_COPY=0`` is set, ``available()`` is
false, ``reason()`` says why (logged once at INFO on ``muond``) and callers copy with torch's
``copy_`` as before.

``copy(dst, src)`` takes two contiguous CPU tensors of the same dtype and size, not overlapping.
Thread-safe; the library is loaded on first use.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.machinery
import logging
import os
import sys
import threading

import torch

ENV = "MUOND_STREAM_COPY"

_lock = threading.Lock()
_loaded = False
_copy = None
_kind = ""
_reason = ""
_sse2_only = 0


def _library_paths():
    # The package may span a source and a build folder (muond/__init__.py extends its __path__); it
    # is imported before any of its modules, so it is read here, not imported.
    package = sys.modules[__name__.split(".", 1)[0]]
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for folder in package.__path__:
        for suffix in suffixes:
            yield from sorted(glob.glob(os.path.join(folder, "_stream_copy" + suffix)))


def _load() -> None:
    global _loaded, _copy, _kind, _reason, _sse2_only
    with _lock:
        if _loaded:
            return
        setting = os.environ.get(ENV, "1")
        if setting == "0":
            _reason = f"{ENV}=0"
        elif setting not in ("1", "sse2"):
            _reason = f"{ENV}={setting!r} is none of 0, 1, sse2"
        else:
            paths = list(_library_paths())
            if not paths:
                _reason = "muond/_stream_copy was not built with this package (no C compiler?)"
            for path in paths:
                try:
                    library = ctypes.CDLL(path)
                except OSError as err:
                    _reason = f"{path}: {err}"
                    continue
                copy = library.muond_stream_copy
                copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                copy.restype = None
                kind = library.muond_stream_copy_kind
                kind.argtypes = []
                kind.restype = ctypes.c_char_p
                _copy, _kind, _reason = copy, kind().decode(), ""
                if setting == "sse2" and _kind == "avx":
                    _kind, _sse2_only = "sse2", 1
                break
        if _copy is None:
            logging.getLogger("muond").info("streaming host copies unavailable (%s); copying with "
                                            "torch's copy_", _reason)
        _loaded = True


def available() -> bool:
    """Whether ``copy`` is the native streaming copy (else callers use torch's ``copy_``)."""
    _load()
    return _copy is not None


def kind() -> str:
    """The stores the native copy uses on this CPU ("avx", "sse2", "memcpy"), "" when unavailable."""
    _load()
    return _kind


def reason() -> str:
    """Why the native copy is unavailable, "" when it is available."""
    _load()
    return _reason


def fits(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy(dst, src)`` may copy this pair: contiguous CPU tensors of one dtype and size."""
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous())


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies ``src`` into ``dst`` with streaming stores (``fits`` must hold; ``available`` too)."""
    _load()
    if _copy is None:
        raise RuntimeError(f"streaming host copies unavailable: {_reason}")
    if not fits(dst, src):
        raise ValueError("stream_copy.copy needs contiguous CPU tensors of one dtype and size")
    _copy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), _sse2_only)
