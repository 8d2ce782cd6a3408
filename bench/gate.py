"""The benchmark gate: run the quick bench suite, check every ratio against its floor (bench/floors.py).

    .venv/bin/python bench/gate.py              # run the quick suite, print the table, exit 1 on a miss
    .venv/bin/python bench/gate.py --no-run     # only check bench/results/benchmarks.json
    .venv/bin/python bench/gate.py --spread 3   # run the quick suite 3 times: min/median/max per
                                                # metric and the floor the rule in floors.py gives

The suite is ``pytest -o python_files='bench_*.py' bench`` with ``RECBOOST_BENCH_QUICK=1`` and
``--benchmark-json bench/results/benchmarks.json`` (git-ignored); the environment is passed through,
so ``RECBOOST_NO_EXTENSIONS=1 bench/gate.py`` gates the numpy fallback (and fails: that is the
demonstration that a slowed hot path is caught). Exit status: 0 when every metric is within its
floor, 1 when one is beyond its floor or missing, or when a bench failed (its result check).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from floors import FLOORS, floor_from_spread  # noqa: E402

RESULTS = os.path.join(HERE, "results")
JSON = os.path.join(RESULTS, "benchmarks.json")
# Benches not (yet) on pytest-benchmark: they record no ratio the gate could read, and the quick gate
# skips them (they run in `make bench`): bench_boost's six-configuration throughput/AUC run and its
# per-algorithm step costs.
NOT_GATED = "not test_boost_throughput_and_auc and not test_boost_algorithm_costs"


def run_suite(json_path=JSON, args=()):
    """Run the quick bench suite writing pytest-benchmark JSON to ``json_path``; returns
    ``(pytest exit code, seconds)``."""
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    if os.path.exists(json_path):
        os.remove(json_path)
    env = dict(os.environ, RECBOOST_BENCH_QUICK="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py",
           "--benchmark-json", json_path, "--benchmark-columns", "median,min,max,rounds", "-k", NOT_GATED,
           os.path.join(ROOT, "bench")] + list(args)
    print("+ RECBOOST_BENCH_QUICK=1 " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    code = subprocess.call(cmd, env=env, cwd=ROOT)
    return code, time.perf_counter() - t0


def load(json_path=JSON):
    """``{bench name: extra_info}`` of a pytest-benchmark JSON file (benches that called record)."""
    with open(json_path) as fh:
        data = json.load(fh)
    out = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "bench" in info:
            out[info["bench"]] = info
    return out


def value(extra, metric):
    """The number at ``metric`` (``"bench:dotted.key"``) in ``extra`` (from ``load``), or None."""
    bench, _, key = metric.partition(":")
    node = extra.get(bench)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def check(extra, floors=FLOORS):
    """One row per floor: ``(floor, value or None, status)``, status ``"pass"``, ``"FAIL"`` (beyond
    the floor) or ``"MISSING"`` (the bench did not report it)."""
    rows = []
    for f in floors:
        v = value(extra, f.metric)
        if v is None or f.floor is None:
            status = "MISSING" if v is None else "NO FLOOR"
        elif f.direction == "min":
            status = "pass" if v >= f.floor else "FAIL"
        else:
            status = "pass" if v <= f.floor else "FAIL"
        rows.append((f, v, status))
    return rows


def _fmt(x):
    if x is None:
        return "-"
    return "%.3g" % x


def bound(f, x):
    """``>= x`` or ``<= x`` for floor ``f``."""
    return "-" if x is None else ("%s %s" % (">=" if f.direction == "min" else "<=", _fmt(x)))


def table(rows):
    """The gate's table as text."""
    head = ("what", "against", "ratio", "target", "floor", "result")
    body = [(f.what, f.against, _fmt(v), bound(f, f.target), bound(f, f.floor), status)
            for f, v, status in rows]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


def gate(json_path=JSON, suite_code=0):
    """Print the table for ``json_path``; returns the exit status (0 pass, 1 fail)."""
    if not os.path.exists(json_path):
        print("gate: no %s (the suite wrote no results)" % json_path)
        return 1
    extra = load(json_path)
    rows = check(extra)
    backends = sorted({"%s: %s" % (name, info["backend"]) for name, info in extra.items() if "backend" in info})
    print("kernels timed: " + (", ".join(backends) or "-"))
    print(table(rows))
    bad = [f.metric for f, _, status in rows if status != "pass"]
    if suite_code:
        print("gate: FAIL, the bench suite itself failed (exit %d): a timed result was wrong" % suite_code)
    if bad:
        print("gate: FAIL, %d of %d beyond their floor or missing: %s" % (len(bad), len(rows), ", ".join(bad)))
    if suite_code or bad:
        return 1
    print("gate: pass, %d metrics within their floors" % len(rows))
    return 0


def spread(runs):
    """Run the quick suite ``runs`` times; print min/median/max per metric and the rule's floor."""
    values, took = {f.metric: [] for f in FLOORS}, []
    for i in range(runs):
        path = os.path.join(RESULTS, "benchmarks-spread-%d.json" % (i + 1))
        code, seconds = run_suite(path)
        took.append(seconds)
        extra = load(path) if os.path.exists(path) else {}
        for f in FLOORS:
            v = value(extra, f.metric)
            if v is not None:
                values[f.metric].append(v)
        print("run %d: exit %d, %.0f s" % (i + 1, code, seconds), flush=True)
    print("\nquick suite: %s s per run" % ", ".join("%.0f" % t for t in took))
    print("%-48s %-4s %8s %8s %8s %8s %8s" % ("metric", "dir", "min", "median", "max", "target", "floor"))
    for f in FLOORS:
        v = values[f.metric]
        if not v:
            print("%-48s %-4s (no values)" % (f.metric, f.direction))
            continue
        print("%-48s %-4s %8.3g %8.3g %8.3g %8s %8.3g" % (
            f.metric, f.direction, min(v), statistics.median(v), max(v), _fmt(f.target),
            floor_from_spread(f.direction, f.target, v)))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="check the existing JSON only")
    parser.add_argument("--json", default=JSON, help="pytest-benchmark JSON (default %(default)s)")
    parser.add_argument("--spread", type=int, metavar="N", help="run the quick suite N times, print the spread")
    args = parser.parse_args(argv)
    if args.spread:
        return spread(args.spread)
    code = 0
    if not args.no_run:
        code, seconds = run_suite(args.json)
        print("gate: quick suite took %.0f s" % seconds)
    return gate(args.json, code)


if __name__ == "__main__":
    sys.exit(main())
