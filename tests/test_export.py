"""Export to serving: RecModel.export (full and delta bundles) and recboost.Predictor.

A small WideDeep over one growing HashEmbedding with admission and eviction (tests/_export_worker.py
builds it, here and in a fresh process) is trained with RecModel, with an EvictHook, and exported;
a Predictor on a freshly built copy must give RecModel.predict's output bit for bit, in a fresh
process too, and a base with deltas must equal a full export at the same step. Bad bundles, bad
networks and wrong bases are refused with messages naming what is wrong, changing nothing.
"""
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

import recboost as rb
from _stopping import StopAfter
import _export_worker as worker
from _export_worker import BATCH, DENSE, DIM, FIELDS

HERE = os.path.dirname(os.path.abspath(__file__))
UNKNOWN = 10 ** 15                         # ids far above the stream's: never seen


def _stream(seed=0, vocab=120):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=DENSE, num_sparse=FIELDS, vocab_sizes=[vocab] * FIELDS,
                                     batch_size=BATCH, drift=20000.0, with_timestamp=True, rows_per_second=32)
    for dense, ids, label, ts in stream:
        yield {"dense": dense, "ids": ids, "label": label, "timestamp": ts}


class _Run:
    """A model trained on one stream in stages, with one EvictHook for the whole run."""

    def __init__(self, seed=0, vocab=120, evict_every=3, **kw):
        self.table, self.net = worker.network(seed, **kw)
        self.model = rb.RecModel(self.net, nn.BCEWithLogitsLoss(), nn.Adam(self.net.trainable_params(), 0.02))
        self.stream = _stream(seed, vocab)
        self.hooks = [rb.EvictHook(evict_time_interval=evict_every)] if evict_every else []

    def train_to(self, step):
        self.model.online_train(self.stream, callbacks=self.hooks + [StopAfter(step)], dataset_sink_mode=False)
        assert self.model.step == step
        return self

    def untaken(self):
        """The ids admitted by the batches the prefetcher prepared that no step has trained yet (sorted):
        a bundle leaves them out, as ids no trained step has looked up (RecModel.predict reads them so)."""
        with self.model.between_steps() as pending:
            ids = [batch.new_ids for feed in pending for batch in feed.tables or ()]
        return np.unique(np.concatenate(ids)) if ids else np.empty(0, np.int64)

    def served(self, state):
        """Which entries of the cache's ``state`` a bundle holds: ids that own a row, but :meth:`untaken`."""
        return (state["rows"] >= 0) & ~np.isin(state["keys"], self.untaken())

    def owned(self):
        state = self.table.cache.state_dict()
        return state["keys"][self.served(state)]


def _probe(run, extra=()):
    """A batch to predict: the next rows of ``run``'s stream, the first ids replaced by ``extra`` (e.g.
    evicted ids), the last row's by ids never seen."""
    batch = next(run.stream)
    ids = batch["ids"].copy()
    flat = ids.reshape(-1)
    extra = np.asarray(extra, np.int64)[:flat.size - FIELDS]
    flat[:extra.size] = extra
    ids[-1] = UNKNOWN + np.arange(FIELDS)
    return batch["dense"], ids


def _predictor(path, seed=1, deltas=()):
    _, net = worker.network(seed)
    predictor = rb.Predictor(net, path)
    for delta in deltas:
        predictor.apply(delta)
    return predictor


def _served(predictor):
    """The served state: per table (ids, weight) in a full bundle's layout (a delta applied patches its
    base: ``_ServingMap.compacted``), and the dense parameters."""
    maps = [t.cache.compacted() for t in rb._hash_tables(predictor.network)]
    tables = [(m.ids.copy(), m.weight.copy()) for m in maps]
    return tables, {p.name: p.asnumpy().copy() for p in predictor.network.get_parameters()}



def _digest(path):
    """``(bytes, sha256 hex)`` of the file at ``path``, by hashlib (not recboost's own reader)."""
    with open(path, "rb") as fh:
        data = fh.read()
    return len(data), hashlib.sha256(data).hexdigest()

def _assert_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_same_served(a, b):
    (ta, da), (tb, db) = a, b
    assert len(ta) == len(tb) and sorted(da) == sorted(db)
    for (ids_a, w_a), (ids_b, w_b) in zip(ta, tb):
        _assert_bits(ids_a, ids_b)
        _assert_bits(w_a, w_b)
    for name in da:
        _assert_bits(da[name], db[name])


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def _bytes(path, prefix=""):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(prefix))


# ---- exported and served in a fresh process --------------------------------------------------------
@pytest.mark.live_backend
def test_predictor_in_a_fresh_process_equals_recmodel_predict(backend, graph_mode, tmp_path):
    run = _Run().train_to(6)
    before = run.owned()
    run.train_to(12)
    stats = run.table.cache.stats()
    assert stats["evicted"] > 0 and stats["admitted"] > 0 and stats["grown"] > 0
    evicted = np.setdiff1d(before, run.owned())
    assert evicted.size > 0
    bundle = run.model.export(str(tmp_path / "bundle"))
    assert bundle == str(tmp_path / "bundle")
    dense, ids = _probe(run, evicted)
    found = run.table.cache.find(ids)
    assert (found == 0).any() and (found > 1).any()          # default-row ids (evicted, unknown) and owned ones
    expected = run.model.predict(dense, ids).asnumpy()
    assert run.table.cache.stats() == stats                  # predict admitted nothing
    np.savez(str(tmp_path / "inputs.npz"), dense=dense, ids=ids)
    env = dict(os.environ)
    if backend.name == "py":
        env["RECBOOST_NO_EXTENSIONS"] = "1"
        env.pop("RECBOOST_REQUIRE_EXTENSIONS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_export_worker.py"), bundle,
                           str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(str(tmp_path / "out.npz")) as out:
        _assert_bits(out["out"], expected)
        assert bool(out["fast"]) == (backend.name == "fast")
        assert str(out["bundle_id"]) == _manifest(bundle)["id"]


@pytest.mark.parametrize("kind", ["wide_deep", "deepfm", "mindir"])
def test_a_predictor_runs_new_batch_sizes_on_one_graph_bit_for_bit(graph_mode, tmp_path, monkeypatch, kind):
    """A Predictor (or a server's Predictor of a bundle's MindIR) runs a batch size it has seen fewer
    than ``STATIC_AFTER`` times on one graph compiled for any size: no graph of its own is compiled for
    it, and its outputs are the trained RecModel.predict's (a graph for each size) bit for bit, at
    sizes 1 to 129. A frequent size runs on its own graph, bit for bit too; a network whose any-size
    graph cannot be built runs every size on its own graph."""
    shape = {"hidden": (64, 32), "dim": 12, "deepfm": kind == "deepfm"}
    run = _Run(**shape).train_to(4)
    dense, ids = _probe(run)
    bundle = run.model.export(str(tmp_path / "bundle"), mindir=(dense, ids) if kind == "mindir" else None)
    sizes = (1, 3, 7, 64, 129)
    batches = [(np.resize(dense, (n, DENSE)), np.resize(ids, (n, FIELDS))) for n in sizes]
    expected = [run.model.predict(*batch).asnumpy() for batch in batches]

    def served(static_after):
        monkeypatch.setattr(rb._ServedModel, "STATIC_AFTER", static_after)
        predictor = rb._MindIRPredictor(bundle) if kind == "mindir" else \
            rb.Predictor(worker.network(seed=3, **shape)[1], bundle)
        for batch, want in zip(batches, expected):
            _assert_bits(predictor.predict(*batch), want)
        return len(predictor._model.predict_network.compile_cache)      # the graphs of one size each

    assert served(256) == 0
    assert served(0) == len(sizes)
    monkeypatch.setattr(nn.Cell, "set_inputs", lambda *_: (_ for _ in ()).throw(RuntimeError("no")))
    assert served(256) == len(sizes)


def test_bundle_layout_and_the_served_map(graph_mode, tmp_path):
    run = _Run().train_to(8)
    path = run.model.export(str(tmp_path / "bundle"))
    manifest = _manifest(path)
    assert manifest["format"] == rb._BUNDLE_FORMAT and manifest["kind"] == "full" and manifest["base"] is None
    assert manifest["version"] == rb.__version__ and manifest["step"] == 8
    assert manifest["network"] == {       # the network that produced it: class, settings, every parameter
        "class": "recboost:WideDeep",
        "settings": {"model": "widedeep", "num_dense": DENSE, "num_fields": FIELDS, "dim": DIM, "hidden": [8],
                     "vocab_size": None},
        "parameters": [{"name": p.name, "shape": list(p.shape), "dtype": "Float32"}
                       for p in sorted(run.net.get_parameters(), key=lambda p: p.name)]}
    assert [p["name"] for p in manifest["network"]["parameters"]] == [
        "mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight", "wide_dense.bias", "wide_dense.weight"]
    recorded = manifest.pop("sha256")          # the manifest's own checksum: of the rest, in canonical JSON
    assert recorded == hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":"),
                                                 ensure_ascii=True).encode("ascii")).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{32}", manifest["id"])
    (table,) = manifest["tables"]
    assert {k: table[k] for k in ("name", "embedding_size", "combiner", "padding_id")} == \
        {"name": "ids", "embedding_size": DIM + 1, "combiner": None, "padding_id": None}
    files = ["dense.ckpt", "table-0-default.npy", "table-0-ids.npy", "table-0-rows.npy"]
    assert sorted(manifest["files"]) == files and sorted(os.listdir(path)) == sorted(files + ["manifest.json"])
    for name, info in manifest["files"].items():
        assert _digest(os.path.join(path, name)) == (info["bytes"], info["sha256"])
    ids = np.load(os.path.join(path, "table-0-ids.npy"))
    rows = np.load(os.path.join(path, "table-0-rows.npy"))
    state = run.table.cache.state_dict()
    owned = run.served(state)
    assert run.untaken().size and np.isin(run.untaken(), state["keys"][state["rows"] >= 0]).all()
    _assert_bits(ids, state["keys"][owned])        # the ids that own a row, but those no trained step saw
    _assert_bits(rows, run.table.weight[state["rows"][owned]])
    _assert_bits(np.load(os.path.join(path, "table-0-default.npy")), run.table.weight[0])
    assert table["rows"] == ids.size > 0
    # the Predictor: the serving map, no admission, no state change
    predictor = _predictor(path)
    assert predictor.bundle_id == manifest["id"] and predictor.step == 8
    assert predictor.directory == os.path.abspath(path)
    served = rb._hash_tables(predictor.network)[0]
    assert served.cache.capacity == served.weight.shape[0] == ids.size + 2
    probe = np.array([[ids[0], ids[-1], UNKNOWN, ids[3], -5]], np.int64)
    np.testing.assert_array_equal(served.cache.find(probe), [[2, ids.size + 1, 0, 5, 0]])
    np.testing.assert_array_equal(served.cache.find(probe.astype(np.uint64)), served.cache.find(probe))
    assert served.cache.find(np.empty((0, 3), np.int64)).shape == (0, 3)
    dense, batch_ids = _probe(run)
    first = predictor.predict(dense, batch_ids)
    before = _served(predictor)
    _assert_bits(predictor.predict(dense, batch_ids), first)
    _assert_bits(first, run.model.predict(dense, batch_ids).asnumpy())
    _assert_same_served(_served(predictor), before)


@pytest.mark.slow
@pytest.mark.live_backend
def test_bfloat16_rows_are_exported_as_float32_and_served_exactly(backend, graph_mode, tmp_path):
    """A table of bfloat16 rows exports its rows' exact float32 values (full bundle and delta); a
    Predictor (its network's table float32 or bfloat16: the bundle decides the served rows) predicts
    what RecModel.predict does, bit for bit."""
    run = _Run(row_dtype="bfloat16").train_to(5)
    base = run.model.export(str(tmp_path / "base"))
    run.train_to(9)
    delta = run.model.export(str(tmp_path / "delta"), base=base)
    full = run.model.export(str(tmp_path / "full"))
    state = run.table.cache.state_dict()
    owned = run.served(state)
    rows = np.load(os.path.join(full, "table-0-rows.npy"))
    assert run.table.weight.dtype == np.uint16 and rows.dtype == np.float32
    _assert_bits(rows.view(np.uint32) >> 16, run.table.weight[state["rows"][owned]].astype(np.uint32))
    assert not (rows.view(np.uint32) & 0xFFFF).any()
    dense, ids = _probe(run)
    expected = run.model.predict(dense, ids).asnumpy()
    _, net16 = worker.network(seed=3, row_dtype="bfloat16")
    for predictor in (_predictor(full, seed=2), rb.Predictor(net16, full), _predictor(base, seed=4, deltas=[delta])):
        _assert_bits(predictor.predict(dense, ids), expected)


def test_dense_checkpoint_loads_into_a_fresh_network(graph_mode, tmp_path):
    run = _Run().train_to(4)
    path = run.model.export(str(tmp_path / "bundle"))
    _, fresh = worker.network(seed=5)
    params = ms.load_checkpoint(os.path.join(path, "dense.ckpt"))
    assert ms.load_param_into_net(fresh, params, strict_load=True) == ([], [])
    mine = {p.name: p.asnumpy() for p in run.net.get_parameters()}
    assert sorted(mine) == sorted(p.name for p in fresh.get_parameters()) and mine
    for p in fresh.get_parameters():
        _assert_bits(p.asnumpy(), mine[p.name])
    assert not any(name.startswith(("moment", "beta", "global_step", "learning_rate")) for name in params)


# ---- deltas ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.live_backend
def test_base_and_three_deltas_equal_a_full_export(backend, graph_mode, tmp_path):
    run = _Run()
    early = _probe(run)                            # predicted at every export, and after every apply
    run.train_to(5)
    paths, owned, evicted = [run.model.export(str(tmp_path / "base"))], [run.owned()], []
    at_export = [run.model.predict(*early).asnumpy()]
    for k in range(1, 4):
        run.train_to(5 + 4 * k)
        paths.append(run.model.export(str(tmp_path / ("delta%d" % k)), base=paths[-1]))
        at_export.append(run.model.predict(*early).asnumpy())
        owned.append(run.owned())
        manifest, base = _manifest(paths[-1]), _manifest(paths[-2])
        assert manifest["kind"] == "delta"
        assert manifest["base"] == {"id": base["id"], "path": "../" + os.path.basename(paths[-2])}
        gone = np.load(os.path.join(paths[-1], "table-0-evicted.npy"))
        _assert_bits(gone, np.setdiff1d(owned[-2], owned[-1]))           # tombstones: exactly the evicted ids
        new = np.setdiff1d(owned[-1], owned[-2])
        assert gone.size > 0 and new.size > 0                              # evictions and new ids every time
        assert np.isin(new, np.load(os.path.join(paths[-1], "table-0-ids.npy"))).all()
        evicted.append(gone)
    full = run.model.export(str(tmp_path / "full"))
    dense, ids = _probe(run, np.concatenate(evicted))
    expected = run.model.predict(dense, ids).asnumpy()
    whole = _predictor(full, seed=2)
    chained = _predictor(paths[0], seed=3)
    ids_seen = [chained.bundle_id]
    _assert_bits(chained.predict(*early), at_export[0])
    for path, expected_then in zip(paths[1:], at_export[1:]):
        assert chained.apply(path) is chained
        ids_seen.append(chained.bundle_id)
        _assert_bits(chained.predict(*early), expected_then)           # each step of the chain served exactly
    assert ids_seen == [_manifest(p)["id"] for p in paths]
    resolved = _predictor(paths[-1], seed=4)                       # the chain followed from the last delta
    for predictor in (whole, chained, resolved):
        _assert_bits(predictor.predict(dense, ids), expected)
    _assert_same_served(_served(chained), _served(whole))
    _assert_same_served(_served(resolved), _served(whole))
    assert resolved.bundle_id == chained.bundle_id != whole.bundle_id


def test_pynative_mode_serves_each_delta(tmp_path):
    """In PyNative mode RecModel compiles its cells with mindspore.jit, which keep the parameter values
    they were compiled with: apply must still serve the delta's dense parameters."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    try:
        run = _Run()
        probe = _probe(run)
        run.train_to(4)
        base = run.model.export(str(tmp_path / "base"))
        predictor = _predictor(base)
        _assert_bits(predictor.predict(*probe), run.model.predict(*probe).asnumpy())
        run.train_to(8)
        predictor.apply(run.model.export(str(tmp_path / "delta"), base=base))
        _assert_bits(predictor.predict(*probe), run.model.predict(*probe).asnumpy())
    finally:
        ms.set_context(mode=old)


class _ExportEvery(ms.train.Callback):
    """Export a bundle every ``every`` steps from inside training (each a delta on the previous one),
    recording the model's predictions on ``probe`` at that point."""

    def __init__(self, model, folder, every, probe):
        self.model, self.folder, self.every, self.probe = model, folder, every, probe
        self.paths, self.expected = [], []

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step % self.every == 0:
            base = self.paths[-1] if self.paths else None
            self.paths.append(self.model.export(os.path.join(self.folder, "step-%d" % step), base=base))
            self.expected.append(self.model.predict(*self.probe).asnumpy())


@pytest.mark.slow
def test_export_from_a_callback_during_training(graph_mode, tmp_path):
    run = _Run()
    probe = _probe(run)
    exporter = _ExportEvery(run.model, str(tmp_path), 3, probe)
    run.model.online_train(run.stream, callbacks=run.hooks + [exporter, StopAfter(9)], dataset_sink_mode=False)
    assert [_manifest(p)["step"] for p in exporter.paths] == [3, 6, 9]
    predictor = _predictor(exporter.paths[0])
    _assert_bits(predictor.predict(*probe), exporter.expected[0])
    for path, expected in zip(exporter.paths[1:], exporter.expected[1:]):
        _assert_bits(predictor.apply(path).predict(*probe), expected)
    # the run went on undisturbed: the same as a run without exports
    other = _Run()
    _probe(other)
    other.train_to(9)
    _assert_bits(other.model.predict(*probe).asnumpy(), run.model.predict(*probe).asnumpy())


def test_a_delta_holds_only_what_changed(graph_mode, tmp_path):
    run = _Run(vocab=4000, evict=-1, evict_every=0).train_to(10)
    full = run.model.export(str(tmp_path / "full"))
    before = rb._table_snapshot(run.table)
    run.train_to(11)
    delta = run.model.export(str(tmp_path / "delta"), base=full)
    after = rb._table_snapshot(run.table)
    pos, hit = rb._sorted_find(before[0], after[0])
    changed = ~hit
    changed[hit] = np.any(after[1][hit].view(np.uint32) != before[1][pos[hit]].view(np.uint32), axis=1)
    _assert_bits(np.load(os.path.join(delta, "table-0-ids.npy")), after[0][changed])
    _assert_bits(np.load(os.path.join(delta, "table-0-rows.npy")), after[1][changed])
    assert np.load(os.path.join(delta, "table-0-evicted.npy")).size == 0
    assert 0 < changed.sum() < after[0].size / 2
    assert _bytes(delta, "table-") < _bytes(full, "table-") / 2 and _bytes(delta) < _bytes(full)
    # nothing trained since: a delta without rows
    again = run.model.export(str(tmp_path / "again"), base=delta)
    assert _manifest(again)["tables"][0]["rows"] == 0
    assert np.load(os.path.join(again, "table-0-evicted.npy")).size == 0
    dense, ids = _probe(run)
    _assert_bits(_predictor(full, deltas=[delta, again]).predict(dense, ids), run.model.predict(dense, ids).asnumpy())


def test_export_is_all_or_nothing(graph_mode, tmp_path, monkeypatch):
    run = _Run().train_to(3)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert os.path.isfile(os.path.join(run.model.export(str(empty)), "manifest.json"))   # an empty directory is fine
    calls = []
    real = rb._bundle_npy

    def failing(folder, name, array, files):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(folder, name, array, files)
    monkeypatch.setattr(rb, "_bundle_npy", failing)
    with pytest.raises(OSError, match="No space left"):
        run.model.export(str(tmp_path / "broken"))
    assert sorted(os.listdir(str(tmp_path))) == ["empty"]                # no bundle, no temporary directory


def test_export_refuses_rows_a_bundle_would_serve_as_nan_or_infinity(graph_mode, tmp_path):
    """A row holding a NaN (float32 rows were exported as they were and served NaN, a server's JSON then a
    500), a default row holding one (what unknown ids read, whatever the row dtype), and for int8 a row whose
    range float32 cannot hold (3e38 - -3e38: dequantized to infinity) are refused naming the table, nothing
    written; the same rows made finite export and serve."""
    run = _Run().train_to(3)
    table = run.table
    row = int(table.cache.find(run.owned()[:1])[0])
    weight = table.store.weight
    kept = weight[[0, row]].copy()
    cases = [(row, np.nan, "float32", r"the rows of hash table 0 'ids' must be finite numbers \(row_dtype="
                                      r"'float32'\), but got 'non-finite values'"),
             (0, np.inf, "int8", r"the default row of hash table 0 'ids' must be finite numbers"),
             (row, None, "int8", r"the rows of hash table 0 'ids' must be rows whose range \(max - min\) float32 "
                                 r"holds .*but got 'a row from -3\.0+5\d*e\+38 to 3\.0+5\d*e\+38'")]
    for at, value, row_dtype, message in cases:
        if value is None:
            weight[at, 0], weight[at, 1] = 3e38, -3e38
        else:
            weight[at, 0] = value
        with pytest.raises(ValueError, match=r"For 'RecModel.export', " + message):
            run.model.export(str(tmp_path / "b"), row_dtype=row_dtype)
        assert os.listdir(str(tmp_path)) == []
        weight[[0, row]] = kept
    for row_dtype in ("float32", "int8"):
        run.model.export(str(tmp_path / row_dtype), row_dtype=row_dtype)
        served = rb.Predictor(worker.network(1)[1], str(tmp_path / row_dtype))
        assert np.isfinite(served.predict(*_probe(run))).all()


FULL_FILES = ("table-0-ids.npy", "table-0-rows.npy", "table-0-default.npy")


@pytest.mark.slow
@pytest.mark.parametrize("held", [7, 1])
def test_a_full_export_takes_the_ids_a_range_at_a_time_into_the_same_files(backend, graph_mode, tmp_path,
                                                                           monkeypatch, held):
    """A full export writes the ids that own a row sorted a range of about ``_KEYS_HELD`` at a time (the
    cache's candidates dropped), then gathers the rows from the ids read back from its own file: the
    files are those of one range, with candidates in the table, whatever the ranges (7 ids, or one)."""
    run = _Run().train_to(6)
    assert run.table.cache.stats()["candidates"] > 0 and len(run.table.cache) > 20
    whole = run.model.export(str(tmp_path / "whole"))
    monkeypatch.setattr(rb, "_KEYS_HELD", held)
    monkeypatch.setattr(rb, "_ENTRY_CHUNK", 5)
    ranges = run.model.export(str(tmp_path / "ranges"))
    for name in FULL_FILES:
        with open(os.path.join(whole, name), "rb") as a, open(os.path.join(ranges, name), "rb") as b:
            assert a.read() == b.read(), name
    _assert_bits(np.load(os.path.join(ranges, "table-0-ids.npy")), run.owned())


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["swapped", "candidate"])
def test_ids_read_back_damaged_stop_a_full_export(backend, graph_mode, tmp_path, monkeypatch, damage):
    """The ids a full export reads back from its ids file to gather their rows are checked: out of
    order, or an id that owns no row (a candidate's, in order), stops the export with a RuntimeError
    and leaves no bundle."""
    run = _Run().train_to(6)
    state = run.table.cache.state_dict()
    candidates = state["keys"][state["rows"] < 0]
    real = os.pread

    def damaged(fd, n, offset):
        ids = np.frombuffer(real(fd, n, offset), np.int64).copy()
        if damage == "swapped":
            ids[[3, 4]] = ids[[4, 3]]
        else:                       # a candidate in its place: still increasing
            at = np.searchsorted(ids, candidates)
            fits = (at > 0) & (at < ids.size - 1)
            ids[at[fits][0]] = candidates[fits][0]
        return ids.tobytes()
    monkeypatch.setattr(os, "pread", damaged)
    with pytest.raises(RuntimeError, match="not increasing" if damage == "swapped" else "owns no row"):
        run.model.export(str(tmp_path / "bundle"))
    assert os.listdir(str(tmp_path)) == []


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A trained model and its bundles: ``base`` (full, step 4), ``d1`` (delta on base, step 8),
    ``d2`` (delta on d1, step 12)."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    root = tmp_path_factory.mktemp("chain")
    run = _Run().train_to(4)
    run.model.export(str(root / "base"))
    run.train_to(8)
    run.model.export(str(root / "d1"), base=str(root / "base"))
    run.train_to(12)
    run.model.export(str(root / "d2"), base=str(root / "d1"))
    yield run, root
    ms.set_context(mode=old)


def _copy(chain, tmp_path):
    """A writable copy of the chain's bundles; returns its folder."""
    folder = str(tmp_path / "b")
    shutil.copytree(str(chain[1]), folder)
    for path, _, files in os.walk(folder):
        for f in files:
            os.chmod(os.path.join(path, f), 0o644)
    return folder


def _edit_manifest(path, edit, sign=True):
    """Edit the manifest of the bundle ``path``; with ``sign`` its checksum is made again (a deliberate
    edit, which the checks after the checksum must catch), else it is left as it was."""
    manifest = _manifest(path)
    digest = manifest.pop("sha256")
    edit(manifest)
    with open(os.path.join(path, "manifest.json"), "wb") as fh:
        fh.write(rb._json_checked_bytes(manifest) if sign else json.dumps(dict(manifest, sha256=digest)).encode())


def _set_network(path, key, value):
    """Record another value of a network setting in the bundle ``path`` (its checksum made again)."""
    _edit_manifest(path, lambda manifest: manifest["network"]["settings"].update({key: value}))


def _as_format_1(path):
    """Make the manifest of the bundle ``path`` one of format 1: no checksum, the network's class name."""
    manifest = _manifest(path)
    del manifest["sha256"]
    manifest.update(format=1, network="WideDeep")
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)


class _MyWideDeep(rb.WideDeep):
    """A user's class: the same parameters and settings as WideDeep's."""


def _set_format(path, value):
    _edit_manifest(path, lambda manifest: manifest.update(format=value))


def _truncate(path, name, keep=-10):
    with open(os.path.join(path, name), "rb") as fh:
        data = fh.read()
    with open(os.path.join(path, name), "wb") as fh:
        fh.write(data[:keep])


def _flip(path, name):
    with open(os.path.join(path, name), "r+b") as fh:
        fh.seek(os.path.getsize(os.path.join(path, name)) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 1]))


def _ids(folder):
    return {name: _manifest(os.path.join(folder, name))["id"] for name in ("base", "d1", "d2")}


def _q(path):
    return re.escape(repr(path))


# Predictor(network, bundle) with a bad bundle or a network that does not match: (case, spoil(folder)
# -> (network kwargs, bundle path), message pattern given the folder and the bundle ids)
PREDICTOR_CASES = [
    ("format", lambda f: _set_format(os.path.join(f, "base"), 4) or ({}, "base"),
     lambda f, ids: r"For 'Predictor', the format of the bundle %s \('directory'\) must be 2 or 3 \(the bundle "
                    r"formats this recboost reads: 3 with float16 or int8 rows\), but got 4\.$"
                    % _q(os.path.join(f, "base"))),
    ("manifest_missing_field", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m.pop("step")) or
     ({}, "base"),
     lambda f, ids: r"For 'Predictor', the manifest field 'step' of the bundle %s \('directory'\) must be an int >= 0, "
                    r"but got 'missing'\.$" % _q(os.path.join(f, "base"))),
    ("manifest_kind", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m.update(kind="partial")) or
     ({}, "base"),
     lambda f, ids: r"the manifest field 'kind' of the bundle .* must be 'full' or 'delta', but got 'partial'\.$"),
    ("manifest_base_of_full", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m.update(
        base={"id": "x", "path": "y"})) or ({}, "base"),
     lambda f, ids: r"the manifest field 'base' of the bundle .* must be null \(a full bundle has no base\), but got "
                    r"\{'id': 'x', 'path': 'y'\}\.$"),
    ("manifest_file_name", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m["files"].update(
        {"../dense.ckpt": {"bytes": 1, "sha256": "00"}})) or ({}, "base"),
     lambda f, ids: r"the manifest field 'files' of the bundle .* must be an object of file names, but got \{"),
    ("manifest_file_size", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m["files"][
        "dense.ckpt"].update(bytes=-1)) or ({}, "base"),
     lambda f, ids: r"the manifest field \"files\['dense.ckpt'\].bytes\" of the bundle .* must be an int >= 0, "
                    r"but got -1\.$"),
    ("manifest_unlisted_file", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m["tables"][0][
        "files"].update(rows="elsewhere.npy")) or ({}, "base"),
     lambda f, ids: r"the manifest field 'tables\[0\].files.rows' of the bundle .* must be a file listed in 'files', "
                    r"but got 'elsewhere.npy'\.$"),
    ("manifest_padding_id", lambda f: _edit_manifest(os.path.join(f, "d1"), lambda m: m["tables"][0].update(
        padding_id="0")) or ({}, "d1"),
     lambda f, ids: r"For 'Predictor', the manifest field 'tables\[0\].padding_id' of the bundle %s \('directory'\) "
                    r"must be None or an int, but got '0'\.$" % _q(os.path.join(f, "d1"))),
    ("truncated", lambda f: _truncate(os.path.join(f, "base"), "table-0-rows.npy") or ({}, "base"),
     lambda f, ids: r"the file 'table-0-rows.npy' of the bundle %s \('directory'\) must be \d+ bytes with sha256 "
                    r"[0-9a-f]{64}, but got '\d+ bytes \(truncated or altered\)'\.$" % _q(os.path.join(f, "base"))),
    ("altered", lambda f: _flip(os.path.join(f, "base"), "dense.ckpt") or ({}, "base"),
     lambda f, ids: r"the file 'dense.ckpt' of the bundle .* must be \d+ bytes with sha256 [0-9a-f]{64}, but got "
                    r"'sha256 [0-9a-f]{64} \(altered\)'\.$"),
    ("missing_file", lambda f: os.remove(os.path.join(f, "base", "table-0-ids.npy")) or ({}, "base"),
     lambda f, ids: r"the file 'table-0-ids.npy' of the bundle .* must be \d+ bytes with sha256 [0-9a-f]{64}, "
                    r"but got 'missing'\.$"),
    ("missing_base_of_delta", lambda f: shutil.rmtree(os.path.join(f, "base")) or ({}, "d2"),
     lambda f, ids: r"For 'Predictor', the base of the delta %s \(its manifest's base.path\) must be a bundle "
                    r"directory written by RecModel.export \(holding manifest.json\), but got '%s \(missing\)'\.$"
                    % (_q(os.path.join(f, "d1")), re.escape(os.path.join(f, "base")))),
    ("not_a_bundle", lambda f: ({}, "nothing"),
     lambda f, ids: r"For 'Predictor', 'directory' must be a bundle directory written by RecModel.export "
                    r"\(holding manifest.json\), but got '.*nothing \(missing\)'\.$"),
    ("network_shape", lambda f: ({"hidden": (9,)}, "base"),
     lambda f, ids: r"For 'Predictor', the shape of the parameter 'mlp.0.bias' of 'network' must be \(8,\) like "
                    r"the bundle %s \('directory'\), but got \(9,\)\.$" % _q(os.path.join(f, "base"))),
    ("network_missing_parameter", lambda f: ({"num_dense": 0}, "base"),
     lambda f, ids: r"For 'Predictor', 'network' must be a network with the parameter 'wide_dense.bias' of the "
                    r"bundle .*, but got 'a network without it'\.$"),
    ("network_extra_parameter", lambda f: ({"hidden": (8, 8)}, "base"),
     lambda f, ids: r"For 'Predictor', the parameter 'mlp.4.bias' of 'network' must be a parameter of the bundle "
                    r".*, but got 'a parameter it lacks'\.$"),
    ("network_deepfm", lambda f: ({"deepfm": True}, "base"),       # the same parameters: told by the settings
     lambda f, ids: r"For 'Predictor', the setting 'model' of 'network' must be 'widedeep' like the bundle %s "
                    r"\('directory'\), but got 'deepfm'\.$" % _q(os.path.join(f, "base"))),
    ("network_class", lambda f: ({"cls": _MyWideDeep}, "base"),
     lambda f, ids: r"For 'Predictor', the class of 'network' must be recboost:WideDeep like the bundle %s "
                    r"\('directory'\), but got '[\w.]*test_export:_MyWideDeep'\.$" % _q(os.path.join(f, "base"))),
    ("manifest_edited", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m.update(step=5), sign=False) or
     ({}, "base"),
     lambda f, ids: r"For 'Predictor', the manifest.json of the bundle %s \('directory'\) is damaged or was edited: "
                    r"its content's sha256 is [0-9a-f]{64} but the file records [0-9a-f]{64}; recboost refuses to "
                    r"use it\.$" % _q(os.path.join(f, "base"))),
    ("manifest_not_json", lambda f: _truncate(os.path.join(f, "d1"), "manifest.json", 100) or ({}, "d2"),
     lambda f, ids: r"For 'Predictor', the manifest.json of the bundle %s \(the base of the delta %s \(its manifest's "
                    r"base.path\)\) is damaged or was edited: it is not valid UTF-8 JSON" % (
                        _q(os.path.join(f, "d1")), _q(os.path.join(f, "d2")))),
    ("format_1", lambda f: _as_format_1(os.path.join(f, "base")) or ({}, "base"),
     lambda f, ids: r"For 'Predictor', the format of the bundle %s \('directory'\) must be 2 or 3 \(the bundle "
                    r"formats this recboost reads: 3 with float16 or int8 rows; a format-1 bundle, written by an earlier recboost, has no checksum on its "
                    r"manifest and no record of its network: export it again\), but got 1\.$"
                    % _q(os.path.join(f, "base"))),
    ("manifest_network_missing", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m.pop("network")) or
     ({}, "base"),
     lambda f, ids: r"the manifest field 'network' of the bundle .* must be an object with 'class', 'settings' and "
                    r"'parameters', but got 'missing'\.$"),
    ("dense_not_as_listed", lambda f: _edit_manifest(os.path.join(f, "d1"), lambda m: m["network"]["parameters"][
        0].update(shape=[9])) or ({}, "d1"),
     lambda f, ids: r"For 'Predictor', the file 'dense.ckpt' of the bundle %s \('directory'\) must be the parameters "
                    r"the manifest lists \(network.parameters: 6, the first differing \{'name': 'mlp.0.bias', "
                    r"'shape': \[9\], 'dtype': 'Float32'\}\), but got .6 parameters, the first differing "
                    r"\{'name': 'mlp.0.bias', 'shape': \[8\], 'dtype': 'Float32'\}.\.$" % _q(os.path.join(f, "d1"))),
    ("manifest_widedeep_layers", lambda f: _set_network(os.path.join(f, "base"), "hidden", 16) or ({}, "base"),
     lambda f, ids: r"For 'Predictor', the manifest field 'network.settings.hidden' of the bundle %s \('directory'\) "
                    r"must be a list, but got 16\.$" % _q(os.path.join(f, "base"))),
    ("manifest_widedeep_setting_missing", lambda f: _edit_manifest(os.path.join(f, "base"), lambda m: m["network"][
        "settings"].pop("num_dense")) or ({}, "base"),
     lambda f, ids: r"the manifest field 'network.settings.num_dense' of the bundle .* must be an int >= 0, but got "
                    r"'missing'\.$"),
    ("delta_of_another_network", lambda f: _set_network(os.path.join(f, "d1"), "model", "deepfm") or ({}, "d2"),
     lambda f, ids: r"For 'Predictor', the setting 'model' of the network of the delta %s \('directory'\) must be "
                    r"'widedeep' like its base %s, but got 'deepfm'\.$" % (_q(os.path.join(f, "d1")),
                                                                         _q(os.path.join(f, "base")))),
    ("network_table", lambda f: ({"dim": DIM + 1}, "base"),
     lambda f, ids: r"For 'Predictor', the embedding_size of hash table 0 'ids' of 'network' must be %d like the "
                    r"bundle .*, but got %d\.$" % (DIM + 1, DIM + 2)),
]


@pytest.mark.parametrize("case,spoil,message", PREDICTOR_CASES, ids=[c[0] for c in PREDICTOR_CASES])
def test_predictor_refuses_bad_bundles_and_networks(chain, tmp_path, case, spoil, message):
    folder = _copy(chain, tmp_path)
    kwargs, name = spoil(folder)
    table, net = worker.network(seed=7, **kwargs)
    params = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    weight, cache = table.weight.copy(), table.cache
    with pytest.raises((ValueError, TypeError), match=message(folder, _ids(chain[1]))):
        rb.Predictor(net, os.path.join(folder, name))
    assert table.cache is cache and isinstance(cache, rb.HashCache) and len(cache) == 0     # nothing changed
    _assert_bits(table.weight, weight)
    for p in net.get_parameters():
        _assert_bits(p.asnumpy(), params[p.name])


def test_predictor_refuses_a_trained_network(chain):
    run, root = chain
    before = run.table.cache.stats()
    with pytest.raises(ValueError, match=r"For 'Predictor', the hash table 'ids' of 'network' must be a fresh table "
                                         r"\(a Predictor replaces its map and rows: pass a freshly built copy of the "
                                         r"network\), but got 'a table holding \d+ ids'\.$"):
        rb.Predictor(run.net, str(root / "base"))
    assert isinstance(run.table.cache, rb.HashCache) and run.table.cache.stats() == before
    served = _predictor(str(root / "base"))
    with pytest.raises(ValueError, match=r"must be a fresh table"):           # nor a network already serving
        rb.Predictor(served.network, str(root / "d1"))


def test_predict_names_an_input_of_another_shape(chain):
    """RecModel.predict (after training: the training batches' items but the label) and a Predictor of a
    WideDeep bundle (the inputs its record gives) check a batch's items before the network runs: a wrong
    count of id fields or of items is a ValueError naming the input and both shapes (it was MindSpore's
    MatMul error from inside the network); the right ones predict."""
    run, root = chain
    served = _predictor(str(root / "base"))
    dense, ids = np.zeros((3, DENSE), np.float32), np.ones((3, FIELDS), np.int64)
    for predict, where in ((run.model.predict, "RecModel.predict"), (served.predict, "Predictor.predict")):
        with pytest.raises(ValueError, match=r"For '%s', the shape of input 1 must be \[B, %d\] like the model's "
                                             r"inputs, but got '\[B, %d\]'\.$" % (where, FIELDS, FIELDS - 1)):
            predict(dense, ids[:, 1:])
        with pytest.raises(ValueError, match=r"For '%s', the shape of input 0 must be \[B, %d\] like the model's "
                                             r"inputs, but got '\[B, 1\]'\.$" % (where, DENSE)):
            predict(dense[:, :1], ids)
        with pytest.raises(ValueError, match=r"For '%s', the inputs must be 2 items like the model's inputs, but got "
                                             r"'3 items'\.$" % where):
            predict(dense, ids, ids)
    assert served.predict(dense, ids).shape == run.model.predict(dense, ids).shape == (3, 1)


def test_export_refuses_a_path_inside_a_bundle_under_a_file_or_empty(chain, tmp_path):
    """A bundle is never written into (export("base/sub") wrote a bundle and a temporary one inside a bundle
    served), under a file (an OSError "File exists"), nor at "" (a whole temporary bundle written into the
    parent of the working directory before the refusal): each refused by name, nothing written."""
    run, _ = chain
    folder = _copy(chain, tmp_path)
    before = sorted(os.listdir(os.path.join(folder, "base")))
    (tmp_path / "file").write_text("x")
    for path, message in ((os.path.join(folder, "base", "sub"), r"must be a directory outside every bundle \(a "
                           r"bundle is never changed\), but got \".*sub', inside the bundle '.*base'\""),
                          (str(tmp_path / "file" / "sub"), r"must be a new or empty directory, but got .*whose "
                                                          r"parent is a file"),
                          ("", r"'directory' must be")):
        with pytest.raises(ValueError, match=r"For 'RecModel.export', 'directory' " + message.replace(
                r"'directory' must be", "must be")):
            run.model.export(path)
    assert sorted(os.listdir(os.path.join(folder, "base"))) == before


def test_online_export_keeps_only_bundles_of_its_own_network(graph_mode, tmp_path):
    """A bundle the directory holds at an export step is kept as the run's own only when it is of the model's
    network: another network's bundles (a run of hidden (16,) over one of (8,)) are an export failure each,
    logged and counted once per step (the train end tries the failed step no more), never the chain's
    base; a resume from there refuses the foreign base at train start."""
    first = _Run()
    folder = str(tmp_path / "export")
    first.model.online_train(first.stream, callbacks=[rb.OnlineExport(folder, every_steps=2), StopAfter(4)],
                             dataset_sink_mode=False)
    table, net = worker.network(5, hidden=(16,))
    other = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    exporter = rb.OnlineExport(folder, every_steps=2)
    other.online_train(_stream(1), callbacks=[exporter, StopAfter(4)], dataset_sink_mode=False)
    assert other.step == 4 and exporter.exported == 0 and exporter.paths == []
    assert [f["step"] for f in exporter.failures] == [2, 4] and exporter.failed_exports == 2
    assert "the model's network" in exporter.failures[0]["error"]
    with pytest.raises(ValueError, match=r"For 'OnlineExport', the .* of the model's network must be .* like the "
                                         r"bundle '.*bundle-000000004' the directory holds"):
        other.online_train(_stream(2), callbacks=[rb.OnlineExport(folder, every_steps=2), StopAfter(6)],
                           dataset_sink_mode=False)
    assert other.step == 4


def test_a_bundle_file_changed_after_its_check_is_never_used(chain, tmp_path, monkeypatch):
    """Each file Predictor uses is read once: the rows and the dense checkpoint it serves are the bytes
    whose sha256 it checked, though each file is replaced by other bytes right after it is opened."""
    from _disk import swap_on_first_open
    folder = _copy(chain, tmp_path)
    base = os.path.join(folder, "base")
    want = _served(_predictor(base))
    rows = os.path.join(base, "table-0-rows.npy")
    np.save(str(tmp_path / "rows.npy"), np.load(rows) + 1)                  # a valid file: the same shape
    _, other = worker.network(seed=9)
    ms.save_checkpoint(other, str(tmp_path / "dense.ckpt"))                 # another network's parameters
    replaced = {rows: str(tmp_path / "rows.npy"), os.path.join(base, "dense.ckpt"): str(tmp_path / "dense.ckpt")}
    opened = swap_on_first_open(monkeypatch, replaced)
    got = _served(_predictor(base))
    monkeypatch.undo()
    assert opened == set(replaced)                                         # both replaced while being read
    _assert_same_served(got, want)
    with pytest.raises(ValueError, match=r"the file 'dense.ckpt' of the bundle .* \(altered\)"):
        _predictor(base)                                                   # now changed: refused by name


def test_rows_numpy_wrote_in_fortran_order_are_served_as_numpy_reads_them(chain, tmp_path):
    """A rows file in Fortran order (numpy's own .npy, listed with its size and sha256 in a re-signed
    manifest) is read as ``np.load`` reads it; its rows are then copied into the served weight."""
    folder = _copy(chain, tmp_path)
    base = os.path.join(folder, "base")
    want = _served(_predictor(base))
    rows = os.path.join(base, "table-0-rows.npy")
    np.save(rows, np.asfortranarray(np.load(rows)))
    assert np.load(rows).flags.f_contiguous and not np.load(rows).flags.c_contiguous
    _edit_manifest(base, lambda m: m["files"]["table-0-rows.npy"].update(zip(("bytes", "sha256"), _digest(rows))))
    _assert_same_served(_served(_predictor(base)), want)


def test_a_checked_copy_that_cannot_be_written_is_an_os_error_naming_it(chain, tmp_path, monkeypatch):
    """dense.ckpt is loaded from a temporary copy of its checked bytes; a temporary folder that cannot
    take it is an OSError naming the file, its bytes and the folder, not a damaged bundle."""
    missing = str(tmp_path / "missing")
    monkeypatch.setattr(tempfile, "tempdir", missing)
    with pytest.raises(FileNotFoundError, match=r"writing a copy of the checked bytes of 'dense.ckpt' \(\d+ bytes\) "
                                                r"into %s, for MindSpore to load$" % _q(missing)):
        _predictor(os.path.join(str(chain[1]), "base"))
    monkeypatch.undo()
    assert not os.path.exists(missing) and _predictor(os.path.join(str(chain[1]), "base"))


# ---- serving from threads -------------------------------------------------------------------------------
def _in_threads(n, work):
    """Run ``work(k)`` in ``n`` threads at once; re-raise the first failure."""
    import threading
    errors, start = [], threading.Barrier(n)

    def run(k):
        try:
            start.wait()
            work(k)
        except BaseException as exc:            # noqa: BLE001 -- re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a prediction thread hung"
    if errors:
        raise errors[0]


def test_predict_from_four_threads_is_safe_and_exact(chain):
    """Four threads predicting at once, on a fresh Predictor (the first calls compile) and a warm one:
    no crash, every output the single-threaded one, bit for bit."""
    run, root = chain
    probes = [_probe(run) for _ in range(4)]
    want = [_predictor(str(root / "d2"), deltas=()).predict(*p) for p in probes]
    for warm in (False, True):
        predictor = _predictor(str(root / "d2"))
        if warm:
            predictor.predict(*probes[0])
        got = {k: [] for k in range(4)}
        _in_threads(4, lambda k: got[k].extend(predictor.predict(*probes[k]) for _ in range(10)))
        for k in range(4):
            for out in got[k]:
                _assert_bits(out, want[k])


def test_apply_is_atomic_under_concurrent_predictions(chain):
    """Three threads predict while the main thread applies d1 then d2: every prediction equals the
    model before or after a delta (base, d1 or d2), never a mix, and the last ones d2's."""
    run, root = chain
    probe = _probe(run, np.concatenate([np.load(os.path.join(root, name, "table-0-ids.npy"))
                                        for name in ("base", "d1")])[:BATCH * FIELDS // 2])
    states = [_predictor(str(root / "base")).predict(*probe),
              _predictor(str(root / "base"), deltas=[str(root / "d1")]).predict(*probe),
              _predictor(str(root / "d2")).predict(*probe)]
    assert all(a.tobytes() != b.tobytes() for i, a in enumerate(states) for b in states[i + 1:])
    predictor = _predictor(str(root / "base"))
    predictor.predict(*probe)
    seen, applied, done = {k: [] for k in range(3)}, [], []

    def work(k):
        if k == 3:
            try:
                for name in ("d1", "d2"):
                    predictor.apply(str(root / name))
                    applied.append(name)
            finally:
                done.append(True)
            return
        while not done or len(seen[k]) < 5:
            seen[k].append(predictor.predict(*probe).tobytes())

    _in_threads(4, work)
    assert applied == ["d1", "d2"]
    which = [[[s.tobytes() for s in states].index(out) if out in [s.tobytes() for s in states] else None
              for out in outs] for outs in seen.values()]
    assert all(None not in w for w in which), which            # never a mix of two states
    assert all(w == sorted(w) and w[-1] == 2 for w in which)   # in order, ending on d2


# Predictor.apply(delta) on the served base: (case, spoil(folder) -> delta name, message pattern)
APPLY_CASES = [
    ("wrong_base", lambda f: "d2",
     lambda f, ids: r"For 'Predictor.apply', 'delta_directory' must be a delta on the current bundle %s \(id %s\), "
                    r"but got .the delta %s \(id %s\) on the bundle %s \(id %s\).\.$" % (
                        _q(os.path.join(f, "base")), ids["base"], _q(os.path.join(f, "d2")), ids["d2"],
                        _q(os.path.join(f, "d1")), ids["d1"])),
    ("full_bundle", lambda f: "base",
     lambda f, ids: r"For 'Predictor.apply', 'delta_directory' must be a delta bundle \(written by RecModel.export "
                    r"with 'base'\), but got .the full bundle %s \(id %s\).\.$"
                    % (_q(os.path.join(f, "base")), ids["base"])),
    ("format", lambda f: _set_format(os.path.join(f, "d1"), 99) or "d1",
     lambda f, ids: r"For 'Predictor.apply', the format of the bundle %s \('delta_directory'\) must be 2 or 3 "
                    r"\(the bundle formats this recboost reads: 3 with float16 or int8 rows\), but got 99\.$" % _q(os.path.join(f, "d1"))),
    ("truncated", lambda f: _truncate(os.path.join(f, "d1"), "table-0-evicted.npy") or "d1",
     lambda f, ids: r"the file 'table-0-evicted.npy' of the bundle .* must be \d+ bytes with sha256 "
                    r"[0-9a-f]{64}, but got '\d+ bytes \(truncated or altered\)'\.$"),
    ("not_a_bundle", lambda f: "nothing",
     lambda f, ids: r"For 'Predictor.apply', 'delta_directory' must be a bundle directory written by "
                    r"RecModel.export"),
    ("network", lambda f: _set_network(os.path.join(f, "d1"), "hidden", [9]) or "d1",
     lambda f, ids: r"For 'Predictor.apply', the setting 'hidden' of the network of the delta %s "
                    r"\('delta_directory'\) must be \[8\] like its base %s, but got \[9\]\.$" % (
                        _q(os.path.join(f, "d1")), _q(os.path.join(f, "base")))),
    ("manifest_edited", lambda f: _edit_manifest(os.path.join(f, "d1"), lambda m: m.update(step=99), sign=False) or
     "d1",
     lambda f, ids: r"For 'Predictor.apply', the manifest.json of the bundle %s \('delta_directory'\) is damaged "
                    r"or was edited: its content's sha256 is" % _q(os.path.join(f, "d1"))),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,spoil,message", APPLY_CASES, ids=[c[0] for c in APPLY_CASES])
def test_apply_refuses_bad_deltas_and_changes_nothing(chain, tmp_path, case, spoil, message):
    folder = _copy(chain, tmp_path)
    predictor = _predictor(os.path.join(folder, "base"))
    dense, ids = _probe(chain[0])
    out, served, bundle_id = predictor.predict(dense, ids), _served(predictor), predictor.bundle_id
    name = spoil(folder)
    with pytest.raises(ValueError, match=message(folder, _ids(chain[1]))):
        predictor.apply(os.path.join(folder, name))
    assert predictor.bundle_id == bundle_id and predictor.directory == os.path.join(folder, "base")
    _assert_same_served(_served(predictor), served)
    _assert_bits(predictor.predict(dense, ids), out)
    if case == "wrong_base":                      # the right order still works afterwards
        predictor.apply(os.path.join(folder, "d1")).apply(os.path.join(folder, "d2"))
        assert predictor.bundle_id == _ids(chain[1])["d2"]


def _other_bundle(folder):
    """A bundle of a model whose table is one column wider."""
    _, net = worker.network(dim=DIM + 1)
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params())).export(
        os.path.join(folder, "other"))


# RecModel.export(directory, base) refused: (case, spoil(folder) -> (directory, base), message pattern)
EXPORT_CASES = [
    ("base_not_a_bundle", lambda f: ("new", os.path.join(f, "nothing")),
     lambda f: r"For 'RecModel.export', 'base' must be a bundle directory written by RecModel.export \(holding "
               r"manifest.json\), but got '%s \(missing\)'\.$" % re.escape(os.path.join(f, "nothing"))),
    ("base_is_a_file", lambda f: ("new", os.path.join(f, "base", "manifest.json")),
     lambda f: r"For 'RecModel.export', 'base' must be a bundle directory written by RecModel.export"),
    ("base_truncated",
     lambda f: _truncate(os.path.join(f, "d1"), "table-0-ids.npy", 40) or ("new", os.path.join(f, "d2")),
     lambda f: r"For 'RecModel.export', the file 'table-0-ids.npy' of the bundle %s \(the base of the delta %s "
               r"\(its manifest's base.path\)\) must be \d+ bytes" % (_q(os.path.join(f, "d1")),
                                                                 _q(os.path.join(f, "d2")))),
    ("base_format", lambda f: _set_format(os.path.join(f, "base"), 0) or ("new", os.path.join(f, "base")),
     lambda f: r"For 'RecModel.export', the format of the bundle .* \('base'\) must be 2 .*, but got 0\.$"),
    ("base_of_another_model", lambda f: ("new", _other_bundle(f)),
     lambda f: r"For 'RecModel.export', the embedding_size of hash table 0 'ids' of this model must be %d like the "
               r"base %s \('base'\), but got %d\.$" % (DIM + 2, _q(os.path.join(f, "other")), DIM + 1)),
    ("base_of_another_network", lambda f: [_set_network(os.path.join(f, b), "model", "deepfm")
                                           for b in ("base", "d1", "d2")] and ("new", os.path.join(f, "d2")),
     lambda f: r"For 'RecModel.export', the setting 'model' of this model's network must be 'deepfm' like the base "
               r"%s \('base'\), but got 'widedeep'\.$" % _q(os.path.join(f, "d2"))),
    ("directory_not_empty", lambda f: (os.path.join(f, "d1"), None),
     lambda f: r"For 'RecModel.export', 'directory' must be a new or empty directory \(a bundle is never "
               r"overwritten\), but got .%s, which is not empty.\.$" % _q(os.path.join(f, "d1"))),
    ("directory_is_a_file", lambda f: (os.path.join(f, "d1", "dense.ckpt"), None),
     lambda f: r"For 'RecModel.export', 'directory' must be a new or empty directory, but got .*, which is a file"),
]


@pytest.mark.parametrize("case,spoil,message", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_export_refuses_bad_arguments_and_changes_nothing(chain, tmp_path, case, spoil, message):
    run = chain[0]
    folder = _copy(chain, tmp_path)
    directory, base = spoil(folder)
    directory = os.path.join(folder, directory)
    listing = {p: sorted(os.listdir(os.path.join(folder, p))) for p in os.listdir(folder)
               if os.path.isdir(os.path.join(folder, p))}
    digests = {(p, f): _digest(os.path.join(folder, p, f)) for p, files in listing.items() for f in files}
    state = run.table.state_dict()
    dense = {p.name: p.asnumpy().copy() for p in run.model.state_parameters()}
    step = run.model.step
    with pytest.raises(ValueError, match=message(folder)):
        run.model.export(directory, base=base)
    assert not os.path.exists(os.path.join(folder, "new"))
    assert {p: sorted(os.listdir(os.path.join(folder, p))) for p in os.listdir(folder)
            if os.path.isdir(os.path.join(folder, p))} == listing                # nothing written, no temporary
    assert digests == {(p, f): _digest(os.path.join(folder, p, f))
                       for p, files in listing.items() for f in files}
    after = run.table.state_dict()
    _assert_bits(after["table"], state["table"])
    for key, value in state["cache"].items():
        _assert_bits(after["cache"][key], value)
    for key, value in state["slots"].items():
        _assert_bits(after["slots"][key], value)
    for p in run.model.state_parameters():
        _assert_bits(p.asnumpy(), dense[p.name])
    assert run.model.step == step


def test_export_argument_types(chain, tmp_path):
    model = chain[0].model
    with pytest.raises(TypeError, match=r"For 'RecModel.export', 'directory' must be a directory path, but got 3\.$"):
        model.export(3)
    with pytest.raises(TypeError, match=r"For 'RecModel.export', 'base' must be None or a bundle directory path, "
                                        r"but got 1\.$"):
        model.export(str(tmp_path / "x"), base=1)
    with pytest.raises(TypeError, match=r"For 'Predictor', 'network' must be a Cell"):
        rb.Predictor("net", str(tmp_path))
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_delta_lists_the_ids_a_full_table_replaced(graph_mode, tmp_path, policy):
    """Ids a full table's eviction policy replaced (no time eviction here) are tombstones of the next
    delta, and a Predictor on the chain serves exactly the ids the table holds, with their rows."""
    run = _Run(seed=3, vocab=400, evict_every=0, capacity=40, evict=-1, policy=policy).train_to(4)
    run.model.export(str(tmp_path / "base"))
    before, replaced = run.owned(), run.table.cache.stats()["replaced"]
    run.train_to(8)
    stats = run.table.cache.stats()
    assert stats["replaced"] > replaced and stats["evicted"] == 0 and stats["capacity"] == 40
    run.model.export(str(tmp_path / "d1"), base=str(tmp_path / "base"))
    gone = np.setdiff1d(before, run.owned())
    assert gone.size
    _assert_bits(np.load(str(tmp_path / "d1" / "table-0-evicted.npy")), gone)
    predictor = _predictor(str(tmp_path / "base"), deltas=[str(tmp_path / "d1")])
    (served_ids, served_rows), = _served(predictor)[0]
    state = run.table.cache.state_dict()
    _assert_bits(served_ids, run.owned())
    _assert_bits(served_rows[2:], run.table.weight[state["rows"][run.served(state)]])


# ---- I/O failures while writing a bundle: named, nothing left; a long run goes on and retries ----------
def _failing_writes(monkeypatch, part, code, when=lambda: True):
    """Make the write of one part of a bundle fail with the OSError ``code`` while ``when()``: "rows"
    (the data of table-0-rows.npy, through the bytes writer), "dense" (mindspore.save_checkpoint) or
    "manifest" (manifest.json)."""
    error = OSError(code, os.strerror(code))
    if part == "rows":
        real = rb._HashingWriter.write

        def write(self, data):
            if when() and self.fh.name.endswith("table-0-rows.npy") and self.size:     # after the header
                raise error
            return real(self, data)
        monkeypatch.setattr(rb._HashingWriter, "write", write)
    elif part == "dense":
        real_save = rb.ms.save_checkpoint

        def save(network, path, *args, **kwargs):
            if when():
                raise error
            return real_save(network, path, *args, **kwargs)
        monkeypatch.setattr(rb.ms, "save_checkpoint", save)
    else:
        real_json = rb._write_json_checked

        def write_json(path, record):
            if when():
                raise error
            return real_json(path, record)
        monkeypatch.setattr(rb, "_write_json_checked", write_json)


@pytest.mark.slow
@pytest.mark.parametrize("part,code,exc_type", [("rows", errno.ENOSPC, OSError), ("dense", errno.EIO, OSError),
                                                 ("manifest", errno.EACCES, PermissionError)])
def test_an_io_error_while_exporting_names_the_path_and_the_bytes(graph_mode, tmp_path, monkeypatch, part, code,
                                                                   exc_type):
    run = _Run().train_to(3)
    failing = [True]
    _failing_writes(monkeypatch, part, code, lambda: failing[0])
    target = str(tmp_path / "out" / "bundle")
    with pytest.raises(exc_type) as info:
        run.model.export(target)
    message = str(info.value)
    assert info.value.errno == code and message.startswith("[Errno %d] %s: writing " % (code, os.strerror(code)))
    name = {"rows": "table-0-rows.npy", "dense": "dense.ckpt", "manifest": "manifest.json"}[part]
    found = re.search(r": writing (\d+) bytes to '(.*)': the bundle '(.*)' was not written \(nothing of it is "
                      r"left\)$", message)
    assert found, message
    assert os.path.basename(found.group(2)) == name and found.group(3) == target
    assert re.fullmatch(r"\.tmp-%d-[0-9a-f]{12}\.bundle" % os.getpid(), os.path.basename(os.path.dirname(
        found.group(2))))
    assert os.listdir(str(tmp_path / "out")) == []                         # no bundle, no temporary directory
    failing[0] = False                                                     # the disk has room again
    run.model.export(target)
    size = os.path.getsize(os.path.join(target, name))
    if part == "dense":     # before writing, the parameters' bytes (the checkpoint adds names and shapes)
        assert int(found.group(1)) == sum(p.asnumpy().nbytes for p in run.net.get_parameters()) < size
    else:
        assert int(found.group(1)) == size


class _Expected(ms.train.Callback):
    """After each step: the model's output on ``probe`` (the model every export of that step holds)."""

    def __init__(self, model, probe):
        self.model, self.probe, self.at = model, probe, {}

    def on_train_step_end(self, run_context):
        self.at[run_context.original_args().cur_step_num] = self.model.predict(*self.probe).asnumpy()


def test_online_export_logs_a_failed_bundle_and_retries_at_the_next_export_point(graph_mode, tmp_path, monkeypatch):
    """The bundle of step 6 fails (a full disk): training goes on, the failure is logged loudly with the
    bundle's path and the error, nothing of it is left, and step 9 is a delta on step 3's bundle: a
    Predictor following the export goes 3 -> 9 -> 10, each bit for bit the model at that step."""
    run = _Run()
    probe = _probe(run)
    logged = []
    monkeypatch.setattr(rb, "_log", logged.append)
    _failing_writes(monkeypatch, "rows", errno.ENOSPC, lambda: run.model.step == 6)
    folder = str(tmp_path / "export")
    exporter = rb.OnlineExport(folder, every_steps=3)
    expected = _Expected(run.model, probe)
    run.model.online_train(run.stream, callbacks=run.hooks + [exporter, expected, StopAfter(10)],
                           dataset_sink_mode=False)
    assert run.model.step == 10                                            # training went on
    names = ["bundle-%09d" % step for step in (3, 9, 10)]
    assert exporter.paths == [os.path.join(folder, n) for n in names] and sorted(os.listdir(folder)) == names
    assert exporter.failed_exports == 1 and len(exporter.failures) == 1
    failure = exporter.failures[0]
    assert failure["step"] == 6 and failure["path"] == os.path.join(folder, "bundle-000000006")
    assert re.fullmatch(r"\[Errno 28\] No space left on device: writing \d+ bytes to '.*table-0-rows\.npy': the "
                        r"bundle '%s' was not written \(nothing of it is left\)" % re.escape(failure["path"]),
                        failure["error"])
    lines = [line for line in logged if "FAILED" in line]
    assert lines == ["OnlineExport: EXPORTING THE BUNDLE %s FAILED at step 6 (OSError: %s); nothing of it is left, "
                     "training goes on, the next export point tries again (a delta on %s); 1 failed export(s) so "
                     "far" % (failure["path"], failure["error"], exporter.paths[0])]
    manifests = [_manifest(p) for p in exporter.paths]
    assert [m["step"] for m in manifests] == [3, 9, 10] and [m["kind"] for m in manifests] == ["full", "delta", "delta"]
    assert manifests[1]["base"]["id"] == manifests[0]["id"] and manifests[2]["base"]["id"] == manifests[1]["id"]
    predictor = _predictor(exporter.paths[0])
    _assert_bits(predictor.predict(*probe), expected.at[3])
    for path, step in zip(exporter.paths[1:], (9, 10)):
        _assert_bits(predictor.apply(path).predict(*probe), expected.at[step])


def test_online_export_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"For 'OnlineExport', 'directory' must be a directory path, but got 3\.$"):
        rb.OnlineExport(3)
    with pytest.raises((TypeError, ValueError), match=r"For 'OnlineExport', 'every_steps' must be an int >= 1"):
        rb.OnlineExport(str(tmp_path), every_steps=0)
    assert rb.OnlineExport(str(tmp_path), every_steps=5).every == 5 and not os.listdir(str(tmp_path))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for where, given in ((a_file, "which is a file"), (a_file / "under", "is a file")):
        with pytest.raises(ValueError, match=r"For 'OnlineExport', 'directory' must be .*%s" % given):
            rb.OnlineExport(str(where))
    assert os.listdir(str(tmp_path)) == ["a-file"]      # nothing created, no probe left


def test_online_export_removes_the_temporary_bundles_of_dead_processes(graph_mode, tmp_path):
    dead = next(pid for pid in range(4194303, 4000000, -1) if not rb._pid_alive(pid))
    folder = tmp_path / "export"
    folder.mkdir()
    for pid in (dead, os.getpid()):                       # a killed exporter's, and one of a live process
        (folder / (".tmp-%d-0123456789ab.bundle" % pid)).mkdir()
        (folder / (".tmp-%d-0123456789ab.bundle" % pid) / "dense.ckpt").write_bytes(b"part")
    run = _Run()
    run.model.online_train(run.stream, callbacks=[rb.OnlineExport(str(folder), every_steps=2), StopAfter(2)],
                           dataset_sink_mode=False)
    assert sorted(os.listdir(str(folder))) == [".tmp-%d-0123456789ab.bundle" % os.getpid(), "bundle-000000002"]


@pytest.mark.parametrize("one, other, same", [
    ("recboost:WideDeep", "recboost:WideDeep", True), ("__main__:Net", "models:Net", True),
    ("models:Net", "__main__:Net", True), ("models:Net", "other:Net", False), ("__main__:Net", "models:Net2", False),
    ("recboost:WideDeep", "models:WideDeep", False)])
def test_a_class_of_a_script_run_as_main_is_its_class_imported_by_name(one, other, same):
    assert rb._same_class(one, other) is same


def _top(run, n=None, min_score=None):
    """The ids a capped export keeps, worked out here from the cache's state: the owned ids by score
    decayed to the table's time (halved per whole half-life unseen), then the latest seen, then id."""
    state = run.table.cache.state_dict()
    owned = run.served(state)
    ids, counts, last = state["keys"][owned], state["counts"][owned], state["last_seen"][owned]
    periods = (state["now"] - last) // state["score_half_life"]
    score = np.where(periods >= 63, 0, counts >> np.minimum(periods, 62))
    entries = sorted(zip((-score).tolist(), (-last).tolist(), ids.tolist()))
    kept = [e[2] for e in entries if min_score is None or -e[0] / 65536 >= min_score]
    return np.sort(np.array(kept[:n] if n is not None else kept, np.int64))


def test_a_capped_bundle_keeps_the_top_rows_by_score_and_its_deltas_tombstone_what_falls_out(
        backend, graph_mode, tmp_path):
    """export(max_rows=N | min_score=s) of a "score" table: the bundle holds the top rows by score (the
    rest read the default row: Predictor predicts as RecModel does with them unknown); a capped delta
    on a capped base lists the base's ids that fell out of the cap as evicted, and base + delta serve
    exactly as a capped full export at the delta's step."""
    run = _Run(evict_every=0, capacity=200, access=-1, evict=-1, policy="score").train_to(6)
    assert run.table.cache.stats()["replaced"] > 0
    base = run.model.export(str(tmp_path / "base"), max_rows=10)
    kept = _top(run, 10)
    _assert_bits(np.load(os.path.join(base, "table-0-ids.npy")), kept)
    scores = run.table.cache.scores(run.owned())
    cut = float(np.median(scores))
    by_score = run.model.export(str(tmp_path / "by-score"), min_score=cut)
    _assert_bits(np.load(os.path.join(by_score, "table-0-ids.npy")), _top(run, min_score=cut))
    assert 0 < np.load(os.path.join(by_score, "table-0-ids.npy")).size < run.owned().size
    dense, ids = _probe(run, run.owned())
    unknown = np.where(np.isin(ids, kept), ids, UNKNOWN + 99)
    before = run.table.cache.state_dict()
    _assert_bits(_predictor(base).predict(dense, ids), run.model.predict(dense, unknown).asnumpy())
    after = run.table.cache.state_dict()                     # predict moved no score (no labels: find only)
    for key in ("keys", "counts", "last_seen", "step"):
        _assert_bits(after[key], before[key])
    run.train_to(10)
    delta = run.model.export(str(tmp_path / "delta"), base=base, max_rows=10)
    _assert_bits(np.load(os.path.join(delta, "table-0-evicted.npy")), np.setdiff1d(kept, _top(run, 10)))
    assert np.setdiff1d(kept, _top(run, 10)).size > 0
    full = run.model.export(str(tmp_path / "full"), max_rows=10)
    _assert_same_served(_served(_predictor(base, deltas=[delta])), _served(_predictor(full, seed=2)))
    with pytest.raises(ValueError, match="'max_rows' must be an int >= 0, but got -1"):
        run.model.export(str(tmp_path / "bad"), max_rows=-1)
    with pytest.raises(ValueError, match="'min_score' must be a finite number"):
        run.model.export(str(tmp_path / "bad"), min_score=float("nan"))
    assert not os.path.exists(str(tmp_path / "bad"))


def test_min_score_needs_a_score_table(graph_mode, tmp_path):
    run = _Run(evict_every=0, capacity=34, policy="lru").train_to(2)
    with pytest.raises(ValueError, match="'min_score' must be None: hash table 'ids' has no scores.*'lru'"):
        run.model.export(str(tmp_path / "bad"), min_score=1.0)
    capped = run.model.export(str(tmp_path / "recent"), max_rows=5)     # by recency without scores
    state = run.table.cache.state_dict()
    owned = run.served(state)
    order = np.lexsort((state["keys"][owned], -state["last_seen"][owned]))[:5]
    _assert_bits(np.load(os.path.join(capped, "table-0-ids.npy")), np.sort(state["keys"][owned][order]))


def test_online_export_caps_every_bundle_of_its_chain(graph_mode, tmp_path):
    """OnlineExport(max_rows=8) on a "score" table: each bundle of the chain (a capped base, capped
    deltas) serves exactly as a capped full export at the last step; min_score on a table without
    scores is refused at train begin, naming it."""
    run = _Run(evict_every=0, capacity=200, access=-1, evict=-1, policy="score")
    folder = str(tmp_path / "export")
    exporter = rb.OnlineExport(folder, every_steps=3, max_rows=8)
    run.model.online_train(run.stream, callbacks=[exporter, StopAfter(7)], dataset_sink_mode=False)
    assert [os.path.basename(p) for p in exporter.paths] == ["bundle-%09d" % s for s in (3, 6, 7)]
    assert np.load(os.path.join(exporter.paths[0], "table-0-ids.npy")).size == 8
    full = run.model.export(str(tmp_path / "full"), max_rows=8)
    _assert_bits(np.load(os.path.join(full, "table-0-ids.npy")), _top(run, 8))
    _assert_same_served(_served(_predictor(exporter.paths[-1])), _served(_predictor(full, seed=2)))
    lru = _Run(evict_every=0, capacity=34, policy="lru")
    with pytest.raises(ValueError, match="For 'OnlineExport', 'min_score' must be None: hash table 'ids' has no scores"):
        lru.model.online_train(lru.stream, callbacks=[rb.OnlineExport(str(tmp_path / "lru"), min_score=0.5),
                                                      StopAfter(1)], dataset_sink_mode=False)
