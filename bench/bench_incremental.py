"""Incremental checkpoints (issue #38 item 3): a delta's bytes and time against a full checkpoint's.
Reported, not gated (marked ``untimed``: the gate's A/B run skips it).

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_incremental.py
        (RECBOOST_BENCH_QUICK=1: 2^16 rows, 3 intervals: a correctness run of seconds)

The model: a Wide&Deep (26 fields, 13 dense, MLP 64-1) over one ``HashEmbedding`` of width 16 and
ROWS (2^23) rows, every row held by an id (admitted through ``sparse_lookup``), trained by
``SparseAdam`` (two slots: 192 bytes a row in all). Each interval is one training step whose batch
draws its ids uniformly from the held ones, TOUCHED (1%) of the rows' worth of ids (a little fewer
distinct rows: repeats). After the base (``save_checkpoint(chain="base")``), each interval writes a
delta (``chain="delta"``) and, for comparison, a full checkpoint of the same step (``chain=None``,
which leaves the chain as it is), in alternating order; the full one is deleted after it is
measured. Then the last delta (INTERVALS links from its base) and the full checkpoint of its step
are each loaded into the model, interleaved, and the table's rows and slots checked equal (sha256
of their bytes).

Figures: per interval the changed rows (the delta's row patch), the delta's and the full
checkpoint's bytes and write seconds; their medians, ``delta_over_full_bytes`` and
``delta_over_full_seconds`` (the medians' ratios), and the load seconds of the chain and of the full
file (``chain_load_over_full_load``). Target (the issue's): a delta costs what changed, about
TOUCHED of the full bytes and time plus the dense part and the fixed-size state.
"""
import hashlib
import json
import os
import shutil
import time

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

import recboost as rb
from _harness import QUICK, RESULTS, record  # noqa: E402

ROWS = 1 << (16 if QUICK else 23)
DIM, FIELDS, DENSE = 16, 26, 13
TOUCHED = 0.01
INTERVALS = 3 if QUICK else 5


def _model():
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM, ROWS + 2, input_index=1, seed=0, name="ids", optimizer=rb.SparseAdam(1e-3),
                             max_unique=int(ROWS * TOUCHED) + 1)
    ids = (np.arange(ROWS, dtype=np.int64) + 1) * 7919
    for start in range(0, ROWS, 1 << 20):                 # every row held by an id, its initial row set
        rb.sparse_lookup(table, ids[start:start + (1 << 20)])
    assert len(table.cache) == ROWS
    net = rb.WideDeep(DENSE, FIELDS, DIM - 1, (64,), embedding=table)
    return ids, table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))


def _batch(ids, rng):
    """One batch whose ids, drawn uniformly from ``ids``, number TOUCHED of the rows."""
    size = max(1, int(ROWS * TOUCHED) // FIELDS)
    return (rng.standard_normal((size, DENSE)).astype(np.float32), ids[rng.integers(0, ids.size, (size, FIELDS))],
            (rng.random((size, 1)) < 0.3).astype(np.float32))


def _timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _rows_digest(table):
    state = table.state_dict(copy=False)
    sha = hashlib.sha256(np.ascontiguousarray(state["table"]).data)
    for name in sorted(state["slots"]):
        sha.update(np.ascontiguousarray(state["slots"][name]).data)
    return sha.hexdigest()


def _manifest(path):
    with np.load(path) as npz:
        return json.loads(npz["manifest"].tobytes())


@pytest.mark.untimed
def test_incremental_checkpoint():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    folder = os.path.join(RESULTS, "incremental-scratch")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    ids, table, model = _model()
    model.online_train([_batch(ids, rng)], dataset_sink_mode=False)          # compiled outside the timing
    base = os.path.join(folder, "base.npz")
    base_seconds = _timed(model.save_checkpoint, base, None, "base")
    intervals = []
    for k in range(INTERVALS):
        model.online_train([_batch(ids, rng)], dataset_sink_mode=False)
        delta, full = os.path.join(folder, "delta-%d.npz" % k), os.path.join(folder, "full.npz")
        order = [("delta", delta, "delta"), ("full", full, None)]
        seconds = {name: _timed(model.save_checkpoint, path, None, chain)
                   for name, path, chain in (order if k % 2 == 0 else order[::-1])}
        patch = _manifest(delta)["delta"]["patches"]["tables.0.table"]
        changed = np.load(delta)[patch["rows"]].size if patch["kind"] == "rows" else ROWS
        intervals.append({"changed_rows": int(changed), "delta_bytes": os.path.getsize(delta),
                          "full_bytes": os.path.getsize(full), "delta_seconds": seconds["delta"],
                          "full_seconds": seconds["full"]})
        if k < INTERVALS - 1:
            os.remove(full)
    expected = _rows_digest(table)
    loads = {"chain": [], "full": []}
    for name in ["chain", "full", "full", "chain"]:        # ABBA; each load checked against the trained rows
        loads[name].append(_timed(model.load_checkpoint, delta if name == "chain" else full))
        assert _rows_digest(table) == expected, name
    shutil.rmtree(folder)
    median = {key: float(np.median([row[key] for row in intervals]))
              for key in ("delta_bytes", "full_bytes", "delta_seconds", "full_seconds")}
    load = {name: float(np.median(v)) for name, v in loads.items()}
    record("incremental_checkpoint", {
        "rows": ROWS, "dim": DIM, "optimizer": "SparseAdam", "touched_fraction": TOUCHED, "intervals": intervals,
        "base_seconds": base_seconds, "median": median,
        "delta_over_full_bytes": median["delta_bytes"] / median["full_bytes"],
        "delta_over_full_seconds": median["delta_seconds"] / median["full_seconds"],
        "load_seconds": {"chain_of_%d_deltas" % INTERVALS: load["chain"], "full": load["full"]},
        "chain_load_over_full_load": load["chain"] / load["full"],
        "targets": {"delta_over_full_bytes": "about the touched fraction plus the dense part (reported)",
                    "delta_over_full_seconds": "reported, not gated"}})
