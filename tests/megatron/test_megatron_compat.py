"""hpcrl.trainer.megatron_compat: version pin, idempotence and the CPU patches' behaviour."""

from __future__ import annotations

import pytest
import torch

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
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.0, 0.0]))
    assert torch.allclose(q.grad, torch.tensor([0.0, 0.8]))
    clip_grads.clip_grad_by_total_norm_fp32([p, q], max_norm=10.0, total_norm=1.0)  # no-op below the max
    assert torch.allclose(q.grad, torch.tensor([0.0, 0.8]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU patch")
def test_first_import_leaves_jit_fuser_plain_and_skips_inductor() -> None:
    """Patch 6, in a fresh process (this one may have imported Megatron already): after apply(),
    Megatron's jit_fuser is a plain decorator, torch.compile is the real one again, and neither
    dynamo's nor inductor's compiler was imported."""
    import subprocess
    import sys

    code = (
        "import sys, torch; real = torch.compile\n"
        "from hpcrl.trainer import megatron_compat; megatron_compat.apply()\n"
        "from megatron.core import jit\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "f = lambda x: x + 1\n"
        "print(torch.compile is real, jit.jit_fuser(f) is f, 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["True", "True", "False"], out.stdout
