"""The pure resharding planner: trainer layout -> rollout layout transfers, in rounds.

`plan(src, dst, spec, memory_budget_bytes, topology)` returns a `Plan`: transfers (source rank,
destination rank, HF tensor, global `Box`, bytes) grouped in rounds such that
  * every rollout rank receives exactly the boxes it must hold, each element once;
  * every distinct box a rollout node needs crosses that node's NICs once: one GPU of the node
    (the least loaded holder) fetches it and relays it to the node's other holders over NVLink
    in a later round; a source on the same node (colocated layouts) is used over NVLink instead;
  * the sending is spread over every trainer replica of a box (DP, CP, EDP copies, the TP copies
    of replicated tensors): forced transfers (one possible sender) are placed first, then the
    rest largest-first, each to the currently least-loaded sender;
  * per round, each rank's staging memory -- bytes it receives, plus bytes it sends as a trainer
    rank (packed into send buffers; a relay sends from the copy it already holds) -- stays within
    `memory_budget_bytes`; pieces larger than budget/16 are cut along dim 0 (then dim 1, ...);
  * the result is deterministic (no hashing of ids, no unordered iteration).
Rounds are filled in lockstep: round r gives every destination, in an order rotated by r, as many
of its pending bundles (the transfers of one source->destination pair, cut to budget/8) as fit its
and the sender's budget, then the relays its node peers received in earlier rounds. NIC bytes per
rank and round are capped so that, when a node's bytes are mostly NVLink relays, NICs and NVLink
work in the same rounds. Plans carry columns (numpy), not objects, so a 1,024 -> 512-rank
DeepSeek-V3 plan (about a million transfers) stays cheap; `Plan.transfers()` yields `Transfer`
tuples on demand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moe.layouts import RolloutLayout, TensorPlacement, TrainerLayout
from moe.network import Topology
from moe.slices import Box
from moe.specs import MoESpec

MIN_BUDGET_BYTES = 64
BUNDLE_FRACTION = 8   # bundles are cut to budget // 8 bytes, pieces to budget // 16
SCAN_LIMIT = 32       # pending bundles a destination inspects per round before giving up the round
TOO_BIG_LIMIT = 4     # ... or this many that exceed its remaining budget (it is nearly full)
NIC_QUOTA_SLACK = 1.1  # per round, NIC bytes <= busiest NIC total / R * slack


class Transfer(NamedTuple):
    """One box of one tensor moved from a source rank to a rollout rank in a given round.

    `src_side` is "trainer" for a transfer from a trainer rank, "rollout" for an intra-node relay
    from a rollout rank that received the same box in an earlier round.
    """

    src_rank: int
    src_side: str
    dst_rank: int
    tensor: str
    box: Box
    nbytes: int
    round: int


@dataclass(frozen=True, eq=False)
class Plan:
    """Columns of all transfers, sorted by (round, source, destination). Index i is one transfer."""

    spec: MoESpec
    src: TrainerLayout
    dst: RolloutLayout
    topology: Topology
    memory_budget_bytes: int
    num_rounds: int
    src_rank: np.ndarray       # int32: trainer rank, or rollout rank where from_rollout
    from_rollout: np.ndarray   # bool: an intra-node relay from a rollout rank
    dst_rank: np.ndarray       # int32: rollout rank
    tensor: np.ndarray         # int32: index into spec.tensors
    box_table: tuple[Box, ...] = field(repr=False)
    box_index: np.ndarray = field(repr=False)    # int32: index into box_table
    nbytes: np.ndarray = field(repr=False)       # int64
    round: np.ndarray = field(repr=False)        # int32
    intra_node: np.ndarray = field(repr=False)   # bool: NVLink (same node) rather than NIC
    planning_s: float = 0.0       # wall-clock seconds plan() took
    planning_cpu_s: float = 0.0   # CPU seconds of this process (the wall time on an idle machine)

    def __len__(self) -> int:
        return len(self.nbytes)

    def transfers(self, round: int | None = None) -> Iterator[Transfer]:
        """All transfers (or those of one round) as `Transfer` tuples, in plan order."""
        idx = range(len(self)) if round is None else np.flatnonzero(self.round == round).tolist()
        names = [t.name for t in self.spec.tensors]
        src, rel, dst = self.src_rank.tolist(), self.from_rollout.tolist(), self.dst_rank.tolist()
        ten, nb, rd = self.tensor.tolist(), self.nbytes.tolist(), self.round.tolist()
        bi, table = self.box_index.tolist(), self.box_table
        for i in idx:
            yield Transfer(src[i], "rollout" if rel[i] else "trainer", dst[i], names[ten[i]], table[bi[i]],
                           nb[i], rd[i])

    def box(self, i: int) -> Box:
        """The global box of transfer i."""
        return self.box_table[int(self.box_index[i])]

    def staging_bytes(self) -> np.ndarray:
        """[num_rounds, trainer world + rollout world] staging bytes per rank per round.

        Staging = bytes received + bytes sent by a trainer rank (packed into send buffers); a relay
        sends from the copy it already holds. Columns: trainer ranks, then rollout ranks (rollout
        rank j is column trainer_world + j).
        """
        ns, n = self.src.world_size, self.src.world_size + self.dst.world_size
        gd = self.dst_rank.astype(np.int64) + ns
        r = self.round.astype(np.int64)
        w = self.nbytes.astype(np.float64)
        out = np.bincount(r * n + gd, weights=w, minlength=self.num_rounds * n)
        t = ~self.from_rollout
        out += np.bincount(r[t] * n + self.src_rank[t], weights=w[t], minlength=self.num_rounds * n)
        return out.reshape(self.num_rounds, n)

    def sent_bytes(self) -> np.ndarray:
        """Bytes each trainer rank sends (all rounds)."""
        m = ~self.from_rollout
        return np.bincount(self.src_rank[m], weights=self.nbytes[m], minlength=self.src.world_size)

    def received_bytes(self) -> np.ndarray:
        """Bytes each rollout rank receives, over NIC and NVLink (all rounds)."""
        return np.bincount(self.dst_rank, weights=self.nbytes, minlength=self.dst.world_size)


def _chunks(box: Box, itemsize: int, cap: int) -> list[Box]:
    """Cut `box` into row-major pieces of at most `cap` bytes (dim 0 first, then dim 1, ...)."""
    if box.numel * itemsize <= cap:
        return [box]
    inner = itemsize
    for s in box.shape[1:]:
        inner *= s
    rows = box.shape[0]
    if inner <= cap:
        step = cap // inner
        return [Box((box.offsets[0] + lo,) + box.offsets[1:], (min(step, rows - lo),) + box.shape[1:])
                for lo in range(0, rows, step)]
    out = []
    for lo in range(rows):  # a single row is still too big: cut each row along the next dim
        sub = Box(box.offsets[1:], box.shape[1:])
        out.extend(Box((box.offsets[0] + lo,) + c.offsets, (1,) + c.shape) for c in _chunks(sub, itemsize, cap))
    return out


class _Rows:
    """Transfer columns appended in blocks; `parent` is the row a relay copies (-1: trainer send).

    A block column is an array or a scalar repeated over the block; scalars stay Python values
    until `columns()` so that the many small blocks of a plan cost no numpy calls each.
    """

    COLS = ("src", "relay", "dst", "tensor", "box", "nbytes", "parent")

    def __init__(self) -> None:
        self.blocks: dict[str, list] = {c: [] for c in self.COLS}
        self.sizes: list[int] = []
        self.n = 0
        self.boxes: list[Box] = []
        self._box_id: dict[int, int] = {}

    def box_id(self, box: Box) -> int:
        i = self._box_id.get(id(box))
        if i is None:
            i = self._box_id[id(box)] = len(self.boxes)
            self.boxes.append(box)  # keeps the Box alive, so its id() stays unique
        return i

    def add(self, dst: np.ndarray | int, src: np.ndarray | int, relay: bool, tensor: int, box: int,
            nbytes: np.ndarray | int, parent: np.ndarray | int = -1, n: int = 1) -> int:
        """Append `n` rows (array columns must have length n); returns the index of the first one."""
        first = self.n
        for c, v in (("dst", dst), ("src", src), ("relay", relay), ("tensor", tensor), ("box", box),
                     ("nbytes", nbytes), ("parent", parent)):
            self.blocks[c].append(v)
        self.sizes.append(n)
        self.n += n
        return first

    def columns(self) -> dict[str, np.ndarray]:
        sizes = np.asarray(self.sizes, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        out = {}
        for c, blocks in self.blocks.items():
            is_arr = [isinstance(v, np.ndarray) for v in blocks]
            scalars = np.asarray([0 if a else v for v, a in zip(blocks, is_arr)], dtype=np.int64)
            col = np.repeat(scalars, sizes)
            for v, a, st, n in zip(blocks, is_arr, starts.tolist(), self.sizes):
                if a:
                    col[st:st + n] = v
            out[c] = col.astype(bool) if c == "relay" else col
        return out


def _spread(cands: np.ndarray, n: int, size: int, load: np.ndarray) -> np.ndarray:
    """Give `n` pieces of `size` bytes to candidates, each batch to the least-loaded ones (stable)."""
    if len(cands) == 1:
        load[cands[0]] += n * size
        return np.full(n, cands[0])
    out = np.empty(n, dtype=np.int64)
    pos = 0
    while pos < n:
        m = min(len(cands), n - pos)
        sel = cands[np.argsort(load[cands], kind="stable")[:m]]
        out[pos:pos + m] = sel
        load[sel] += size
        pos += m
    return out


class _DstGroups:
    """The rollout holders of one box, by node: nodes [M], holders [M, H] when every node has H."""

    def __init__(self, ranks: tuple[int, ...], dnode: np.ndarray) -> None:
        by: dict[int, list[int]] = {}
        for r in ranks:
            by.setdefault(int(dnode[r]), []).append(r)
        self.items = sorted(by.items())
        self.nodes = np.array([nd for nd, _ in self.items], dtype=np.int64)
        sizes = {len(h) for _, h in self.items}
        self.holders = np.array([h for _, h in self.items], dtype=np.int64) if len(sizes) == 1 else None


def _assign_pieces(spec: MoESpec, src_pl: list[TensorPlacement], dst_pl: list[TensorPlacement],
                   snode: np.ndarray, dnode: np.ndarray, colocated: bool, cap: int, rows: _Rows) -> None:
    """Choose, for every (tensor, destination box, destination node), who sends and who receives."""
    nic_out = np.zeros(len(snode))
    nvl_out = np.zeros(len(snode))
    nic_in = np.zeros(len(dnode))
    inter: dict[tuple[int, int], Box | None] = {}
    keep: list[object] = []  # `inter` is keyed by id(); keep its boxes alive
    # Tensors whose piece has the same holders, senders, box and itemsize are planned together.
    groups: dict[tuple[int, int, int, int], list] = {}
    for ti, t in enumerate(spec.tensors):
        for dbox, dranks in dst_pl[ti]:
            for sbox, sranks in src_pl[ti]:
                k = (id(sbox), id(dbox))
                if k not in inter:
                    inter[k] = sbox.intersect(dbox)
                    keep.extend((sbox, dbox))
                pbox = inter[k]
                if pbox is None:
                    continue
                key = (id(dranks), id(sranks), id(pbox), t.itemsize)
                g = groups.get(key)
                if g is None:
                    g = groups[key] = [dranks, sranks, pbox, t.itemsize, []]
                g[4].append(ti)

    dgroups: dict[int, _DstGroups] = {}
    flexible = []
    for order, (dranks, sranks, pbox, item, tids) in enumerate(groups.values()):
        dg = dgroups.get(id(dranks))
        if dg is None:
            dg = dgroups[id(dranks)] = _DstGroups(dranks, dnode)
        chunks = _chunks(pbox, item, cap)
        if len(sranks) == 1 and dg.holders is not None and dg.holders.shape[1] == 1:
            # forced: one sender, one holder per node -- emit all tensors of the group at once
            h = dg.holders[:, 0]
            T, C, M = len(tids), len(chunks), len(h)
            cb = np.array([c.numel * item for c in chunks], dtype=np.int64)
            cid = np.array([rows.box_id(c) for c in chunks], dtype=np.int64)
            rows.add(np.tile(h, T * C), sranks[0], False, np.repeat(np.asarray(tids), C * M),
                     np.tile(np.repeat(cid, M), T), np.tile(np.repeat(cb, M), T), n=T * C * M)
            nic_out[sranks[0]] += T * M * int(cb.sum())
            nic_in[h] += T * int(cb.sum())
        else:
            flexible.append((-pbox.numel * item, order, dg, sranks, chunks, item, tids))
    flexible.sort(key=lambda f: (f[0], f[1]))

    local_cache: dict[int, dict[int, list[int]]] = {}
    for _, _, dg, sranks, chunks, item, tids in flexible:
        sr = np.asarray(sranks, dtype=np.int64)
        local_by: dict[int, list[int]] = {}
        if colocated:
            local_by = local_cache.get(id(sranks)) or {}
            if id(sranks) not in local_cache:
                for r in sranks:
                    local_by.setdefault(int(snode[r]), []).append(r)
                local_cache[id(sranks)] = local_by
                keep.append(sranks)
            local_by = {nd: v for nd, v in local_by.items() if nd in set(dg.nodes.tolist())}
        for ti in tids:
            for c in chunks:
                b, cid = c.numel * item, rows.box_id(c)
                if dg.holders is not None and not local_by:
                    _emit_vectorized(rows, dg.holders, sr, ti, cid, b, nic_out, nic_in)
                else:
                    _emit_per_node(rows, dg, sr, local_by, ti, cid, b, nic_out, nvl_out, nic_in)


def _emit_vectorized(rows: _Rows, holders: np.ndarray, sr: np.ndarray, ti: int, cid: int, b: int,
                     nic_out: np.ndarray, nic_in: np.ndarray) -> None:
    """One box to every node: a least-loaded holder per node receives it, then relays it on-node."""
    M, H = holders.shape
    if H == 1:
        p = holders[:, 0]
    else:
        p = holders[np.arange(M), np.argmin(nic_in[holders], axis=1)]
    s = _spread(sr, M, b, nic_out)
    nic_in[p] += b
    first = rows.add(p, s, False, ti, cid, b, n=M)
    if H > 1:
        others = holders != p[:, None]
        rows.add(holders[others], np.repeat(p, H - 1), True, ti, cid, b, np.repeat(first + np.arange(M), H - 1),
                 n=M * (H - 1))


def _emit_per_node(rows: _Rows, dg: _DstGroups, sr: np.ndarray, local_by: dict[int, list[int]], ti: int,
                   cid: int, b: int, nic_out: np.ndarray, nvl_out: np.ndarray, nic_in: np.ndarray) -> None:
    """Irregular holder counts or on-node senders (colocated): the same rules, node by node."""
    for node, holders in dg.items:
        local = local_by.get(node)
        if local:  # a trainer rank on this node has it: every holder copies over NVLink directly
            loc = np.asarray(local, dtype=np.int64)
            s = _spread(loc, len(holders), b, nvl_out)
            rows.add(np.asarray(holders, dtype=np.int64), s, False, ti, cid, b, n=len(holders))
            continue
        h = np.asarray(holders, dtype=np.int64)
        p = int(h[np.argmin(nic_in[h])])
        s = int(_spread(sr, 1, b, nic_out)[0])
        nic_in[p] += b
        first = rows.add(p, s, False, ti, cid, b)
        others = h[h != p]
        if len(others):
            rows.add(others, p, True, ti, cid, b, first, n=len(others))


def _bundles(gsrc: np.ndarray, gdst: np.ndarray, extra: np.ndarray, nbytes: np.ndarray, half_cap: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group rows of one (destination, source, extra) key into bundles of at most 2*half_cap bytes.

    Returns (row order, bundle id of each row in that order, index within its key of each bundle).
    Rows are at most half_cap bytes, so cutting the running total at multiples of half_cap keeps
    every bundle under 2*half_cap.
    """
    order = np.lexsort((np.arange(len(gsrc)), extra, gsrc, gdst))
    gs, gd, ex, nb = gsrc[order], gdst[order], extra[order], nbytes[order]
    new_key = np.ones(len(order), dtype=bool)
    new_key[1:] = (gs[1:] != gs[:-1]) | (gd[1:] != gd[:-1]) | (ex[1:] != ex[:-1])
    key_id = np.cumsum(new_key) - 1
    cum = np.cumsum(nb) - nb
    key_start = cum[new_key][key_id]
    j = (cum - key_start) // half_cap
    new_bundle = new_key.copy()
    new_bundle[1:] |= j[1:] != j[:-1]
    bundle = np.cumsum(new_bundle) - 1
    return order, bundle, j[new_bundle]


def _assign_rounds(cols: dict[str, np.ndarray], intra: np.ndarray, n_src: int, n_dst: int, budget: int,
                   half_cap: int) -> np.ndarray:
    """Round of every row: lockstep filling (module docstring), relays in the round after their source's.

    Staging per rank and round = bytes it receives + bytes it sends as a trainer rank (packed into
    send buffers); a relay sends from the copy its sender already holds. Each destination takes, in
    every round, trainer bundles and then the relays that have become possible. NIC bytes per rank
    and round are capped at the busiest NIC's total over R (R = the rounds the budget forces), so
    when relays dominate a node's bytes the NICs are paced and NVLink relays overlap them instead
    of piling up at the end; when NIC bytes dominate, the cap exceeds the budget and does nothing.
    """
    n_all = n_src + n_dst
    relay, nbytes, parent = cols["relay"], cols["nbytes"], cols["parent"]
    n_rows = len(nbytes)
    gsrc = np.where(relay, cols["src"] + n_src, cols["src"])
    gdst = cols["dst"] + n_src
    rnd = np.full(n_rows, -1, dtype=np.int64)
    nb_l = nbytes.tolist()

    sends = np.flatnonzero(~relay)
    order, bundle, j = _bundles(gsrc[sends], gdst[sends], np.zeros(len(sends), np.int64), nbytes[sends], half_cap)
    rows_sorted = sends[order]
    first = np.flatnonzero(np.r_[True, bundle[1:] != bundle[:-1]])
    bsize = np.add.reduceat(nbytes[rows_sorted], first).tolist() if len(first) else []
    bsrc, bdst = gsrc[rows_sorted][first], gdst[rows_sorted][first]
    bnic = (~intra[rows_sorted][first]).tolist()
    bounds = np.r_[first, len(rows_sorted)].tolist()
    rows_l = rows_sorted.tolist()
    # relay children of every row, as CSR over parent rows
    relays = np.flatnonzero(relay)
    kids = relays[np.argsort(parent[relays], kind="stable")]
    kid_off = np.r_[0, np.cumsum(np.bincount(parent[relays], minlength=n_rows))].tolist()
    kids_l, gdst_l = kids.tolist(), gdst.tolist()
    bkids = (np.add.reduceat(np.diff(np.asarray(kid_off))[rows_sorted], first) > 0).tolist() if len(first) else []

    staging = np.bincount(gdst, weights=nbytes, minlength=n_all) + np.bincount(
        gsrc[sends], weights=nbytes[sends], minlength=n_all)
    min_rounds = max(1, int(np.ceil(staging.max() / budget))) if n_rows else 1
    nic_rows = ~intra & ~relay
    nic_io = np.bincount(gdst[nic_rows], weights=nbytes[nic_rows], minlength=n_all) + np.bincount(
        gsrc[nic_rows], weights=nbytes[nic_rows], minlength=n_all)  # NIC in (rollout) or out (trainer)
    # one NIC cap per round for every rank: the busiest NIC's bytes spread over the rounds the
    # budget forces anyway (no-op when NIC bytes dominate staging; paces the NICs when relays do)
    nic_cap = float(nic_io.max()) / min_rounds * NIC_QUOTA_SLACK if n_rows else 0.0

    # Per destination, interleave sources (every source's j-th bundle before any (j+1)-th), starting
    # at a source rotated per destination: a busy sender then blocks one queue slot, not a run.
    rot = (bsrc - (bdst - n_src) * 7919) % n_all
    qorder = np.lexsort((rot, j, bdst)).tolist()
    bsrc_l, bdst_l = bsrc.tolist(), bdst.tolist()
    queues: list[deque[int]] = [deque() for _ in range(n_dst)]
    rqueues: list[deque[list]] = [deque() for _ in range(n_dst)]  # [size, eligible round, rows, sender]
    for b in qorder:
        queues[bdst_l[b] - n_src].append(b)
    bround = [-1] * len(bsize)
    left = len(bsize)
    r = 0
    while left:
        used = [0] * n_all
        nic_used = [0] * n_all
        nvl_out = [0] * n_all
        active = [d for d in range(n_dst) if queues[d] or rqueues[d]]
        start = r % len(active)
        for d in active[start:] + active[:start]:
            gd = d + n_src
            room = budget - used[gd]
            q, kept, scanned, too_big = queues[d], [], 0, 0
            while q and scanned < SCAN_LIMIT and too_big < TOO_BIG_LIMIT:
                b = q.popleft()
                scanned += 1
                size, gs = bsize[b], bsrc_l[b]
                if size > room or (bnic[b] and nic_used[gd] and nic_used[gd] + size > nic_cap):
                    too_big += 1
                    kept.append(b)
                    continue
                if used[gs] + size > budget or (bnic[b] and nic_used[gs] and nic_used[gs] + size > nic_cap):
                    kept.append(b)
                    continue
                used[gs] += size
                room -= size
                if bnic[b]:
                    nic_used[gd] += size
                    nic_used[gs] += size
                bround[b] = r
                left -= 1
                if bkids[b]:
                    left += _queue_relays(b, bounds, rows_l, kid_off, kids_l, gdst_l, nb_l, n_src, r + 1,
                                          2 * half_cap, rqueues, gd)
            q.extendleft(reversed(kept))
            rq, kept, scanned = rqueues[d], [], 0
            while rq and rq[0][1] <= r and scanned < SCAN_LIMIT and room > 0:
                it = rq.popleft()
                scanned += 1
                size, gs = it[0], it[3]
                if size > room or nvl_out[gs] + size > budget:  # NVLink out per round: one budget
                    kept.append(it)
                    continue
                room -= size
                nvl_out[gs] += size
                left -= 1
                for c in it[2]:
                    rnd[c] = r
            rq.extendleft(reversed(kept))
            used[gd] = budget - room
        r += 1
    if len(bsize):
        rnd[rows_sorted] = np.asarray(bround, dtype=np.int64)[bundle]
    # drop empty rounds (keeps relative order, so relays stay after their sources)
    _, rnd = np.unique(rnd, return_inverse=True)
    return rnd


def _queue_relays(b: int, bounds: list[int], rows: list[int], kid_off: list[int], kids: list[int],
                  gdst: list[int], nbytes: list[int], n_src: int, eligible: int, cap: int,
                  rqueues: list[deque[list]], sender: int) -> int:
    """Queue the relays of bundle b's rows at their destinations, cut to `cap`; returns bundles added."""
    by_dst: dict[int, list[int]] = {}
    for i in rows[bounds[b]:bounds[b + 1]]:
        for c in kids[kid_off[i]:kid_off[i + 1]]:
            by_dst.setdefault(gdst[c], []).append(c)
    added = 0
    for gd, crow in by_dst.items():
        q = rqueues[gd - n_src]
        cur, size = [], 0
        for c in crow:
            if size and size + nbytes[c] > cap:
                q.append([size, eligible, cur, sender])
                added += 1
                cur, size = [], 0
            cur.append(c)
            size += nbytes[c]
        q.append([size, eligible, cur, sender])
        added += 1
    return added


def plan(src: TrainerLayout, dst: RolloutLayout, spec: MoESpec, memory_budget_bytes: int,
         topology: Topology | None = None) -> Plan:
    """Plan moving `spec`'s weights from trainer layout `src` to rollout layout `dst`.

    Pure: no processes, no tensors. `memory_budget_bytes` bounds, per rank and round, the staging
    bytes (received, plus sent by trainer ranks). Raises ValueError for layouts that do not fit the spec or a budget below
    MIN_BUDGET_BYTES.
    """
    if not isinstance(memory_budget_bytes, int) or memory_budget_bytes < MIN_BUDGET_BYTES:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be an int >= {MIN_BUDGET_BYTES}")
    topo = topology or Topology()
    t0, c0 = time.perf_counter(), time.process_time()
    src_pl, dst_pl = src.placement(spec), dst.placement(spec)
    n_src, n_dst = src.world_size, dst.world_size
    snode, dnode = topo.trainer_nodes(n_src), topo.rollout_nodes(n_src, n_dst)
    half_cap = max(memory_budget_bytes // (2 * BUNDLE_FRACTION), 4)
    rows = _Rows()
    _assign_pieces(spec, src_pl, dst_pl, snode, dnode, topo.colocated, half_cap, rows)
    cols = rows.columns()
    relay, src_r, dst_r = cols["relay"], cols["src"], cols["dst"]
    src_node = np.where(relay, dnode[np.where(relay, src_r, 0)], snode[np.where(relay, 0, src_r)])
    intra = src_node == dnode[dst_r]
    rnd = _assign_rounds(cols, intra, n_src, n_dst, memory_budget_bytes, half_cap)
    gsrc = np.where(relay, src_r + n_src, src_r)
    order = np.lexsort((np.arange(len(rnd)), dst_r, gsrc, rnd))
    return Plan(spec=spec, src=src, dst=dst, topology=topo, memory_budget_bytes=memory_budget_bytes,
                num_rounds=int(rnd.max()) + 1 if len(rnd) else 0, src_rank=src_r[order].astype(np.int32),
                from_rollout=relay[order], dst_rank=dst_r[order].astype(np.int32),
                tensor=cols["tensor"][order].astype(np.int32), box_table=tuple(rows.boxes),
                box_index=cols["box"][order].astype(np.int32), nbytes=cols["nbytes"][order],
                round=rnd[order].astype(np.int32), intra_node=intra[order],
                planning_s=time.perf_counter() - t0, planning_cpu_s=time.process_time() - c0)
