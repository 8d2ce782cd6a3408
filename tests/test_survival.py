"""Online training that survives its environment (issue 10): one trainer per checkpoint directory,
every batch checked before it changes anything, all-or-nothing checkpoint loads, directory problems
found early and failed saves survived, CriteoReader on cut files and huge lines."""
import errno
import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn
from mindspore.train.callback import Callback

import recboost as rb
from _disk import FailingDisk
from _stopping import StopAfter

BATCH, FIELDS, DENSE, DIM = 32, 4, 3, 4


def _batches(seed, n):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = rng.normal(size=(BATCH, DENSE)).astype(np.float32)
        ids = rng.integers(0, 300, size=(BATCH, FIELDS)).astype(np.int64)
        label = (rng.random((BATCH, 1)) < 0.3).astype(np.float32)
        out.append((dense, ids, label))
    return out


def _model(seed=0, eviction_threshold=-1):
    ms.set_seed(seed)
    table = rb.HashEmbedding(DIM + 1, 256, access_threshold=1, eviction_threshold=eviction_threshold,
                             max_unique=BATCH * FIELDS + 1, input_index=1, name="ids", seed=seed)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _state(table, model):
    """Everything a bad batch or a refused file must leave alone."""
    out = {"param:" + p.name: p.asnumpy().copy() for p in model.state_parameters()}
    out["table"] = table.weight.copy()
    for key, value in table.cache.state_dict().items():
        out["cache:" + key] = np.asarray(value).copy()
    out["counters"] = np.array([model.step, model.batches_consumed, model.overflow_steps, model.samples]
                               + sorted(model.skipped_batches.items()), dtype=object)
    return out


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        if a[key].dtype == object:
            assert a[key].tolist() == b[key].tolist(), key
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _no_counters(state):
    return {k: v for k, v in state.items() if k != "counters"}


# ---- every batch checked before it changes anything ---------------------------------------------------
def _ids_5_columns(b):
    return b[0], np.concatenate([b[1], b[1][:, :1]], axis=1), b[2]


def _dense_12_columns(b):
    return b[0][:, :-1], b[1], b[2]


def _label_flat(b):
    return b[0], b[1], b[2].reshape(-1)


def _dense_int(b):
    return b[0].astype(np.int32), b[1], b[2]


def _float64_ids(b):
    return b[0], b[1].astype(np.float64), b[2]


def _extra_item(b):
    return b + (b[2],)


BAD_BATCHES = [
    ("ids with 5 columns", _ids_5_columns, ValueError, r"batch item 1 must be of shape \[B, 4\] like the "
                                                        r"first batch, but got 'shape \(32, 5\)'"),
    ("dense with 2 columns", _dense_12_columns, ValueError, r"batch item 0 must be of shape \[B, 3\]"),
    ("label of shape [B]", _label_flat, ValueError, r"batch item 2 \(the label\) must be of shape \[B, 1\]"),
    ("int dense", _dense_int, TypeError, "batch item 0 must be of dtype float32 like the first batch, "
                                         "but got 'dtype int32'"),
    ("float64 ids", _float64_ids, TypeError, "batch item 1 must be of dtype integer like the first batch, "
                                             "but got 'dtype float64'"),
    ("one item too many", _extra_item, ValueError, "the batch must be 3 items like the first batch, but got "
                                                   "'4 items'"),
]


@pytest.fixture(scope="module")
def straight_runs():
    """Backend name -> the states of the run of _batches(1, 5) without a bad batch, after 3 steps and after
    5 (``_straight_run``): made by the first case of a backend, the same for all its cases."""
    return {}


def _straight_run(runs, backend):
    """The states of the straight run on ``backend`` (:func:`straight_runs`), made now if not yet."""
    if backend.name not in runs:
        good = _batches(1, 5)
        ref_table, ref = _model()
        ref.online_train(good[:3], dataset_sink_mode=False)
        after_3 = _state(ref_table, ref)
        ref.online_train(good[3:], dataset_sink_mode=False)
        runs[backend.name] = after_3, _state(ref_table, ref)
    return runs[backend.name]


@pytest.mark.slow
@pytest.mark.parametrize("case, make, exc, match", BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_changes_nothing_and_the_run_goes_on_as_without_it(graph_mode, backend, straight_runs, case, make,
                                                                     exc, match):
    good = _batches(1, 5)
    table, model = _model()
    model.online_train(good[:2], dataset_sink_mode=False)
    before = _state(table, model)
    with pytest.raises(exc, match=match):
        model.online_train([good[2], make(good[3]), good[3], good[4]], dataset_sink_mode=False)
    assert model.step == 3
    after_3, after_5 = _straight_run(straight_runs, backend)
    _assert_same(after_3, _state(table, model))     # nothing of the bad batch, nor after it
    assert _state(table, model)["counters"].tolist() != before["counters"].tolist()
    model.online_train(good[3:], dataset_sink_mode=False)
    _assert_same(after_5, _state(table, model))


def test_float64_ids_in_the_first_batch_are_named_as_float64(backend):
    table, model = _model()
    dense, ids, label = _batches(1, 1)[0]
    with pytest.raises(TypeError, match="'ids' must be an array of integers, but got 'array of dtype float64'"):
        model.online_train([(dense, ids.astype(np.float64), label)], dataset_sink_mode=False)
    assert len(table.cache) == 0 and model.step == 0


@pytest.mark.slow
@pytest.mark.live_backend
def test_float16_dense_trains_as_float32(graph_mode, backend):
    good = _batches(2, 3)
    half = [(d.astype(np.float16), i, y) for d, i, y in good]
    widened = [(d.astype(np.float16).astype(np.float32), i, y) for d, i, y in good]
    table_a, a = _model()
    a.online_train(half, dataset_sink_mode=False)
    table_b, b = _model()
    b.online_train(widened, dataset_sink_mode=False)
    _assert_same(_state(table_a, a), _state(table_b, b))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["dense", "label"])
@pytest.mark.live_backend
def test_nonfinite_batch_is_skipped_before_its_ids_reach_the_cache(graph_mode, backend, where):
    good = _batches(3, 4)
    dense, ids, label = good[1]
    ids = ids + 10_000                   # ids no other batch has: none may reach the cache
    bad = (np.where(np.arange(DENSE) == 1, np.inf, dense).astype(np.float32), ids, label) if where == "dense" \
        else (dense, ids, np.where(np.arange(BATCH)[:, None] == 3, np.nan, label).astype(np.float32))
    table, model = _model()
    model.online_train([good[0], bad, good[2], good[3]], dataset_sink_mode=False)
    assert model.step == 3
    assert model.skipped_batches == ({"empty": 0, "bad_label": 0, "nonfinite": 1} if where == "dense" else
                                     {"empty": 0, "bad_label": 1, "nonfinite": 0})
    assert table.cache.find(ids.ravel()).max() == rb.HASH_DEFAULT_ROW
    ref_table, ref = _model()
    ref.online_train([good[0], good[2], good[3]], dataset_sink_mode=False)
    _assert_same(_no_counters(_state(ref_table, ref)), _no_counters(_state(table, model)))


class _FailAt(Callback):
    """Raise in on_train_step_begin of step ``step`` (once)."""

    def __init__(self, step):
        self.step, self.failed = step, False

    def on_train_step_begin(self, run_context):
        if run_context.original_args().cur_step_num == self.step and not self.failed:
            self.failed = True
            raise KeyboardInterrupt("operator pressed ^C")


@pytest.mark.slow
@pytest.mark.live_backend
def test_batches_prepared_after_a_failed_step_are_trained_next_not_lost(graph_mode, backend):
    """The prefetcher had counted the ids of the batches after the failed step: they are kept and
    trained first by the next call on the same stream, so the run equals one without the failure."""
    good = _batches(4, 8)
    table, model = _model()
    stream = iter(good)
    with pytest.raises(KeyboardInterrupt):
        model.online_train(stream, callbacks=_FailAt(4), dataset_sink_mode=False)
    assert model.step == 3 and len(model._unconsumed) >= 1
    model.online_train(stream, dataset_sink_mode=False)
    ref_table, ref = _model()
    ref.online_train(good, dataset_sink_mode=False)
    assert model.step == ref.step == 8
    _assert_same(_state(ref_table, ref), _state(table, model))


# ---- one trainer per directory --------------------------------------------------------------------
_HOLDER = """
import sys, time
sys.path.insert(0, %r)
import recboost as rb
lock = rb._DirectoryLock(sys.argv[1])
lock.acquire("holder")
print("locked", flush=True)
time.sleep(120)
"""


def _hold_lock(directory):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER % root, str(directory)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, GLOG_v="3"))
    assert proc.stdout.readline().strip() == "locked"
    return proc


class _Probe(Callback):
    def __init__(self, directory):
        self.directory, self.seen = directory, []

    def on_train_step_end(self, run_context):
        self.seen.append(sorted(os.listdir(self.directory)))
        with open(os.path.join(self.directory, ".recboost.lock")) as fh:
            self.pid = int(fh.read())


def test_second_trainer_is_refused_and_a_dead_holders_lock_is_taken_over(graph_mode, tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        table, model = _model()
        ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=1)
        with pytest.raises(RuntimeError, match=r"checkpoint directory '%s' must be used by one trainer at a "
                                               r"time, but it is locked by the running process pid %d"
                           % (re.escape(str(tmp_path)), holder.pid)):
            model.online_train(_batches(5, 2), callbacks=ckpt, dataset_sink_mode=False)
        assert model.step == 0 and rb.latest_checkpoint(str(tmp_path)) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(tmp_path / ".recboost.lock")            # the dead holder's file is left behind
    probe = _Probe(str(tmp_path))
    model.online_train(_batches(5, 2), callbacks=[ckpt, probe], dataset_sink_mode=False)
    assert model.step == 2 and probe.pid == os.getpid()
    assert not os.path.exists(tmp_path / ".recboost.lock")        # released at the end


def test_two_trainers_in_one_process_cannot_share_a_directory(graph_mode, tmp_path):
    table, model = _model()
    _, other = _model(1)
    errors = []

    class _Second(Callback):
        def on_train_step_end(self, run_context):
            if not errors:
                try:
                    other.online_train(_batches(6, 1), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=1),
                                       dataset_sink_mode=False)
                except RuntimeError as exc:
                    errors.append(str(exc))

    model.online_train(_batches(6, 3), callbacks=[rb.OnlineCheckpoint(tmp_path, every_steps=1), _Second()],
                       dataset_sink_mode=False)
    assert len(errors) == 1 and "pid %d (this process: another OnlineCheckpoint of this directory holds it)" % (
        os.getpid()) in errors[0]
    assert other.step == 0 and model.step == 3


def test_temporary_files_are_cleaned_only_when_their_writer_is_gone(graph_mode, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = [".tmp-%d-inflight.npz" % live.pid, ".tmp-%d-crashed.npz" % dead.pid,
                 ".tmp-%d-mine.npz" % os.getpid()]
        for name in names:
            (tmp_path / name).write_bytes(b"partial")
        table, model = _model()
        model.online_train(_batches(7, 2), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=1),
                           dataset_sink_mode=False)
        left = sorted(n for n in os.listdir(tmp_path) if n.startswith(".tmp-"))
        assert left == [names[0]]                # the live writer's file survives
    finally:
        live.kill()
        live.wait()


def test_a_damaged_checkpoint_in_the_directory_is_named_as_unreadable_not_as_another_runs(graph_mode, tmp_path):
    (tmp_path / "recboost-3.npz").write_bytes(b"PK\x03\x04 cut short")
    table, model = _model()
    with pytest.raises(ValueError, match=r"must be free of other runs' checkpoints .*but got 'recboost-3.npz whose "
                                         r"run cannot be read \(damaged, or no recboost checkpoint\)'"):
        model.online_train(_batches(8, 2), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=1),
                           dataset_sink_mode=False)
    assert model.step == 0 and sorted(os.listdir(tmp_path)) == ["recboost-3.npz"]


@pytest.mark.slow
def test_a_directory_of_another_run_is_refused_and_its_files_never_pruned(graph_mode, tmp_path):
    table, first = _model()
    first.online_train(_batches(8, 4), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=5),
                       dataset_sink_mode=False)
    theirs = sorted(os.listdir(tmp_path))
    assert theirs == ["recboost-2.npz", "recboost-4.npz"]
    _, second = _model(1)
    with pytest.raises(ValueError, match="must be free of other runs' checkpoints .*recboost-4.npz"):
        second.online_train(_batches(8, 4), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=1),
                            dataset_sink_mode=False)
    assert sorted(os.listdir(tmp_path)) == theirs and second.step == 0
    # another run's file appearing during a run (e.g. copied in) is not pruned either
    other_dir = tmp_path / "other"
    _, third = _model(2)
    third.online_train(_batches(9, 1), dataset_sink_mode=False)
    third.save_checkpoint(str(other_dir / "recboost-1.npz"))
    resumed_table, resumed = _model(3)

    class _CopyIn(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 5:
                os.link(other_dir / "recboost-1.npz", tmp_path / "recboost-1.npz")

    resumed.online_train(iter(_batches(8, 8)), callbacks=[rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=1),
                                                          _CopyIn()],
                         dataset_sink_mode=False, resume_from=str(tmp_path))
    assert resumed.run_id == first.run_id and resumed.step == 8
    assert sorted(os.listdir(tmp_path)) == ["other", "recboost-1.npz", "recboost-8.npz"]


# ---- directory problems found early; failed saves survived ------------------------------------------
def test_directory_problems_are_found_at_construction_and_at_train_start(graph_mode, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="'directory' must be a directory, but got '%s, which is a file'"
                       % re.escape(str(a_file))):
        rb.OnlineCheckpoint(a_file, every_seconds=600)
    with pytest.raises(ValueError, match="must be a path whose existing part is a directory"):
        rb.OnlineCheckpoint(a_file / "sub", every_seconds=600)
    with pytest.raises(ValueError, match="'directory' must be a writable directory, but got '/sys/kernel"):
        rb.OnlineCheckpoint("/sys/kernel", every_seconds=600)             # not writable, even by root
    with pytest.raises(ValueError, match="'directory' must be a writable directory"):
        rb.OnlineCheckpoint("/sys/kernel/recboost-ckpt", every_seconds=600)
    later = tmp_path / "later"
    ckpt = rb.OnlineCheckpoint(later, every_seconds=600)           # fine now; becomes a file before training
    later.write_text("oops")
    table, model = _model()
    with pytest.raises(ValueError, match="which is a file"):
        model.online_train(_batches(10, 2), callbacks=ckpt, dataset_sink_mode=False)
    assert model.step == 0


def test_a_full_disk_keeps_the_last_checkpoint_and_training_goes_on(graph_mode, tmp_path, monkeypatch, capfd):
    disk = FailingDisk(monkeypatch)
    seen = []

    class _Fill(Callback):
        def on_train_step_end(self, run_context):
            step = run_context.original_args().cur_step_num
            disk.full = step in (4, 5, 6)        # the saves at steps 4 and 6 fail, the one at 8 works
            seen.append(sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")))

    table, model = _model()
    ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=1, max_failed_saves=3, save_on_end=False)
    model.online_train(_batches(11, 8), callbacks=[_Fill(), ckpt], dataset_sink_mode=False)
    assert model.step == 8 and ckpt.failed_saves == 2
    assert seen[5] == ["recboost-2.npz"] and seen[6] == ["recboost-2.npz"]      # kept while saves failed
    assert sorted(os.listdir(tmp_path)) == ["recboost-8.npz"]                   # no temporary left
    err = capfd.readouterr().err
    assert re.search(r"SAVING %s FAILED \(OSError: \[Errno 28\] No space left on device: writing '%s' \(\d+ bytes of "
                     r"content\) failed after 17 bytes\)" % ((re.escape(str(tmp_path / "recboost-4.npz")),) * 2), err)
    assert "the last good checkpoint %s is kept" % (tmp_path / "recboost-2.npz") in err


def test_consecutive_failed_saves_end_training_naming_the_path(graph_mode, tmp_path, monkeypatch):
    disk = FailingDisk(monkeypatch)

    class _Fill(Callback):
        def on_train_step_end(self, run_context):
            disk.full = run_context.original_args().cur_step_num >= 1

    table, model = _model()
    ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=2, max_failed_saves=2)
    with pytest.raises(RuntimeError, match="must succeed within 2 tries in a row, but 2 failed, the last to '%s'"
                       % re.escape(str(tmp_path / "recboost-4.npz"))):
        model.online_train(_batches(12, 9), callbacks=[_Fill(), ckpt], dataset_sink_mode=False)
    assert model.step == 4 and ckpt.failed_saves == 2
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(ValueError, match="'max_failed_saves' must be an int >= 1"):
        rb.OnlineCheckpoint(tmp_path, every_steps=2, max_failed_saves=0)


# ---- all-or-nothing checkpoint loads -------------------------------------------------------------
def _members(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _write_signed(path, meta, arrays):
    """Write the checkpoint ``path`` of the manifest ``meta`` and the members ``arrays`` with its checksums
    made anew (recboost's writer), so that an edit reaches the checks behind them."""
    meta = {k: v for k, v in meta.items() if k not in ("sha256", "members")}
    rb._atomic_write(path, lambda fh: rb._write_checkpoint_file(fh, meta, {k: v for k, v in arrays.items()
                                                                           if k != "manifest"}))


def _rewrite_meta(src, dst, edit):
    """Copy the checkpoint ``src`` to ``dst`` with its manifest edited (and its checksums made anew)."""
    arrays = _members(src)
    meta = json.loads(arrays["manifest"].tobytes().decode())
    edit(meta)
    _write_signed(dst, meta, arrays)


def _drop(path):
    def edit(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


def _set(path, value):
    def edit(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


META_CASES = [
    (("step",), "lacks the field 'step'", "x"),
    (("taken",), "lacks the field 'taken'", -1),
    (("overflow_steps",), "lacks the field 'overflow_steps'", 1.5),
    (("samples",), "lacks the field 'samples'", None),
    (("skipped_batches",), "lacks the field 'skipped_batches'", {"empty": "3"}),
    (("replay",), "lacks the field 'replay'", [[1, 2]]),
    (("tables",), "lacks the field 'tables'", "tables"),
    (("version",), "lacks the field 'version'", 3),
    (("network",), "lacks the field 'network'", ["WideDeep"]),
    (("evict_hooks",), "lacks the field 'evict_hooks'", [{"last_step": "soon"}]),
    (("run",), "lacks the field 'run'", 7),
    (("parameters",), "lacks the field 'parameters'", ["w"]),
    (("tables", 0, "cache"), r"lacks the field 'tables\[0\].cache'", {"keys": 3}),
    (("replay", 0, "inputs"), r"lacks the field 'replay\[0\].inputs'", "x"),
    (("tables", 0, "seed"), r"lacks the field 'tables\[0\].seed'", -3),
    (("tables", 0, "embedding_size"), r"lacks the field 'tables\[0\].embedding_size'", "nine"),
]


@pytest.fixture(scope="module")
def replay_checkpoint(tmp_path_factory):
    """The checkpoint every case of META_CASES edits, written once: a model stopped at step 3 with batches
    prepared (the file has a replay list). ``(its path, that model's state but its counters, (step,
    samples, run id))``; the cases copy it before they edit."""
    from _dist import graph_mode_on_cpu
    with graph_mode_on_cpu():
        table, model = _model()
        model.online_train(iter(_batches(13, 6)), callbacks=[rb.EvictHook(evict_step_interval=2),
                                                             StopAfter(3)], dataset_sink_mode=False)
        assert model._unconsumed                      # prepared batches: the file has a replay list
        good = str(tmp_path_factory.mktemp("replay") / "good.npz")
        model.save_checkpoint(good)
        return good, _no_counters(_state(table, model)), (model.step, model.samples, model.run_id)


@pytest.fixture(scope="module")
def load_target(tmp_path_factory):
    """The model every case of META_CASES loads into, made and trained once (seed 7, other batches: its
    state is not the checkpoint's), and a checkpoint of it, which each case loads first to give it that
    state again: ``(table, model, its checkpoint)``."""
    from _dist import graph_mode_on_cpu
    with graph_mode_on_cpu():
        table, model = _model(7)
        model.online_train(_batches(14, 2), dataset_sink_mode=False)
        own = str(tmp_path_factory.mktemp("target") / "own.npz")
        model.save_checkpoint(own)
        return table, model, own


@pytest.mark.parametrize("field, missing, bad_value", META_CASES, ids=[".".join(map(str, c[0])) for c in META_CASES])
def test_a_missing_or_mistyped_field_is_refused_whole(graph_mode, tmp_path, replay_checkpoint, load_target, field,
                                                      missing, bad_value):
    source, state, counters = replay_checkpoint
    good = str(tmp_path / "good.npz")
    shutil.copyfile(source, good)
    target_table, target, own = load_target
    target.load_checkpoint(own)                      # its own state again (the case before loaded the good file)
    before = _state(target_table, target)
    assert not np.array_equal(before["table"], state["table"])     # a partial load would show
    for name, edit, match in (("missing.npz", _drop(field), missing),
                              ("mistyped.npz", _set(field, bad_value), "has a bad (field|state)")):
        path = str(tmp_path / name)
        _rewrite_meta(good, path, edit)
        with pytest.raises(ValueError, match="checkpoint '%s' %s" % (re.escape(path), match)):
            target.load_checkpoint(path)
        _assert_same(before, _state(target_table, target))
        assert target.train_network is not None
    target.load_checkpoint(good)                     # the good file still loads, whole
    _assert_same(state, _no_counters(_state(target_table, target)))
    assert (target.step, target.samples, target.run_id) == counters


PARTS_CASES = [
    ("world", lambda m: m.update(world=0), r"has a bad field 'world': it must be an int >= 1, but got 0"),
    ("order", lambda m: m["parts"].reverse(),
     r"has a bad field 'parts': it must be one part per rank 0..1, in rank order, but got \[1, 0\]"),
    ("directory", lambda m: m["parts"][1].update(file="../elsewhere.npz"),
     r"has a bad field 'parts\[1\].file': it must be a file name \(no directory\), but got '../elsewhere.npz'"),
    ("digest", lambda m: m["parts"][0].pop("sha256"), r"lacks the field 'parts\[0\].sha256'"),
    ("missing", lambda m: None, r"names rank 0's part '.*x-part0.npz', which is missing"),
]


@pytest.mark.parametrize("edit, problem", [c[1:] for c in PARTS_CASES], ids=[c[0] for c in PARTS_CASES])
def test_a_bad_row_wise_manifest_is_refused_naming_the_field(graph_mode, tmp_path, replay_checkpoint, load_target,
                                                             edit, problem):
    """The manifest of a row-wise checkpoint (its world and one part file per rank) is checked whole
    before any part is opened: a part file must sit beside it (no directory in its name)."""
    good = replay_checkpoint[0]
    table, model, own = load_target
    model.load_checkpoint(own)                       # its own state again (another case may have loaded another)

    def row_wise(meta):
        meta.update(world=2, parts=[{"rank": r, "file": "x-part%d.npz" % r, "size": 1, "sha256": "00"}
                                    for r in range(2)])
        edit(meta)
    path = str(tmp_path / "rowwise.npz")
    _rewrite_meta(good, path, row_wise)
    before = _state(table, model)
    with pytest.raises(ValueError, match=r"the checkpoint '%s' %s\.$" % (re.escape(path), problem)):
        model.load_checkpoint(path)
    _assert_same(before, _state(table, model))


def test_other_formats_are_refused_naming_the_version(graph_mode, tmp_path):
    """A manifest of another format is refused naming it; a file of recboost before 0.2.0 (format 2: its
    metadata in the member "meta", no manifest) is refused saying so; nothing of the model changes."""
    table, model = _model()
    model.online_train(_batches(19, 2), dataset_sink_mode=False)
    good = str(tmp_path / "good.npz")
    model.save_checkpoint(good)
    target_table, target = _model(5)
    target.online_train(_batches(20, 1), dataset_sink_mode=False)
    before = _state(target_table, target)
    for version in (6, "4", 2):
        path = str(tmp_path / ("v%s.npz" % version))
        _rewrite_meta(good, path, _set(("format",), version))
        with pytest.raises(ValueError, match=r"the checkpoint '%s' has format %r, but this recboost reads format "
                                             r"4, its deltas' 5 \(and format 3 as recboost 0.2.0 wrote it\)\.$"
                                             % (re.escape(path), version)):
            target.load_checkpoint(path)
        _assert_same(before, _state(target_table, target))
    path = str(tmp_path / "v5.npz")          # a delta's format, without the delta's field naming its predecessor
    _rewrite_meta(good, path, _set(("format",), 5))
    with pytest.raises(ValueError, match=r"the checkpoint '%s' has a bad field 'delta': it must be an object, but "
                                         r"got None\.$" % re.escape(path)):
        target.load_checkpoint(path)
    _assert_same(before, _state(target_table, target))
    arrays = _members(good)
    arrays["meta"] = arrays.pop("manifest")
    np.savez(str(tmp_path / "format2.npz"), **arrays)
    with pytest.raises(ValueError, match="format2.npz' cannot be read \\(it has no member 'manifest'; it has "
                                         "format 2's 'meta': a checkpoint of recboost before 0.2.0, which this "
                                         "version does not read\\)"):
        target.load_checkpoint(str(tmp_path / "format2.npz"))
    del arrays["meta"]
    np.savez(str(tmp_path / "bare.npz"), **arrays)
    with pytest.raises(ValueError, match="bare.npz' cannot be read \\(it has no member 'manifest'\\)"):
        target.load_checkpoint(str(tmp_path / "bare.npz"))
    _assert_same(before, _state(target_table, target))


def _manifest_of(path):
    return json.loads(_members(path)["manifest"].tobytes().decode())


@pytest.mark.parametrize("which", ["parameter", "table rows", "cache keys", "slot", "replayed input",
                                   "replayed new ids"])
def test_a_missing_array_is_named_and_nothing_loads(graph_mode, tmp_path, replay_checkpoint, load_target, which):
    good = replay_checkpoint[0]
    manifest = _manifest_of(good)
    first_param = sorted(manifest["parameters"])[0]
    assert manifest["replay"]                     # prepared batches: the file has a replay list
    name, part = {
        "parameter": (manifest["parameters"][first_param], "parameters[%r]" % first_param),
        "table rows": (manifest["tables"][0]["table"], "tables[0].table"),
        "cache keys": (manifest["tables"][0]["cache"]["keys"], "tables[0].cache['keys']"),
        "slot": (manifest["tables"][0]["slots"]["moment2"], "tables[0].slots['moment2']"),
        "replayed input": (manifest["replay"][0]["inputs"][0], "replay[0].inputs[0]"),
        "replayed new ids": (manifest["replay"][0]["tables"][0]["new_ids"], "replay[0].tables[0].new_ids"),
    }[which]
    arrays = _members(good)
    del arrays[name]
    path = str(tmp_path / "missing.npz")
    _write_signed(path, manifest, arrays)
    target_table, target, own = load_target
    target.load_checkpoint(own)                      # its own state again (another case may have loaded another)
    before = _state(target_table, target)
    assert _manifest_of(good)["evict_hooks"]                       # its hook states would show (own has none)
    match = r"the checkpoint '%s' lacks the array '%s' \(the manifest's %s\)\.$" % (
        re.escape(path), re.escape(name), re.escape(part))
    with pytest.raises(ValueError, match=match):
        target.load_checkpoint(path)
    _assert_same(before, _state(target_table, target))
    assert target._evict_hook_states == [] and not target._unconsumed


def test_an_array_the_manifest_does_not_name_is_refused(graph_mode, tmp_path):
    table, model = _model()
    model.online_train(_batches(23, 2), dataset_sink_mode=False)
    good = str(tmp_path / "good.npz")
    model.save_checkpoint(good)
    arrays = _members(good)
    arrays["stray"] = np.zeros(3)
    path = str(tmp_path / "stray.npz")
    _write_signed(path, _manifest_of(good), arrays)
    target_table, target = _model(7)
    before = _state(target_table, target)
    with pytest.raises(ValueError, match=r"'%s' holds arrays its manifest does not name: \['stray'\]"
                       % re.escape(path)):
        target.load_checkpoint(path)
    _assert_same(before, _state(target_table, target))


def test_every_file_is_written_by_the_one_atomic_helper(graph_mode, tmp_path, monkeypatch):
    """Checkpoints and PCA matrices go through _atomic_write; a failed write leaves the previous file
    whole and no temporary behind."""
    written, real = [], rb._atomic_write

    def spy(path, write, size=None, recycle=None):
        written.append(os.path.basename(path))
        return real(path, write, size=size, recycle=recycle)
    monkeypatch.setattr(rb, "_atomic_write", spy)
    table, model = _model()
    model.online_train(_batches(24, 2), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=1, keep=5),
                       dataset_sink_mode=False)
    model.save_checkpoint(str(tmp_path / "by-hand.npz"))
    pca = str(tmp_path / "pca.npy")
    rb.save_pca_mat(np.eye(3), pca)
    assert written == ["recboost-1.npz", "recboost-2.npz", "by-hand.npz", "pca.npy"]

    def half_then_fail(fh, arr, **kwargs):
        fh.write(b"\x93NUMPY half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        rb.save_pca_mat(np.zeros((3, 3)), pca)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.load(pca), np.eye(3, dtype=np.float32))        # the old file, whole
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_checkpoint_names_are_made_and_parsed_in_one_place(tmp_path):
    assert rb._checkpoint_name("run.a", 12) == "run.a-12.npz"
    assert rb._checkpoint_step("run.a-12.npz", "run.a") == 12
    for name in ("runxa-12.npz", "run.a-12.npz.tmp", "run.a-x.npz", ".tmp-1-run.a-12.npz", "run.a-12.npy"):
        assert rb._checkpoint_step(name, "run.a") is None, name
    for step in (9, 10, 2):
        (tmp_path / rb._checkpoint_name("run.a", step)).write_bytes(b"")
    (tmp_path / "runxa-99.npz").write_bytes(b"")
    assert rb.latest_checkpoint(str(tmp_path), "run.a") == str(tmp_path / "run.a-10.npz")     # by number


# ---- CriteoReader ---------------------------------------------------------------------------------
def _criteo_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = [str(int(v)) for v in rng.integers(0, 100, 13)]
        cats = ["%08x" % int(v) for v in rng.integers(0, 1 << 32, 26)]
        lines.append("\t".join([str(int(rng.random() < 0.3))] + dense + cats) + "\n")
    return "".join(lines).encode()


def test_a_cut_gzip_file_yields_its_intact_rows_then_names_file_and_offset(tmp_path, backend):
    text = _criteo_lines(3000)
    whole = gzip.compress(text)
    path = str(tmp_path / "day_0.gz")
    with open(path, "wb") as fh:
        fh.write(whole[: len(whole) * 2 // 3])
    reader = rb.CriteoReader(path, batch_size=256, chunk_bytes=1 << 16)
    rows = []
    with pytest.raises(EOFError, match=r"the file '%s' must be a complete compressed stream, but got 'one cut "
                                       r"short at decompressed byte offset (\d+), after (\d+) intact rows"
                       % re.escape(path)) as info:
        for dense, ids, label in reader:
            rows.append(label)
    offset = int(info.value.args[0].split("byte offset ")[1].split(",")[0])
    intact = text[:offset].count(b"\n")
    assert 0 < intact < 3000 and sum(len(r) for r in rows) == intact
    full = np.concatenate([y for _, _, y in rb.CriteoReader(io.BytesIO(text), batch_size=256)])
    np.testing.assert_array_equal(np.concatenate(rows), full[:intact])


def test_a_huge_line_ending_in_a_newline_is_counted_too_long(tmp_path, backend):
    good = _criteo_lines(3, seed=1)
    huge = b"1" + b"\tx" * (3 << 20 >> 1) + b"\n"                 # a 3 MB line
    path = tmp_path / "huge.txt"
    path.write_bytes(good + huge + good)
    reader = rb.CriteoReader(str(path), batch_size=4, chunk_bytes=8 << 20)      # the line fits one chunk
    labels = np.concatenate([y for _, _, y in reader])
    assert labels.size == 6
    malformed = reader.stats()["malformed"]
    assert malformed["too_long"] == 1 and malformed["field_count"] == 0


# ---- flat memory in PyNative mode -----------------------------------------------------------------
def _rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class _Rss(Callback):
    def __init__(self, at):
        self.at, self.rss = at, {}

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step in self.at:
            self.rss[step] = _rss_mb()


def test_pynative_training_keeps_memory_flat():
    """Run op by op, MindSpore's PyNative mode keeps ~20 KB of native memory per step (6+ MB over
    these 300 steps); RecModel compiles its step cells, so it keeps none (the full soak is in
    bench/bench_soak.py)."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        table, model = _model()
        batches = _batches(16, 8)
        rss = _Rss({100, 400})
        model.online_train((batches[k % 8] for k in range(400)), callbacks=rss, dataset_sink_mode=False)
    finally:
        ms.set_context(mode=old)
    assert model.step == 400
    assert rss.rss[400] - rss.rss[100] < 2.0, rss.rss


@pytest.mark.slow
@pytest.mark.live_backend
def test_a_stopped_run_continues_exactly_in_process_and_from_its_last_checkpoint(graph_mode, backend, tmp_path):
    """request_stop() leaves up to 2 batches prepared (their ids counted): they are trained first by
    the next call, and the checkpoint written at train end carries them for a resume."""
    good = _batches(17, 10)
    ref_table, ref = _model()
    ref.online_train(good, dataset_sink_mode=False)
    table, model = _model()
    stream = iter(good)
    model.online_train(stream, callbacks=[StopAfter(5), rb.OnlineCheckpoint(tmp_path, every_steps=100)],
                       dataset_sink_mode=False)
    assert model.step == 5
    resumed_table, resumed = _model(4)
    resumed.online_train(good, dataset_sink_mode=False, resume_from=str(tmp_path))
    model.online_train(stream, dataset_sink_mode=False)
    assert model.step == resumed.step == 10
    _assert_same(_state(ref_table, ref), _state(table, model))
    _assert_same(_no_counters(_state(ref_table, ref)), _no_counters(_state(resumed_table, resumed)))
