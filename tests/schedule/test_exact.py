"""The exact placements the benchmarks measure `place` against, checked by brute force."""

from __future__ import annotations

import math

import pytest

from gridgraph.schedule.cost import CostModel, bytes_moved, finish_time
from gridgraph.schedule.exact import exact_placement, fastest_within
from tests.schedule.graphs import WORKERS, chain, random_dag

MODELS = {"local": CostModel.local(), "pubsub": CostModel.pubsub()}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("seed", range(3))
def test_fastest_within_a_byte_ceiling_is_what_brute_force_finds(model, seed):
    cost = MODELS[model]
    b = random_dag(8, 200 + seed, d=[64, 256, 512][seed])
    fewest, _ = exact_placement(b.nodes, b.values, WORKERS, cost, objective="bytes")
    least = bytes_moved(b.nodes, b.values, fewest)
    for ceiling in (least, 1.5 * least, math.inf):
        _, brute = exact_placement(b.nodes, b.values, WORKERS, cost, max_bytes=ceiling)
        for known in (None, fewest):
            found, t = fastest_within(b.nodes, b.values, WORKERS, cost, ceiling, known=known)
            assert bytes_moved(b.nodes, b.values, found) <= ceiling
            assert finish_time(b.nodes, b.values, found, cost) == t
            assert t == pytest.approx(brute, rel=1e-12)


def test_no_placement_within_a_ceiling_below_the_fewest_bytes():
    b = chain([64, 128, 32, 256, 8])
    fewest, _ = exact_placement(b.nodes, b.values, WORKERS, objective="bytes")
    least = bytes_moved(b.nodes, b.values, fewest)
    assert least > 0
    assert fastest_within(b.nodes, b.values, WORKERS, CostModel.pubsub(), least - 1) is None
    assert exact_placement(b.nodes, b.values, WORKERS, max_bytes=least - 1) is None
