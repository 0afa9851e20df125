"""hpcrl.trainer.megatron_compat: version pin, idempotence and the CPU patches' behaviour."""

from __future__ import annotations

import pytest
import torch
from numerics import reordered

from hpcrl.trainer import megatron_compat

pytestmark = pytest.mark.megatron


def test_refuses_other_megatron_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"0\.17\.0 is installed; install megatron-core==0\.16\.1"):
        megatron_compat.apply()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_apply_is_idempotent_and_patches_cpu_call_sites() -> None:
    megatron_compat.apply()
    megatron_compat.apply()
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert moe_utils.te_general_gemm is None
    # device="cuda" factories inside patched modules allocate on the CPU; torch.cuda is a stand-in
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == "cpu"
    assert schedules.torch.Tensor is torch.Tensor and torch.cuda.current_device is not None
    # the alltoall split sizes become numpy
    assert token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True).tolist() == [1, 2]
    # sequence-parallel torch norm is allowed and tagged for the TP grad all-reduce
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = torch_norm.WrappedTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_cpu_grad_clipping_scales_in_place() -> None:
    megatron_compat.apply()
    from megatron.core.optimizer import clip_grads, optimizer

    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([p, q], max_norm=1.0, total_norm=5.0)
    # Megatron's coefficient max_norm / (total_norm + 1e-6), one fp32 multiply per element: these bits
    coeff = 1.0 / (5.0 + 1.0e-6)
    assert torch.equal(p.grad, torch.tensor([3.0, 0.0, 0.0]) * coeff)
    assert torch.equal(q.grad, torch.tensor([0.0, 4.0]) * coeff)
    clipped = q.grad.clone()
    clip_grads.clip_grad_by_total_norm_fp32([p, q], max_norm=10.0, total_norm=1.0)  # no-op below the max
    assert torch.equal(q.grad, clipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU patch")
def test_first_import_leaves_jit_fuser_plain_and_skips_inductor() -> None:
    """Patch 6, in a fresh process (this one may have imported Megatron already): after apply(),
    Megatron's jit_fuser is a plain decorator, torch.compile is the real one again, and neither
    dynamo's nor inductor's compiler was imported."""
    code = (
        "import sys, torch; real = torch.compile\n"
        "from hpcrl.trainer import megatron_compat; megatron_compat.apply()\n"
        "from megatron.core import jit\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "f = lambda x: x + 1\n"
        "print(torch.compile is real, jit.jit_fuser(f) is f, 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    assert fresh_process(code)[-3:] == ["True", "True", "False"]


def test_the_norm_fix_applies_on_a_gpu_without_apex() -> None:
    """hpcrl's GPU install has neither transformer-engine nor apex, so the local spec builds every norm
    as WrappedTorchNorm there too, and its sequence-parallel assert would stop any trainer.tp > 1 model.
    In a fresh process that reports CUDA (no CPU patches), apply() still installs the norm fix: a
    sequence-parallel RMSNorm is built and tagged for the TP grad all-reduce."""
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "from hpcrl.trainer import megatron_compat; megatron_compat.apply()\n"
        "assert not megatron_compat._applied['cpu']\n"
        "from megatron.core.models.gpt import gpt_layer_specs\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "assert not gpt_layer_specs.HAVE_APEX\n"
        "config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization='RMSNorm',\n"
        "                           tensor_model_parallel_size=2, sequence_parallel=True)\n"
        "norm = gpt_layer_specs.LNImpl(config, 8, eps=1e-6)\n"
        "print(type(norm).__name__, all(p.sequence_parallel for p in norm.parameters()))\n"
    )
    assert fresh_process(code)[-2:] == ["RMSNorm", "True"]


def fresh_process(code: str) -> list[str]:
    """The words `python -c code` prints, in a process of its own (this one may have imported and
    patched Megatron already); it must exit 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _values_and_grads(fn, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """fn(*tensors), then the gradients of a fixed weighted sum of it w.r.t. every tensor."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    (out * _weights(out)).sum().backward()
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _weights(out: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, out.numel()).reshape(out.shape)


def _linear_bounds(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> list[float]:
    """How far two kernels may put y = x w^T + b, dL/dx and dL/dw (the gradients of _values_and_grads)
    apart: each element is one sum, of in-features (+ bias), out-features and rows terms, so
    reordered(n, 1, sum|terms|) with sum|terms| taken exactly from |x|, |w|, |b| and the loss weights."""
    x2, g = x.reshape(-1, x.shape[-1]).abs(), _weights(torch.empty(*x.shape[:-1], w.shape[0])).abs()
    g = g.reshape(-1, w.shape[0])
    terms_y = (x2 @ w.abs().t() + (0 if b is None else b.abs())).max().item()
    return [reordered(x.shape[-1] + 1, 1, terms_y), reordered(w.shape[0], 1, (g @ w.abs()).max().item()),
            reordered(x2.shape[0], 1, (g.t() @ x2).max().item())]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_linear_fast_paths_give_the_custom_functions_values_and_grads() -> None:
    """Patch 7: the F.linear fast paths agree with Megatron's custom autograd Functions (the
    fallback to the Function is checked in the one-rank world test below)."""
    megatron_compat.apply()
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils, router

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    fast = layers.linear_with_grad_accumulation_and_async_allreduce
    function = layers.LinearWithGradAccumulationAndAsyncCommunication.apply
    for bias in (b, None):
        args = (False, False, False, None, 0, None)
        want = _values_and_grads(lambda x, w: function(x, w, bias, *args), x, w)
        got = _values_and_grads(lambda x, w: fast(x, w, bias, False, False, False), x, w)
        for a, c, bound in zip(got, want, _linear_bounds(x, w, bias)):
            torch.testing.assert_close(a, c, rtol=0, atol=bound)

    assert router.router_gating_linear is not moe_utils.router_gating_linear
    want = _values_and_grads(lambda x, w: moe_utils.router_gating_linear(x, w, None, torch.float32), x, w)
    got = _values_and_grads(lambda x, w: router.router_gating_linear(x, w, None, torch.float32), x, w)
    for a, c, bound in zip(got, want, _linear_bounds(x, w, None)):
        torch.testing.assert_close(a, c, rtol=0, atol=bound)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_foreach_grad_norm_matches_megatrons_local_norm() -> None:
    """Patch 8: the grad norm (without apex) is the same number as Megatron's per-tensor loop."""
    megatron_compat.apply()
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=g) * s for n, s in ((7, 1.0), (64, 0.01), (3, 100.0))]
    want, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    got, _ = clip_grads.l2_norm_impl(0, None, [grads], False)
    assert clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
    # Two chained sums of squares (per tensor, <= 64 terms; then over the tensors) in other orders; a
    # norm's relative error is half its sum of squares'.
    assert got.shape == (1,) and (got - want).abs().item() <= reordered(64, 2, want.item()) / 2
    assert clip_grads.l2_norm_impl(0, None, [[]], False)[0].tolist() == [0.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU patches")
@pytest.mark.parametrize("name", ["mappings", "experts", "grad_norm", "grad_sync", "deferred_grads"])
def test_one_rank_world_checks(name: str) -> None:
    """Patches 9, 10, 11, 13 and 17 and patch 7's fallback, checked in a fresh one-rank gloo world
    (tests/megatron/_one_rank_world.py says what each check asserts)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_one_rank_world.py")
    out = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"{name} OK", out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_rope_without_pass_through_gives_megatrons_values_and_grads() -> None:
    """Patch 12: full-head RoPE without the final copy is Megatron's result bit for bit (plain and
    interleaved, with mscale); partial rotary and MLA still go through Megatron's function."""
    megatron_compat.apply()
    from megatron.core.models.common.embeddings import rope_utils

    fast = rope_utils._apply_rotary_pos_emb_bshd
    original = megatron_compat.unpatched(fast, "_apply_rotary_pos_emb_bshd")
    g = torch.Generator().manual_seed(2)
    t, freqs = torch.randn(6, 3, 2, 8, generator=g), torch.randn(6, 1, 1, 8, generator=g)
    for interleaved, mscale in ((False, 1.0), (True, 0.7)):
        want = _values_and_grads(lambda t, f: original(t, f, interleaved, False, mscale), t, freqs)
        got = _values_and_grads(lambda t, f: fast(t, f, interleaved, False, mscale), t, freqs)
        assert all(torch.equal(a, c) for a, c in zip(got, want))
    for args in ((t, freqs[..., :4]), (t, freqs, False, True)):  # partial rotary; MLA
        assert torch.equal(fast(*args), original(*args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_attention_and_router_softmax_go_through_softmax_cpu() -> None:
    """Patch 14: Megatron's unfused attention softmax (scale, causal mask, softmax) and the router's
    `torch.softmax` calls reach hpcrl.trainer.softmax_cpu, with torch's values and grads."""
    megatron_compat.apply()
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.utils import attention_mask_func

    from hpcrl.trainer import softmax_cpu

    assert moe_utils.torch.softmax is megatron_compat._softmax
    assert isinstance(fused_softmax.torch.nn.Softmax(dim=-1), softmax_cpu.SoftmaxLastDim)
    assert type(fused_softmax.torch.nn.Softmax(dim=1)) is torch.nn.Softmax
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False, mask_func=attention_mask_func, softmax_in_fp32=True, scale=0.25)
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(64, 4, 12, 12, generator=g)

    def unpatched(x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)
        return torch.softmax((x * 0.25).masked_fill(causal, -10000.0), dim=-1)

    got = _values_and_grads(lambda x: softmax(x, None), scores)
    want = _values_and_grads(unpatched, scores)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    logits = torch.randn(3000, 4, generator=g)
    routed = moe_utils.torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(routed, torch.softmax(logits, -1))
    assert torch.equal(moe_utils.torch.softmax(logits, 0), torch.softmax(logits, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_sort_chunks_in_identity_order_returns_its_inputs() -> None:
    """Patch 15: the dispatcher's sort by local expert is skipped when the order is the identity
    (one EP x TP rank) and is Megatron's otherwise, values and grads."""
    megatron_compat.apply()
    from megatron.core.transformer.moe import token_dispatcher

    fast = token_dispatcher.sort_chunks_by_idxs
    original = megatron_compat.unpatched(fast, "sort_chunks_by_idxs")
    assert original is not fast
    g = torch.Generator().manual_seed(5)
    tokens, probs = torch.randn(10, 4, generator=g), torch.rand(10, generator=g)
    sizes = torch.tensor([3, 0, 5, 2])
    out, out_probs = fast(tokens, sizes, torch.arange(4), probs=probs)
    assert out is tokens and out_probs is probs
    def flat(sort):  # tokens and probs of one sort, as one tensor
        return lambda t, p: torch.cat([piece.flatten() for piece in sort(t, sizes, order, probs=p)])

    for order in (torch.tensor([2, 0, 3, 1]), torch.tensor([0, 2, 1, 3])):
        got = _values_and_grads(flat(fast), tokens, probs)
        assert all(torch.equal(a, b) for a, b in zip(got, _values_and_grads(flat(original), tokens, probs)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patches")
def test_reset_of_temporary_tensors_walks_the_model_only_when_there_is_something_to_reset() -> None:
    """Patch 18: without expert bias and a global aux loss the per-step reset does not walk the
    model's modules; with either, it resets what Megatron's function resets."""
    import importlib
    from types import SimpleNamespace

    megatron_compat.apply()
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    fast = finalize.reset_model_temporary_tensors
    assert fast.__closure__ is not None and fast.__name__ == "reset_model_temporary_tensors"

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expert_bias = torch.zeros(4)
            self.local_tokens_per_expert = torch.ones(4)
            self.tracker_resets = 0

        def reset_global_aux_loss_tracker(self) -> None:
            self.tracker_resets += 1

    for bias, balancing, walks in ((False, "aux_loss", False), (False, "seq_aux_loss", False),
                                   (True, "aux_loss", True), (False, "global_aux_loss", True),
                                   (False, ["aux_loss", "global_aux_loss"], True)):
        router = Router()
        model = torch.nn.Sequential(router)
        walked = []
        model.modules = lambda m=model: walked.append(1) or torch.nn.Module.modules(m)
        config = SimpleNamespace(moe_router_enable_expert_bias=bias, moe_router_load_balancing_type=balancing)
        fast(config, [model])
        assert bool(walked) == walks, (bias, balancing)
        assert router.local_tokens_per_expert.sum() == (0 if bias else 4)
        assert router.tracker_resets == (1 if "global_aux_loss" in balancing else 0)


def test_unpatched_names_what_it_cannot_find():
    def plain():
        return None

    for not_a_patch in (plain, len):
        with pytest.raises(LookupError, match="wraps no function named 'forward'"):
            megatron_compat.unpatched(not_a_patch, "forward")
