"""Tables at a fixed memory budget on a drifting stream (issue #25): held-out AUC by eviction policy.

The same Wide&Deep (26 fields, rows of 16 + 1, hidden 400 x 400, Adam 1e-3) is trained online on
``SyntheticClickStream(drift=1.0)`` for BUDGET_STEPS (default 1,500) steps of 2048 rows, then scored
on the next 32 batches of the stream (never trained on). Tables:

- ``exact``: a table holding every id of the run (capacity 2**21 > the ~1.56M distinct ids;
  admission at first sight, no eviction): what an exact vocabulary gives;
- ``none``, ``lru``, ``lfu``: 1/16 of the distinct ids (97,675 rows), ``access_threshold=1``, ids
  unseen for 6 hours of data time evicted (an EvictHook every data hour), without growth; a full
  table overflows new ids to the default row (``none``) or replaces an id by its policy;
- ``lru_sketch``: ``lru`` with ``admission_counter="sketch"`` (default sizes: 4 x 390,700 int32
  counters, 6.25 MB, halved every 195,350 counts): the ids below the threshold are counted in the
  sketch, so the table tracks no more ids than its rows.

Records ``results/budget_tables.json``: each table's AUC, its gap to ``exact``, its cache
statistics (tracked ids against capacity) and samples/s (one run each, not interleaved: a guide,
not a speed claim). Not in the gate (its baseline has no eviction policy; 5 minutes). Run:

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_budget.py

``BUDGET_ONLY=lru,lru_sketch`` runs only those tables (no gap to ``exact`` unless it is among them).
"""
import os
import time

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

import recboost as rb
from _harness import record

pytestmark = pytest.mark.untimed

BUDGET_STEPS = int(os.environ.get("BUDGET_STEPS", 1500))
BATCH, DIM, BUDGET_ROWS = 2048, 16, 97_675        # 1/16 of the ~1.56M distinct ids of 1,500 steps
CONFIGS = {"exact": dict(capacity=1 << 21, access_threshold=-1, eviction_threshold=-1, eviction_policy=None),
           "none": dict(capacity=BUDGET_ROWS, access_threshold=1, eviction_threshold=6 * 3600, eviction_policy=None),
           "lru": dict(capacity=BUDGET_ROWS, access_threshold=1, eviction_threshold=6 * 3600, eviction_policy="lru"),
           "lfu": dict(capacity=BUDGET_ROWS, access_threshold=1, eviction_threshold=6 * 3600, eviction_policy="lfu"),
           "lru_sketch": dict(capacity=BUDGET_ROWS, access_threshold=1, eviction_threshold=6 * 3600, eviction_policy="lru",
                              admission_counter="sketch")}
ONLY = [name for name in os.environ.get("BUDGET_ONLY", "").split(",") if name] or list(CONFIGS)


def _held_out_auc(config):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, optimizer=rb.SparseAdam(1e-3), input_index=1, seed=0, name="ids",
                             lfu_half_life=6 * 3600, **config)
    net = rb.WideDeep(13, 26, DIM, (400, 400), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    stream = rb.SyntheticClickStream(seed=0, batch_size=BATCH, with_timestamp=True, rows_per_second=BATCH / 60.0,
                                     drift=1.0)
    train = ({"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in stream)
    start = time.perf_counter()
    model.online_train(train, callbacks=[rb.EvictHook(evict_time_interval=3600), rb._StopAfter(BUDGET_STEPS)],
                       dataset_sink_mode=False)
    seconds = time.perf_counter() - start
    held = stream.take(32)
    scores = np.concatenate([model.predict(d, i).asnumpy().ravel() for d, i, _, _ in held])
    labels = np.concatenate([y.ravel() for _, _, y, _ in held])
    stats = table.cache.stats()
    return {"auc": rb.roc_auc(labels, scores), "stats": stats, "samples_per_second": model.samples / seconds,
            "tracked_per_row": (stats["size"] + stats["candidates"]) / (stats["capacity"] - 2)}


def test_budget_tables_auc():
    runs = {name: _held_out_auc(CONFIGS[name]) for name in ONLY}
    for name, run in runs.items():
        if "exact" in runs:
            run["gap_to_exact"] = runs["exact"]["auc"] - run["auc"]
    record("budget_tables", {"steps": BUDGET_STEPS, "batch": BATCH, "budget_rows": BUDGET_ROWS, "runs": runs})
    if "exact" in runs:
        assert runs["exact"]["stats"]["overflowed"] == 0
    if "none" in runs:
        assert runs["none"]["stats"]["overflowed"] > 0
    for policy in ("lru", "lfu", "lru_sketch"):
        if policy in runs:
            assert runs[policy]["stats"]["replaced"] > 0 and runs[policy]["stats"]["grown"] == 0
            assert runs[policy].get("gap_to_exact", 0) < 0.005, (policy, runs[policy]["gap_to_exact"])
    if "lru_sketch" in runs:
        assert runs["lru_sketch"]["tracked_per_row"] <= 1 and runs["lru_sketch"]["stats"]["candidates"] == 0
