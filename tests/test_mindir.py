"""The dense network as MindIR (issue #39 item 3): ``RecModel.export(..., mindir=sample)`` writes
``dense.mindir`` into the bundle, and a process that cannot import recboost serves the bundle with
``mindspore.load`` + ``nn.GraphCell`` and the plain numpy reader of docs/serving.md ("Serving without
recboost": serve.py, run here as written), bit for bit as ``Predictor`` on the same batches: a
one-table Wide&Deep (admission, eviction, ids evicted and never seen), and a network of two tables
side by side on one item and a multi-hot ``mean`` bag with a padding id, padded and ragged. A
damaged ``dense.mindir``, a bundle without one, a bad ``mindir`` field and a network MindSpore
cannot export are refused by name, changing nothing.
"""
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

import recboost as rb
import _export_worker as worker
from _export_worker import BATCH, DENSE, FIELDS
from test_readme import NO_RECBOOST, _example

UNKNOWN = 10 ** 15                         # ids far above the streams': never seen
TAGS, TAG_DIM, DEEP_DIM = 4, 3, 4          # the two-table network: tags per row (padded with 0), widths


def _serve_py(folder):
    """docs/serving.md's serve.py, as written, in ``folder``."""
    path = os.path.join(str(folder), "serve.py")
    with open(path, "w") as fh:
        fh.write(_example("docs/serving.md", "## Serving without recboost"))
    return path


#: The fresh process: recboost cannot be imported; serve.py's functions serve every batch of an .npz
#: (``"<batch>.<item>"``, or ``"<batch>.<item>.values"`` / ``".offsets"`` for a ragged item).
CHILD = NO_RECBOOST + """
folder, bundle, batches, out = sys.argv[1:5]
sys.path.insert(0, folder)
import numpy as np
import serve
manifest, tables, network = serve.read_bundle(bundle)
results = {}
with np.load(batches) as data:
    for j in sorted({key.split(".")[0] for key in data.files}):
        items, k = [], 0
        while "%s.%d" % (j, k) in data.files or "%s.%d.values" % (j, k) in data.files:
            key = "%s.%d" % (j, k)
            items.append(data[key] if key in data.files else (data[key + ".values"], data[key + ".offsets"]))
            k += 1
        results[j] = network(*serve.network_inputs(manifest, tables, items)).asnumpy()
try:
    import recboost  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("recboost was importable")
np.savez(out, **results)
"""


def _serve_without_recboost(tmp_path, bundle, batches):
    """The outputs serve.py gives for ``batches`` (a list of batches, each a tuple of items) in a
    process where ``import recboost`` fails."""
    data = {}
    for j, batch in enumerate(batches):
        for k, item in enumerate(batch):
            if isinstance(item, tuple):
                data["%d.%d.values" % (j, k)], data["%d.%d.offsets" % (j, k)] = item
            else:
                data["%d.%d" % (j, k)] = item
    np.savez(str(tmp_path / "batches.npz"), **data)
    _serve_py(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), bundle, str(tmp_path / "batches.npz"),
                           str(tmp_path / "out.npz")], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(str(tmp_path / "out.npz")) as out:
        return [out[str(j)] for j in range(len(batches))]


def _stream(seed=0, vocab=120, tags=False):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=DENSE, num_sparse=FIELDS, vocab_sizes=[vocab] * FIELDS,
                                     batch_size=BATCH, drift=20000.0, with_timestamp=True, rows_per_second=32)
    rng = np.random.default_rng(seed)
    for dense, ids, label, ts in stream:
        batch = {"dense": dense, "ids": ids, "label": label, "timestamp": ts}
        if tags:
            batch = {"dense": dense, "ids": ids, "tags": rng.integers(0, 40, (BATCH, TAGS)), "label": label,
                     "timestamp": ts}
        yield batch


def _owned(table):
    state = table.cache.state_dict()
    return state["keys"][state["rows"] >= 0]


# ---- served without recboost, bit for bit as Predictor ----------------------------------------------
@pytest.mark.slow
@pytest.mark.live_backend
def test_one_table_served_without_recboost_equals_predictor(backend, graph_mode, tmp_path):
    table, net = worker.network(0)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    stream = _stream()
    hook = rb.EvictHook(evict_time_interval=3)
    model.online_train(itertools.islice(stream, 6), callbacks=hook, dataset_sink_mode=False)
    before = _owned(table)
    model.online_train(itertools.islice(stream, 6), callbacks=hook, dataset_sink_mode=False)
    evicted = np.setdiff1d(before, _owned(table))
    assert evicted.size > 0 and table.cache.stats()["admitted"] > 0
    probe = next(stream)
    ids = probe["ids"].copy()
    extra = evicted[:ids.size - FIELDS]
    ids.reshape(-1)[:extra.size] = extra                      # evicted ids, then the last row's never seen
    ids[-1] = UNKNOWN + np.arange(FIELDS)
    found = table.cache.find(ids)
    assert (found == 0).any() and (found > 1).any()           # default-row ids and ids with their own row
    small = (probe["dense"][:5], ids[:5])                     # another batch size: the batch dimension is dynamic
    bundle = model.export(str(tmp_path / "bundle"), mindir=(probe["dense"], ids))

    _, fresh = worker.network(7)
    predictor = rb.Predictor(fresh, bundle)
    expected = [predictor.predict(probe["dense"], ids), predictor.predict(*small)]
    assert np.array_equal(expected[0], model.predict(probe["dense"], ids).asnumpy())
    got = _serve_without_recboost(tmp_path, bundle, [(probe["dense"], ids), small])
    for out, want in zip(got, expected):
        assert out.dtype == want.dtype and out.shape == want.shape
        assert np.array_equal(out, want)

    graph = rb.load_mindir(bundle)                            # the checked GraphCell: the same graph
    serve = _serve_here(tmp_path)
    net_inputs = [Tensor(probe["dense"]), Tensor(serve["table_rows"](serve["read_bundle"](bundle)[1][0], ids))]
    assert np.array_equal(graph(*net_inputs).asnumpy(), expected[0])


def _serve_here(folder):
    """serve.py's functions (``read_bundle``, ``table_rows``, ``network_inputs``) in this process."""
    scope = {}
    exec(compile(open(_serve_py(folder)).read(), "serve.py", "exec"), scope)   # noqa: S102
    return scope


class TwoTables(nn.Cell):
    """``construct(dense, ids, tags)``: a wide table (1 column) and a deep table (DEEP_DIM) reading
    ``ids`` side by side, and a ``mean`` bag of ``tags`` (padding id 0), into one dense layer."""

    def __init__(self, seed=0):
        super().__init__()
        ms.set_seed(seed)
        common = dict(access_threshold=1, use_dynamic_expansion=True, seed=seed, optimizer=rb.SparseAdam(0.02))
        self.wide = rb.HashEmbedding(1, 32, input_index=1, name="wide", **common)
        self.deep = rb.HashEmbedding(DEEP_DIM, 32, input_index=1, name="deep", **common)
        self.tags = rb.HashEmbedding(TAG_DIM, 32, input_index=2, name="tags", combiner="mean", padding_id=0,
                                     **common)
        self.out = nn.Dense(DENSE + FIELDS * DEEP_DIM + TAG_DIM, 1)

    def construct(self, dense, ids, tags):
        wide, deep, bags = self.wide(ids), self.deep(ids), self.tags(tags)
        x = ops.concat((dense, deep.reshape((deep.shape[0], -1)), bags), 1)
        return self.out(x) + wide.sum(1)


@pytest.mark.slow
@pytest.mark.live_backend
def test_two_tables_side_by_side_and_a_mean_bag_served_without_recboost(backend, graph_mode, tmp_path):
    net = TwoTables()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    stream = _stream(seed=3, tags=True)
    model.online_train(itertools.islice(stream, 8), dataset_sink_mode=False)
    probe = next(stream)
    ids, tags = probe["ids"].copy(), probe["tags"].copy()
    ids[-1] = UNKNOWN + np.arange(FIELDS)
    tags[0] = 0                                               # an empty bag: padding only
    tags[1] = [0, 5, 0, UNKNOWN]                              # padding, a known and an unknown tag
    tags[2] = [7, 7, 7, 7]                                    # one tag four times
    assert (net.tags.cache.find(tags[1:2, 1:2]) > 1).all()
    padded = (probe["dense"], ids, tags)
    values = np.array([5, 0, UNKNOWN, 7, 9, 7, 11], np.int64)       # ragged: bags [5, 0, U], [], [7, 9, 7, 11]
    ragged = (probe["dense"][:3], ids[:3], (values, np.array([0, 3, 3, 7], np.int64)))
    bundle = model.export(str(tmp_path / "bundle"), mindir=padded)

    manifest = json.load(open(os.path.join(bundle, "manifest.json")))
    assert manifest["mindir"] == {"file": "dense.mindir", "inputs": [
        {"name": "dense", "shape": [-1, DENSE], "dtype": "float32", "tables": []},
        {"name": "ids", "shape": [-1, FIELDS, 1 + DEEP_DIM], "dtype": "float32", "tables": [0, 1]},
        {"name": "tags", "shape": [-1, TAG_DIM], "dtype": "float32", "tables": [2]}]}
    assert "dense.mindir" in manifest["files"] and manifest["format"] == 2

    predictor = rb.Predictor(TwoTables(seed=5), bundle)
    expected = [predictor.predict(*padded), predictor.predict(*ragged)]
    got = _serve_without_recboost(tmp_path, bundle, [padded, ragged])
    for out, want in zip(got, expected):
        assert out.shape == want.shape and np.array_equal(out, want)


class _ExportMindIR(ms.train.Callback):
    """At step ``at``, from inside training: export with ``mindir`` (when ``folder``) and keep the model's
    predictions on ``probe``; stop at step ``stop``."""

    def __init__(self, model, folder, at, stop, probe):
        self.model, self.folder, self.at, self.stop, self.probe = model, folder, at, stop, probe
        self.path = self.expected = None

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step == self.at and self.folder:
            self.path = self.model.export(os.path.join(self.folder, "step-%d" % step), mindir=self.probe)
            self.expected = self.model.predict(*self.probe).asnumpy()
        if step == self.stop:
            run_context.request_stop()


@pytest.mark.slow
def test_export_with_mindir_from_inside_training_changes_nothing(graph_mode, tmp_path):
    """A MindIR exported mid-run (the prefetcher paused, the network put in eval mode for the export)
    predicts as the model did then, and the run goes on as one without the export, bit for bit."""
    probe = next(_stream(seed=9))
    probe = (probe["dense"], probe["ids"])
    finals = []
    for folder in (str(tmp_path), None):
        _, net = worker.network(0)
        model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
        exporter = _ExportMindIR(model, folder, 3, 6, probe)
        model.online_train(_stream(), callbacks=exporter, dataset_sink_mode=False)
        assert model.step == 6
        finals.append(model.predict(*probe).asnumpy())
        if folder:
            assert json.load(open(os.path.join(exporter.path, "manifest.json")))["step"] == 3
            serve = _serve_here(tmp_path)
            manifest, tables, graph = serve["read_bundle"](exporter.path)
            served = graph(*serve["network_inputs"](manifest, tables, probe)).asnumpy()
            assert np.array_equal(served, exporter.expected)
    assert np.array_equal(finals[0], finals[1])


# ---- refused by name, changing nothing ---------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A bundle with a MindIR and one without, of one small trained model (GRAPH mode)."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    try:
        _, net = worker.network(0)
        model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
        stream = _stream()
        model.online_train(itertools.islice(stream, 3), dataset_sink_mode=False)
        probe = next(stream)
        folder = tmp_path_factory.mktemp("mindir")
        with_mindir = model.export(str(folder / "with"), mindir=(probe["dense"], probe["ids"]))
        without = model.export(str(folder / "without"))
        yield with_mindir, without, model, probe
    finally:
        ms.set_context(mode=old)


def _copy(src, tmp_path):
    import shutil
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def _resign(path, edit):
    """Edit the manifest of the bundle ``path`` and sign it again (its sha256 made for the new content)."""
    name = os.path.join(path, "manifest.json")
    record = json.load(open(name))
    record.pop("sha256")
    edit(record)
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    record["sha256"] = hashlib.sha256(canonical).hexdigest()
    with open(name, "w") as fh:
        json.dump(record, fh)


def test_a_bundle_without_mindir_is_refused_by_load_mindir(exported):
    _, without, _, _ = exported
    with pytest.raises(ValueError, match=r"For 'load_mindir', the manifest field 'mindir' of the bundle .*without"
                                         r".* must be a MindIR of the network \(export with RecModel.export"
                                         r"\(\.\.\., mindir=<a sample batch>\)\), but got 'none: the bundle was "
                                         r"exported without it'"):
        rb.load_mindir(without)
    assert "mindir" not in json.load(open(os.path.join(without, "manifest.json")))   # as before: no field


def test_load_mindir_of_a_delta_checks_its_chain(exported, tmp_path):
    """load_mindir of a delta reads its chain of bases as a Predictor does (it read the delta alone: a delta
    whose base was gone or damaged loaded): a missing base is refused by name, the chain whole loads."""
    import shutil
    with_mindir, _, model, probe = exported
    base = str(tmp_path / "base")
    shutil.copytree(with_mindir, base)
    delta = model.export(str(tmp_path / "delta"), base=base, mindir=(probe["dense"], probe["ids"]))  # (the module's
    assert json.load(open(os.path.join(delta, "manifest.json")))["kind"] == "delta"          # model: not trained)
    assert isinstance(rb.load_mindir(delta), nn.GraphCell)
    os.rename(base, str(tmp_path / "moved"))
    with pytest.raises(ValueError, match=r"For 'load_mindir', the base of the delta .*delta.* \(its manifest's "
                                         r"base.path\)"):
        rb.load_mindir(delta)


def test_a_damaged_mindir_is_refused_by_the_bundle_checksum(exported, tmp_path):
    with_mindir = _copy(exported[0], tmp_path)
    path = os.path.join(with_mindir, "dense.mindir")
    os.chmod(path, 0o600)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    damaged = r"the file 'dense.mindir' of the bundle .*copy.* must be \d+ bytes with sha256 \w+, but got " \
              r"'sha256 \w+ \(altered\)'"
    with pytest.raises(ValueError, match="For 'load_mindir', " + damaged):
        rb.load_mindir(with_mindir)
    _, fresh = worker.network(1)
    with pytest.raises(ValueError, match="For 'Predictor', " + damaged):
        rb.Predictor(fresh, with_mindir)
    with pytest.raises(ValueError, match="its file dense.mindir is damaged"):
        _serve_here(tmp_path)["read_bundle"](with_mindir)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["mindir"].update(file="other.mindir"),
     r"the manifest field 'mindir.file' of the bundle .* must be a file listed in 'files', but got 'other.mindir'"),
    (lambda m: m["mindir"]["inputs"][1].update(tables=[1]),
     r"the manifest field 'mindir.inputs\[1\].tables\[0\]' of the bundle .* must be a position in 'tables' "
     r"\(an int >= 0 and < 1\), but got 1"),
    (lambda m: m["mindir"].pop("inputs"),
     r"the manifest field 'mindir.inputs' of the bundle .* must be a list, but got 'missing'"),
])
def test_a_bad_mindir_field_is_refused(exported, tmp_path, edit, message):
    bundle = _copy(exported[0], tmp_path)
    _resign(bundle, edit)
    with pytest.raises(ValueError, match="For 'load_mindir', " + message):
        rb.load_mindir(bundle)
    _, fresh = worker.network(1)
    with pytest.raises(ValueError, match="For 'Predictor', " + message):
        rb.Predictor(fresh, bundle)


def test_mindir_argument_must_be_a_sample_batch(exported, tmp_path):
    _, _, model, probe = exported
    for bad in (True, "dense.mindir", 3):
        with pytest.raises(TypeError, match=r"For 'RecModel.export', 'mindir' must be None or a sample batch of "
                                            r"the inputs RecModel.predict takes .*, but got %r" % bad):
            model.export(str(tmp_path / "bundle"), mindir=bad)
    with pytest.raises(ValueError, match=r"For 'RecModel.export', the inputs must be a non-empty batch"):
        model.export(str(tmp_path / "bundle"), mindir=(probe["dense"][:0], probe["ids"][:0]))
    assert not os.path.exists(str(tmp_path / "bundle"))
    path = model.export(str(tmp_path / "bundle"), mindir={"dense": probe["dense"], "ids": probe["ids"]})
    assert json.load(open(os.path.join(path, "manifest.json")))["mindir"]["inputs"][1]["tables"] == [0]


def test_a_delta_holds_the_whole_mindir(exported, tmp_path):
    with_mindir, _, model, probe = exported
    delta = model.export(str(tmp_path / "delta"), base=with_mindir, mindir=(probe["dense"][:2], probe["ids"][:2]))
    manifest = json.load(open(os.path.join(delta, "manifest.json")))
    assert manifest["kind"] == "delta" and manifest["mindir"]["file"] in manifest["files"]
    rng = np.random.default_rng(0)
    inputs = [Tensor(rng.standard_normal((3, DENSE)).astype(np.float32)),
              Tensor(rng.standard_normal((3, FIELDS, worker.DIM + 1)).astype(np.float32))]
    full, whole = rb.load_mindir(with_mindir), rb.load_mindir(delta)     # the same network at the same step
    assert np.array_equal(whole(*inputs).asnumpy(), full(*inputs).asnumpy())


@pytest.mark.slow
def test_a_mindir_changed_after_its_check_is_never_loaded(exported, tmp_path, monkeypatch):
    """load_mindir, and docs/serving.md's serve.py, use the bytes whose sha256 they checked, though the
    MindIR (and for serve.py the rows) are replaced by another network's right after they are opened."""
    from _disk import swap_on_first_open
    with_mindir, _, _, probe = exported
    _, net = worker.network(seed=5)                   # another network of the same shapes (its table empty)
    other = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params())).export(
        str(tmp_path / "other"), mindir=(probe["dense"], probe["ids"]))
    rng = np.random.default_rng(0)
    inputs = [Tensor(rng.standard_normal((3, DENSE)).astype(np.float32)),
              Tensor(rng.standard_normal((3, FIELDS, worker.DIM + 1)).astype(np.float32))]
    serve, batch = _serve_here(tmp_path), (probe["dense"], probe["ids"])
    readers = {"load_mindir": lambda b: rb.load_mindir(b)(*inputs).asnumpy(),
               "serve.py": lambda b: _served_here(serve, b, batch)}
    for name, read in readers.items():
        bundle = str(tmp_path / ("bundle-" + name))
        shutil.copytree(with_mindir, bundle)
        want, theirs = read(bundle), read(other)
        assert not np.array_equal(want, theirs), name
        replaced = {os.path.join(bundle, f): os.path.join(str(tmp_path), "spare-%s-%s" % (name, f))
                    for f in ("dense.mindir", "table-0-rows.npy")}
        shutil.copyfile(os.path.join(other, "dense.mindir"), replaced[os.path.join(bundle, "dense.mindir")])
        rows = os.path.join(bundle, "table-0-rows.npy")
        np.save(replaced[rows], np.load(rows) + 1)                    # valid, the same shape, other rows
        opened = swap_on_first_open(monkeypatch, replaced)
        got = read(bundle)
        monkeypatch.undo()
        assert opened == set(replaced) and np.array_equal(got, want), name
        with pytest.raises(ValueError, match=r"dense.mindir|table-0-rows.npy"):
            read(bundle)                                             # now changed: refused by name


class Unexportable(nn.Cell):
    """A network graph mode compiles only in MindSpore's lax syntax (``asnumpy`` in construct), which
    ``mindspore.export`` refuses (it compiles in strict syntax)."""

    def __init__(self):
        super().__init__()
        self.table = rb.HashEmbedding(3, 32, access_threshold=1, use_dynamic_expansion=True, input_index=1,
                                      name="ids")
        self.out = nn.Dense(DENSE + FIELDS * 3, 1)

    def construct(self, dense, ids):
        rows = self.table(ids)
        x = ops.concat((dense, rows.reshape((rows.shape[0], -1))), 1)
        return self.out(x) * Tensor(np.tanh(x.asnumpy()).max())


def test_a_network_mindspore_cannot_export_is_named_and_nothing_changes(graph_mode, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                    # MindSpore writes its analyze_fail.ir under the working directory
    net = Unexportable()
    model = rb.RecModel(net)
    probe = next(_stream())
    net.set_train(True)
    syntax = ms.get_context("jit_syntax_level")
    target = str(tmp_path / "bundle")
    with pytest.raises(ValueError, match=r"For 'RecModel.export', the network test_mindir.Unexportable \('mindir'\) "
                                         r"must be a network mindspore.export writes as MindIR on its inputs "
                                         r"\(\[B, 4\] Float32, \[B, 5, 3\] Float32\), but got \"AttributeError: "
                                         r".*asnumpy"):
        model.export(target, mindir=(probe["dense"], probe["ids"]))
    assert not os.path.exists(target) and not [n for n in os.listdir(str(tmp_path)) if n.endswith(".bundle")]
    assert ms.get_context("jit_syntax_level") == syntax
    assert net.training and net.out.training                  # the train flags as they were
    assert model.export(target) == target                     # the model still exports (without MindIR)


# ---- OnlineExport(mindir=...): a MindIR in every bundle; serve.py follows a delta chain ------------------
def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def _served_here(serve, bundle, batch):
    """serve.py's prediction, in this process, for ``batch`` on ``bundle`` (its chain applied)."""
    manifest, tables, graph = serve["read_bundle"](bundle)
    return graph(*serve["network_inputs"](manifest, tables, batch)).asnumpy()


MINDIR_INPUTS = [{"name": "dense", "shape": [-1, DENSE], "dtype": "float32", "tables": []},
                 {"name": "ids", "shape": [-1, FIELDS, worker.DIM + 1], "dtype": "float32", "tables": [0]}]


@pytest.mark.slow
@pytest.mark.live_backend
def test_online_export_writes_a_mindir_into_every_bundle_and_serve_py_follows_the_delta_chain(backend, graph_mode,
                                                                                               tmp_path):
    """OnlineExport(mindir=True): the full bundle and each delta hold their own dense.mindir, its inputs
    from the first training batch (any batch size); serve.py, in a process that cannot import
    recboost, applies the chain full -> delta -> delta (evicted ids, changed and new rows, the default
    row) and predicts bit for bit as a Predictor following the same chain, and as the model at the end."""
    table, net = worker.network(0)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    exporter = rb.OnlineExport(str(tmp_path / "export"), every_steps=5, mindir=True)
    stream = _stream()
    model.online_train(itertools.islice(stream, 12), callbacks=[rb.EvictHook(evict_time_interval=3), exporter],
                       dataset_sink_mode=False)
    assert [os.path.basename(p) for p in exporter.paths] == ["bundle-000000005", "bundle-000000010",
                                                              "bundle-000000012"]
    manifests = [_manifest(p) for p in exporter.paths]
    assert [m["kind"] for m in manifests] == ["full", "delta", "delta"]
    for m in manifests:
        assert m["mindir"] == {"file": "dense.mindir", "inputs": MINDIR_INPUTS} and "dense.mindir" in m["files"]
    evicted = [np.load(os.path.join(p, m["tables"][0]["files"]["evicted"])) for p, m in
               zip(exporter.paths[1:], manifests[1:])]
    assert sum(e.size for e in evicted) > 0 and all(m["tables"][0]["rows"] > 0 for m in manifests)
    probe = next(stream)
    ids = probe["ids"].copy()
    ids.reshape(-1)[:evicted[0].size] = evicted[0][:ids.size]          # ids evicted on the way
    ids[-1] = UNKNOWN + np.arange(FIELDS)
    batch, small = (probe["dense"], ids), (probe["dense"][:3], ids[:3])

    predictor = rb.Predictor(worker.network(7)[1], exporter.paths[0])
    serve = _serve_here(tmp_path)
    for k, path in enumerate(exporter.paths):
        if k:
            predictor.apply(path)
        want = predictor.predict(*batch)
        assert np.array_equal(_served_here(serve, path, batch), want)
    assert np.array_equal(want, model.predict(*batch).asnumpy())
    chained = rb.Predictor(worker.network(8)[1], exporter.paths[-1])   # the chain followed from the last delta
    expected = [chained.predict(*batch), chained.predict(*small)]
    assert np.array_equal(expected[0], want)
    got = _serve_without_recboost(tmp_path, exporter.paths[-1], [batch, small])
    for out, want in zip(got, expected):
        assert out.dtype == want.dtype and out.shape == want.shape and np.array_equal(out, want)


def test_serve_py_refuses_a_damaged_base_and_a_delta_on_another_base(exported, tmp_path):
    """serve.py checks every bundle of a chain: a base's damaged file and a delta whose base path
    holds another bundle (its id differs) are refused, naming the bundle."""
    with_mindir, without, model, probe = exported
    base = _copy(with_mindir, tmp_path)
    delta = model.export(str(tmp_path / "delta"), base=base, mindir=(probe["dense"], probe["ids"]))
    serve = _serve_here(tmp_path)
    assert np.array_equal(_served_here(serve, delta, (probe["dense"], probe["ids"])),
                          model.predict(probe["dense"], probe["ids"]).asnumpy())
    os.rename(base, str(tmp_path / "kept"))
    import shutil
    shutil.copytree(without, base)                              # another bundle where the base was
    with pytest.raises(ValueError, match=r"delta: its base .*copy is not the bundle [0-9a-f]{32}"):
        serve["read_bundle"](delta)
    shutil.rmtree(base)
    os.rename(str(tmp_path / "kept"), base)
    rows = os.path.join(base, "table-0-rows.npy")
    os.chmod(rows, 0o600)
    with open(rows, "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    with pytest.raises(ValueError, match=r"copy: its file table-0-rows.npy is damaged"):
        serve["read_bundle"](delta)


@pytest.mark.slow
def test_online_export_takes_a_sample_batch_and_refuses_a_bad_one_before_training(graph_mode, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)                    # MindSpore writes its analyze_fail.ir under the working directory
    probe = next(_stream(seed=9))
    with pytest.raises(TypeError, match=r"For 'OnlineExport', 'mindir' must be True \(the first training batch\), "
                                        r"False, None or a sample batch of the inputs RecModel.predict takes .*, "
                                        r"but got 'dense.mindir'"):
        rb.OnlineExport(str(tmp_path / "export"), mindir="dense.mindir")
    _, net = worker.network(0)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    for bad in ((probe["dense"][:, :DENSE - 1], probe["ids"]), (probe["dense"],)):
        exporter = rb.OnlineExport(str(tmp_path / "export"), every_steps=2, mindir=bad)
        with pytest.raises(ValueError, match=r"For 'OnlineExport', 'mindir' must be a sample batch this model "
                                             r"predicts on \(the inputs RecModel.predict takes\), but got [\"']a batch "
                                             r"it refuses \(\w+: .+\)[\"']\.$"):
            model.online_train(itertools.islice(_stream(), 3), callbacks=exporter, dataset_sink_mode=False)
        assert model.step == 0 and not os.path.exists(str(tmp_path / "export"))
    sample = (probe["dense"][:2], probe["ids"][:2])
    exporter = rb.OnlineExport(str(tmp_path / "export"), every_steps=2, mindir=sample)
    stream = _stream()
    model.online_train(itertools.islice(stream, 3), callbacks=exporter, dataset_sink_mode=False)
    assert [_manifest(p)["mindir"]["inputs"] for p in exporter.paths] == [MINDIR_INPUTS] * 2
    assert sorted(os.listdir(str(tmp_path / "export"))) == ["bundle-000000002", "bundle-000000003"]   # no trial left
    batch = (probe["dense"], probe["ids"])
    assert np.array_equal(_served_here(_serve_here(tmp_path), exporter.paths[-1], batch),
                          model.predict(*batch).asnumpy())


def test_online_export_refuses_a_network_mindspore_cannot_export_before_it_trains(graph_mode, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)                    # MindSpore writes its analyze_fail.ir under the working directory
    net = Unexportable()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    export = tmp_path / "export"
    exporter = rb.OnlineExport(str(export), every_steps=1, mindir=True)
    with pytest.raises(ValueError, match=r"For 'OnlineExport', the network test_mindir.Unexportable \('mindir'\) "
                                         r"must be a network mindspore.export writes as MindIR on its inputs "
                                         r"\(\[B, 4\] Float32, \[B, 5, 3\] Float32\), but got \"AttributeError: "
                                         r".*asnumpy"):
        model.online_train(itertools.islice(_stream(), 3), callbacks=exporter, dataset_sink_mode=False)
    assert model.step == 0 and os.listdir(str(export)) == []          # nothing trained, no bundle, no trial left


@pytest.mark.slow
def test_a_mindir_that_cannot_be_written_is_a_failed_export_and_training_goes_on(graph_mode, tmp_path, monkeypatch):
    """ENOSPC while dense.mindir of step 6's bundle is written: counted and logged as a failed export,
    nothing of the bundle left; training goes on and step 8's bundle is a delta on step 3's, which
    serve.py serves as the model predicts."""
    logged, calls = [], []
    monkeypatch.setattr(rb, "_log", logged.append)
    real = ms.export

    def export(net, *inputs, **kwargs):
        calls.append(kwargs["file_name"])
        if len(calls) == 3:                            # the trial, step 3's bundle, then step 6's
            with open(kwargs["file_name"], "wb") as fh:
                fh.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(net, *inputs, **kwargs)
    monkeypatch.setattr(ms, "export", export)
    _, net = worker.network(0)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    folder = tmp_path / "export"
    exporter = rb.OnlineExport(str(folder), every_steps=3, mindir=True)
    stream = _stream()
    model.online_train(itertools.islice(stream, 8), callbacks=exporter, dataset_sink_mode=False)
    assert model.step == 8 and len(calls) == 4
    assert sorted(os.listdir(str(folder))) == ["bundle-000000003", "bundle-000000008"]
    assert exporter.paths == [str(folder / "bundle-000000003"), str(folder / "bundle-000000008")]
    (failure,) = exporter.failures
    assert exporter.failed_exports == 1 and failure["step"] == 6 and failure["path"] == str(folder / "bundle-000000006")
    assert re.fullmatch(r"\[Errno 28\] No space left on device: writing \d+ bytes to '%s/\.tmp-\d+-[0-9a-f]+\.bundle/"
                        r"dense\.mindir': the bundle '%s' was not written \(nothing of it is left\)" % (
                            re.escape(str(folder)), re.escape(failure["path"])), failure["error"]), failure["error"]
    assert [line for line in logged if "FAILED" in line] == [
        "OnlineExport: EXPORTING THE BUNDLE %s FAILED at step 6 (OSError: %s); nothing of it is left, training goes "
        "on, the next export point tries again (a delta on %s); 1 failed export(s) so far" % (
            failure["path"], failure["error"], exporter.paths[0])]
    last = _manifest(exporter.paths[-1])
    assert last["kind"] == "delta" and last["base"]["id"] == _manifest(exporter.paths[0])["id"]
    probe = next(stream)
    batch = (probe["dense"], probe["ids"])
    assert np.array_equal(_served_here(_serve_here(tmp_path), exporter.paths[-1], batch),
                          model.predict(*batch).asnumpy())


class OneBag(nn.Cell):
    """``construct(dense, tags)``: a multi-hot bag of ``tags`` (padding id 0) with ``combiner``, into one
    dense layer."""

    def __init__(self, combiner, seed=0):
        super().__init__()
        ms.set_seed(seed)
        self.tags = rb.HashEmbedding(TAG_DIM, 64, input_index=1, name="tags", combiner=combiner, padding_id=0,
                                     access_threshold=1, use_dynamic_expansion=True, seed=seed,
                                     optimizer=rb.SparseAdam(0.02))
        self.out = nn.Dense(DENSE + TAG_DIM, 1)

    def construct(self, dense, tags):
        return self.out(ops.concat((dense, self.tags(tags)), 1))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
@pytest.mark.live_backend
def test_every_combiner_weighted_or_not_served_by_serve_py_equals_predictor(backend, graph_mode, tmp_path, combiner):
    """Issue 61 item 5: docs/serving.md's serve.py, as written, pools a bag of each combiner as recboost does
    (it served "max" as a sum): padded and ragged, unweighted and weighted (ties, an empty bag, unknown ids,
    weights of 0, 1e20 and 1e-25), bit for bit as a Predictor of the bundle."""
    rng = np.random.default_rng(11)
    batches = [(rng.standard_normal((BATCH, DENSE)).astype(np.float32), rng.integers(0, 40, (BATCH, TAGS)),
                (rng.random((BATCH, 1)) < 0.3).astype(np.float32)) for _ in range(8)]
    net = OneBag(combiner)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    model.online_train(batches, dataset_sink_mode=False)
    dense, tags = rng.standard_normal((6, DENSE)).astype(np.float32), rng.integers(1, 40, (6, TAGS))
    tags[0] = 0                                               # an empty bag: padding only
    tags[1] = [0, 5, 0, UNKNOWN]                              # padding, a known and an unknown tag
    tags[2] = [7, 7, 7, 7]                                    # one tag four times (max: a tie, the first)
    weights = rng.uniform(0.1, 2.0, tags.shape).astype(np.float32) * (1 if combiner == "mean" else
                                                                       rng.choice([-1, 1], tags.shape))
    weights[3] = [1e20, 2e20, 0, 3e19]                        # huge, and a weight of 0
    weights[4] = [1e-25, 3e-25, 2e-25, 0]                     # tiny
    weights = weights.astype(np.float32)
    values, offsets = np.array([5, 0, UNKNOWN, 7, 9, 7, 11], np.int64), np.array([0, 3, 3, 7], np.int64)
    ragged_weights = np.array([0.5, 2.0, 1.0, 3.0, 1e20, 0.0, 1e-25], np.float32)
    bundle = model.export(str(tmp_path / "bundle"), mindir=(dense, tags))
    predictor = rb.Predictor(OneBag(combiner, seed=5), bundle)
    serve = _serve_here(tmp_path)
    manifest, tables, graph = serve["read_bundle"](bundle)
    assert tables[0]["combiner"] == combiner
    cases = [((dense, tags), (dense, tags)),
             ((dense[:3], (values, offsets)), (dense[:3], (values, offsets))),
             ((dense, rb.WeightedIds(tags, weights)), (dense, {"ids": tags, "weights": weights})),
             ((dense[:3], rb.WeightedIds(values, ragged_weights, offsets)),
              (dense[:3], {"ids": values, "weights": ragged_weights, "offsets": offsets}))]
    for mine, theirs in cases:
        want = predictor.predict(*mine)
        got = graph(*serve["network_inputs"](manifest, tables, theirs)).asnumpy()
        assert got.shape == want.shape and np.isfinite(want).all()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
