"""How torch dtypes are stored in HDF5: natively where numpy has the type, else as raw bits.

HDF5 (through numpy) has no bfloat16 or float8, and stores numpy bool as an enum; those are
written as unsigned integers of the same width and viewed back on load, so every value
round-trips bit for bit. The manifest records the torch dtype name, never the storage type.
"""

from __future__ import annotations

import numpy as np
import torch

# torch dtype -> storage numpy dtype (same itemsize). A view, never a conversion.
_STORAGE: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.uint16),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.uint8),
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _STORAGE[getattr(torch, _name)] = np.dtype(np.uint8)

# Types numpy lacks (or, for bool, that h5py would store as an enum): stored as their raw bits.
_VIEWED = {d for d in _STORAGE if d == torch.bool or d == torch.bfloat16 or "float8" in str(d)}
_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _STORAGE}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype ("bfloat16"); ValueError if it cannot be stored."""
    if dtype not in _STORAGE:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(_BY_NAME)}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown checkpoint dtype {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a tensor of `dtype` is stored as in HDF5."""
    dtype_name(dtype)
    return _STORAGE[dtype]


def to_storage(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array holding the tensor's bits (shares memory when possible).

    The tensor must already be on the CPU.
    """
    sdtype = storage_dtype(tensor.dtype)
    t = tensor.detach().contiguous()
    if t.dtype in _VIEWED:
        t = t.view(torch.uint8 if sdtype.itemsize == 1 else torch.uint16)
    return t.numpy()  # contiguous already; np.ascontiguousarray would turn 0-d into 1-d


def from_storage(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` viewing the storage array's bits (no copy)."""
    t = torch.from_numpy(array)
    return t if t.dtype == dtype else t.view(dtype)

