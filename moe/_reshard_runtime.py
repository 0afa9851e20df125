"""Low-level machinery of the resharding runtime: bucketed point-to-point exchange with checksums
and a deadline, over torch.distributed (gloo on CPU, NCCL on GPU).

One call of `exchange(...)` is one round: for every peer, the items this rank sends to it and
the items it receives from it, each an (HF tensor name, tensor view) pair listed in the same order
on both sides. Items smaller than `direct_bytes` are packed into one flat uint8 bucket per peer
(one copy); larger items travel as their own message straight from / into the tensor memory when
the view is contiguous (no copy). The bucket starts with a 16-byte header that carries the sender's
checksum of all the bytes it sends that peer in the round (`verify`: "sampled", the default, sums a
rotating 1/32 of them; "full" every byte; "off" none, and a peer with no small items then gets no
bucket); the receiver recomputes it over what arrived and raises `ChecksumError` naming the peer
and the tensors on a mismatch. The direct messages and every receive are posted first; the sender
computes its checksums while they are in flight and sends each bucket last.
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


# Checksum modes. "sampled" sums one 32nd of every message's words, a contiguous slice at a
# different position in each repetition of a round (the sender picks the phase and sends it along):
# every round checks every message's length and catches a lost or truncated message and most
# garbage (what an offset bug produces), and 32 repetitions of a round (32 weight
# syncs) have checked every byte of it once. A 16th cost 5-10% of a sync's time on a CPU host;
# a 32nd halves that (benchmarks/RESULTS.md, reshard_cpu, 2026-12-01). "full" sums every byte: on
# a CPU host that is two more memory passes over the payload (sender and receiver), about half the
# cost of moving it; on GPUs it is cheap next to the transfer. A contiguous slice, not strided
# blocks: on this VM every page touched costs a page walk, so a slice is 1.5x cheaper than 4 KiB
# blocks spread over the message. A word sum does not see words reordered within a message (rows
# swapped between two pieces of one bucket); `combine` weighs a peer's messages by their place, so
# two of its messages swapped are seen. Both sides' orders come from one plan.
VERIFY_MODES = ("sampled", "full", "off")
SAMPLE_EVERY = 32
FULL = -1  # the phase that means every byte
_phases: collections.defaultdict[str, itertools.count] = collections.defaultdict(itertools.count)


def verify_mode(verify: str) -> str:
    """`verify` checked: one of VERIFY_MODES, else a ValueError that names the valid values."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} must be one of {', '.join(map(repr, VERIFY_MODES))} "
                         f"(the checksum of every round: a rotating 1/{SAMPLE_EVERY} sample, every byte, "
                         f"or none)")
    return verify


def next_phase(verify: str, round_label: str) -> int:
    """The phase a sender uses for this repetition of a round: FULL, or the round's next sample slice."""
    return FULL if verify == "full" else next(_phases[round_label]) % SAMPLE_EVERY


def checksum(buf: torch.Tensor, phase: int = FULL) -> int:
    """A cheap checksum of a tensor's bytes: the sum of its zero-padded 64-bit words, plus length.

    With `phase` FULL every word counts: catches flipped, lost and truncated bytes (not reordered
    words). With phase k in [0, S), S = SAMPLE_EVERY, only the words [k * w // S, (k + 1) * w // S)
    of the w words count (and the length). Independent of the buffer's alignment (a misaligned or
    odd-sized buffer is copied once); computed on the tensor's device. A native int64 sum runs at
    memory speed, unlike widening int32 words (20x slower on CPU).
    """
    return word_sum(_words(buf), buf.numel() * buf.element_size(), phase)


def _words(buf: torch.Tensor) -> np.ndarray | torch.Tensor:
    """`buf`'s bytes as 64-bit words (zero-padded; a misaligned or odd-sized buffer is copied).

    A view when it can be: a prepared round keeps it and sums it on every sync (moe/runtime.py).
    numpy on CPU: a few microseconds less per call than torch, and there is a call per message.
    """
    b = buf.reshape(-1).view(torch.uint8)
    n = b.numel()
    if not _word_aligned(b):
        padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=b.device)
        padded[:n] = b
        b = padded
    return b.detach().numpy().view(np.int64) if b.device.type == "cpu" else b.view(torch.int64)


def _word_aligned(flat: torch.Tensor) -> bool:
    """Whether flat bytes can be viewed as 64-bit words in place (8-byte start and length)."""
    return flat.numel() % 8 == 0 and flat.data_ptr() % 8 == 0


def word_sum(words: np.ndarray | torch.Tensor, nbytes: int, phase: int = FULL) -> int:
    """`checksum` of a buffer of `nbytes` bytes whose words (`_words`) are given."""
    if phase != FULL:
        w = len(words)
        words = words[phase * w // SAMPLE_EVERY:(phase + 1) * w // SAMPLE_EVERY]
    return _wrap(int(words.sum()) + nbytes * 1_000_003)


def combine(sums: list[int]) -> int:
    """The checksum of several messages in their order: the k-th weighted by k + 1 (swapped messages
    are seen), as a signed 64-bit value."""
    return _wrap(sum((k + 1) * s for k, s in enumerate(sums)))


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


# The bucket's header: (phase, checksum) as two int64 words, ahead of the small items.
HEADER = 16


def _segments(items: list[Item], direct_bytes: int) -> tuple[list[tuple[int, Item]], list[Item], int]:
    """Split items into bucketed ones (with their byte offsets, after the header) and direct ones;
    returns the bucket's size, header included."""
    bucketed, direct, off = [], [], HEADER
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
    """A peer's part of a round with its bucket layout and every view made once, so that a sync
    repeated with the same tensors (weights updated in place) only copies, sums and sends.

    `*_flat` are the direct items as flat bytes (None: not contiguous, copied on every call) and
    `*_words` those bytes as 64-bit words for the checksum (None: misaligned, summed from a copy).
    """

    plan: _PeerPlan
    send_bucket: torch.Tensor | None = None
    pack: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))  # (bucket, source)
    send_direct: list[torch.Tensor] = field(default_factory=list)
    send_flat: list[torch.Tensor | None] = field(default_factory=list)
    send_words: list[Any] = field(default_factory=list)  # direct items, then the bucket's body
    recv_bucket: torch.Tensor | None = None
    unpack: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))  # (dest, bucket)
    recv_direct: list[torch.Tensor] = field(default_factory=list)
    recv_flat: list[torch.Tensor | None] = field(default_factory=list)
    recv_words: list[Any] = field(default_factory=list)


def _flat_or_none(view: torch.Tensor) -> torch.Tensor | None:
    return _flat(view) if view.is_contiguous() else None


def _word_view(flat: torch.Tensor | None) -> Any:
    """`flat`'s 64-bit words as a view, or None where that needs a copy (then summed per call)."""
    return _words(flat) if flat is not None and _word_aligned(flat) else None


def prepare(p: _PeerPlan, direct_bytes: int, staging: Staging, device: torch.device | None) -> _Prepared:
    """Lay out `p`'s messages: small items in one bucket per direction (views into `staging`'s
    buffer for this peer, after the checksum header), the others direct."""
    out = _Prepared(p)
    if p.send:
        bucketed, direct, size = _segments(p.send, direct_bytes)
        out.send_direct = [v for _, v in direct]
        out.send_bucket = staging.get(p.peer, "send", size, device)
        out.pack = ([_bucket_view(out.send_bucket, off, v) for off, (_, v) in bucketed],
                    [v for _, (_, v) in bucketed])
        out.send_flat = [_flat_or_none(v) for v in out.send_direct]
        out.send_words = [_word_view(f) for f in (*out.send_flat, out.send_bucket[HEADER:])]
    if p.recv:
        bucketed, direct, size = _segments(p.recv, direct_bytes)
        out.recv_direct = [v for _, v in direct]
        out.recv_bucket = staging.get(p.peer, "recv", size, device)
        out.unpack = ([v for _, (_, v) in bucketed],
                      [_bucket_view(out.recv_bucket, off, v) for off, (_, v) in bucketed])
        out.recv_flat = [_flat_or_none(v) for v in out.recv_direct]
        out.recv_words = [_word_view(f) for f in (*out.recv_flat, out.recv_bucket[HEADER:])]
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
    "off" or not (the sender's "full" or "sampled" travels in its bucket's header). On gloo the
    direct sends and all receives are posted first, the sender's checksums are computed while those
    are in flight, and the buckets (header + small items) follow; other backends (NCCL) pack and
    checksum the buckets first and post the whole round as one batch (see the comment at the end).
    Raises `RoundTimeout` naming the stalled peers, `ChecksumError` naming the peer and its tensors.
    Peers may come `prepare`d (then `direct_bytes` and `staging` were applied when they were prepared).
    """
    post = _Poster(group)
    done: dict[int, Callable[[], None]] = {}  # index of a peer's last receive -> verify + unpack
    buckets: list[tuple[_Prepared, int, list[torch.Tensor]]] = []  # (peer, bucket tag, direct payloads)
    staging = staging or Staging()
    checked = verify_mode(verify) != "off"
    for pp in peers:
        q = pp if isinstance(pp, _Prepared) else prepare(pp, direct_bytes, staging, device)
        p = q.plan
        if p.send:
            payloads = [f if f is not None else _flat(v.contiguous())
                        for f, v in zip(q.send_flat, q.send_direct)]
            for tag, buf in enumerate(payloads):
                post.send(buf, p, tag)
            if checked or q.pack[0]:
                buckets.append((q, len(payloads), payloads))
        if p.recv:
            unpack: list[Callable[[], None]] = []
            bufs = []
            for f, view in zip(q.recv_flat, q.recv_direct):
                if f is None:
                    tmp = torch.empty(view.shape, dtype=view.dtype, device=view.device)
                    f = _flat(tmp)
                    unpack.append(lambda view=view, tmp=tmp: view.copy_(tmp))
                bufs.append(f)
            for tag, buf in enumerate(bufs):  # tags count per direction, from 0 on both sides
                post.recv(buf, p, tag)
            if checked or q.unpack[0]:
                post.recv(q.recv_bucket, p, len(bufs))
            if q.unpack[0]:
                unpack.append(lambda q=q: torch._foreach_copy_(q.unpack[0], q.unpack[1]))
            verify_with = (q, bufs) if checked else None
            done[len(post.ops) - 1] = (lambda p=p, v=verify_with, unpack=unpack:
                                       _finish(p, v, unpack, round_label))
    if not post.ops and not buckets:
        return
    if post.gloo:  # the direct sends and the receives run while the buckets' checksums are computed
        post.flush()
    if buckets:
        phase = next_phase(verify, round_label) if checked else FULL
        for q, tag, payloads in buckets:
            if q.pack[0]:
                torch._foreach_copy_(q.pack[0], q.pack[1])
            if checked:
                s = combine(_sums((*payloads, q.send_bucket[HEADER:]), q.send_words, phase))
                q.send_bucket[:HEADER].view(torch.int64).copy_(torch.tensor([phase, s]))
            post.send(q.send_bucket, q.plan, tag)
    # One batch on NCCL: it runs a batch as one kernel on the group's stream, so a bucket send in a
    # second batch would wait for the first batch's receives, and two ranks that send each other
    # buckets in one round (any cycle of peers) would each wait for the other's second batch.
    post.flush()
    _wait(post.works, post.owners, deadline_s, round_label, group, done)


class _Poster:
    """Posts a round's sends and receives, and keeps their works with the peer each belongs to.

    On gloo every op goes straight to the process group's send / recv (there batch_isend_irecv
    only loops over isend / irecv, adding argument checks per op: a round posts hundreds); other
    backends get one batch_isend_irecv per `flush` (NCCL must group them).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.pg = group if group is not None else dist.group.WORLD
        self.gloo = dist.get_backend(group) == "gloo"
        self.ops: list[tuple[bool, torch.Tensor, int, int]] = []  # (send?, tensor, global peer, tag)
        self.owners: list[_PeerPlan] = []
        self.works: list[Any] = []
        self._posted = 0

    def send(self, buf: torch.Tensor, p: _PeerPlan, tag: int) -> None:
        self.ops.append((True, buf, p.peer, tag))
        self.owners.append(p)

    def recv(self, buf: torch.Tensor, p: _PeerPlan, tag: int) -> None:
        self.ops.append((False, buf, p.peer, tag))
        self.owners.append(p)

    def flush(self) -> None:
        new = self.ops[self._posted:]
        self._posted = len(self.ops)
        if not new:
            return
        if self.gloo:
            peer = (lambda g: g) if self.group is None else (lambda g: dist.get_group_rank(self.group, g))
            self.works += [self.pg.send([t], peer(g), tag) if is_send else self.pg.recv([t], peer(g), tag)
                           for is_send, t, g, tag in new]
        else:
            self.works += dist.batch_isend_irecv([dist.P2POp(dist.isend if is_send else dist.irecv, t, g,
                                                             self.group, tag) for is_send, t, g, tag in new])


def _sums(bufs: Sequence[torch.Tensor], words: Sequence[Any], phase: int) -> list[int]:
    """The checksums of `bufs`, from their prepared word views where there are some."""
    return [checksum(b, phase) if w is None else word_sum(w, b.numel(), phase) for b, w in zip(bufs, words)]


def _finish(p: _PeerPlan, check: tuple[_Prepared, list[torch.Tensor]] | None,
            unpack: list[Callable[[], None]], round_label: str) -> None:
    """A peer's receives are complete: check its checksum (`check`: the prepared peer and the
    direct buffers received; the sender's (phase, sum) is the bucket's header), then copy
    bucketed pieces into place."""
    if check is not None:
        q, bufs = check
        phase, want = q.recv_bucket[:HEADER].view(torch.int64).tolist()
        got = (combine(_sums((*bufs, q.recv_bucket[HEADER:]), q.recv_words, phase))
               if FULL <= phase < SAMPLE_EVERY else None)
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

    On gloo there is one work per op (we map each to its peer), and every wait blocks: the works up
    to each `done` index are waited last one first, because a peer's messages mostly complete in
    the order they were posted, so one blocking wait covers the group and the others find their
    work done (a blocking wait is a sleep and a wake-up, which cost more CPU than the wait itself).
    With NCCL batch_isend_irecv may return a single coalesced work, in which case the stall is
    attributed to every peer of the round.
    """
    end = time.monotonic() + deadline_s
    if len(works) != len(owners):
        owners_of = [list({id(o): o for o in owners}.values())] * len(works)
    else:
        owners_of = [[o] for o in owners]
    gloo = dist.get_backend(group) == "gloo"
    stalled: dict[int, str] = {}
    errors: list[str] = []
    pending, after = _wait_order(len(works), done or {}) if gloo else (list(range(len(works))), {})
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
                if i in after and not stalled:
                    done[after[i]]()  # may raise ChecksumError: not a transport error, so outside the try
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


def _wait_order(n: int, done: dict[int, Callable[[], None]]) -> tuple[list[int], dict[int, int]]:
    """The order in which to wait n gloo works: up to each `done` index k, the works since the
    previous one from last to first; then the rest, last first. Returns (order, {i: k}): after
    waiting work i, run done[k] (all works up to k are waited by then)."""
    order: list[int] = []
    after: dict[int, int] = {}
    start = 0
    for k in sorted(done):
        order += range(k, start - 1, -1)
        after[start] = k
        start = k + 1
    order += range(n - 1, start - 1, -1)
    return order, after
