"""Bench: ``python -m recboost train`` on files (issue #26, item 6): memory and speed of the stream.

- ``test_train_cli_peak_rss``: peak RSS of ``python -m recboost train --data FILE`` (a fresh process
  each, measured by a parent that runs only it: ``getrusage(RUSAGE_CHILDREN).ru_maxrss``) on a
  generated file of TRAIN_CLI_ROWS lines and one 4 times longer, with a table in a fixed budget
  (TABLE_IN_BUDGET). Streaming means the same within 5% (``rss_ratio`` <= 1.05, asserted). Each
  run's summary is checked: every line of the file trained.
- ``test_train_cli_file_vs_ready_batches``: the same model (the job's network, progressive
  validation on every batch) trained on the same rows read from the file (``_CriteoInput``) and on
  the same batches parsed beforehand (a list), both after the same warm-up (compilation); rows/s of
  the file over rows/s of the ready batches (target >= 0.85), in ABBA order.

Defaults: 1M rows (RECBOOST_BENCH_QUICK=1 or TRAIN_CLI_ROWS=N: fewer). Not in the gate (minutes of
training, and its baseline has no ``train`` command). Run:

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_train_cli.py
"""
import os
import re
import subprocess
import sys
import time

import mindspore as ms
import pytest
from mindspore import nn

import recboost as rb
from _harness import QUICK, TREE, record

pytestmark = pytest.mark.untimed

ROWS = int(os.environ.get("TRAIN_CLI_ROWS", 20_000 if QUICK else 1_000_000))
#: the table of the RSS runs keeps a fixed budget (its rows and, by default then, a count-min sketch for
#: admission), so what the two runs' memory could differ by is the input path alone: a growing table's
#: memory follows the distinct ids of its data by design, whatever reads it
TABLE_IN_BUDGET = ["--capacity", str(1 << 18), "--eviction-policy", "lru"]
BATCH = 2048

_PEAK = ("import resource, subprocess, sys; out = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "sys.stderr.write(out.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
         "sys.exit(out.returncode)")


def _peak_rss_kib(path):
    """(peak RSS in KiB of one ``train`` process on ``path``, rows it trained)."""
    cmd = [sys.executable, "-c", _PEAK, sys.executable, "-m", "recboost", "train", "--data", path,
           "--batch-size", str(BATCH), "--progress-seconds", "1e9"] + TABLE_IN_BUDGET
    out = subprocess.run(cmd, cwd=TREE, capture_output=True, text=True, timeout=24 * 3600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = int(re.search(r"(\d+) rows trained in this run", out.stderr).group(1))
    return int(out.stdout.split()[-1]), rows


def test_train_cli_peak_rss(tmp_path):
    small, large = str(tmp_path / "small.txt"), str(tmp_path / "large.txt")
    rb.SyntheticClickStream(seed=0).write_criteo(small, ROWS)
    rb.SyntheticClickStream(seed=0).write_criteo(large, 4 * ROWS)
    rss_small, rows_small = _peak_rss_kib(small)
    rss_large, rows_large = _peak_rss_kib(large)
    assert (rows_small, rows_large) == (ROWS, 4 * ROWS)
    record("train_cli_rss", {"rows": [ROWS, 4 * ROWS], "peak_rss_mib": [rss_small / 1024, rss_large / 1024],
                             "rss_ratio": rss_large / rss_small, "target": "rss_ratio <= 1.05"})
    assert rss_large / rss_small <= 1.05, (rss_small, rss_large)


def _model():
    net, _ = rb._job_network("widedeep", 0, 1e-3, {"capacity": 1 << 20, "access_threshold": 1})
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))


def _monitor():
    return rb.ProgressMonitor(every_seconds=1e9, eval_every=1, printer=lambda line: None)


def test_train_cli_file_vs_ready_batches(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    path = str(tmp_path / "day.txt")
    warm = 20
    rb.SyntheticClickStream(seed=0).write_criteo(path, ROWS + warm * BATCH)
    with open(path, "rb") as fh:                    # the byte offset of the first timed line
        offset = sum(len(next(fh)) for _ in range(warm * BATCH))
    reader = rb.CriteoReader(path, batch_size=BATCH)
    batches = list(reader)
    ready, warmup = batches[warm:], batches[:warm]
    start = {"offset": offset, "lines": warm * BATCH, "rows": warm * BATCH}
    seconds = {"file": [], "ready": []}
    for name in ("file", "ready", "ready", "file"):
        model = _model()
        model.online_train(warmup, callbacks=[_monitor()], dataset_sink_mode=False)
        data = rb._CriteoInput([path], BATCH, starts=[start]) if name == "file" else ready
        t0 = time.perf_counter()
        model.online_train(data, callbacks=[_monitor()], dataset_sink_mode=False)
        seconds[name].append(time.perf_counter() - t0)
        assert model.samples == ROWS + warm * BATCH
    rate = {k: ROWS / (sum(v) / len(v)) for k, v in seconds.items()}
    record("train_cli_file_vs_ready", {"rows": ROWS, "rows_per_second": rate,
                                       "file_over_ready": rate["file"] / rate["ready"], "target": ">= 0.85"})
