"""Hash tables across ranks (issue 12): 2 ranks against 1 on the same global batch, under msrun, for
both shardings, and the per-rank bytes and table memory extrapolated to 8, 16 and 64 ranks.

``test_dist_two_ranks_vs_one`` launches ``bench/_dist_worker.py`` three times with msrun on
127.0.0.1: one rank on the whole global batch (2048 rows; sharding "none"), then two ranks each on
its half, with sharding "data_parallel" (the id exchange and the row-gradient AllReduce each step)
and with "row_wise" (the id exchange, the row fetch and the gradient AllGather). Same model
(Wide&Deep, 26 x (16+1) on one 1M-row HashEmbedding, MLP 400-400-1), same stream, warm-up steps
untimed. Reported per sharding: seconds per step (the slower rank), ``over_one`` (the ratio to one
rank: below 1 is a speed-up), bytes each rank puts into the collectives per step (measured, and
equal to the formula of ``_dist_worker.bytes_per_step`` plus the 32-byte header that ends the timed
call's stream, ``STREAM_END_BYTES``: checked) and seconds per step spent in them.
Ungated (not in bench/floors.py; bench/gate.py leaves it out): on the 2-core machines the two ranks
share the cores the one rank has to itself, so the figure says what the exchange costs, not what
two machines would gain.

``test_dist_extrapolation`` evaluates the same formula (bytes sent, and bytes received: an AllGather
hands every rank every rank's part) on the same stream for W = 2, 8, 16, 64 ranks with 1024 rows per rank (each rank's part as in the measured run; the global batch grows with W) and
the table memory per rank for a table of 10M ids (rows, two Adam slots and the cache's 28 bytes per
id, the whole table on every rank for "data_parallel", 1/W of it for "row_wise"): the table of docs/distributed.md.

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_dist.py
    (RECBOOST_BENCH_QUICK=1: short)
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from _harness import QUICK, record

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import recboost as rb  # noqa: E402
from _dist import free_port  # noqa: E402
from _dist_worker import DIM, bytes_per_step  # noqa: E402

GLOBAL_BATCH = 2048
STEPS = 10 if QUICK else 30
WARMUP = 3
ROWS_PER_RANK = GLOBAL_BATCH // 2
TABLE_IDS = 10_000_000
CACHE_BYTES_PER_ID = 8 + 4 + 8 + 8          # HashCache: key, row, count, last-seen time


def _run(ranks, out, sharding):
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [msrun, "--worker_num=%d" % ranks, "--local_worker_num=%d" % ranks, "--master_addr=127.0.0.1",
           "--master_port=%d" % free_port(), "--join=True", "--log_dir=%s" % os.path.join(out, "logs"),
           os.path.join(HERE, "_dist_worker.py"), out, str(GLOBAL_BATCH), str(STEPS), str(WARMUP), sharding]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = []
    for r in range(ranks):
        with open(os.path.join(out, "rank_%d.json" % r)) as fh:
            results.append(json.load(fh))
    return results


def test_dist_two_ranks_vs_one(benchmark):
    runs = {}
    with tempfile.TemporaryDirectory() as one_dir:
        runs["none"] = benchmark.pedantic(_run, args=(1, one_dir, "none"), rounds=1, iterations=1)
    for sharding in ("data_parallel", "row_wise"):
        with tempfile.TemporaryDirectory() as two_dir:
            runs[sharding] = _run(2, two_dir, sharding)
    one_step = runs["none"][0]["seconds_per_step"]
    figures = {"global_batch": GLOBAL_BATCH, "steps": STEPS, "one_rank_seconds_per_step": one_step}
    for sharding in ("data_parallel", "row_wise"):
        two = runs[sharding]
        assert all(r["sharding"] == sharding for r in two)
        for r in two:                                   # the formula is what the exchange sends
            assert r["bytes_sent_per_step"] == r["predicted_bytes_per_step"], r
        step = max(r["seconds_per_step"] for r in two)
        figures.update({
            sharding + "_seconds_per_step": step, sharding + "_over_one": step / one_step,
            sharding + "_bytes_sent_per_rank_per_step": max(r["bytes_sent_per_step"] for r in two),
            sharding + "_exchange_seconds_per_step": max(r["exchange_seconds_per_step"] for r in two),
            sharding + "_table_rows_per_rank": two[0]["table_rows"]})
    # the same ids held in all: the whole table's on each data-parallel rank, split between the row-wise ones
    assert runs["data_parallel"][0]["ids_held"] == runs["none"][0]["ids_held"] == \
        sum(r["ids_held"] for r in runs["row_wise"])
    record("dist_tables", figures, benchmark)


def extrapolation(ranks=(2, 8, 16, 64), rows_per_rank=ROWS_PER_RANK, batches=3):
    """Per sharding and number of ranks W: bytes each rank sends per step (the measured formula on
    the stream's global batches of W x rows_per_rank rows, mean of ``batches``) and the table memory
    per rank for a table of TABLE_IDS ids (float32 rows and two Adam slots of DIM + 1 each, and the
    cache's bytes per id)."""
    out = {}
    per_id = 3 * 4 * (DIM + 1) + CACHE_BYTES_PER_ID
    for w in ranks:
        stream = rb.SyntheticClickStream(seed=0, batch_size=w * rows_per_rank)
        moved = {"data_parallel": [], "row_wise": []}
        for _ in range(batches):
            ids = next(stream)[1].reshape(w, -1)
            for sharding in moved:
                moved[sharding].append(bytes_per_step(sharding, ids, DIM + 1))
        for sharding, values in moved.items():
            out["%s_%d_ranks_bytes_per_step" % (sharding, w)] = float(np.mean([v[0] for v in values]))
            out["%s_%d_ranks_bytes_received_per_step" % (sharding, w)] = float(np.mean([v[1] for v in values]))
            share = 1 if sharding == "data_parallel" else w
            out["%s_%d_ranks_table_bytes" % (sharding, w)] = float(per_id * TABLE_IDS / share)
    return out


@pytest.mark.untimed
def test_dist_extrapolation(benchmark):
    figures = benchmark.pedantic(extrapolation, rounds=1, iterations=1)
    for w in (8, 16, 64):          # row-wise: sends less per rank than data-parallel, and a 1/W table
        assert figures["row_wise_%d_ranks_bytes_per_step" % w] < figures["data_parallel_%d_ranks_bytes_per_step" % w]
    record("dist_extrapolation", figures, benchmark)
