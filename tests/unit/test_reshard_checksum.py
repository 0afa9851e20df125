"""The runtime's per-round checksums: what a full and a sampled checksum cover, and the receiver's
check raising ChecksumError that names the peer and its tensors (moe/_reshard_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from moe._reshard_runtime import (FULL, HEADER, SAMPLE_EVERY, ChecksumError, Staging, _finish, _PeerPlan,
                                  _wrap, checksum, next_phase, prepare, verify_mode)

WORDS = 40_003  # not a multiple of SAMPLE_EVERY: the slices' integer bounds must still tile the message


def _message(nbytes: int = WORDS * 8) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _flipped(buf: torch.Tensor, byte: int) -> torch.Tensor:
    out = buf.clone()
    out[byte] ^= 0x10
    return out


def test_full_checksum_sees_every_byte() -> None:
    buf = _message()
    base = checksum(buf)
    for byte in (0, 7, 8 * (WORDS // 2) + 3, 8 * WORDS - 1):
        assert checksum(_flipped(buf, byte)) != base, byte


def test_sampled_phases_tile_the_message_and_each_sees_only_its_slice() -> None:
    """Phase k sums words [k * w // 16, (k + 1) * w // 16): a flip inside changes it, outside does not,
    and the SAMPLE_EVERY phases together are exactly the full sum (every byte once per cycle)."""
    buf = _message()
    bounds = [k * WORDS // SAMPLE_EVERY for k in range(SAMPLE_EVERY + 1)]
    length_term = 8 * WORDS * 1_000_003
    total = sum(checksum(buf, k) - length_term for k in range(SAMPLE_EVERY))
    assert _wrap(total + length_term) == checksum(buf, FULL)
    for k in (0, 5, SAMPLE_EVERY - 1):
        inside = 8 * bounds[k] + 3
        outside = 8 * bounds[k + 1] + 3 if k + 1 < SAMPLE_EVERY else 0
        assert checksum(_flipped(buf, inside), k) != checksum(buf, k), k
        assert checksum(_flipped(buf, outside), k) == checksum(buf, k), k


def test_every_phase_sees_a_truncated_or_misaligned_message() -> None:
    buf = _message()
    short = buf[:-8].clone()
    for k in (FULL, *range(SAMPLE_EVERY)):
        assert checksum(short, k) != checksum(buf, k), k
    odd = _message(8 * 1000 + 3)[1:]  # misaligned start and odd length: copied once, same rule
    assert checksum(odd, 2) == checksum(odd.clone(), 2)


def test_phases_rotate_per_round_and_full_is_fixed() -> None:
    seen = [next_phase("sampled", "test round A") for _ in range(2 * SAMPLE_EVERY)]
    assert seen == list(range(SAMPLE_EVERY)) * 2
    assert next_phase("sampled", "test round B") == 0  # rounds rotate independently
    assert next_phase("full", "test round A") == FULL


def test_bad_verify_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"verify=True must be one of 'sampled', 'full', 'off'"):
        verify_mode(True)


def _arrived(peer: _PeerPlan, phase: int, want: int):
    """The receiver's side of `peer` after its messages arrived: the one item received direct, and
    a bucket that holds only the header with the sender's (phase, checksum)."""
    q = prepare(peer, 1, Staging(), None)
    assert not q.unpack[0] and len(q.recv_direct) == 1
    q.recv_bucket[:HEADER].view(torch.int64).copy_(torch.tensor([phase, want]))
    return q, [q.recv_direct[0]]


@pytest.mark.parametrize("phase", [FULL, 3])
def test_receiver_raises_checksum_error_naming_peer_and_tensors(phase: int) -> None:
    buf = _message()
    peer = _PeerPlan(5, "trainer rank 1 (global rank 5)", recv=[("model.layers.0.mlp.gate.weight", buf)])
    label = "reshard round 0/2 on rollout rank 0"
    _finish(peer, _arrived(peer, phase, checksum(buf, phase)), [], label)  # passes
    named = r"from trainer rank 1 \(global rank 5\).*model\.layers\.0\.mlp\.gate"
    with pytest.raises(ChecksumError, match=named):
        _finish(peer, _arrived(peer, phase, checksum(buf, phase) + 1), [], label)


def test_garbage_phase_from_the_wire_is_a_checksum_error() -> None:
    buf = _message()
    peer = _PeerPlan(2, "trainer rank 2", recv=[("w", buf)])
    with pytest.raises(ChecksumError, match="phase 99"):
        _finish(peer, _arrived(peer, 99, checksum(buf)), [], "round 0")


def test_a_peers_messages_swapped_are_seen() -> None:
    """Two of a peer's messages of equal size arriving in each other's place (a tag or offset mix-up)
    summed to the same checksum; `combine` weighs each by its place."""
    from moe._reshard_runtime import combine

    a, b = _message(800), _message(800).flip(0)
    assert combine([checksum(a), checksum(b)]) != combine([checksum(b), checksum(a)])
    assert combine([checksum(a)]) == checksum(a)
