"""Random weights that any rank can draw for any box of any tensor, alone: a layout-independent init
for models too large to build on one rank.

Element i (row-major flat index in the *global* tensor) of tensor `name` under `seed` is a function
of (seed, name, i) only: two 64-bit counter hashes (splitmix64's finaliser over a per-tensor key
xor the counter) give two uniforms, and Box-Muller turns them into one standard normal. So a box
drawn on its own equals the same box of the whole tensor drawn at once, under every TP/PP/EP/ETP
layout, and a rank's cost is its own elements. Matrices (embeddings, projections, experts, the
router) are normal(0, std) with std the config's `initializer_range`; vectors (RMSNorm weights) are
ones, as transformers initialises them. The values differ from transformers' own init (which draws
from torch's sequential generator), so `model.random_init` names which one a run uses.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from moe.digest import GAMMA, MIX_M1, MIX_M2, global_flat_index
from moe.slices import Box

_GOLDEN, _M1, _M2 = np.uint64(GAMMA), np.uint64(MIX_M1), np.uint64(MIX_M2)
_CHUNK = 1 << 20  # elements per pass: bounds the temporaries to a few MB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function over a uint64 array (wrapping arithmetic): x + GAMMA, then the
    finalizer moe.digest applies in place on int64 torch tensors."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def tensor_key(seed: int, name: str) -> np.uint64:
    """A 64-bit key per (seed, tensor name)."""
    digest = hashlib.sha256(f"hpcrl-init:{seed}:{name}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def flat_indices(shape: tuple[int, ...], box: Box) -> np.ndarray:
    """Row-major flat indices (uint64) in a tensor of `shape` of every element of `box`, in box order
    (the policy hash's positions, moe.digest.global_flat_index)."""
    return global_flat_index(box, shape, 0, box.shape[0], torch.device("cpu")).numpy().view(np.uint64)


def standard_normal(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Float64 standard normals at the given flat indices (pure function of key and index)."""
    with np.errstate(over="ignore"):
        a = splitmix64(key ^ (index * np.uint64(2)))
        b = splitmix64(key ^ (index * np.uint64(2) + np.uint64(1)))
    # 53-bit uniforms; u1 in (0, 1] so that log(u1) is finite
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * (1.0 / (1 << 53))
    u2 = (b >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def init_box(seed: int, name: str, shape: tuple[int, ...], box: Box, std: float) -> np.ndarray:
    """The float32 values of `box` of tensor `name` (global `shape`): ones for vectors, else
    normal(0, std) keyed by (seed, name, flat index)."""
    if len(shape) == 1:
        return np.ones(box.shape, dtype=np.float32)
    key = tensor_key(seed, name)
    out = np.empty(box.numel, dtype=np.float32)
    rows = max(1, _CHUNK // max(1, box.numel // max(1, box.shape[0])))
    done = 0
    for r0 in range(0, box.shape[0], rows):
        part = Box((box.offsets[0] + r0, *box.offsets[1:]),
                   (min(rows, box.shape[0] - r0), *box.shape[1:]))
        values = standard_normal(key, flat_indices(shape, part)) * std
        out[done: done + part.numel] = values
        done += part.numel
    return out.reshape(box.shape)
