"""The benchmark gate's checker (bench/gate.py, bench/floors.py) on synthetic pytest-benchmark JSON.

No benchmark runs here: the JSON files are written by the tests, in pytest-benchmark's layout.
"""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import floors  # noqa: E402
import gate  # noqa: E402
from floors import Floor, floor_from_spread  # noqa: E402

FAKE = [Floor("cache:speed_vs_c", "min", 0.8, 0.6, "lookup", "C loop", ""),
        Floor("step:nested.over_base", "max", 1.1, 1.3, "step", "base step", "")]


def _write(tmp_path, extra_by_bench):
    """A pytest-benchmark JSON file with one benchmark per bench name, ``extra_info`` as given."""
    data = {"machine_info": {}, "commit_info": {}, "version": "5.1.0", "benchmarks": [
        {"name": "test_" + name, "fullname": "bench/bench_x.py::test_" + name, "group": None,
         "stats": {"median": 0.01, "min": 0.01, "max": 0.02, "rounds": 5},
         "extra_info": dict(extra, bench=name)} for name, extra in extra_by_bench.items()]}
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(data))
    return str(path)


def _status(tmp_path, extra_by_bench, floor_list=FAKE):
    return [status for _, _, status in gate.check(gate.load(_write(tmp_path, extra_by_bench)), floor_list)]


def test_above_floor_passes_below_fails(tmp_path):
    assert _status(tmp_path, {"cache": {"speed_vs_c": 0.61}, "step": {"nested": {"over_base": 1.29}}}) == \
        ["pass", "pass"]
    assert _status(tmp_path, {"cache": {"speed_vs_c": 0.59}, "step": {"nested": {"over_base": 1.29}}}) == \
        ["FAIL", "pass"]
    # a "max" metric fails above its floor
    assert _status(tmp_path, {"cache": {"speed_vs_c": 2.0}, "step": {"nested": {"over_base": 1.31}}}) == \
        ["pass", "FAIL"]
    # exactly at the floor passes
    assert _status(tmp_path, {"cache": {"speed_vs_c": 0.6}, "step": {"nested": {"over_base": 1.3}}}) == \
        ["pass", "pass"]


def test_missing_metric_fails(tmp_path):
    # the bench is absent, the key is absent, the value is not a number
    assert _status(tmp_path, {"step": {"nested": {"over_base": 1.0}}}) == ["MISSING", "pass"]
    assert _status(tmp_path, {"cache": {"speed_vs_dict": 50.0}, "step": {"nested": {}}}) == \
        ["MISSING", "MISSING"]
    assert _status(tmp_path, {"cache": {"speed_vs_c": "fast"}, "step": {"nested": {"over_base": True}}}) == \
        ["MISSING", "MISSING"]


def _at_floor():
    """extra_info for every real floor, each metric exactly at its floor."""
    extra = {}
    for f in floors.FLOORS:
        bench, _, key = f.metric.partition(":")
        node = extra.setdefault(bench, {})
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = f.floor
    return extra


def test_gate_exit_status_on_the_real_floors(tmp_path, capsys):
    extra = _at_floor()
    path = _write(tmp_path, extra)
    assert gate.main(["--no-run", "--json", path]) == 0
    assert "gate: pass" in capsys.readouterr().out
    # one ratio just beyond its floor: exit 1, the table says which
    f = floors.FLOORS[0]
    bench, _, key = f.metric.partition(":")
    extra[bench][key] = f.floor * (0.99 if f.direction == "min" else 1.01)
    assert gate.main(["--no-run", "--json", _write(tmp_path, extra)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and f.metric in out
    # a bench that reported nothing fails the gate too
    del extra[bench]
    assert gate.main(["--no-run", "--json", _write(tmp_path, extra)]) == 1
    assert "MISSING" in capsys.readouterr().out
    # no JSON at all (the suite crashed before writing it)
    assert gate.main(["--no-run", "--json", str(tmp_path / "none.json")]) == 1


def test_failed_suite_fails_the_gate(tmp_path):
    assert gate.gate(_write(tmp_path, _at_floor()), suite_code=1) == 1


def test_floor_rule():
    # spread (1.2 - 0.8) / 1.0 = 0.4; worst of target 0.8 and min 0.8 -> 0.8 / 1.4
    assert floor_from_spread("min", 0.8, [1.0, 0.8, 1.2]) == pytest.approx(0.8 / 1.4)
    # target not met (worst 0.5 < 0.8): the floor guards the level reached; spread at least 10%
    assert floor_from_spread("min", 0.8, [0.5, 0.5, 0.5]) == pytest.approx(0.5 / 1.1)
    # "max": one spread above the larger of target and worst; (1.3 - 1.0) / 1.05
    assert floor_from_spread("max", 1.1, [1.0, 1.05, 1.3]) == pytest.approx(1.3 * (1 + 0.3 / 1.05))
    assert floor_from_spread("max", None, [0.0, 0.0, 0.02]) == pytest.approx(0.02 * (1 + 0.10))


def test_real_floors_are_set_and_never_stricter_than_their_target():
    metrics = [f.metric for f in floors.FLOORS]
    assert len(metrics) == len(set(metrics))
    for f in floors.FLOORS:
        assert f.direction in ("min", "max") and ":" in f.metric and f.what and f.against, f
        assert f.floor is not None, f
        if f.target is not None:
            assert (f.floor <= f.target) if f.direction == "min" else (f.floor >= f.target), f
