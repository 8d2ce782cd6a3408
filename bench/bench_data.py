"""Bench: Criteo parsing and the data sources, in one run, as ratios.

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_data.py
        (200K rows; RECBOOST_BENCH_QUICK=1: 20K rows)
    .venv/bin/python bench/bench_data.py [--quick]       # the same through pytest

Times, on the same in-memory buffer of synthetic Criteo lines: the live ``recboost.parse_criteo``
(the compiled kernel; its numpy twin under ``RECBOOST_NO_EXTENSIONS=1``) through pytest-benchmark,
the numpy twin ``_py_parse_criteo`` and a naive Python parser (``line.split('\\t')``, ``int()``, then
the same numpy hashing) interleaved with it, checks that all three give the same arrays, and
reports rows/s and ratios. Then rows/s of ``CriteoReader`` (file -> ready batches) and of
``SyntheticClickStream``, next to the ~40K samples/s a Wide&Deep training step consumes here.
"""
import argparse
import collections
import os
import subprocess
import sys

import numpy as np

import recboost  # noqa: E402
from _harness import AB, NAN, QUICK, compare, interleaved, record  # noqa: E402

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


ROWS = 20_000 if QUICK else 200_000


def test_parse_criteo(benchmark, tmp_path):
    path = str(tmp_path / "day.txt")
    recboost.SyntheticClickStream(seed=0).write_criteo(path, ROWS)
    with open(path, "rb") as fh:
        buf = fh.read()
    last = {}

    def keep(name, fn):
        def go():
            last[name] = fn()
        return go

    def check(out):
        for a, b in zip(out, last["numpy_twin"]):
            assert a.dtype == b.dtype and np.array_equal(a, b), "twin differs from the live kernel"
        for a, b in zip(out[:3], last["naive"]):
            assert np.array_equal(a, b), "naive parser differs from the live kernel"
        assert out[0].size == ROWS

    times, ratios = compare(
        benchmark, lambda: recboost.parse_criteo(buf, ND, NS),
        {"numpy_twin": keep("numpy_twin", lambda: recboost._py_parse_criteo(buf, ND, NS)),
         "naive": keep("naive", lambda: naive_parse(buf))},
        rounds=3 if QUICK else 5, warmup=1, check=check, ab_rounds=15)

    def read_file():
        n = 0
        for dense, ids, label in recboost.CriteoReader(path, batch_size=2048):
            n += label.shape[0]
        assert n == ROWS
    gen_batches = max(2, ROWS // 2048)
    sources = collections.defaultdict(lambda: NAN) if AB else interleaved({"reader": read_file,
                           "generator": lambda: recboost.SyntheticClickStream(seed=1).take(gen_batches)},
                          rounds=1 if QUICK else 3, warmup=0)
    record("data", {
        "rows": ROWS, "mb": len(buf) / 1e6,
        "backend": "compiled" if recboost.parse_criteo is not recboost._py_parse_criteo else "numpy",
        "rows_per_second": {"recboost": ROWS / times["recboost"], "numpy_twin": ROWS / times["numpy_twin"],
                            "naive": ROWS / times["naive"], "reader": ROWS / sources["reader"],
                            "generator": gen_batches * 2048 / sources["generator"]},
        "speed_vs_numpy_twin": 1 / ratios["numpy_twin"], "speed_vs_naive": 1 / ratios["naive"]}, benchmark)


def main(argv=None):
    """Run this file's benchmark through pytest (``--quick``: RECBOOST_BENCH_QUICK=1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20K rows")
    args = parser.parse_args(argv)
    env = dict(os.environ, RECBOOST_BENCH_QUICK="1" if args.quick else os.environ.get("RECBOOST_BENCH_QUICK", ""))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-o", "python_files=bench_*.py",
                            os.path.abspath(__file__)], env=env, cwd=root)


if __name__ == "__main__":
    sys.exit(main())
