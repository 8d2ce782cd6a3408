"""Fault injection on every public path that changes state (tests/_faults.py): each path is run once
to count its injection points, then once per point with that point failing; after each failure the
model, its tables and the files on disk are exactly as before (array by array, byte by byte), and
the error names what failed (or the documented next state). ``make test`` fails the first point of each
path; ``make test-all`` (slow) also :data:`WALKED` evenly spaced points of each, its middle and last
among them (``RECBOOST_FAULTS_EVERY_POINT=1``: every point). Paths: step, grow, evict, save, delta save, load, a
two-table load, resume, export, a served model's delta apply, a second one (a patch), reshard
(:data:`PATHS`)."""
import copy
import os
import re
import tempfile

import numpy as np
import pytest

import recboost as rb
from _faults import INJECTED, Faults, differences, files, snapshot
from _stopping import StopAfter

NAME = "ids"


@pytest.fixture(autouse=True)
def _on_cpu(pynative):
    """MindSpore's device set (PyNative, its default mode, on CPU) before any kernel of these tests runs, as
    every other file's fixtures set it: a process whose first kernel ran without one refuses set_device later
    (the graph_mode fixture of the tests that come after in the same pytest-xdist worker)."""
    yield


def _two_tables():
    """A network of two hash tables ('ids' on batch item 1, 'ids2' on item 2), each on 3 id columns."""
    from mindspore import nn, ops

    class TwoTables(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = rb.HashEmbedding(4, 256, input_index=1, seed=0, name=NAME, optimizer=rb.SparseAdagrad(0.05))
            self.b = rb.HashEmbedding(4, 256, input_index=2, seed=1, name=NAME + "2",
                                      optimizer=rb.SparseAdagrad(0.05))
            self.out = nn.Dense(4 + 2 * 3 * 4, 1)

        def construct(self, dense, a, b):
            a, b = self.a(a), self.b(b)
            return self.out(ops.concat((dense, a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)), 1))
    net = TwoTables()
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _model(grow=False, capacity=256, evict=False, two=False):
    """Wide&Deep on one hash table (``evict``: ids unseen for a step are stale); ``two``: :func:`_two_tables`.
    Every model starts from the same dense parameters (MindSpore's seed 0)."""
    import mindspore as ms
    from mindspore import nn
    ms.set_seed(0)
    if two:
        return _two_tables()
    table = rb.HashEmbedding(9, capacity, input_index=1, seed=0, name=NAME, optimizer=rb.SparseAdagrad(0.05),
                             use_dynamic_expansion=grow, eviction_threshold=1 if evict else -1)
    net = rb.WideDeep(4, 6, 8, (16,), embedding=table)
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _batches(n, seed=0, vocab=200, size=16, two=False):
    """``n`` batches (dense, ids, label); ``two``: (dense, ids of 3 columns, ids of the other 3, label)."""
    stream = rb.SyntheticClickStream(seed=seed, num_dense=4, num_sparse=6, vocab_sizes=[vocab] * 6, batch_size=size)
    out = [next(stream) for _ in range(n)]
    return [(b[0], b[1][:, :3].copy(), b[1][:, 3:].copy(), b[2]) for b in out] if two else out


_MADE = {}


def _once(key, make):
    """``make()``, made once per process for ``key``: the products of deterministic runs (seeded models and
    batches) that every point of a path shares. Each new model compiles its train graph (about 1.3 s), so a
    walk that made them again at every point spent most of its time compiling the same graphs."""
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]


class _Case:
    """A model trained a little, a folder holding what the path wrote before, and the path's action.
    ``loaded``: the model is a new one that loaded the checkpoint of that training (made once), for a
    path that trains no step (a save, an export, a load, a reshard), which would compile the model's
    train graph."""

    def __init__(self, tmp, grow=False, evict=False, two=False, loaded=False):
        self.dir, self.from_checkpoint = str(tmp), loaded
        path = os.path.join(self.dir, "recboost-2.npz")
        self.model = _model(grow, evict=evict, two=two)
        if not loaded:
            self.model.train(1, _batches(2, two=two))
            self.model.save_checkpoint(path)
            return

        def make():
            with tempfile.TemporaryDirectory() as tmp:
                return files(_Case(tmp, grow, evict, two).dir)
        for name, data in _once(("case", grow, evict, two), make).items():
            with open(os.path.join(self.dir, name), "wb") as fh:
                fh.write(data)
        self.model.load_checkpoint(path)

    def snap(self):
        """The state the path must leave as it was (:func:`snapshot` of the model and the folder)."""
        return snapshot(self.model, self.dir)

    def expected(self, before, faults, name):
        """The state after the path ``name`` failed at ``faults.failed``: the state before; after its
        batch was prepared (:data:`PREPARED`), that of a run over the same batches stopped by StopAfter
        after the step before (:func:`_stopped`: its prepared batches too); a resume's after its load
        (its callbacks failed): the checkpoint's, as a model of the same making loads it."""
        if name in PREPARED and PREPARED[name](faults):
            return dict(_stopped(name), files=before["files"])
        if not hasattr(self, "loaded") or not hasattr(self, "resumed") or faults.failed != "user" \
                or faults.hits["user"] < 2:
            return before
        return dict(_once("resumed", lambda: _loaded_snapshot(self.loaded)), files=before["files"])


def _loaded_snapshot(path):
    """The :func:`snapshot` of a case's model after it loaded the checkpoint ``path``."""
    with tempfile.TemporaryDirectory() as tmp:
        other = _Case(tmp)
        other.model.load_checkpoint(path)
        return snapshot(other.model)


def _step(case, faults):
    batches = _batches(1, seed=1)

    def data():
        for batch in batches:
            yield batch
    case.model.train(1, faults.user(data)(), callbacks=[_hook(faults)])


def _hook(faults):
    """A callback whose methods before the step are injection points of user code (after the step it
    has trained: a failure there is no failure of the step)."""
    from mindspore.train.callback import Callback

    class Hook(Callback):
        on_train_begin = faults.user(lambda self, run_context: None)
        on_train_step_begin = faults.user(lambda self, run_context: None)
    return Hook()


def _grow(case, faults):
    case.model.train(1, _batches(1, seed=2, vocab=100000, size=64))    # 384 new ids, a table of 256 rows: grows


def _save(case, faults):
    case.target = "recboost-2.npz"
    case.model.save_checkpoint(os.path.join(case.dir, "recboost-2.npz"))      # replaces its file


def _delta(case, faults):
    case.target = "recboost-3.npz"
    case.model.save_checkpoint(os.path.join(case.dir, "recboost-3.npz"), chain="delta")


def _load(case, faults):
    case.model.load_checkpoint(case.loaded)


def _export(case, faults):
    case.model.export(os.path.join(case.dir, "bundle"))


def _other_run(two):
    """The files of another run's checkpoint ``recboost-3.npz`` (3 steps of other batches; ``two``: of the
    two-table network), made once: ``{name: bytes}``."""
    def make():
        other = _model(two=two)
        other.train(1, _batches(3, seed=5, two=two))
        with tempfile.TemporaryDirectory() as tmp:
            other.save_checkpoint(os.path.join(tmp, "recboost-3.npz"))
            return files(tmp)
    return _once(("other", two), make)


def _prepare_load(case, tmp, two=False):
    """Another run's checkpoint, written into ``tmp/other`` (``two``: of the two-table network; issue 61: a
    load failing at its second table)."""
    os.makedirs(os.path.join(str(tmp), "other"))
    for name, data in _other_run(two).items():
        with open(os.path.join(str(tmp), "other", name), "wb") as fh:
            fh.write(data)
    case.loaded = os.path.join(str(tmp), "other", "recboost-3.npz")


def _prepare_load_two(case, tmp):
    _prepare_load(case, tmp, two=True)


def _prepare_resume(case, tmp):
    _prepare_load(case, tmp)
    case.resumed = True


def _prepare_delta(case, tmp):
    case.model.save_checkpoint(os.path.join(case.dir, "recboost-2.npz"), chain="base")
    case.model.train(1, _batches(1, seed=3))


def _evict(case, faults):
    """A step after which an EvictHook evicts every id (eviction_threshold 1, the clock two steps on)."""
    case.model.train(1, faults.user(lambda: iter(_batches(1, seed=1)))(),
                     callbacks=[rb.EvictHook(evict_time_interval=None, evict_step_interval=1), _hook(faults)])


def _resume(case, faults):
    """online_train resuming from another run's checkpoint, then its stream (one batch). A failure of the
    user code after the load (the callbacks: user point 2 on) leaves the documented next state: the
    model as the checkpoint holds it (:meth:`_Case.expected`)."""
    case.model.online_train(faults.user(lambda: iter(_batches(1, seed=1)))(), callbacks=[_hook(faults)],
                            resume_from=case.loaded, resume_skip=0, dataset_sink_mode=False)


def _apply(case, faults):
    case.predictor.apply(case.delta)


def _reshard(case, faults):
    """The table loads another run's table from its 2 row-wise shards (re-laid out for 1 rank)."""
    table = case.model.tables[0]
    table.load_state_dict(table.restore_states(case.shards))


def _exports(model, tmp, patch=False):
    """The bundles ``base`` of ``model`` and ``delta`` of one more step on it, in ``tmp``; ``patch``: and
    ``delta2`` of one more step on ``delta``."""
    model.export(os.path.join(str(tmp), "base"))
    model.train(1, _batches(1, seed=3))
    model.export(os.path.join(str(tmp), "delta"), base=os.path.join(str(tmp), "base"))
    if patch:
        model.train(1, _batches(1, seed=4))
        model.export(os.path.join(str(tmp), "delta2"), base=os.path.join(str(tmp), "delta"))


def _prepare_apply(case, tmp, patch=False):
    """A Predictor serving the base bundle of the model; the delta of one more step beside it. ``patch``
    (:func:`_prepare_apply_patch`): the Predictor past that delta, and the delta of one more step beside it.
    A case whose model loaded its state (the walk's, :func:`_case`) takes the bundles a trained case
    exported once (:func:`_exports`); the others export their own."""
    if case.from_checkpoint:
        def make():
            with tempfile.TemporaryDirectory() as out:
                _exports(_Case(out).model, out, patch)
                return {n: b for n, b in files(out).items() if not n.startswith("recboost-")}
        for name, data in _once(("exports", patch), make).items():
            os.makedirs(os.path.dirname(os.path.join(str(tmp), name)), exist_ok=True)
            with open(os.path.join(str(tmp), name), "wb") as fh:
                fh.write(data)
    else:
        _exports(case.model, tmp, patch)
    base, case.delta = os.path.join(str(tmp), "base"), os.path.join(str(tmp), "delta")
    case.predictor = rb.Predictor(_model().network, base)
    probe = _batches(1, seed=7)[0][:2]

    def snap():
        state = {"bundle": case.predictor.bundle_id, "step": case.predictor.step,
                 "predict": case.predictor.predict(*probe)}
        state.update(("param:" + n, p.asnumpy().copy()) for n, p in case.predictor.network.parameters_and_names())
        return state
    case.snap = snap


def _prepare_apply_patch(case, tmp):
    """As :func:`_prepare_apply`, the Predictor past that delta (its rows gathered with room after them),
    and the delta of one more step beside it: applied, it is written into that room (a patch)."""
    _prepare_apply(case, tmp, patch=True)
    case.predictor.apply(case.delta)
    case.delta = os.path.join(str(tmp), "delta2")


def _prepare_reshard(case, tmp):
    def make():
        other = _model()
        other.train(1, _batches(3, seed=5))
        table = other.tables[0]
        whole = table.check_state_dict(table.state_dict())
        return [table.check_state_dict(table.reshard_states([whole], r, 2)) for r in range(2)]
    case.shards = copy.deepcopy(_once("shards", make))


def _pending(model):
    """The stream positions of the prepared batches ``model`` keeps to train next (RecModel.between_steps)."""
    with model.between_steps() as pending:
        return [feed.taken for feed in pending]


#: The paths whose batch is prepared (its ids admitted to the cache, an EvictHook's eviction done) before
#: the point that fails: a growth's allocations in its step (the 3rd on: the 1st and 2nd, the live flags
#: and marks, are made before the cache admits the batch), the hook's on_train_step_begin (user call 3,
#: after the data iterator's and on_train_begin) of a step, an eviction and a resume.
PREPARED = {"grow": lambda faults: faults.hits["alloc"] >= 3,
            "step": lambda faults: faults.failed == "user" and faults.hits["user"] == 3,
            "evict": lambda faults: faults.failed == "user" and faults.hits["user"] == 3,
            "resume": lambda faults: faults.failed == "user" and faults.hits["user"] == 3}


def _stopped(name):
    """The documented state after a step of ``name`` failed (PREPARED), computed without a failure (once):
    one ``train`` over the case's batches and the path's, stopped by StopAfter after the step before the
    failed one (its pause fills the prefetcher's depth); its :func:`snapshot` and :func:`_pending`."""
    return _once(("stopped", name), lambda: _stopped_run(name))


def _stopped_run(name):
    path = {"step": _batches(1, seed=1), "evict": _batches(1, seed=1), "resume": _batches(1, seed=1),
            "grow": _batches(1, seed=2, vocab=100000, size=64)}[name]
    first = _batches(3, seed=5) if name == "resume" else _batches(2)    # the checkpoint's run, or the case's
    model = _model(grow=name == "grow", evict=name == "evict")
    # the path's EvictHook evicts at its first batch: the 3rd of this run, where a 3-step schedule is due
    hooks = [rb.EvictHook(evict_time_interval=None, evict_step_interval=3)] if name == "evict" else []
    model.train(1, first + path, callbacks=hooks + [StopAfter(len(first))])
    assert model.step == len(first)
    return dict(snapshot(model), pending=_pending(model))


PATHS = {
    # name: (action, points, grow (True; "evict": a table whose ids go stale after a step; "two": two
    # tables, _two_tables), prepare)
    "step": (_step, ("user",), False, None),
    "grow": (_grow, ("alloc",), True, None),
    "save": (_save, ("write",), False, None),
    "delta_save": (_delta, ("write", "alloc"), False, _prepare_delta),
    "load": (_load, ("assign", "alloc"), False, _prepare_load),
    "export": (_export, ("write",), False, None),
    "evict": (_evict, ("user",), "evict", None),
    "resume": (_resume, ("alloc", "assign", "user"), False, _prepare_resume),
    "apply": (_apply, ("alloc", "assign"), False, _prepare_apply),
    "apply_patch": (_apply, ("alloc", "assign"), False, _prepare_apply_patch),
    "reshard": (_reshard, ("alloc",), False, _prepare_reshard),
    "load_two_tables": (_load, ("assign", "alloc"), "two", _prepare_load_two),
}


def _case(name, tmp, trained=False):
    """The case of the path ``name`` in ``tmp``, prepared; ``trained``: its model trained even where the walk
    loads it (a test that trains it on and exports from it)."""
    _, _, grow, prepare = PATHS[name]
    os.makedirs(str(tmp / "ckpt"), exist_ok=True)
    case = _Case(tmp / "ckpt", grow is True, evict=grow == "evict", two=grow == "two",
                 loaded=name in ("load", "load_two_tables", "reshard", "save", "export", "apply", "apply_patch")
                 and not trained)
    if prepare is not None:
        prepare(case, tmp)
    return case


_COUNTS = {}


def _count(name, tmp_path_factory):
    """How many injection points the path ``name`` hits, by point (once per session)."""
    if name not in _COUNTS:
        act, points, _, _ = PATHS[name]
        case = _case(name, tmp_path_factory.mktemp("count-" + name))
        with Faults(points) as faults:
            act(case, faults)
        _COUNTS[name] = dict(faults.hits)
    return _COUNTS[name]


#: How README's "Nothing silent" names each path before its count of points.
README_NAMES = {"step": "a step", "grow": "a table's growth", "evict": "an eviction", "save": "a save",
                "delta_save": "a delta save", "load": "a load", "load_two_tables": "a load of two tables",
                "resume": "a resume", "export": "an export", "apply": "a served model's delta apply",
                "apply_patch": "a second delta apply (a patch)",
                "reshard": "a reshard of a table's 2 row-wise shards into 1"}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_every_injection_point_of_a_path_is_hit(name, tmp_path_factory):
    """Each point kind a path declares is hit at least once (the counts are in the assertion), and README
    gives the path's count of points."""
    hits = _count(name, tmp_path_factory)
    print("injection points of %r: %r" % (name, hits))
    assert all(n > 0 for n in hits.values()), "path %r hits %r" % (name, hits)
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as fh:
        readme = " ".join(fh.read().split())
    said = "%s %d" % (README_NAMES[name], sum(hits.values()))
    assert re.search(re.escape(said) + r"\b", readme) and len(README_NAMES) == len(PATHS), \
        "README's Nothing silent lacks %r" % said


def _fail_and_compare(name, k, tmp_path, capfd):
    """The path ``name`` with its ``k``-th injection point failing: the state is as before."""
    act, points, _, _ = PATHS[name]
    total = sum(_count(name, _Factory(tmp_path)).values())
    assert 1 <= k <= total, "path %r has %d injection points, not a %d-th" % (name, total, k)
    case = _case(name, tmp_path)
    before = case.snap()
    error = None
    with Faults(points, fail_at=k) as faults:
        try:
            act(case, faults)
        except (OSError, RuntimeError, MemoryError, ValueError) as exc:    # (ValueError: a load's read)
            error = exc
    assert faults.failed is not None, "point %d of %d of %r was not reached" % (k, total, name)
    after = case.snap()
    if name in PREPARED and PREPARED[name](faults):
        after["pending"] = _pending(case.model)
    if error is None:
        # the documented next state: an export whose folder sync fails keeps the bundle, written whole, and says so
        err = capfd.readouterr().err
        assert name == "export" and "syncing its folder failed" in err, (name, k, err)
        assert os.path.isfile(os.path.join(case.dir, "bundle", "manifest.json"))
        return
    message = str(error)
    assert INJECTED in message, message                        # the cause is kept
    named = {"alloc": (repr(NAME), repr(NAME + "2"), getattr(case, "loaded", repr(NAME)), getattr(case, "delta",
                                                                                             repr(NAME))),
             "write": (case.dir,),
             "assign": ("parameter",), "user": (INJECTED,)}[faults.failed]
    assert any(n in message for n in named), "%s point %d of %r: %s" % (faults.failed, k, name, message)
    target = getattr(case, "target", None)
    if target is not None and k == total and faults.failed == "write":
        # the documented next state of _atomic_write: the folder's fsync after the rename failed, so the file
        # is the complete new one (raised: a crash may lose it); every other file as before
        assert os.path.join(case.dir, target) in message, message
        assert target in after["files"]
        for snap in (before, after):
            snap["files"] = {n: b for n, b in snap["files"].items() if n != target}
    wrong = differences(case.expected(before, faults, name), after)
    assert wrong == [], "%s point %d of %d of %r changed state: %s" % (faults.failed, k, total, name, wrong[:5])


class _Factory:
    def __init__(self, tmp):
        self.tmp = tmp

    def mktemp(self, name):
        path = self.tmp / name
        path.mkdir()
        return path


@pytest.mark.parametrize("name", sorted(PATHS))
def test_a_failure_at_the_first_point_leaves_the_state_before(name, tmp_path, capfd):
    """make test's representative of each path (a model built and trained each: 3-7 s on two shared
    cores); the whole suite walks each path (below)."""
    _fail_and_compare(name, 1, tmp_path, capfd)


@pytest.mark.parametrize("k", [1] + [pytest.param(k, marks=pytest.mark.slow) for k in (2, 3, 4)])
def test_a_table_that_could_not_grow_is_whole_and_grows_when_memory_is_back(k, tmp_path):
    """Issue 61 item 9: memory that runs out while a table grows (each of its allocations in turn) is an
    OSError (ENOMEM) naming the table, the capacity and the bytes; the rows, slots, live flags and
    marks keep one length, and the same batch trains once memory is back (no IndexError)."""
    case = _case("grow", tmp_path)
    table = case.model.tables[0]
    with Faults(("alloc",), fail_at=k) as faults:
        with pytest.raises(OSError) as info:
            _grow(case, faults)
    message = str(info.value)
    assert info.value.errno == 12 and repr(NAME) in message and "capacity" in message and "bytes" in message
    store = table.store
    assert len({store.weight.shape[0]} | {a.shape[0] for a in store.slots.values()}) == 1   # rows and slots agree
    assert store.live.shape[0] <= table.cache.capacity
    _grow(case, Faults(()))
    assert {store.weight.shape[0], store.live.shape[0]} | {a.shape[0] for a in store.slots.values()} == \
        {table.cache.capacity} and table.cache.capacity > 256


@pytest.mark.parametrize("k", [1, 12])
def test_a_patch_applied_again_after_it_failed_serves_the_chain_bit_for_bit(k, tmp_path):
    """A second delta's apply (a patch into the room the first left) failing at its first point (its
    read) or its last (the dense parameters' assignment, after its rows were written past the served
    map's end, never read); applied again (a patch, or after the last point a gather: the room's tip
    moved) and a third delta after it (a patch), the Predictor serves what a fresh Predictor of the
    chain and the trained model give, bit for bit."""
    case = _case("apply_patch", tmp_path, trained=True)
    with Faults(("alloc", "assign"), fail_at=k) as faults:
        with pytest.raises((OSError, RuntimeError, ValueError)):     # (ValueError: a file of it unreadable)
            case.predictor.apply(case.delta)
    assert faults.failed is not None
    case.predictor.apply(case.delta)
    case.model.train(1, _batches(1, seed=4))                  # the second delta's batch: its ids own rows now
    third = os.path.join(str(tmp_path), "delta3")
    case.model.export(third, base=case.delta)
    case.predictor.apply(third)
    assert rb._hash_tables(case.predictor.network)[0].cache.patch_ids.size > 0          # a patch
    fresh = rb.Predictor(_model().network, os.path.join(str(tmp_path), "base"))
    for delta in ("delta", "delta2", "delta3"):
        fresh.apply(os.path.join(str(tmp_path), delta))
    for seed in (7, 8):
        probe = _batches(1, seed=seed)[0][:2]
        assert case.predictor.predict(*probe).tobytes() == fresh.predict(*probe).tobytes()
        assert case.predictor.predict(*probe).tobytes() == case.model.predict(*probe).asnumpy().tobytes()


def test_a_load_whose_assignment_fails_leaves_every_parameter_and_table(tmp_path):
    """Issue 61 item 10: MindSpore's Assign failing on the last dense parameter of a load: the ones
    assigned before are put back, the tables are not swapped in, and the error names the parameter."""
    case = _case("load", tmp_path)
    with Faults(("assign",)) as count:
        _load(case, count)
    case = _case("load", tmp_path / "again")
    before = snapshot(case.model, case.dir)
    with Faults(("assign",), fail_at=count.hits["assign"]) as faults:
        with pytest.raises(RuntimeError, match=r"For 'RecModel.load_checkpoint', the parameter '[^']+' must be "
                                               r"assigned .*the model is unchanged.*injected"):
            _load(case, faults)
    assert count.hits["assign"] > 1 and differences(before, snapshot(case.model, case.dir)) == []


#: The most points of one path the suite fails in turn (each builds and trains a model, about 3 s): a path
#: with more (a save's writes, one per chunk of each member) gets that many, evenly spaced, its first and
#: last among them. RECBOOST_FAULTS_EVERY_POINT=1 fails every point (a save's: about 25 minutes).
WALKED = 12


def _walked(total):
    """The points of a path of ``total`` points that the walk fails, in order: its middle, its last and
    evenly spaced ones between (its first is test_a_failure_at_the_first_point_leaves_the_state_before's)."""
    if os.environ.get("RECBOOST_FAULTS_EVERY_POINT") == "1" or total <= WALKED:
        return list(range(2, total + 1))
    return sorted({1 + round(i * (total - 1) / (WALKED - 1)) for i in range(1, WALKED)} | {(total + 1) // 2})


def test_a_long_path_is_walked_at_evenly_spaced_points_with_its_middle_and_last():
    assert _walked(5) == [2, 3, 4, 5]
    points = _walked(451)
    assert WALKED - 1 <= len(points) <= WALKED and points[0] > 1 and points[-1] == 451 and 226 in points
    assert max(b - a for a, b in zip(points, points[1:])) <= 451 // (WALKED - 1) + 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PATHS))
def test_every_point_of_a_path_leaves_the_state_before(name, tmp_path_factory, capfd):
    """Every injection point of each path in turn but its first (the test above), or :data:`WALKED` of a
    longer path."""
    total = sum(_count(name, tmp_path_factory).values())
    broken = []
    for k in _walked(total):
        try:
            _fail_and_compare(name, k, tmp_path_factory.mktemp("%s-%d" % (name, k)), capfd)
        except AssertionError as exc:
            broken.append((k, str(exc).splitlines()[0]))
    assert broken == [], "path %r, %d points" % (name, total)


@pytest.mark.slow
@pytest.mark.parametrize("flags, kind, left", [         # (the end's export tries failed step 4 no more)
    (["--export", "{d}", "--export-every", "2"], "every export of the run failed (all 2, at step(s) [2, 4]; the "
     "last, {d}/bundle-000000004: ", ["train-config.json"]),
    (["--checkpoint-dir", "{d}", "--checkpoint-every", "3"], "every checkpoint of the run failed (all 2, logged "
     "above): none of it was written", ["train-config.json"])], ids=["exports", "checkpoints"])
def test_a_train_run_whose_every_export_or_checkpoint_failed_exits_4_naming_them(tmp_path, flags, kind, left,
                                                                                  capsys):
    """Issue 61: a job whose exports all failed for a full disk exited 0. The disk fills right after the job's
    train-config.json is written (every later write fails: Faults(persist=True)); the run trains to its end
    (2 failed checkpoints do not stop it: 3 in a row do, exit 3) and exits with 4, naming what failed."""
    rb.SyntheticClickStream(seed=0).write_criteo(str(tmp_path / "day.txt"), 64 * 4)
    with Faults(("write",)) as config:             # the writes of the job's train-config.json, before training
        rb._job_config_write(str(tmp_path / "count"), {"model": "widedeep"})
    d = str(tmp_path / "out")
    argv = ["train", "--data", str(tmp_path / "day.txt"), "--batch-size", "64", "--capacity", "16384",
            "--progress-seconds", "1000"] + [f.format(d=d) for f in flags]
    capsys.readouterr()
    with Faults(("write",), fail_at=config.hits["write"] + 1, persist=True) as faults:
        with pytest.raises(SystemExit) as info:
            rb.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 4, err[-2000:]
    assert faults.failures >= 2 and sorted(os.listdir(d)) == left
    line = [x for x in err.splitlines() if x.startswith("python -m recboost train: nothing saved: ")]
    assert len(line) == 1 and kind.format(d=d) in line[0] and (INJECTED in line[0] or "checkpoint" in kind), err
    assert "NOTHING SAVED: " + line[0].split("nothing saved: ", 1)[1] + " (exit code 4)" in err
    assert "done: step 4, 256 rows trained" in err                    # it trained to its end

def test_a_take_by_hand_whose_memory_ran_out_is_taken_again_before_the_next_prepare(backend):
    """A batch prepared by hand admits its ids (the cache grown past the rows); its take, whose growth's
    memory runs out, changes no row, and the batch must be taken again before another prepare: a prepare
    before it is refused naming the table (before: it mapped new ids onto rows never set, which held the
    trained values of evicted ids). Taken again, every new id reads its initial row."""
    emb = rb.HashEmbedding(4, 64, eviction_threshold=0, use_dynamic_expansion=True, optimizer=rb.SparseSGD(1.0),
                           name="t", seed=0)
    old = emb.prepare(np.arange(10, 60))
    emb.take(old)
    emb.apply_gradients(old, np.full((50, 4), 7.0, np.float32))       # rows far from any initial row
    emb.take(emb.prepare(np.array([1])))
    assert emb.evict().size == 50
    batch = emb.prepare(np.arange(1000, 1100))                        # 100 new ids: the cache grows
    rows = emb.store.weight.copy()
    with Faults(("alloc",), fail_at=1):
        with pytest.raises(OSError, match=r"the hash table 't' of capacity 128 must be a table this process can "
                                          r"allocate.*injected"):
            emb.take(batch)
    assert np.array_equal(emb.store.weight, rows)
    with pytest.raises(ValueError, match=r"For 'HashEmbedding.prepare', the batch of hash table 't' whose take "
                                         r"failed must be taken first \(take\(batch\) again"):
        emb.prepare(np.arange(1000, 1005))
    emb.take(batch)
    again = emb.prepare(np.arange(1000, 1005))
    emb.take(again)
    want = np.empty((5, 4), np.float32)
    rb.init_rows(np.arange(1000, 1005, dtype=np.int64), 0, 0.01, want)
    np.testing.assert_array_equal(emb.gather(again), want)


def test_a_prepare_while_a_take_by_hand_runs_goes_on(backend):
    """Only a take by hand that failed holds back the next prepare: one running is no refusal. RecModel's
    predict (from a callback, say) takes its batch by hand on the training thread while the prefetch
    thread prepares the next training batch, which was refused now and then ("whose take failed ... but
    got 'a prepare before it'") though no take had failed."""
    emb = rb.HashEmbedding(4, 64, use_dynamic_expansion=True, optimizer=rb.SparseSGD(1.0), name="t", seed=0)
    batch = emb.prepare(np.arange(1000, 1100))                        # 100 new ids: the take grows the table
    store, grow, during = emb.store, emb.store.grow, []

    def growing(capacity):                                            # the prefetch thread's prepare, meanwhile
        during.append(emb.prepare(np.arange(5, 9)))
        return grow(capacity)
    store.grow = growing
    emb.take(batch)
    del store.grow
    assert len(during) == 1 and store.weight.shape[0] >= 128
    emb.take(during[0])
    want = np.empty((4, 4), np.float32)
    rb.init_rows(np.arange(5, 9, dtype=np.int64), 0, 0.01, want)
    np.testing.assert_array_equal(emb.gather(during[0]), want)


def test_a_two_table_load_whose_second_table_runs_out_of_memory_leaves_the_model_as_it_was(tmp_path):
    """Issue 61: a load of two tables whose second table's memory runs out (its last allocation, after the
    first table's arrays were made and the dense parameters assigned) left the first table loaded. Now
    every table's arrays are made before any table takes them: the error names the second table, the
    model is exactly as before, and the same load succeeds once memory is back."""
    total = sum(_count("load_two_tables", _Factory(tmp_path)).values())
    case = _case("load_two_tables", tmp_path / "case")
    before = case.snap()
    with Faults(("assign", "alloc"), fail_at=total) as faults:
        with pytest.raises(OSError, match=r"the hash table 'ids2' of capacity 256 must be a table this process can "
                                          r"allocate.*injected"):
            _load(case, faults)
    assert faults.failed == "alloc" and faults.hits["assign"] > 1     # the parameters had been assigned
    assert differences(before, case.snap()) == []
    case.model.load_checkpoint(case.loaded)
    assert case.model.step == 3 and differences(before, case.snap()) != []


@pytest.mark.parametrize("hook", ["on_train_step_begin", "on_train_step_end"])
def test_a_step_that_fails_mid_stream_leaves_the_state_of_a_stop_after_the_step_before(hook):
    """A callback failing at the begin of step 4 of a 6-batch stream (the prefetcher had run ahead), or
    at the end of step 3: the model, its tables and the prepared batches kept are those of the same run
    stopped by StopAfter after step 3, array by array (the failed step's rows taken are put back; the
    prefetcher holds its depth, the failed batch included); and the next train call trains on to the
    same end."""
    from mindspore.train.callback import Callback

    def fail(self, run_context):              # (a step's own number from its step begin on, as in Model)
        if run_context.original_args().cur_step_num == (4 if hook == "on_train_step_begin" else 3):
            raise RuntimeError("user code failed " + INJECTED)
    FailAt = type("FailAt", (Callback,), {hook: fail})
    batches = _batches(6, seed=4)
    failed, stopped = _model(), _model()
    with pytest.raises(RuntimeError, match="injected"):
        failed.train(1, iter(batches), callbacks=[FailAt()])
    stopped.train(1, iter(batches), callbacks=[StopAfter(3)])
    assert failed.step == stopped.step == 3 and _pending(failed) == _pending(stopped) == [4, 5]
    assert differences(snapshot(stopped), snapshot(failed)) == []
    failed.train(1, iter(batches[5:]))
    stopped.train(1, iter(batches[5:]))
    assert failed.step == 6 and differences(snapshot(stopped), snapshot(failed)) == []
