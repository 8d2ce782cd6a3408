"""How much of a pytest run is MindSpore compiling graphs: a pytest plugin, and the summary of its log.

    PYTHONPATH=tools .venv/bin/python -m pytest -p compile_share -n 2 -m "not serial" tests
    .venv/bin/python tools/compile_share.py compile-share.jsonl        # the summary, by test file

The plugin times each call of MindSpore's graph compile (``_CellGraphExecutor.compile``: parsing, type
inference, the passes and the backend of a cell's graph, on its first call and on each new input shape).
A call that finds its graph compiled returns in microseconds; calls under 20 ms are not counted. Each test
appends one JSON line to ``$RECBOOST_COMPILE_SHARE`` (default ``compile-share.jsonl``): its node id, its
seconds (setup, call and teardown), the seconds it spent compiling and how many graphs it compiled. Each
xdist worker appends its own lines. A test that starts processes (msrun, the command line in a child, a
``fresh_process`` test) counts its own process only.
"""
import collections
import json
import os
import sys
import time

import pytest

COUNTED = 0.02          # seconds: a compile call shorter than this found its graph compiled


def _log_path():
    return os.environ.get("RECBOOST_COMPILE_SHARE", "compile-share.jsonl")


# ---- the plugin (pytest -p compile_share) ------------------------------------------------------------
_test = {"compiles": 0, "seconds": 0.0}


def _timed(compile_graph):
    def compile(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_graph(self, *args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            if spent >= COUNTED:
                _test["compiles"] += 1
                _test["seconds"] += spent
    return compile


def pytest_configure(config):
    from mindspore.common import api
    api._CellGraphExecutor.compile = _timed(api._CellGraphExecutor.compile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _test.update(compiles=0, seconds=0.0)
    start = time.perf_counter()
    yield
    line = {"test": item.nodeid, "seconds": round(time.perf_counter() - start, 3),
            "compiling": round(_test["seconds"], 3), "compiles": _test["compiles"]}
    with open(_log_path(), "a") as log:
        log.write(json.dumps(line) + "\n")


# ---- the summary (python tools/compile_share.py LOG) -------------------------------------------------
_FIELDS = {"test", "seconds", "compiling", "compiles"}


def summary(path, top=15):
    """The log's totals and its ``top`` test files by seconds compiling, as lines of text."""
    tests = []
    with open(path) as log:
        for number, line in enumerate(log, 1):
            if not line.strip():
                continue
            try:
                test = json.loads(line)
            except json.JSONDecodeError:
                test = None
            if not isinstance(test, dict) or not _FIELDS <= test.keys():
                raise SystemExit("compile_share: %s line %d is not one of the plugin's lines (a JSON object with "
                                 "%s), but %.60r: was the run cut short?" % (path, number, sorted(_FIELDS), line))
            tests.append(test)
    if not tests:
        raise SystemExit("compile_share: %s holds no test" % path)
    seconds = sum(t["seconds"] for t in tests)
    compiling = sum(t["compiling"] for t in tests)
    compiles = sum(t["compiles"] for t in tests)
    out = ["%d tests, %.0f s in tests, %.0f s of it compiling (%.0f%%): %d graphs, %.2f s each"
           % (len(tests), seconds, compiling, 100 * compiling / seconds, compiles, compiling / max(compiles, 1)),
           "%-48s %8s %10s %9s" % ("file", "seconds", "compiling", "graphs")]
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for t in tests:
        row = files[t["test"].split("::")[0]]
        row[0] += t["seconds"]
        row[1] += t["compiling"]
        row[2] += t["compiles"]
    for name, (s, c, n) in sorted(files.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append("%-48s %8.1f %10.1f %9d" % (name, s, c, n))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/compile_share.py LOG (the plugin's JSON lines)")
    print("\n".join(summary(sys.argv[1])))
