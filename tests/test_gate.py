"""The benchmark gate (bench/gate.py, bench/floors.py, bench/_harness.py) on synthetic pytest-benchmark
JSON: the floor rule, the verdicts, re-measuring a failing row, calibration and the slowdown hook.

No benchmark runs here: the JSON files are written by the tests, in pytest-benchmark's layout.
"""
import json
import os
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import _harness  # noqa: E402
import floors  # noqa: E402
import gate  # noqa: E402
from floors import Metric, floor_from_median  # noqa: E402

FAKE_METRICS = [Metric("cache:speed_vs_c", "min", 0.8, "lookup", "C loop"),
                Metric("step:nested.over_base", "max", 1.1, "step", "base step"),
                Metric("quality:auc_loss", "max", 0.003, "AUC loss", "O0", kind="delta", delta=0.01)]
FAKE_MEDIANS = {"cache:speed_vs_c": {"median": 1.0}, "step:nested.over_base": {"median": 1.0},
                "quality:auc_loss": {"median": 0.002}}


def _write(path, extra_by_bench):
    """A pytest-benchmark JSON file with one benchmark per bench name, ``extra_info`` as given."""
    data = {"machine_info": {}, "commit_info": {}, "version": "5.1.0", "benchmarks": [
        {"name": "test_" + name, "fullname": "bench/bench_x.py::test_" + name, "group": None,
         "stats": {"median": 0.01, "min": 0.01, "max": 0.02, "rounds": 5},
         "extra_info": dict(extra, bench=name)} for name, extra in extra_by_bench.items()]}
    with open(str(path), "w") as fh:
        json.dump(data, fh)
    return str(path)


def _fake_floors():
    return [floors.Floor(m.metric, m.direction, m.target, floor_from_median(m, FAKE_MEDIANS[m.metric]["median"]),
                         m.what, m.against, m.note, FAKE_MEDIANS[m.metric]["median"]) for m in FAKE_METRICS]


def _extra(speed=1.0, over=1.0, loss=0.002):
    return {"cache": {"speed_vs_c": speed}, "step": {"nested": {"over_base": over}}, "quality": {"auc_loss": loss}}


def test_floor_rule_catches_a_30_percent_regression_on_every_row():
    """Every ratio row fails 30% worse than its median and passes 20% noise; a row with its own wider
    margin (an alternative with two speeds, said in its note) fails just beyond that margin."""
    for m in floors.METRICS:
        if m.kind != "ratio":
            continue
        median, margin = 2.0, (0.25 if m.margin is None else m.margin)
        assert m.margin is None or (m.margin <= 0.6 and "from one process to the next" in m.note), m
        floor = floor_from_median(m, median)
        bad, ok = 1 + max(0.3, margin + 0.05), 1.2
        worse = median / bad if m.direction == "min" else median * bad          # beyond the margin: fails
        noise = median / ok if m.direction == "min" else median * ok            # 20% noise: passes
        assert (worse < floor) if m.direction == "min" else (worse > floor), m
        assert (noise >= floor) if m.direction == "min" else (noise <= floor), m
    assert sorted(m.metric for m in floors.METRICS if m.margin is not None) == [
        "hash_e2e:speed_vs_embedding", "hash_e2e:speed_vs_embedding_lookup"]
    delta = Metric("q:x", "max", 0.003, "w", "a", kind="delta", delta=0.01)
    assert floor_from_median(delta, 0.002) == pytest.approx(0.012)
    assert floor_from_median(Metric("q:y", "min", None, "w", "a", kind="delta", delta=0.5), 3.0) == 2.5


def test_floors_come_from_the_measured_medians_not_the_targets(tmp_path):
    path = str(tmp_path / "measured.json")
    floors.write_measured({"tables:speed_vs_lookup_lazyadam": [1.0, 1.2, 1.1], "data:speed_vs_naive": []}, 3,
                          [10.0, 11.0, 12.0], path)
    measured = floors.load_measured(path)
    assert measured["tables:speed_vs_lookup_lazyadam"]["median"] == 1.1 and "data:speed_vs_naive" not in measured
    got = {f.metric: f for f in floors.floors(measured)}
    f = got["tables:speed_vs_lookup_lazyadam"]
    assert f.floor == pytest.approx(1.1 / 1.25) and f.target == 1.5            # the target stays a target
    assert got["data:speed_vs_naive"].floor is None                             # not calibrated
    assert len({m.metric for m in floors.METRICS}) == len(floors.METRICS)
    for m in floors.METRICS:
        assert m.direction in ("min", "max") and ":" in m.metric and m.what and m.against, m
        assert m.kind in ("ratio", "delta") and (m.kind == "ratio") == (m.delta is None), m


def test_the_committed_calibration_covers_every_metric():
    measured = floors.load_measured()
    missing = [m.metric for m in floors.METRICS if m.metric not in measured]
    assert not missing, "run `bench/gate.py --calibrate 3` on a quiet machine: %s" % missing


def test_verdicts(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "FLOORS", _fake_floors())
    status = lambda extra: [s for _, _, s in gate.check(gate.load(_write(tmp_path / "b.json", extra)))]  # noqa
    assert status(_extra()) == ["pass", "pass", "pass"]
    assert status(_extra(speed=0.79, over=1.26, loss=0.013)) == ["FAIL", "FAIL", "FAIL"]
    assert status(_extra(speed=0.8, over=1.25, loss=0.012)) == ["pass", "pass", "pass"]       # at the floor
    del_one = _extra()
    del del_one["cache"]
    assert status(del_one) == ["MISSING", "pass", "pass"]
    assert status(dict(_extra(), step={"nested": {"over_base": True}})) == ["pass", "MISSING", "pass"]
    monkeypatch.setattr(gate, "FLOORS", [f._replace(floor=None) for f in _fake_floors()])
    assert status(_extra()) == ["NO FLOOR"] * 3


def test_a_failing_row_is_measured_again_and_every_attempt_is_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gate, "FLOORS", _fake_floors())
    first = _write(tmp_path / "a1.json", _extra(speed=0.7))
    calls = []

    def rerun(ids, attempt):                  # the second attempt is slow again, the third recovers
        calls.append((ids, attempt))
        return _write(tmp_path / ("a%d.json" % attempt), {"cache": {"speed_vs_c": 0.75 if attempt == 2 else 0.95}})
    assert gate.gate(first, rerun=rerun) == 0
    assert calls == [(["bench/bench_x.py::test_cache"], 2), (["bench/bench_x.py::test_cache"], 3)]
    out = capsys.readouterr().out
    assert "attempt 3" in out and "0.7 FAIL" in out and "0.75 FAIL" in out and "0.95" in out and "gate: pass" in out
    # three bad attempts fail the gate; no fourth
    calls.clear()
    assert gate.gate(first, rerun=lambda ids, attempt: calls.append(attempt) or
                     _write(tmp_path / "b.json", {"cache": {"speed_vs_c": 0.5}})) == 1
    assert calls == [2, 3] and "gate: FAIL" in capsys.readouterr().out
    # a passing run never re-measures; a missing metric is not re-measured (nothing to compare)
    assert gate.gate(_write(tmp_path / "ok.json", _extra()), rerun=lambda *a: pytest.fail("re-ran")) == 0
    missing = _extra()
    del missing["quality"]
    assert gate.gate(_write(tmp_path / "m.json", missing), rerun=lambda *a: pytest.fail("re-ran")) == 1


def test_exit_status_and_suite_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "FLOORS", _fake_floors())
    path = _write(tmp_path / "b.json", _extra())
    assert gate.main(["--no-run", "--json", path]) == 0
    assert gate.main(["--no-run", "--json", _write(tmp_path / "c.json", _extra(over=2.0))]) == 1
    assert gate.main(["--no-run", "--json", str(tmp_path / "none.json")]) == 1
    assert gate.gate(path, suite_code=1) == 1


def test_calibrate_writes_the_medians(tmp_path, monkeypatch):
    values = iter([0.9, 1.1, 1.0])

    def runner(json_path):
        _write(json_path, {"tables": {"speed_vs_lookup_lazyadam": next(values)}})
        return 0, 1.5
    monkeypatch.setattr(gate, "RESULTS", str(tmp_path))
    path = str(tmp_path / "measured.json")
    assert gate.calibrate(3, path, runner) == 0
    got = floors.load_measured(path)
    assert got["tables:speed_vs_lookup_lazyadam"] == {"values": [0.9, 1.1, 1.0], "median": 1.0}


def test_slowdown_hook_makes_the_contender_slower(monkeypatch):
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
    with open(os.path.join(os.path.dirname(BENCH), "recboost.py")) as fh:
        assert "RECBOOST_BENCH_SLOWDOWN" not in fh.read()
