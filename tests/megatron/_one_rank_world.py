"""Checks of megatron_compat patches that need torch.distributed and Megatron's parallel state:
run as `python _one_rank_world.py NAME` in a fresh process (a one-rank gloo world); prints
`NAME OK` on success, raises otherwise."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for numerics
from numerics import reordered  # noqa: E402


def check_experts() -> None:
    """Patch 10: the grouped-GEMM experts give the per-expert loop's output and the same grads for
    the input, the routing probs and every expert weight, also with an expert that gets no token."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hpcrl.trainer import megatron_compat

    fast = SequentialMLP.forward
    original = megatron_compat.unpatched(fast, "forward")
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=8,
                               moe_ffn_hidden_size=8, num_moe_experts=3, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                               gradient_accumulation_fusion=False, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=3, moe_grouped_gemm=False)
    experts = spec.submodules.mlp.submodules.experts
    groups = ProcessGroupCollection.use_mpu_process_groups()
    mlp = experts.module(3, config, experts.submodules, pg_collection=groups)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x, probs = torch.randn(9, 16, generator=g), torch.rand(9, generator=g)
    for counts in ([4, 0, 5], [2, 3, 4]):
        per_expert = torch.tensor(counts)
        results = []
        for forward in (original, fast):
            mlp.zero_grad()
            xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
            out, bias = forward(mlp, xi, per_expert, pi)
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            results.append([out.detach(), xi.grad, pi.grad, *(p.grad.clone() for p in mlp.parameters())])
            assert bias is None
        # Other GEMM shapes sum in other orders. Each value ends at most 4 chained reductions (fc1,
        # fc2, and back through fc2 and fc1 for the input's grad; a weight's grad sums <= 9 tokens), none
        # longer than the hidden size 16: tests/numerics.py's bound with magnitude the tensor's max.
        for a, b in zip(*results):
            bound = reordered(16, 4, max(a.abs().max().item(), b.abs().max().item()))
            assert (a - b).abs().max().item() <= bound, ((a - b).abs().max().item(), bound)
    # one local expert: Megatron's own path
    one = experts.module(1, config, experts.submodules, pg_collection=groups)
    out, _ = fast(one, x, torch.tensor([9]), probs)
    assert out.shape == (9, 16)


def check_mappings() -> None:
    """Patch 9: with a one-rank group the TP mappings hand back their input and gradients flow
    through unchanged; the wrappers are installed where Megatron's layers look the names up.
    Patch 7's fallback: with a dgrad all-reduce to do, the TP linear runs Megatron's Function
    (which warns about CUDA_DEVICE_MAX_CONNECTIONS the first time)."""
    import warnings

    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    group = dist.new_group([0])
    x = torch.randn(4, 3, requires_grad=True)
    a = layers.copy_to_tensor_model_parallel_region(x, group=group)
    b = moe_utils.reduce_from_tensor_model_parallel_region(a * 2, group=group)
    c = token_dispatcher.all_to_all(group, b, [4], [4])
    c.sum().backward()
    assert a is x and torch.equal(c, x * 2) and torch.equal(x.grad, torch.full((4, 3), 2.0))
    mapped = mappings.reduce_from_tensor_model_parallel_region
    assert layers.reduce_from_tensor_model_parallel_region is mapped
    w = torch.randn(5, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, True, False,
                                                                     tp_group=group)
    assert any("async grad allreduce" in str(m.message) for m in caught), [str(m.message) for m in caught]
    assert torch.equal(y, x @ w.t())  # Megatron's Function computes torch.matmul(x, w.t()): the same op


def check_grad_norm() -> None:
    """Patch 11: on a one-rank group the grad norm is the original's value exactly, without its
    all-reduce; other norm types still go to Megatron's function (which all-reduces)."""
    from unittest import mock

    from megatron.core.optimizer import clip_grads, optimizer

    from hpcrl.trainer import megatron_compat

    assert optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32
    original = megatron_compat.unpatched(clip_grads.get_grad_norm_fp32, "get_grad_norm_fp32")
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(shape, generator=g) for shape in ((7, 3), (11,), (2, 5, 4))]
    group = dist.new_group([0])
    want = original(grads, 2, group)
    with mock.patch.object(dist, "all_reduce", side_effect=AssertionError("all_reduce on one rank")):
        got = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)
        assert clip_grads.get_grad_norm_fp32([], grad_stats_parallel_group=group) == 0.0
    # Against one norm over all 72 elements: sums of <= 72 terms, two chained (per tensor, then over
    # the tensors), in other orders; a norm's relative error is half its sum of squares'.
    flat = torch.cat([x.flatten() for x in grads])
    assert got == want and abs(got - float(flat.norm())) <= reordered(72, 2, got) / 2
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as reduce:
        l1 = clip_grads.get_grad_norm_fp32(grads, 1, group)
        assert abs(l1 - float(sum(x.abs().sum() for x in grads))) <= reordered(72, 2, l1)
    assert reduce.called


def _tiny_moe_gpt() -> tuple:
    """A one-layer, two-expert GPTModel's TransformerConfig (no dropout) and a builder of the model."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=8,
                               moe_ffn_hidden_size=8, num_moe_experts=2, moe_router_topk=2,
                               gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                               gradient_accumulation_fusion=False, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=2)
    return config, lambda: GPTModel(config, spec, vocab_size=32, max_sequence_length=8)


def check_grad_sync() -> None:
    """Patch 13: with one data-parallel rank, DDP's grad sync leaves the grad buffers exactly as
    Megatron's (an identity all-reduce) without calling the collective; a distributed optimizer still
    goes to Megatron's function."""
    from unittest import mock

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from hpcrl.trainer import megatron_compat

    patched = _ParamAndGradBucketGroup.start_grad_sync
    original = megatron_compat.unpatched(patched, "start_grad_sync")
    config, build = _tiny_moe_gpt()
    model = build()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ddp(tokens, torch.arange(8).expand(2, 8), None).float().square().mean().backward()
    megatron_compat._fold_deferred_grads(ddp)  # the grads into the buffers, as Megatron's hooks do (patch 17)
    before = [b.grad_data.clone() for b in ddp.buffers + ddp.expert_parallel_buffers]
    assert all(g.abs().sum() > 0 for g in before)
    for sync in (patched, original):
        with mock.patch.object(_ParamAndGradBucketGroup, "start_grad_sync", sync), \
                mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as reduce:
            ddp.finish_grad_sync()
        assert reduce.called == (sync is original), (sync, reduce.called)
        after = [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers]
        assert all(torch.equal(x, y) for x, y in zip(before, after))


def check_deferred_grads() -> None:
    """Patch 17: with no-op grad hooks and the deferred fold, DDP's fp32 grad buffers after three
    accumulated backward passes (micro-batches) are Megatron's hooks' buffers bit for bit, no
    param.grad is left, and overlapped reduction keeps Megatron's hook."""
    from unittest import mock

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from hpcrl.trainer import megatron_compat

    patched = DistributedDataParallel._make_backward_post_hook
    original = megatron_compat.unpatched(patched, "_make_backward_post_hook")
    config, build = _tiny_moe_gpt()
    tokens = torch.randint(0, 32, (3, 2, 8), generator=torch.Generator().manual_seed(1))
    init_model = build()
    init, num_params = init_model.state_dict(), len(list(init_model.parameters()))

    def buffers_after_backward(make_hook, overlap: bool = False) -> tuple[list[torch.Tensor], int]:
        model = build()
        model.load_state_dict(init)  # Megatron's init draws from its own RNG tracker, not torch's seed
        with mock.patch.object(DistributedDataParallel, "_make_backward_post_hook", make_hook):
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), model)
        ddp.zero_grad_buffer()
        for t in tokens:
            ddp(t, torch.arange(8).expand(2, 8), None).float().square().mean().backward()
        ddp.finish_grad_sync()
        assert all(p.grad is None for p in model.parameters()), "a grad was left outside main_grad"
        grads = [b.grad_data.clone() for b in ddp.buffers + ddp.expert_parallel_buffers]
        return grads, len(ddp.__dict__.get("_hpcrl_deferred_grads", ()))

    want, none = buffers_after_backward(original)
    got, deferred = buffers_after_backward(patched)
    assert none == 0 and deferred == num_params, (none, deferred, num_params)
    assert all(g.abs().sum() > 0 for g in want)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    _, overlapped = buffers_after_backward(patched, overlap=True)
    assert overlapped == 0, "overlapped grad reduction must keep Megatron's hook"
    assert megatron_compat._no_hook() is None


if __name__ == "__main__":
    from hpcrl.trainer import megatron_compat

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    megatron_compat.apply()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    name = sys.argv[1]
    {"mappings": check_mappings, "experts": check_experts, "grad_norm": check_grad_norm,
     "grad_sync": check_grad_sync, "deferred_grads": check_deferred_grads}[name]()
    print(f"{name} OK", flush=True)
    # As hpcrl's workers do (worker_main.finalize_and_exit): skip interpreter teardown, where a gloo
    # run-loop thread that still holds a Python thread state aborts the process (exit -6, seen in CI).
    sys.stderr.flush()
    os._exit(0)
