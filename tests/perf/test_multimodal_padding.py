"""Unpacked vision-language batches (issue 40): the padded length a step waits for. Each term is
checked against what it claims to count: the order statistics against exact enumeration, the
slowest rank's padding against a simulation of the batches (LLaVA's length-grouped sampler
re-enacted from its description, plain random batches), and the estimate against both."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from aihpc.perf.multimodal import estimate_vlm
from aihpc.perf.multimodal.imbalance import Grid, expected_max, expected_order_stat, max_of
from aihpc.perf.multimodal.workload import padded_length, sample_lengths
from aihpc.runspec import runspec_from_dict

# A small length distribution on whole cells, so the grid holds it exactly.
VALUES = np.array([100.0, 300.0, 700.0, 1500.0])
WEIGHTS = np.array([0.45, 0.33, 0.2, 0.02])  # the longest rare: no sure maximum


def _grid() -> Grid:
    return Grid(100.0, 200.0, np.array([0.45, 0.33, 0.0, 0.2, 0.0, 0.0, 0.0, 0.02]))


def test_order_statistics_match_exact_enumeration() -> None:
    g, n = _grid(), 4
    exact = np.zeros(n)
    for draw in itertools.product(range(len(VALUES)), repeat=n):
        prob = math.prod(WEIGHTS[i] for i in draw)
        exact += prob * np.sort(VALUES[list(draw)])[::-1]
    for j in range(1, n + 1):
        assert expected_order_stat(g, n, j) == pytest.approx(exact[j - 1], rel=1e-9)
    assert expected_order_stat(g, n, 1) == pytest.approx(expected_max(g, n), rel=1e-12)
    biggest = max_of(g, n)
    assert biggest.mean == pytest.approx(exact[0], rel=1e-9)
    with pytest.raises(ValueError):
        expected_order_stat(g, n, n + 1)


def _llava_grouped_step(lengths: np.ndarray, ranks: int, steps: int) -> float:
    """One step of LLaVA's group_by_modality_length order, re-enacted from its description
    (llava/train/llava_trainer.py at c121f04): the megabatch sorted longest first, each sample
    dealt to the chunk of least total length among those not yet full, chunk c run by rank
    c % ranks at micro-step c // ranks; the step's mean over micro-steps of the slowest rank's
    padded length."""
    order = np.argsort(-lengths, kind="stable")
    chunks = ranks * steps
    size = len(lengths) // chunks
    members: list[list[float]] = [[] for _ in range(chunks)]
    totals = np.zeros(chunks)
    for i in order:
        c = int(np.argmin(totals))
        members[c].append(float(lengths[i]))
        totals[c] += lengths[i]
        if len(members[c]) == size:
            totals[c] = np.inf
    per_step = [max(max(members[k * ranks + r]) for r in range(ranks)) for k in range(steps)]
    return float(np.mean(per_step))


@pytest.mark.parametrize(("ranks", "steps", "micro"), [(8, 1, 16), (8, 4, 4), (2, 3, 2)])
def test_grouped_padding_matches_llavas_sampler(ranks: int, steps: int, micro: int) -> None:
    rng = np.random.default_rng(7)
    trials = 3000
    n = ranks * steps * micro
    draws = rng.choice(VALUES, size=(trials, n), p=WEIGHTS)
    sim = np.array([_llava_grouped_step(row, ranks, steps) for row in draws])
    priced = padded_length(_grid(), micro, ranks, steps, True, "grouped")
    assert priced == pytest.approx(sim.mean(), abs=4 * sim.std() / math.sqrt(trials))


@pytest.mark.parametrize("synced", [True, False])
def test_longest_padding_waits_for_the_slowest_rank(synced: bool) -> None:
    """Random batches: each rank pads each micro-batch to its longest sample; synchronised
    ranks wait for each other at every micro-step, unsynchronised ones once a step."""
    rng = np.random.default_rng(11)
    trials, ranks, steps, micro = 20000, 4, 3, 2
    draws = rng.choice(VALUES, size=(trials, steps, ranks, micro), p=WEIGHTS)
    padded = draws.max(axis=3)  # (trials, steps, ranks)
    every_step = padded.max(axis=2).mean(axis=1)  # the slowest rank of each micro-step
    once = padded.sum(axis=1).max(axis=1) / steps  # the slowest rank's whole step
    sim = every_step if synced else once
    priced = padded_length(_grid(), micro, ranks, steps, synced, "longest")
    assert priced == pytest.approx(sim.mean(), abs=4 * sim.std() / math.sqrt(trials))
    alone = padded_length(_grid(), micro, 1, 1, True, "longest")
    assert alone == pytest.approx(expected_max(_grid(), micro)) and priced > alone


def _spec(zero: int, dp: int, micro: int, gbs: int, padding: str = "longest"):  # type: ignore[no-untyped-def]
    return runspec_from_dict(
        {
            "model": {"preset": "llava-1.5-7b", "seq_length": 2048},
            "cluster": {"gpu": "a100-80gb", "num_gpus": dp},
            "parallel": {
                "dp": dp,
                "micro_batch_size": micro,
                "global_batch_size": gbs,
                "zero_stage": zero,
            },
            "multimodal": {
                "packing": False,
                "padding": padding,
                "image_tokens": 576,
                "text_tokens": {"mean": 300, "p99": 1500},
                "placement": "replicated",
            },
        }
    )


def test_the_estimate_prices_the_padded_length_of_its_slowest_rank() -> None:
    """ZeRO-3 ranks meet at every micro-step: the language model runs at the expected longest
    of dp x micro-batch samples (each capped at seq_length); one GPU at the longest of its own
    micro-batch; ranks that meet once a step (DDP, 4 micro-steps) in between."""
    one = estimate_vlm(_spec(3, 1, 4, 4))
    eight = estimate_vlm(_spec(3, 8, 4, 32))
    ddp = estimate_vlm(_spec(0, 8, 4, 128))
    spec = _spec(3, 8, 4, 32)
    assert spec.vision is not None and spec.multimodal is not None
    capped = sample_lengths(spec.vision, spec.multimodal).map(lambda x: np.minimum(x, 2048))
    assert one.layout.llm_seq == math.ceil(expected_max(capped, 4))
    assert eight.layout.llm_seq == math.ceil(expected_max(capped, 32))
    assert one.layout.llm_seq < ddp.layout.llm_seq < eight.layout.llm_seq <= 2048
    grouped = estimate_vlm(_spec(3, 8, 4, 128, "grouped"))
    assert grouped.layout.llm_seq == math.ceil(padded_length(capped, 4, 8, 4, True, "grouped"))
    assert grouped.layout.llm_seq < eight.layout.llm_seq
