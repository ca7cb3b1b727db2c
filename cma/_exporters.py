"""Buffers that speak only DLPack or the CUDA array interface, read as mpi4py reads them.

DLPack: the capsule is not consumed. It stays valid, named as the producer made it, for
as long as the array returned here lives, and its own destructor releases the tensor.
(Taking it over, as ``numpy.from_dlpack`` does, crashed with producers that free the
tensor with the capsule, mpi4py's test helper among them.)

``__cuda_array_interface__``: taken only where its pointer lies in ordinary memory of
this process (mpi4py's tests fake GPU arrays this way); real device memory is refused
rather than read by the CPU. Only C-contiguous buffers, in either case.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from .errors import BufferError

CPU = 1  # DLDeviceType kDLCPU
READ_ONLY = 1  # DLManagedTensorVersioned.flags bit
_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}  # DLDataTypeCode -> NumPy's kind


class _Device(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):  # DLManagedTensor (DLPack 0.x)
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack >= 1.0)
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid.restype = ctypes.c_int

_held: dict[int, object] = {}  # id(array) -> what its memory belongs to (a capsule, ...)


def _capsule(obj: Any) -> tuple[object, bool]:
    """The object's capsule and whether it is a versioned one (DLPack >= 1.0)."""
    try:
        return obj.__dlpack__(max_version=(1, 0)), True
    except TypeError:  # a DLPack 0.x producer
        return obj.__dlpack__(), False


def _element(dtype: _DataType) -> np.dtype | None:
    """NumPy's type for a DLPack element type, or None where NumPy has none."""
    kind, nbytes = _KINDS.get(dtype.code), dtype.bits // 8
    if kind == "f" and dtype.lanes == 2:  # (complex long double, as mpi4py's tests export it)
        kind, nbytes = "c", 2 * nbytes
    elif dtype.lanes != 1 or kind is None:
        return None
    try:
        return np.dtype(f"{kind}{nbytes}")
    except TypeError:
        return None


def dlpack_array(obj: Any, typed: bool = False) -> np.ndarray:
    """The bytes of a CPU DLPack exporter as a flat uint8 array (read-only if it says so);
    ``typed``: as a flat array of its elements where NumPy has their type."""
    capsule, versioned = _capsule(obj)
    name = b"dltensor_versioned" if versioned and _is_valid(capsule, b"dltensor_versioned") \
        else b"dltensor"
    if not _is_valid(capsule, name):
        raise BufferError(f"{type(obj).__name__}.__dlpack__ returned no DLPack capsule")
    address = _get_pointer(capsule, name)
    if name == b"dltensor_versioned":
        managed = _ManagedVersioned.from_address(address)
        tensor, readonly = managed.dl_tensor, bool(managed.flags & READ_ONLY)
    else:
        tensor, readonly = _Managed.from_address(address).dl_tensor, False
    if tensor.device.type != CPU:
        raise BufferError(f"{type(obj).__name__} lives on a device (DLPack type "
                          f"{tensor.device.type}), not in this process's memory")
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    itemsize = (tensor.dtype.bits * tensor.dtype.lanes + 7) // 8
    if tensor.strides:
        expected = itemsize
        for i in reversed(range(tensor.ndim)):
            if shape[i] > 1 and tensor.strides[i] * itemsize != expected:
                raise BufferError(f"{type(obj).__name__} is not C-contiguous: pass a "
                                  "contiguous copy")
            expected *= shape[i]
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    element = _element(tensor.dtype) if typed else None
    if element is None or element.itemsize != itemsize:
        element = np.dtype(np.uint8)
    if nbytes == 0:
        return np.empty(0, element)
    return _array_at((tensor.data or 0) + tensor.byte_offset, nbytes, readonly, capsule
                     ).view(element)


def _array_at(address: int, nbytes: int, readonly: bool, owner: object) -> np.ndarray:
    """A flat uint8 array over memory ``owner`` keeps valid, keeping ``owner`` alive."""
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    array = np.frombuffer(memoryview(raw), np.uint8)
    if readonly:
        array.flags.writeable = False
    _held[id(array)] = owner
    weakref.finalize(array, _held.pop, id(array), None)
    return array


def cai_array(obj: Any) -> np.ndarray:
    """The bytes of an object's ``__cuda_array_interface__``, if they are host memory."""
    interface = obj.__cuda_array_interface__
    address, readonly = interface["data"]
    itemsize = np.dtype(interface["typestr"]).itemsize
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
        raise BufferError(f"{type(obj).__name__} is not C-contiguous: pass a contiguous copy")
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if nbytes == 0:
        return np.empty(0, np.uint8)
    if not _host_memory(address, nbytes):
        raise BufferError(f"{type(obj).__name__} is device memory: cma moves host memory "
                          "only (send it through MPI with a CUDA-aware build)")
    return _array_at(address, nbytes, bool(readonly), obj)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _host_memory(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies in one ordinary mapping of this process
    (not a device file's: a GPU's memory is mapped from /dev/nvidia* and the like)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address and address + nbytes <= stop:
                path = fields[5] if len(fields) > 5 else ""
                return not path.startswith("/dev/") or path.startswith(("/dev/shm", "/dev/zero"))
    return False
