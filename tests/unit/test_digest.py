"""moe.digest: the per-tensor digest composes from disjoint boxes, matches a plain-Python reading of
its definition, and the policy hash sees every element, its position, the dtype and the shape."""

import hashlib

import pytest
import torch

from moe.digest import GAMMA, LANES, digest_box, lanes_hex, policy_hash, seeds, state_dict_digest
from moe.slices import Box

M64 = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def reference_lanes(name: str, t: torch.Tensor) -> list[int]:
    """docs/policy_hash.md's definition, element by element in Python integers."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    size = t.element_size()
    out = []
    for seed in seeds(name):
        total = 0
        for i in range(t.numel()):
            bits = int.from_bytes(raw[i * size: (i + 1) * size], "little")
            total += _mix_ref(((seed + i * GAMMA) & M64) ^ _mix_ref((bits + GAMMA) & M64))
        out.append(total & M64)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8,
                                   torch.bool])
def test_matches_the_definition(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    before = t.clone()
    lanes = digest_box("w", t, Box.full((3, 5)), (3, 5))
    assert lanes_hex(lanes) == lanes_hex(reference_lanes("w", t))
    assert torch.equal(t, before)  # the data is read, never modified (8-byte dtypes view it as int64)
    zero_d = torch.tensor(-1.5)
    assert lanes_hex(digest_box("s", zero_d, Box.full(()), ())) == lanes_hex(reference_lanes("s", zero_d))


def _sum(parts: list[torch.Tensor]) -> str:
    return lanes_hex(torch.stack(parts).sum(0))


def test_same_digest_however_the_tensor_is_split() -> None:
    t = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    whole = lanes_hex(digest_box("w", t, Box.full((8, 12)), (8, 12)))
    assert lanes_hex(digest_box("w", t, Box.full((8, 12)), (8, 12), chunk_elems=5)) == whole
    full = Box.full((8, 12))
    rows = [full.split(0, 4, k) for k in range(4)]
    cols = [full.split(1, 3, k) for k in range(3)]
    grid = [Box((r, c), (2, 6)) for r in range(0, 8, 2) for c in (0, 6)]
    for boxes in (rows, cols, grid):
        assert _sum([digest_box("w", t[b.index], b, (8, 12), chunk_elems=7) for b in boxes]) == whole
    # Non-contiguous views (a column box of a row-major tensor) digest as their values.
    b = cols[1]
    assert not t[b.index].is_contiguous()
    assert lanes_hex(digest_box("w", t[b.index], b, (8, 12))) == lanes_hex(
        digest_box("w", t[b.index].clone(), b, (8, 12)))


def test_changes_with_every_element_position_name_dtype_and_shape() -> None:
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    base = state_dict_digest({"a": t, "b": t[0]})
    changed = t.clone()
    changed[3, 5] = torch.nextafter(changed[3, 5], torch.tensor(1e9))  # one ulp
    swapped = t.clone()
    swapped[0, 1], swapped[2, 4] = t[2, 4], t[0, 1]
    variants = [
        {"a": changed, "b": t[0]},
        {"a": swapped, "b": t[0]},
        {"a": t.T.contiguous().T.clone(), "b": t[0]},  # same values: same digest (checked below)
        {"a": t.reshape(6, 4), "b": t[0]},  # same bytes, other shape
        {"a": t.double(), "b": t[0]},
        {"a": t, "c": t[0]},  # renamed tensor
        {"a": t, "b": t[0], "extra": t[1]},
    ]
    digests = [state_dict_digest(v) for v in variants]
    assert digests[2] == base
    others = [d for k, d in enumerate(digests) if k != 2]
    assert base not in others and len(set(others)) == len(others)
    # The same values under another tensor's name give another digest (seeds come from the name).
    assert lanes_hex(digest_box("a", t, Box.full((4, 6)), (4, 6))) != lanes_hex(
        digest_box("b", t, Box.full((4, 6)), (4, 6)))
    # -0.0 and 0.0 are different bits, so different digests.
    assert state_dict_digest({"z": torch.zeros(3)}) != state_dict_digest({"z": -torch.zeros(3)})


def test_policy_hash_is_order_free_and_hashes_the_lines() -> None:
    lanes = torch.tensor([-1, 5])
    one = policy_hash([("b", "float32", (2,), lanes), ("a", "float32", (), [1, 2])])
    two = policy_hash([("a", "float32", (), [1, 2]), ("b", "float32", (2,), lanes)])
    line_a = f"a\tfloat32\t[]\t{1:016x}{2:016x}\n"
    line_b = f"b\tfloat32\t[2]\t{'f' * 16}{5:016x}\n"
    assert one == two == hashlib.sha256((line_a + line_b).encode()).hexdigest()
    assert LANES == 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="data shape"):
        digest_box("w", torch.zeros(2, 3), Box.full((3, 2)), (3, 2))
    with pytest.raises(ValueError, match="not inside"):
        digest_box("w", torch.zeros(2, 3), Box((2, 0), (2, 3)), (3, 3))
    with pytest.raises(ValueError, match="cannot digest"):
        digest_box("w", torch.zeros(2, dtype=torch.complex64), Box.full((2,)), (2,))


def test_the_random_init_and_the_hash_share_one_mix_and_one_index():
    """moe/sharded_init.py's numpy splitmix64 is x + GAMMA then the finalizer the hash applies in place
    on int64 torch tensors, and its counters are the hash's global flat indices."""
    import numpy as np
    import torch

    from moe.digest import _mix_, global_flat_index
    from moe.sharded_init import flat_indices, splitmix64
    from moe.slices import Box

    x = np.random.default_rng(0).integers(0, 2**64, size=1000, dtype=np.uint64)
    z = torch.from_numpy((x + np.uint64(GAMMA)).view(np.int64).copy())
    assert (_mix_(z, torch.empty_like(z)).numpy().view(np.uint64) == splitmix64(x)).all()
    box = Box((1, 2, 3), (2, 3, 4))
    idx = flat_indices((4, 5, 6), box)
    assert idx.dtype == np.uint64 and idx.tolist() == global_flat_index(box, (4, 5, 6), 0, 2, torch.device("cpu")).tolist()
    assert idx[0] == 1 * 30 + 2 * 6 + 3 and len(idx) == box.numel
