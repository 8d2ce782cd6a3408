"""Data-parallel hash tables in a real 2-worker msrun job (CPU, 127.0.0.1): two ranks, each on half of
every global batch, end where one process on the concatenated batches ends (dense parameters, rows
by id, cache statistics, predictions), with caches and rows bit-identical on the two ranks, through
admission, eviction, growth, a full table fed by two features, a batch whose rank-1 half has a NaN
(every rank skips it) and one whose rank-1 half overflows (no rank updates); id-keyed initial rows
across ranks, after re-admission and after a restore; a failure on one rank stops every rank; the
README's msrun example; the default sharding rule and the argument checks."""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from mindspore import nn

import recboost as rb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _tables_dist_worker as worker  # noqa: E402


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("tables_dist")
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [msrun, "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
           "--master_port=%d" % _free_port(), "--join=True", "--log_dir=%s" % (out / "logs"),
           os.path.join(HERE, "_tables_dist_worker.py"), str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - start
    logs = ""
    for name in sorted(os.listdir(out / "logs")) if (out / "logs").exists() else []:
        text = (out / "logs" / name).read_text(errors="replace")
        logs += "\n".join(line for line in text.splitlines() if "Traceback" in line or "Error" in line)[-3000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    print("msrun job: %.1f s wall" % wall)
    return [dict(np.load(out / ("rank_%d.npz" % r))) for r in range(2)]


@pytest.fixture(scope="module")
def reference():
    """One process (stand-alone) on the concatenated global batches, GRAPH mode like the workers."""
    import mindspore as ms
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    try:
        table, model, hook = worker.make_model()
        log = []
        worker.record_initial_rows(table, log)
        batches = worker.global_batches()
        model.train(1, batches, callbacks=[hook])
        assert table.resolved_sharding == "none" and model._exchange is None
        out = worker.results(table, model, hook, batches[0])
        out["init_calls"] = np.array([len(ids) for ids, _ in log])
        return out, table
    finally:
        ms.set_context(mode=mode)


def _by_id(result, name):
    """(ids, their rows) of every id of table ``name`` that holds a row (by id, not by row number),
    and the shared default row 0."""
    keys, rows = result[name + ":cache:keys"], result[name + ":cache:rows"]
    held = rows >= 2                                   # rows 0 and 1 are reserved
    return keys[held], result[name + ":table"][rows[held]], result[name + ":table"][0]


def test_ranks_are_bit_identical(job):
    r0, r1 = job
    for key in r0:
        if key in ("seconds", "bytes_sent", "failure"):
            continue
        np.testing.assert_array_equal(r0[key], r1[key], err_msg=key)
    assert r0["tables"].tolist() == ["ids", "bags", "pair"]
    assert r0["sharding"].tolist() == ["data_parallel"] * 3     # the default under a data-parallel context
    assert bool(r0["mean"])                               # gradients_mean=True: the row sums are averaged


def test_two_ranks_equal_one_process_on_the_concatenated_batches(job, reference):
    r0 = job[0]
    ref, _ = reference
    assert int(r0["step"]) == int(ref["step"]) == worker.STEPS - 1      # the NaN batch skipped by both
    assert int(r0["skipped"]) == int(ref["skipped"]) == 1
    assert int(r0["overflow_steps"]) == int(job[1]["overflow_steps"]) == int(ref["overflow_steps"]) == 1
    for table in ("ids", "bags", "pair"):
        for name in rb._HASH_STAT_NAMES:                  # admission, eviction, growth: the same decisions
            key = table + ":cache:" + name
            assert int(r0[key]) == int(ref[key]), key
        for key in ("keys", "rows", "counts", "last_seen", "free_rows", "capacity", "now"):   # row numbers too
            np.testing.assert_array_equal(r0[table + ":cache:" + key], ref[table + ":cache:" + key], err_msg=key)
        ids_dp, rows_dp, default_dp = _by_id(r0, table)
        ids_ref, rows_ref, default_ref = _by_id(ref, table)
        np.testing.assert_array_equal(ids_dp, ids_ref)
        np.testing.assert_allclose(rows_dp, rows_ref, rtol=1e-5, atol=1e-6, err_msg=table)
        np.testing.assert_allclose(default_dp, default_ref, rtol=1e-5, atol=1e-6, err_msg=table)
    assert int(ref["ids:cache:evicted"]) > 0 and int(ref["ids:cache:grown"]) > 0
    assert int(ref["ids:cache:rejected"]) > 0 and int(ref["bags:cache:grown"]) > 0
    assert int(ref["pair:cache:overflowed"]) > 0          # a full table: which ids win depends on the order
    assert int(r0["evictions"]) == int(ref["evictions"]) > 0
    dense = [k for k in ref if k.startswith("dense:")]
    assert dense and sorted(dense) == sorted(k for k in r0 if k.startswith("dense:"))
    for key in dense:
        np.testing.assert_allclose(r0[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(r0["predict"], ref["predict"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r0["init_calls"], ref["init_calls"])


def test_initial_rows_are_id_keyed_across_ranks(job):
    r0, r1 = job
    batches = worker.global_batches()
    only_rank1 = set(np.unique(worker.half(batches[0], 1)["ids"])) - set(np.unique(worker.half(batches[0], 0)["ids"]))
    for result in (r0, r1):
        ids, rows = result["init_ids"], result["init_rows"]
        want = np.empty_like(rows)
        rb.init_rows(ids, 3, 0.1, want)             # one process, the table's seed and stddev
        np.testing.assert_array_equal(rows, want)
        assert only_rank1 & set(ids.tolist())        # ids first admitted from rank 1's half are among them
        values, counts = np.unique(ids, return_counts=True)
        again = values[counts > 1]                   # evicted, then admitted again: the same initial row
        assert again.size > 0
        for i in again[:5]:
            first = rows[ids == i]
            assert (first == first[0]).all()


def test_a_restore_on_every_rank_continues_exactly(job):
    """Each rank restores its own checkpoint (written after 5 of the 8 global batches) into a fresh
    model and trains the rest: the same bits as the run without the stop; ids evicted before the
    checkpoint and admitted again after the restore get their id-keyed initial rows."""
    for result in job:
        restored = [k for k in result if k.startswith("restored:") and not k.startswith("restored:init_")]
        assert len(restored) > 10
        for key in restored:
            np.testing.assert_array_equal(result[key], result[key[len("restored:"):]], err_msg=key)
        ids, rows = result["restored:init_ids"], result["restored:init_rows"]
        assert ids.size > 0 and set(ids.tolist()) & set(range(0, 30))      # pool A's ids, back after B
        want = np.empty_like(rows)
        rb.init_rows(ids, 3, 0.1, want)
        np.testing.assert_array_equal(rows, want)


def test_a_batch_failing_on_one_rank_stops_every_rank(job):
    r0, r1 = job
    assert int(r0["failure_step"]) == int(r1["failure_step"]) == 1
    assert str(r1["failure"]).startswith("TypeError") and "batch item 1" in str(r1["failure"])
    assert str(r0["failure"]).startswith("RuntimeError") and "rank 1 could not prepare" in str(r0["failure"])


def test_bytes_sent_are_counted(job):
    r0, r1 = job
    assert int(r0["bytes_sent"]) > 0 and int(r1["bytes_sent"]) > 0


def test_the_readme_msrun_example_runs(tmp_path):
    """The README's data-parallel example, as written, under the README's msrun command (2 ranks)."""
    import re
    root = os.path.dirname(HERE)
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("### Hash tables across processes (msrun)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(code)
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, PYTHONPATH=root,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [msrun, "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
           "--master_port=%d" % _free_port(), "--join=True", "--log_dir=%s" % (tmp_path / "logs"), str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    logs = {r: (tmp_path / "logs" / ("worker_%d.log" % r)).read_text(errors="replace")
            if (tmp_path / "logs" / ("worker_%d.log" % r)).exists() else "" for r in range(2)}
    assert proc.returncode == 0, proc.stderr[-2000:] + logs[0][-2000:]
    lines = [re.search(r"^rank %d (\S+) (\d+) (\d+)$" % r, logs[r], re.M) for r in range(2)]
    assert all(lines), logs[0][-2000:] + logs[1][-2000:]
    assert lines[0].groups()[:2] == lines[1].groups()[:2] == ("data_parallel", "20")
    assert lines[0].group(3) == lines[1].group(3) and int(lines[0].group(3)) > 1000    # the same ids held


def test_default_sharding_in_one_process_and_argument_checks(graph_mode):
    table = rb.HashEmbedding(4, 16, input_index=1)
    assert table.sharding is None and table.resolved_sharding is None
    net = rb.WideDeep(2, 2, 3, (4,), embedding=rb.HashEmbedding(4, 16, input_index=1))
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(8, 2)).astype(np.float32), rng.integers(0, 9, (8, 2)),
             np.ones((8, 1), np.float32))
    model.train(1, [batch])
    assert net.embedding.resolved_sharding == "none" and model._exchange is None
    assert rb.HashEmbedding(4, 16, sharding="none").resolved_sharding == "none"
    assert rb.HashEmbedding(4, 16, sharding="data_parallel").sharding == "data_parallel"
    assert rb.create_table("t", 4, 16, sharding="none").sharding == "none"
    with pytest.raises(ValueError, match="sharding.*row_wise.*not implemented"):
        rb.HashEmbedding(4, 16, sharding="row_wise")
    with pytest.raises(ValueError, match="sharding"):
        rb.HashEmbedding(4, 16, sharding="rows")
    # data_parallel asked for without a data-parallel context: a clear error before anything changes
    net = rb.WideDeep(2, 2, 3, (4,), embedding=rb.HashEmbedding(4, 16, input_index=1, sharding="data_parallel"))
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    with pytest.raises(ValueError, match="sharding.*data-parallel context"):
        model.train(1, [batch])
    assert len(net.embedding.cache) == 0
