"""Buffers that speak only DLPack: their element type is read from the tensor itself, so
collectives count elements as mpi4py does, including types NumPy cannot import by DLPack
(long double, which mpi4py's own tests export: test_cco_vec failed 8 tests before)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from cma import _exporters, collectives

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_new_capsule.restype = ctypes.py_object
_NAME = ctypes.create_string_buffer(b"dltensor")


class LegacyExporter:
    """A DLPack 0.x producer over a NumPy array (no ``max_version``), written by hand as
    mpi4py's test helper is: NumPy itself exports no long double."""

    def __init__(self, array: np.ndarray, code: int, bits: int, lanes: int = 1) -> None:
        self.array = array
        self.shape = (ctypes.c_int64 * 1)(array.size)
        self.managed = _exporters._Managed()
        tensor = self.managed.dl_tensor
        tensor.data = array.ctypes.data
        tensor.device = _exporters._Device(_exporters.CPU, 0)
        tensor.ndim = 1
        tensor.dtype = _exporters._DataType(code, bits, lanes)
        tensor.shape = self.shape

    def __dlpack__(self) -> Any:
        return _new_capsule(ctypes.addressof(self.managed), _NAME, None)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_exporters.CPU, 0)


@pytest.mark.parametrize("dtype, code, bits, lanes", [
    (np.longdouble, 2, 128, 1),  # kDLFloat
    (np.clongdouble, 2, 128, 2),  # (DLPack's 8-bit width field cannot say 256: two lanes)
    (np.complex64, 5, 64, 1),  # kDLComplex
    (np.int16, 0, 16, 1),
    (np.uint64, 1, 64, 1),
    (np.bool_, 6, 8, 1),
])
def test_dlpack_only_buffers_keep_their_element_type(dtype: Any, code: int, bits: int,
                                                     lanes: int) -> None:
    if np.dtype(dtype).itemsize * 8 != bits * lanes:
        pytest.skip(f"{np.dtype(dtype)} is {np.dtype(dtype).itemsize} bytes on this platform, "
                    "not the DLPack width under test")
    source = np.arange(5).astype(dtype)
    exporter = LegacyExporter(source, code, bits, lanes)
    typed = _exporters.dlpack_array(exporter, typed=True)
    assert typed.dtype == source.dtype and np.array_equal(typed, source)
    assert _exporters.dlpack_array(exporter).dtype == np.uint8  # (point-to-point moves bytes)
    assert collectives._whole(exporter, writable=False).size == 5  # elements, not bytes


def test_dlpack_type_numpy_lacks_is_read_as_bytes() -> None:
    source = np.arange(4, dtype=np.uint32)
    exporter = LegacyExporter(source, 4, 16, 2)  # (two bfloat16 lanes: no NumPy type)
    assert _exporters.dlpack_array(exporter, typed=True).dtype == np.uint8
