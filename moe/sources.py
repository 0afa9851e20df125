"""Which trainer rank broadcasts which full HF tensors, in which buckets (no torch: `hpcrl plan` uses it).

Shared by the broadcast paths (moe/_broadcast_sync.py inside one torch world, and
hpcrl/trainer/broadcast_sync.py over SGLang's routes) and by the time model (moe/network.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe.layouts import TensorPlacement
from moe.specs import MoESpec

ALIGN = 8  # bucket offsets are multiples of 8 so that any dtype can be viewed in place


def source_cap(spec: MoESpec, bucket_bytes: int) -> int:
    """At most one broadcast source per bucket's worth of weights: a source with less than a bucket
    only adds one more update per engine (an engine takes one at a time)."""
    return -(-spec.total_bytes // bucket_bytes)


def gather_holder(ti: int, source: int, ranks: tuple[int, ...]) -> int:
    """The rank source `source` takes its piece of tensor `ti` from (itself if it holds it)."""
    return source if source in ranks else ranks[ti % len(ranks)]


@dataclass
class Bucket:
    """Tensors (spec indices) one source broadcasts together, with their byte offsets."""

    source: int                                   # trainer rank
    tensors: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0                               # payload bytes (aligned), checksum excluded


def assign_sources(spec: MoESpec, placement: list[TensorPlacement], bucket_bytes: int, packed: bool = False,
                   max_sources: int | None = None) -> list[list[Bucket]]:
    """Per trainer rank, its buckets (empty list: not a source). Deterministic from the inputs.

    Default: tensors in spec order at offsets padded to `ALIGN`, room for a checksum after them.
    `packed`: SGLang's flattened-bucket layout, tensors back to back with no padding; a source's
    tensors are ordered by falling item size (then spec order) so every offset stays a multiple of
    its tensor's item size and views in place. `max_sources`: only that many ranks, evenly spread
    over the rank range (rank 0 first), may be sources; a tensor none of them holds is gathered by
    the least loaded of them.
    """
    world = 1 + max(r for pl in placement for _, ranks in pl for r in ranks)
    allowed = None
    if max_sources is not None and max_sources < world:
        allowed = sorted({i * world // max(1, max_sources) for i in range(max(1, max_sources))})
    load = [0] * world
    per_src: list[list[int]] = [[] for _ in range(world)]
    for ti, (t, pl) in enumerate(zip(spec.tensors, placement)):
        whole = [ranks for box, ranks in pl if box.shape == t.shape]
        cands = sorted(whole[0]) if whole else sorted({r for _, ranks in pl for r in ranks})
        if allowed is not None:
            cands = [r for r in cands if r in allowed] or allowed
        s = min(cands, key=lambda r: (load[r], r))
        load[s] += t.nbytes
        per_src[s].append(ti)
    out: list[list[Bucket]] = []
    align = 1 if packed else ALIGN
    for s, tids in enumerate(per_src):
        if packed:
            tids.sort(key=lambda ti: (-spec.tensors[ti].itemsize, ti))
        buckets: list[Bucket] = []
        for ti in tids:
            nb = -(-spec.tensors[ti].nbytes // align) * align
            if not buckets or (buckets[-1].nbytes and buckets[-1].nbytes + nb > bucket_bytes):
                buckets.append(Bucket(s))
            b = buckets[-1]
            b.tensors.append(ti)
            b.offsets.append(b.nbytes)
            b.nbytes += nb
        out.append(buckets)
    return out
