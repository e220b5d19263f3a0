"""A tiny ctypes binding of the CUDA runtime, for the CUDA IPC transport
(``cuda_ipc_transport.py``).

Only what exporting memory and an event to the daemon takes: ``cudaMalloc``/``cudaFree`` (a plain
allocation, not a block of torch's caching allocator, which cannot be exported on its own),
``cudaIpcGetMemHandle``, interprocess events (``cudaEventCreateWithFlags``,
``cudaIpcGetEventHandle``, ``cudaEventRecord``, ``cudaEventDestroy``) and ``cudaGetErrorString``.
The library is the one torch already loaded when it can be found (``/proc/self/maps``), else
``libcudart.so.13``/``.12``/``libcudart.so`` by name, else a copy in site-packages (torch/lib,
nvidia/*/lib). Every failing call raises ``RuntimeError`` naming the call and CUDA's message.

``DeviceBuffer`` is one such allocation, seen by torch as a flat uint8 tensor
(``__cuda_array_interface__``), of which typed views are taken at 4-byte-aligned offsets; the
allocation is freed when the buffer and every tensor viewing it are gone.

Pure helpers (``format_uuid``, the handle structures) need no GPU and no library. Loading is lazy:
importing this module works on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
import threading
from typing import List, Optional, Union

import torch

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t

CUDA_EVENT_DISABLE_TIMING = 0x2
CUDA_EVENT_INTERPROCESS = 0x4


class IpcMemHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes."""
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class IpcEventHandle(ctypes.Structure):
    """``cudaIpcEventHandle_t``: 64 opaque bytes."""
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def handle_bytes(handle: ctypes.Structure) -> bytes:
    """The raw bytes of a handle structure (every byte, NULs included)."""
    return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))


def format_uuid(value: Union[bytes, str, object]) -> str:
    """A device UUID as ``nvidia-smi -L`` prints it and ``ServerInfo.cuda_device_uuid`` carries
    it: "GPU-" and 8-4-4-4-12 lowercase hex digits. Takes the 16 raw bytes, a string with or
    without the "GPU-" prefix (torch 2.x's ``str(props.uuid)``), or torch's ``_CUuuid`` (its
    ``.bytes``)."""
    raw = getattr(value, "bytes", None)
    if isinstance(raw, (bytes, bytearray)):
        value = bytes(raw)
    if isinstance(value, (bytes, bytearray)):
        if len(value) != 16:
            raise ValueError(f"a device UUID has 16 bytes, got {len(value)}")
        h = bytes(value).hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    text = str(value).strip()
    for prefix in ("GPU-", "MIG-"):
        if text.upper().startswith(prefix):
            return prefix + text[len(prefix):].lower()
    return "GPU-" + text.lower()


def same_uuid(a: str, b: str) -> bool:
    """Whether two formatted device UUIDs name one device (case-insensitive; empty never matches)."""
    return bool(a) and bool(b) and a.strip().lower() == b.strip().lower()


def _loaded_paths(stem: str) -> List[str]:
    """Paths of libraries whose file name starts with ``stem`` mapped into this process."""
    found: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(stem + ".so") \
                        and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _site_dirs() -> List[str]:
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # pragma: no cover - virtualenvs of old Pythons
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:  # pragma: no cover
        pass
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    dirs.append(os.path.dirname(torch_dir))
    unique = []
    for d in dirs:
        if d and d not in unique:
            unique.append(d)
    return unique


def library_candidates(stem: str, names: List[str], sub_dirs: List[str]) -> List[str]:
    """Where to look for a library, best first: copies already loaded into this process, the
    sonames (the dynamic loader's search, which also finds an already-loaded copy by soname), then
    files under site-packages' ``sub_dirs`` (globs relative to a site-packages folder)."""
    candidates = _loaded_paths(stem) + list(names)
    for base in _site_dirs():
        for sub in sub_dirs:
            candidates += sorted(glob.glob(os.path.join(base, sub, stem + "*.so*")), reverse=True)
    unique = []
    for c in candidates:
        if c not in unique:
            unique.append(c)
    return unique


def load_library(what: str, stem: str, names: List[str], sub_dirs: List[str]) -> ctypes.CDLL:
    """The first candidate of ``library_candidates`` that loads; RuntimeError listing the tries."""
    errors = []
    for candidate in library_candidates(stem, names, sub_dirs):
        try:
            return ctypes.CDLL(candidate)
        except OSError as err:
            errors.append(f"{candidate}: {err}")
    raise RuntimeError(f"cannot load the {what} ({stem}*): tried " + "; ".join(errors or ["nothing"]))


_lock = threading.Lock()
_runtime: Optional["Runtime"] = None


class Runtime:
    """The functions of one loaded libcudart."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        c_int, c_void_p, c_size_t, c_uint = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._sig("cudaGetErrorString", ctypes.c_char_p, [c_int])
        self._sig("cudaSetDevice", c_int, [c_int])
        self._sig("cudaGetDevice", c_int, [ctypes.POINTER(c_int)])
        self._sig("cudaMalloc", c_int, [ctypes.POINTER(c_void_p), c_size_t])
        self._sig("cudaFree", c_int, [c_void_p])
        self._sig("cudaIpcGetMemHandle", c_int, [ctypes.POINTER(IpcMemHandle), c_void_p])
        self._sig("cudaEventCreateWithFlags", c_int, [ctypes.POINTER(c_void_p), c_uint])
        self._sig("cudaIpcGetEventHandle", c_int, [ctypes.POINTER(IpcEventHandle), c_void_p])
        self._sig("cudaEventRecord", c_int, [c_void_p, c_void_p])
        self._sig("cudaEventDestroy", c_int, [c_void_p])

    def _sig(self, name: str, restype, argtypes) -> None:
        fn = getattr(self.lib, name)
        fn.restype = restype
        fn.argtypes = argtypes

    def error_string(self, code: int) -> str:
        text = self.lib.cudaGetErrorString(int(code))
        return text.decode("utf-8", "replace") if text else f"error {code}"

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{call} failed: {self.error_string(code)} (cudaError {code})")

    def set_device(self, device: int) -> None:
        self.check("cudaSetDevice", self.lib.cudaSetDevice(int(device)))

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check("cudaMalloc", self.lib.cudaMalloc(ctypes.byref(ptr), int(nbytes)))
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self.check("cudaFree", self.lib.cudaFree(ctypes.c_void_p(ptr)))

    def ipc_mem_handle(self, ptr: int) -> bytes:
        handle = IpcMemHandle()
        self.check("cudaIpcGetMemHandle", self.lib.cudaIpcGetMemHandle(ctypes.byref(handle),
                                                                      ctypes.c_void_p(ptr)))
        return handle_bytes(handle)

    def create_ipc_event(self) -> int:
        """An event that can be shared with another process (interprocess, no timing)."""
        event = ctypes.c_void_p()
        self.check("cudaEventCreateWithFlags", self.lib.cudaEventCreateWithFlags(
            ctypes.byref(event), CUDA_EVENT_INTERPROCESS | CUDA_EVENT_DISABLE_TIMING))
        return int(event.value or 0)

    def ipc_event_handle(self, event: int) -> bytes:
        handle = IpcEventHandle()
        self.check("cudaIpcGetEventHandle", self.lib.cudaIpcGetEventHandle(ctypes.byref(handle),
                                                                          ctypes.c_void_p(event)))
        return handle_bytes(handle)

    def record_event(self, event: int, stream: int) -> None:
        self.check("cudaEventRecord", self.lib.cudaEventRecord(ctypes.c_void_p(event),
                                                              ctypes.c_void_p(stream)))

    def destroy_event(self, event: int) -> None:
        self.check("cudaEventDestroy", self.lib.cudaEventDestroy(ctypes.c_void_p(event)))


def runtime() -> Runtime:
    """The CUDA runtime (loaded once); RuntimeError when none can be loaded."""
    global _runtime
    with _lock:
        if _runtime is None:
            lib = load_library("CUDA runtime", "libcudart",
                               ["libcudart.so.13", "libcudart.so.12", "libcudart.so"],
                               ["torch/lib", "nvidia/cuda_runtime/lib", "nvidia/cu13/lib",
                                "nvidia/cu12/lib"])
            _runtime = Runtime(lib)
        return _runtime


def device_uuid(index: int) -> str:
    """The formatted UUID of CUDA device ``index`` (as torch numbers devices): torch 2.x's
    ``get_device_properties(i).uuid``, else the driver's ``cuDeviceGetUuid``."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return format_uuid(uuid)
    lib = ctypes.CDLL("libcuda.so.1")

    def check(call: str, code: int) -> None:
        if code:
            raise RuntimeError(f"{call} failed (CUresult {code})")
    check("cuInit", lib.cuInit(0))
    dev = ctypes.c_int()
    check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), int(index)))
    raw = (ctypes.c_char * 16)()
    check("cuDeviceGetUuid", lib.cuDeviceGetUuid(raw, dev))
    return format_uuid(bytes(raw))


def current_stream_handle(device: torch.device) -> int:
    """The ``cudaStream_t`` of torch's current stream on ``device``."""
    return int(torch.cuda.current_stream(device).cuda_stream)


class _Allocation:
    """One ``cudaMalloc`` allocation and its interprocess event, freed when the last reference
    goes: the tensors viewing it hold one (through ``__cuda_array_interface__``)."""

    def __init__(self, rt: Runtime, nbytes: int, device: int):
        self.rt, self.nbytes, self.device = rt, nbytes, device
        self.ptr = 0
        self.event = 0
        with torch.cuda.device(device):
            rt.set_device(device)
            try:
                self.ptr = rt.malloc(nbytes)
                self.mem_handle = rt.ipc_mem_handle(self.ptr)
                self.event = rt.create_ipc_event()
                self.event_handle = rt.ipc_event_handle(self.event)
            except BaseException:
                try:
                    self._free()
                except RuntimeError:
                    pass  # the first failure is the one to report
                raise

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 2, "strides": None}

    def _free(self) -> None:
        if self.event:
            event, self.event = self.event, 0
            self.rt.destroy_event(event)
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.rt.free(ptr)

    def __del__(self):
        if sys.is_finalizing():
            return  # the driver tears the context down with the process
        try:
            with torch.cuda.device(self.device):
                self.rt.set_device(self.device)
                self._free()
        except Exception:  # noqa: BLE001 - garbage collection must not raise
            pass


class DeviceBuffer:
    """``nbytes`` of device memory from ``cudaMalloc`` on CUDA device ``device`` (an index), and
    an interprocess event on the same device; ``tensor`` views the memory as flat uint8.
    ``mem_handle`` and ``event_handle`` are their exported handles (64 bytes each).

    The memory and the event are freed once this object and every tensor viewing the memory are
    gone (torch's tensor keeps the allocation alive)."""

    def __init__(self, nbytes: int, device: int):
        if nbytes <= 0:
            raise ValueError("a device buffer has at least one byte")
        self.nbytes = int(nbytes)
        self.device = int(device)
        self._rt = runtime()
        allocation = _Allocation(self._rt, self.nbytes, self.device)
        self.ptr = allocation.ptr
        self.mem_handle = allocation.mem_handle
        self.event_handle = allocation.event_handle
        self._event = allocation.event
        self.tensor = torch.as_tensor(allocation, device=torch.device("cuda", self.device))
        if self.tensor.data_ptr() != self.ptr or self.tensor.numel() != self.nbytes \
                or self.tensor.dtype != torch.uint8:
            raise RuntimeError("torch did not view the CUDA buffer in place as uint8")

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` from byte ``offset`` (a multiple of
        the element size)."""
        return self.tensor[byte_range(offset, numel, dtype, self.nbytes)].view(dtype)

    def record(self, stream: int) -> None:
        """Records the event on ``stream`` (a ``cudaStream_t``): the daemon's work waits for it."""
        self._rt.record_event(self._event, stream)


def byte_range(offset: int, numel: int, dtype: torch.dtype, nbytes: int) -> slice:
    """The bytes of ``numel`` elements of ``dtype`` at byte ``offset`` of an ``nbytes`` buffer;
    ValueError when misaligned or out of bounds."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset < 0 or offset % itemsize:
        raise ValueError(f"offset {offset} is not aligned to {itemsize}-byte elements")
    end = offset + numel * itemsize
    if end > nbytes:
        raise ValueError(f"{numel} elements at offset {offset} end past the buffer's {nbytes} bytes")
    return slice(offset, end)
