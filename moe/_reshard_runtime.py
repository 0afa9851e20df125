"""Low-level machinery of the resharding runtime: bucketed point-to-point exchange with checksums
and a deadline, over torch.distributed (gloo on CPU, NCCL on GPU).

One call of `exchange(...)` is one round: for every peer, the items this rank sends to it and
the items it receives from it, each an (HF tensor name, tensor view) pair listed in the same order
on both sides. Items smaller than `direct_bytes` are packed into one flat uint8 bucket per peer
(one copy); larger items travel as their own message straight from / into the tensor memory when
the view is contiguous (no copy). Every peer also gets one message with the sender's checksum of
those bytes (`verify`: "sampled", the default, sums a rotating 1/16 of them; "full" every byte;
"off" sends none); the receiver recomputes it over what arrived and raises `ChecksumError`
naming the peer and the tensors on a mismatch. All messages of a round go out in one `batch_isend_irecv`.
The round must complete by its deadline, otherwise `RoundTimeout` names every peer whose messages
are still pending. Gloo's own timeout (the process group's) should be longer than the deadline.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moe.sources import ALIGN

# A (tensor name, view) item of a round. Send views may be non-contiguous (they are packed or
# copied); receive views are written in place.
Item = tuple[str, torch.Tensor]


class ReshardError(RuntimeError):
    """Base class of runtime failures (bad checksum, stalled peer)."""


class ChecksumError(ReshardError):
    """The bytes a peer sent do not match the checksum it computed before sending."""


class RoundTimeout(ReshardError):
    """A round did not complete before its deadline; `peers` are the stalled peers' descriptions."""

    def __init__(self, message: str, peers: list[str]) -> None:
        super().__init__(message)
        self.peers = peers


# Checksum modes. "sampled" sums one sixteenth of every message's words, a contiguous slice at a
# different position in each repetition of a round (the sender picks the phase and sends it along):
# every round checks every message's length and catches a lost, truncated or misrouted message and
# most garbage, and 16 repetitions of a round (16 weight syncs) have checked every byte of it once.
# "full" sums every byte: on a CPU host that is two more memory passes over the payload (sender
# and receiver), about half the cost of moving it (benchmarks/RESULTS.md); on GPUs it is cheap
# next to the transfer. A contiguous slice, not strided blocks: on this VM every page touched costs
# a page walk, so a slice is 1.5x cheaper than 4 KiB blocks spread over the message.
VERIFY_MODES = ("sampled", "full", "off")
SAMPLE_EVERY = 16
FULL = -1  # the phase that means every byte
_phases: collections.defaultdict[str, itertools.count] = collections.defaultdict(itertools.count)


def verify_mode(verify: str) -> str:
    """`verify` checked: one of VERIFY_MODES, else a ValueError that names the valid values."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} must be one of {', '.join(map(repr, VERIFY_MODES))} "
                         f"(the checksum of every round: a rotating 1/16 sample, every byte, or none)")
    return verify


def next_phase(verify: str, round_label: str) -> int:
    """The phase a sender uses for this repetition of a round: FULL, or the round's next sixteenth."""
    return FULL if verify == "full" else next(_phases[round_label]) % SAMPLE_EVERY


def checksum(buf: torch.Tensor, phase: int = FULL) -> int:
    """A cheap checksum of a tensor's bytes: the sum of its zero-padded 64-bit words, plus length.

    With `phase` FULL every word counts: catches flipped, lost and truncated bytes (not reordered
    words). With phase k in [0, SAMPLE_EVERY) only the words [k * w // 16, (k + 1) * w // 16) of
    the w words count (and the length). Independent of the buffer's alignment (a misaligned or
    odd-sized buffer is copied once); computed on the tensor's device. A native int64 sum runs at
    memory speed, unlike widening int32 words (20x slower on CPU).
    """
    b = buf.reshape(-1).view(torch.uint8)
    n = b.numel()
    if n % 8 or b.data_ptr() % 8:
        padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=b.device)
        padded[:n] = b
        b = padded
    # numpy on CPU: a few microseconds less per call than torch, and there is a call per message
    words = b.detach().numpy().view(np.int64) if b.device.type == "cpu" else b.view(torch.int64)
    if phase != FULL:
        w = len(words)
        words = words[phase * w // SAMPLE_EVERY:(phase + 1) * w // SAMPLE_EVERY]
    return _wrap(int(words.sum()) + n * 1_000_003)


def combine(sums: list[int]) -> int:
    """The checksum of several messages (their sum, as a signed 64-bit value)."""
    return _wrap(sum(sums))


def _wrap(x: int) -> int:
    """x modulo 2**64 as a signed int64 (every bit of the word sum counts; it fits an int64 tensor)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class _PeerPlan:
    """What this rank exchanges with one peer in one round: its messages, in a fixed order."""

    peer: int                      # global rank
    label: str                     # e.g. "trainer rank 3 (global rank 3)"
    send: list[Item] = field(default_factory=list)
    recv: list[Item] = field(default_factory=list)


def _segments(items: list[Item], direct_bytes: int) -> tuple[list[tuple[int, Item]], list[Item], int]:
    """Split items into bucketed ones (with their byte offsets) and direct ones; returns bucket size."""
    bucketed, direct, off = [], [], 0
    for name, view in items:
        nb = view.numel() * view.element_size()
        if nb >= direct_bytes:
            direct.append((name, view))
        else:
            bucketed.append((off, (name, view)))
            off += -(-nb // ALIGN) * ALIGN
    return bucketed, direct, off


def _bucket_view(bucket: torch.Tensor, off: int, view: torch.Tensor) -> torch.Tensor:
    nb = view.numel() * view.element_size()
    return bucket[off:off + nb].view(view.dtype).view(view.shape)


@dataclass
class _Prepared:
    """A peer's part of a round with its bucket layout and every bucket view made once, so that a
    sync repeated with the same tensors (weights updated in place) only copies and sends."""

    plan: _PeerPlan
    send_bucket: torch.Tensor | None = None
    pack: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))  # (bucket, source)
    send_direct: list[torch.Tensor] = field(default_factory=list)
    recv_bucket: torch.Tensor | None = None
    unpack: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))  # (dest, bucket)
    recv_direct: list[torch.Tensor] = field(default_factory=list)


def prepare(p: _PeerPlan, direct_bytes: int, staging: Staging, device: torch.device | None) -> _Prepared:
    """Lay out `p`'s messages: small items in one bucket per direction (views into `staging`'s
    buffer for this peer), the others direct."""
    out = _Prepared(p)
    if p.send:
        bucketed, direct, size = _segments(p.send, direct_bytes)
        out.send_direct = [v for _, v in direct]
        if bucketed:
            out.send_bucket = staging.get(p.peer, "send", size, device)
            out.pack = ([_bucket_view(out.send_bucket, off, v) for off, (_, v) in bucketed],
                        [v for _, (_, v) in bucketed])
    if p.recv:
        bucketed, direct, size = _segments(p.recv, direct_bytes)
        out.recv_direct = [v for _, v in direct]
        if bucketed:
            out.recv_bucket = staging.get(p.peer, "recv", size, device)
            out.unpack = ([v for _, (_, v) in bucketed],
                          [_bucket_view(out.recv_bucket, off, v) for off, (_, v) in bucketed])
    return out


def bucket_sizes(peers: Sequence[_PeerPlan], direct_bytes: int) -> dict[tuple[int, str], int]:
    """{(peer, "send" / "recv"): bucket bytes} of one round."""
    sizes = {}
    for p in peers:
        for direction, items in (("send", p.send), ("recv", p.recv)):
            if items:
                sizes[(p.peer, direction)] = _segments(items, direct_bytes)[2]
    return sizes


class Staging:
    """Reusable bucket buffers, one per (peer, direction), grown as needed.

    Fresh buffers cost page faults on every sync (CPU) or allocator traffic (GPU); a caller that
    syncs weights every step keeps one `Staging` and passes it to every call. Holds at most one
    round's buckets (the plan's per-round budget bounds them), and the prepared rounds of the
    last `reshard` call that can repeat (moe/runtime.py).
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}
        self.program: tuple[Any, ...] | None = None  # (plan, key, prepared rounds) of the last repeatable call

    def get(self, peer: int, direction: str, nbytes: int, device: torch.device | None) -> torch.Tensor:
        buf = self._bufs.get((peer, direction))
        if buf is None or buf.numel() < nbytes or buf.device != torch.empty(0, device=device).device:
            buf = self._bufs[(peer, direction)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


def exchange(peers: Sequence[_PeerPlan | _Prepared], *, deadline_s: float, round_label: str,
             verify: str = "sampled", direct_bytes: int = 1 << 20, group: dist.ProcessGroup | None = None,
             device: torch.device | None = None, staging: Staging | None = None) -> None:
    """Run one round: every peer's sends and receives, checked, within `deadline_s`.

    Both sides of a pair must list the same items (same order, sizes and dtypes) and pass `verify`
    "off" or not (the sender's "full" or "sampled" travels with its checksum). Payload sends and
    all receives are posted in one `batch_isend_irecv`; the sender's checksums are computed while
    the payload is in flight and follow in a second batch. Raises `RoundTimeout` naming the
    stalled peers, `ChecksumError` naming the peer and its tensors. Peers may come `prepare`d
    (then `direct_bytes` and `staging` were applied when they were prepared).
    """
    ops: list[dist.P2POp] = []
    owners: list[_PeerPlan] = []
    done: dict[int, Callable[[], None]] = {}  # index of a peer's last receive op -> verify + unpack
    sent: list[tuple[_PeerPlan, int, list[torch.Tensor]]] = []
    staging = staging or Staging()
    checked = verify_mode(verify) != "off"
    for pp in peers:
        q = pp if isinstance(pp, _Prepared) else prepare(pp, direct_bytes, staging, device)
        p = q.plan
        if p.send:
            payloads = []
            if q.send_bucket is not None:
                torch._foreach_copy_(q.pack[0], q.pack[1])
                payloads.append(q.send_bucket)
            payloads += [_flat(v if v.is_contiguous() else v.contiguous()) for v in q.send_direct]
            for tag, buf in enumerate(payloads):
                ops.append(dist.P2POp(dist.isend, buf, p.peer, group, tag))
                owners.append(p)
            sent.append((p, len(payloads), payloads))
        if p.recv:
            unpack: list[Callable[[], None]] = []
            bufs = []
            if q.recv_bucket is not None:
                bufs.append(q.recv_bucket)
                unpack.append(lambda q=q: torch._foreach_copy_(q.unpack[0], q.unpack[1]))
            for view in q.recv_direct:
                if view.is_contiguous():
                    bufs.append(_flat(view))
                else:
                    tmp = torch.empty(view.shape, dtype=view.dtype, device=view.device)
                    bufs.append(_flat(tmp))
                    unpack.append(lambda view=view, tmp=tmp: view.copy_(tmp))
            for tag, buf in enumerate(bufs):  # tags count per direction, from 0 on both sides
                ops.append(dist.P2POp(dist.irecv, buf, p.peer, group, tag))
                owners.append(p)
            expect = torch.zeros(2, dtype=torch.int64, device=device)  # (phase, checksum)
            if checked:
                ops.append(dist.P2POp(dist.irecv, expect, p.peer, group, len(bufs)))
                owners.append(p)
            done[len(ops) - 1] = (lambda p=p, expect=expect, bufs=bufs, unpack=unpack:
                                  _finish(p, expect if checked else None, bufs, unpack, round_label))
    if not ops and not sent:
        return
    works = dist.batch_isend_irecv(ops) if ops else []
    if checked and sent:
        phase = next_phase(verify, round_label)
        sums = [torch.tensor([phase, combine([checksum(b, phase) for b in payloads])], dtype=torch.int64,
                             device=device) for _, _, payloads in sent]
        sum_ops = [dist.P2POp(dist.isend, s, p.peer, group, tag) for s, (p, tag, _) in zip(sums, sent)]
        works += dist.batch_isend_irecv(sum_ops)
        owners += [p for p, _, _ in sent]
    _wait(works, owners, deadline_s, round_label, group, done)


def _finish(p: _PeerPlan, expect: torch.Tensor | None, bufs: list[torch.Tensor],
            unpack: list[Callable[[], None]], round_label: str) -> None:
    """A peer's receives are complete: check its checksum, then copy bucketed pieces into place."""
    if expect is not None:
        phase, want = expect.tolist()
        got = combine([checksum(b, phase) for b in bufs]) if FULL <= phase < SAMPLE_EVERY else None
        if got != want:
            names = sorted({n for n, _ in p.recv})
            raise ChecksumError(
                f"{round_label}: checksum mismatch on the bytes received from {p.label}: sender computed "
                f"{want} (phase {phase}), receiver {got}; tensors in that message: "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    for f in unpack:
        f()


def _wait(works: list, owners: list[_PeerPlan], deadline_s: float, round_label: str,
          group: dist.ProcessGroup | None, done: dict[int, Callable[[], None]] | None = None) -> None:
    """Wait for all works until the deadline; raise RoundTimeout naming the peers still pending.

    `done[i]` runs once works 0..i have completed (gloo: right away, overlapping the peers still
    in flight; other backends: after all), unless a peer has stalled by then.

    batch_isend_irecv returns one work per op on gloo (we map each to its peer); with NCCL it may
    return a single coalesced work, in which case the stall is attributed to every peer of the round.
    """
    end = time.monotonic() + deadline_s
    if len(works) != len(owners):
        owners_of = [list({id(o): o for o in owners}.values())] * len(works)
    else:
        owners_of = [[o] for o in owners]
    gloo = dist.get_backend(group) == "gloo"
    stalled: dict[int, str] = {}
    errors: list[str] = []
    pending = list(range(len(works)))
    delay = 5e-5
    while pending:
        left = end - time.monotonic()
        still = []
        for i in pending:
            w = works[i]
            try:
                if gloo:
                    w.wait(datetime.timedelta(seconds=max(left, 0.001)))
                elif not w.is_completed():
                    still.append(i)
                    continue
                else:
                    w.wait()
            except RuntimeError as e:
                timed_out = "Timed out" in str(e) or "timeout" in str(e).lower()
                for o in owners_of[i]:
                    stalled[o.peer] = o.label
                if not timed_out:
                    errors.append(str(e).splitlines()[0][:200])
            else:
                if gloo and not stalled and done and i in done:
                    done[i]()  # may raise ChecksumError: not a transport error, so outside the try
            left = end - time.monotonic()
        pending = still
        if pending:
            if time.monotonic() >= end:
                for i in pending:
                    for o in owners_of[i]:
                        stalled[o.peer] = o.label
                break
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)
    if stalled:
        labels = [stalled[k] for k in sorted(stalled)]
        why = f" (errors: {'; '.join(errors)})" if errors else ""
        raise RoundTimeout(f"{round_label} did not complete within its deadline of {deadline_s:g} s; stalled "
                           f"peers: {', '.join(labels)}{why}", labels)
    if not gloo:
        for i in sorted(done or {}):
            done[i]()
