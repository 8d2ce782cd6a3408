"""Where a table's arrays live, and the fused SparseAdam's copy-rate fraction (issue #38 items 1 and 5).

The fused ``sparse_adam_update`` on a table of ``2^RECBOOST_BENCH_ROWS_LOG2`` rows (default 20; 24 shows
the TLB's share and holds about 10 GB: three copies of rows and moments; dim 64: a quarter of the rows), dims 16, 17 (the bench Wide&Deep's row: 16 deep + 1 wide) and 64, 8 batches
of 53K ids per timed call (uniform ids over the rows: the cache-miss worst case; ``zipf``: the skewed
ids of ``bench_tables.py``'s ``test_fused_adam_kernel``), timed interleaved (ABBA) in one process with
``np.copyto`` of 256 MB (the memory copy rate) and with each other:

- ``table``: this tree's kernel on the table's own arrays (``HashEmbedding(...).store``: 64-byte aligned,
  2 MB+ arrays on a 2 MB aligned ``MADV_HUGEPAGE`` mapping);
- ``plain``: this tree's kernel on the same values in numpy's own memory (``np.array`` copies: what
  every table held before): ``plain / table`` is what the placement gives;
- ``before``: the kernel of the tree ``RECBOOST_BENCH_BEFORE`` names (e.g. a checkout of main with its
  ``_recboost_fast`` built, loaded beside this one, as ``bench_table_optimizers.py`` does) on numpy's
  memory: main as it was. ``before / table``: placement and kernel (the prefetches) together.

Each figure: bytes the update must move per second (``bench_tables.py``'s count: the gradient read, the
per-row sums written and read, each touched row of the table and both moments read and written) over
the copy rate, the fastest sample of each. Every contender is checked to compute the same bits.

    RECBOOST_BENCH_BEFORE=/path/to/main-checkout RECBOOST_BENCH_ROWS_LOG2=24 \\
        .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_host_memory.py
        (RECBOOST_BENCH_QUICK=1: fewer rounds)
"""
import os

import numpy as np

import recboost as rb
from _harness import QUICK, abba, record
from bench_table_optimizers import _before_module
from bench_tables import _Copy, _timed

BATCH, FIELDS, INNER = 2048, 26, 8
LOG2 = int(os.environ.get("RECBOOST_BENCH_ROWS_LOG2", "20"))
ROUNDS = 5 if QUICK else 15
F = np.float32


def _adam(kernels, arrays, batch, acc):
    w, m, v = arrays
    uniq, inverse, grad = batch
    kernels.sparse_adam_update(w, m, v, uniq, inverse, grad, acc, F(1e-3), F(0.9), F(0.999), F(1) - F(0.9),
                               F(1) - F(0.999), F(1e-8))


def _batches(rng, rows, dim, ids):
    n, out = BATCH * FIELDS, []
    for _ in range(INNER):
        drawn = rng.integers(0, rows, n) if ids == "uniform" else np.minimum(rng.zipf(1.1, n), rows - 1)
        uniq, inverse = rb.unique_inverse(drawn.astype(np.int32), np.full(rows, -1, np.int32))
        out.append((uniq, inverse, rng.standard_normal((n, dim)).astype(np.float32)))
    return out


def test_host_memory_adam_copy_rate():
    before = _before_module()
    copy, out = _Copy(), {}
    for dim in (16, 17, 64):
        rows = 1 << (LOG2 - 2 if dim == 64 else LOG2)       # (dim 64: a quarter of the rows, as bench_tables)
        for ids in ("uniform", "zipf"):
            rng = np.random.default_rng(dim)
            store = rb.HashEmbedding(dim, rows, optimizer=rb.SparseAdam(1e-3), seed=1).store
            rng.standard_normal(out=store.weight, dtype=np.float32)
            store.weight *= F(0.1)
            table = [store.weight, store.slots["moment1"], store.slots["moment2"]]
            arrays = {"table": table, "plain": [np.array(a) for a in table]}
            if before is not None:
                arrays["before"] = [np.array(a) for a in table]
            batches = _batches(rng, rows, dim, ids)
            acc = np.empty((max(b[0].size for b in batches), dim), np.float32)
            kernels = {"table": rb, "plain": rb, "before": before}

            def steps(name):
                for batch in batches:
                    _adam(kernels[name], arrays[name], batch, acc)
            for name in arrays:                       # warm (pages faulted in) and the same bits
                steps(name)
            assert all(np.array_equal(a, b) for name in arrays for a, b in zip(arrays[name], arrays["table"]))
            fns = dict({name: (lambda name=name: steps(name)) for name in arrays}, copy=copy)
            samples = {name: [] for name in fns}
            for order in abba(fns, ROUNDS):
                for name in order:
                    samples[name].append(_timed(fns[name]))
            distinct = sum(b[0].size for b in batches)
            moved = 4 * (INNER * BATCH * FIELDS * dim + 2 * distinct * dim + 6 * distinct * dim)
            rate = copy.rate(min(samples["copy"]))
            fig = {name + "_fraction_of_copy_rate": moved / min(samples[name]) / rate for name in arrays}
            fig.update({"plain_over_table": min(samples["plain"]) / min(samples["table"]),
                        "distinct_per_batch": distinct / INNER, "copy_bytes_per_second": rate})
            if before is not None:
                fig["before_over_table"] = min(samples["before"]) / min(samples["table"])
            out["dim%d_%s" % (dim, ids)] = fig
    record("host_memory", dict(out, log2_rows=LOG2, before=os.environ.get("RECBOOST_BENCH_BEFORE"),
                               targets={"table_fraction_of_copy_rate (dim 16)": ">= 0.6"}))
