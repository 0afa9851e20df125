"""Parallel layouts as frozen value objects: which global box of which HF tensor each rank holds.

`TrainerLayout` is Megatron-core's layout (TP, PP, EP, ETP, DP, CP, optional uneven first/last
pipeline stages) with Megatron's rank order 'tp-cp-ep-dp-pp': dense parameters use the generator
(tp, cp, dp, pp) and expert parameters the generator (etp, ep, edp, pp), fastest axis first,
where edp = tp*cp*dp / (etp*ep) (megatron.core.parallel_state.RankGenerator, 0.16.1).
`RolloutLayout` is SGLang's: `num_engines` engines of `tp` GPUs; inside an engine the attention
TP group is attn_tp = tp / dp_attention contiguous ranks, and the MoE EP axis groups ranks with
stride moe_tp = tp / ep (moe_ep_rank = r // moe_tp, moe_tp_rank = r % moe_tp, as in
sglang.srt.distributed.parallel_state). The role -> placement table is in moe/README.md.

`layout.placement(spec)` is the form the planner uses: for every tensor (in spec order) the
partition of its global index space into `Box`es, each with the ranks holding a replica.
Validation raises ValueError naming the field, the bad value and the nearest valid values.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from moe.slices import Box
from moe.specs import ModelDims, MoESpec, Role
from moe.specs._types import config_dtype

# One tensor's placement: (box, ranks holding a replica of that box), boxes disjoint and covering.
TensorPlacement = list[tuple[Box, tuple[int, ...]]]

SGLANG_VOCAB_PADDING = 64


@lru_cache(maxsize=None)
def full_box(shape: tuple[int, ...]) -> Box:
    """The whole index space of `shape` (cached: equal shapes share one Box object)."""
    return Box.full(shape)


@lru_cache(maxsize=None)
def split_box(shape: tuple[int, ...], axis: int, parts: int, index: int) -> Box:
    """The `index`-th of `parts` equal pieces of the full box of `shape` along `axis`."""
    return Box.full(shape).split(axis, parts, index)


@lru_cache(maxsize=None)
def padded_rows_box(shape: tuple[int, ...], parts: int, index: int, multiple: int) -> Box | None:
    """Vocab-parallel rows: pad dim 0 to a multiple of `multiple`, split evenly, drop padding rows.

    Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * tp; SGLang pads to
    64 before dividing by tp. Padding rows are not part of the HF tensor, so the last parts may be
    shorter or empty (None).
    """
    rows = shape[0]
    padded = -(-rows // multiple) * multiple
    per = -(-padded // parts)
    lo, hi = index * per, min((index + 1) * per, rows)
    if hi <= lo:
        return None
    return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])


def sglang_vocab_multiple(rows: int, tp: int) -> int:
    """What SGLang 0.5.23 pads a vocab-parallel tensor's rows to (VocabParallelEmbedding): 64, or
    64 * tp when the rows padded to 64 do not split evenly over tp (tp 6 or 12 with Qwen3's 151936)."""
    padded = -(-rows // SGLANG_VOCAB_PADDING) * SGLANG_VOCAB_PADDING
    return SGLANG_VOCAB_PADDING * (tp if padded % tp else 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(valid: list[int], value: int, k: int = 3) -> list[int]:
    """Up to `k` valid values closest to `value` (ties: the smaller first), in ascending order."""
    return sorted(sorted(valid, key=lambda v: (abs(v - value), v))[:k])


def expert_split_problem(dense: int, ep: int, etp: int, num_experts: int = 0) -> str | None:
    """Why tp*cp*dp=`dense` ranks cannot hold `num_experts` experts in expert groups of etp*ep (None if
    they can; 0 experts: the model is unknown). The ep values it suggests meet both conditions."""
    ok = [e for e in _divisors(dense // etp) if not num_experts or num_experts % e == 0] if dense % etp == 0 else []
    if num_experts and num_experts % ep:
        return (f"TrainerLayout.ep={ep} does not divide num_experts={num_experts}; "
                f"nearest valid ep: {_nearest(ok or _divisors(num_experts), ep)}")
    if dense % (etp * ep) == 0:
        return None
    return (f"TrainerLayout.ep={ep} with etp={etp} does not divide tp*cp*dp={dense} "
            f"(Megatron needs tp*cp*dp % (etp*ep) == 0); nearest valid ep: {_nearest(ok, ep) or 'none'}"
            + ("" if dense % etp == 0 else f"; etp={etp} must divide {dense}"))


def _positive(obj: object, *names: str) -> None:
    """Check positive integer fields; numpy integers are normalised to int (frozen: via object.__setattr__)."""
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{n}={v!r} must be a positive int")
        object.__setattr__(obj, n, int(v))


def _check_world(layout_name: str, world: int, expected: int | None, hint: str) -> None:
    if expected is not None and world != expected:
        raise ValueError(f"{layout_name} world size {world} != the {expected} GPUs given; {hint}")


@dataclass(frozen=True, slots=True)
class TrainerLayout:
    """Megatron-core layout. world = tp*cp*dp*pp; experts use etp*ep*edp*pp over the same ranks.

    `first_stage_layers` / `last_stage_layers` mirror Megatron's num_layers_in_{first,last}_
    pipeline_stage: the remaining decoder layers split evenly over the other stages. DeepSeek MTP
    layers live on the last stage. `vocab_divisible_by` is Megatron's make_vocab_size_divisible_by.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    cp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        _positive(self, "tp", "pp", "ep", "etp", "dp", "cp", "vocab_divisible_by")
        for n in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0):
                raise ValueError(f"TrainerLayout.{n}={v!r} must be None or a non-negative int")
            if v is not None:
                object.__setattr__(self, n, int(v))
            if v is not None and self.pp == 1:
                raise ValueError(f"TrainerLayout.{n}={v} needs pp > 1 (pp=1 has a single stage)")
        problem = expert_split_problem(self.tp * self.cp * self.dp, self.ep, self.etp)
        if problem:
            raise ValueError(problem)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    def rank(self, tp: int, cp: int, dp: int, pp: int) -> int:
        """Global rank of dense coordinates (order tp-cp-dp-pp, tp fastest)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def expert_rank(self, etp: int, ep: int, edp: int, pp: int) -> int:
        """Global rank of expert coordinates (order etp-ep-edp-pp, etp fastest)."""
        return etp + self.etp * (ep + self.ep * (edp + self.expert_dp * pp))

    def coords(self, rank: int) -> dict[str, int]:
        """Dense and expert coordinates of `rank`: tp, cp, dp, pp, etp, ep, edp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} out of range for world size {self.world_size}")
        tp, r = rank % self.tp, rank // self.tp
        cp, r = r % self.cp, r // self.cp
        dp, pp = r % self.dp, r // self.dp
        etp, r = rank % self.etp, rank // self.etp
        ep, edp = r % self.ep, (r // self.ep) % self.expert_dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "etp": etp, "ep": ep, "edp": edp}

    def stage_layers(self, num_layers: int) -> list[range]:
        """Decoder layers of each pipeline stage; ValueError with valid choices if they do not split."""
        first, last, pp = self.first_stage_layers, self.last_stage_layers, self.pp
        fixed = [x for x in (first, last) if x is not None]
        middle = pp - len(fixed)
        rest = num_layers - sum(fixed)
        if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
            valid_pp = [d for d in _divisors(num_layers) if d <= num_layers]
            raise ValueError(
                f"TrainerLayout: {num_layers} decoder layers do not split over pp={pp} stages with "
                f"first_stage_layers={first}, last_stage_layers={last}; nearest valid pp with even "
                f"stages: {_nearest(valid_pp, pp)}, or first/last_stage_layers that leave an equal "
                f"count for each middle stage (e.g. {self._suggest_uneven(num_layers)})")
        per = rest // middle if middle else 0
        sizes = [per] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        out, start = [], 0
        for s in sizes:
            out.append(range(start, start + s))
            start += s
        return out

    def _suggest_uneven(self, num_layers: int) -> str:
        pp = self.pp
        if pp == 2:
            return f"first_stage_layers={num_layers // 2}, last_stage_layers={num_layers - num_layers // 2}"
        for total_edge in range(0, 2 * num_layers):
            for first in range(0, total_edge + 1):
                last = total_edge - first
                rest = num_layers - total_edge
                if pp > 2 and rest >= 0 and rest % (pp - 2) == 0 and abs(first - last) <= 1:
                    return f"first_stage_layers={first}, last_stage_layers={last}"
        return "a different pp"

    def stage_of_layers(self, spec: MoESpec) -> list[int]:
        """Pipeline stage of every decoder layer index (MTP layers on the last stage)."""
        stages = [0] * (spec.dims.num_layers + spec.dims.num_mtp_layers)
        for s, r in enumerate(self.stage_layers(spec.dims.num_layers)):
            for i in r:
                stages[i] = s
        for i in range(spec.dims.num_layers, len(stages)):
            stages[i] = self.pp - 1
        return stages

    def validate(self, spec: MoESpec, world_size: int | None = None, gpu_memory_bytes: int | None = None,
                 distributed_optimizer: bool = True) -> None:
        """Raise ValueError if `spec` cannot be laid out this way (divisibility, world, memory: what
        moe.trainer_memory counts for params of the checkpoint's dtype, as `hpcrl plan` does)."""
        d = self.dims_check(spec)
        _check_world("TrainerLayout", self.world_size, world_size,
                     f"with tp={self.tp} cp={self.cp} pp={self.pp} use dp={world_size // (self.tp * self.cp * self.pp)}"
                     if world_size and world_size % (self.tp * self.cp * self.pp) == 0 else
                     f"tp*cp*pp={self.tp * self.cp * self.pp} must divide it")
        self.stage_layers(d.num_layers)
        if gpu_memory_bytes is not None:
            from moe.trainer_memory import TrainerBuild, memory_hint, trainer_memory  # it imports this module

            build = TrainerBuild(param_dtype=config_dtype(spec.config), distributed_optimizer=distributed_optimizer)
            mem = trainer_memory(spec, self, build)
            need = int(mem["total_bytes"].max())
            if need > gpu_memory_bytes:
                raise ValueError(
                    f"TrainerLayout needs {need / 2**30:.1f} GiB per GPU (params "
                    f"{mem['params_bytes'].max() / 2**30:.1f} + grads {mem['grads_bytes'].max() / 2**30:.1f} + "
                    f"optimizer {mem['optimizer_bytes'].max() / 2**30:.1f}) > gpu memory "
                    f"{gpu_memory_bytes / 2**30:.1f} GiB; increase pp, ep or tp "
                    f"({memory_hint(spec, self, build, gpu_memory_bytes)})")

    def dims_check(self, spec: MoESpec) -> ModelDims:
        """The spec's dims, after checking they divide by this layout's axes (ValueError if not)."""
        d = spec.dims
        if d.num_experts and d.num_experts % self.ep:
            raise ValueError(f"TrainerLayout.ep={self.ep} does not divide num_experts={d.num_experts}; "
                             f"nearest valid ep: {_nearest(_divisors(d.num_experts), self.ep)}")
        heads_ok = _divisors(np.gcd(d.num_heads, d.num_kv_heads).item())
        if d.num_heads % self.tp or d.num_kv_heads % self.tp:
            raise ValueError(f"TrainerLayout.tp={self.tp} must divide num_heads={d.num_heads} and "
                             f"num_kv_heads={d.num_kv_heads}; nearest valid tp: {_nearest(heads_ok, self.tp)}")
        for size, what, axis, n in ((d.intermediate_size, "intermediate_size", "tp", self.tp),
                                    (d.shared_intermediate_size, "shared expert size", "tp", self.tp),
                                    (d.moe_intermediate_size, "moe_intermediate_size", "etp", self.etp)):
            if size and size % n:
                raise ValueError(f"TrainerLayout.{axis}={n} does not divide {what}={size}; "
                                 f"nearest valid {axis}: {_nearest(_divisors(size), n)}")
        return d

    def placement(self, spec: MoESpec) -> list[TensorPlacement]:
        """For every tensor of `spec` (spec order): its boxes and the trainer ranks holding each.

        Cached per (layout, spec); the returned lists are shared and must not be modified.
        """
        return _cached_placement(self, spec)

    def _placement(self, spec: MoESpec) -> list[TensorPlacement]:
        self.dims_check(spec)
        stage_of = self.stage_of_layers(spec)
        S = self.stage_size
        stage_ranks = [tuple(range(p * S, (p + 1) * S)) for p in range(self.pp)]
        dense_ranks = [[tuple(sorted(self.rank(t, c, d, p) for c in range(self.cp) for d in range(self.dp)))
                        for t in range(self.tp)] for p in range(self.pp)]
        expert_ranks = [[[tuple(self.expert_rank(t, e, d, p) for d in range(self.expert_dp))
                          for t in range(self.etp)] for e in range(self.ep)] for p in range(self.pp)]
        per_ep = (spec.dims.num_experts // self.ep) if spec.dims.num_experts else 1
        last = self.pp - 1
        vocab_multiple = self.vocab_divisible_by * self.tp
        out: list[TensorPlacement] = []
        for t in spec.tensors:
            role, shape = t.role, t.shape
            p = last if t.layer is None else stage_of[t.layer]
            if role is Role.EMBED or role is Role.LM_HEAD:
                stages = [0] if role is Role.EMBED else [last]
                if role is Role.EMBED and spec.dims.tie_word_embeddings and last != 0:
                    stages.append(last)  # Megatron keeps the tied output-layer copy on the last stage
                pl = []
                for r in range(self.tp):
                    box = padded_rows_box(shape, self.tp, r, vocab_multiple)
                    if box is not None:
                        pl.append((box, tuple(sorted(x for s in stages for x in dense_ranks[s][r]))))
                out.append(pl)
            elif role is Role.REPLICATED or role is Role.ROUTER:
                out.append([(full_box(shape), stage_ranks[p])])
            elif role in (Role.EXPERT_COL, Role.EXPERT_ROW):
                axis = 0 if role is Role.EXPERT_COL else 1
                e = t.expert // per_ep
                out.append([(split_box(shape, axis, self.etp, r), expert_ranks[p][e][r]) for r in range(self.etp)])
            else:
                axis = 1 if role in (Role.ATTN_ROW, Role.MLP_ROW, Role.SHARED_ROW) else 0
                out.append([(split_box(shape, axis, self.tp, r), dense_ranks[p][r]) for r in range(self.tp)])
        return out

    def shards(self, spec: MoESpec, rank: int) -> list[tuple[str, Box]]:
        """(HF tensor name, global box) of every tensor piece `rank` holds, in spec order."""
        return _shards_of(spec, self.placement(spec), rank)


@dataclass(frozen=True, slots=True)
class RolloutLayout:
    """SGLang layout: `num_engines` engines of `tp` GPUs each, with `ep` and `dp_attention` inside.

    Per engine: attention (and dense FFN / shared experts) is TP over attn_tp = tp // dp_attention
    contiguous ranks; routed experts are split over the EP axis (tp // ep ranks apart) and TP over
    moe_tp = tp // ep; the input embedding is vocab-parallel over tp without DP attention and
    replicated with it; lm_head is vocab-parallel over tp; norms and routers are replicated.
    """

    num_engines: int = 1
    tp: int = 1
    ep: int = 1
    dp_attention: int = 1

    def __post_init__(self) -> None:
        _positive(self, "num_engines", "tp", "ep", "dp_attention")
        if self.tp % self.ep:
            raise ValueError(f"RolloutLayout.ep={self.ep} must divide tp={self.tp} (SGLang's EP axis lives "
                             f"inside the TP group); nearest valid ep: {_nearest(_divisors(self.tp), self.ep)}")
        if self.tp % self.dp_attention:
            raise ValueError(f"RolloutLayout.dp_attention={self.dp_attention} must divide tp={self.tp}; "
                             f"nearest valid: {_nearest(_divisors(self.tp), self.dp_attention)}")

    @property
    def world_size(self) -> int:
        return self.num_engines * self.tp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp_attention

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """Engine and in-engine coordinates of `rank`: engine, tp, attn_tp, attn_dp, moe_ep, moe_tp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} out of range for world size {self.world_size}")
        r = rank % self.tp
        return {"engine": rank // self.tp, "tp": r, "attn_tp": r % self.attn_tp, "attn_dp": r // self.attn_tp,
                "moe_ep": r // self.moe_tp, "moe_tp": r % self.moe_tp}

    def dims_check(self, spec: MoESpec) -> ModelDims:
        """The spec's dims, after checking they divide by this layout's axes (ValueError if not)."""
        d, a = spec.dims, self.attn_tp
        if d.num_experts and d.num_experts % self.ep:
            raise ValueError(f"RolloutLayout.ep={self.ep} does not divide num_experts={d.num_experts}; "
                             f"nearest valid ep: {_nearest(_divisors(d.num_experts), self.ep)}")
        if d.num_heads % a:
            raise ValueError(f"RolloutLayout attention TP tp/dp_attention={a} does not divide num_heads={d.num_heads}; "
                             f"nearest valid tp/dp_attention: {_nearest(_divisors(d.num_heads), a)}")
        nkv = d.num_kv_heads
        if nkv % a and a % nkv:
            raise ValueError(f"RolloutLayout attention TP {a} and num_kv_heads={d.num_kv_heads}: one must divide "
                             f"the other; nearest valid tp/dp_attention: "
                             f"{_nearest([x for x in _divisors(d.num_heads) if not (x % nkv and nkv % x)], a)}")
        for size, what, n, label in ((d.intermediate_size, "intermediate_size", a, "tp/dp_attention"),
                                     (d.shared_intermediate_size, "shared expert size", a, "tp/dp_attention"),
                                     (d.moe_intermediate_size, "moe_intermediate_size", self.moe_tp, "tp/ep")):
            if size and size % n:
                raise ValueError(f"RolloutLayout {label}={n} does not divide {what}={size}; "
                                 f"nearest valid {label}: {_nearest(_divisors(size), n)}")
        return d

    def validate(self, spec: MoESpec, world_size: int | None = None, gpu_memory_bytes: int | None = None) -> None:
        """Raise ValueError if `spec` cannot be served this way (divisibility, world, weight memory)."""
        self.dims_check(spec)
        _check_world("RolloutLayout", self.world_size, world_size,
                     f"use num_engines={world_size // self.tp}" if world_size and world_size % self.tp == 0
                     else f"tp={self.tp} must divide it")
        if gpu_memory_bytes is not None:
            need = int(bytes_per_rank(spec, self.placement(spec), self.world_size).max())
            if need > gpu_memory_bytes:
                hints = [f"tp={t} ep={t}" for t in (2 * self.tp, 4 * self.tp)
                         if spec.dims.num_experts % t == 0 and spec.dims.num_heads % (t // self.dp_attention) == 0]
                raise ValueError(f"RolloutLayout weights need {need / 2**30:.1f} GiB per GPU > gpu memory "
                                 f"{gpu_memory_bytes / 2**30:.1f} GiB; increase tp and ep"
                                 + (f" (e.g. {' or '.join(hints)})" if hints else ""))

    def placement(self, spec: MoESpec) -> list[TensorPlacement]:
        """For every tensor of `spec` (spec order): its boxes and the rollout ranks holding each.

        Cached per (layout, spec); the returned lists are shared and must not be modified.
        """
        return _cached_placement(self, spec)

    def _placement(self, spec: MoESpec) -> list[TensorPlacement]:
        self.dims_check(spec)
        tp, a, mtp, E = self.tp, self.attn_tp, self.moe_tp, self.num_engines

        def glob(local: list[int]) -> tuple[int, ...]:
            return tuple(k * tp + r for k in range(E) for r in local)

        all_ranks = glob(list(range(tp)))
        by_tp = [glob([r]) for r in range(tp)]
        by_attn = [glob([r for r in range(tp) if r % a == i]) for i in range(a)]
        by_expert = [[glob([e * mtp + i]) for i in range(mtp)] for e in range(self.ep)]
        nkv = spec.dims.num_kv_heads
        kv_parts = min(a, nkv)
        # attention TP rank i holds KV head group i * kv_parts // a (KV heads replicate when nkv < attn_tp)
        by_kv = [glob([r for r in range(tp) if (r % a) * kv_parts // a == g]) for g in range(kv_parts)]
        per_ep = (spec.dims.num_experts // self.ep) if spec.dims.num_experts else 1
        out: list[TensorPlacement] = []
        for t in spec.tensors:
            role, shape = t.role, t.shape
            if role is Role.LM_HEAD or (role is Role.EMBED and self.dp_attention == 1):
                pl = []
                for r in range(tp):
                    box = padded_rows_box(shape, tp, r, sglang_vocab_multiple(shape[0], tp))
                    if box is not None:
                        pl.append((box, by_tp[r]))
                out.append(pl)
            elif role in (Role.EMBED, Role.REPLICATED, Role.ROUTER):
                out.append([(full_box(shape), all_ranks)])
            elif role in (Role.EXPERT_COL, Role.EXPERT_ROW):
                axis = 0 if role is Role.EXPERT_COL else 1
                e = t.expert // per_ep
                out.append([(split_box(shape, axis, mtp, i), by_expert[e][i]) for i in range(mtp)])
            elif role is Role.ATTN_KV:
                out.append([(split_box(shape, 0, kv_parts, g), by_kv[g]) for g in range(kv_parts)])
            else:
                axis = 1 if role in (Role.ATTN_ROW, Role.MLP_ROW, Role.SHARED_ROW) else 0
                out.append([(split_box(shape, axis, a, i), by_attn[i]) for i in range(a)])
        return out

    def shards(self, spec: MoESpec, rank: int) -> list[tuple[str, Box]]:
        """(HF tensor name, global box) of every tensor piece `rank` holds, in spec order."""
        return _shards_of(spec, self.placement(spec), rank)


@lru_cache(maxsize=16)
def _cached_placement(layout: TrainerLayout | RolloutLayout, spec: MoESpec) -> list[TensorPlacement]:
    return layout._placement(spec)


def _shards_of(spec: MoESpec, placement: list[TensorPlacement], rank: int) -> list[tuple[str, Box]]:
    return [(spec.tensors[i].name, box) for i, pl in enumerate(placement) for box, ranks in pl if rank in ranks]


def bytes_per_rank(spec: MoESpec, placement: list[TensorPlacement], world_size: int,
                   bytes_per_param: float | None = None) -> np.ndarray:
    """Bytes each rank holds (at the spec dtypes, or `bytes_per_param` for every element)."""
    acc: dict[tuple[int, ...], float] = {}
    for t, pl in zip(spec.tensors, placement):
        item = t.itemsize if bytes_per_param is None else bytes_per_param
        for box, ranks in pl:
            acc[ranks] = acc.get(ranks, 0.0) + box.numel * item
    out = np.zeros(world_size, dtype=np.float64)
    for ranks, b in acc.items():
        out[list(ranks)] += b
    return out
