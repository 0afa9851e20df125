"""Compatibility layer that lets megatron-core 0.16.1 train MoE GPT models on CPU (and without TE).

Megatron-core assumes CUDA in a few hundred places; the training path of a GPTModel + MoE touches
a handful of them. `apply()` installs narrow patches, each naming the call site it fixes (facts
and measurements: notes/python_stack.md sections 2-2.4):

  TE-less fixes (GPU too): `moe_utils.py:1192 RouterGatingLinearFunction.forward` reads the name
      `te_general_gemm`, which 0.16.1 defines only when transformer-engine imports;
      `multi_latent_attention.py:62` sets HAVE_TE when the TE extension module imports, which it does
      without TE (its classes are MagicMocks then), and line 185 calls isinstance with such a mock.
      `tensor_parallel/random.py:636 CheckpointWithoutOutput.__init__` sets `self.fp8 = fp8 is not None`,
      so its default fp8=False, which transformer_layer.py:577/672 use, takes the fp8 path, whose
      `FP8GlobalStateManager` exists only with TE (NameError: trainer.recompute_modules layernorm);
      the patched constructor counts False as no fp8.
  Router fix (GPU too): `router.py:542 _apply_expert_bias` (token counts for the expert bias, which
      DeepSeek-V3 models enable) ANDs routing_map [tokens, experts] with a padding mask [tokens],
      which broadcasts wrongly and raises; the patched method broadcasts the mask over the experts.
  Recompute fix (GPU too): `transformer_block.py:544 _checkpointed_forward` with recompute_method
      block calls the layers it does not recompute without the padding mask, so their routers count
      padding tokens in the load-balancing loss (the aux loss and every gradient then differ from a run
      without recompute); the patched method passes it, as the uniform method and the recomputed
      layers do. Other recompute settings, and fp8/fp4, go to Megatron's method.
  Norm fix (GPU too, whenever apex is absent, as on hpcrl's GPU install): patch 3 below. Without
      apex the local spec builds every norm as `WrappedTorchNorm`, whose assert would stop any
      trainer.tp > 1 (sequence parallel) model from being built on a GPU as well.
  CPU only (nothing below is touched when CUDA is available):
  1. `torch` stand-in inside the Megatron modules listed in `_CPU_MODULES`: their `torch.cuda` is
     a CPU namespace (current_device() -> "cpu"; streams/events are no-ops; synchronize and
     empty_cache do nothing; the CUDA RNG calls use the CPU generator) and tensor factories
     called with device="cuda" allocate on the CPU. Call sites: rotary_pos_embedding.py:162,
     utils.py:631 GlobalMemoryBuffer, transformer/utils.py:35 causal mask,
     token_dispatcher.py:445 Stream, schedules.py:2138, p2p_communication.py:190/313,
     param_and_grad_buffer.py:783, optimizer.py:907, clip_grads.py:103/174, mappings.py:441,
     layers.py:552 (sequence-parallel backward),
     router.py:169, and the `add` of tensor_parallel/random.py:235.
  2. `tensor_parallel/random.py:_get/_set_cuda_rng_state` (the RNG tracker's fork) use the
     default CPU generator.
  3. (the norm fix, applied without apex on a GPU too) `torch_norm.py:32 WrappedTorchNorm.__new__`
     asserts `not sequence_parallel`; the patched constructor builds the same torch norm and tags
     its params `sequence_parallel=True`, so `finalize_model_grads` all-reduces their grads over TP
     (as it does for TE norms).
  4. `token_dispatcher.py:876 maybe_move_tensor_to_cpu` only converts CUDA tensors, leaving the
     alltoall split sizes as tensors that `all_to_all_single` rejects; CPU tensors are converted
     to numpy when `as_numpy`.
  5. `clip_grads.py:167 clip_grad_by_total_norm_fp32` asserts the grad type string
     'torch.cuda.FloatTensor'; the patched function is the same in-place scaling for fp32 CPU
     grads, so `grad_clip > 0` works.
  6. Start-up, not correctness: `jit.py:21` sets `jit_fuser = torch.compile`, and decorating the
     fusion functions with it imports dynamo and inductor (about 2 s of the 4 s import). hpcrl
     turns every fusion off, so none of those functions runs here; the first `import megatron.core`
     happens with `torch.compile` as the identity (restored right after), which leaves
     `jit_fuser` a plain decorator.
  Speed, not correctness (CPU only; each replaces a Python-level path by the native op it reduces
  to under the stated condition, so values and gradients are the same):
  7. `layers.py:629 linear_with_grad_accumulation_and_async_allreduce` -> `F.linear` when there is
     no gradient-accumulation fusion, no dgrad all-reduce, no sequence parallelism and no deferred
     wgrad; `moe_utils.py:1243 router_gating_linear` -> `F.linear` when input and weight are in the
     router dtype. Both custom autograd Functions then compute only that matmul.
  8. `utils.py:1200 local_multi_tensor_l2_norm` (the grad norm without apex) -> one foreach norm
     kernel instead of a norm per tensor and a round trip through Python floats.
  9. `mappings.py` copy_to_ / reduce_from_tensor_model_parallel_region and all_to_all return their
     input when the group has one rank (their Functions are the identity both ways there).
  10. `experts.py SequentialMLP.forward` (several local experts) -> two `F.grouped_mm` over the
     stacked expert weights when every expert is a bias-free SwiGLU MLP on one expert-TP rank
     (no fp8, no clamp or offset, no fused activation): the per-expert loop's math (fc1,
     silu(gate) * up, times the routing prob, fc2) in two kernels; log-probs of the tiny model
     unchanged bit for bit. Megatron's own grouped-GEMM experts need the CUDA `grouped_gemm`
     package and a different parameter layout; this keeps SequentialMLP's parameters and names.
  11. `clip_grads.py:51 get_grad_norm_fp32` (the grad norm every step reports, clipping or not)
     -> patch 8's foreach norm alone when the L2 norm's reduction group has one rank and no grad is
     a DTensor: without the per-grad DTensor probes and the one-rank all-reduce (~0.35 ms of the
     tiny model's ~45 ms step), and with the same float arithmetic, so the same value.
  12. `rope_utils.py:92 _apply_rotary_pos_emb_bshd` ends with `torch.cat((t, t_pass))`, which
     copies the rotated q or k when the rotary dims cover the whole head (t_pass empty; every
     model hpcrl builds but MLA); the fast path returns the rotated tensor itself (-1% of the
     tiny train step, same-process A/B). MLA and partial rotary go to Megatron's function.
  13. `param_and_grad_buffer.py:365 _ParamAndGradBucketGroup.start_grad_sync` -> only the gradient
     scaling when the group it reduces over has one rank (data parallel size 1) and the optimizer is
     not distributed: the all-reduce (sum or average) of one rank is the identity, and the coalesced
     collectives cost ~2% of the tiny model's train step. Overlapped reduction, the distributed
     optimizer and the NaN / large-grad checks go to Megatron's function.
  14. `fused_softmax.py:331` (the unfused attention softmax) and the router's `torch.softmax`
     calls (`moe_utils.py:711/715/781`, `router.py:235`) -> `hpcrl.trainer.softmax_cpu`: torch's
     softmax over the last dim bit for bit (checked per row length on first use, else torch's),
     faster where a row is shorter than one SIMD vector: forward + backward 1.7-2.1x on the tiny
     model's [64, 4, 12, 12] attention scores (benchmarks/RESULTS.md, small_kernels), about -10%
     of the isolated train step at 12 positions, within the noise at the copy task's 7; policy
     hash unchanged.
  15. `moe_utils.py:470 sort_chunks_by_idxs` (the alltoall dispatcher's sort of received tokens by
     local expert, and its inverse) returns its inputs when the order is the identity, as it is
     with one EP x TP rank: the split and in-order concatenation copy every token and its gradient
     twice per MoE layer for nothing.
  16. `distrib_optimizer.py:361/420/582` (Megatron's distributed optimizer, which hpcrl uses for
     bf16 parameters) sorts parameters by their type strings, which name CUDA tensors only
     ('torch.cuda.BFloat16Tensor', ...), and raises TypeError for CPU ones. While its constructor
     runs, `Tensor.type()` without arguments spells a CPU tensor's type as the CUDA one
     (`_cuda_type_names`); nothing else changes, and the type is restored right after.
  17. `distributed_data_parallel.py:420 _make_backward_post_hook`: Megatron DDP adds each parameter's
     grad into its fp32 `main_grad` in a Python hook on the parameter's grad accumulator, once per
     parameter and micro-batch (~5% of the tiny model's train step). With fp32 parameters and no
     overlapped reduction the hook is a no-op; autograd leaves the grads in `param.grad` (summed over
     the micro-batches, as the hook would sum them into the zeroed buffer: the same floats), and
     DDP's `start_grad_sync` / `finish_grad_sync` first add them all into `main_grad` with one
     foreach kernel and free them, as the hook did. Policy hash unchanged (tests/megatron).
  18. `finalize_model_grads.py:278 reset_model_temporary_tensors` walks every module of the model
     after each step to reset the routers' expert-bias token counts and global aux-loss trackers;
     without expert bias and a global aux loss there is nothing to reset, and the walk is skipped
     (~1% of the tiny model's train step).
  Together with patch 1 caching its attribute look-ups, patches 7-9 took the tiny model's train
  step from 58 to 46 ms (median of 4 alternating runs), patch 10 another 11% (same-process A/B;
  dev/LOG.md). Attention is left to Megatron: SDPA there (7% faster) moved the trainer's rounding
  enough to flip one near-tied top-2 router choice against the engine in the compute benchmark
  (one token off by 0.026; the sync check's 1e-4 bound stops the run on it); dev/LOG.md.

The patches touch private functions, so the module refuses any other megatron-core version.
`apply()` is idempotent.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any

import torch

from hpcrl.trainer.softmax_cpu import SoftmaxLastDim, softmax_lastdim

MEGATRON_VERSION = "0.16.1"

_CPU_MODULES = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.attention",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.fusions.fused_softmax",
)

_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                        "randint", "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"})

_applied = {"te": False, "cpu": False, "router": False, "norm": False}


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec to "cpu"; leave everything else alone."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: every stream is the same, work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoOpStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NoOpStream:
        return self

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NO_OP_STREAM = _NoOpStream()


class _CpuCuda(types.SimpleNamespace):
    """The `torch.cuda` seen by patched Megatron modules on a CPU-only host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _make_cpu_cuda() -> _CpuCuda:
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    return _CpuCuda(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=_NoOpStream,
        Event=_NoOpStream,
        current_stream=lambda *a, **k: _NO_OP_STREAM,
        default_stream=lambda *a, **k: _NO_OP_STREAM,
        stream=lambda *a, **k: contextlib.nullcontext(),
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
    )


def _softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.softmax` with the last dim through `softmax_cpu` (patch 14)."""
    if dim in (-1, input.dim() - 1) and dtype in (None, input.dtype):
        return softmax_lastdim(input)
    return torch.softmax(input, dim, dtype=dtype)


def _softmax_module(dim: int | None = None) -> torch.nn.Module:
    """`torch.nn.Softmax(dim)`, through `softmax_cpu` over the last dim (patch 14)."""
    return SoftmaxLastDim() if dim == -1 else torch.nn.Softmax(dim)


class _CpuNN(types.ModuleType):
    """`torch.nn` in the patched modules: forwards to it, except `Softmax` (patch 14)."""

    def __init__(self) -> None:
        super().__init__("torch.nn")
        self.Softmax = _softmax_module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch.nn, name)
        setattr(self, name, attr)
        return attr


class _CpuTorch(types.ModuleType):
    """Forwards to `torch`, except `cuda` (a CPU namespace), factories given a CUDA device, and
    softmax (patch 14)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _make_cpu_cuda()
        self.nn = _CpuNN()
        self.softmax = _softmax

    def __getattr__(self, name: str) -> Any:
        # Called only on the first access of a name: the result is kept as an attribute, so the
        # hot paths of the patched modules look `torch.X` up at module-attribute speed.
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args: Any, _f: Any = attr, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _f(*args, **kwargs)

            attr = factory
        setattr(self, name, attr)
        return attr


def _identity_compile(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
    """`torch.compile` as a no-op, both as `@torch.compile` and as `torch.compile(...)(fn)`."""
    return fn if fn is not None else (lambda f: f)


def _import_megatron() -> Any:
    """`import megatron.core`; the first time on CPU, with torch.compile as the identity (patch 6)."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return importlib.import_module("megatron.core")
    real = torch.compile
    torch.compile = _identity_compile
    try:
        return importlib.import_module("megatron.core")
    finally:
        torch.compile = real


def _check_version() -> None:
    megatron_core = _import_megatron()
    if megatron_core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(
            f"hpcrl.trainer.megatron_compat patches private functions of megatron-core "
            f"{MEGATRON_VERSION}, but megatron-core {megatron_core.__version__} is installed; "
            f"install megatron-core=={MEGATRON_VERSION} (the version pyproject.toml pins)")


def _have_transformer_engine() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return bool(getattr(moe_utils, "HAVE_TE", False))


def _have_apex() -> bool:
    """Whether Megatron's layer specs found apex (then they build FusedLayerNorm, not WrappedTorchNorm)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_APEX)


def _apply_te_fix() -> None:
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from megatron.core.tensor_parallel import random

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    checkpoint = random.CheckpointWithoutOutput
    checkpoint.__init__ = _checkpoint_without_output_init(checkpoint.__init__)
    # Without TE, megatron.core.extensions.transformer_engine still imports, its TE classes being
    # MagicMock stand-ins, so MLA believes TE is there and calls isinstance(linear, <a mock>).
    multi_latent_attention.HAVE_TE = False


def _count_tokens_per_expert(self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
                             ) -> None:
    """`router.py:532 TopKRouter._apply_expert_bias` with the padding mask [tokens] broadcast over the
    experts of routing_map [tokens, experts] (0.16.1 broadcasts it over the tokens and raises)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _apply_router_fix() -> None:
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import router

    router.TopKRouter._apply_expert_bias = _count_tokens_per_expert
    block = transformer_block.TransformerBlock
    block._checkpointed_forward = _block_recompute_with_padding_mask(block._checkpointed_forward)


def _block_recompute_with_padding_mask(original: Any) -> Any:
    """`TransformerBlock._checkpointed_forward` whose block method passes the padding mask to every
    layer (the recompute fix): the first recompute_num_layers layers of the stage through
    `tensor_parallel.checkpoint`, the others called directly, as Megatron's method does without fp8."""
    def _checkpointed_forward(self: Any, hidden_states: Any, attention_mask: Any, context: Any, context_mask: Any,
                              rotary_pos_emb: Any, attention_bias: Any, packed_seq_params: Any,
                              use_inner_quantization_context: bool, padding_mask: Any = None) -> Any:
        config = self.config
        if config.recompute_method != "block" or config.fp8 or config.fp4:
            return original(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                            attention_bias, packed_seq_params, use_inner_quantization_context, padding_mask)
        from megatron.core import tensor_parallel

        def layer_forward(index: int) -> Any:
            def forward(hidden_states: Any, attention_mask: Any, context: Any, context_mask: Any,
                        rotary_pos_emb: Any, padding_mask: Any = None) -> Any:
                return self._get_layer(index)(
                    hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                    context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                    inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            return forward

        for index in range(self.num_layers_per_pipeline_rank):
            inputs = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask)
            if index < config.recompute_num_layers:
                hidden_states, context = tensor_parallel.checkpoint(
                    layer_forward(index), config.distribute_saved_activations, *inputs)
            else:
                hidden_states, context = layer_forward(index)(*inputs)
        return hidden_states

    return _checkpointed_forward


def _checkpoint_without_output_init(original: Any) -> Any:
    """`CheckpointWithoutOutput.__init__` that takes fp8=False as no fp8 (the TE-less fix)."""
    def __init__(self: Any, fp8: Any = False) -> None:
        original(self, None if fp8 is False else fp8)

    return __init__


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _torch_norm_new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
    """WrappedTorchNorm without the sequence-parallel assert (see patch 3)."""
    if config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
    elif config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    else:
        raise ValueError(f"normalization={config.normalization!r}; the compat layer supports RMSNorm, LayerNorm")
    if config.sequence_parallel:
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` that also gives numpy for CPU tensors (patch 4)."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                  use_decoupled_grad: bool = False) -> None:
    """Scale fp32 grads in place by max_norm / total_norm when that is < 1 (patch 5)."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            assert grad.dtype == torch.float32, f"clip_grads expects fp32 grads, got {grad.dtype}"
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _linear_fast_path(original: Any) -> Any:
    """`layers.linear_with_grad_accumulation_and_async_allreduce` that calls `F.linear` when the
    custom autograd Function would compute nothing else (patch 7)."""
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
               grad_output_buffer: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel
                or grad_output_buffer is not None):
            return torch.nn.functional.linear(input, weight, bias)
        return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                        sequence_parallel, grad_output_buffer, *args, **kwargs)

    linear.warned = original.warned  # the original reads and sets it through its global name
    return linear


def _router_linear_fast_path(original: Any) -> Any:
    """`moe_utils.router_gating_linear` that calls `F.linear` when input and weight are already in
    the router dtype, so the custom Function would only do that matmul (patch 7)."""
    def router_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      router_dtype: torch.dtype) -> torch.Tensor:
        if inp.dtype == weight.dtype == router_dtype:
            return torch.nn.functional.linear(inp, weight, bias)
        return original(inp, weight, bias, router_dtype)

    return router_linear


def _skip_single_rank_group(original: Any, group_first: bool) -> Any:
    """A `tensor_parallel.mappings` wrapper that returns its input when the group has one rank,
    where the autograd Function is the identity both ways (patch 9)."""
    if group_first:  # all_to_all(group, input_, ...)
        def wrapper(group: Any, input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if group is not None and group.size() == 1:
                return input_
            return original(group, input_, *args, **kwargs)
    else:  # copy_to_... / reduce_from_...(input_, group=None)
        def wrapper(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
            if group is not None and group.size() == 1:
                return input_
            return original(input_, group)

    return wrapper


def _grouped_experts_fast_path(original: Any) -> Any:
    """`SequentialMLP.forward` as two `F.grouped_mm` over the stacked expert weights when every
    expert is a plain bias-free SwiGLU MLP on one expert-TP rank (patch 10); the same math as the
    per-expert loop: fc1, silu(gate) * up, times the routing prob, fc2."""
    def forward(self: Any, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: Any,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        c = self.config
        x = permuted_local_hidden_states
        align = 16 // x.element_size()  # grouped_mm wants 16-byte row strides
        if (self.num_local_experts == 1 or self.tp_group.size() != 1 or c.fp8 or c.fp4
                or c.moe_apply_probs_on_input or c.add_bias_linear or not c.gated_linear_unit
                or c.activation_func is not torch.nn.functional.silu or c.bias_activation_fusion
                or c.use_te_activation_func or c.activation_func_clamp_value is not None
                or c.glu_linear_offset != 0 or c.gradient_accumulation_fusion or x.dim() != 2
                or x.shape[1] % align or c.moe_ffn_hidden_size % align):
            return original(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        offsets = torch.as_tensor(tokens_per_expert).cumsum(0).to(device=x.device, dtype=torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        gate, up = torch.chunk(torch.nn.functional.grouped_mm(x, w1, offs=offsets), 2, dim=-1)
        hidden = (torch.nn.functional.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return torch.nn.functional.grouped_mm(hidden, w2, offs=offsets), None

    return forward


def _rope_without_pass_through(original: Any, rotate_half: Any) -> Any:
    """`rope_utils._apply_rotary_pos_emb_bshd` without the copy that appends an empty pass-through
    part (patch 12): Megatron's unfused RoPE arithmetic, op for op."""
    def apply(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
              multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if multi_latent_attention or t.shape[-1] != freqs.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
        sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
        return (t * cos_) + (rotate_half(t, rotary_interleaved) * sin_)

    return apply


def _one_rank_grad_norm(original: Any) -> Any:
    """`clip_grads.get_grad_norm_fp32` that skips the reductions when they are over one rank
    (patch 11): the same (norm ** 2) ** (1 / 2) float the original returns there."""
    def get_grad_norm_fp32(grads_for_norm: Any, norm_type: float = 2,
                           grad_stats_parallel_group: Any = None) -> float:
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else grads_for_norm
        one_rank = (grad_stats_parallel_group.size() == 1 if grad_stats_parallel_group is not None
                    else torch.distributed.get_world_size() == 1)
        if float(norm_type) != 2.0 or not one_rank or any(type(g) is not torch.Tensor for g in grads):
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        norm = _local_l2_norm(0, None, [grads], False)[0] if grads else torch.zeros(1)
        return (norm ** 2.0).item() ** 0.5

    return get_grad_norm_fp32


def _one_rank_grad_sync(original: Any) -> Any:
    """`_ParamAndGradBucketGroup.start_grad_sync` without the collective over a one-rank group
    (patch 13): what the original does there, less the identity all-reduce."""
    def start_grad_sync(self: Any, force_all_reduce: bool | None = False) -> None:
        cfg = self.ddp_config
        if (cfg.use_distributed_optimizer or cfg.overlap_grad_reduce or cfg.check_for_nan_in_grad
                or cfg.check_for_large_grads or cfg.num_distributed_optimizer_instances != 1
                or self.data_parallel_group.size() != 1):
            return original(self, force_all_reduce)
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        self.grad_reduce_handle = None
        return None

    return start_grad_sync


def _sort_chunks_unless_in_order(original: Any) -> Any:
    """`moe_utils.sort_chunks_by_idxs` that returns its inputs when the order is the identity (patch
    15): the split-and-concatenate in order is a copy of the same values, and its gradient the same
    identity."""
    def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                            probs: torch.Tensor | None = None, fused: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not fused and sorted_idxs.tolist() == list(range(len(sorted_idxs))):
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs, fused)

    return sort_chunks_by_idxs


@contextlib.contextmanager
def _cuda_type_names() -> Any:
    """Within the block, `t.type()` of a CPU tensor reads 'torch.cuda.<Type>' (patch 16)."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(original: Any) -> Any:
    """`original` run inside `_cuda_type_names` (patch 16)."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return original(*args, **kwargs)

    return wrapped


def _no_hook(*unused: Any) -> None:
    return None


def _deferred_main_grad_hook(original: Any) -> Any:
    """DDP's backward post-hook factory (patch 17): a no-op hook for an fp32 parameter whose grad DDP
    reduces after the backward (no overlap, no delayed wgrad), which `_fold_deferred_grads` then adds
    into `main_grad`; Megatron's hook otherwise."""
    def make_backward_post_hook(self: Any, param: torch.nn.Parameter) -> Any:
        cfg = self.ddp_config
        main_grad = getattr(param, "main_grad", None)
        if (cfg.overlap_grad_reduce or cfg.delay_wgrad_compute or param.dtype != torch.float32
                or main_grad is None or main_grad.dtype != torch.float32):
            return original(self, param)
        self.__dict__.setdefault("_hpcrl_deferred_grads", []).append(param)
        return _no_hook

    return make_backward_post_hook


def _fold_deferred_grads(self: Any) -> None:
    """What patch 17's no-op hooks left undone: `main_grad += grad` for every deferred parameter
    with a grad (one foreach kernel), then the grad freed -- Megatron's hook, for all at once."""
    params = [p for p in self.__dict__.get("_hpcrl_deferred_grads", ()) if p.grad is not None]
    added = [p for p in params if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False)]
    if added:
        torch._foreach_add_([p.main_grad for p in added], [p.grad.data for p in added])
    for p in params:
        p.grad = None


def _folding_deferred_grads(original: Any) -> Any:
    """DDP's start_grad_sync / finish_grad_sync, after `_fold_deferred_grads` (patch 17)."""
    def grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        _fold_deferred_grads(self)
        return original(self, *args, **kwargs)

    return grad_sync


def _reset_only_what_exists(original: Any) -> Any:
    """`reset_model_temporary_tensors` without its walk over every module when the config has
    neither of the two things it resets (patch 18)."""
    def reset_model_temporary_tensors(config: Any, model: Any) -> None:
        # Megatron's two conditions: `in` covers the type as a string and as a list of types
        if config.moe_router_enable_expert_bias or "global_aux_loss" in config.moe_router_load_balancing_type:
            original(config, model)

    return reset_model_temporary_tensors


def _local_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool,
                   *args: Any) -> tuple[torch.Tensor, None]:
    """`utils.local_multi_tensor_l2_norm` with foreach kernels instead of a norm per tensor and a
    Python float round trip (patch 8): the L2 norm of the per-tensor L2 norms, as a [1] tensor."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _apply_cpu_patches() -> None:
    cpu_torch = _CpuTorch()
    for name in _CPU_MODULES:
        importlib.import_module(name).torch = cpu_torch

    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import layers, mappings, random
    from megatron.core.transformer.moe import experts, moe_utils, router, shared_experts, token_dispatcher

    random._get_cuda_rng_state = _cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    layers.linear_with_grad_accumulation_and_async_allreduce = _linear_fast_path(
        layers.linear_with_grad_accumulation_and_async_allreduce)
    router.router_gating_linear = _router_linear_fast_path(router.router_gating_linear)
    experts.SequentialMLP.forward = _grouped_experts_fast_path(experts.SequentialMLP.forward)
    rope_utils._apply_rotary_pos_emb_bshd = _rope_without_pass_through(rope_utils._apply_rotary_pos_emb_bshd,
                                                                      rope_utils._rotate_half)
    token_dispatcher.sort_chunks_by_idxs = _sort_chunks_unless_in_order(moe_utils.sort_chunks_by_idxs)
    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_type_names(
        distrib_optimizer.DistributedOptimizer.__init__)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package
    # exports a function of the same name, so `from ... import` would give the function
    finalize.reset_model_temporary_tensors = _reset_only_what_exists(finalize.reset_model_temporary_tensors)
    ddp = distributed_data_parallel.DistributedDataParallel
    ddp._make_backward_post_hook = _deferred_main_grad_hook(ddp._make_backward_post_hook)
    ddp.start_grad_sync = _folding_deferred_grads(ddp.start_grad_sync)
    ddp.finish_grad_sync = _folding_deferred_grads(ddp.finish_grad_sync)
    bucket_group = param_and_grad_buffer._ParamAndGradBucketGroup
    bucket_group.start_grad_sync = _one_rank_grad_sync(bucket_group.start_grad_sync)
    for fn_name, group_first in (("copy_to_tensor_model_parallel_region", False),
                                 ("reduce_from_tensor_model_parallel_region", False),
                                 ("all_to_all", True)):
        original = getattr(mappings, fn_name)
        wrapper = _skip_single_rank_group(original, group_first)
        for module in (mappings, layers, moe_utils, token_dispatcher, shared_experts):
            if getattr(module, fn_name, None) is original:
                setattr(module, fn_name, wrapper)
    if clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":  # apex absent
        clip_grads.l2_norm_impl = _local_l2_norm
        original = clip_grads.get_grad_norm_fp32
        clip_grads.get_grad_norm_fp32 = optimizer.get_grad_norm_fp32 = _one_rank_grad_norm(original)


def unpatched(patched: Any, name: str) -> Any:
    """The Megatron function named `name` that the compat patch `patched` wraps (a cell of its
    closure), for tests and benchmarks that compare the two."""
    for cell in getattr(patched, "__closure__", None) or ():
        if getattr(cell.cell_contents, "__name__", "") == name:
            return cell.cell_contents
    raise LookupError(f"{patched!r} wraps no function named {name!r}: not a compat patch, or apply() not run")


def apply() -> None:
    """Install the patches this process needs (idempotent): the TE-less fix whenever
    transformer-engine is absent, the norm fix whenever apex is absent, the CPU patches when CUDA is
    unavailable.

    Raises RuntimeError when megatron-core is not version 0.16.1.
    """
    _check_version()
    if not _applied["router"]:
        _apply_router_fix()
        _applied["router"] = True
    if not _applied["te"] and not _have_transformer_engine():
        _apply_te_fix()
        _applied["te"] = True
    if not _applied["norm"] and not _have_apex():
        from megatron.core.transformer import torch_norm

        torch_norm.WrappedTorchNorm.__new__ = _torch_norm_new
        _applied["norm"] = True
    if not _applied["cpu"] and not torch.cuda.is_available():
        _apply_cpu_patches()
        _applied["cpu"] = True
