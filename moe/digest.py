"""A layout-independent policy digest: per-tensor digests that compose from disjoint boxes.

The digest of a tensor is a sum over its elements, so a rank can digest the boxes it holds where
they live (CPU or GPU, no gather) and the digests of disjoint boxes add up to the tensor's. The
policy hash is sha256 over every tensor's (name, dtype, shape, digest). Definition (docs/policy_hash.md;
all arithmetic mod 2^64 on unsigned 64-bit words, `>>` a logical shift):

    mix(z)     = splitmix64's finalizer: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
                 z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
    seed_j     = bytes [8j, 8j + 8) of sha256(tensor name, UTF-8) as a little-endian integer, j < LANES
    bits(e)    = the raw bytes of element e as an unsigned little-endian integer
    lane_j     = sum over elements e at row-major global index i of
                 mix((seed_j + i * GAMMA) ^ mix(bits(e) + GAMMA)),    GAMMA = 0x9E3779B97F4A7C15
    hash       = sha256 of, for every tensor in sorted name order, the UTF-8 line
                 f"{name}\\t{dtype}\\t{shape}\\t{lane_0:016x}{lane_1:016x}\\n"
                 (dtype: the torch name without "torch.", e.g. float32; shape: e.g. [64,128], [] for 0-d)

Each element's term depends on its position and its bits jointly (the mixed bits are 64-bit
pseudo-random, so two (position, bits) pairs give the same term only by a 2^-64 chance), so
changing, swapping or moving elements changes a lane except with probability about 2^-64 per lane.
Three mixes per element (one for the bits, one per lane), in place on chunks: about 36 M elements/s
on one CPU core, far more on a GPU. Torch only (int64 tensors on the data's device, whose arithmetic
wraps like uint64's), no hpcrl import.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from math import prod

import torch

from moe.slices import Box

LANES = 2
GAMMA = 0x9E3779B97F4A7C15
MIX_M1, MIX_M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers (also moe/sharded_init.py)
_MASK64 = (1 << 64) - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_ELEMS = 1 << 20  # elements per chunk: bounds the temporaries (4 int64 buffers of it)


def _signed(x: int) -> int:
    """The int64 with the same bits as the uint64 `x` (torch int64 arithmetic wraps like uint64)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 `z`, in place (`tmp`: a scratch tensor of z's shape).
    Logical right shifts are arithmetic shifts masked to the low 64 - s bits."""
    for s, m in ((30, MIX_M1), (27, MIX_M2), (31, None)):
        torch.bitwise_right_shift(z, s, out=tmp)
        tmp.bitwise_and_((1 << (64 - s)) - 1)
        z.bitwise_xor_(tmp)
        if m is not None:
            z.mul_(_signed(m))
    return z


def seeds(name: str) -> list[int]:
    """The lane seeds of tensor `name` (uint64 values)."""
    d = hashlib.sha256(name.encode()).digest()
    return [int.from_bytes(d[8 * j: 8 * j + 8], "little") for j in range(LANES)]


def _bits(chunk: torch.Tensor) -> torch.Tensor:
    """Raw bits of a contiguous tensor's elements, zero-extended to int64: a new flat tensor
    (callers modify it in place)."""
    size = chunk.element_size()
    if size not in _INT_VIEW or chunk.is_complex():
        raise ValueError(f"cannot digest dtype {chunk.dtype}: elements of 1, 2, 4 or 8 bytes only")
    b = chunk.reshape(-1).view(_INT_VIEW[size]).to(torch.int64, copy=True)
    return b.bitwise_and_((1 << (8 * size)) - 1) if size in (2, 4) else b


def global_flat_index(box: Box, global_shape: Sequence[int], r0: int, r1: int,
                      device: torch.device) -> torch.Tensor:
    """Row-major global flat indices (int64) of rows [r0, r1) (along axis 0) of `box`, flat, in box
    order (also the counters of moe/sharded_init.py)."""
    if not box.shape:
        return torch.zeros(1, dtype=torch.int64, device=device)
    strides = [prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    o = box.offsets
    if tuple(box.shape[1:]) == tuple(global_shape[1:]):  # whole rows: one contiguous range
        return torch.arange((o[0] + r0) * strides[0], (o[0] + r1) * strides[0], dtype=torch.int64,
                            device=device)
    idx = torch.arange(o[0] + r0, o[0] + r1, dtype=torch.int64, device=device) * strides[0]
    for d in range(1, len(box.shape)):
        step = torch.arange(o[d], o[d] + box.shape[d], dtype=torch.int64, device=device) * strides[d]
        idx = idx.unsqueeze(-1) + step
    return idx.reshape(-1)


@torch.no_grad()
def digest_box(name: str, data: torch.Tensor, box: Box, global_shape: Sequence[int],
               chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """The lanes (int64 [LANES], on `data`'s device; read them as uint64) of tensor `name`'s box
    `box`, whose values are `data` (shape `box.shape`, any strides). Digests of disjoint boxes
    add (mod 2^64) to the digest of their union. Works in chunks of rows of `chunk_elems` elements
    (at least one row), so the temporaries stay O(chunk)."""
    if tuple(data.shape) != tuple(box.shape):
        raise ValueError(f"digest_box({name!r}): data shape {tuple(data.shape)} != box shape {box.shape}")
    if not Box.full(tuple(global_shape)).contains(box):
        raise ValueError(f"digest_box({name!r}): box {box} is not inside global shape {list(global_shape)}")
    lanes = torch.zeros(LANES, dtype=torch.int64, device=data.device)
    if box.numel == 0:
        return lanes
    lane_seeds = [_signed(s) for s in seeds(name)]
    rows = box.shape[0] if box.shape else 1
    per_row = max(1, box.numel // rows)
    step = max(1, chunk_elems // per_row)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        value = _bits((data[r0:r1] if box.shape else data).contiguous())
        tmp = torch.empty_like(value)
        _mix_(value.add_(_signed(GAMMA)), tmp)
        pos = global_flat_index(box, global_shape, r0, r1, data.device).mul_(_signed(GAMMA))
        term = torch.empty_like(value)
        for j, seed in enumerate(lane_seeds):
            torch.add(pos, seed, out=term)
            lanes[j] += _mix_(term.bitwise_xor_(value), tmp).sum()
    return lanes


def lanes_hex(lanes: torch.Tensor | Sequence[int]) -> str:
    """The lanes as one lowercase hex string of 16 digits per lane (uint64 reading)."""
    values = lanes.tolist() if isinstance(lanes, torch.Tensor) else list(lanes)
    return "".join(f"{int(v) & _MASK64:016x}" for v in values)


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as it enters the hash ("float32", "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def policy_hash(entries: Iterable[tuple[str, str, Sequence[int], torch.Tensor | Sequence[int]]]) -> str:
    """sha256 hex of (name, dtype name, shape, lanes) of every tensor, in sorted name order."""
    h = hashlib.sha256()
    for name, dtype, shape, lanes in sorted(entries, key=lambda e: e[0]):
        shape_text = json.dumps([int(s) for s in shape], separators=(",", ":"))
        h.update(f"{name}\t{dtype}\t{shape_text}\t{lanes_hex(lanes)}\n".encode())
    return h.hexdigest()


def state_dict_digest(sd: Mapping[str, torch.Tensor]) -> str:
    """The policy hash of full tensors (e.g. HF checkpoint-named weights): equal to what
    `MegatronPolicy.policy_sha256` computes from the shards of any layout holding the same values."""
    entries = []
    for name, t in sd.items():
        shape = tuple(t.shape)
        lanes = digest_box(name, t.detach(), Box.full(shape), shape)
        entries.append((name, dtype_name(t.dtype), shape, lanes))
    return policy_hash(entries)
