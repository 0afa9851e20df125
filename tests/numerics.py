"""Tolerances for comparing two evaluations of the same arithmetic in another summation order (other
kernels, TP/EP/PP splits, micro-batches, thread counts, CPU kinds: AVX2 and AVX-512 pick other
vector widths), derived from the arithmetic instead of read off one machine's output.

A sum of n terms in floating point with unit roundoff u is off by at most gamma_n * sum|terms|, with
gamma_n = n * u / (1 - n * u) ~ n * u (Higham, "Accuracy and Stability of Numerical Algorithms",
sec. 3.1); two orders of the same sum differ by at most twice that. A quantity at the end of a chain
of `depth` such reductions, each passing its error on with a gain of at most 1 (normalised layers;
optimizer updates that are Lipschitz in the gradient), is off by at most 2 * n * u * depth * magnitude
to first order, where n is the longest reduction and `magnitude` stands for sum|terms| (the largest
value the quantity takes). Worst-case bounds are far above what rounding does in practice (which
grows like sqrt(n)), so they hold on every CPU kind; each test that uses one states its n, depth and
magnitude, and shows that a real error (a swapped expert, a wrong slice, a missing norm) exceeds it.
"""

from __future__ import annotations

U_FP32 = 2.0 ** -24
"""Unit roundoff of float32 (round to nearest, 24-bit significand)."""
U_BF16 = 2.0 ** -8
"""Unit roundoff of bfloat16 (8-bit significand)."""


def reordered(n: int, depth: int, magnitude: float, u: float = U_FP32) -> float:
    """First-order bound on |a - b| for a and b the same quantity computed through `depth` reductions
    of at most `n` terms each, in two summation orders, with sum|terms| ~ `magnitude`."""
    return 2 * n * u * depth * magnitude
