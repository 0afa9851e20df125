"""Trainer-side checkpoint save and load through the HDF5 store (checkpoints/).

Every tensor is stored under its HF checkpoint name with the global box this rank holds
(`moe.hf_megatron.local_params` gives the Megatron-shard -> HF-box pieces), so a checkpoint saved
under one layout (TP/EP/PP/ETP/DP, any world size) loads under another: each rank reads only the
boxes it needs. Stored per tensor: `policy/<hf>`, `adam/exp_avg/<hf>`, `adam/exp_avg_sq/<hf>` and,
with a reference model, `ref/<hf>`; with PPO's critic (hpcrl/trainer/critic.py), its body as
`critic/<hf>` and `critic_adam/<moment>/<hf>` (no `lm_head`) and its value head as
`critic/value_head.{weight,bias}`, resharded on load the same way. Per rank: the RNG states (torch CPU/CUDA, Python, numpy) as a
blob; they are restored only when the world size is unchanged (else re-seeded deterministically).

bf16 parameters (model.dtype bfloat16) are stored as they are under `policy/` (what export and
the hash read), their fp32 main parameters under `main/<hf>` (`critic_main/<hf>`) and the Adam
moments, which Megatron's distributed optimizer keeps as flat shards spread over the DP group,
at fp32 under the same names as above: each parameter's shards are joined over its DP group, one
quantity at a time (an integer all-reduce of the owner's bits and zeros: exact), and each rank of
the group writes its own share of every box's rows, copied off the GPU at once. So a save adds at
most one parameter's fp32 copy to a GPU and 12 bytes / DP per parameter to the host, where joining
everything and writing it from every DP rank held 12 bytes per parameter on each GPU until the
commit. On load each rank cuts its own flat range from the boxes it reads. A bf16 run resumes a
float32 checkpoint (its parameters become the main parameters) and the other way round.
"""

from __future__ import annotations

import io
import math
import pickle
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from checkpoints import CheckpointWriter, open_checkpoint
from hpcrl.trainer.model import weight_tensors
from moe.hf_megatron import local_params

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Main:
    """The distributed optimizer's part of one model parameter on this rank: its fp32 main shard
    (None when this rank owns none of it), the flat range of the parameter that shard covers, the
    shard's Adam state dict, and the DP group the parameter's shards are spread over."""

    shard: torch.Tensor | None
    flat: slice
    state: dict
    group: Any


def _main_params(ddp: Any, optimizer: Any) -> dict[torch.nn.Parameter, _Main]:
    """param -> its `_Main`, for every trainable parameter of `ddp` when `optimizer` is Megatron's
    distributed optimizer (bf16 parameters); {} otherwise."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if optimizer is None or not any(hasattr(opt, "shard_fp32_from_float16_groups") for opt in inner):
        return {}
    out: dict[torch.nn.Parameter, _Main] = {}
    for opt in inner:
        pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                 *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
        for model_group, shard_group in pairs:
            for param, shard in zip(model_group, shard_group):
                r = opt._get_model_param_range_map(param)["param"]
                out[param] = _Main(shard, slice(r.start, r.end), opt.optimizer.state[shard], None)
    for param in ddp.module.parameters():
        if param.requires_grad:
            # DDP's rule (distributed_data_parallel.py broadcast_params): experts over the expert DP group
            group = ddp.dp_cp_group if getattr(param, "allreduce", True) else ddp.expt_dp_group
            out.setdefault(param, _Main(None, slice(0, 0), {}, None)).group = group
    return out


def _join_main(param: torch.nn.Parameter, main: _Main, key: str) -> torch.Tensor:
    """The full fp32 `key` ("main", the main parameter, or an Adam moment) of `param` on every rank
    of its DP group, shaped like `param`. Collective over main.group; exact: each element's owner
    contributes its bits and every other rank zeros, summed as int32 (a float sum of x and 0 is x
    too, but NCCL's in-switch reductions need not keep subnormals, such as small exp_avg_sq)."""
    buf = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if main.shard is not None:
        buf[main.flat] = main.shard.detach() if key == "main" else main.state[key]
    if main.group.size() > 1:
        dist.all_reduce(buf.view(torch.int32), group=main.group)
    return buf.view(param.shape)


def _my_rows(box: Any, group: Any) -> tuple[slice, Any] | None:
    """This rank's share of a box every rank of `group` holds alike: rows split as evenly as they go
    (rank r of G: rows n r / G to n (r + 1) / G), as (the rows within the box, their global box);
    None when the share is empty."""
    from moe.slices import Box

    size, rank = group.size(), dist.get_rank(group=group)
    rows = box.shape[0]
    start, end = rows * rank // size, rows * (rank + 1) // size
    if end == start:
        return None
    return slice(start, end), Box((box.offsets[0] + start, *box.offsets[1:]), (end - start, *box.shape[1:]))


def _adam_states(optimizer: Any) -> dict[torch.nn.Parameter, dict]:
    """param -> the torch AdamW state dict of the sub-optimizer that owns it (Megatron chains one
    optimizer per param kind). The dicts are the optimizers' own, created empty if missing, so
    filling them restores the state."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states: dict = {}
    for opt in inner:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                states[p] = opt.optimizer.state[p]  # state is a defaultdict(dict)
    return states


def _rng_blob() -> bytes:
    """This rank's RNG states; on a GPU its own device's generator only (a rank sees every GPU of its
    node, and the node it resumes on may have fewer, or give it another index)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    buf = io.BytesIO()
    pickle.dump(state, buf)
    return buf.getvalue()


def _set_rng(blob: bytes) -> None:
    state = pickle.loads(blob)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state["cuda"]
    if isinstance(cuda, list):  # saved before the current device's state alone: every visible GPU's
        cuda = cuda[torch.cuda.current_device()] if torch.cuda.is_available() and \
            torch.cuda.current_device() < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


@dataclass
class _Model:
    """One model's part of a checkpoint: its tensors under `prefix/<name>`, its Adam moments (if it
    trains) under `adam_prefix/<moment>/<name>` at the step recorded as metadata[`step_key`]."""

    prefix: str
    pieces: list[tuple[str, torch.nn.Parameter, Any, Any, tuple[int, ...]]]  # name, param, index, box, shape
    optimizer: Any = None
    adam_prefix: str = ""
    step_key: str = ""
    ddp: Any = None
    main_prefix: str = ""
    groups: dict = field(default_factory=dict)  # param -> the DP group it is replicated over


def _replicas(ddp: Any, pieces: list) -> dict[torch.nn.Parameter, Any]:
    """The data-parallel group each piece's parameter is replicated over, by DDP's rule
    (distributed_data_parallel.py broadcast_params: experts over the expert DP group); `ddp` is the
    policy's for its reference model, whose parameters mirror it (and carry the same attributes)."""
    return {param: ddp.dp_cp_group if getattr(param, "allreduce", True) else ddp.expt_dp_group
            for _, param, *_ in pieces}


def _models(policy: Any) -> list[_Model]:
    """The policy, its frozen reference (if any) and PPO's critic (if any), each as the pieces this
    rank holds: HF-named boxes of the Megatron shards (`local_params`); the critic has no `lm_head`
    and, on the last stage, its value head whole (replicated)."""
    from moe.slices import Box

    shapes = policy.dims.hf_shapes()
    local = local_params(policy.dims, policy.coords)

    def pieces(gpt: torch.nn.Module, names: set[str]) -> list:
        params = weight_tensors(gpt)
        return [(pc.hf_name, params[lp.name], pc.local_box.index, pc.hf_box, shapes[pc.hf_name])
                for lp in local if lp.name in names for pc in lp.pieces]

    everything = {lp.name for lp in local}
    own = pieces(policy.gpt, everything)
    models = [_Model("policy", own, policy.optimizer, "adam", "adam_step", policy.ddp, "main",
                     _replicas(policy.ddp, own))]
    if policy.ref is not None:
        ref = pieces(policy.ref, everything)
        models.append(_Model("ref", ref, groups=_replicas(policy.ddp, ref)))
    critic = policy.critic
    if critic is not None:
        from hpcrl.trainer.critic import HEAD_NAMES

        # the value head replaces lm_head (and an untied critic has no tied copy of the embedding)
        own = {n for n, _ in critic.gpt.named_parameters() if not n.startswith("output_layer.")}
        body = pieces(critic.gpt, everything & own)
        head = critic.head()
        if head is not None:
            for name, param in zip(HEAD_NAMES, (head.weight, head.bias)):
                full = Box.full(tuple(param.shape))
                body.append((name, param, full.index, full, tuple(param.shape)))
        models.append(_Model("critic", body, critic.optimizer, "critic_adam", "critic_adam_step",
                             critic.ddp, "critic_main", _replicas(critic.ddp, body)))
    return models


def save(policy: Any, ckpt_dir: str, step: int, attempt_id: str, keep: int,
         metadata: dict | None, blobs: dict[str, bytes] | None = None) -> float:
    """Collective over the trainer ranks: write this rank's slices and commit (rank 0 writes the
    manifest with `metadata`, and the controller's `blobs`, e.g. the rollouts sampled ahead:
    hpcrl/controller/pipeline.py). Returns the bytes this rank wrote."""
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = CheckpointWriter(ckpt_dir, step, rank=rank, world_size=world, attempt_id=attempt_id,
                              keep_last=keep)
    adam_steps: dict[str, float] = {}
    nbytes = 0
    for m in _models(policy):
        states = _adam_states(m.optimizer) if m.optimizer is not None else {}
        mains = _main_params(m.ddp, m.optimizer)
        with_adam = _adam_started(mains, policy.device)
        steps = set()
        for param, pieces in _by_param(m.pieces):
            sources = {m.prefix: param.detach()}
            if param in mains:  # bf16: fp32 main parameter and moments, joined over the DP group
                main = mains[param]
                if "step" in main.state:
                    steps.add(float(main.state["step"]))
                joined = {m.main_prefix: "main", **({f"{m.adam_prefix}/{k}": k for k in ADAM_KEYS}
                                                    if with_adam else {})}
                for prefix, key in joined.items():
                    full = _join_main(param, main, key)
                    for name, index, box, shape in pieces:
                        mine = _my_rows(box, main.group)
                        if mine is not None:
                            part = full[index][mine[0]]
                            part = (part.cpu() if part.is_cuda else part.clone()).contiguous()
                            writer.write(f"{prefix}/{name}", part, box=mine[1], global_shape=shape)
                            nbytes += part.numel() * part.element_size()
                    del full
            st = states.get(param)
            if st and "exp_avg" in st:
                steps.add(float(st["step"]))
                sources.update({f"{m.adam_prefix}/{k}": st[k] for k in ADAM_KEYS})
            for name, index, box, shape in pieces:  # DP replicas: each writes its share of the rows
                mine = _my_rows(box, m.groups[param])
                for prefix, tensor in sources.items() if mine is not None else ():
                    part = tensor[index][mine[0]].contiguous()
                    writer.write(f"{prefix}/{name}", part, box=mine[1], global_shape=shape)
                    nbytes += part.numel() * part.element_size()
        assert len(steps) <= 1, f"{m.prefix} params at different Adam steps: {steps}"
        if m.step_key:
            adam_steps[m.step_key] = _max_over_ranks(steps.pop() if steps else 0.0, policy.device)
    writer.write_blob("rng", _rng_blob())
    for name, data in (blobs or {}).items():
        writer.write_blob(name, data)
    writer.commit({**(metadata or {}), **adam_steps} if rank == 0 else None)
    writer.wait(for_commit=True)
    return float(nbytes)


def load(policy: Any, ckpt_dir: str, step: int) -> dict:
    """Collective: fill this rank's params, Adam moments and RNG from the checkpoint at `step`,
    reading only the boxes this rank holds. Returns the checkpoint's metadata."""
    with open_checkpoint(ckpt_dir, step) as reader:
        meta = reader.metadata
        saved = {n.split("/", 1)[0] for n in reader.tensor_names()}
        for m in _models(policy):
            if m.prefix == "ref" and "ref" not in saved:
                continue  # keep the seed-initialised reference (the reference is the initial policy)
            if m.prefix not in saved:
                raise ValueError(f"this checkpoint has no {m.prefix} (it was saved by a run without one, "
                                 "e.g. not ppo); resume it with its own algorithm, or start the run fresh "
                                 "from its export (model.path)")
            _load_model(m, reader, float(meta.get(m.step_key, 0.0)) if m.step_key else 0.0)
        ranks = reader.blob_ranks("rng")
        if len(ranks) == dist.get_world_size() and dist.get_rank() in ranks:
            _set_rng(reader.blob("rng", rank=dist.get_rank()))
    policy._loaded["policy"] = True
    return meta


def _by_param(pieces: list) -> list[tuple[torch.nn.Parameter, list]]:
    """The pieces of each parameter together, in the order the parameters first appear (the same
    order on every rank of a DP group, which `_join_main`'s collectives need)."""
    out: dict[torch.nn.Parameter, list] = {}
    for name, param, index, box, shape in pieces:
        out.setdefault(param, []).append((name, index, box, shape))
    return list(out.items())


def _adam_started(mains: dict[torch.nn.Parameter, _Main], device: torch.device) -> bool:
    """Whether the distributed optimizer has taken a step (its moments exist), agreed by all ranks:
    a rank that owns no shard has no state to look at."""
    here = any("exp_avg" in main.state for main in mains.values())
    return bool(mains) and _max_over_ranks(float(here), device) > 0


def _max_over_ranks(value: float, device: torch.device) -> float:
    """`value`'s maximum over the trainer ranks (a rank without optimizer state reports 0);
    `device` is the policy's, where its collectives run."""
    if dist.get_world_size() == 1:
        return value
    out = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.cpu()[0])


@torch.no_grad()
def _load_model(m: _Model, reader: Any, adam_step: float) -> None:
    """Fill the pieces of `m` this rank holds, and their Adam moments when the checkpoint has them."""
    mains = _main_params(m.ddp, m.optimizer)
    if mains:
        return _load_main(m, reader, adam_step, mains)
    states = _adam_states(m.optimizer) if adam_step > 0 else {}
    source = _param_source(m, reader)
    for name, param, index, box, _ in m.pieces:
        targets = {source: param.data}
        if adam_step > 0 and param.requires_grad:  # not DeepSeek's frozen expert bias (a buffer)
            st = states[param]
            for k in ADAM_KEYS:
                st.setdefault(k, torch.zeros_like(param.data))
                targets[f"{m.adam_prefix}/{k}"] = st[k]
            st["step"] = torch.tensor(adam_step, dtype=torch.float32)
        for prefix, target in targets.items():
            target[index] = reader.read(f"{prefix}/{name}", box).to(target.dtype)


def _param_source(m: _Model, reader: Any) -> str:
    """Where `m`'s fp32 values are: its main parameters when a bf16 run saved them, else itself."""
    if m.main_prefix and any(n.startswith(f"{m.main_prefix}/") for n in reader.tensor_names()):
        return m.main_prefix
    return m.prefix


def _load_main(m: _Model, reader: Any, adam_step: float, mains: dict[torch.nn.Parameter, _Main]) -> None:
    """`_load_model` for the distributed optimizer: the bf16 parameters from `prefix/`, and this
    rank's flat range of each fp32 main parameter (from `main_prefix/`, or the parameter itself in
    a float32 checkpoint) and of its moments, read only where this rank owns part of them."""
    source = _param_source(m, reader)
    for param, pieces in _by_param(m.pieces):
        for name, index, box, _ in pieces:
            param.data[index] = reader.read(f"{m.prefix}/{name}", box).to(param.dtype)
        main = mains.get(param)
        if main is None or main.shard is None:
            continue
        # only the rows of `param` that this rank's flat range touches, one quantity at a time
        shape = tuple(param.shape) or (1,)
        row = math.prod(shape[1:])
        rows = slice(main.flat.start // row, -(-main.flat.stop // row))
        flat = slice(main.flat.start - rows.start * row, main.flat.stop - rows.start * row)
        keys = {"main": source, **({k: f"{m.adam_prefix}/{k}" for k in ADAM_KEYS} if adam_step > 0 else {})}
        for k, prefix in keys.items():
            part = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=torch.float32, device=param.device)
            for name, index, box, _ in pieces:
                mine = _rows_within(index, box, rows) if param.dim() else (index, box)
                if mine is not None:
                    part[mine[0]] = reader.read(f"{prefix}/{name}", mine[1]).float()
            if k == "main":
                main.shard.copy_(part.view(-1)[flat])
            else:
                main.state[k] = part.view(-1)[flat].clone()
        if adam_step > 0:
            main.state["step"] = torch.tensor(adam_step, dtype=torch.float32)


def _rows_within(index: tuple[slice, ...], box: Any, rows: slice) -> tuple[tuple[slice, ...], Any] | None:
    """The part of a piece (at `index` in its parameter, `box` in the HF tensor) that falls in the
    parameter's `rows`: (its index in a buffer of those rows, its global box); None if none."""
    from moe.slices import Box

    first = index[0]
    lo, hi = max(first.start, rows.start), min(first.stop, rows.stop)
    if hi <= lo:
        return None
    into = (slice(lo - rows.start, hi - rows.start), *index[1:])
    skip = lo - first.start
    return into, Box((box.offsets[0] + skip, *box.offsets[1:]), (hi - lo, *box.shape[1:]))
