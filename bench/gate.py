"""The benchmark gate: run the quick bench suite, check every metric against its floor (bench/floors.py).

    .venv/bin/python bench/gate.py                 # run the quick suite, print the table, exit 1 on a miss
    .venv/bin/python bench/gate.py --no-run        # only check bench/results/benchmarks.json
    .venv/bin/python bench/gate.py --calibrate 3   # run the quick suite 3 times and write the medians
                                                   # to bench/floors_measured.json (the floors follow)

The suite is ``pytest -o python_files='bench_*.py' bench`` with ``RECBOOST_BENCH_QUICK=1`` and
``--benchmark-json bench/results/benchmarks.json`` (git-ignored); the environment is passed through,
so ``RECBOOST_NO_EXTENSIONS=1 bench/gate.py`` gates the numpy fallback and
``RECBOOST_BENCH_SLOWDOWN=1.5 bench/gate.py`` makes every timed recboost contender 1.5x slower (both
fail: that is the demonstration that a regression is caught). A metric beyond its floor is measured
again, up to twice (only the bench that reports it runs again), and passes if any attempt passes;
the table shows every attempt. Exit status: 0 when every metric is within its floor, 1 otherwise
(beyond its floor in every attempt, missing, not calibrated, or a bench failed its result check).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import floors as floors_mod  # noqa: E402
from floors import FLOORS  # noqa: E402

RESULTS = os.path.join(HERE, "results")
JSON = os.path.join(RESULTS, "benchmarks.json")
RETRIES = 2
# Benches not on pytest-benchmark: they record no ratio the gate could read, and the quick gate
# skips them (they run in `make bench`): bench_boost's six-configuration run and its per-algorithm
# step costs (the gated boost figures come from bench_tables.py's test_boost_with_tables).
NOT_GATED = "not test_boost_throughput_and_auc and not test_boost_algorithm_costs and not test_dist_two_ranks_vs_one"


def run_suite(json_path=JSON, args=(), nodeids=None):
    """Run the quick bench suite (or only ``nodeids``) writing pytest-benchmark JSON to ``json_path``;
    returns ``(pytest exit code, seconds)``."""
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    if os.path.exists(json_path):
        os.remove(json_path)
    env = dict(os.environ, RECBOOST_BENCH_QUICK="1")
    targets = list(nodeids) if nodeids else ["-k", NOT_GATED, os.path.join(ROOT, "bench")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py",
           "--benchmark-json", json_path, "--benchmark-columns", "median,min,max,rounds"] + targets + list(args)
    print("+ RECBOOST_BENCH_QUICK=1 " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    code = subprocess.call(cmd, env=env, cwd=ROOT)
    return code, time.perf_counter() - t0


def nodeids(json_path):
    """``{bench name: pytest node id}`` of the benches in a pytest-benchmark JSON file."""
    with open(json_path) as fh:
        data = json.load(fh)
    return {b["extra_info"]["bench"]: b["fullname"] for b in data.get("benchmarks", [])
            if "bench" in b.get("extra_info", {}) and "fullname" in b}


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


def check(extra, floors=None):
    """One row per floor: ``(floor, value or None, status)``, status ``"pass"``, ``"FAIL"`` (beyond
    the floor), ``"MISSING"`` (the bench did not report it) or ``"NO FLOOR"`` (not calibrated)."""
    rows = []
    for f in FLOORS if floors is None else floors:
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


def table(attempts):
    """The gate's table as text: one row per floor, one value column per attempt (``attempts`` is a
    list of ``check`` results; a row passes if any attempt passed)."""
    head = ("what", "against", "median", "floor", "target") + tuple(
        "attempt %d" % (i + 1) for i in range(len(attempts))) + ("result",)
    body = []
    for k, (f, _, _) in enumerate(attempts[0]):
        cells = []
        for rows in attempts:
            v, status = rows[k][1], rows[k][2]
            cells.append(_fmt(v) + ("" if status == "pass" else " " + status))
        body.append((f.what, f.against, _fmt(f.median), bound(f, f.floor), bound(f, f.target)) + tuple(cells)
                    + (final_status([rows[k] for rows in attempts]),))
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


def final_status(row_attempts):
    """A metric's verdict over its attempts: "pass" if any attempt passed, else the last status."""
    statuses = [status for _, _, status in row_attempts]
    return "pass" if "pass" in statuses else statuses[-1]


def gate(json_path=JSON, suite_code=0, rerun=None, retries=RETRIES):
    """Check ``json_path``; re-measure failing metrics up to ``retries`` times with ``rerun(nodeids,
    attempt) -> json path`` (None: no re-measuring). Prints the table; returns 0 (pass) or 1 (fail)."""
    if not os.path.exists(json_path):
        print("gate: no %s (the suite wrote no results)" % json_path)
        return 1
    extra = load(json_path)
    attempts = [check(extra)]
    benches = nodeids(json_path)
    for attempt in range(2, retries + 2):
        failing = [f for f, _, status in attempts[-1] if status == "FAIL"]
        if rerun is None or not failing:
            break
        ids = sorted({benches[f.metric.partition(":")[0]] for f in failing
                      if f.metric.partition(":")[0] in benches})
        print("gate: %d metric(s) beyond their floor; measuring again (attempt %d): %s"
              % (len(failing), attempt, ", ".join(f.metric for f in failing)), flush=True)
        again = load(rerun(ids, attempt))
        extra = dict(extra, **again)
        attempts.append(check(extra))
    backends = sorted({"%s: %s" % (name, info["backend"]) for name, info in extra.items() if "backend" in info})
    print("kernels timed: " + (", ".join(backends) or "-"))
    print(table(attempts))
    verdicts = [(rows_k[0][0], final_status(rows_k)) for rows_k in zip(*attempts)]
    bad = [f.metric for f, status in verdicts if status != "pass"]
    if suite_code:
        print("gate: FAIL, the bench suite itself failed (exit %d): a timed result was wrong" % suite_code)
    if bad:
        print("gate: FAIL, %d of %d beyond their floor, missing or not calibrated: %s"
              % (len(bad), len(verdicts), ", ".join(bad)))
    if suite_code or bad:
        return 1
    print("gate: pass, %d metrics within their floors (%d attempt(s))" % (len(verdicts), len(attempts)))
    return 0


def _rerun(ids, attempt):
    path = os.path.join(RESULTS, "benchmarks-attempt-%d.json" % attempt)
    run_suite(path, nodeids=ids)
    return path


def calibrate(runs, path=floors_mod.MEASURED, runner=None):
    """Run the quick suite ``runs`` times and write every metric's values and median to ``path``."""
    runner = runner or run_suite
    values, took = {m.metric: [] for m in floors_mod.METRICS}, []
    for i in range(runs):
        json_path = os.path.join(RESULTS, "benchmarks-calibrate-%d.json" % (i + 1))
        code, seconds = runner(json_path)
        took.append(seconds)
        extra = load(json_path) if os.path.exists(json_path) else {}
        for name in values:
            v = value(extra, name)
            if v is not None:
                values[name].append(v)
        print("run %d: exit %d, %.0f s" % (i + 1, code, seconds), flush=True)
    out = floors_mod.write_measured(values, runs, took, path)
    print("%-52s %-4s %9s %9s %9s %9s" % ("metric", "dir", "min", "median", "max", "floor"))
    measured = out["metrics"]
    for f in floors_mod.floors(measured):
        v = values[f.metric]
        if not v:
            print("%-52s %-4s (no values)" % (f.metric, f.direction))
            continue
        print("%-52s %-4s %9.4g %9.4g %9.4g %9.4g" % (f.metric, f.direction, min(v), f.median, max(v), f.floor))
    print("calibrate: %d runs (%s s) written to %s" % (runs, ", ".join("%.0f" % t for t in took), path))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="check the existing JSON only (no re-measuring)")
    parser.add_argument("--json", default=JSON, help="pytest-benchmark JSON (default %(default)s)")
    parser.add_argument("--calibrate", type=int, metavar="N",
                        help="run the quick suite N times and write the medians to bench/floors_measured.json")
    args = parser.parse_args(argv)
    if args.calibrate:
        return calibrate(args.calibrate)
    if args.no_run:
        return gate(args.json)
    code, seconds = run_suite(args.json)
    print("gate: quick suite took %.0f s" % seconds)
    return gate(args.json, code, rerun=_rerun)


if __name__ == "__main__":
    sys.exit(main())
