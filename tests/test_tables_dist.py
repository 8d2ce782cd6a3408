"""Data-parallel hash tables in a real 2-worker msrun job (CPU, 127.0.0.1): two ranks, each on half of
every global batch, end where one process on the concatenated batches ends (dense parameters, rows
by id, cache statistics, predictions), with caches and rows bit-identical on the two ranks, through
admission, eviction, growth, a full table fed by two features, two tables reading one ids item, a
batch whose rank-1 half has a NaN (every rank skips it) and one whose rank-1 half overflows (no rank
updates); id-keyed initial rows across ranks, after re-admission and after a restore; a failure on
one rank stops every rank; the msrun example of docs/distributed.md; the default sharding rule and the argument checks.

Row-wise tables the same way: each rank holds only the ids it owns, and the shards together end where
one process ends (by id), the full table included; checkpoints in parts with a manifest (2 -> 2 bit
for bit, 2 -> 1, 1 -> 2, a missing or altered part, a part that cannot be written); ``reshard_states`` in
one process. A rank that fails ends the job and the last checkpoint resumes in one process: a killed
rank (row-wise tables), and a stalled one, ended by the exchange watchdog (data-parallel tables)."""
import os
import sys

import numpy as np
import pytest
from mindspore import nn

import recboost as rb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _tables_dist_worker as worker  # noqa: E402
from _dist import FAILING_JOB_ENV, graph_mode_on_cpu, msrun, msrun_results  # noqa: E402

# msrun jobs or kills at chosen moments: the whole suite's serial part (make test-all), not the
# newcomer's check (make test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One msrun launch for every successful 2-rank run of this file (an msrun start costs more than most
    of what it runs): the worker with data-parallel tables, then with row-wise ones, each also resuming
    from one process's checkpoint after 5 global batches (1 -> 2), then tests/_finite_dist_worker.py's
    cases. ``(output folder, name % rank ->
    [rank 0's results, rank 1's])``."""
    out = tmp_path_factory.mktemp("tables_dist")
    with graph_mode_on_cpu():
        _, model, hook = worker.make_model()
        model.train(1, worker.global_batches()[:5], callbacks=[hook])
        one = model.save_checkpoint(str(out / "one.npz"))
    msrun_results(out, os.path.join(HERE, "_tables_dist_worker.py"), "rank_%d.npz", out, "--resume", one,
                  "--finite", "none", "row_wise")
    return out, lambda name: [dict(np.load(out / (name % r))) for r in range(2)]


@pytest.fixture(scope="module")
def job(launch):
    """Each rank's results with data-parallel tables."""
    return launch[1]("rank_%d.npz")


@pytest.fixture(scope="module")
def reference():
    """One process (stand-alone) on the concatenated global batches, GRAPH mode like the workers."""
    with graph_mode_on_cpu():
        table, model, hook = worker.make_model()
        log = []
        worker.record_initial_rows(table, log)
        batches = worker.global_batches()
        model.train(1, batches, callbacks=[hook])
        assert table.resolved_sharding == "none" and model.exchange_stats() is None
        out = worker.results(table, model, hook, batches[0])
        out["init_calls"] = np.array([len(ids) for ids, _ in log])
        return out, table


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
    assert r0["tables"].tolist() == ["ids", "bags", "pair", "wide"]
    assert r0["sharding"].tolist() == ["data_parallel"] * 4     # the default under a data-parallel context
    assert bool(r0["mean"])                               # gradients_mean=True: the row sums are averaged


def _assert_like_one_process(result, ref):
    """``result`` (a rank's) ends where one process ``ref`` ended: every cache decision exactly (row
    numbers too), rows by id, dense parameters and predictions to fp32 summation-order tolerance."""
    assert int(result["step"]) == int(ref["step"])
    assert int(result["skipped"]) == int(ref["skipped"]) and int(result["overflow_steps"]) == int(ref["overflow_steps"])
    for table in ("ids", "bags", "pair", "wide"):
        for name in rb._HASH_STAT_NAMES:                  # admission, eviction, growth: the same decisions
            key = table + ":cache:" + name
            assert int(result[key]) == int(ref[key]), key
        for key in ("keys", "rows", "counts", "last_seen", "free_rows", "capacity", "now"):   # row numbers too
            np.testing.assert_array_equal(result[table + ":cache:" + key], ref[table + ":cache:" + key], err_msg=key)
        ids_dp, rows_dp, default_dp = _by_id(result, table)
        ids_ref, rows_ref, default_ref = _by_id(ref, table)
        np.testing.assert_array_equal(ids_dp, ids_ref)
        np.testing.assert_allclose(rows_dp, rows_ref, rtol=1e-5, atol=1e-6, err_msg=table)
        np.testing.assert_allclose(default_dp, default_ref, rtol=1e-5, atol=1e-6, err_msg=table)
    dense = [k for k in ref if k.startswith("dense:")]
    assert dense and sorted(dense) == sorted(k for k in result if k.startswith("dense:"))
    for key in dense:
        np.testing.assert_allclose(result[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in ("predict", "predict_padding"):
        np.testing.assert_allclose(result[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_two_ranks_equal_one_process_on_the_concatenated_batches(job, reference):
    r0 = job[0]
    ref, _ = reference
    assert int(r0["step"]) == worker.STEPS - 1      # the NaN batch skipped by both
    assert int(r0["skipped"]) == 1
    assert int(r0["overflow_steps"]) == int(job[1]["overflow_steps"]) == 1
    _assert_like_one_process(r0, ref)
    assert int(ref["ids:cache:evicted"]) > 0 and int(ref["ids:cache:grown"]) > 0
    assert int(ref["ids:cache:rejected"]) > 0 and int(ref["bags:cache:grown"]) > 0
    assert int(ref["pair:cache:overflowed"]) > 0          # a full table: which ids win depends on the order
    assert int(r0["evictions"]) == int(ref["evictions"]) > 0
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


def test_the_readme_msrun_example_runs(early_launch):
    """The data-parallel example of docs/distributed.md, as written, under its msrun command (2 ranks),
    started when the tests were collected (conftest's ``_early_launches``)."""
    import re
    (proc, _, _), out = early_launch("readme", timeout=240)
    logs = {r: (out / "readme" / "logs" / ("worker_%d.log" % r)).read_text(errors="replace")
            if (out / "readme" / "logs" / ("worker_%d.log" % r)).exists() else "" for r in range(2)}
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
    assert net.embedding.resolved_sharding == "none" and model.exchange_stats() is None
    assert rb.HashEmbedding(4, 16, sharding="none").resolved_sharding == "none"
    assert rb.HashEmbedding(4, 16, sharding="data_parallel").sharding == "data_parallel"
    assert rb.create_table("t", 4, 16, sharding="none").sharding == "none"
    assert rb.HashEmbedding(4, 16, sharding="row_wise").shard == (0, 1)
    with pytest.raises(ValueError, match="sharding.*'rows'"):
        rb.HashEmbedding(4, 16, sharding="rows")
    # data_parallel or row_wise asked for without a data-parallel context: a clear error before anything changes
    for sharding in ("data_parallel", "row_wise"):
        net = rb.WideDeep(2, 2, 3, (4,), embedding=rb.HashEmbedding(4, 16, input_index=1, sharding=sharding))
        model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
        with pytest.raises(ValueError, match="sharding.*data-parallel context.*%s" % sharding):
            model.train(1, [batch])
        assert len(net.embedding.cache) == 0 and net.embedding.capacity == 16


@pytest.mark.parametrize("optimizer, row_dtype", [(rb.SparseAdam, "float32"), (rb.SparseRowWiseAdagrad, "float32"),
                                                  (rb.SparseAdam, "bfloat16")],
                         ids=["adam", "rowwise_adagrad", "adam_bfloat16"])
def test_reshard_splits_and_merges_a_table_exactly(graph_mode, optimizer, row_dtype):
    """``reshard_states`` on real trained states: one table split into 2 and 3 owner shards and merged back
    gives every id its row (bfloat16 rows stay 16-bit), slots (one value per row for row-wise
    Adagrad), count and last-seen time; the default row, scalars, clock and rounding counter follow;
    statistics are totals; a shard holds only ids it owns."""
    table = rb.HashEmbedding(4, 64, access_threshold=1, eviction_threshold=3, optimizer=optimizer(0.1),
                             seed=2, name="t", row_dtype=row_dtype)
    rng = np.random.default_rng(1)
    for step in range(6):
        batch = table.prepare(rng.integers(0, 80, 50), timestamp=step)
        table.take(batch)
        table.apply_gradients(batch, rng.normal(size=(50, 4)).astype(np.float32))
        table.evict(step)
    whole = table.check_state_dict(table.state_dict())
    for world in (2, 3):
        shards = [table.reshard_states([whole], r, world) for r in range(world)]
        for r, shard in enumerate(shards):
            assert (rb._owner_of(shard["cache"]["keys"], world) == r).all()
            np.testing.assert_array_equal(shard["table"][0], whole["table"][0])
            assert shard["cache"]["step"] == whole["cache"]["step"] and shard["cache"]["now"] == whole["cache"]["now"]
            assert shard["scalars"] == whole["scalars"] and shard["rounds"] == whole["rounds"]
            assert shard["table"].dtype == whole["table"].dtype == table.weight.dtype
        assert sum(s["cache"]["keys"].size for s in shards) == whole["cache"]["keys"].size
        assert shards[0]["cache"]["admitted"] == whole["cache"]["admitted"] > 0 and shards[1]["cache"]["admitted"] == 0
        back = table.reshard_states([table.check_state_dict(s) for s in shards], 0, 1)
        for key in ("keys", "counts", "last_seen"):
            np.testing.assert_array_equal(back["cache"][key], whole["cache"][key])
        assert ((back["cache"]["rows"] >= 0) == (whole["cache"]["rows"] >= 0)).all()
        held = whole["cache"]["rows"] >= 0
        for name in ("table", "slots"):
            get = (lambda st, rows: st["table"][rows]) if name == "table" else \
                (lambda st, rows: np.stack([st["slots"][k][rows] for k in sorted(st["slots"])]))
            np.testing.assert_array_equal(get(back, back["cache"]["rows"][held]), get(whole, whole["cache"]["rows"][held]))
        fresh = rb.HashEmbedding(4, 64, access_threshold=1, eviction_threshold=3, optimizer=optimizer(0.1),
                                 seed=2, name="t", row_dtype=row_dtype)
        fresh.load_state_dict(back)
        probe = rng.integers(0, 80, 30)
        np.testing.assert_array_equal(fresh.gather(fresh.prepare(probe, is_train=False)),
                                      table.gather(table.prepare(probe, is_train=False)))


# ---- row-wise tables ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rw_job(launch):
    """The worker with every table row-wise: ``(output folder, [rank 0's results, rank 1's])``."""
    return launch[0], launch[1]("row_wise_rank_%d.npz")


def _assert_by_id_like_one_process(results, ref):
    """The shards ``results`` (each rank's, or one process's) together end where one process ``ref``
    ended: the same ids tracked, with the same counts and last-seen times, the same ids holding
    rows, every cache statistic but growth summed over the shards, rows by id, the default row,
    dense parameters and predictions to fp32 summation-order tolerance."""
    for result in results:
        assert int(result["step"]) == int(ref["step"])
        assert int(result["skipped"]) == int(ref["skipped"])
        assert int(result["overflow_steps"]) == int(ref["overflow_steps"])
        for key in [k for k in ref if k.startswith("dense:")] + ["predict", "predict_padding"]:
            np.testing.assert_allclose(result[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for table in ("ids", "bags", "pair", "wide"):
        for name in set(rb._HASH_STAT_NAMES) - {"grown"}:      # a shard grows on its own
            key = table + ":cache:" + name
            assert sum(int(r[key]) for r in results) == int(ref[key]), key
        keys = np.concatenate([r[table + ":cache:keys"] for r in results])
        order = np.argsort(keys)
        np.testing.assert_array_equal(keys[order], ref[table + ":cache:keys"])
        for key in ("counts", "last_seen"):
            got = np.concatenate([r[table + ":cache:" + key] for r in results])[order]
            np.testing.assert_array_equal(got, ref[table + ":cache:" + key], err_msg=table + key)
        rows = np.concatenate([r[table + ":cache:rows"] for r in results])[order]
        ref_rows = ref[table + ":cache:rows"]
        np.testing.assert_array_equal(rows >= 0, ref_rows >= 0)
        values = np.concatenate([r[table + ":table"][np.maximum(r[table + ":cache:rows"], 0)]
                                 for r in results])[order]
        np.testing.assert_allclose(values[ref_rows >= 0], ref[table + ":table"][ref_rows[ref_rows >= 0]],
                                   rtol=1e-5, atol=1e-6, err_msg=table)
        for result in results:
            np.testing.assert_allclose(result[table + ":table"][0], ref[table + ":table"][0], rtol=1e-5, atol=1e-6)


def test_row_wise_ranks_hold_their_own_ids_and_agree_on_the_rest(rw_job):
    _, (r0, r1) = rw_job
    assert r0["sharding"].tolist() == ["row_wise"] * 4
    for table in ("ids", "bags", "pair", "wide"):
        for rank, result in enumerate((r0, r1)):
            keys = result[table + ":cache:keys"]
            assert keys.size and (rb._owner_of(keys, 2) == rank).all(), table
        # rows 0 (the shared default row) and 1: the same on both ranks, like the dense state
        np.testing.assert_array_equal(r0[table + ":table"][:2], r1[table + ":table"][:2])
    # the full 12-row table: its 10 rows for ids are shared by the shards (each started at 2 + 5 rows
    # and grows only to hold what the table admits)
    held = [int((r["pair:cache:rows"] >= 0).sum()) for r in (r0, r1)]
    assert sum(held) == 10 and min(held) > 0
    for key in r0:
        if key.startswith("dense:") or key in ("predict", "predict_padding", "step", "skipped", "overflow_steps",
                                               "evictions", "after_failure_step", "after_failure_predict"):
            np.testing.assert_array_equal(r0[key], r1[key], err_msg=key)


def test_row_wise_two_ranks_equal_one_process_on_the_concatenated_batches(rw_job, reference):
    _, ranks = rw_job
    _assert_by_id_like_one_process(ranks, reference[0])
    ref = reference[0]
    assert int(ref["ids:cache:evicted"]) > 0 and int(ref["ids:cache:rejected"]) > 0
    assert int(ranks[0]["ids:cache:grown"]) > 0 and int(ranks[1]["bags:cache:grown"]) > 0
    assert int(ref["pair:cache:rejected"]) > 0 and int(ref["pair:cache:admitted"]) > 0
    assert int(ref["pair:cache:overflowed"]) > 0        # the full table: the shards admit what one process does
    assert int(ranks[0]["evictions"]) == int(ref["evictions"]) > 0
    assert int(ranks[0]["overflow_steps"]) == 1 and int(ranks[0]["skipped"]) == 1


def test_row_wise_initial_rows_are_id_keyed(rw_job):
    _, ranks = rw_job
    for rank, result in enumerate(ranks):
        ids, rows = result["init_ids"], result["init_rows"]
        assert ids.size and (rb._owner_of(ids, 2) == rank).all()      # the owner hands out its ids' rows
        want = np.empty_like(rows)
        rb.init_rows(ids, 3, 0.1, want)
        np.testing.assert_array_equal(rows, want)
        values, counts = np.unique(ids, return_counts=True)
        assert (counts > 1).any()                                      # evicted and admitted again
        for result_key in ("restored:init_ids",):
            restored = result[result_key]
            want = np.empty((restored.size, rows.shape[1]), np.float32)
            rb.init_rows(restored, 3, 0.1, want)
            np.testing.assert_array_equal(result["restored:init_rows"], want)


def test_row_wise_restore_on_the_same_ranks_and_failures(rw_job):
    """2 -> 2: each rank restores its part of the checkpoint (written in parts, with a manifest) and
    ends with the bits of the straight run; a batch failing on one rank stops both."""
    out, ranks = rw_job
    for result in ranks:
        restored = [k for k in result if k.startswith("restored:") and not k.startswith("restored:init_")]
        assert len(restored) > 10
        for key in restored:
            np.testing.assert_array_equal(result[key], result[key[len("restored:"):]], err_msg=key)
    assert sorted(p.name for p in out.glob("ckpt_row_wise*")) == [
        "ckpt_row_wise.npz", "ckpt_row_wise.part-0-of-2.npz", "ckpt_row_wise.part-1-of-2.npz"]
    assert int(ranks[0]["failure_step"]) == int(ranks[1]["failure_step"]) == 1
    assert str(ranks[1]["failure"]).startswith("TypeError")
    assert "rank 1 could not prepare" in str(ranks[0]["failure"])
    for result in ranks:
        assert "RecModel.export" in str(result["export"]) and "row-wise shards" in str(result["export"])
        assert int(result["after_failure_step"]) == int(result["restored:step"]) + 1     # trained on, in step
    assert "No space left on device" in str(ranks[1]["save_failure"])
    assert "rank 1 could not write its part" in str(ranks[0]["save_failure"])
    assert not (out / "ckpt_full_disk.npz").exists() and not list(out.glob("bundle_*"))


def test_row_wise_checkpoint_restores_in_one_process(rw_job, reference, tmp_path):
    """2 -> 1: one process loads the 2-part checkpoint (the shards merged) and trains the rest of the
    global batches: it ends where the straight one-process run ended. A missing, altered or stray
    part is an error naming it, and the model is unchanged."""
    import shutil
    out, _ = rw_job
    batches = worker.global_batches()
    with graph_mode_on_cpu():
        table, model, hook = worker.make_model()
        assert model.load_checkpoint(str(out / "ckpt_row_wise.npz")) == []
        assert model.batches_consumed == 5
        model.train(1, batches[5:], callbacks=[hook])
        result = worker.results(table, model, hook, batches[0])
        _assert_by_id_like_one_process([result], reference[0])
        for name in ("ckpt_row_wise.npz", "ckpt_row_wise.part-0-of-2.npz", "ckpt_row_wise.part-1-of-2.npz"):
            shutil.copy(out / name, tmp_path / name)
        table, model, _ = worker.make_model()
        before = {p.name: p.asnumpy().copy() for p in model.state_parameters()}
        part1 = tmp_path / "ckpt_row_wise.part-1-of-2.npz"
        data = bytearray(part1.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part1.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="rank 1's part .*part-1-of-2.npz.* sha256"):
            model.load_checkpoint(str(tmp_path / "ckpt_row_wise.npz"))
        part1.unlink()
        with pytest.raises(ValueError, match="rank 1's part .*part-1-of-2.npz.*missing"):
            model.load_checkpoint(str(tmp_path / "ckpt_row_wise.npz"))
        with pytest.raises(ValueError, match="part .*rank.*0.*of a row-wise checkpoint"):
            model.load_checkpoint(str(tmp_path / "ckpt_row_wise.part-0-of-2.npz"))
        assert len(table.cache) == 0 and model.step == 0
        for p in model.state_parameters():
            np.testing.assert_array_equal(p.asnumpy(), before[p.name])


# ---- resharding (1 -> 2 and 2 -> 1 ranks) and a rank that dies --------------------------------------
@pytest.mark.parametrize("sharding", [None, "row_wise"])
def test_a_one_process_checkpoint_restores_onto_two_ranks(launch, sharding, request):
    """1 -> 2: one process trains 5 global batches and saves; under msrun both ranks restore that one
    file (row-wise: each keeps the ids it owns) and train their halves of the rest: they end where
    one process ended (the straight run)."""
    ranks = launch[1](("row_wise_" if sharding else "") + "resume_%d.npz")
    if sharding is None:
        for key in ranks[0]:
            np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
        _assert_like_one_process(ranks[0], request.getfixturevalue("reference")[0])
    else:
        _assert_by_id_like_one_process(ranks, request.getfixturevalue("reference")[0])


def _restores_in_one_process(folder, reference):
    """2 -> 1: one process resumes from the latest checkpoint in ``folder`` (a data-parallel rank's, or a
    row-wise manifest with its parts), trains the rest of the global batches and ends where the straight
    run ``reference`` ended."""
    latest = rb.latest_checkpoint(str(folder))
    assert latest is not None and latest.endswith("recboost-4.npz"), latest
    with graph_mode_on_cpu():
        table, model, hook = worker.make_model()
        batches = worker.global_batches()
        model.online_train(batches, callbacks=[hook], resume_from=str(folder))     # its latest checkpoint
        result = worker.results(table, model, hook, batches[0])
    if folder.name.endswith("row_wise"):
        _assert_by_id_like_one_process([result], reference)
    else:
        _assert_like_one_process(result, reference)


def test_a_killed_rank_ends_the_job_and_its_last_checkpoint_restores_in_one_process(early_launch, reference):
    """Rank 1 is killed (SIGKILL) at step 5 while rank 0 goes on into the next exchange: msrun ends the
    job (no hang; a non-zero exit well within the bound), every checkpoint left is complete, and the
    last one (row-wise tables: the last manifest, whose parts both ranks wrote) restores in one
    process (2 -> 1), which trains the rest of the global batches and ends where the straight run
    ended. (Data-parallel tables, each rank's own checkpoints: the stalled rank's job below ends the
    same way, rank 0 waiting in step 6's exchange, and its rank 0's last checkpoint restores there.) The job
    (conftest's ``_early_launches``: tests/_tables_reshard_worker.py, FAILING_JOB_ENV) started when the
    tests were collected."""
    (proc, wall, logs), out = early_launch("kill", timeout=200)
    assert proc.returncode != 0 and wall < 150, (proc.returncode, wall)
    folder = out / "kill_row_wise"
    # keep=1: step 2's manifest and parts were pruned after step 4's were written
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".recboost")) == [
        "recboost-4%s.npz" % part for part in ("", ".part-0-of-2", ".part-1-of-2")]
    _restores_in_one_process(folder, reference[0])


def test_a_stalled_rank_is_ended_by_the_exchange_watchdog(tmp_path, monkeypatch, reference):
    """Rank 1 stalls (sleeps 10 minutes) after step 5, alive, so msrun sees nothing wrong: rank 0 waits in
    the next exchange, and after RECBOOST_EXCHANGE_TIMEOUT seconds its watchdog says which wait, on
    which rank, and exits (code 75); msrun then ends the job. Without the watchdog it would hang past
    the bound. Rank 0's last checkpoint (data-parallel tables: its own) restores in one process (2 -> 1)
    and ends where the straight run ended. A bad RECBOOST_EXCHANGE_TIMEOUT is an error naming it."""
    proc, wall, _ = msrun(tmp_path, os.path.join(HERE, "_tables_reshard_worker.py"), tmp_path, "stall",
                          timeout=240, env=dict(FAILING_JOB_ENV, RECBOOST_EXCHANGE_TIMEOUT="8"))
    log = (tmp_path / "logs" / "worker_0.log").read_text(errors="replace")
    assert proc.returncode != 0 and wall < 200, (proc.returncode, wall)
    assert "[recboost] rank 0 of 2: an AllGather of the hash tables' exchange has waited more than 8 s" in log
    _restores_in_one_process(tmp_path / "kill_0", reference[0])
    for bad in ("soon", "-1", "inf"):
        monkeypatch.setenv("RECBOOST_EXCHANGE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="RECBOOST_EXCHANGE_TIMEOUT must be a number of seconds >= 0"):
            rb._exchange_timeout()
    monkeypatch.setenv("RECBOOST_EXCHANGE_TIMEOUT", "0")
    assert rb._exchange_timeout() == 0


def test_a_row_wise_row_that_another_ranks_gradient_would_overflow_is_skipped(launch):
    """A row-wise table's row is updated by its owner with every rank's gradient of it: rank 0's rows at
    float32's largest accumulator, rank 1's gradients squaring to ~1e33 (finite against its own rows). The
    ranks share their rows' bounds, so rank 1 bounds its gradient against rank 0's rows: every rank skips the
    step, counted, and no row, slot or dense parameter changes on either rank. The same job then sums a
    data-parallel table's row gradients over the ranks (below)."""
    results = launch[1]("finite_rank_%d.npz")
    for r in results:
        assert int(r["step"]) == 3 and int(r["overflow_steps"]) == 1
        assert list(r["changed"]) == ["-"] and bool(r["finite"])
    # rows summed over the ranks (gradients_mean=False): each rank's row gradient squares to a finite 2.25e38,
    # their sum to Inf; every rank bounds its own times the ranks, and all skip the step
    for r in results:
        assert not bool(r["summed:mean"])
        assert int(r["summed:step"]) == 2 and int(r["summed:overflow_steps"]) == 1
        assert list(r["summed:changed"]) == ["-"] and bool(r["summed:finite"])
