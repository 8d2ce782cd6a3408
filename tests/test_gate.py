"""The benchmark gate (bench/gate.py, bench/floors.py, bench/_harness.py) without running a benchmark:
ABBA order, paired ratios, tolerances and the confirming re-run, the checked targets, the side each
process imports, and the slowdown hook. The "benches" here are fake runners writing
pytest-benchmark JSON in its layout.
"""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import _harness  # noqa: E402
import floors  # noqa: E402
import gate  # noqa: E402


# ---- ABBA order ------------------------------------------------------------------------------------
def test_processes_alternate_abba():
    assert gate.abba_sides(1) == ["A", "B"]
    assert gate.abba_sides(3) == ["A", "B", "B", "A", "A", "B"]
    assert _harness.abba(["x", "y", "z"], 3) == [["x", "y", "z"], ["z", "y", "x"], ["x", "y", "z"]]


def test_interleaved_runs_in_abba_order():
    calls = []
    _harness.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=4, warmup=0)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_THP_DISABLE) is Linux's")
def test_the_ab_processes_run_without_transparent_huge_pages(monkeypatch, tmp_path):
    def thp_enabled(**kwargs):
        status = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                                capture_output=True, text=True, check=True, **kwargs).stdout
        return [line.split()[1] for line in status.splitlines() if line.startswith("THP_enabled:")]
    assert thp_enabled() == ["1"]
    assert thp_enabled(preexec_fn=gate.no_huge_pages) == ["0"]
    launched = []
    monkeypatch.setattr(gate.subprocess, "call", lambda cmd, **kwargs: launched.append(kwargs.get("preexec_fn")) or 0)
    gate.run_suite(str(tmp_path / "ab.json"), mode="ab", tree=ROOT, nodeids=["x"])
    gate.run_suite(str(tmp_path / "report.json"), mode="report", tree=ROOT, nodeids=["x"])
    assert launched == [gate.no_huge_pages, None]        # the targets' run keeps the huge pages users get


class _FakeBenchmark:
    """pytest-benchmark's ``pedantic``: ``setup()`` then the timed call, ``rounds`` times."""

    enabled = True

    def __init__(self):
        self.extra_info = {}
        self.stats = type("S", (), {})()
        self.stats.stats = type("D", (), {"data": []})()

    def pedantic(self, fn, setup, rounds, warmup_rounds, iterations):
        for _ in range(rounds):
            args, kwargs = setup()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.stats.stats.data.append(time.perf_counter() - t0)
        return out


def test_compare_times_the_contender_abba_with_its_alternatives(monkeypatch):
    monkeypatch.setattr(_harness, "AB", False)
    calls = []
    bench = _FakeBenchmark()
    times, ratios = _harness.compare(bench, lambda: calls.append("C"),
                                     {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     rounds=4, warmup=0)
    assert calls == ["a", "b", "C", "C", "b", "a", "a", "b", "C", "C", "b", "a"]
    assert set(times) == {"a", "b", "recboost"} and set(ratios) == {"a", "b"}
    assert bench.extra_info["ab_seconds"] == times["recboost"]


def test_compare_in_ab_mode_runs_only_the_contender(monkeypatch):
    monkeypatch.setattr(_harness, "AB", True)
    calls = []
    bench = _FakeBenchmark()
    times, ratios = _harness.compare(bench, lambda x: calls.append(("C", x)), {"a": lambda: pytest.fail("ran")},
                                     rounds=2, warmup=0, ab_rounds=5,
                                     prepare={"recboost": lambda: (1,), "a": lambda: pytest.fail("prepared")},
                                     check=lambda r: pytest.fail("checked"))
    assert calls == [("C", 1)] * 5
    # every alternative is listed, NaN: benches build their own dicts from ``ratios.items()``
    assert set(times) == {"a", "recboost"} and set(ratios) == {"a"}
    assert times["a"] != times["a"] and ratios["a"] != ratios["a"]
    assert times["unlisted"] != times["unlisted"] and ratios["unlisted"] != ratios["unlisted"]
    assert times["recboost"] == bench.extra_info["ab_seconds"] and bench.extra_info["rounds"] == 5


# ---- paired ratios and verdicts ----------------------------------------------------------------------
def test_paired_ratios_pair_consecutive_processes():
    runs = [("A", {"k": 1.0, "gone": 1.0}), ("B", {"k": 1.1, "new": 5.0}),
            ("B", {"k": 2.2}), ("A", {"k": 2.0, "gone": 1.0}),
            ("A", {"k": 1.0}), ("B", {"k": 0.9})]
    got = gate.paired_ratios(runs)
    assert got["k"] == pytest.approx([1.1, 1.1, 0.9])
    assert got["gone"] == [None, None] and "new" not in got


def test_verdict_uses_the_median_of_the_pairs_and_the_stated_tolerance():
    row = floors.TimedRow("k", "kernel", 0.10, "why")
    assert gate.verdict([1.05, 1.30, 1.08], row) == (1.08, "pass")           # one bad pair does not fail
    assert gate.verdict([1.12, 1.30, 1.08], row)[1] == "SLOWER"
    assert gate.verdict([1.10, 1.10, 1.10], row)[1] == "pass"                # at the tolerance
    assert gate.verdict([1.0, None], row) == (None, "MISSING")
    assert gate.verdict([1.0], None)[1] == "NO TOLERANCE"


def _write(path, rows_by_bench, tree):
    data = {"benchmarks": [{"name": "test_" + bench, "fullname": "bench/bench_x.py::test_" + bench,
                            "extra_info": {"bench": bench, "ab": rows,
                                           "recboost_file": os.path.join(tree, "recboost.py")}}
                           for bench, rows in rows_by_bench.items()]}
    with open(path, "w") as fh:
        json.dump(data, fh)


class _Runner:
    """A fake A/B process: ``times[side](row, call)`` gives each row's seconds; records every call."""

    def __init__(self, head, base=lambda row: 1.0, rows=("fast", "slow")):
        self.head, self.base, self.rows, self.calls = head, base, rows, []

    def __call__(self, path, mode, tree, nodeids, env):
        side = "B" if tree == gate.ROOT else "A"
        self.calls.append((side, nodeids, {k: env.get(k) for k in gate.HEAD_ONLY_ENV}))
        rows = [r for r in self.rows if nodeids is None or "bench/bench_x.py::test_" + r in nodeids]
        times = {r: (self.head(r, len(self.calls)) if side == "B" else self.base(r)) for r in rows}
        _write(path, {r: {r: t} for r, t in times.items()}, tree)
        return 0, 0.0


@pytest.fixture
def fake_rows(monkeypatch, tmp_path):
    monkeypatch.setattr(floors, "TIMED", [floors.TimedRow("fast", "k", 0.10, "why"),
                                          floors.TimedRow("slow", "g", 0.15, "why")])
    monkeypatch.setattr(gate, "RESULTS", str(tmp_path))
    base = tmp_path / "base"
    base.mkdir()
    return str(base)


def test_a_row_slower_in_both_runs_fails_and_only_its_bench_reruns(fake_rows, monkeypatch):
    monkeypatch.setenv("RECBOOST_BENCH_SLOWDOWN", "1.5")
    runner = _Runner(head=lambda row, call: 1.2 if row == "fast" else 1.0)
    rows, problems = gate.ab_gate(fake_rows, pairs=2, runner=runner)
    got = {r["row"]: r for r in rows}
    assert got["fast"]["status"] == "SLOWER" and got["fast"]["median"] == pytest.approx(1.2)
    assert got["fast"]["confirm_median"] == pytest.approx(1.2)
    assert got["slow"]["status"] == "pass" and not problems
    assert [gate.ab_failed(r) for r in rows] == [True, False]
    assert [c[0] for c in runner.calls] == ["A", "B", "B", "A"] * 3           # the confirm: twice the pairs
    assert [c[1] for c in runner.calls[4:]] == [["bench/bench_x.py::test_fast"]] * 8
    # the slowdown and the numpy fallback reach HEAD's processes only
    assert all(c[2]["RECBOOST_BENCH_SLOWDOWN"] == ("1.5" if c[0] == "B" else None) for c in runner.calls)


def test_a_row_slow_once_passes_after_its_confirming_run(fake_rows):
    runner = _Runner(head=lambda row, call: 1.2 if (row == "slow" and call <= 4) else 1.0)
    rows, problems = gate.ab_gate(fake_rows, pairs=2, runner=runner)
    got = {r["row"]: r for r in rows}
    assert got["slow"]["median"] == pytest.approx(1.2) and got["slow"]["status"].startswith("pass")
    assert got["slow"]["confirm_median"] == pytest.approx(1.0)      # the confirming run alone
    assert not any(gate.ab_failed(r) for r in rows) and not problems


def test_every_row_fails_at_a_uniform_slowdown_of_a_quarter(fake_rows):
    rows, _ = gate.ab_gate(fake_rows, pairs=3, runner=_Runner(head=lambda row, call: 1.25))
    assert all(r["status"] == "SLOWER" for r in rows)


def test_rows_without_tolerance_or_missing_on_head_fail_and_new_rows_are_reported(fake_rows):
    runner = _Runner(head=lambda row, call: 1.0, rows=("fast", "extra"))
    rows, _ = gate.ab_gate(fake_rows, pairs=1, runner=runner)
    got = {r["row"]: r["status"] for r in rows}
    assert got == {"fast": "pass", "extra": "NO TOLERANCE", "slow": "MISSING"}
    # a row that HEAD times and the baseline does not: new, reported, not failed
    runner = _Runner(head=lambda row, call: 1.0)
    runner.base = lambda row: 1.0
    original = runner.__call__

    def without_slow_on_a(path, mode, tree, nodeids, env):
        code = original(path, mode, tree, nodeids, env)
        if tree != gate.ROOT:
            _write(path, {"fast": {"fast": 1.0}}, tree)
        return code
    rows, _ = gate.ab_gate(fake_rows, pairs=1, runner=without_slow_on_a)
    got = {r["row"]: r for r in rows}
    assert got["slow"]["status"] == "NEW (no baseline)" and not gate.ab_failed(got["slow"])


def test_a_process_that_imported_the_other_side_fails_the_gate(fake_rows):
    def runner(path, mode, tree, nodeids, env):
        _write(path, {"fast": {"fast": 1.0}, "slow": {"slow": 1.0}}, gate.ROOT)    # always HEAD's file
        return 0, 0.0
    _, problems = gate.ab_gate(fake_rows, pairs=1, runner=runner)
    assert problems and "imported another recboost.py" in problems[0]


def test_a_failing_head_bench_fails_the_gate_a_failing_baseline_bench_does_not(fake_rows):
    def runner(side_fails):
        def run(path, mode, tree, nodeids, env):
            _write(path, {"fast": {"fast": 1.0}, "slow": {"slow": 1.0}}, tree)
            return (1 if (tree == gate.ROOT) == (side_fails == "B") else 0), 0.0
        return run
    assert gate.ab_gate(fake_rows, pairs=1, runner=runner("B"))[1]
    assert not gate.ab_gate(fake_rows, pairs=1, runner=runner("A"))[1]


# ---- targets ---------------------------------------------------------------------------------------------
def test_checked_targets_fail_reported_targets_never_do():
    checked = floors.Target("q:auc_loss", "max", 0.003, "w", "a", checked=True)
    reported = floors.Target("r:speed", "min", 1.5, "w", "a")
    extra = {"q": {"auc_loss": 0.004}, "r": {"speed": 1.2}}
    got = gate.check_targets(extra, [checked, reported])
    assert [g["status"] for g in got] == ["MISSED", "missed"]
    assert [g["status"] for g in gate.check_targets({"q": {"auc_loss": 0.003}}, [checked, reported])] == ["pass", "-"]
    assert gate.check_targets({}, [checked])[0]["status"] == "MISSING"


def test_a_missed_checked_target_is_measured_once_more(monkeypatch, tmp_path):
    monkeypatch.setattr(gate, "JSON", str(tmp_path / "b.json"))
    monkeypatch.setattr(gate, "RESULTS", str(tmp_path))
    monkeypatch.setattr(floors, "TARGETS", [floors.Target("q:auc_loss", "max", 0.003, "w", "a", checked=True)])
    values = iter([0.01, 0.002])
    calls = []

    def runner(path, mode, tree, nodeids, env):
        calls.append((mode, nodeids))
        with open(path, "w") as fh:
            json.dump({"benchmarks": [{"fullname": "bench/bench_q.py::test_q",
                                       "extra_info": {"bench": "q", "auc_loss": next(values)}}]}, fh)
        return 0, 0.0
    rows, _, problems = gate.targets_gate(runner)
    assert rows[0]["status"] == "pass (confirm)" and rows[0]["confirm"] == 0.002 and not problems
    assert calls == [("report", None), ("report", ["bench/bench_q.py::test_q"])]


def test_the_checked_only_report_run_is_the_benches_of_the_checked_targets(monkeypatch, tmp_path):
    """``--checked-only`` (CI) runs just ``floors.CHECKED_BENCHES`` and still fails on a checked row
    missing from them; it lists the reported rows of the benches it ran, not those of the others."""
    monkeypatch.setattr(gate, "JSON", str(tmp_path / "b.json"))
    targets = [floors.Target("q:auc_loss", "max", 0.003, "w", "a", checked=True),
               floors.Target("q:speed", "min", 1.5, "w", "a"), floors.Target("r:speed", "min", 1.5, "w", "a")]
    monkeypatch.setattr(floors, "TARGETS", targets)
    monkeypatch.setattr(floors, "CHECKED_BENCHES", {"q": "bench/bench_q.py::test_q"})
    calls = []

    def runner(path, mode, tree, nodeids, env):
        calls.append(nodeids)
        with open(path, "w") as fh:
            json.dump({"benchmarks": [{"fullname": "bench/bench_q.py::test_q",
                                       "extra_info": {"bench": "q", "auc_loss": 0.001, "speed": 2.0}}]}, fh)
        return 0, 0.0
    rows, _, problems = gate.targets_gate(runner, checked_only=True)
    assert calls == [["bench/bench_q.py::test_q"]] and not problems
    assert [(r["metric"], r["status"]) for r in rows] == [("q:auc_loss", "pass"), ("q:speed", "met")]
    monkeypatch.setattr(floors, "TARGETS", targets + [floors.Target("s:size_over", "max", 1.2, "w", "a", checked=True)])
    rows, _, _ = gate.targets_gate(runner, checked_only=True)
    assert rows[-1]["status"] == "MISSING"


def test_every_checked_target_names_the_bench_that_records_it():
    for t in floors.TARGETS:
        if t.checked:
            name = t.metric.partition(":")[0]
            path, _, test = floors.CHECKED_BENCHES[name].partition("::")
            with open(os.path.join(ROOT, path)) as fh:
                source = fh.read()
            assert "def %s(" % test in source, (name, path, test)
            assert '"%s"' % name in source or '"%s' % name.rsplit("_", 2)[0] in source, (name, path)


def test_the_stated_tolerances_and_targets():
    """Every timed row states 10-15% and why; every checked target is an absolute quality, memory or
    size target (none follows a measured median), and every ratio against an anchor is reported only."""
    assert len({t.row for t in floors.TIMED}) == len(floors.TIMED)
    for t in floors.TIMED:
        assert 0.10 <= t.tolerance <= 0.15 and t.reason and t.what, t
    assert len({t.metric for t in floors.TARGETS}) == len(floors.TARGETS)
    for t in floors.TARGETS:
        assert t.direction in ("min", "max") and ":" in t.metric and t.what and t.against, t
        if t.checked:
            assert t.target is not None and any(k in t.metric for k in ("auc_loss", "rss_growth", "size", "peak")), t
        else:
            assert not any(k in t.metric for k in ("auc_loss", "rss_growth", "size_over", "peak")), t
    auc = {t.metric: t.target for t in floors.TARGETS if t.checked}
    assert auc["boost_quality:auc_loss_O1"] == 0.003 and auc["boost_quality:auc_loss_O2_relative"] == 0.03
    assert not hasattr(floors, "MARGIN") and not os.path.exists(os.path.join(BENCH, "floors_measured.json"))


def test_the_baseline_is_a_commit_before_head():
    sha = gate.resolve(gate.baseline_ref())
    ancestor = subprocess.run(["git", "-C", ROOT, "merge-base", "--is-ancestor", sha, "HEAD"])
    assert ancestor.returncode == 0, "bench/BASELINE names %s, not an ancestor of HEAD" % sha
    with pytest.raises(SystemExit, match="not a commit"):
        gate.resolve("no-such-ref-anywhere")


# ---- the slowdown hook ---------------------------------------------------------------------------------
def test_slowdown_hook_makes_the_contender_slower():
    def work():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.02:
            pass
        return 7
    assert _harness.slowed(work, 1.0) is work
    slow = _harness.slowed(work, 1.5)
    t0 = time.perf_counter()
    assert slow() == 7
    assert time.perf_counter() - t0 >= 0.029
    with pytest.raises(ValueError, match="RECBOOST_BENCH_SLOWDOWN must be >= 1"):
        _harness.slowed(work, 0.5)
    # recboost.py never reads it: only the harness does
    with open(os.path.join(ROOT, "recboost.py")) as fh:
        assert "RECBOOST_BENCH_SLOWDOWN" not in fh.read()


# ---- the main job against the previous round's commit ----------------------------------------------
def _main_jobs(rates, imported=None):
    """A fake main-job runner: the n-th call's samples/s is ``rates(side, n)``; it imports its tree's file."""
    calls = []

    def runner(tree, env):
        side = "B" if tree == gate.ROOT else "A"
        calls.append(side)
        assert (env is None) == (side == "B") and (side == "B" or env["RECBOOST_REQUIRE_EXTENSIONS"] == "1")
        assert side == "B" or not set(gate.HEAD_ONLY_ENV) & set(env)
        return rates(side, len(calls)), imported or os.path.join(tree, "recboost.py")
    return runner, calls


@pytest.mark.parametrize("head_rate, first, status", [
    (100.0, 1.0, "pass"),                  # as fast as the reference
    (98.0, 100 / 98, "pass"),              # 2% slower: inside 3%
    (96.0, 100 / 96, "SLOWER"),            # 4% slower, again in the confirming run
])
def test_the_main_job_is_held_to_the_reference_within_3_percent(fake_rows, head_rate, first, status, monkeypatch):
    monkeypatch.setenv("RECBOOST_NO_EXTENSIONS", "1")
    runner, calls = _main_jobs(lambda side, n: head_rate if side == "B" else 100.0)
    row, problems = gate.reference_gate(fake_rows, pairs=2, runner=runner)
    assert row["median"] == pytest.approx(first) and row["status"] == status and not problems
    assert calls == ["A", "B", "B", "A"] * (3 if status == "SLOWER" else 1)
    assert gate.ab_failed(row) == (status == "SLOWER")


def test_the_main_job_slow_once_passes_its_confirming_run_and_a_failed_or_foreign_run_fails(fake_rows):
    runner, calls = _main_jobs(lambda side, n: 90.0 if side == "B" and n <= 4 else 100.0)
    row, problems = gate.reference_gate(fake_rows, pairs=2, runner=runner)
    assert row["status"] == "pass (confirmed)" and row["confirm_median"] == pytest.approx(1.0) and not problems
    runner, _ = _main_jobs(lambda side, n: None if side == "B" else 100.0)
    row, problems = gate.reference_gate(fake_rows, pairs=1, runner=runner)
    assert row["status"] == "MISSING" and gate.ab_failed(row) and problems == ["the main job failed on HEAD"]
    runner, _ = _main_jobs(lambda side, n: 100.0, imported="/elsewhere/recboost.py")
    row, problems = gate.reference_gate(fake_rows, pairs=1, runner=runner)
    assert row["status"] == "MISSING" and len(problems) == 2 and "imported /elsewhere/recboost.py" in problems[0]


def test_the_reference_is_a_commit_of_the_previous_round_and_resolves():
    ref = gate.baseline_ref(gate.REFERENCE_FILE)
    assert gate.resolve(ref) == ref and ref != gate.resolve(gate.baseline_ref())
