"""The busiest expert-parallel GPU under balanced routing: a first-principles floor on
``moe_imbalance``.

Even where every expert is equally likely (DeepSeek's profile with "absolutely balanced MoE
routing", SGLang's "simulated perfect EPLB": random experts following the group-limited routing),
a step's N tokens land on the ep GPUs by chance, and the step waits for the GPU that drew the
most. Each token puts X of its top_k copies on a given GPU; X's mean and variance follow from the
routing (below), the GPU's load is a sum of N independent X (mean N E[X], variance N Var[X]),
and the busiest of the ep GPUs expects ``mean + e_ep sd``, e_ep the expected maximum of ep
standard normals. The floor is that over the mean.

A GPU holds ``experts / ep`` of the experts. Without group limits a token's top_k experts are
a uniform draw without replacement, so X is hypergeometric. DeepSeek-V3's group-limited routing
(``moe_router_groups`` G groups, a token's experts drawn from its best ``moe_router_group_topk``
g of them) picks the groups first: a GPU inside one group (ep a multiple of G) sees a token with
probability g / G and then takes a hypergeometric share of the top_k among the g G-ths of the
experts the token's groups hold; a GPU holding h = G / ep whole groups sees j of them chosen,
j hypergeometric (G, g, h). The learned router's skew (some experts hotter than others) is on
top of this floor and is not in it: only a run's published per-GPU load gives it.
"""

from __future__ import annotations

import functools
import math

from aihpc.runspec.model import ModelSpec

__all__ = ["expected_max_std_normal", "routing_imbalance_floor", "tokens_per_gpu_moments"]


@functools.lru_cache(maxsize=256)
def expected_max_std_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx, by
    the trapezoid rule on [-10, 10] (0 for n = 1; 1/sqrt(pi) for n = 2)."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 8000, -10.0, 10.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * dx
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * pdf * cdf ** (n - 1)
    return total * dx


def _hypergeom_moments(population: float, marked: float, draws: int) -> tuple[float, float]:
    """(mean, E[X^2]) of the marked items among ``draws`` drawn without replacement."""
    if population <= 0 or marked <= 0:
        return 0.0, 0.0
    p = min(marked / population, 1.0)
    mean = draws * p
    fpc = (population - draws) / (population - 1) if population > 1 else 0.0
    var = draws * p * (1.0 - p) * max(fpc, 0.0)
    return mean, var + mean * mean


def _comb(n: int, k: int) -> int:
    return math.comb(n, k) if 0 <= k <= n else 0


def tokens_per_gpu_moments(model: ModelSpec, ep: int) -> tuple[float, float]:
    """(E[X], Var[X]) of the routed copies one token puts on one of ``ep`` GPUs under uniform
    routing (group-limited where the model has groups and the GPUs split them evenly)."""
    e, k = model.num_experts, model.moe_top_k
    local = e / ep
    groups, g = model.moe_router_groups, model.moe_router_group_topk
    if groups and g < groups and (ep % groups == 0 or groups % ep == 0):
        pool = e * g / groups  # experts of the token's chosen groups
        if ep % groups == 0:  # the GPU's experts lie in one group
            _, m2 = _hypergeom_moments(pool, local, k)
            second = (g / groups) * m2
        else:  # the GPU holds h whole groups, j of them chosen
            h = groups // ep
            second = 0.0
            for j in range(0, min(h, g) + 1):
                pj = _comb(g, j) * _comb(groups - g, h - j) / _comb(groups, h)
                _, m2 = _hypergeom_moments(pool, j * e / groups, k)
                second += pj * m2
    else:
        _, second = _hypergeom_moments(e, local, k)
    mean = k / ep
    return mean, max(second - mean * mean, 0.0)


def routing_imbalance_floor(model: ModelSpec, ep: int, tokens: float) -> float:
    """Busiest GPU's routed copies over the mean for ``tokens`` routed over ``ep`` GPUs with
    balanced experts (>= 1; 1 for one GPU or no tokens), capped where the busiest GPU would
    hold every copy a token can place on it."""
    if ep <= 1 or tokens <= 0 or not model.is_moe:
        return 1.0
    mean, var = tokens_per_gpu_moments(model, ep)
    if mean <= 0:
        return 1.0
    cv = math.sqrt(var / tokens) / mean  # sd over mean of one GPU's load
    cap = min(model.moe_top_k, math.ceil(model.num_experts / ep)) / mean
    return min(1.0 + expected_max_std_normal(ep) * cv, cap)
