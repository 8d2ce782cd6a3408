"""Data-parallel hash tables (issue 12): 2 ranks against 1 on the same global batch, under msrun.

``test_dist_two_ranks_vs_one`` launches ``bench/_dist_worker.py`` twice with msrun on 127.0.0.1: one
rank on the whole global batch (2048 rows; sharding "none"), then two ranks each on its half (sharding
"data_parallel": the id exchange and the row-gradient AllReduce each step). Same model (Wide&Deep,
26 x (16+1) on one 1M-row HashEmbedding, MLP 400-400-1), same stream, warm-up steps untimed. Reported:
seconds per step of each (the slower rank for two), ``two_over_one`` (their ratio: below 1 is a
speed-up), bytes each rank puts into the collectives per step, and the seconds per step spent in
them. Ungated (not in bench/floors.py; bench/gate.py leaves it out): on the 2-core machines the two
ranks share the cores the one rank has to itself, so the figure says what the exchange costs, not
what two machines would gain.

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_dist.py
    (RECBOOST_BENCH_QUICK=1: short)
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

from _harness import QUICK, record

HERE = os.path.dirname(os.path.abspath(__file__))
GLOBAL_BATCH = 2048
STEPS = 10 if QUICK else 30
WARMUP = 3


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(ranks, out):
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [msrun, "--worker_num=%d" % ranks, "--local_worker_num=%d" % ranks, "--master_addr=127.0.0.1",
           "--master_port=%d" % _free_port(), "--join=True", "--log_dir=%s" % os.path.join(out, "logs"),
           os.path.join(HERE, "_dist_worker.py"), out, str(GLOBAL_BATCH), str(STEPS), str(WARMUP)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = []
    for r in range(ranks):
        with open(os.path.join(out, "rank_%d.json" % r)) as fh:
            results.append(json.load(fh))
    return results


def test_dist_two_ranks_vs_one(benchmark):
    with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as two_dir:
        one = benchmark.pedantic(_run, args=(1, one_dir), rounds=1, iterations=1)
        two = _run(2, two_dir)
    assert one[0]["sharding"] == "none" and all(r["sharding"] == "data_parallel" for r in two)
    assert two[0]["ids_held"] == two[1]["ids_held"] == one[0]["ids_held"]     # the same ids admitted
    one_step = one[0]["seconds_per_step"]
    two_step = max(r["seconds_per_step"] for r in two)
    record("dist_tables", {
        "global_batch": GLOBAL_BATCH, "steps": STEPS,
        "one_rank_seconds_per_step": one_step, "two_ranks_seconds_per_step": two_step,
        "two_over_one": two_step / one_step,
        "bytes_sent_per_rank_per_step": max(r["bytes_sent_per_step"] for r in two),
        "exchange_seconds_per_step": max(r["exchange_seconds_per_step"] for r in two)}, benchmark)
