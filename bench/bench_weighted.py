"""Weighted ids and the max combiner (issue 39, item 1): what a weight per id and max pooling cost in
the pooled step by hand, against the same step without weights, in one process, interleaved rounds.

``test_weighted_pooled_step``: bench_multihot.py's pooled step (a 1M-row ``HashEmbedding(16,
padding_id=0)`` with ``SparseAdam``, batch 2048 bags of L = 20 Zipf-like ids with trailing padding,
``prepare`` + ``take`` + ``gather`` + ``apply_gradients`` with a fixed bag gradient, consecutive
batches per timed call), each path on its own table fed the same ids:

- ``recboost`` (the contender): ``combiner="mean"`` with ``WeightedIds`` (weights uniform in
  [0.1, 2)): ``gather_pool`` with weights, then the fused update takes the bags with their
  weights (``weights=``: no per-position gradient array);
- ``unweighted_mean``: the same ids without weights (the fused update spreads the bags itself);
- ``max``, ``weighted_max``: ``combiner="max"`` without and with the weights (``gather_max``, its
  arg-max, which the fused update takes as ``argmax=``).

Recorded: each path's ms per step and the ratios to ``unweighted_mean`` (``weighted_over_unweighted``
is the price of the weights). Report mode only (marked ``untimed``: no A/B row of the gate).

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_weighted.py
    (RECBOOST_BENCH_QUICK=1: short)
"""
import numpy as np
import pytest

import recboost as rb
from _harness import QUICK, compare, record
from bench_multihot import BATCH, DIM, L, PAD, ROWS, _bags, _graph, _host_run

INNER = 4 if QUICK else 8                 # consecutive batches per timed call
ROUNDS = 7 if QUICK else 15


def _table(combiner):
    return rb.HashEmbedding(DIM, ROWS, optimizer=rb.SparseAdam(1e-3), combiner=combiner, padding_id=PAD,
                            name="hist", seed=0)


@pytest.mark.untimed
def test_weighted_pooled_step(benchmark):
    _graph()
    rng = np.random.default_rng(0)
    calls = 1 + ROUNDS                                          # compare's warm-up call, then the rounds
    ids = [_bags(rng) for _ in range(calls * INNER)]
    weighted = [rb.WeightedIds(b, rng.uniform(0.1, 2.0, b.shape).astype(np.float32)) for b in ids]
    grad = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    alternatives = {"unweighted_mean": _host_run(_table("mean"), ids, grad),
                    "max": _host_run(_table("max"), ids, grad),
                    "weighted_max": _host_run(_table("max"), weighted, grad)}

    def check(pooled):
        assert pooled.shape == (BATCH, DIM) and np.isfinite(pooled).all()

    times, ratios = compare(benchmark, _host_run(_table("mean"), weighted, grad), alternatives, rounds=ROUNDS,
                            warmup=1, check=check)
    base = times["unweighted_mean"]
    record("weighted", {
        "ms_per_step": {k: t / INNER * 1e3 for k, t in times.items()},
        "over_unweighted_mean": {k: t / base for k, t in times.items()},
        "weighted_over_unweighted": ratios["unweighted_mean"],
        "rows": ROWS, "bag_length": L, "batch": BATCH, "steps_per_call": INNER,
        "backend": "compiled" if rb.FAST_BACKEND else "numpy",
    }, benchmark)
