"""Tolerances that follow the values' scale and the summation order.

Two runs that sum the same ``terms`` numbers in different orders (a batch split into other
micro-batches, a gradient all-reduced over ranks, a matmul blocked differently) round
differently. Recursive summation of n terms is within (n - 1) unit roundoffs of the exact sum,
relative to the sum of the terms' magnitudes, whatever the order; two orders, twice that. The
terms are of the size of the tensor's largest values, so an element that nearly cancels carries
an absolute error of that size, not one relative to itself: the bound is absolute, at the
tensor's scale.
"""

from __future__ import annotations

import math

import torch


def ulp(value: float, dtype: torch.dtype = torch.float32) -> float:
    """Spacing of ``dtype`` numbers at ``|value|`` (one unit in the last place)."""
    info = torch.finfo(dtype)
    _, exponent = math.frexp(max(abs(value), info.tiny))  # |value| = m 2^exponent, m in [.5, 1)
    return math.ldexp(info.eps, exponent - 1)


def summation_atol(ref: torch.Tensor, terms: int) -> float:
    """Absolute tolerance between two results of ``ref``'s dtype that sum ``terms`` terms in
    different orders: 2 (terms - 1) ulp at ``ref``'s largest magnitude."""
    return 2 * (terms - 1) * ulp(float(ref.abs().max()), ref.dtype)
