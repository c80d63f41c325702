"""The imbalance images bring: distributions of a cost (encoder seconds, tokens) on a uniform
grid, their sums over samples and micro-batches, and the expected maximum over ranks.

A data-parallel step ends when its slowest rank does, so what the step waits for is the
*expected maximum* over the D ranks of each rank's sum of per-sample costs, not the mean. For
a sum S with CDF F on grid points x_i, the maximum of D independent copies has CDF F^D, so

    E[max] = sum_i x_i (F(x_i)^D - F(x_{i-1})^D),

exactly, for the discretised distribution (order statistics of the sum, not a normal
approximation; for many samples the sum tends to a normal and E[max] to mean + sigma * E[max of
D standard normals], which the tests check against). Sums of n samples are built by repeated
doubling of the convolution (log2 n convolutions), the grid coarsened two cells into one
whenever it grows past ``BINS`` cells, which keeps the mean exactly and the spread to within a
cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aihpc.runspec.vision import Distribution

__all__ = ["BINS", "Grid", "compound", "expected_max", "expected_order_stat", "max_of"]

BINS = 2048  # cells a distribution keeps; past it two cells merge into one


@dataclass(frozen=True)
class Grid:
    """P(X = lo + step * i) = p[i]."""

    lo: float
    step: float
    p: np.ndarray

    @staticmethod
    def point(value: float) -> Grid:
        return Grid(float(value), 1.0, np.ones(1))

    @staticmethod
    def of(
        values: list[float] | tuple[float, ...],
        weights: list[float] | tuple[float, ...],
        cells: int = 512,
    ) -> Grid:
        """A discrete distribution put on a grid of ``cells`` cells spanning its values; each
        value's weight is split between its two neighbouring points so that the mean is
        kept exactly."""
        v = np.asarray(values, dtype=float)
        w = np.asarray(weights, dtype=float)
        w = w / w.sum()
        lo, hi = float(v.min()), float(v.max())
        if hi - lo <= 1e-12 * max(1.0, abs(hi)):
            return Grid(float((v * w).sum()), 1.0, np.ones(1))
        step = (hi - lo) / (cells - 1)
        pos = (v - lo) / step
        i = np.minimum(np.floor(pos).astype(int), cells - 2)
        frac = pos - i
        p = np.zeros(cells)
        np.add.at(p, i, w * (1 - frac))
        np.add.at(p, i + 1, w * frac)
        return Grid(lo, step, p)

    @staticmethod
    def of_dist(d: Distribution, cells: int = 512) -> Grid:
        return Grid.of(d.values, d.weights, cells)

    @property
    def values(self) -> np.ndarray:
        return self.lo + self.step * np.arange(len(self.p))

    @property
    def mean(self) -> float:
        return float((self.values * self.p).sum())

    @property
    def std(self) -> float:
        m = self.mean
        return float(np.sqrt(max(0.0, ((self.values - m) ** 2 * self.p).sum())))

    def quantile(self, q: float) -> float:
        cdf = np.cumsum(self.p)
        return float(self.values[min(len(cdf) - 1, int(np.searchsorted(cdf, q - 1e-12)))])

    def map(self, f) -> Grid:  # type: ignore[no-untyped-def]
        """The distribution of f(X), on a fresh grid."""
        return Grid.of(list(f(self.values)), list(self.p), max(2, len(self.p)))

    def coarsen(self) -> Grid:
        """Two cells into one, at the pair's weighted position split to keep the mean."""
        p = self.p if len(self.p) % 2 == 0 else np.append(self.p, 0.0)
        return Grid.of(list(self.lo + self.step * np.arange(len(p))), list(p), cells=len(p) // 2)

    def fit(self, step: float) -> Grid:
        """Coarsened until its step is at least ``step``."""
        g = self
        while g.step < step * (1 - 1e-9) and len(g.p) > 1:
            g = g.coarsen()
        return g

    def add(self, other: Grid) -> Grid:
        """The distribution of X + Y for independent X (self) and Y (other)."""
        if len(self.p) == 1:
            return Grid(other.lo + self.lo, other.step, other.p)
        if len(other.p) == 1:
            return Grid(self.lo + other.lo, self.step, self.p)
        a, b = self, other
        step = max(a.step, b.step)
        a, b = _on_step(a, step), _on_step(b, step)
        p = np.convolve(a.p, b.p)
        out = Grid(a.lo + b.lo, step, p / p.sum())
        while len(out.p) > BINS:
            out = out.coarsen()
        return out

    def times(self, n: int) -> Grid:
        """The sum of ``n`` independent copies (n >= 0), by doubling."""
        out = Grid.point(0.0)
        base = self
        while n:
            if n & 1:
                out = out.add(base)
            n >>= 1
            if n:
                base = base.add(base)
        return out


def _on_step(g: Grid, step: float) -> Grid:
    """``g`` re-gridded onto points ``step`` apart (step >= g.step), mean kept."""
    if abs(g.step - step) <= 1e-12 * step:
        return g
    cells = max(2, int(np.ceil((len(g.p) - 1) * g.step / step)) + 1)
    hi = g.lo + step * (cells - 1)
    vals = np.append(g.values, hi)  # pins the grid's span to whole steps
    return Grid.of(list(vals), list(np.append(g.p, 0.0)), cells)


def compound(count: Distribution, item: Grid) -> Grid:
    """The sum of K independent items, K drawn from ``count`` (whole numbers >= 0): the
    mixture over k of the k-fold sums, each weighted by P(K = k)."""
    values: list[float] = []
    weights: list[float] = []
    cells = 2
    for k, w in zip(count.values, count.weights, strict=True):
        if w <= 0:
            continue
        part = item.times(int(k))
        values += list(part.values)
        weights += list(part.p / part.p.sum() * w)
        cells = max(cells, len(part.p))
    return Grid.of(values, weights, min(BINS, cells))


def expected_max(g: Grid, ranks: int) -> float:
    """E[max of ``ranks`` independent draws] of the (normalised) distribution ``g``."""
    p = g.p / g.p.sum()
    if ranks <= 1 or len(p) == 1:
        return float((g.values * p).sum())
    cdf = np.minimum(1.0, np.cumsum(p))
    fd = cdf**ranks
    pm = np.diff(np.concatenate(([0.0], fd)))
    return float((g.values * pm).sum())


def max_of(g: Grid, n: int) -> Grid:
    """The distribution of the largest of ``n`` independent draws of ``g`` (CDF F^n)."""
    p = g.p / g.p.sum()
    if n <= 1 or len(p) == 1:
        return Grid(g.lo, g.step, p)
    fd = np.minimum(1.0, np.cumsum(p)) ** n
    return Grid(g.lo, g.step, np.diff(np.concatenate(([0.0], fd))))


def expected_order_stat(g: Grid, n: int, j: int) -> float:
    """E[the ``j``-th largest of ``n`` independent draws] of ``g`` (j = 1: the maximum).

    X_(j) <= x exactly when fewer than j of the n draws exceed x, so with q = 1 - F(x)
    P(X_(j) <= x) = P(Binomial(n, q) <= j - 1), summed here term by term in logs."""
    if not 1 <= j <= n:
        raise ValueError(f"order statistic j={j} outside 1..{n}")
    p = g.p / g.p.sum()
    if len(p) == 1:
        return float(g.values[0])
    cdf = np.clip(np.cumsum(p), 0.0, 1.0)
    q = np.clip(1.0 - cdf, 1e-300, 1.0)
    keep = np.clip(cdf, 1e-300, 1.0)
    i = np.arange(j, dtype=float)[:, None]
    log_comb = np.array(
        [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(j)]
    )
    terms = log_comb[:, None] + i * np.log(q)[None, :] + (n - i) * np.log(keep)[None, :]
    below = np.minimum(1.0, np.exp(terms).sum(axis=0))
    below[cdf >= 1.0 - 1e-15] = 1.0
    pm = np.diff(np.concatenate(([0.0], np.maximum.accumulate(below))))
    return float((g.values * pm).sum())
