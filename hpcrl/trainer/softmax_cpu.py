"""Softmax over a short last dimension on the CPU, bit for bit torch's, in a fraction of its time.

torch's CPU softmax over the last dimension (aten/src/ATen/native/cpu/SoftMaxKernel.cpp,
`_vec_softmax_lastdim`) treats a row shorter than one SIMD vector (16 floats on AVX512, 8 on AVX2)
with partial-vector reductions that cost one vector operation per element: on the tiny model's
attention scores ([64, 4, 12, 12]) it takes ~0.8 ms where a vectorized pass over the same numbers
takes ~0.1 ms, and its backward ~0.6 ms. Per row that kernel computes, in float32:

    m = max(x);  e_j = vexp(x_j - m);  s = ((e_0 + e_1) + e_2) + ...;  y_j = e_j * (1 / s)
    backward: t = ((g_0 y_0 + g_1 y_1) + g_2 y_2) + ...;  dx_j = (g_j - t) * y_j

`softmax_lastdim` computes the same operations, in the same order, as whole-tensor ops: the sums
as a chain of column adds, and vexp (the SIMD exp, which differs from `torch.exp` in the last bit
for a few percent of inputs) taken from the one kernel that returns it bare: the log-softmax
backward over a dimension of two, where dx_0 = 0 - vexp(o_0) * (0 + -1) = vexp(o_0). The first
call for each row length checks its results against torch's on a probe; on a mismatch (another
CPU, another torch build) that length goes to torch's softmax for good. So a caller sees torch's
values whatever happens, faster where the check passed.
"""

from __future__ import annotations

from typing import Any

import torch

_VECTOR_FLOATS = {"AVX512": 16, "AVX2": 8}
"""Float lanes of torch's CPU kernels by capability (torch.backends.cpu.get_cpu_capability())."""

MIN_ELEMENTS = 8192
"""Smaller inputs go to torch: this path's ~10 + 2n tensor ops cost more than torch's rows there."""

_checked: dict[int, bool] = {}  # row length -> this module's results equal torch's
_buffers: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}  # _vexp_buffers by (lanes, mode)


def _vector_floats() -> int:
    return _VECTOR_FLOATS.get(torch.backends.cpu.get_cpu_capability(), 0)


def _vexp_buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [2, lanes] input and grad of the log-softmax backward that gives vexp, lanes >= n a
    whole number of vectors (a scalar tail would use the C library's exp); kept per size and per
    inference mode (a tensor made in it cannot be written outside it)."""
    key = (-(-n // 64) * 64, torch.is_inference_mode_enabled())
    if key not in _buffers:
        if len(_buffers) > 8:
            _buffers.clear()
        grad = torch.zeros(2, key[0])
        grad[1] = -1.0  # dx_0 = 0 - vexp(o_0) * (0 + -1) = vexp(o_0), exactly
        _buffers[key] = (torch.zeros(2, key[0]), grad)
    return _buffers[key]


def _forward(x: torch.Tensor) -> torch.Tensor:
    """Softmax of the rows of a contiguous float32 x, worked on columns: [n, rows] is contiguous."""
    n = x.shape[-1]
    rows_n = x.view(-1, n)
    out, grad = _vexp_buffers(x.numel())
    shifted_nR = out[0, : x.numel()].view(n, -1)
    torch.sub(rows_n.t(), rows_n.amax(-1).unsqueeze(0), out=shifted_nR)
    e_nR = torch._log_softmax_backward_data(grad, out, 0, x.dtype)[0, : x.numel()].view(n, -1)
    y = torch.empty_like(x)
    torch.mul(e_nR.t(), _row_sum(e_nR).reciprocal_().unsqueeze(1), out=y.view(-1, n))
    return y


def _backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    n = y.shape[-1]
    grad_rn, y_rn = grad.view(-1, n), y.view(-1, n)
    products_nR = y.new_empty(n, y_rn.shape[0])
    torch.mul(grad_rn.t(), y_rn.t(), out=products_nR)
    return (grad_rn - _row_sum(products_nR).unsqueeze(1)).mul_(y_rn).view(y.shape)


def _row_sum(x_nR: torch.Tensor) -> torch.Tensor:
    """((x[0] + x[1]) + x[2]) + ...: the kernel's order of a short row's sum (here a column's)."""
    total = x_nR[0] + x_nR[1]
    for j in range(2, x_nR.shape[0]):
        total.add_(x_nR[j])
    return total


class _SoftmaxLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = _forward(x.contiguous())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return _backward(grad.contiguous(), y)


def _matches_torch(n: int) -> bool:
    """Whether this module's forward and backward equal torch's, bit for bit, on rows of n."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(96, 3, n, generator=g) * 8
    x[::5, :, n // 2] = -10000.0  # a masked position (Megatron's mask value)
    grad = torch.randn(96, 3, n, generator=g)
    y = torch.softmax(x, -1)
    return (torch.equal(_forward(x), y)
            and torch.equal(_backward(grad, y), torch._softmax_backward_data(grad, y, -1, x.dtype)))


def fast_path(x: torch.Tensor) -> bool:
    """Whether `softmax_lastdim(x)` takes this module's path (else it is torch.softmax)."""
    n = x.shape[-1] if x.dim() else 0
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and 2 <= n < _vector_floats()
            and x.numel() >= MIN_ELEMENTS):
        return False
    if n not in _checked:
        _checked[n] = _matches_torch(n)
    return _checked[n]


def softmax_lastdim(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax(x, dim=-1), with its gradient, bit for bit; faster on float32 CPU rows shorter
    than a SIMD vector (see the module docstring)."""
    if not fast_path(x):
        return torch.softmax(x, dim=-1)
    return _SoftmaxLastDim.apply(x)


class SoftmaxLastDim(torch.nn.Module):
    """`torch.nn.Softmax(dim=-1)` through `softmax_lastdim`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax_lastdim(x)
