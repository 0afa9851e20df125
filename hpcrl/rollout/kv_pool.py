"""The KV cache an SGLang 0.5.23 engine gives itself at start, worked out before any GPU exists.

SGLang sizes its token pool once, after the weights load (mem_cache/kv_cache_configurator.py,
`_profile_available_bytes`): the GPU memory still free, less (1 - mem_fraction_static) of what was
free before the load, divided by the bytes one token takes in every layer's cache
(model_executor/pool_configurator.py, `DefaultPoolConfigurator._compute_cell_size`). Without
`--mem-fraction-static`, the fraction is SGLang's heuristic (arg_groups/memory_hook.py,
`handle_gpu_memory_settings`): the GPU's memory less a reserve for activations and CUDA graphs
that grows with the chunked-prefill size, the decode graphs' batch size and, under DP attention,
with both times the DP size. `mem_fraction_static` follows that code for the engines hpcrl starts
(tests/conformance/test_kv_pool.py runs SGLang's own function beside it).

`hpcrl plan` shows the pool and fails a layout whose engines could not serve a step: no memory left
for the pool (SGLang refuses to start: "Loaded weights leave no GPU memory for the KV cache"), or a
pool smaller than one sample and CONTEXT_RESERVE (SGLang's max_req_len is min(context_len, pool) - 1,
managers/tp_worker.py `get_worker_info`: it clips max_new_tokens to it, scheduler.py
`init_req_max_new_tokens`, so responses would end early, and refuses longer inputs). The pool is
an upper bound: SGLang measures what is free, the GPU's memory less the CUDA context and
communication buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpcrl.config.validate_data import CONTEXT_RESERVE
from hpcrl.config.validate_rollout import server_arg_number, server_arg_values
from moe.specs import DTYPE_BYTES

MIB = 2**20

KV_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp8_e5m2": 1, "fp8_e4m3": 1}
"""--kv-cache-dtype values whose cache is one plain array per layer ("auto": the engine's dtype)."""

UNMODELLED_FLAGS = ("--cuda-graph-config", "--cuda-graph-bs-decode", "--cuda-graph-bs-prefill",
                    "--speculative-algorithm", "--disaggregation-mode", "--enable-hierarchical-cache",
                    "--dcp-size", "--pp-size", "--enable-kv-cache-sharding")
"""Server arguments that change SGLang's memory sizing in ways this estimate does not follow."""


def _gpu_tier(gpu_mib: float, tp: int) -> tuple[int, int]:
    """SGLang's chunked_prefill_size and decode CUDA-graph max_bs defaults for a GPU of `gpu_mib`."""
    wide = tp >= 4
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 160 if wide else 48
    if gpu_mib < 60 * 1024:
        return 4096, 160 if wide else 32
    if gpu_mib < 160 * 1024:
        return 8192, 512 if wide else 256
    return 16384, 512


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """The token counts SGLang captures prefill CUDA graphs for, up to `max_bs` (cuda_graph_hook.py)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_bs + 1, 512)]
    return [s for s in sizes if s <= max_bs]


@dataclass(frozen=True)
class EngineMemoryArgs:
    """The SGLang server arguments that size an engine's memory (rollout.server_args); None: SGLang's
    default. `unmodelled` lists the arguments given that change the sizing in ways not followed."""

    mem_fraction_static: float | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    decode_graph: str = "full"
    prefill_graph: str = "breakable"
    decode_graph_max_bs: int | None = None
    prefill_graph_max_bs: int | None = None
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    context_length: int | None = None
    deepep: bool = False
    unmodelled: tuple[str, ...] = field(default=())

    @staticmethod
    def from_server_args(args: list[str]) -> EngineMemoryArgs:
        """Read `args` as SGLang's parser would for these flags; a bad number is a ConfigError naming
        rollout.server_args[i]."""
        ints = {"--chunked-prefill-size": "chunked_prefill_size",
                "--max-prefill-tokens": "max_prefill_tokens",
                "--max-running-requests": "max_running_requests", "--max-total-tokens": "max_total_tokens",
                "--cuda-graph-max-bs-decode": "decode_graph_max_bs",
                "--cuda-graph-max-bs-prefill": "prefill_graph_max_bs", "--page-size": "page_size",
                "--context-length": "context_length"}
        got: dict[str, Any] = {}
        legacy, switches, backends = {}, {}, {}  # SGLang's precedence: backends over switches over legacy
        unmodelled = []
        for i, arg, flag, value in server_arg_values(args):
            if flag == "--mem-fraction-static":
                got["mem_fraction_static"] = server_arg_number(i, arg, flag, value, float)
            elif flag in ints:
                got[ints[flag]] = server_arg_number(i, arg, flag, value)
            elif flag == "--kv-cache-dtype":
                got["kv_cache_dtype"] = value
            elif flag == "--moe-a2a-backend":
                got["deepep"] = value == "deepep"
            elif flag == "--disable-cuda-graph":  # SGLang's deprecated spelling: both phases
                legacy = {"decode_graph": "disabled", "prefill_graph": "disabled"}
            elif flag in ("--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"):
                switches["decode_graph" if "decode" in flag else "prefill_graph"] = "disabled"
            elif flag in ("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"):
                backends["decode_graph" if "decode" in flag else "prefill_graph"] = value
            elif flag in UNMODELLED_FLAGS:
                unmodelled.append(flag)
        return EngineMemoryArgs(**got, **{**legacy, **switches, **backends}, unmodelled=tuple(unmodelled))


def mem_fraction_static(gpu_mib: float, tp: int, attn_dp: int, mla: bool,
                        args: EngineMemoryArgs) -> tuple[float, float]:
    """(mem_fraction_static, the MiB it reserves) as SGLang 0.5.23's `handle_gpu_memory_settings`
    sets them on a CUDA GPU of `gpu_mib` MiB for an engine of `tp` GPUs with `attn_dp` DP-attention
    groups (1: none), MLA attention or not; `args.mem_fraction_static` when given (reserve 0).
    The branch every engine hpcrl starts takes: no disaggregation, no VLM, no speculative decoding,
    KV sizing before the graphs are captured, one pipeline stage."""
    if args.mem_fraction_static is not None:
        return args.mem_fraction_static, 0.0
    chunked, decode_max_bs = _gpu_tier(gpu_mib, tp)
    chunked = args.chunked_prefill_size if args.chunked_prefill_size is not None else chunked
    if args.decode_graph_max_bs is not None:
        decode_max_bs = args.decode_graph_max_bs
    elif args.max_running_requests is not None:
        decode_max_bs = min(decode_max_bs, args.max_running_requests)
    prefill_max_bs = args.prefill_graph_max_bs
    if args.deepep and args.prefill_graph == "breakable":  # DeepEP's buckets: multiples of 8, 2048 unless set
        prefill_sizes = sorted({-(-b // 8) * 8 for b in prefill_graph_sizes(prefill_max_bs or 2048)})
    else:
        if prefill_max_bs is None:
            prefill_max_bs = min(8192, chunked) if mla else chunked
            if args.max_total_tokens is not None:
                prefill_max_bs = min(prefill_max_bs, args.max_total_tokens)
        prefill_sizes = prefill_graph_sizes(prefill_max_bs)
    activation_tokens = max(chunked if chunked > 0 else args.max_prefill_tokens, 2048)
    graphs = decode_max_bs * 2 if args.decode_graph != "disabled" else 0.0
    if attn_dp > 1:
        graphs += decode_max_bs * attn_dp * 3 + (decode_max_bs * attn_dp * 1.5 if decode_max_bs > 300 else 0)
    if args.prefill_graph != "disabled":
        graphs += 1.5 * 1024 if mla else len(prefill_sizes) * 8
        graphs += 1024 if args.deepep and args.prefill_graph == "breakable" else 0
    reserved = 512 + activation_tokens * 1.5 + tp / 8 * 1024 + graphs
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    if args.deepep and args.decode_graph != "disabled":
        reserved += 2 * 1024
    return round((gpu_mib - reserved) / gpu_mib, 3), reserved


def kv_cell_bytes(dims: Any, attn_tp: int, element_bytes: int) -> int:
    """Bytes one token takes in an engine GPU's KV cache over all decoder layers (SGLang's
    `_compute_cell_size`): MLA keeps the compressed latent and the RoPE key, kv_lora_rank +
    qk_rope_head_dim, on every GPU; other attention its share of the KV heads (at least one), a key
    and a value of head_dim each. `dims` is an `HFModelDims` (moe/hf_megatron.py)."""
    if dims.mla is not None:
        per_layer = dims.mla.kv_lora_rank + dims.mla.qk_rope_dim
    else:
        per_layer = max(1, dims.num_kv_heads // attn_tp) * 2 * dims.head_dim
    return per_layer * dims.num_layers * element_bytes


def kv_pool(*, dims: Any, tp: int, attn_dp: int, num_engines: int, engine_dtype: str, server_args: list[str],
            weights_bytes: float, gpu_bytes: int, prompt: int, max_new_tokens: int,
            samples: int) -> dict[str, Any]:
    """The KV pool of each engine GPU (at most) and how a step's `samples` of at most `prompt` +
    `max_new_tokens` tokens fit it, spread over `num_engines` x `attn_dp` schedulers. `fits` False
    comes with `error`, a message naming what to change. `modelled` False (a KV dtype or a server
    argument not followed): the figures are left out and nothing is judged."""
    args = EngineMemoryArgs.from_server_args(server_args)
    gpu_mib = gpu_bytes / MIB
    fraction, reserved = mem_fraction_static(gpu_mib, tp, attn_dp, dims.mla is not None, args)
    element = DTYPE_BYTES[engine_dtype] if args.kv_cache_dtype == "auto" else \
        KV_DTYPE_BYTES.get(args.kv_cache_dtype)
    unmodelled = [*args.unmodelled, *([] if element else [f"--kv-cache-dtype {args.kv_cache_dtype}"])]
    sample_tokens = prompt + max_new_tokens
    out: dict[str, Any] = {
        "mem_fraction_static": fraction, "from_server_args": args.mem_fraction_static is not None,
        "reserved_bytes": reserved * MIB, "unmodelled": unmodelled, "sample_tokens": sample_tokens,
        "samples_per_scheduler": math.ceil(samples / (num_engines * attn_dp)), "modelled": not unmodelled,
        "fits": True}
    if unmodelled:
        return out
    cell = kv_cell_bytes(dims, tp // attn_dp, element)
    pool_bytes = int(gpu_bytes * fraction - weights_bytes)
    tokens = max(0, pool_bytes) // cell // args.page_size * args.page_size
    if args.max_total_tokens is not None:
        tokens = min(tokens, args.max_total_tokens)
    context = args.context_length or dims.max_position_embeddings
    running = args.max_running_requests
    running = (min(max(1, running // attn_dp), tokens // 2) if running is not None
               else min(max(min(int(tokens / context * 512), 4096), 2048), tokens // 2))
    at_once = min(tokens // sample_tokens, running, out["samples_per_scheduler"])
    waves = math.ceil(out["samples_per_scheduler"] / at_once) if at_once else None
    out.update(cell_bytes=cell, pool_bytes=max(0, pool_bytes), pool_tokens=tokens,
               max_running_requests=running, samples_at_once=at_once, waves=waves)
    need = sample_tokens + CONTEXT_RESERVE
    fraction_needed = math.ceil((weights_bytes + need * cell) / gpu_bytes * 1000) / 1000
    if args.max_total_tokens is not None and args.max_total_tokens < need <= max(0, pool_bytes) // cell:
        fix = f"raise --max-total-tokens in rollout.server_args to at least {need:,}"
    elif fraction_needed < 1:
        fix = (f"set --mem-fraction-static >= {fraction_needed:g} in rollout.server_args (that leaves "
               f"{(1 - fraction_needed) * gpu_bytes / 2**30:.1f} GiB per GPU for activations and CUDA graphs"
               + (f"; SGLang's default reserves {reserved / 1024:.1f} GiB, which "
                  "--cuda-graph-max-bs-decode and --chunked-prefill-size shrink"
                  if not out["from_server_args"] else "")
               + "), or increase rollout.tp_per_engine and rollout.ep")
    else:
        fix = ("no fraction of the GPU holds the weights and one sample: increase "
               "rollout.tp_per_engine and rollout.ep")
    if pool_bytes <= 0:
        out["fits"] = False
        out["error"] = (f"SGLang's KV cache: weights of {weights_bytes / 2**30:.2f} GiB per GPU leave no "
                        f"memory for it under --mem-fraction-static={fraction:g} of "
                        f"{gpu_bytes / 2**30:.1f} GiB (SGLang refuses to start); {fix}")
    elif tokens < sample_tokens + CONTEXT_RESERVE:  # the pool bounds a request as the context does
        out["fits"] = False
        out["error"] = (f"SGLang's KV cache: at most {tokens:,} tokens per GPU ({cell:,} B each), fewer than "
                        f"one sample's {sample_tokens:,} + {CONTEXT_RESERVE} (SGLang's max_req_len is "
                        f"min(context, pool) - 1: it would cut responses short of rollout.max_new_tokens="
                        f"{max_new_tokens} and refuse the sync check's prompt + response); {fix}, or lower "
                        "rollout.max_new_tokens")
    return out
