"""Full checkpoints written while training goes on (issue #62 item 4): ``OnlineCheckpoint(background=True)``
copies the step's state in its pause and writes the file on a thread. The file is the blocking save's of
the same step, byte for byte (rows, Adam slots, cache and scores, dense part: all of one step, while the
steps after it run); a save waits for the write before it; a failed write is counted and reported as a
blocking one is, the last good checkpoint kept; the end of training waits for the write. Kills at random
moments of background writes: tests/test_crash.py."""
import errno
import filecmp
import os
import threading
import time

import numpy as np
import pytest

import recboost as rb
from _stopping import StopAfter
from test_incremental_checkpoint import CASES, _batches, _hooks, _manifest, _model

WRITER = "recboost-checkpoint-write"       # the name of the background write's thread
SNAPSHOT = rb._RowsSnapshot               # (its ROWS: the rows a piece of the file holds)


class _SlowFile:
    """The open checkpoint file ``fh`` of a background write: each write to it first waits until the
    model has reached step ``until`` (at most ``PATIENCE`` seconds a file), so that steps run during
    the write whatever the machine's speed, and is recorded (the model's step then) in ``seen``; the
    ``fail_at``-th write raises ``error``."""

    PATIENCE = 10.0

    def __init__(self, fh, model, until, seen, fail_at, error):
        self.fh, self.model, self.until = fh, model, until
        self.seen, self.fail_at, self.error = seen, fail_at, error
        self.deadline = time.monotonic() + self.PATIENCE

    def write(self, data):
        self.seen.append(self.model.step)
        if len(self.seen) == self.fail_at:
            raise self.error
        while self.model.step < self.until and time.monotonic() < self.deadline:
            time.sleep(0.001)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


class _SlowWrites:
    """``recboost._write_checkpoint_file`` held back on the background writer's thread (:class:`_SlowFile`)
    until the model is ``ahead`` steps past the checkpoint's step (or at ``last``, where training
    stops), recording per background checkpoint (its step) the model's steps seen while it was
    written, and how many background writes ran at once at most. ``fail_at``: the checkpoint of that
    step fails with ``error`` at its 20th write."""

    def __init__(self, monkeypatch, model, last, ahead=2, fail_at=None, error=None):
        self.seen, self.running, self.most = {}, 0, 0
        real = rb._write_checkpoint_file

        def write_file(fh, manifest, arrays):
            if threading.current_thread().name != WRITER:
                return real(fh, manifest, arrays)
            self.running += 1
            self.most = max(self.most, self.running)
            step = manifest["step"]
            seen = self.seen.setdefault(step, [])
            slow = _SlowFile(fh, model, min(step + ahead, last), seen, 20 if step == fail_at else None, error)
            try:
                return real(slow, manifest, arrays)
            finally:
                self.running -= 1
        monkeypatch.setattr(rb, "_write_checkpoint_file", write_file)


def _score_case(monkeypatch):
    monkeypatch.setitem(CASES, "adam-score", (lambda: rb.SparseAdam(0.01), dict(capacity=40, eviction=rb.Score(
        half_life=3, click_weight=1.0, nonclick_weight=0.25, admit_score=0.3))))


@pytest.mark.parametrize("case", ["adam-lru-sketch", "adam-score", "ftrl-bf16-grow-evict"])
@pytest.mark.live_backend
def test_a_background_checkpoint_is_the_blocking_one_byte_for_byte(graph_mode, backend, tmp_path, monkeypatch,
                                                                   case):
    """One run, two OnlineCheckpoints every 3 steps: blocking into a/, in the background into b/, whose
    writes are held back so that the steps after each go on during it (asserted: the model's step moved on
    while the arrays of the file were written, for every checkpoint but the one at the end). Every file
    of b/ equals a/'s of its step, byte for byte: Adam's and FTRL's slots, the rows, the cache (LRU with
    a sketch, scores, bfloat16 rows with growth and evictions) and the dense part are all of one step.
    A save due while a write runs waits for it (one write at a time), and online_train returns with the
    last file complete and no write running. Each write is held back until two more steps have run. The rows are read in ranges of 4 (``_RowsSnapshot.ROWS``), so
    the steps keep rows the writer has not reached, and it lays them over the live ones."""
    _score_case(monkeypatch)
    monkeypatch.setattr(SNAPSHOT, "ROWS", 4)          # many ranges a file: rows kept and let go between them
    kept, keep = [], SNAPSHOT.keep

    def keeping(snapshot, rows):
        keep(snapshot, rows)
        kept.append(snapshot.kept_bytes)
    monkeypatch.setattr(SNAPSHOT, "keep", keeping)
    table, model = _model(case)
    slow = _SlowWrites(monkeypatch, model, last=20)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    background = rb.OnlineCheckpoint(b, every_steps=3, keep=100, background=True)
    model.online_train(_batches(40), dataset_sink_mode=False, callbacks=_hooks(case) + [
        rb.OnlineCheckpoint(a, every_steps=3, keep=100), background, StopAfter(20)])
    assert model.step == 20
    assert not [t for t in threading.enumerate() if t.name == WRITER]
    names = sorted(n for n in os.listdir(a) if n.endswith(".npz"))
    assert names == sorted("recboost-%d.npz" % s for s in (3, 6, 9, 12, 15, 18, 20))
    assert sorted(n for n in os.listdir(b) if not n.startswith(".")) == names
    assert background.saved == [os.path.join(b, "recboost-%d.npz" % s) for s in (3, 6, 9, 12, 15, 18, 20)]
    for name in names:
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name
    assert sorted(slow.seen) == [3, 6, 9, 12, 15, 18, 20]
    for step in (3, 6, 9, 12, 15, 18):
        assert max(slow.seen[step]) > step, (step, slow.seen[step])      # steps ran during its write
    assert slow.most == 1
    assert max(kept) > 0 and table.store.snapshot is None           # rows were kept (copy on write), then let go
    manifest = _manifest(os.path.join(b, "recboost-9.npz"))
    assert manifest["step"] == 9 and manifest["tables"][0]["slots"]     # (Adam's, FTRL's: compared above)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("a bug")],
                         ids=["oserror", "other"])
@pytest.mark.live_backend
def test_a_failed_background_write_keeps_the_last_checkpoint_and_is_reported(graph_mode, backend, tmp_path,
                                                                             monkeypatch, error):
    """The background write of step 6 fails at its 20th write to the file. An OSError is a failed save as a
    blocking one's: logged naming the path and the error, counted in failed_saves, its temporary file
    removed, the last good checkpoint (step 3) kept, and training goes on with the next saves (9, 12);
    with max_failed_saves=1 it stops training with a RuntimeError naming the path and the last good
    checkpoint at the first step end after the failure. Any other error is raised out of online_train."""
    table, model = _model("adam-lru-sketch")
    _SlowWrites(monkeypatch, model, last=12, fail_at=6, error=error)
    directory = str(tmp_path / "c")
    ckpt = rb.OnlineCheckpoint(directory, every_steps=3, keep=100, background=True)
    if isinstance(error, OSError):
        model.online_train(_batches(20), dataset_sink_mode=False, callbacks=[ckpt, StopAfter(12)])
        assert ckpt.failed_saves == 1
        assert sorted(os.listdir(directory)) == ["recboost-%d.npz" % s for s in (12, 3, 9)]     # no temporary
        assert ckpt.saved == [os.path.join(directory, "recboost-%d.npz" % s) for s in (3, 9, 12)]
        stopping = rb.OnlineCheckpoint(str(tmp_path / "d"), every_steps=3, keep=100, background=True,
                                       max_failed_saves=1)
        _, again = _model("adam-lru-sketch")
        _SlowWrites(monkeypatch, again, last=12, fail_at=6, error=error)
        with pytest.raises(RuntimeError, match=r"saving a checkpoint must succeed within 1 tries in a row, "
                           r"but 1 failed, the last to '.*recboost-6\.npz' \(OSError: \[Errno 28\].*the last good "
                           r"checkpoint is '.*recboost-3\.npz'"):
            again.online_train(_batches(20), dataset_sink_mode=False, callbacks=[stopping, StopAfter(12)])
        assert 6 < again.step < 12          # (raised at a step end after the write of 6 failed, before 12)
        assert sorted(os.listdir(tmp_path / "d")) == ["recboost-3.npz"]
    else:
        with pytest.raises(RuntimeError, match="a bug"):
            model.online_train(_batches(20), dataset_sink_mode=False, callbacks=[ckpt, StopAfter(12)])
        assert sorted(os.listdir(directory)) == ["recboost-3.npz"]
        assert ckpt.failed_saves == 0


def test_background_is_checked(graph_mode, tmp_path):
    """``background`` must be a bool, and not with full_every or a chain (their writes are in the pause)."""
    with pytest.raises(ValueError, match=r"For 'OnlineCheckpoint', 'background' must be False with "
                       r"full_every=3 \(a chain is written in the pause\), but got True"):
        rb.OnlineCheckpoint(str(tmp_path), every_steps=1, full_every=3, background=True)
    with pytest.raises(TypeError, match="background"):
        rb.OnlineCheckpoint(str(tmp_path), every_steps=1, background=1)
    _, model = _model("adagrad")
    model.online_train(_batches(2), dataset_sink_mode=False, callbacks=[StopAfter(1)])
    with pytest.raises(ValueError, match=r"For 'RecModel.save_checkpoint', 'background' must be False with "
                       r"chain='base'"):
        model.save_checkpoint(str(tmp_path / "x.npz"), chain="base", background=True)
    assert not os.path.exists(tmp_path / "x.npz")
    running = model.save_checkpoint(str(tmp_path / "y.npz"), background=True)
    assert running.result() == str(tmp_path / "y.npz")
    _, other = _model("adagrad", seed=3)
    other.load_checkpoint(str(tmp_path / "y.npz"))
    assert other.step == model.step == 1

def test_a_load_waits_for_the_models_own_write_still_running(graph_mode, tmp_path, monkeypatch):
    """The model loads the file its own background write is writing: the load waits for the write, so the
    model holds the state the file ends with (the background save's step), not the file's earlier one."""
    _, model = _model("adagrad")
    model.online_train(_batches(4), dataset_sink_mode=False, callbacks=[StopAfter(1)])
    path = str(tmp_path / "x.npz")
    model.save_checkpoint(path)
    model.online_train(_batches(4, seed=1), dataset_sink_mode=False, callbacks=[StopAfter(3)])
    real = rb._write_checkpoint_file

    def slow(fh, manifest, arrays):
        time.sleep(0.5)
        return real(fh, manifest, arrays)
    monkeypatch.setattr(rb, "_write_checkpoint_file", slow)
    running = model.save_checkpoint(path, background=True)
    model.load_checkpoint(path)
    assert running.done() and running.result() == path
    assert model.step == 3 and _manifest(path)["step"] == 3


@pytest.mark.slow
def test_recboost_train_checkpoint_background_resumes_bit_for_bit(graph_mode, tmp_path, capsys):
    """``recboost train --checkpoint-background``: a job stopped at step 5 (its checkpoints 2, 4 and 5
    written in the background, each with its input position) and run again resumes from step 5 and ends
    with the model of the uninterrupted job with blocking checkpoints, bit for bit. With
    ``--checkpoint-full-every`` it is refused by name before anything trains."""
    from test_incremental_checkpoint import _assert_same, _state
    data = tmp_path / "day.txt"
    rb.SyntheticClickStream(seed=1).write_criteo(str(data), 64 * 9)
    settings = dict(batch_size=64, capacity=1 << 12, checkpoint_every=2, progress_seconds=1e9,
                    printer=lambda line: None)
    once = rb.train_job(str(data), checkpoint_dir=str(tmp_path / "once"), checkpoint_background=False, **settings)
    twice = str(tmp_path / "twice")
    stopped = rb.train_job(str(data), checkpoint_dir=twice, steps=5, checkpoint_background=True, **settings)
    assert stopped["checkpoints"] == [os.path.join(twice, "recboost-%d.npz" % k) for k in (2, 4, 5)]
    manifest = _manifest(os.path.join(twice, "recboost-5.npz"))        # (the prepared batches are replayed)
    assert manifest["step"] == 5 and manifest["extra"]["batches"] == manifest["taken"] - manifest["stream_start"] > 5
    resumed = rb.train_job(str(data), checkpoint_dir=twice, checkpoint_background=True, **settings)
    assert resumed["resumed_from"] == os.path.join(twice, "recboost-5.npz")
    assert resumed["model"].step == once["model"].step == 9
    _assert_same(dict(_state(resumed["model"].tables[0], resumed["model"]), run=None),
                 dict(_state(once["model"].tables[0], once["model"]), run=None), "resumed job")
    with pytest.raises(ValueError, match=r"For 'recboost train', 'checkpoint_background' must be False or None "
                       r"with 'checkpoint_full_every' \(a chain of incremental checkpoints is written in the step's "
                       r"pause\), but got True"):
        rb.train_job(str(data), checkpoint_dir=str(tmp_path / "three"), checkpoint_background=True,
                     checkpoint_full_every=3, **settings)
    assert not os.path.exists(tmp_path / "three")


def _backgrounds(monkeypatch):
    """The ``background`` of every OnlineCheckpoint made from now on, in a list."""
    seen, init = [], rb.OnlineCheckpoint.__init__

    def recorded(self, *args, **kwargs):
        seen.append(kwargs.get("background"))
        init(self, *args, **kwargs)
    monkeypatch.setattr(rb.OnlineCheckpoint, "__init__", recorded)
    return seen


@pytest.mark.parametrize("case", ["safe", "chain", "short", "unknown", "on", "off"])
def test_recboost_train_writes_its_checkpoints_in_the_background_when_it_is_safe(graph_mode, tmp_path, monkeypatch,
                                                                                 case):
    """``recboost train --checkpoint-dir`` writes its checkpoints in the background by default (auto)
    when it is safe, and logs the choice: not with ``--checkpoint-full-every`` (a chain), nor when half
    the memory available could not hold what a write keeps aside at worst (every row and slot, and the
    map: the table's bytes a row, with 3 map entries), nor when the memory available is unknown. On and
    off are what they say, without a log line."""
    data = tmp_path / "day.txt"
    rb.SyntheticClickStream(seed=1).write_criteo(str(data), 64 * 3)
    capacity, lines = 1 << 12, []
    kept = capacity * (4 * 17 * 3 + 3 * 32)   # rows of 17 float32 (16 deep, 1 wide), Adam's 2 slots, 3 map entries
    available = {"short": 2 * kept - 1, "unknown": None}.get(case, 2 * kept)
    monkeypatch.setattr(rb, "_available_memory", lambda: available)
    seen = _backgrounds(monkeypatch)
    options = {"chain": {"checkpoint_full_every": 2}, "on": {"checkpoint_background": True},
               "off": {"checkpoint_background": False}}.get(case, {})
    rb.train_job(str(data), checkpoint_dir=str(tmp_path / "c"), batch_size=64, capacity=capacity, checkpoint_every=2,
                 progress_seconds=1e9, printer=lines.append, **options)
    assert seen == [case in ("safe", "on")]
    said = [line for line in lines if line.startswith("checkpoints (--checkpoint-background auto): ")]
    expected = {
        "safe": "written in the background; a write keeps at most %.1f MB aside (%.1f MB available)" % (
            kept / 1e6, 2 * kept / 1e6),
        "chain": "blocking (--checkpoint-full-every: a chain is written in the step's pause)",
        "short": "blocking (a write may keep %.1f MB aside, more than half of the %.1f MB available)" % (
            kept / 1e6, (2 * kept - 1) / 1e6),
        "unknown": "blocking (the memory available is unknown)"}.get(case)
    assert said == ([] if expected is None else ["checkpoints (--checkpoint-background auto): " + expected])


def test_a_resumed_job_judges_its_background_by_the_table_its_checkpoint_holds(graph_mode, tmp_path, monkeypatch):
    """A job resumed from a checkpoint whose table grew past the capacity it was started with judges
    auto by that checkpoint's table: with memory for the fresh table's write but not the grown one's,
    its checkpoints are blocking, and it says so."""
    data = tmp_path / "day.txt"
    rb.SyntheticClickStream(seed=1).write_criteo(str(data), 64 * 12)
    settings = dict(batch_size=64, capacity=1 << 9, checkpoint_every=3, progress_seconds=1e9,
                    checkpoint_dir=str(tmp_path / "c"))
    first = rb.train_job(str(data), steps=9, checkpoint_background=False, printer=lambda line: None, **settings)
    assert first["model"].tables[0].store.capacity > 1 << 9                        # grown
    fresh = (1 << 9) * (4 * 17 * 3 + 3 * 32)                  # what a write of the fresh table keeps at most
    monkeypatch.setattr(rb, "_available_memory", lambda: 2 * fresh)
    seen, lines = _backgrounds(monkeypatch), []
    resumed = rb.train_job(str(data), printer=lines.append, **settings)
    assert resumed["resumed_from"] is not None and seen == [False]
    assert any(line.startswith("checkpoints (--checkpoint-background auto): blocking (a write may keep ")
               for line in lines), lines


def _store(optimizer, capacity, row_dtype="float32"):
    """A table's row store with rows 2.. holding ids' initial rows and trained once."""
    table = rb.HashEmbedding(4, capacity, seed=0, name="ids", optimizer=optimizer, row_dtype=row_dtype)
    store = table.store
    rows = np.arange(2, capacity, dtype=np.int32)
    store.reset_rows(rows, rows.astype(np.int64) * 7)
    _update(store, np.random.default_rng(0), capacity)
    return store


def _update(store, rng, capacity):
    """One sparse update of random distinct rows of ``store`` (its first ``capacity`` rows)."""
    uniq = np.sort(rng.choice(np.arange(2, capacity, dtype=np.int32), 9, replace=False))
    store.update_rows(uniq, np.arange(9, dtype=np.int32), rng.standard_normal((9, 4)).astype(np.float32))


def _arrays(store):
    return dict(table=store.weight.copy(), **{name: a.copy() for name, a in store.slots.items()})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("optimizer, row_dtype", [(lambda: rb.SparseAdam(0.01), "float32"),
                                                  (lambda: rb.SparseFtrl(0.05), "bfloat16")], ids=["adam", "ftrl-bf16"])
def test_a_snapshot_reads_the_rows_of_its_moment_while_they_change(monkeypatch, seed, optimizer, row_dtype):
    """A ``_RowsSnapshot`` against a plain copy taken at the same moment: its writer reads each array a
    range at a time in a random interleaving with updates and initial rows of random rows, and a growth
    half-way (the old arrays no longer written, updates then in the new ones); every array read equals
    the copy, byte for byte. The rows kept are only those changed ahead of the writer, let go once every
    array passed them; closed, the store keeps nothing."""
    monkeypatch.setattr(SNAPSHOT, "ROWS", 8)
    rng = np.random.default_rng(seed)
    store = _store(optimizer(), 64, row_dtype)
    expected, snapshot = _arrays(store), store.snapshot_rows()
    readers = {name: snapshot.pieces(name) for name in expected}
    read = {name: [] for name in expected}
    reads = 0
    while readers:
        name = list(readers)[rng.integers(len(readers))]
        try:
            read[name].append(next(readers[name]))
            reads += 1
        except StopIteration:
            del readers[name]
        if reads == 2 * len(expected) * 64 // 8 // 3:     # (a third of the ranges read)
            assert store.grow(96)                           # (new arrays: the snapshot's no longer written)
        if rng.integers(2):
            _update(store, rng, store.capacity)
        else:
            rows = rng.choice(np.arange(2, store.capacity, dtype=np.int32), 5, replace=False)
            store.reset_rows(rows, rng.integers(0, 1 << 40, 5))
        assert snapshot.kept_bytes == sum(v.nbytes for entries in snapshot.kept.values()
                                          for _, values in entries for v in values.values())
        assert all(k >= snapshot.floor // snapshot.ROWS for k in snapshot.kept)     # passed ranges let go
    assert store.capacity == 96
    for name, array in expected.items():
        assert np.concatenate(read[name]).tobytes() == array.tobytes(), name
    assert snapshot.kept_bytes == 0 and not snapshot.kept
    snapshot.close()
    assert store.snapshot is None
    before = _arrays(store)
    _update(store, rng, store.capacity)                     # (no snapshot: nothing kept, as before)
    assert any(before[name].tobytes() != a.tobytes() for name, a in _arrays(store).items())


def test_a_snapshot_keeps_only_the_rows_changed_ahead_of_its_writer(monkeypatch):
    """Rows changed below what the writer has passed in every array are not kept; rows ahead of it are,
    once each (a second change keeps nothing more); kept rows are let go as the writer passes them."""
    monkeypatch.setattr(SNAPSHOT, "ROWS", 16)
    store = _store(rb.SparseAdagrad(0.05), 64)
    snapshot = store.snapshot_rows()
    per_row = store.weight[0].nbytes + store.slots["accum"][0].nbytes
    table, accum = snapshot.pieces("table"), snapshot.pieces("accum")
    next(table), next(accum)                                # rows 0..15 passed in both arrays
    store.reset_rows(np.array([3, 20, 40], np.int32), np.array([1, 2, 3], np.int64))
    assert snapshot.kept_bytes == 2 * per_row               # 20 and 40, not 3
    store.reset_rows(np.array([20, 41], np.int32), np.array([5, 6], np.int64))
    assert snapshot.kept_bytes == 3 * per_row               # 41 only
    next(table)
    assert snapshot.kept_bytes == 3 * per_row               # (accum has not passed 20 yet)
    next(accum)
    assert snapshot.kept_bytes == 2 * per_row               # 20's let go; 40 and 41 still ahead
    snapshot.close()
    assert snapshot.kept_bytes == 0 and store.snapshot is None


def test_memory_that_runs_out_keeping_rows_fails_the_write_not_the_step(monkeypatch):
    """An allocation that fails while a step keeps rows (tests/_faults.py's ``alloc``): the step's update is
    applied exactly as without a snapshot, and the writer raises an OSError (ENOMEM) naming the table at
    its next range (a failed save: the file is not written)."""
    from _faults import Faults
    monkeypatch.setattr(SNAPSHOT, "ROWS", 16)
    store, plain = _store(rb.SparseAdam(0.01), 64), _store(rb.SparseAdam(0.01), 64)
    snapshot = store.snapshot_rows()
    table = snapshot.pieces("table")
    next(table)
    with Faults(("alloc",), fail_at=1) as faults:
        _update(store, np.random.default_rng(5), 64)
    assert faults.failures == 1
    _update(plain, np.random.default_rng(5), 64)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_arrays(store).values(), _arrays(plain).values()))
    with pytest.raises(OSError, match=r"out of memory keeping the rows the steps change while the checkpoint "
                       r"of hash table 'ids' is written") as raised:
        next(table)
    assert raised.value.errno == errno.ENOMEM
    snapshot.close()


@pytest.mark.parametrize("settings", [dict(access_threshold=2, eviction_policy="lru"),
                                      dict(grow=True, access_threshold=1, eviction_threshold=3)], ids=["lru", "grow"])
def test_an_entries_copy_holds_the_entries_of_its_moment(backend, settings):
    """``HashCache.entries_copy()``: the entries of the moment it was taken (ids with rows and candidates,
    their rows, counts and last-seen times, as ``state_dict()`` gives them then), whatever lookups and
    evictions change in the cache afterwards (through a growth of the map), on both backends."""
    cache, rng = backend.HashCache(40, **settings), np.random.default_rng(1)
    for t in range(6):
        cache.lookup(rng.integers(0, 60, 30).astype(np.int64), t)
    state, copied = cache.state_dict(), cache.entries_copy()
    for t in range(6, 30):
        cache.lookup(rng.integers(0, 400, 50).astype(np.int64), t)
        if t % 4 == 0:
            cache.evict(t)
    assert cache.state_dict()["keys"].tobytes() != state["keys"].tobytes()      # (the cache moved on)
    assert copied.keys().tobytes() == state["keys"].tobytes()
    tracked, rows, counts, last = copied.entries(state["keys"])
    assert tracked.all() and rows.tobytes() == state["rows"].tobytes()
    assert counts.tobytes() == state["counts"].tobytes() and last.tobytes() == state["last_seen"].tobytes()
    stats = copied.stats()
    assert stats["size"] == (state["rows"] >= 0).sum() and stats["candidates"] == (state["rows"] < 0).sum()


def test_an_entries_copy_into_an_earlier_one_reuses_its_memory(backend):
    """``entries_copy(into)``: the entries of the moment, into ``into``'s memory when its map has as many
    slots (the compiled kernel: the same object back; a full LRU table's map keeps its size), else new;
    the numpy twin always makes its arrays anew. A background checkpoint keeps its copies as the next
    one's spares (:class:`recboost._CheckpointStore`)."""
    cache, rng = backend.HashCache(1000, eviction_policy="lru"), np.random.default_rng(1)
    for t in range(30):
        cache.lookup(rng.integers(0, 5000, 300).astype(np.int64), t)
    first = cache.entries_copy()
    before = first.keys()
    for t in range(30, 40):
        cache.lookup(rng.integers(0, 5000, 300).astype(np.int64), t)
    state = cache.state_dict()
    again = cache.entries_copy(first)
    assert (again is first) == (backend.name == "fast")
    assert again.keys().tobytes() == state["keys"].tobytes() != before.tobytes()
    tracked, rows, counts, last = again.entries(state["keys"])
    assert tracked.all() and rows.tobytes() == state["rows"].tobytes() and last.tobytes() == state["last_seen"].tobytes()
    small = backend.HashCache(1000, eviction_policy="lru")
    small.lookup(np.arange(3, dtype=np.int64), 0)
    other = small.entries_copy(again)                       # (a map of another size: new memory)
    assert other is not again and other.keys().tolist() == [0, 1, 2]
    assert again.keys().tobytes() == state["keys"].tobytes()


def test_a_map_of_64_mib_and_more_is_copied_by_two_threads_whole():
    """A map of at least 64 MiB (2^21 ids: 4M slots of 32 bytes) is copied half by a second thread
    (the compiled kernel): the copy holds every entry, into fresh memory and into its own again."""
    cache = rb.HashCache((1 << 21) + 2)
    ids = np.arange(1 << 21, dtype=np.int64) * 7 + 1
    for start in range(0, ids.size, 1 << 18):
        cache.lookup(ids[start:start + (1 << 18)], 0)
    state = cache.state_dict()
    for copied in (cache.entries_copy(), None):
        copied = cache.entries_copy(copied)
        assert copied.keys().tobytes() == state["keys"].tobytes()
        tracked, rows, counts, last = copied.entries(state["keys"])
        assert tracked.all() and rows.tobytes() == state["rows"].tobytes() and counts.tobytes() == state[
            "counts"].tobytes()


@pytest.mark.parametrize("fails", [False, True], ids=["warmed", "no-memory"])
def test_online_checkpoint_in_the_background_copies_the_map_once_before_training(graph_mode, tmp_path, monkeypatch,
                                                                                   capsys, fails):
    """``OnlineCheckpoint(background=True)``: a spare copy of each cache's map is made when training
    starts (before the first step), and every save copies into it; memory that runs out there is
    logged naming the table, and training and its saves go on (the first save then copies into new
    memory). A blocking OnlineCheckpoint makes none."""
    calls, real = [], rb.HashCache.entries_copy

    def entries_copy(cache, into=None):
        calls.append((model.step, into is not None))
        if fails and len(calls) == 1:
            raise MemoryError("injected")
        return real(cache, into)
    monkeypatch.setattr(rb.HashCache, "entries_copy", entries_copy)
    _, model = _model("adagrad")
    model.online_train(_batches(8), dataset_sink_mode=False,
                       callbacks=[rb.OnlineCheckpoint(str(tmp_path / "a"), every_steps=3), StopAfter(7)])
    assert calls == []
    ckpt = rb.OnlineCheckpoint(str(tmp_path / "b"), every_steps=3, background=True)
    model.online_train(_batches(8), dataset_sink_mode=False, callbacks=[ckpt, StopAfter(13)])
    assert calls[0] == (7, False)                   # at train start, before step 8
    saves = [step for step, _ in calls[1:]]
    assert saves == [int(os.path.basename(p)[9:-4]) for p in ckpt.saved] and len(saves) >= 2
    assert [into for _, into in calls[1:]] == [not fails] + [True] * (len(saves) - 1) and ckpt.failed_saves == 0
    logged = "no spare copy of hash table 'ids''s cache map for the writes in the background (MemoryError: injected)"
    assert (logged in capsys.readouterr().err) == fails
