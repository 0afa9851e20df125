"""The SGLang-compatible weight path: full HF tensors broadcast in buckets from disjoint sources.

SGLang 0.5.x takes new weights only as NCCL broadcasts of whole HF-named tensors
(`/update_weights_from_distributed`). To keep that path fast, the tensors are split over many
trainer sources instead of one: every tensor gets one source, chosen (identically on every rank,
from the layouts alone) among the trainer ranks holding it whole if any, else among those holding
a piece, always the least loaded so far in bytes. Each source packs its tensors, in spec order,
into buckets of at most `bucket_bytes` (a larger tensor is a bucket of its own). Bucket round k:
(1) sources missing pieces of their k-th bucket gather them point to point from a holder (a
checked, deadlined `exchange`); (2) every source broadcasts its k-th bucket plus a checksum to all
rollout ranks in its own group ({source} + rollout ranks), all sources concurrently. Rollout ranks
verify (moe/_reshard_runtime.py's checksum modes), hand each full tensor to `on_full_tensor` (an
SGLang engine's load_weights) and keep the box their layout assigns. Entry point:
`moe.runtime.broadcast_sync`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moe._reshard_runtime import (FULL, SAMPLE_EVERY, ChecksumError, Staging, _PeerPlan, _Prepared, _wait,
                                  checksum, exchange, next_phase)
from moe.layouts import TensorPlacement
from moe.sources import Bucket, assign_sources, gather_holder
from moe.slices import Box
from moe.specs import MoESpec

Shards = dict[str, tuple[Box, torch.Tensor]]
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
TRAILER = 16  # bytes after a broadcast bucket: the sender's checksum phase and checksum, two int64


def make_groups(spec: MoESpec, src_placement: list[TensorPlacement], rollout_world: int,
                global_rank: Callable[[str, int], int], bucket_bytes: int, backend: str
                ) -> dict[int, dist.ProcessGroup]:
    """Create one group {source} + rollout ranks per source: collective over the whole default world.

    Every rank of the default world must call this with the same arguments, in the same order
    (torch's new_group; `use_local_synchronization` deadlocks for these overlapping groups in
    torch 2.13). Returns the groups this rank belongs to, by source trainer rank. Groups are cached.
    """
    plan = assign_sources(spec, src_placement, bucket_bytes)
    rollout_g = tuple(global_rank("rollout", j) for j in range(rollout_world))
    me = dist.get_rank()
    out: dict[int, dist.ProcessGroup] = {}
    for s in (s for s, b in enumerate(plan) if b):
        ranks = (global_rank("trainer", s),) + rollout_g
        g = _GROUPS.get(ranks)
        if g is None:
            g = _GROUPS[ranks] = dist.new_group(list(ranks), backend=backend)
        if me in ranks:
            out[s] = g
    return out


def _full_view(buf: torch.Tensor, off: int, t_shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
               ) -> torch.Tensor:
    return buf[off:off + nbytes].view(dtype).view(t_shape)


def run(spec: MoESpec, src_placement: list[TensorPlacement], rollout_boxes: dict[str, Box], role: str,
        rank: int, shards: Shards | None, result: Shards, global_rank: Callable[[str, int], int],
        label: Callable[[str, int], str], rollout_world: int, bucket_bytes: int, deadline_s: float,
        verify: str, groups: dict[int, dist.ProcessGroup],
        on_full_tensor: Callable[[str, torch.Tensor], None] | None) -> None:
    """Execute the broadcast path on this rank (see the module docstring); fills `result` in place."""
    plan = assign_sources(spec, src_placement, bucket_bytes)
    sources = [s for s, b in enumerate(plan) if b]
    need = sources if role == "rollout" else [rank] if plan[rank] else []
    missing = [s for s in need if s not in groups]
    if missing:
        raise ValueError(f"groups lacks the broadcast groups of source trainer ranks {missing}; create them "
                         f"with moe.runtime.broadcast_groups(plan) on every rank of the world")
    device = next((t.device for _, t in (shards or result).values()), None)
    for k in range(max((len(plan[s]) for s in sources), default=0)):
        bufs: dict[int, torch.Tensor] = {}
        if role == "trainer":
            mine = plan[rank][k] if k < len(plan[rank]) else None
            if mine is not None:
                bufs[rank] = torch.empty(mine.nbytes + TRAILER, dtype=torch.uint8, device=device)
            _gather(spec, src_placement, plan, k, rank, shards or {}, bufs.get(rank), global_rank, label,
                    deadline_s, verify)
            if mine is not None:
                phase, s = FULL, 0  # "off": the trailer travels unchecked
                if verify != "off":
                    phase = next_phase(verify, f"broadcast bucket {k} from {label('trainer', rank)}")
                    s = checksum(bufs[rank][:mine.nbytes], phase)
                bufs[rank][mine.nbytes:].view(torch.int64)[:] = torch.tensor([phase, s])
        else:
            for s in sources:
                if k < len(plan[s]):
                    bufs[s] = torch.empty(plan[s][k].nbytes + TRAILER, dtype=torch.uint8, device=device)
        works, owners = [], []
        for s, buf in sorted(bufs.items()):
            works.append(dist.broadcast(buf, src=global_rank("trainer", s), group=groups[s], async_op=True))
            g = global_rank("trainer", s)
            owners.append(_PeerPlan(g, label("trainer", s)))
        _wait(works, owners, deadline_s, f"broadcast bucket {k} on {label(role, rank)}", None)
        if role == "rollout":
            for s, buf in sorted(bufs.items()):
                _consume(spec, plan[s][k], buf, rollout_boxes, result, verify, label("trainer", s),
                         on_full_tensor)


def _gather(spec: MoESpec, pl: list[TensorPlacement], plan: list[list[Bucket]], k: int, rank: int,
            shards: Shards, buf: torch.Tensor | None, global_rank: Callable[[str, int], int],
            label: Callable[[str, int], str], deadline_s: float, verify: str) -> None:
    """Sources fill their k-th bucket: own pieces copied, missing pieces received from one holder each."""
    copies, peers = gather_program(spec, pl, plan, k, rank, shards, buf, global_rank, label)
    run_gather(copies, peers, deadline_s, verify, f"broadcast gather {k} on {label('trainer', rank)}",
               buf.device if buf is not None else None)


def gather_program(spec: MoESpec, pl: list[TensorPlacement], plan: list[list[Bucket]], k: int, rank: int,
                   shards: Shards, buf: torch.Tensor | None, global_rank: Callable[[str, int], int],
                   label: Callable[[str, int], str]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                              list[_PeerPlan]]:
    """What bucket round k asks of this rank, as views: (local copies (dst, src), peers to
    exchange with, in global rank order). Valid while `shards` and `buf` keep their memory."""
    peers: dict[int, _PeerPlan] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s, buckets in enumerate(plan):
        if k >= len(buckets):
            continue
        b = buckets[k]
        for ti, off in zip(b.tensors, b.offsets):
            t = spec.tensors[ti]
            for box, ranks in pl[ti]:
                holder = gather_holder(ti, s, ranks)
                if s == rank:
                    assert buf is not None
                    full = _full_view(buf, off, t.shape, getattr(torch, t.dtype), t.nbytes)
                    dst = full[box.relative_to(Box.full(t.shape))]
                    if holder == rank:
                        sb, st = shards[t.name]
                        copies.append((dst, st[box.relative_to(sb)]))
                    else:
                        g = global_rank("trainer", holder)
                        peers.setdefault(g, _PeerPlan(g, label("trainer", holder))).recv.append((t.name, dst))
                elif holder == rank:
                    sb, st = shards[t.name]
                    g = global_rank("trainer", s)
                    peers.setdefault(g, _PeerPlan(g, label("trainer", s))).send.append(
                        (t.name, st[box.relative_to(sb)]))
    return copies, [peers[g] for g in sorted(peers)]


def run_gather(copies: list[tuple[torch.Tensor, torch.Tensor]], peers: Sequence[_PeerPlan | _Prepared],
               deadline_s: float, verify: str, round_label: str, device: torch.device | None,
               staging: Staging | None = None) -> None:
    """Execute one bucket round of `gather_program`: the local copies, then the checked exchange."""
    if copies:
        torch._foreach_copy_([d for d, _ in copies], [src for _, src in copies])
    exchange(peers, deadline_s=deadline_s, verify=verify, round_label=round_label, device=device,
             staging=staging)


def _consume(spec: MoESpec, b: Bucket, buf: torch.Tensor, boxes: dict[str, Box], result: Shards, verify: str,
             src_label: str, on_full_tensor: Callable[[str, torch.Tensor], None] | None) -> None:
    if verify != "off":
        phase, want = buf[b.nbytes:].view(torch.int64).tolist()
        got = checksum(buf[:b.nbytes], phase) if FULL <= phase < SAMPLE_EVERY else None
        if want != got:
            names = [spec.tensors[ti].name for ti in b.tensors]
            raise ChecksumError(f"broadcast from {src_label}: checksum mismatch (sender {want}, "
                                f"phase {phase}, receiver {got}) in a bucket of {', '.join(names[:8])}"
                                f"{' ...' if len(names) > 8 else ''}")
    for ti, off in zip(b.tensors, b.offsets):
        t = spec.tensors[ti]
        full = _full_view(buf, off, t.shape, getattr(torch, t.dtype), t.nbytes)
        if on_full_tensor is not None:
            on_full_tensor(t.name, full)
        if t.name in result:
            box, dst = result[t.name]
            dst.copy_(full[box.relative_to(Box.full(t.shape))])
