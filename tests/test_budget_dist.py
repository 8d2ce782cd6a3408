"""Tables in a fixed memory budget across ranks, in a real 2-worker msrun job (CPU, 127.0.0.1): an
"lru" table with the default admission sketch, an "lfu" table (exact counter, admitting at first
sight), a "score" table (admitting and replacing by the scores the labels give its ids: the labels
travel with the ids between the ranks) and a growing table counting candidates in a small ageing
sketch, on a drifting stream that fills the tables within a step or two.

- **Data-parallel**: the ranks decide as one process on the concatenated batches does, every
  decision exactly (which ids each policy replaces, row numbers, counts, times, the sketch's
  counters, the statistics), rows by id and predictions to summation-order tolerance.
- **Row-wise**: a table is full shard by shard (docs/tables.md): each rank's shard decides exactly as
  one table of the shard's capacity fed, step by step, only the ids that rank owns; its ids are its
  own, and the dense parameters and predictions agree on both ranks.
- Both: a checkpoint saved mid-run and restored on the same ranks ends bit for bit where the straight
  run ended; a row-wise checkpoint loads into one process (2 -> 1) and predicts as the two ranks did."""
import os
import sys

import numpy as np
import pytest

import recboost as rb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _budget_dist_worker as worker  # noqa: E402
from _dist import graph_mode_on_cpu  # noqa: E402

# msrun jobs: the whole suite's serial part (make test-all); one test is in the newcomer's check
pytestmark = pytest.mark.serial

TABLES = ("lru", "lfu", "sketch", "score")
SETTINGS = ("access_threshold", "eviction_threshold", "eviction_policy", "lfu_half_life", "admission_counter",
            "sketch_width", "sketch_depth", "sketch_window", "score_half_life", "score_click_weight",
            "score_nonclick_weight", "admit_score")


@pytest.fixture(scope="module")
def job(dist_jobs):
    """``(out, {sharding: [rank 0's results, rank 1's]})`` of tests/_budget_dist_worker.py's job (it runs
    both shardings), run in conftest's shared msrun launch (``dist_jobs``)."""
    out = dist_jobs / "budget"
    return out, {sharding: [dict(np.load(out / ("%s_rank_%d.npz" % (sharding, r)))) for r in range(2)]
                 for sharding in worker.SHARDINGS}


@pytest.fixture(scope="module")
def reference():
    """One process (stand-alone) on the concatenated global batches."""
    with graph_mode_on_cpu():
        model = worker.make_model()
        batches = worker.global_batches()
        model.train(1, batches)
        assert [t.resolved_sharding for t in model.tables] == ["none"] * 4
        return worker.results(model, batches[0])


def _held(result, table):
    """(ids, rows' values) of the ids of ``table`` that hold a row, in id order."""
    keys, rows = result[table + ":cache:keys"], result[table + ":cache:rows"]
    held = rows >= 2                                   # rows 0 and 1 are reserved
    order = np.argsort(keys[held])
    return keys[held][order], result[table + ":table"][rows[held]][order]


@pytest.mark.slow
def test_the_stream_exercises_every_budget_mechanism(reference):
    """The job means something: the policy tables replaced ids, the lru table's sketch and the
    sketch table's rejected ids and aged, the score table refused ids below its admit_score, and
    every table is in its memory budget."""
    ref = reference
    for table in ("lru", "lfu", "score"):
        assert int(ref[table + ":cache:replaced"]) > 20, table
        assert int(ref[table + ":cache:capacity"]) == {"lru": 26, "lfu": 20, "score": 24}[table]   # it never grew
    assert int(ref["score:cache:rejected"]) > 0 and int(ref["score:cache:admitted"]) > 0
    for table in ("lru", "sketch"):
        assert str(ref[table + ":cache:admission_counter"]) == "sketch"
        assert int(ref[table + ":cache:rejected"]) > 0 and int(ref[table + ":cache:aged"]) > 0, table
        assert ref[table + ":cache:keys"].size <= int(ref[table + ":cache:capacity"])    # no candidates tracked
    assert str(ref["lfu:cache:admission_counter"]) == "exact"
    assert int(ref["sketch:cache:grown"]) > 0


def test_data_parallel_ranks_decide_as_one_process(job, reference):
    _, results = job
    r0, r1 = results["data_parallel"]
    for key in r0:
        np.testing.assert_array_equal(r0[key], r1[key], err_msg=key)
    assert r0["sharding"].tolist() == ["data_parallel"] * 4
    ref = reference
    assert int(r0["step"]) == int(ref["step"]) == worker.STEPS
    for table in TABLES:
        cache = [k for k in ref if k.startswith(table + ":cache:")]
        assert table + ":cache:sketch" in cache or table == "lfu"
        for key in cache:                              # every decision, row numbers and sketch included
            np.testing.assert_array_equal(r0[key], ref[key], err_msg=key)
        ids, rows = _held(r0, table)
        ref_ids, ref_rows = _held(ref, table)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-6, err_msg=table)
    for key in [k for k in ref if k.startswith("dense:")]:
        np.testing.assert_allclose(r0[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(r0["predict"], ref["predict"], rtol=1e-5, atol=1e-6)


def _shard_replay(rank, world=2):
    """Each table's shard ``rank`` of ``world`` as one table of the shard's capacity that looks up,
    step by step, only the ids of the global batch that ``rank`` owns (in the batch's order)."""
    model = worker.make_model("row_wise")
    for table in model.tables:
        table.set_layout("row_wise", rank, world)
    read = {"lru": "ids", "sketch": "ids", "lfu": "more", "score": "more"}
    for batch in worker.global_batches():
        for table in model.tables:
            flat = batch[read[table.table_name]].ravel()
            mine = rb._owner_of(flat, world) == rank
            labels = np.repeat(batch["label"].ravel(), worker.MORE)[mine] if table.table_name == "score" else None
            table.cache.lookup(flat[mine], batch["timestamp"], labels=labels)
    return {t.table_name: t.cache.state_dict() for t in model.tables}


def test_a_row_wise_table_is_full_shard_by_shard(job, reference):
    """Each rank's shard holds at most 2 + ceil((capacity - 2) / 2) rows, only ids it owns, and decides
    (admits, replaces, counts, ages) exactly as one table of that capacity, with the table's other
    settings, fed only its ids."""
    _, results = job
    ranks = results["row_wise"]
    assert ranks[0]["sharding"].tolist() == ["row_wise"] * 4
    for rank, result in enumerate(ranks):
        replay = _shard_replay(rank)
        for table in TABLES:
            for key in SETTINGS:                       # the shard is the table's, but for its capacity
                assert replay[table][key] == reference[table + ":cache:" + key], (table, key)
            for key, want in replay[table].items():
                np.testing.assert_array_equal(result[table + ":cache:" + key], np.asarray(want),
                                              err_msg="rank %d %s %s" % (rank, table, key))
            keys = result[table + ":cache:keys"]
            assert keys.size and (rb._owner_of(keys, 2) == rank).all()
        assert int(result["lru:cache:capacity"]) == 2 + 12 and int(result["lfu:cache:capacity"]) == 2 + 9
        assert int(result["score:cache:capacity"]) == 2 + 11
        for table in ("lru", "lfu", "score"):
            assert int(result[table + ":cache:replaced"]) > 0, table
    held = [set(_held(r, t)[0].tolist()) for r in ranks for t in ("lru",)]
    assert not held[0] & held[1]
    for key in [k for k in ranks[0] if k.startswith("dense:")] + ["predict", "first:predict"]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)


@pytest.mark.parametrize("sharding", worker.SHARDINGS)
def test_a_checkpoint_restored_on_the_same_ranks_continues_exactly(job, sharding):
    _, results = job
    for rank, result in enumerate(results[sharding]):
        restored = [k for k in result if k.startswith("restored:")]
        assert len(restored) > 20
        for key in restored:
            np.testing.assert_array_equal(result[key], result[key[len("restored:"):]],
                                          err_msg="rank %d %s" % (rank, key))


def test_a_row_wise_checkpoint_loads_into_one_process(job):
    """2 -> 1: the shards merge into one table of the table's capacity, which predicts as the two
    ranks did and trains on, in its budget."""
    out, results = job
    batches = worker.global_batches()
    with graph_mode_on_cpu():
        model = worker.make_model()
        assert model.load_checkpoint(str(out / "ckpt_row_wise.npz")) == []
        assert model.batches_consumed == worker.SAVE_AT
        predict = model.predict(*(batches[0][k] for k in ("dense", "ids", "more"))).asnumpy()
        np.testing.assert_allclose(predict, results["row_wise"][0]["first:predict"], rtol=1e-5, atol=1e-6)
        model.train(1, batches[worker.SAVE_AT:])
        for table in model.tables[:2]:
            assert table.capacity == table.table_capacity and len(table.cache) <= table.capacity
