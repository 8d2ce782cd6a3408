"""Soak: long runs must keep memory flat, occupancy within capacity and throughput steady.

1. Host path: HashCache lookups with admission and eviction on a drifting Zipf id stream,
   SOAK_BATCHES (default 200,000) batches of 26 x 256 ids, evicting every 100 batches.
2. End to end: RecModel.online_train with a hash table, admission, eviction (EvictHook) and growth
   on, SOAK_STEPS (default 20,000) steps on the synthetic stream (small Wide&Deep, batch 256), once
   in GRAPH_MODE (record ``soak_online``) and once in PyNative mode, MindSpore's default
   (``soak_online_pynative``): PyNative run op by op keeps ~13-23 KB of native memory per step, which
   RecModel avoids by compiling its step cells (``recboost._graph_step``).
3. A table in a fixed memory budget (issue #25): the same run with a table that never grows, its
   ``eviction_policy="lru"`` replacing ids when full and its admission counted in the default
   count-min sketch, on a stream whose vocabulary never stops growing (no time eviction at all):
   record ``soak_budget``. Besides memory and throughput it reports the most ids the table tracked
   (rows plus exact candidates, checked after every step) against its capacity: at most 2x.

Each reports resident memory after warm-up and at the end (host soak: growth < 5%; online soaks:
< 2%), the largest occupancy against capacity, and throughput of the last 10% against the first 10%
after warm-up (within 10%): asserted at full length; in the quick suite the memory growth is a floor
of the gate (bench/floors.py) and the windows are too short for the throughput limit. The bench always asserts
that the run was right (evictions happened, occupancy never exceeded the capacity). Each soak runs
once, timed as one round by pytest-benchmark. Run:

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_soak.py
        (RECBOOST_BENCH_QUICK=1: 5% length)
"""
import os
import time

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn
from mindspore.train.callback import Callback

import recboost as rb
from _harness import QUICK, record

pytestmark = pytest.mark.untimed          # memory rows only: no A/B timing

SCALE = 0.05 if QUICK else 1.0
SOAK_BATCHES = int(os.environ.get("SOAK_BATCHES", 200_000 * SCALE))
SOAK_STEPS = int(os.environ.get("SOAK_STEPS", 20_000 * SCALE))


def _rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _drifting_ids(rng, step, shape, vocab=400_000, drift_per_batch=40):
    """Zipf ranks over a window of ids that slides by ``drift_per_batch`` ids every batch."""
    ranks = np.minimum(rng.zipf(1.2, size=shape), vocab) - 1
    return (ranks + step * drift_per_batch).astype(np.int64) * 1_000_003 % (1 << 62)


def test_soak_host_cache(benchmark):
    stats, result = benchmark.pedantic(_soak_host, rounds=1, iterations=1)
    record("soak_host", result, benchmark)
    assert stats["evicted"] > 0 and result["peak_occupancy"] <= result["capacity"], result
    _full_length_limits(result)


def _full_length_limits(result, max_growth=0.05):
    """The soak's limits, asserted at full length; at 5% (quick) the gate checks the memory growth
    (bench/floors.py) and the throughput windows are too short to mean anything."""
    if not QUICK:
        assert result["rss_growth"] < max_growth, result
        assert result["throughput_end_over_start"] > 0.9, result


def _soak_host():
    rng = np.random.default_rng(0)
    capacity = 1 << 19
    cache = rb.HashCache(capacity, access_threshold=1, eviction_threshold=1_000)
    warm = max(SOAK_BATCHES // 10, 3_000)          # occupancy is steady after a few eviction horizons
    window = max((SOAK_BATCHES - warm) // 10, 1)
    times, rss_warm, peak_len = [], None, 0
    batches = [_drifting_ids(rng, k, (256, 26)) for k in range(64)]     # ids pre-made, shifted per step
    for k in range(SOAK_BATCHES):
        ids = batches[k % 64] + (k // 64) * 64 * 40 * 1_000_003
        t0 = time.perf_counter()
        rows = cache.lookup(ids, timestamp=k)
        if k % 100 == 99:
            cache.evict(k)
        times.append(time.perf_counter() - t0)
        assert rows.max() < cache.capacity
        peak_len = max(peak_len, len(cache))
        if k == warm:
            rss_warm = _rss_mb()
    rss_end = _rss_mb()
    first = np.sum(times[warm:warm + window])
    last = np.sum(times[-window:])
    stats = cache.stats()
    return stats, {
        "batches": SOAK_BATCHES, "ids_per_batch": 256 * 26, "rss_after_warmup_mb": rss_warm,
        "rss_end_mb": rss_end, "rss_growth": rss_end / rss_warm - 1, "peak_occupancy": peak_len,
        "capacity": cache.capacity, "throughput_end_over_start": first / last,
        "evicted": stats["evicted"], "admitted": stats["admitted"], "backend": "fast" if rb.FAST_BACKEND else "py"}


class _Meter(Callback):
    def __init__(self, warm):
        self.warm, self.times, self.rss_warm, self.peak = warm, [], None, 0
        self.capacity_warm = None
        self.peak_tracked = 0           # ids with a row plus exact admission candidates

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.times.append(time.perf_counter())
        table = cb.recboost.tables[0]
        self.peak = max(self.peak, len(table.cache))
        self.peak_tracked = max(self.peak_tracked, len(table.cache) + table.cache.stats()["candidates"])
        if cb.cur_step_num == self.warm:
            self.rss_warm = _rss_mb()
            self.capacity_warm = table.capacity
        if cb.cur_step_num >= SOAK_STEPS:
            run_context.request_stop()


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_soak_online_training(benchmark, mode):
    old = ms.get_context("mode")
    try:
        model, stats, result = benchmark.pedantic(_soak_online, args=(mode,), rounds=1, iterations=1)
    finally:
        ms.set_context(mode=old)
    record("soak_online" if mode == "graph" else "soak_online_pynative", result, benchmark)
    assert model.step == SOAK_STEPS and stats["evicted"] > 0 and result["peak_occupancy"] <= result["capacity"]
    assert result["capacity_after_warmup"] == result["capacity"], result     # growth ended in the warm-up
    _full_length_limits(result, max_growth=0.02)


def test_soak_budget_table(benchmark):
    """A table in a fixed budget (lru, the default sketch admission, no growth, no time eviction) on a
    stream whose vocabulary keeps growing: memory flat, the ids it tracks at most twice its rows."""
    model, stats, result = benchmark.pedantic(_soak_online, args=("graph", True), rounds=1, iterations=1)
    record("soak_budget", result, benchmark)
    assert model.step == SOAK_STEPS and stats["replaced"] > 0 and stats["grown"] == 0 and stats["candidates"] == 0
    assert result["admission_counter"] == "sketch" and result["capacity"] == result["capacity_after_warmup"]
    assert result["peak_tracked_per_row"] <= 2.0, result
    _full_length_limits(result, max_growth=0.02)


def _soak_online(mode, budget=False):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    batch, fields = 256, 26
    capacity = 1 << 14                 # grows (doubling) to what eviction keeps live, in the warm-up
    if budget:                         # stays at its rows: a full table replaces the least recent id
        table = rb.HashEmbedding(9, capacity, access_threshold=1, max_unique=batch * fields + 1,
                                 eviction_policy="lru", input_index=1, name="ids")
    else:
        table = rb.HashEmbedding(9, capacity, access_threshold=1, eviction_threshold=120,
                                 max_unique=batch * fields + 1, use_dynamic_expansion=True, input_index=1, name="ids")
    net = rb.WideDeep(13, fields, 8, (64, 64), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    stream = rb.SyntheticClickStream(seed=0, batch_size=batch, with_timestamp=True, drift=5.0, rows_per_second=256)
    dicts = ({"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in stream)
    warm = max(SOAK_STEPS // 10, 300)
    meter = _Meter(warm)
    model.online_train(dicts, callbacks=[meter] + ([] if budget else [rb.EvictHook(evict_time_interval=20)]),
                       dataset_sink_mode=False)
    rss_end = _rss_mb()
    step_times = np.diff(meter.times)
    window = max(len(step_times) // 10, 1)
    first = np.sum(step_times[warm:warm + window])
    last = np.sum(step_times[-window:])
    stats = table.cache.stats()
    return model, stats, {
        "mode": mode, "steps": model.step, "rss_after_warmup_mb": meter.rss_warm, "rss_end_mb": rss_end,
        "capacity_after_warmup": meter.capacity_warm,
        "rss_growth": rss_end / meter.rss_warm - 1, "peak_occupancy": meter.peak, "capacity": table.capacity,
        "throughput_end_over_start": first / last, "evicted": stats["evicted"], "admitted": stats["admitted"],
        "samples_per_second_end": batch * window / last, "replaced": stats["replaced"],
        "admission_counter": table.cache.admission_counter, "peak_tracked": meter.peak_tracked,
        "peak_tracked_per_row": meter.peak_tracked / (table.capacity - 2)}
