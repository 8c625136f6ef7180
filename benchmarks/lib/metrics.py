"""Statistics the suites report: medians and seeded bootstrap intervals (shares, paired ratios)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

__all__ = ["bootstrap_ci", "median", "paired_ratio_ci", "share_ci"]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def bootstrap_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its percentile-bootstrap confidence interval.

    Seeded, so a table regenerates identically. One value gives a zero-width interval; none
    gives NaNs.
    """
    if not values:
        return float("nan"), float("nan"), float("nan")
    data = torch.tensor(list(values), dtype=torch.float64)
    mean = float(data.mean())
    if data.numel() == 1:
        return mean, mean, mean
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, data.numel(), (resamples, data.numel()), generator=g)
    means = data[picks].mean(dim=1)
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return mean, float(lo), float(hi)


def share_ci(values: Sequence[float], *, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of per-example shares in [0, 1] (recall, EM, F1, accuracy).

    The percentile bootstrap, except where every example scored 1 (or every one 0): there the
    bootstrap interval has zero width and would claim a certainty n examples cannot give, so the
    exact binomial (Clopper–Pearson) interval of n successes in n trials is returned instead:
    [(α/2)^(1/n), 1] (0.87 for 27 of 27, 0.69 for 10 of 10), mirrored for all zeros.
    """
    n = len(values)
    if n > 1 and all(v == 1.0 for v in values):
        return 1.0, ((1.0 - level) / 2) ** (1.0 / n), 1.0
    if n > 1 and all(v == 0.0 for v in values):
        return 0.0, 0.0, 1.0 - ((1.0 - level) / 2) ** (1.0 / n)
    return bootstrap_ci(values, level=level, seed=seed)  # no resampling where its answer is replaced


def paired_ratio_ci(
    values: Sequence[float],
    reference: Sequence[float],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    shares: bool = False,
) -> tuple[float | None, float, float]:
    """(ratio, low, high): mean(values) / mean(reference) over the same examples, with a paired
    percentile-bootstrap interval (examples resampled together). None when the reference is 0.

    ``shares``: the values are per-example shares in [0, 1] (F1, accuracy). Where every value
    equals its reference, or every value is 0, every resample gives the same ratio and the
    bootstrap interval has zero width; as in ``share_ci``, the exact binomial bound takes its
    place: at most p = 1 - (α/2)^(1/n) of the examples may differ (0 of n seen), each by at most 1,
    so the ratio moves by at most p / mean(reference) (the needle's 30 of 30: 1.00 [0.88, 1.12]).
    """
    if not values or len(values) != len(reference):
        return None, float("nan"), float("nan")
    a = torch.tensor(list(values), dtype=torch.float64)
    b = torch.tensor(list(reference), dtype=torch.float64)
    if float(b.sum()) == 0.0:
        return None, float("nan"), float("nan")
    ratio = float(a.sum() / b.sum())
    if shares and a.numel() > 1 and (bool(torch.equal(a, b)) or not bool(a.any())):
        reach = (1.0 - ((1.0 - level) / 2) ** (1.0 / a.numel())) / float(b.mean())
        return ratio, max(ratio - reach, 0.0), ratio + reach
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, a.numel(), (resamples, a.numel()), generator=g)
    num, den = a[picks].sum(dim=1), b[picks].sum(dim=1)
    ratios = (num / den)[den > 0]
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return ratio, float(lo), float(hi)
