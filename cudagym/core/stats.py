"""The median's confidence interval, distribution-free: what a timed loop's length is judged by
(`cudagym.sandbox.feed.CallFeed`, `TimingConfig.stop`) and what `TimingStats` reports beside the
median.

For n independent calls, the k-th smallest and the k-th largest time bracket the true median
with probability 1 - 2 P(B <= k - 1), B ~ Binomial(n, 1/2), whatever the times' distribution
(the sign test's interval); k is the largest rank that keeps that probability at least the
confidence asked for. No normal approximation: call times are skewed (a slow tail of late
launches and interrupts), and the interval of the order statistics does not care.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def median_ci_ranks(n: int, confidence: float = 0.95) -> tuple[int, int] | None:
    """0-based indices (lo, hi) into n sorted samples of the distribution-free `confidence`
    interval of the median; None when n samples are too few for it (n < 6 at 95%)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    alpha = 1.0 - confidence
    half = math.log(0.5) * n
    tail, k = 0.0, 0  # tail: P(B <= k - 1); k: the rank of the lower end, 1-based
    while k < n:
        # P(B = k), through logs: 2^-n underflows beyond n ~ 1074
        p = math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + half)
        if 2.0 * (tail + p) > alpha:
            break
        tail += p
        k += 1
    if k == 0:
        return None
    return k - 1, n - k


def median_ci(sorted_samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """(low, high): the distribution-free `confidence` interval of the median of `sorted_samples`
    (sorted ascending); None for too few samples."""
    ranks = median_ci_ranks(len(sorted_samples), confidence)
    if ranks is None:
        return None
    return sorted_samples[ranks[0]], sorted_samples[ranks[1]]


def median_ci_rel(sorted_samples: Sequence[float], median: float, confidence: float = 0.95) -> float | None:
    """The interval's farther end from `median`, relative to it (0.005: within 0.5%); None for too
    few samples, inf for a median of 0 with an interval of any width."""
    ci = median_ci(sorted_samples, confidence)
    if ci is None:
        return None
    half = max(median - ci[0], ci[1] - median)
    if median <= 0:
        return 0.0 if half <= 0 else math.inf
    return half / median
