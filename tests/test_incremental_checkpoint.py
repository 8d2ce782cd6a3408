"""Incremental checkpoints (issue #38 item 3): ``OnlineCheckpoint(full_every=K)`` writes a full base
every K checkpoints and deltas between them; a delta's chain read back is the full checkpoint of its
step, bit for bit; resume goes on bit for bit; a damaged, missing or foreign link is refused by name;
pruning keeps every kept checkpoint's chain."""
import fcntl
import itertools
import json
import os
import re
import shutil
import time
import traceback

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

from mindspore.train.callback import Callback

import recboost as rb
from _stopping import StopAfter

FIELDS, DENSE, DIM, BATCH = 6, 4, 8, 16
SKETCH = dict(admission_counter="sketch", sketch_width=256, sketch_depth=2, sketch_window=200)

# (optimizer, table settings): Adam with admission by a sketch, an LRU policy and a full table (ids
# replace others between checkpoints); FTRL on bfloat16 rows with a lookup threshold, growth and an
# EvictHook (evictions and growth between checkpoints); Adagrad with a plain count threshold.
CASES = {
    "adam-lru-sketch": (lambda: rb.SparseAdam(0.01), dict(capacity=48, access_threshold=2, eviction_policy="lru",
                                                          **SKETCH)),
    "ftrl-bf16-grow-evict": (lambda: rb.SparseFtrl(0.05), dict(capacity=16, access_threshold=2, eviction_threshold=3,
                                                              use_dynamic_expansion=True, row_dtype="bfloat16")),
    "adagrad": (lambda: rb.SparseAdagrad(0.05), dict(capacity=512, access_threshold=1)),
}


def _batches(n, vocab=400, seed=0):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=DENSE, num_sparse=FIELDS, vocab_sizes=[vocab] * FIELDS,
                                     batch_size=BATCH)
    return list(itertools.islice(stream, n))


def _model(case, seed=0):
    optimizer, settings = CASES[case]
    settings = dict(settings)
    ms.set_seed(seed)
    table = rb.HashEmbedding(DIM + 1, settings.pop("capacity"), input_index=1, seed=seed, name="ids",
                             optimizer=optimizer(), max_unique=BATCH * FIELDS + 1, **settings)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (16,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _hooks(case):
    return [rb.EvictHook(evict_time_interval=None, evict_step_interval=3)] if "evict" in case else []


def _state(table, model):
    """Every array of the model's state: the table's (rows, live flags, slots, scalars, cache) and the
    dense parameters (network, optimizer, loss scale), with the counters."""
    state = table.state_dict()
    out = {"table": state["table"], "live": state["live"], "rounds": state["rounds"], "seed": state["seed"],
           **{"slot:" + k: v for k, v in state["slots"].items()},
           **{"scalar:" + k: v for k, v in state["scalars"].items()},
           **{"cache:" + k: np.asarray(v) for k, v in state["cache"].items()},
           **{"dense:" + p.name: p.asnumpy() for p in model.state_parameters()}}
    out.update(step=model.step, samples=model.samples, run=model.run_id)
    return out


def _assert_same(a, b, what):
    assert sorted(a) == sorted(b), what
    for key in a:
        assert np.asarray(a[key]).dtype == np.asarray(b[key]).dtype, (what, key)
        np.testing.assert_array_equal(a[key], b[key], err_msg="%s: %s" % (what, key))


def _manifest(path):
    """A checkpoint file's manifest (np.load opens it: its members are .npy arrays)."""
    with np.load(path) as npz:
        return json.loads(npz["manifest"].tobytes())


def _loaded(case, path):
    table, model = _model(case, seed=7)         # another seed: everything must come from the file
    model.load_checkpoint(path)
    return table, model


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.live_backend
@pytest.mark.fallback
def test_base_and_deltas_are_the_full_checkpoint_and_resume_bit_for_bit(graph_mode, backend, tmp_path, case):
    """A run writes, at every step, a full checkpoint (one directory) and a base every 3 checkpoints with
    deltas between (another): each delta read back through its chain is the full checkpoint of its step,
    array for array; resuming from a delta 2 links deep trains on bit for bit as the uninterrupted run."""
    batches = _batches(14)
    full, chained = str(tmp_path / "full"), str(tmp_path / "chained")
    table, model = _model(case)
    model.online_train(batches, dataset_sink_mode=False, callbacks=_hooks(case) + [
        rb.OnlineCheckpoint(full, every_steps=1, keep=100), rb.OnlineCheckpoint(chained, every_steps=1, keep=100,
                                                                               full_every=3),
        StopAfter(12)])
    assert model.step == 12
    stats = table.cache.stats()
    if case == "adam-lru-sketch":
        assert stats["replaced"] > 0 and stats["rejected"] > 0        # replacements and admissions between them
    if case == "ftrl-bf16-grow-evict":
        assert stats["evicted"] > 0 and stats["grown"] > 0
    kinds = set()
    for step in range(1, 13):
        name = "recboost-%d.npz" % step
        manifest = _manifest(os.path.join(chained, name))
        assert manifest["format"] == (4 if step % 3 == 1 else 5), name
        if manifest["format"] == 5:
            assert manifest["delta"]["file"] == "recboost-%d.npz" % (step - 1)
            assert manifest["delta"]["run"] == model.run_id
            kinds |= {(key.split(".")[2], patch["kind"]) for key, patch in manifest["delta"]["patches"].items()
                      if key.startswith("tables.0.")}
        _assert_same(_state(*_loaded(case, os.path.join(chained, name))),
                     _state(*_loaded(case, os.path.join(full, name))), name)
        if manifest["format"] == 5:
            _assert_holds_only_what_changed(os.path.join(chained, name), os.path.join(full, "recboost-%d.npz" % (step - 1)),
                                            os.path.join(full, name))
    # the tables' rows and slots went by their changed rows, the cache by entries, in some delta
    assert {("table", "rows"), ("live", "rows"), ("cache", "entries")} <= kinds
    assert ("slots", "rows") in kinds
    reference = dict(_state(table, model), run=None)        # (the resumed run below is another run)

    # stopped at step 6 (a delta after a delta after the base at 4), resumed for 6 more steps
    resumed_dir = str(tmp_path / "resumed")
    table_b, model_b = _model(case)
    model_b.online_train(batches, dataset_sink_mode=False, callbacks=_hooks(case) + [
        rb.OnlineCheckpoint(resumed_dir, every_steps=1, keep=100, full_every=3), StopAfter(6)])
    assert _manifest(os.path.join(resumed_dir, "recboost-6.npz"))["format"] == 5
    table_c, model_c = _model(case, seed=5)
    model_c.online_train(batches, dataset_sink_mode=False, resume_from=resumed_dir, callbacks=_hooks(case) + [
        rb.OnlineCheckpoint(resumed_dir, every_steps=1, keep=100, full_every=3), StopAfter(12)])
    _assert_same(dict(_state(table_c, model_c), run=None), reference, "resumed at 6")
    # the resumed run's first checkpoint is a base, then its deltas: its last reads back as the reference
    assert _manifest(os.path.join(resumed_dir, "recboost-7.npz"))["format"] == 4
    _assert_same(dict(_state(*_loaded(case, os.path.join(resumed_dir, "recboost-12.npz"))), run=None), reference,
                 "resumed run's 12")


def test_the_callbacks_of_one_step_see_one_point_of_the_stream():
    """A pause taken while the step's callbacks run (``_Prefetcher.held``: each checkpoint pauses, then
    resumes) lasts until they all end: a second checkpoint of the step sees the batches the first saw,
    not one more the producer made between them. The producer is caught idle with room in its queue, as
    a thread the scheduler has not woken yet after the training thread took a batch can be (the
    incremental test above compares two callbacks' files of one step: it failed so under load)."""
    made = []

    def produce(raw):
        made.append(raw)
        return raw
    prefetcher = rb._Prefetcher(iter(range(100)), produce, depth=2)
    try:
        deadline = time.monotonic() + 10
        while len(made) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        prefetcher.pause()                    # the producer idle, its queue full
        assert next(prefetcher) == 0          # the training thread takes one and trains it: room for one more
        prefetcher.trained()
        with prefetcher.held():
            prefetcher.pause()                # a checkpoint ...
            prefetcher.resume()
            time.sleep(0.3)                   # ... another callback, long enough to produce a batch ...
            prefetcher.pause()                # ... and a second checkpoint: nothing was made between
            prefetcher.resume()
            assert made == [0, 1]
        deadline = time.monotonic() + 10      # the hold's end lets the producer go on
        while len(made) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert made == [0, 1, 2]
    finally:
        prefetcher.close()


def test_a_pause_sees_the_prefetch_depth_filled_however_slow_the_producer():
    """``_Prefetcher.pause()`` lets the producer fill its queue first: with a producer far slower than
    the consumer, a pause still returns ``depth`` items (fewer only at the stream's end; the batch in its
    step, taken and not trained, counts among them), so the point a checkpoint, a stop or a failed step
    records does not depend on timing."""
    def produce(raw):
        time.sleep(0.05)
        return raw
    prefetcher = rb._Prefetcher(iter(range(5)), produce, depth=3)
    try:
        assert next(prefetcher) == 0                # at once: the producer has made nothing more
        assert prefetcher.pause() == [1, 2]         # 0 in its step: a failure there keeps [0, 1, 2]
        prefetcher.resume()
        prefetcher.trained()                        # 0 trained
        assert prefetcher.pause() == [1, 2, 3]
        prefetcher.resume()
        assert [next(prefetcher) for _ in range(3)] == [1, 2, 3]
        assert prefetcher.pause() == [4]            # the stream's end: one left
        prefetcher.resume()
    finally:
        prefetcher.close()


def _slowed(batches, after, seconds):
    """``batches``, each one past the first ``after`` yielded ``seconds`` late."""
    for i, batch in enumerate(batches):
        if i >= after:
            time.sleep(seconds)
        yield batch


def test_the_tables_after_a_stop_and_its_checkpoint_do_not_depend_on_the_streams_speed(graph_mode, tmp_path):
    """A run stopped at step 6 leaves the same tables (ids admitted ahead for the prepared batches
    included) and writes the same checkpoint whether the batches past the stop come at once or late
    (the prefetcher then has prepared fewer when the stop comes: it failed so under load)."""
    case, batches = "adam-lru-sketch", _batches(12)
    states, files = [], []
    for name, stream in (("fast", batches), ("slow", _slowed(batches, 6, 0.4))):
        table, model = _model(case)
        model.online_train(stream, dataset_sink_mode=False, callbacks=[
            rb.OnlineCheckpoint(str(tmp_path / name), every_steps=6, keep=10), StopAfter(6)])
        assert model.step == 6
        states.append(dict(_state(table, model), run=None))
        with np.load(str(tmp_path / name / "recboost-6.npz")) as npz:
            files.append({key: npz[key] for key in npz.files if key != "manifest"})
    _assert_same(states[1], states[0], "slow stream")
    _assert_same(files[1], files[0], "slow stream's checkpoint")


def _assert_holds_only_what_changed(delta, before, after):
    """The delta file ``delta`` (of the full checkpoints ``before`` and ``after``) holds of the cache the
    entries new or changed and the ids removed, and of the live flags the rows changed or grown,
    exactly (what it held when it compared whole copies: the change records find the same)."""
    with np.load(before) as old, np.load(after) as new:         # (full checkpoints: .npy members)
        old, new = dict(old), dict(new)
    patches = _manifest(delta)["delta"]["patches"]
    with np.load(delta) as npz:
        members = {name: npz[name] for name in npz.files}
    prefix = "tables.0.cache."
    at = np.minimum(np.searchsorted(old[prefix + "keys"], new[prefix + "keys"]), old[prefix + "keys"].size - 1)
    hit = old[prefix + "keys"][at] == new[prefix + "keys"]
    same = hit.copy()
    for field in ("rows", "counts", "last_seen"):
        same[hit] &= old[prefix + field][at[hit]] == new[prefix + field][hit]
    for field in ("keys", "rows", "counts", "last_seen"):
        assert patches[prefix + field]["kind"] == "entries"
        np.testing.assert_array_equal(members["delta.values." + prefix + field], new[prefix + field][~same])
    np.testing.assert_array_equal(members["delta.removed." + prefix + "keys"],
                                  np.setdiff1d(old[prefix + "keys"], new[prefix + "keys"]))
    live_old, live_new = old["tables.0.live"], new["tables.0.live"]
    if patches["tables.0.live"]["kind"] == "rows":
        np.testing.assert_array_equal(members["delta.rows.tables.0.live"], np.concatenate([
            np.flatnonzero(live_old != live_new[:live_old.size]), np.arange(live_old.size, live_new.size)]))


def test_a_delta_holds_what_changed_and_is_much_smaller(graph_mode, tmp_path):
    """A table of 2^14 rows that a step touches a few dozen of: a delta's file is under a tenth of the
    full checkpoint's (the rows, slots and cache entries of the changed rows, the dense part whole)."""
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, 1 << 14, input_index=1, seed=0, name="ids", optimizer=rb.SparseAdam(0.01),
                             max_unique=BATCH * FIELDS + 1)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (16,), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    model.online_train(_batches(6, vocab=100000), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=100, full_every=10), StopAfter(4)])
    sizes = [os.path.getsize(tmp_path / ("recboost-%d.npz" % step)) for step in range(1, 5)]
    assert _manifest(tmp_path / "recboost-1.npz")["format"] == 4
    assert all(_manifest(tmp_path / ("recboost-%d.npz" % step))["format"] == 5 for step in (2, 3, 4))
    assert max(sizes[1:]) < 0.1 * sizes[0], sizes


@pytest.fixture(scope="module")
def _chain_files(tmp_path_factory):
    """Two runs' checkpoints (every step, a base every 3): ``(ours, theirs)`` directories."""
    with GraphMode():
        dirs = []
        for seed in (0, 1):
            directory = str(tmp_path_factory.mktemp("run%d" % seed))
            table, model = _model("adagrad", seed=seed)
            model.online_train(_batches(6), dataset_sink_mode=False, callbacks=[
                rb.OnlineCheckpoint(directory, every_steps=1, keep=100, full_every=3), StopAfter(3)])
            dirs.append(directory)
    return dirs


class GraphMode:
    """MindSpore in GRAPH_MODE on CPU, the mode restored after (for a module-scoped fixture)."""

    def __enter__(self):
        self.mode = ms.get_context("mode")
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_device("CPU")

    def __exit__(self, *exc):
        ms.set_context(mode=self.mode)


def _copy(directory, tmp_path):
    target = str(tmp_path / "copy")
    shutil.copytree(directory, target)
    return target


def test_a_damaged_delta_of_the_chain_is_refused_by_name(_chain_files, tmp_path):
    ours = _copy(_chain_files[0], tmp_path)
    middle = os.path.join(ours, "recboost-2.npz")
    data = bytearray(open(middle, "rb").read())
    data[len(data) // 3] ^= 0x01
    open(middle, "wb").write(bytes(data))
    table, model = _model("adagrad", seed=3)
    before = _state(table, model)
    with pytest.raises(ValueError, match=r"the checkpoint '.*recboost-3\.npz' names its predecessor "
                                         r"'.*recboost-2\.npz', which cannot be read \("):
        model.load_checkpoint(os.path.join(ours, "recboost-3.npz"))
    _assert_same(_state(table, model), before, "after a refused load")
    with pytest.raises(ValueError, match=r"the checkpoint '.*recboost-2\.npz' cannot be read \("):
        model.load_checkpoint(middle)


def test_a_missing_delta_of_the_chain_is_refused_by_name(_chain_files, tmp_path):
    ours = _copy(_chain_files[0], tmp_path)
    os.unlink(os.path.join(ours, "recboost-1.npz"))              # the base
    _, model = _model("adagrad", seed=3)
    with pytest.raises(ValueError, match=r"the checkpoint '.*recboost-3\.npz' needs the delta '.*recboost-2\.npz' of "
                                         r"its chain, which names its predecessor '.*recboost-1\.npz' \(field "
                                         r"'delta\.file'\), which is missing"):
        model.load_checkpoint(ours)                  # the directory: its latest, recboost-3.npz
    os.unlink(os.path.join(ours, "recboost-2.npz"))
    with pytest.raises(ValueError, match=r"'.*recboost-3\.npz' names its predecessor '.*recboost-2\.npz' \(field "
                                         r"'delta\.file'\), which is missing"):
        model.load_checkpoint(os.path.join(ours, "recboost-3.npz"))


def test_a_link_of_another_run_is_refused_by_name(_chain_files, tmp_path):
    ours = _copy(_chain_files[0], tmp_path)
    for name in ("recboost-1.npz", "recboost-2.npz"):        # another run's files under our names
        shutil.copy(os.path.join(_chain_files[1], name), os.path.join(ours, name))
    _, model = _model("adagrad", seed=3)
    with pytest.raises(ValueError, match=r"'.*recboost-3\.npz' names its predecessor '.*recboost-2\.npz' of run "
                                         r"'[0-9a-f-]+', step 2 and content id [0-9a-f]{64}, but that file is of run "
                                         r"'[0-9a-f-]+', step 2 and content id [0-9a-f]{64} \(another run's"):
        model.load_checkpoint(os.path.join(ours, "recboost-3.npz"))
    model.load_checkpoint(os.path.join(_chain_files[1], "recboost-3.npz"))      # its own chain loads
    assert model.step == 3


def test_pruning_keeps_every_chain_a_kept_checkpoint_needs(graph_mode, tmp_path):
    """keep=2 over 10 checkpoints, a base every 3: after every save the directory holds exactly the
    kept two and the files their chains need, and each kept one loads."""
    seen = []

    class Look(Callback):                   # after OnlineCheckpoint: what the directory holds
        def on_train_step_end(self, run_context):
            seen.append(sorted((n for n in os.listdir(tmp_path) if n.endswith(".npz")), key=lambda n: int(n[9:-4])))

    table, model = _model("adagrad")
    model.online_train(_batches(12), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=2, full_every=3, save_on_end=False), Look(),
        StopAfter(10)])
    chains = {1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [4], 5: [4, 5], 6: [4, 5, 6], 7: [7], 8: [7, 8], 9: [7, 8, 9],
              10: [10]}
    for step, names in enumerate(seen, 1):
        kept = {step - 1, step} - {0}
        expected = sorted(set().union(*(chains[k] for k in kept)))
        assert names == ["recboost-%d.npz" % k for k in expected], step
    for step in (9, 10):
        loaded, other = _loaded("adagrad", str(tmp_path / ("recboost-%d.npz" % step)))
        assert other.step == step
    _assert_same(_state(*_loaded("adagrad", str(tmp_path))), _state(table, model), "the latest")


def test_save_checkpoint_chain_is_checked(graph_mode, tmp_path):
    """A delta needs the model's last chain checkpoint: none saved, or one loaded since, is refused."""
    table, model = _model("adagrad")
    model.online_train(_batches(3), dataset_sink_mode=False, callbacks=[StopAfter(2)])
    with pytest.raises(ValueError, match=r"'chain' must be 'base' first: a delta builds on the last checkpoint"):
        model.save_checkpoint(str(tmp_path / "a.npz"), chain="delta")
    with pytest.raises(ValueError, match=r"'chain' must be one of \[None, 'base', 'delta'\], but got 'full'"):
        model.save_checkpoint(str(tmp_path / "a.npz"), chain="full")
    model.save_checkpoint(str(tmp_path / "a.npz"), chain="base")
    model.save_checkpoint(str(tmp_path / "b.npz"), chain="delta")
    with pytest.raises(ValueError, match=r"'path' of a delta \(chain='delta'\) must be in the folder of its "
                                         r"predecessor"):
        model.save_checkpoint(str(tmp_path / "elsewhere" / "c.npz"), chain="delta")
    model.load_checkpoint(str(tmp_path / "b.npz"))
    with pytest.raises(ValueError, match=r"the hash tables were loaded or replaced since"):
        model.save_checkpoint(str(tmp_path / "c.npz"), chain="delta")
    with pytest.raises(ValueError, match=r"'full_every' must be an int >= 1"):
        rb.OnlineCheckpoint(tmp_path, every_steps=1, full_every=0)
    model.save_checkpoint(str(tmp_path / "d.npz"), chain="base")
    os.remove(str(tmp_path / "d.npz"))
    with pytest.raises(ValueError, match=r"'chain' must be 'base' \(a full checkpoint\): the last checkpoint of the "
                                         r"chain, '.*d\.npz', is gone"):
        model.save_checkpoint(str(tmp_path / "e.npz"), chain="delta")


def test_a_chain_whose_last_file_is_gone_goes_on_with_a_base(graph_mode, tmp_path):
    """When the last checkpoint was deleted behind the run's back, the next one is a base, not a delta
    nothing could restore."""

    class Remove(Callback):                 # after OnlineCheckpoint: deletes the checkpoint of step 2
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                os.remove(str(tmp_path / "recboost-2.npz"))

    table, model = _model("adagrad")
    model.online_train(_batches(6), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=100, full_every=3), Remove(), StopAfter(4)])
    assert [_manifest(tmp_path / ("recboost-%d.npz" % k))["format"] for k in (1, 3, 4)] == [4, 4, 5]
    assert _manifest(tmp_path / "recboost-4.npz")["delta"]["file"] == "recboost-3.npz"
    _assert_same(_state(*_loaded("adagrad", str(tmp_path))), _state(table, model), "the latest")


@pytest.mark.slow
def test_recboost_train_writes_deltas_and_resumes_from_one(graph_mode, tmp_path):
    """``recboost train --checkpoint-full-every 3``: bases and deltas; a job stopped at a delta and run
    again resumes from it (its input position proven from the delta's manifest) and ends with the
    model of the uninterrupted job, bit for bit."""
    data = tmp_path / "day.txt"
    rb.SyntheticClickStream(seed=1).write_criteo(str(data), 64 * 9)
    settings = dict(batch_size=64, capacity=1 << 12, checkpoint_every=2, checkpoint_full_every=3, progress_seconds=1e9,
                    printer=lambda line: None)
    once = rb.train_job(str(data), checkpoint_dir=str(tmp_path / "once"), **settings)
    stopped = rb.train_job(str(data), checkpoint_dir=str(tmp_path / "twice"), steps=5, **settings)
    assert stopped["steps"] == 5
    assert [_manifest(tmp_path / "twice" / ("recboost-%d.npz" % k))["format"] for k in (2, 4, 5)] == [4, 5, 5]
    resumed = rb.train_job(str(data), checkpoint_dir=str(tmp_path / "twice"), **settings)
    assert resumed["model"].step == once["model"].step == 9
    _assert_same(dict(_state(resumed["model"].tables[0], resumed["model"]), run=None),
                 dict(_state(once["model"].tables[0], once["model"]), run=None), "resumed job")
    assert _manifest(rb.latest_checkpoint(str(tmp_path / "once")))["format"] == 5     # 2 base, 4, 6 deltas, 8 base, 9


def _touching(cache, call, ids=None):
    """``call`` the cache (a lookup of ``ids``, or an eviction); returns the ids it touched: those of
    ``ids`` tracked before or after it, and those it forgot (evicted, replaced)."""
    before = cache.state_dict()["keys"]
    call() if ids is None else call(ids)
    after = cache.state_dict()["keys"]
    touched = np.setdiff1d(before, after)
    return touched if ids is None else np.union1d(touched, ids[np.isin(ids, before) | np.isin(ids, after)])


def _expected_changes(before, touched):
    """What ``cache.changes()`` must give, from the state ``before`` (state_dict at record_changes())
    and the ids touched since (``_touching``): each as it was."""
    keys = np.unique(np.concatenate(touched + [np.empty(0, np.int64)]))
    at = np.minimum(np.searchsorted(before["keys"], keys), max(before["keys"].size - 1, 0))
    existed = before["keys"][at] == keys if before["keys"].size else np.zeros(keys.size, np.bool_)
    out = {"keys": keys, "existed": existed}
    for name, dtype in (("rows", np.int32), ("counts", np.int64), ("last_seen", np.int64)):
        out[name] = np.where(existed, before[name][at], 0).astype(dtype) if before["keys"].size else \
            np.zeros(keys.size, dtype)
    return out


@pytest.mark.parametrize("settings", [
    dict(access_threshold=1, eviction_threshold=2, grow=True),                 # candidates, eviction, growth
    dict(access_threshold=0, eviction_policy="lru"),                           # a full table replaces ids
    dict(access_threshold=1, eviction_policy="lfu", lfu_half_life=2, **SKETCH),
], ids=["grow-evict", "lru", "lfu-sketch"])
def test_the_cache_records_which_entries_change_as_they_were(backend, settings):
    """HashCache.record_changes()/changes(): the ids looked up, evicted or replaced since the record
    began, each with its entry as it was then (or not tracked then); a new record starts empty; a
    load stops it (None); entries() reads the entries now. Both backends give the same arrays."""
    cache = backend.HashCache(8, **settings)
    rng = np.random.default_rng(3)
    assert cache.changes() is None                      # no record yet
    for _ in range(4):
        cache.lookup(rng.integers(0, 40, 12, dtype=np.int64))
    for round_ in range(3):
        before, looked_up = cache.state_dict(), []
        cache.record_changes()
        for step in range(5):
            looked_up.append(_touching(cache, cache.lookup, rng.integers(0, 40 + 20 * round_, 6, dtype=np.int64)))
            if step % 2 and settings.get("eviction_threshold", -1) >= 0:
                looked_up.append(_touching(cache, cache.evict))
        got, want = cache.changes(), _expected_changes(before, looked_up)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert want["keys"].size and (~want["existed"]).any() and want["existed"].any()
        now = cache.state_dict()
        tracked, rows, counts, last = cache.entries(got["keys"])
        at = np.searchsorted(now["keys"], got["keys"])
        np.testing.assert_array_equal(tracked, np.isin(got["keys"], now["keys"]))
        for mine, name in ((rows, "rows"), (counts, "counts"), (last, "last_seen")):
            np.testing.assert_array_equal(mine[tracked], now[name][at[tracked]], err_msg=name)
            assert not mine[~tracked].any() and mine.dtype == now[name].dtype
    if "grow" in settings:
        assert cache.stats()["grown"] and cache.stats()["forgotten"] and cache.stats()["evicted"]
    if "eviction_policy" in settings:
        assert cache.stats()["replaced"]
    cache.record_changes()
    assert cache.changes()["keys"].size == 0           # a new record starts empty
    before, touched = cache.state_dict(), []
    for k in range(3):                                  # new ids, most rejected: a sketch records none of those
        touched.append(_touching(cache, cache.lookup, np.arange(1000, 1040, dtype=np.int64) + 100 * k))
    got, want = cache.changes(), _expected_changes(before, touched)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (got["keys"].size < 60) == ("admission_counter" in settings), got["keys"].size
    cache.load_state_dict(cache.state_dict())
    assert cache.changes() is None                      # a load stops it
    empty = cache.state_dict(entries=False)
    assert all(empty[k].size == 0 for k in ("keys", "rows", "counts", "last_seen"))
    _assert_same({k: v for k, v in empty.items() if k not in ("keys", "rows", "counts", "last_seen")},
                 {k: v for k, v in cache.state_dict().items() if k not in ("keys", "rows", "counts", "last_seen")},
                 "state_dict(entries=False)")


class _RecordedCache(rb.HashCache):
    """The cache, counting its passes over every entry: the whole entry states it gives
    (``state_dict()`` with entries) and the sorted ids of every entry (``keys()``, or ``keys_between``
    from the lowest id on: the first range of a full checkpoint's ids, which it writes its entries from)."""
    whole = 0

    def state_dict(self, *entries):
        _RecordedCache.whole += bool(entries[0] if entries else True)
        return super().state_dict(*entries)

    def keys(self):
        _RecordedCache.whole += 1
        return super().keys()

    def keys_between(self, low, high, out):
        _RecordedCache.whole += low == -2 ** 63
        return super().keys_between(low, high, out)


@pytest.mark.slow
def test_a_delta_is_written_and_read_without_a_pass_over_every_entry(graph_mode, tmp_path, monkeypatch):
    """Writing a delta takes no whole cache state (its entries come from the change record), and
    reading a chain back merges each delta's entries into its predecessor's, sorting none again (the
    checkpoint's prepared batches are rebuilt apart: the numpy twin's unique_inverse sorts their rows)."""
    monkeypatch.setattr(rb, "HashCache", _RecordedCache)
    table, model = _model("adam-lru-sketch")
    assert isinstance(table.cache, _RecordedCache)
    model.online_train(_batches(6), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=100, full_every=10), StopAfter(4)])
    assert _manifest(tmp_path / "recboost-4.npz")["format"] == 5
    assert _RecordedCache.whole == 1                    # the base's, none for the 3 deltas
    sorts, replays = [], []
    argsort = np.argsort

    def counted(a, *args, **kw):
        replay = any(frame.name == "_replay_batch" for frame in traceback.extract_stack())
        (replays if replay else sorts).append(np.shape(a))
        return argsort(a, *args, **kw)
    monkeypatch.setattr(np, "argsort", counted)
    loaded = _loaded("adam-lru-sketch", str(tmp_path / "recboost-4.npz"))
    assert sorts == [] and len(loaded[0].cache) > 0 and all(n <= BATCH * FIELDS for n, in replays), (sorts, replays)
    monkeypatch.undo()
    _assert_same(_state(*loaded), _state(table, model), "the chain read back")


def test_a_delta_of_changed_entries_only_reads_back_in_place(graph_mode, tmp_path):
    """Once every id of the stream holds a row, a delta's cache entries are changed ones only (no id
    new or removed): they are written over the predecessor's in place, and the chain reads back as
    the run's state."""
    table, model = _model("adagrad")
    model.online_train(_batches(10, vocab=3), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=100, full_every=20),
        rb.OnlineCheckpoint(tmp_path / "full", every_steps=1, keep=100), StopAfter(8)])
    changed = 0                 # (which interval's lookups a delta holds depends on the prefetcher's lead)
    for step in range(4, 9):
        with np.load(str(tmp_path / ("recboost-%d.npz" % step))) as npz:
            new_keys, removed = npz["delta.values.tables.0.cache.keys"], npz["delta.removed.tables.0.cache.keys"]
        with np.load(str(tmp_path / "full" / ("recboost-%d.npz" % (step - 1)))) as npz:
            keys_before = npz["tables.0.cache.keys"]
        assert removed.size == 0 and np.isin(new_keys, keys_before).all(), step
        changed += new_keys.size
    assert changed > 0
    last = str(tmp_path / "recboost-8.npz")
    _assert_same(_state(*_loaded("adagrad", last)), _state(table, model), "the chain read back")


def test_a_delta_onto_a_file_of_its_own_chain_is_refused_by_name(graph_mode, tmp_path):
    """Issue 61 item 1: a delta written onto the path of its predecessor (or of any earlier file of its
    chain) would overwrite what it needs: refused naming the path, the file left as it was and loadable."""
    table, model = _model("adagrad")
    model.online_train(_batches(3), dataset_sink_mode=False, callbacks=[StopAfter(2)])
    base = str(tmp_path / "a.npz")
    model.save_checkpoint(base, chain="base")
    with open(base, "rb") as fh:
        before = fh.read()
    with pytest.raises(ValueError, match=r"For 'RecModel.save_checkpoint', 'path' of a delta "
                                         r"\(chain='delta'\) must be .*another file than those of its chain.*"
                                         r"but got '.*a\.npz'"):
        model.save_checkpoint(base, chain="delta")
    model.save_checkpoint(str(tmp_path / "b.npz"), chain="delta")
    for path in (base, str(tmp_path / "b.npz"), os.path.join(str(tmp_path), ".", "a.npz")):
        with pytest.raises(ValueError, match=r"'path' of a delta \(chain='delta'\) must be another file"):
            model.save_checkpoint(path, chain="delta")
    with open(base, "rb") as fh:
        assert fh.read() == before
    model.save_checkpoint(str(tmp_path / "c.npz"), chain="delta")     # the chain goes on
    _assert_same(_state(*_loaded("adagrad", str(tmp_path / "c.npz"))), _state(table, model), "c.npz")
    assert _loaded("adagrad", base)[1].step == 2



def test_a_full_save_over_a_file_of_the_chain_and_a_replaced_base_are_refused(graph_mode, tmp_path):
    """A full save (chain None, "base" or in the background) onto a file of the chain the model writes would
    leave its deltas unreadable: refused naming the path and the chain, nothing written. A base replaced from
    outside (another model's checkpoint moved over it) is found before the next delta is written: refused,
    naming the file; a new base then starts a chain that loads."""
    table, model = _model("adagrad")
    model.online_train(_batches(3), dataset_sink_mode=False, callbacks=[StopAfter(2)])
    base, delta = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    model.save_checkpoint(base, chain="base")
    model.save_checkpoint(delta, chain="delta")
    files = {p: open(p, "rb").read() for p in (base, delta)}
    for path, kwargs in ((base, {}), (delta, {}), (base, dict(chain="base")), (base, dict(background=True))):
        with pytest.raises(ValueError, match=r"'path' must be another file than those of the chain of incremental "
                                             r"checkpoints this model writes, \['a\.npz', 'b\.npz'\].*but got '.*%s'"
                                             % os.path.basename(path)):
            model.save_checkpoint(path, **kwargs)
    assert {p: open(p, "rb").read() for p in files} == files and sorted(os.listdir(tmp_path)) == ["a.npz", "b.npz"]
    _, other = _model("adagrad", seed=3)
    other.online_train(_batches(2, seed=5), dataset_sink_mode=False)
    other.save_checkpoint(str(tmp_path / "other.npz"))
    os.replace(str(tmp_path / "other.npz"), base)
    with pytest.raises(ValueError, match=r"'chain' must be 'base' \(a full checkpoint\): the checkpoint '.*a\.npz' of "
                                         r"the chain is no longer the one this model wrote"):
        model.save_checkpoint(str(tmp_path / "c.npz"), chain="delta")
    assert not os.path.exists(str(tmp_path / "c.npz"))
    model.save_checkpoint(str(tmp_path / "d.npz"), chain="base")
    model.save_checkpoint(str(tmp_path / "e.npz"), chain="delta")
    _assert_same(_state(*_loaded("adagrad", str(tmp_path / "e.npz"))), _state(table, model), "e.npz")

def test_checkpoint_paths_and_extra_are_checked_before_anything_changes(graph_mode, tmp_path):
    """A path that is no path (None, bytes, an int a file function would take as a descriptor) is a
    TypeError naming it, and no descriptor is touched; "" a ValueError; a directory given as a file, or a
    missing one to latest_checkpoint, is named; ``extra`` that JSON would refuse or read back changed (NaN,
    numpy scalars, int keys, tuples, nesting past the recursion limit) is a TypeError naming it, nothing
    written. online_train refuses a dataset that is no iterable before a resume loads anything."""
    _, model = _model("adagrad")
    model.online_train(_batches(3), dataset_sink_mode=False, callbacks=[StopAfter(2)])
    reader, writer = os.pipe()
    try:
        for bad in (None, b"x.npz", reader, 1.5):
            for call, name in ((model.save_checkpoint, "RecModel.save_checkpoint"),
                               (model.load_checkpoint, "RecModel.load_checkpoint")):
                with pytest.raises(TypeError, match=r"For '%s', 'path' must be a path \(a str or an os.PathLike "
                                                    r"of one\), but got %s\." % (name, re.escape(repr(bad)))):
                    call(bad)
            with pytest.raises(TypeError, match="For 'latest_checkpoint', 'directory' must be a path"):
                rb.latest_checkpoint(bad)
        os.write(writer, b"open")                       # the descriptor was not closed
        assert os.read(reader, 4) == b"open"
    finally:
        os.close(reader)
        os.close(writer)
    for call in (model.save_checkpoint, model.load_checkpoint, rb.latest_checkpoint,
                 lambda p: rb.OnlineCheckpoint(p, every_steps=1)):
        with pytest.raises(ValueError, match=r"'(path|directory)' must be a path \(a non-empty str\), but got ''"):
            call("")
    with pytest.raises(ValueError, match=r"'path' must be a checkpoint file's path, but got \"'.*', which is a "
                                         r"directory\""):
        model.save_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"'directory' must be an existing directory, but got \"'.*nowhere', which "
                                         r"is missing\""):
        rb.latest_checkpoint(str(tmp_path / "nowhere"))
    deep = {}
    for _ in range(100000):
        deep = {"a": deep}
    for extra, problem in (({"loss": float("nan")}, "Out of range float"), ({"n": np.int64(3)}, "int64"),
                           ({1: "a"}, "reads back as another"), ({"t": (1, 2)}, "reads back as another"),
                           (deep, "RecursionError")):
        with pytest.raises(TypeError, match=r"For 'RecModel.save_checkpoint', the value of 'extra' must be a JSON "
                                            r"object that reads back equal .*%s" % problem):
            model.save_checkpoint(str(tmp_path / "e.npz"), extra=lambda counters, extra=extra: extra)
    assert os.listdir(tmp_path) == []
    path = model.save_checkpoint(str(tmp_path / "e.npz"), extra=lambda counters: {"k": [1, 2.5, None, "s"]})
    assert _manifest(path)["extra"] == {"k": [1, 2.5, None, "s"]}
    table, other = _model("adagrad", seed=3)
    before = _state(table, other)
    with pytest.raises(TypeError, match=r"For 'RecModel.online_train', 'train_dataset' must be a MindSpore dataset "
                                        r"or an iterable of batches, but got 'int'"):
        other.online_train(5, dataset_sink_mode=False, resume_from=path)
    _assert_same(_state(table, other), before, "not resumed")


@pytest.mark.parametrize("full_every", [None, 3])
def test_a_branch_from_an_older_checkpoint_into_its_directory_is_refused_naming_the_later_ones(
        graph_mode, tmp_path, full_every):
    """Issue 61 item 2: a run resumed from step 3 of a directory holding its steps up to 8 would write a
    second branch among the first one's files: a later resume of the directory would load the abandoned
    step 8, and ``keep`` would prune the new branch's own files. Training into that directory is refused
    before the resume loads anything (``OnlineCheckpoint.check_resume``), naming the later checkpoints and
    the step: the model and the files are as they were, as they are when another trainer holds the
    directory's lock; with them moved
    away the branch trains, and after a crash the directory resumes from the branch's newest, its own
    files kept."""
    batches = _batches(14)
    d = tmp_path / "d"
    table, model = _model("adagrad")
    model.online_train(batches, dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(d, every_steps=1, keep=100, full_every=full_every), StopAfter(8)])

    def files():
        return {name: (d / name).read_bytes() for name in os.listdir(d) if name.endswith(".npz")}
    before = files()
    assert sorted(before) == sorted("recboost-%d.npz" % k for k in range(1, 9))
    table_b, model_b = _model("adagrad", seed=5)
    fresh = _state(table_b, model_b)
    with pytest.raises(ValueError, match=r"For 'OnlineCheckpoint', the checkpoint directory '.*d' must be free of "
                                         r"checkpoints of this run after step 3, the step it trains on from .*but got "
                                         r"\['recboost-4.npz', 'recboost-5.npz', 'recboost-6.npz', 'recboost-7.npz', "
                                         r"'recboost-8.npz'\]"):
        model_b.online_train(batches, dataset_sink_mode=False, resume_from=str(d / "recboost-3.npz"), callbacks=[
            rb.OnlineCheckpoint(d, every_steps=1, keep=2, full_every=full_every), StopAfter(6)])
    assert model_b.step == 0 and files() == before and not os.path.exists(d / ".recboost.lock")
    _assert_same(_state(table_b, model_b), fresh, "not loaded")
    with open(d / ".recboost.lock", "w") as held:                  # another trainer's lock, as flock takes it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        with pytest.raises(RuntimeError, match=r"must be used by one trainer at a time, but it is locked by the "
                                               r"running process pid 4242"):
            model_b.online_train(batches, dataset_sink_mode=False, resume_from=str(d / "recboost-8.npz"),
                                 callbacks=[rb.OnlineCheckpoint(d, every_steps=1, full_every=full_every)])
    assert model_b.step == 0 and files() == before
    _assert_same(_state(table_b, model_b), fresh, "not loaded")
    os.unlink(d / ".recboost.lock")

    (tmp_path / "abandoned").mkdir()
    for k in range(4, 9):
        os.rename(d / ("recboost-%d.npz" % k), tmp_path / "abandoned" / ("recboost-%d.npz" % k))
    table_c, model_c = _model("adagrad", seed=5)
    model_c.online_train(batches, dataset_sink_mode=False, resume_from=str(d / "recboost-3.npz"), callbacks=[
        rb.OnlineCheckpoint(d, every_steps=1, keep=2, full_every=full_every), StopAfter(6)])    # then a crash
    assert rb.latest_checkpoint(str(d)) == str(d / "recboost-6.npz")
    assert {"recboost-5.npz", "recboost-6.npz"} <= set(files())
    _assert_same(_state(*_loaded("adagrad", str(d))), _state(table_c, model_c), "the branch's newest")


def test_two_online_checkpoints_with_full_every_are_refused_at_train_start(graph_mode, tmp_path):
    """Issue 61 item 15: a model keeps one chain of incremental checkpoints, so two OnlineCheckpoints with
    full_every (in two directories) stopped training at step 6 ("'path' of a delta must be in the folder
    of its predecessor"). Refused at train start naming both directories, before any step or file; one
    with full_every beside one without trains, each directory resuming bit for bit."""
    table, model = _model("adagrad")
    with pytest.raises(ValueError, match=r"For 'OnlineCheckpoint', 'full_every' must be None on all but one "
                                         r"OnlineCheckpoint of a training .*but got \"full_every in \['.*a', '.*b'\]\""):
        model.online_train(_batches(10), dataset_sink_mode=False, callbacks=[
            rb.OnlineCheckpoint(tmp_path / "a", every_steps=1, full_every=3),
            rb.OnlineCheckpoint(tmp_path / "b", every_steps=1, full_every=2), StopAfter(8)])
    assert model.step == 0 and not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".npz")]
    table, model = _model("adagrad")
    model.online_train(_batches(10), dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(tmp_path / "a", every_steps=1, keep=100, full_every=3),
        rb.OnlineCheckpoint(tmp_path / "b", every_steps=1, keep=100), StopAfter(8)])
    assert _manifest(tmp_path / "a" / "recboost-8.npz")["format"] == 5
    for d in "ab":
        _assert_same(_state(*_loaded("adagrad", str(tmp_path / d))), _state(table, model), d)


@pytest.mark.slow
@pytest.mark.live_backend
def test_a_score_table_checkpoints_its_scores_and_resumes_bit_for_bit(graph_mode, backend, tmp_path, monkeypatch):
    """eviction_policy="score" in a RecModel: the pipeline hands each training batch's labels to the table
    (its cache ends exactly as a HashCache fed the same ids with each sample's label per id); the scores
    (the entries' counts) go through full checkpoints and deltas (the cache's "entries" patches) bit for
    bit, and a run stopped at a delta and resumed ends as the straight run."""
    monkeypatch.setitem(CASES, "adam-score", (lambda: rb.SparseAdam(0.01), dict(capacity=40, eviction=rb.Score(
        half_life=3, click_weight=1.0, nonclick_weight=0.25, admit_score=0.3))))
    case, batches = "adam-score", _batches(10)
    full, chained = str(tmp_path / "full"), str(tmp_path / "chained")
    table, model = _model(case)
    model.online_train(batches, dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(full, every_steps=1, keep=100),
        rb.OnlineCheckpoint(chained, every_steps=1, keep=100, full_every=3), StopAfter(8)])
    bare = rb.HashCache(40, eviction=table.cache.eviction)
    for batch in batches[:model.tables[0].cache.step]:       # (the prefetcher may have prepared past step 8)
        bare.lookup(batch[1], labels=np.repeat(batch[-1].reshape(-1, 1), FIELDS, axis=1).astype(np.int64))
    mine, want = table.cache.state_dict(), bare.state_dict()
    for key in ("keys", "rows", "counts", "last_seen", "replaced", "rejected"):
        np.testing.assert_array_equal(mine[key], want[key], err_msg=key)
    assert mine["replaced"] > 0 and mine["rejected"] > 0 and mine["counts"].max() > 2 * 65536
    kinds = set()
    for step in (5, 6, 8):
        name = "recboost-%d.npz" % step
        manifest = _manifest(os.path.join(chained, name))
        assert manifest["format"] == (4 if step % 3 == 1 else 5), name
        kinds |= {(key.split(".")[2], patch["kind"]) for key, patch in manifest.get("delta", {}).get(
            "patches", {}).items() if key.startswith("tables.0.")}
        _assert_same(_state(*_loaded(case, os.path.join(chained, name))),
                     _state(*_loaded(case, os.path.join(full, name))), name)
    assert ("cache", "entries") in kinds
    reference = dict(_state(table, model), run=None)
    resumed_dir = str(tmp_path / "resumed")
    _, model_b = _model(case)
    model_b.online_train(batches, dataset_sink_mode=False, callbacks=[
        rb.OnlineCheckpoint(resumed_dir, every_steps=1, keep=100, full_every=3), StopAfter(5)])
    assert _manifest(os.path.join(resumed_dir, "recboost-5.npz"))["format"] == 5
    table_c, model_c = _model(case, seed=5)
    model_c.online_train(batches, dataset_sink_mode=False, resume_from=resumed_dir, callbacks=[
        rb.OnlineCheckpoint(resumed_dir, every_steps=1, keep=100, full_every=3), StopAfter(8)])
    _assert_same(dict(_state(table_c, model_c), run=None), reference, "resumed at 5")
