"""Soak: long runs must keep memory flat, occupancy within capacity and throughput steady.

1. Host path: HashCache lookups with admission and eviction on a drifting Zipf id stream,
   SOAK_BATCHES (default 200,000) batches of 26 x 256 ids, evicting every 100 batches.
2. End to end: RecModel.online_train with a hash table, admission, eviction (EvictHook) and growth
   off, SOAK_STEPS (default 20,000) steps on the synthetic stream (small Wide&Deep, batch 256).

Each reports resident memory after warm-up and at the end (growth must be < 5%), the largest
occupancy against capacity, and throughput of the last 10% against the first 10% after warm-up
(within 10%). Run:

    .venv/bin/python -m pytest -q -s bench/bench_soak.py          (RECBOOST_BENCH_QUICK=1: 5% length)
"""
import os
import time

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.train.callback import Callback

import recboost as rb
from _harness import QUICK, record

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


def test_soak_host_cache():
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
    result = record("soak_host", {
        "batches": SOAK_BATCHES, "ids_per_batch": 256 * 26, "rss_after_warmup_mb": rss_warm,
        "rss_end_mb": rss_end, "rss_growth": rss_end / rss_warm - 1, "peak_occupancy": peak_len,
        "capacity": cache.capacity, "throughput_end_over_start": first / last,
        "evicted": stats["evicted"], "admitted": stats["admitted"], "backend": "fast" if rb.FAST_BACKEND else "py"})
    assert stats["evicted"] > 0 and peak_len <= cache.capacity
    assert result["rss_growth"] < 0.05, result
    assert result["throughput_end_over_start"] > 0.9, result


class _Meter(Callback):
    def __init__(self, warm):
        self.warm, self.times, self.rss_warm, self.peak = warm, [], None, 0

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.times.append(time.perf_counter())
        table = cb.recboost._tables[0]
        self.peak = max(self.peak, len(table.cache))
        if cb.cur_step_num == self.warm:
            self.rss_warm = _rss_mb()
        if cb.cur_step_num >= SOAK_STEPS:
            run_context.request_stop()


def test_soak_online_training():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    batch, fields = 256, 26
    capacity = 1 << 17
    table = rb.HashEmbedding(9, capacity, access_threshold=1, eviction_threshold=600, max_unique=batch * fields + 1,
                             input_index=1, name="ids")
    net = rb.WideDeep(13, fields, 8, (64, 64), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    stream = rb.SyntheticClickStream(seed=0, batch_size=batch, with_timestamp=True, drift=5.0, rows_per_second=256)
    dicts = ({"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in stream)
    warm = max(SOAK_STEPS // 10, 20)
    meter = _Meter(warm)
    model.online_train(dicts, callbacks=[meter, rb.EvictHook(evict_time_interval=60)], dataset_sink_mode=False)
    rss_end = _rss_mb()
    step_times = np.diff(meter.times)
    window = max(len(step_times) // 10, 1)
    first = np.sum(step_times[warm:warm + window])
    last = np.sum(step_times[-window:])
    stats = table.cache.stats()
    result = record("soak_online", {
        "steps": model.step, "rss_after_warmup_mb": meter.rss_warm, "rss_end_mb": rss_end,
        "rss_growth": rss_end / meter.rss_warm - 1, "peak_occupancy": meter.peak, "capacity": table.capacity,
        "throughput_end_over_start": first / last, "evicted": stats["evicted"], "admitted": stats["admitted"],
        "samples_per_second_end": batch * window / last})
    assert model.step == SOAK_STEPS and stats["evicted"] > 0 and meter.peak <= table.capacity
    assert result["rss_growth"] < 0.05, result
    assert result["throughput_end_over_start"] > 0.9, result
