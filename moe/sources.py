"""Which trainer rank broadcasts which full HF tensors, in which buckets (no torch: `hpcrl plan` uses it).

Shared by the broadcast paths (moe/_broadcast_sync.py inside one torch world, and
hpcrl/trainer/broadcast_sync.py over SGLang's routes) and by the time model (moe/network.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe.fused import fused_groups
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
    the least loaded of them. Tensors SGLang fuses on load (`moe.fused`) share one source and one
    bucket (a group larger than `bucket_bytes` is a bucket of its own).
    """
    world = 1 + max(r for pl in placement for _, ranks in pl for r in ranks)
    allowed = None
    if max_sources is not None and max_sources < world:
        allowed = sorted({i * world // max(1, max_sources) for i in range(max(1, max_sources))})
    load = [0] * world
    per_src: list[list[list[int]]] = [[] for _ in range(world)]  # units: tensors that travel together
    fused = {g[0]: g for g in fused_groups([t.name for t in spec.tensors])}
    follower = {ti for g in fused.values() for ti in g[1:]}
    for ti in range(len(spec.tensors)):
        if ti in follower:
            continue  # placed with its group's first tensor
        unit = fused.get(ti, [ti])
        wholes = [{r for box, ranks in placement[u] if box.shape == spec.tensors[u].shape for r in ranks}
                  for u in unit]
        whole = set.intersection(*wholes)
        cands = sorted(whole or {r for u in unit for _, ranks in placement[u] for r in ranks})
        if allowed is not None:
            cands = [r for r in cands if r in allowed] or allowed
        s = min(cands, key=lambda r: (load[r], r))
        load[s] += sum(spec.tensors[u].nbytes for u in unit)
        per_src[s].append(unit)
    out: list[list[Bucket]] = []
    align = 1 if packed else ALIGN
    for s, units in enumerate(per_src):
        if packed:
            for unit in units:
                unit.sort(key=lambda ti: (-spec.tensors[ti].itemsize, ti))
            units.sort(key=lambda u: (-spec.tensors[u[0]].itemsize, u[0]))
        buckets: list[Bucket] = []
        for unit in units:
            sizes = [-(-spec.tensors[ti].nbytes // align) * align for ti in unit]
            if not buckets or (buckets[-1].nbytes and buckets[-1].nbytes + sum(sizes) > bucket_bytes):
                buckets.append(Bucket(s))
            b = buckets[-1]
            for ti, nb in zip(unit, sizes):
                b.tensors.append(ti)
                b.offsets.append(b.nbytes)
                b.nbytes += nb
        out.append(buckets)
    return out
