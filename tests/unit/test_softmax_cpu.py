"""hpcrl.trainer.softmax_cpu: torch's softmax over a short last dim, values and gradients bit for
bit, on the fast path where the CPU allows it and through torch everywhere else."""

from __future__ import annotations

import pytest
import torch

from hpcrl.trainer import softmax_cpu
from hpcrl.trainer.softmax_cpu import softmax_lastdim

SIMD = softmax_cpu._vector_floats()
needs_simd = pytest.mark.skipif(SIMD == 0, reason=f"CPU capability {torch.backends.cpu.get_cpu_capability()} "
                                                  "has no fast path (AVX2 / AVX512 only)")


def _values_and_grad(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("n", range(1, 20))
@pytest.mark.parametrize("shape", [(64, 4, 12), (3000,), (5, 7)])
def test_values_and_grads_are_torchs_bit_for_bit(n: int, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(*shape, n, generator=g) * 6
    x[..., n // 2][::3] = -10000.0  # Megatron's masked scores
    grad = torch.randn(*shape, n, generator=g)
    got = _values_and_grad(softmax_lastdim, x, grad)
    want = _values_and_grad(lambda t: torch.softmax(t, -1), x, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_simd
def test_the_attention_scores_of_the_tiny_model_take_the_fast_path() -> None:
    """The shape that motivated it ([batch, heads, seq, seq] with seq < one vector) is not handed
    to torch: otherwise the test above would prove nothing about this module's arithmetic."""
    n = min(12, SIMD - 1)
    assert softmax_cpu.fast_path(torch.zeros(64, 4, n, n))
    for x in (torch.zeros(64, 4, 12, SIMD), torch.zeros(4, n), torch.zeros(64, 4, n, n, dtype=torch.float64)):
        assert not softmax_cpu.fast_path(x)  # a whole vector per row; too small; not float32


def test_non_contiguous_input_and_grad() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, 4, 12, generator=g).transpose(0, 1)  # [64, 12, 4, 12], not contiguous
    grad = torch.randn(64, 4, 12, 12, generator=g).transpose(1, 2)
    got = _values_and_grad(softmax_lastdim, x, grad)
    want = _values_and_grad(lambda t: torch.softmax(t, -1), x, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_simd
def test_a_row_length_that_fails_the_probe_goes_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this module's arithmetic differed from torch's (another build, another CPU), the probe of
    the first call refuses that row length for good, and callers still get torch's values."""
    monkeypatch.setattr(softmax_cpu, "_checked", {})
    monkeypatch.setattr(softmax_cpu, "_forward", lambda x: torch.exp(x - x.amax(-1, keepdim=True))
                        / torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True))
    x = torch.randn(64, 4, 6, 6)
    assert not softmax_cpu.fast_path(x) and softmax_cpu._checked == {6: False}
    assert torch.equal(softmax_lastdim(x), torch.softmax(x, -1))


def test_inference_mode_and_grad_mode_alternate() -> None:
    """The path's scratch buffers made under torch.inference_mode are not written outside it."""
    x = torch.randn(64, 4, 12, 12)
    for _ in range(2):
        with torch.inference_mode():
            assert torch.equal(softmax_lastdim(x), torch.softmax(x, -1))
        assert torch.equal(softmax_lastdim(x), torch.softmax(x, -1))
