"""The resharding runtime: execute a `Plan` over torch.distributed, or broadcast full HF tensors.

Rank mapping. Both paths run in one torch.distributed world (default group, or `group`) holding
the trainer ranks followed by the rollout ranks: trainer rank t is global rank `base + t` and
rollout rank j is global rank `base + plan.src.world_size + j` (`RankMap`; `base` lets a
controller rank 0 or other ranks precede them; ranks outside the map may exist and stay idle).

  * `reshard(plan, role, rank, shards)` -- shard to shard: every rank walks the plan's rounds; in a
    round it packs what it sends to each peer into one flat bucket behind a checksum header (large
    boxes go as their own message, zero-copy), posts the receives and direct sends, then the
    buckets, checks each peer's checksum and the round's deadline (moe/_reshard_runtime.py), then
    the next round. Relay transfers (src_side "rollout") are sent from the copy the relaying
    rank received earlier.
  * `broadcast_sync(plan, role, rank, shards)` -- the SGLang-compatible path (SGLang 0.5.x only
    accepts `update_weights_from_distributed` broadcasts of full HF tensors): every tensor gets one
    trainer source, preferring ranks holding it whole and balancing bytes, so the sources own
    disjoint subsets; a source missing pieces first gathers them point to point; then every source
    broadcasts its tensors in buckets to all rollout ranks in its own group, all sources at once.

Both return, on a rollout rank, `{HF name: (Box, tensor)}` exactly as `plan.dst.shards(spec, rank)`
lists (on a trainer rank: {}); `out=` lets an engine receive straight into its own weight tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe import _broadcast_sync
from moe._reshard_runtime import (VERIFY_MODES, ChecksumError, ReshardError, RoundTimeout, Staging, _PeerPlan,
                                  _Prepared, bucket_sizes, exchange, prepare, verify_mode)
from moe.layouts import TensorPlacement
from moe.plan import Plan
from moe.slices import Box
from moe.sources import Bucket, assign_sources
from moe.specs import MoESpec

__all__ = ["VERIFY_MODES", "ChecksumError", "RankMap", "ReshardError", "RoundTimeout", "Shards", "Staging",
           "allocate_shards", "broadcast_groups", "broadcast_sync", "gather_buckets", "reshard",
           "source_buckets"]

Shards = dict[str, tuple[Box, torch.Tensor]]
ROLES = ("trainer", "rollout")


@dataclass(frozen=True, slots=True)
class RankMap:
    """Global ranks of a trainer + rollout world: trainer t -> base + t, rollout j -> base + T + j."""

    trainer_world: int
    rollout_world: int
    base: int = 0

    def global_rank(self, side: str, rank: int) -> int:
        return self.base + rank + (self.trainer_world if side == "rollout" else 0)

    def label(self, side: str, rank: int) -> str:
        return f"{side} rank {rank} (global rank {self.global_rank(side, rank)})"


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def allocate_shards(spec: MoESpec, boxes: list[tuple[str, Box]], device: torch.device | str | None = None
                    ) -> Shards:
    """Empty tensors for `boxes` (from `layout.shards(spec, rank)`), at the spec dtypes."""
    return {n: (b, torch.empty(b.shape, dtype=torch_dtype(spec[n].dtype), device=device)) for n, b in boxes}


def _check_args(plan: Plan, role: str, rank: int, shards: Shards | None) -> None:
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {ROLES}")
    world = plan.src.world_size if role == "trainer" else plan.dst.world_size
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} out of range for the {role} layout's world size {world}")
    if role == "trainer":
        want = dict(plan.src.shards(plan.spec, rank))
        _check_shards("shards", plan.spec, want, shards)


def _check_shards(arg: str, spec: MoESpec, want: Mapping[str, Box], shards: Shards | None) -> None:
    """Shards must hold exactly the boxes of the layout, with the right shape and dtype."""
    if shards is None:
        raise ValueError(f"{arg}=None: a trainer rank must pass its local shards {{HF name: (Box, tensor)}}")
    missing = [n for n in want if n not in shards]
    if missing:
        raise ValueError(f"{arg} lacks {len(missing)} tensors the layout places on this rank, "
                         f"e.g. {missing[:3]}")
    for n, box in want.items():
        b, t = shards[n]
        if b != box or tuple(t.shape) != box.shape or t.dtype != torch_dtype(spec[n].dtype):
            raise ValueError(f"{arg}[{n!r}] = (box {b}, tensor {tuple(t.shape)} {t.dtype}) but the layout "
                             f"says box {box} of dtype {spec[n].dtype}; pass the shard the layout assigns")


def _dst_shards(plan: Plan, rank: int, out: Shards | None, device: torch.device | str | None) -> Shards:
    boxes = plan.dst.shards(plan.spec, rank)
    if out is None:
        return allocate_shards(plan.spec, boxes, device)
    _check_shards("out", plan.spec, dict(boxes), out)
    return {n: out[n] for n, _ in boxes}


def reshard(plan: Plan, role: str, rank: int, shards: Shards | None = None, *, base: int = 0,
            group: dist.ProcessGroup | None = None, deadline_s: float = 60.0, verify: str = "sampled",
            direct_bytes: int = 1 << 20, out: Shards | None = None,
            device: torch.device | str | None = None, staging: Staging | None = None) -> Shards:
    """Execute `plan` on this rank: `role` "trainer" or "rollout", `rank` within that layout.

    Collective over all trainer and rollout ranks of the plan (mapping: `RankMap`). Trainer ranks
    pass `shards` (their local pieces, as `plan.src.shards(spec, rank)` lists them); rollout ranks
    get back their pieces as `plan.dst.shards(spec, rank)` lists them (into `out` if given).
    Every round must finish within `deadline_s` (RoundTimeout names the stalled peers); every
    peer's bytes are checksummed (ChecksumError names the peer and tensors): `verify` "sampled" (a
    rotating 1/32 of the bytes each sync; every byte once in 32 syncs), "full" or "off", the
    same on/off on every rank (moe/_reshard_runtime.py).
    Pieces of at least `direct_bytes` travel as their own message (zero-copy when contiguous),
    smaller ones in one bucket per peer and round; pass the same `staging` to every call to reuse
    the bucket memory across syncs, and, when the call repeats with the same plan and the same
    tensors (`shards`, or `out`), the prepared rounds: views, bucket layout, validation.
    """
    verify_mode(verify)
    staging = staging or Staging()
    # A call repeated with the same tensors (a trainer syncing every step, an engine receiving into
    # its kept buffers) reuses the rounds prepared by the first: views and bucket layout included.
    given = shards if role == "trainer" else out
    key = None if given is None else (role, rank, base, direct_bytes, id(group), _identity(given))
    cached = staging.program
    if key is not None and cached is not None and cached[0] is plan and cached[1] == key:
        result, rounds = cached[2]
    else:
        _check_args(plan, role, rank, shards)
        result = {} if role == "trainer" else _dst_shards(plan, rank, out, device)
        held = shards if role == "trainer" else result
        rounds = _prepare_rounds(plan, role, rank, held, base, direct_bytes, staging, _device_of(held))
        staging.program = None if key is None else (plan, key, (result, rounds))
    held_device = _device_of(shards if role == "trainer" else result)
    _form_communicator(group, held_device)
    for label, peers in rounds:
        exchange(peers, deadline_s=deadline_s, verify=verify, round_label=label, group=group,
                 device=held_device, staging=staging)
    return result


_FORMED: dict[int, dist.ProcessGroup] = {}
"""Non-gloo groups whose communicator a reshard has formed (kept, so that no new group takes the id)."""


def _form_communicator(group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    """NCCL forms a group's communicator at the group's first collective call, and every rank of the
    group must take part in it (torch's batch_isend_irecv note); a round leaves out the ranks with
    nothing to send or receive in it. So the first reshard over a group starts with an all-reduce of
    one element on every rank (all of them call reshard: trainer and engine ranks alike)."""
    if group is None or id(group) in _FORMED or dist.get_backend(group) == "gloo":
        return
    if device is None and torch.cuda.is_available():  # a rank that holds nothing: NCCL's current device
        device = torch.device("cuda", torch.cuda.current_device())
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _FORMED[id(group)] = group


def _identity(shards: Shards) -> tuple:
    """What must not change for prepared rounds to stay valid: every tensor's memory and layout."""
    return tuple((n, b, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for n, (b, t) in shards.items())


def _prepare_rounds(plan: Plan, role: str, rank: int, held: Shards, base: int, direct_bytes: int,
                    staging: Staging, device: torch.device | None) -> list[tuple[str, list[_Prepared]]]:
    """This rank's rounds as (label, prepared peers in staggered order), views made once."""
    rmap = RankMap(plan.src.world_size, plan.dst.world_size, base)
    world = rmap.base + plan.src.world_size + plan.dst.world_size
    names = [t.name for t in plan.spec.tensors]
    if role == "trainer":
        send_rows = np.flatnonzero(~plan.from_rollout & (plan.src_rank == rank))
        recv_rows = np.zeros(0, dtype=np.int64)
    else:
        send_rows = np.flatnonzero(plan.from_rollout & (plan.src_rank == rank))
        recv_rows = np.flatnonzero(plan.dst_rank == rank)
    round_ids = sorted(set(plan.round[send_rows].tolist()) | set(plan.round[recv_rows].tolist()))
    by_round_send = _group(plan.round[send_rows], send_rows)
    by_round_recv = _group(plan.round[recv_rows], recv_rows)
    me = rmap.global_rank(role, rank)
    per_round: list[tuple[int, list[_PeerPlan]]] = []
    for r in round_ids:
        peers: dict[int, _PeerPlan] = {}
        for i in by_round_send.get(r, []):
            d = int(plan.dst_rank[i])
            p = peers.setdefault(rmap.global_rank("rollout", d), _PeerPlan(rmap.global_rank("rollout", d),
                                                                          rmap.label("rollout", d)))
            name = names[plan.tensor[i]]
            box, t = held[name]
            p.send.append((name, t[plan.box(i).relative_to(box)]))
        for i in by_round_recv.get(r, []):
            side = "rollout" if plan.from_rollout[i] else "trainer"
            s = int(plan.src_rank[i])
            g = rmap.global_rank(side, s)
            p = peers.setdefault(g, _PeerPlan(g, rmap.label(side, s)))
            name = names[plan.tensor[i]]
            box, t = held[name]
            p.recv.append((name, t[plan.box(i).relative_to(box)]))
        # staggered peer order (like gloo's own alltoall): not every sender starts on the same receiver
        per_round.append((r, [peers[k] for k in sorted(peers, key=lambda k: (k - me) % world)]))
    # size every bucket for its largest round first, so all rounds' views share one buffer per peer
    largest: dict[tuple[int, str], int] = {}
    for _, peers in per_round:
        for k, n in bucket_sizes(peers, direct_bytes).items():
            largest[k] = max(largest.get(k, 0), n)
    for (peer, direction), n in largest.items():
        staging.get(peer, direction, n, device)
    return [(f"reshard round {r}/{plan.num_rounds} on {rmap.label(role, rank)}",
             [prepare(p, direct_bytes, staging, device) for p in peers]) for r, peers in per_round]


def _group(keys: np.ndarray, rows: np.ndarray) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for k, i in zip(keys.tolist(), rows.tolist()):
        out.setdefault(k, []).append(i)
    return out


def _device_of(shards: Shards | None) -> torch.device | None:
    for _, t in (shards or {}).values():
        return t.device
    return None


def broadcast_sync(plan: Plan, role: str, rank: int, shards: Shards | None = None, *, base: int = 0,
                   group: dist.ProcessGroup | None = None, deadline_s: float = 60.0, verify: str = "sampled",
                   bucket_bytes: int = 64 << 20, out: Shards | None = None,
                   device: torch.device | str | None = None,
                   groups: dict[int, dist.ProcessGroup] | None = None,
                   on_full_tensor: Callable[[str, torch.Tensor], None] | None = None) -> Shards:
    """The SGLang-compatible path with the same inputs and result as `reshard` (moe/_broadcast_sync.py).

    Only the plan's layouts and spec are used (not its transfers). Collective over all trainer and
    rollout ranks. It needs one group per source trainer rank ({source} + rollout ranks): pass
    `groups=broadcast_groups(plan, ...)`, made once by every rank of the default world; if None it
    calls `broadcast_groups` itself, which is only right when the world is exactly the mapped
    trainer + rollout ranks (or every other rank calls `broadcast_groups` at the same time). On rollout
    ranks, `on_full_tensor(name, full_tensor)` is called
    for every HF tensor as it arrives (the view is only valid during the call).
    """
    _check_args(plan, role, rank, shards)
    verify_mode(verify)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive int (e.g. 64 << 20)")
    rmap = RankMap(plan.src.world_size, plan.dst.world_size, base)
    result: Shards = {} if role == "trainer" else _dst_shards(plan, rank, out, device)
    boxes = dict(plan.dst.shards(plan.spec, rank)) if role == "rollout" else {}
    if groups is None:
        groups = broadcast_groups(plan, base=base, bucket_bytes=bucket_bytes, backend=dist.get_backend(group))
    _broadcast_sync.run(plan.spec, plan.src.placement(plan.spec), boxes, role, rank, shards, result,
                        rmap.global_rank, rmap.label, plan.dst.world_size, bucket_bytes, deadline_s, verify,
                        groups, on_full_tensor)
    return result


def broadcast_groups(plan: Plan, *, base: int = 0, bucket_bytes: int = 64 << 20, backend: str | None = None
                     ) -> dict[int, dist.ProcessGroup]:
    """The groups `broadcast_sync` uses (this rank's, by source trainer rank); cached across calls.

    Collective: every rank of the default world must call it with the same plan layouts, `base`
    and `bucket_bytes` (sources depend on them), including ranks outside the trainer + rollout map.
    """
    rmap = RankMap(plan.src.world_size, plan.dst.world_size, base)
    return _broadcast_sync.make_groups(plan.spec, plan.src.placement(plan.spec), plan.dst.world_size,
                                       rmap.global_rank, bucket_bytes, backend or dist.get_backend())


def source_buckets(spec: MoESpec, placement: list[TensorPlacement], bucket_bytes: int = 64 << 20,
                   max_sources: int | None = None) -> list[list[Bucket]]:
    """Per trainer rank, the buckets of full HF tensors it broadcasts (empty: not a source).

    Every tensor gets one source, the least loaded in bytes among the ranks holding it whole (else
    among those holding a piece), so the sources share the work; each source's tensors are cut into
    buckets of at most `bucket_bytes` in SGLang's flattened-bucket layout (back to back, no padding).
    `max_sources` caps the number of sources (evenly spread ranks; the others' tensors are gathered
    by them). Deterministic from the inputs: every rank computes the same answer.
    """
    return assign_sources(spec, placement, bucket_bytes, packed=True, max_sources=max_sources)


def gather_buckets(spec: MoESpec, placement: list[TensorPlacement],
                   buckets: list[list[Bucket]], rank: int, shards: Shards, *,
                   deadline_s: float = 60.0, verify: str = "sampled", into: list[torch.Tensor] | None = None,
                   staging: Staging | None = None) -> list[torch.Tensor]:
    """Fill this trainer rank's buckets (`buckets[rank]`, from `source_buckets`) with full tensors.

    Pieces this rank holds are copied, the others received point to point from one holder each
    (checked with checksums, each bucket within `deadline_s`). Collective over the trainer ranks,
    which must be the ranks of the default group: every one calls it, source or not. Returns one
    uint8 tensor per bucket, `into`'s when given. Pass the same `into` and `staging` to every sync:
    a call that repeats with the same buckets and tensors reuses the prepared rounds (views,
    message layout) of the first.
    """
    verify_mode(verify)
    mine = buckets[rank]
    device = _device_of(shards)
    if into is None:
        into = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in mine]
    if [t.numel() for t in into] != [b.nbytes for b in mine]:
        raise ValueError(f"into holds {len(into)} buffers that do not match this rank's {len(mine)} buckets")
    staging = staging or Staging()
    key = ("gather", rank, _identity(shards), tuple(t.data_ptr() for t in into))  # buckets: by identity
    cached = staging.program
    if cached is not None and cached[0] is buckets and cached[1] == key:
        rounds = cached[2]
    else:
        rounds = []
        for k in range(max(map(len, buckets), default=0)):
            copies, peers = _broadcast_sync.gather_program(
                spec, placement, buckets, k, rank, shards, into[k] if k < len(mine) else None,
                lambda side, r: r, lambda side, r: f"trainer rank {r}")
            rounds.append((f"broadcast gather {k} on trainer rank {rank}", copies,
                           [prepare(p, 1 << 20, staging, device) for p in peers]))
        staging.program = (buckets, key, rounds)
    for label, copies, peers in rounds:
        _broadcast_sync.run_gather(copies, peers, deadline_s, verify, label, device, staging)
    return into
