"""Bench: Criteo parsing and the data sources, in one run, as ratios.

    python bench/bench_data.py [--quick] [--rows N]

Times, on the same in-memory buffer of synthetic Criteo lines: the compiled ``parse_criteo``, its
numpy twin ``_py_parse_criteo``, and a naive Python parser (``line.split('\\t')``, ``int()``, then
the same numpy hashing), checks that all three give the same arrays, and prints rows/s and ratios.
Then rows/s of ``CriteoReader`` (file -> ready batches, compiled) and of ``SyntheticClickStream``,
next to the ~40K samples/s a Wide&Deep training step consumes on these machines.
Also collected by pytest (``pytest bench/bench_data.py``) in quick mode.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import recboost  # noqa: E402

ND, NS = 13, 26


def naive_parse(buf):
    """What a user would write first: split lines and fields in Python, hash with numpy."""
    labels, dense, values, missing = [], [], [], []
    for line in buf.split(b"\n"):
        fields = line.rstrip(b"\r").split(b"\t")
        if len(fields) != 1 + ND + NS:
            continue
        try:
            label = int(fields[0])
            if label not in (0, 1):
                continue
            d = [int(x) if x else 0 for x in fields[1:1 + ND]]
            c = [int(x, 16) if x else 0 for x in fields[1 + ND:]]
        except ValueError:
            continue
        labels.append(label)
        dense.append(d)
        values.append(c)
        missing.append([not x for x in fields[1 + ND:]])
    field = np.broadcast_to(np.arange(NS), (len(values), NS))
    ids = np.where(np.array(missing, dtype=bool).reshape(-1, NS), recboost._missing_feature_id(field, NS),
                   recboost._hash_feature(field, np.array(values, dtype=np.uint64).reshape(-1, NS), NS))
    return (np.array(labels, np.float32), np.array(dense, np.int64).reshape(-1, ND), ids)


def _best(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(rows, repeats):
    """Return a dict of figures (rows/s and ratios); raises if the parsers disagree."""
    if not recboost.FAST_BACKEND:
        raise RuntimeError("the compiled backend is needed: " + recboost.FAST_BACKEND_REASON)
    fast = recboost._backend_kernels("fast")["parse_criteo"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "day.txt")
        recboost.SyntheticClickStream(seed=0).write_criteo(path, rows)
        with open(path, "rb") as fh:
            buf = fh.read()
        fast(buf, ND, NS)                                          # warm-up
        t_fast, out_fast = _best(lambda: fast(buf, ND, NS), repeats)
        t_py, out_py = _best(lambda: recboost._py_parse_criteo(buf, ND, NS), max(1, repeats // 2))
        t_naive, out_naive = _best(lambda: naive_parse(buf), 1)
        for a, b in zip(out_fast, out_py):
            assert a.dtype == b.dtype and np.array_equal(a, b), "twin differs from the compiled kernel"
        for a, b in zip(out_fast[:3], out_naive):
            assert np.array_equal(a, b), "naive parser differs from the compiled kernel"
        assert out_fast[0].size == rows

        def read_file():
            n = 0
            for dense, ids, label in recboost.CriteoReader(path, batch_size=2048):
                n += label.shape[0]
            return n
        t_reader, n = _best(read_file, max(1, repeats // 2))
        assert n == rows
    gen_batches = max(2, rows // 2048)
    t_gen, _ = _best(lambda: recboost.SyntheticClickStream(seed=1).take(gen_batches), 1)
    return {
        "rows": rows, "mb": len(buf) / 1e6,
        "fast_rows_s": rows / t_fast, "twin_rows_s": rows / t_py, "naive_rows_s": rows / t_naive,
        "fast_vs_twin": t_py / t_fast, "fast_vs_naive": t_naive / t_fast, "twin_vs_naive": t_naive / t_py,
        "reader_rows_s": rows / t_reader, "generator_rows_s": gen_batches * 2048 / t_gen,
    }


def report(f):
    print("Criteo parsing, %d rows (%.1f MB), same buffer, results checked equal:" % (f["rows"], f["mb"]))
    print("  compiled parse_criteo   %10.0f rows/s" % f["fast_rows_s"])
    print("  numpy twin              %10.0f rows/s   compiled is %.1fx faster"
          % (f["twin_rows_s"], f["fast_vs_twin"]))
    print("  naive Python split      %10.0f rows/s   compiled is %.1fx faster, twin %.1fx"
          % (f["naive_rows_s"], f["fast_vs_naive"], f["twin_vs_naive"]))
    print("CriteoReader file -> batches of 2048 (compiled): %.0f rows/s" % f["reader_rows_s"])
    print("SyntheticClickStream batches of 2048:           %.0f rows/s" % f["generator_rows_s"])


def test_bench_data_quick():
    f = run(20_000, 3)
    report(f)
    assert f["fast_vs_twin"] > 1.0 and f["fast_vs_naive"] > 1.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20K rows, fewer repeats")
    parser.add_argument("--rows", type=int, default=None)
    args = parser.parse_args(argv)
    rows = args.rows or (20_000 if args.quick else 200_000)
    report(run(rows, 3 if args.quick else 5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
