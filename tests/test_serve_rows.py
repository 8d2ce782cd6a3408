"""Serving rows of another dtype: ``RecModel.export(..., row_dtype="int8" | "float16")`` (format 3), read
back and dequantized by Predictor as docs/serving.md states the formula, along delta chains; damaged
scale and bias files refused by name; OnlineExport's and ``train``'s option. One model (Wide&Deep(4, 6,
16, (16,)) over a 1024-row table of width 17), trained on the synthetic stream, exported at steps 5 and
10 in each dtype, once for the module."""
import hashlib
import itertools
import json
import os
import shutil

import numpy as np
import pytest

import recboost as rb

DIM = 17
DTYPES = ("float32", "float16", "int8")


def _build(seed=0):
    import mindspore as ms
    ms.set_seed(seed)
    table = rb.HashEmbedding(DIM, 1024, access_threshold=1, use_dynamic_expansion=True, input_index=1, name="ids")
    return rb.WideDeep(4, 6, DIM - 1, (16,), embedding=table)


def _stream(seed, batch_size=256):
    return iter(rb.SyntheticClickStream(num_dense=4, num_sparse=6, vocab_sizes=[300] * 6, batch_size=batch_size,
                                        seed=seed))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``root``: per dtype ``<dtype>`` (a full bundle at step 5), ``<dtype>-d`` (a delta on it at step 10)
    and ``<dtype>-full10`` (a full bundle at step 10); ``batch`` (dense, ids) of the training stream
    (ids that own rows); ``model`` at step 10."""
    import mindspore as ms
    from mindspore import nn
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)          # (its mode restored after the module)
    ms.set_device("CPU")                        # before any kernel runs (train_job sets it again)
    root = tmp_path_factory.mktemp("rows")
    net = _build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    stream = _stream(0)
    model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
    for dtype in DTYPES:
        model.export(str(root / dtype), row_dtype=dtype)
    model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
    dense, ids, _ = next(_stream(0, 64))
    model.export(str(root / "int8-mindir"), row_dtype="int8", mindir=(dense, ids))
    for dtype in DTYPES:
        model.export(str(root / (dtype + "-d")), base=str(root / dtype), row_dtype=dtype)
        model.export(str(root / (dtype + "-full10")), row_dtype=dtype)
    model.export(str(root / "int8-mindir-d"), base=str(root / "int8-mindir"), row_dtype="int8", mindir=(dense, ids))
    yield type("Exported", (), dict(root=root, batch=(dense, ids), model=model))
    ms.set_context(mode=old)


def _manifest(path):
    with open(os.path.join(path, "manifest.json"), "rb") as fh:
        return json.loads(fh.read())


def _numpy_int8(path, i=0):
    """The rows of table ``i`` of an int8 bundle as docs/serving.md says to compute them, in numpy."""
    q, scale, bias = (np.load(os.path.join(path, "table-%d-%s.npy" % (i, part))) for part in ("rows", "scale", "bias"))
    assert q.dtype == np.uint8 and scale.dtype == bias.dtype == np.float32
    return q.astype(np.float32) * scale[:, None] + bias[:, None], scale


def _served(path, seed=1):
    predictor = rb.Predictor(_build(seed), str(path))
    return predictor, predictor.network.embedding.cache


def test_int8_rows_are_within_half_a_scale_and_the_files_are_small(exported):
    """An int8 bundle (format 3, row_dtype 'int8') holds uint8 rows and a float32 scale and bias per row;
    each dequantized value is within scale / 2 of the float32 bundle's (up to float32's rounding of the
    formula); the rows file is at most 0.3x the float32 rows file; Predictor serves exactly the
    documented formula's rows."""
    root = exported.root
    manifest = _manifest(root / "int8")
    assert manifest["format"] == 3 and manifest["row_dtype"] == "int8"
    assert set(manifest["tables"][0]["files"]) == {"ids", "rows", "default", "scale", "bias"}
    assert {"table-0-scale.npy", "table-0-bias.npy"} <= set(manifest["files"])
    assert _manifest(root / "float32")["format"] == 2 and "row_dtype" not in _manifest(root / "float32")
    exact = np.load(root / "float32" / "table-0-rows.npy")
    rows, scale = _numpy_int8(root / "int8")
    assert np.array_equal(np.load(root / "int8" / "table-0-ids.npy"), np.load(root / "float32" / "table-0-ids.npy"))
    err = np.abs(rows - exact)
    rounding = 2.0 ** -23 * (np.abs(exact) + 255 * scale[:, None])
    assert (err <= scale[:, None] / 2 + rounding).all()
    assert (scale > 0).all() and err.max() > 0           # really quantized
    size = os.path.getsize(root / "int8" / "table-0-rows.npy") / os.path.getsize(root / "float32" / "table-0-rows.npy")
    assert size <= 0.3
    _, cache = _served(root / "int8")
    assert cache.rows.tobytes() == rows.tobytes()        # bit for bit the formula
    assert np.array_equal(cache.weight[0], np.load(root / "int8" / "table-0-default.npy"))     # default: float32


def test_float16_rows_are_the_float32_rows_rounded(exported):
    root = exported.root
    manifest = _manifest(root / "float16")
    assert manifest["format"] == 3 and manifest["row_dtype"] == "float16"
    stored = np.load(root / "float16" / "table-0-rows.npy")
    assert stored.dtype == np.float16
    exact = np.load(root / "float32" / "table-0-rows.npy")
    assert np.array_equal(stored, exact.astype(np.float16))
    _, cache = _served(root / "float16")
    assert cache.rows.tobytes() == stored.astype(np.float32).tobytes()


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_predictor_is_the_network_on_the_dequantized_rows(exported, dtype):
    """Predictor on a bundle of ``dtype`` predicts what the float32 bundle's network gives with the
    numpy-dequantized rows put in place of its rows, bit for bit; and not what float32 rows give."""
    root = exported.root
    quantized, _ = _served(root / dtype)
    reference, cache = _served(root / "float32", seed=2)
    exact = reference.predict(*exported.batch)
    cache.rows[...] = _numpy_int8(root / dtype)[0] if dtype == "int8" else \
        np.load(root / dtype / "table-0-rows.npy").astype(np.float32)
    got = quantized.predict(*exported.batch)
    assert got.tobytes() == reference.predict(*exported.batch).tobytes()
    assert 0 < np.abs(got - exact).max() < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_delta_chain_keeps_its_row_dtype_and_equals_a_full_export(exported, dtype):
    """A delta of an int8 (float16) base is int8 (float16), holds only the rows whose served value changed,
    and base + delta serve bit for bit what a full export at the same step serves."""
    root = exported.root
    delta = _manifest(root / (dtype + "-d"))
    assert delta.get("row_dtype", "float32") == dtype and delta["kind"] == "delta"
    chain, chain_cache = _served(root / (dtype + "-d"))
    full, full_cache = _served(root / (dtype + "-full10"), seed=2)
    assert np.array_equal(chain_cache.ids, full_cache.ids)
    assert chain_cache.weight.tobytes() == full_cache.weight.tobytes()
    assert chain.predict(*exported.batch).tobytes() == full.predict(*exported.batch).tobytes()
    base, _ = _served(root / dtype, seed=3)
    base.apply(str(root / (dtype + "-d")))
    assert base.predict(*exported.batch).tobytes() == full.predict(*exported.batch).tobytes() and base.step == 10


def test_a_delta_of_another_row_dtype_is_refused(exported, tmp_path):
    """export(base=an int8 bundle, row_dtype='float32') is refused, nothing written; so is OnlineExport
    with another row_dtype than its base's, at train start."""
    root = exported.root
    target = tmp_path / "mixed"
    with pytest.raises(ValueError) as info:
        exported.model.export(str(target), base=str(root / "int8"))
    assert str(info.value) == "For 'RecModel.export', 'row_dtype' must be 'int8' (the row dtype of the base %r " \
        "('base'): a chain of bundles has one), but got 'float32'." % str(root / "int8")
    assert not target.exists()
    online = tmp_path / "online"
    online.mkdir()
    shutil.copytree(root / "int8", online / "bundle-000000005")
    with pytest.raises(ValueError) as info:
        exported.model.train(1, list(itertools.islice(_stream(4), 1)), dataset_sink_mode=False,
                             callbacks=rb.OnlineExport(str(online), 100, row_dtype="float16"))
    assert "For 'OnlineExport', 'row_dtype' must be 'int8' (the row dtype of the base %r: a chain of bundles has " \
        "one), but got 'float16'." % str(online / "bundle-000000005") in str(info.value)
    with pytest.raises(ValueError, match=r"'row_dtype' must be one of \['float32', 'float16', 'int8'\], but got "
                                         r"'int4'"):
        rb.OnlineExport(str(online), row_dtype="int4")


def _sha(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _signed(manifest):
    """The bytes of ``manifest`` with its checksum, as docs/serving.md states it: the sha256 of the other
    fields in canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return json.dumps(dict(manifest, sha256=hashlib.sha256(canonical).hexdigest())).encode()


def _resign(bundle, name):
    """List the file ``name`` of ``bundle`` again with its size and sha256, the manifest's checksum made again
    (a deliberate edit, which the checks after the checksums must catch)."""
    manifest = _manifest(bundle)
    manifest.pop("sha256")
    manifest["files"][name] = {"bytes": os.path.getsize(os.path.join(bundle, name)),
                               "sha256": _sha(os.path.join(bundle, name))}
    with open(os.path.join(bundle, "manifest.json"), "wb") as fh:
        fh.write(_signed(manifest))


@pytest.mark.parametrize("part", ["scale", "bias"])
def test_damaged_scale_and_bias_files_are_refused_by_name(exported, tmp_path, part):
    """A flipped byte of table-0-scale.npy (bias) is refused by its sha256, naming the file; a NaN written
    there with the manifest signed again is refused by its value; a negative scale too."""
    name = "table-0-%s.npy" % part
    bundle = tmp_path / "b"
    shutil.copytree(exported.root / "int8", bundle)
    path = bundle / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^For 'Predictor', the file %r of the bundle %r \('directory'\) must be "
                                         r"\d+ bytes with sha256 [0-9a-f]{64}, but got 'sha256 [0-9a-f]{64} "
                                         r"\(altered\)'\.$" % (name, str(bundle))):
        _served(bundle)
    values = np.load(exported.root / "int8" / name)
    values[7] = np.nan if part == "bias" else -values[7]
    np.save(path, values)
    _resign(bundle, name)
    expected = "finite scales >= 0" if part == "scale" else "finite biases"
    with pytest.raises(ValueError) as info:
        _served(bundle)
    assert str(info.value) == "For 'Predictor', the file %r (hash table 0 'ids') of the bundle %r ('directory') " \
        "must be %s, but got '1 other values'." % (name, str(bundle), expected)


@pytest.mark.parametrize("dtype, part", [("float32", "rows"), ("float16", "rows"), ("int8", "scale"),
                                         ("float32", "default")])
def test_rows_edited_to_nan_or_infinity_with_the_checksums_remade_are_refused_naming_the_file(
        exported, tmp_path, dtype, part):
    """A bundle whose rows (or default row) were edited to NaN or infinity, their sha256 and the manifest's
    checksum made again, was served: NaN scores, and a server's JSON answered 500. Now the reader refuses it,
    naming the file: float32 NaN, float16 infinity, an int8 scale of 1e38 (finite, but its rows dequantize to
    infinity), a NaN default row; a delta so edited is refused by Predictor.apply, which keeps serving."""
    name = "table-0-%s.npy" % part
    for source in (dtype, dtype + "-d"):
        bundle = tmp_path / source
        shutil.copytree(exported.root / source, bundle)
        values = np.load(bundle / name)
        values.reshape(-1)[5] = {"float32": np.nan, "float16": np.inf, "int8": 1e38}[dtype]
        np.save(bundle / name, values)
        _resign(bundle, name)
    bad = "the file %r (hash table 0 'ids') of the bundle %r ('%s') must be finite values, as an export writes " \
          "them, but got 'non-finite values%s'." % ("table-0-%s.npy" % ("rows" if part == "scale" else part), "%s",
                                                      "%s", " once dequantized" if dtype == "int8" else "")
    with pytest.raises(ValueError) as info:
        _served(tmp_path / dtype)
    assert str(info.value) == "For 'Predictor', " + bad % (str(tmp_path / dtype), "directory")
    predictor, _ = _served(exported.root / dtype)
    before = predictor.predict(*exported.batch)
    with pytest.raises(ValueError) as info:
        predictor.apply(str(tmp_path / (dtype + "-d")))
    assert str(info.value) == "For 'Predictor.apply', " + bad % (str(tmp_path / (dtype + "-d")), "delta_directory")
    assert predictor.predict(*exported.batch).tobytes() == before.tobytes()


def test_row_dtype_and_format_must_agree(exported, tmp_path):
    """A format-3 manifest without row_dtype, and a format-2 one naming int8, are refused by name; a
    reader of format 2 alone refuses a format-3 bundle by its format (what an older recboost does)."""
    for source, edit, message in (
            ("int8", lambda m: m.pop("row_dtype"), "must be 'float16' or 'int8' in a bundle of format 3, but got "
                                                   "'missing'."),
            ("int8", lambda m: m.update(format=2), "must be absent or 'float32' in a bundle of format 2, but got "
                                                   "'int8'.")):
        bundle = tmp_path / ("edited-%d" % len(list(tmp_path.iterdir())))
        shutil.copytree(exported.root / source, bundle)
        manifest = _manifest(bundle)
        manifest.pop("sha256")
        edit(manifest)
        (bundle / "manifest.json").write_bytes(_signed(manifest))
        with pytest.raises(ValueError) as info:
            _served(bundle)
        assert str(info.value) == "For 'Predictor', the manifest field 'row_dtype' of the bundle %r ('directory') " \
            % str(bundle) + message


def test_rows_that_do_not_fit_are_refused_and_nothing_is_written(exported, tmp_path):
    """A row beyond float16's range (float16), or not finite (int8), is a ValueError naming the table;
    nothing of the bundle is written. The bad argument is refused by name."""
    model = exported.model
    table = model.tables[0]
    weight = table.store.weight
    saved = weight[5].copy()
    try:
        weight[5, 3] = 1e5
        with pytest.raises(ValueError, match=r"^For 'RecModel.export', the rows of hash table 0 'ids' must be values "
                                             r"within float16's range .*, but got 'a value of 100000.0'\.$"):
            model.export(str(tmp_path / "f16"), row_dtype="float16")
        weight[5, 3] = np.inf
        with pytest.raises(ValueError, match=r"^For 'RecModel.export', the rows of hash table 0 'ids' must be finite "
                                             r"numbers \(row_dtype='int8'\), but got 'non-finite values'\.$"):
            model.export(str(tmp_path / "i8"), row_dtype="int8")
    finally:
        weight[5] = saved
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"'row_dtype' must be one of \['float32', 'float16', 'int8'\], but got "
                                         r"'bfloat16'\."):
        model.export(str(tmp_path / "x"), row_dtype="bfloat16")


def test_int8_edge_rows(exported, tmp_path):
    """A constant row comes back exactly (scale 0), rows of values near 1e3 and near 1e-30 stay within half
    their scale (up to float32's rounding of the formula)."""
    weight = exported.model.tables[0].store.weight
    saved = weight[5:8].copy()
    rng = np.random.default_rng(0)
    try:
        weight[5] = 0.25
        weight[6] = rng.normal(0, 1e3, DIM).astype(np.float32)
        weight[7] = rng.normal(0, 1e-30, DIM).astype(np.float32)
        exact = weight[5:8].copy()
        bundle = exported.model.export(str(tmp_path / "edges"), row_dtype="int8")
        float32 = exported.model.export(str(tmp_path / "edges32"))
    finally:
        weight[5:8] = saved
    rows, scale = _numpy_int8(bundle)
    at = [int(np.flatnonzero((np.load(os.path.join(float32, "table-0-rows.npy")) == row).all(axis=1))[0])
          for row in exact]
    assert np.array_equal(rows[at[0]], exact[0]) and scale[at[0]] == 0
    err = np.abs(rows[at] - exact)
    rounding = 2.0 ** -23 * (np.abs(exact) + 255 * scale[at][:, None]) + 1e-44
    assert (err <= scale[at][:, None] / 2 + rounding).all() and scale[at[1]] > 1 and 0 < scale[at[2]] < 1e-29


@pytest.mark.parametrize("bundle", ["int8-mindir", "int8-mindir-d"])
def test_the_docs_numpy_reader_dequantizes_int8_bundles(exported, tmp_path, bundle):
    """docs/serving.md's serve.py (no recboost in it) serves an int8 bundle and an int8 delta's chain bit
    for bit as Predictor does."""
    from test_readme import _example
    scope = {}
    exec(compile(_example("docs/serving.md", "## Serving without recboost"), "serve.py", "exec"), scope)  # noqa: S102
    manifest, tables, network = scope["read_bundle"](str(exported.root / bundle))
    assert manifest["row_dtype"] == "int8"
    got = network(*scope["network_inputs"](manifest, tables, list(exported.batch))).asnumpy()
    predictor, cache = _served(exported.root / bundle)
    assert tables[0]["rows"].tobytes() == cache.rows.tobytes()
    assert got.tobytes() == predictor.predict(*exported.batch).tobytes()


def test_train_export_row_dtype(tmp_path, capsys):
    """``train --export DIR --export-row-dtype int8``: every bundle of the chain is int8 (format 3), and a
    Predictor serves its last delta; without --export the option is refused (exit code 2), as is an
    unknown dtype."""
    import re
    import mindspore as ms
    from test_train_cli import BS, _lines
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 4 + 5)))
    export = tmp_path / "export"
    assert rb.main(["train", "--data", str(path), "--batch-size", str(BS), "--export", str(export), "--export-every",
                    "2", "--export-row-dtype", "int8", "--capacity", "4096", "--progress-seconds", "1000"]) == 0
    names = sorted(n for n in os.listdir(export) if n.startswith("bundle-"))
    assert names == ["bundle-000000002", "bundle-000000004", "bundle-000000005"]
    assert [(_manifest(export / n)["format"], _manifest(export / n)["row_dtype"]) for n in names] == [(3, "int8")] * 3
    ms.set_seed(3)
    table = rb.HashEmbedding(17, 64, use_dynamic_expansion=True, input_index=1, name="ids")
    assert rb.Predictor(rb.WideDeep(13, 26, 16, (400, 400), embedding=table), str(export / names[-1])).step == 5
    capsys.readouterr()
    for args, message in ((["--export-row-dtype", "int8"], r"For 'recboost train', 'export_row_dtype' must be "
                           r"'float32' without 'export' \(the rows of the exported bundles\), but got 'int8'\.$"),
                          (["--export", str(tmp_path / "x"), "--export-row-dtype", "int4"],
                           r"argument --export-row-dtype: invalid choice: 'int4'")):
        with pytest.raises(SystemExit) as exited:
            rb.main(["train", "--data", str(path), "--batch-size", str(BS)] + args)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "Traceback" not in err and re.search(message, err, re.M), err
