"""Data: the synthetic click stream and the Criteo reader (parse_criteo on both backends)."""
import gzip
import io
import logging
import time

import numpy as np
import pytest

import recboost

ND, NS = 13, 26


# ---- helpers ----------------------------------------------------------------------------------------
def _line(label="1", dense=None, cats=None):
    dense = [str(i) for i in range(ND)] if dense is None else dense
    cats = ["%08x" % (0x1000 * (f + 1)) for f in range(NS)] if cats is None else cats
    return "\t".join([label] + list(dense) + list(cats))


def _expected_ids(cats):
    """Independent of the parser: the documented hash of each hex value, or the missing id."""
    return np.array([recboost._missing_feature_id(f, NS) if c == "" else
                     recboost._hash_feature(f, np.uint64(int(c, 16)), NS)
                     for f, c in enumerate(cats)], dtype=np.int64)


def _read_all(reader):
    batches = list(reader)
    return [np.concatenate(col) for col in zip(*batches)] if batches else None


# ---- synthetic stream -------------------------------------------------------------------------------
def test_stream_shapes_dtypes_and_ranges():
    s = recboost.SyntheticClickStream(seed=0, batch_size=512, with_probability=True, with_timestamp=True)
    dense, ids, label, prob, ts = next(s)
    assert dense.dtype == np.float32 and dense.shape == (512, ND)
    assert ids.dtype == np.int64 and ids.shape == (512, NS)
    assert label.dtype == np.float32 and label.shape == (512, 1)
    assert prob.dtype == np.float32 and prob.shape == (512, 1)
    assert ts.dtype == np.int64 and ts.shape == ()
    assert np.all(np.isfinite(dense)) and np.all(ids >= 1)
    assert set(np.unique(label)) == {0.0, 1.0}
    assert np.all((prob > 0) & (prob < 1))
    # missing values: dense zeros and the documented per-field missing ids both occur
    assert 0.05 < np.mean(dense == 0) < 0.6
    missing = recboost._missing_feature_id(np.arange(NS), NS)
    assert np.any(ids == missing)
    # fields do not share ids
    per_field = [set(ids[:, f].tolist()) for f in range(NS)]
    assert sum(len(x) for x in per_field) == len(set().union(*per_field))
    # data time advances with the rows: 2048 rows per second by default
    later = [int(next(s)[4]) - int(ts) for _ in range(4)]      # batches at rows 512 ... 2048
    assert later == [0, 0, 0, 1]


def test_stream_is_deterministic_and_seeded():
    a = recboost.SyntheticClickStream(seed=7, batch_size=1000).take(3)
    b = recboost.SyntheticClickStream(seed=7, batch_size=1000).take(3)
    c = recboost.SyntheticClickStream(seed=8, batch_size=1000).take(3)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert u.tobytes() == v.tobytes()
    assert not np.array_equal(a[0][1], c[0][1])
    assert not np.array_equal(a[0][0], c[0][0])
    # the stream is a function of the row index: batch size and resume point do not matter
    big = recboost.SyntheticClickStream(seed=7, batch_size=3000).take(1)[0]
    for col in range(3):
        assert np.array_equal(np.concatenate([x[col] for x in a]), big[col])
    resumed = recboost.SyntheticClickStream(seed=7, batch_size=1000, start_row=1000)
    assert np.array_equal(next(resumed)[1], a[1][1])
    s = recboost.SyntheticClickStream(seed=7, batch_size=1000, num_batches=2)
    assert len(list(s)) == 2 and s.position() == {"rows": 2000}
    s.seek(1000)
    assert s.num_batches == 2 and s.position() == {"rows": 1000}


def test_stream_oracle_auc_and_click_rate():
    s = recboost.SyntheticClickStream(seed=0)
    oracle = s.oracle_auc(num_rows=200_000)
    assert 0.74 <= oracle <= 0.80
    assert s.position() == {"rows": 0}                                  # oracle_auc does not advance
    label = np.concatenate([b[2] for b in s.take(40)])
    assert 0.23 < label.mean() < 0.27                                   # ctr=0.25
    # the click model is stationary although the ids drift (after 30M rows nearly all are new)
    late = recboost.SyntheticClickStream(seed=0, batch_size=100_000, start_row=30_000_000)
    assert abs(late.oracle_auc(num_rows=200_000) - oracle) < 0.01
    assert 0.23 < next(late)[2].mean() < 0.27
    # the probabilities are the ones that drew the labels: calibrated by decile
    s = recboost.SyntheticClickStream(seed=1, with_probability=True, batch_size=65536)
    _, _, y, p = next(s)
    order = np.argsort(p.ravel())
    for part in np.array_split(order, 10):
        assert abs(y.ravel()[part].mean() - p.ravel()[part].mean()) < 0.02


def _seen_fraction(seed, drift, field, row):
    """Fraction of the distinct ids of ``field`` in 60K rows from ``row`` also seen in the first 60K."""
    base = recboost.SyntheticClickStream(seed=seed, drift=drift, batch_size=60_000)
    early = set(next(base)[1][:, field].tolist())
    late = next(recboost.SyntheticClickStream(seed=seed, drift=drift, batch_size=60_000, start_row=row))
    return np.mean([i in early for i in set(late[1][:, field].tolist())])


def test_stream_drift_replaces_ids():
    # field 0 has 1000 slots (60K rows see nearly all): without drift the same ids stay; with
    # drift=0.05 per million rows a slot has a new id after 4M rows with probability 0.2 (speeds
    # 0.5-1.5, uniform phases), after 30M rows with probability 0.98
    assert _seen_fraction(0, 0.0, 0, 4_000_000) > 0.97
    assert 0.74 < _seen_fraction(0, 0.05, 0, 4_000_000) < 0.86
    assert _seen_fraction(0, 0.05, 0, 30_000_000) < 0.06


def test_stream_ground_truth_is_learnable_by_a_linear_model():
    """A per-id logistic regression (the 'wide' half of Wide&Deep) trained online with Adagrad on
    300 batches already gets close to the oracle; the rest is the interactions and the rare ids."""
    s = recboost.SyntheticClickStream(seed=2, batch_size=2048, with_probability=True)
    table = 1 << 22
    w, g2 = np.zeros(table), np.full(table, 1e-6)
    wd, gd2 = np.zeros(ND + 1), np.full(ND + 1, 1e-6)
    ys, qs, ps = [], [], []
    for step in range(300):
        dense, ids, y, p = next(s)
        x = np.hstack([dense, np.ones((dense.shape[0], 1), np.float32)])
        idx = ids % table
        q = 1 / (1 + np.exp(-(w[idx].sum(1) + x @ wd)))
        if step >= 250:                       # progressive validation: scored before the update
            ys.append(y.ravel()), qs.append(q), ps.append(p.ravel())
        g = q - y.ravel()
        uniq, inv = np.unique(idx.ravel(), return_inverse=True)
        gi = np.bincount(inv, weights=np.repeat(g, NS))
        g2[uniq] += gi ** 2
        w[uniq] -= 0.1 * gi / np.sqrt(g2[uniq])
        gd = x.T @ g
        gd2 += gd ** 2
        wd -= 0.1 * gd / np.sqrt(gd2)
    y, q, p = map(np.concatenate, (ys, qs, ps))
    model, oracle = recboost.roc_auc(y, q), recboost.roc_auc(y, p)
    assert model > 0.70 and oracle - model < 0.06, (model, oracle)


def test_stream_argument_errors():
    with pytest.raises(TypeError, match="For 'SyntheticClickStream', 'seed' must be an int"):
        recboost.SyntheticClickStream(seed=1.5)
    with pytest.raises(ValueError, match="'vocab_sizes' must be a list of 26 ints"):
        recboost.SyntheticClickStream(vocab_sizes=[10, 20])
    with pytest.raises(ValueError, match="'ctr' must be a number in \\(0, 1\\)"):
        recboost.SyntheticClickStream(ctr=1.0)
    with pytest.raises(ValueError, match="'batch_size' must be an int >= 1"):
        recboost.SyntheticClickStream(batch_size=0)
    small = recboost.SyntheticClickStream(num_dense=2, num_sparse=3, vocab_sizes=[5, 6, 7], batch_size=4)
    dense, ids, label = next(small)
    assert dense.shape == (4, 2) and ids.shape == (4, 3) and label.shape == (4, 1)


# ---- Criteo round trip ------------------------------------------------------------------------------
def test_write_criteo_then_read_gives_the_stream(tmp_path, backend):
    path = tmp_path / "day.txt"
    s = recboost.SyntheticClickStream(seed=4, batch_size=5000, start_row=3000)
    s.write_criteo(path, 5000, start_row=3000)
    dense, ids, label = next(s)
    reader = recboost.CriteoReader(str(path), batch_size=1024, chunk_bytes=50_000)
    got = list(reader)
    assert [b[0].shape[0] for b in got] == [1024] * 4 + [904]
    rd, ri, rl = [np.concatenate(c) for c in zip(*got)]
    assert rd.tobytes() == dense.tobytes() and ri.tobytes() == ids.tobytes()
    assert rl.tobytes() == label.tobytes()
    st = reader.stats()
    assert st["lines"] == 5000 and st["rows"] == 5000 and st["rows_yielded"] == 5000
    assert sum(st["malformed"].values()) == 0
    # empty fields are written for missing values, 8 hex digits otherwise
    text = path.read_text().splitlines()
    fields = [ln.split("\t") for ln in text]
    assert all(len(f) == 1 + ND + NS for f in fields)
    assert any(f[1 + ND + k] == "" for f in fields for k in range(NS))
    assert all(len(c) in (0, 8) for f in fields for c in f[1 + ND:])


# ---- parser: the malformed-line table, both backends --------------------------------------------------
GOOD_CATS = ["%x" % (0xABC + f) for f in range(NS)]
MALFORMED = [                 # (reason, line)
    ("field_count", ""),
    ("field_count", _line()[:-9]),                                    # one categorical too few
    ("field_count", _line() + "\t"),                                  # one field too many
    ("field_count", "1\t2\t3"),
    ("field_count", _line(label="x")[:-9]),                           # count wins over a bad label
    ("label", _line(label="2")),
    ("label", _line(label="")),
    ("label", _line(label="01")),
    ("label", _line(label="-1")),
    ("dense", _line(dense=["1.5"] + ["1"] * 12)),
    ("dense", _line(dense=["1"] * 12 + ["abc"])),
    ("dense", _line(dense=["-"] + ["1"] * 12)),
    ("dense", _line(dense=["1 "] + ["1"] * 12)),
    ("dense", _line(dense=["9223372036854775808"] + ["1"] * 12)),    # int64 max + 1
    ("dense", _line(dense=["1" * 20] + ["1"] * 12)),                 # 20 digits
    ("dense", _line(dense=["0x10"] + ["1"] * 12)),
    ("categorical", _line(cats=GOOD_CATS[:-1] + ["xyz"])),
    ("categorical", _line(cats=["0x1f"] + GOOD_CATS[1:])),
    ("categorical", _line(cats=["1" * 17] + GOOD_CATS[1:])),          # more than 64 bits
    ("categorical", _line(cats=["a b"] + GOOD_CATS[1:])),
    ("categorical", _line(cats=GOOD_CATS[:-1] + ["\xff"])),
]
EDGE_DENSE = ["-9223372036854775808", "9223372036854775807", "+5", "-3", "0007", "1234567890123456789"]
GOOD = [                      # (line, label, raw dense, cats)
    (_line("0", ["1"] * 13, GOOD_CATS), 0, [1] * 13, GOOD_CATS),
    (_line("1", [""] * 13, [""] * NS), 1, [0] * 13, [""] * NS),
    (_line("1", EDGE_DENSE + [""] * 7, ["FFFFFFFFFFFFFFFF", "0", "DeadBeef"] + GOOD_CATS[3:]),
     1, [-2 ** 63, 2 ** 63 - 1, 5, -3, 7, 1234567890123456789] + [0] * 7,
     ["FFFFFFFFFFFFFFFF", "0", "DeadBeef"] + GOOD_CATS[3:]),
]


def test_parser_table_of_malformed_lines(backend):
    lines, expect_rows = [], []
    for i, (_, bad) in enumerate(MALFORMED):
        lines.append(bad)
        good = GOOD[i % len(GOOD)]
        lines.append(good[0])
        expect_rows.append(good)
    buf = ("\n".join(lines) + "\n").encode("latin-1")
    labels, dense, ids, status, line_end = backend.parse_criteo(buf, ND, NS)
    reasons = recboost._CRITEO_REASONS
    assert [reasons[c] for c in status[0::2]] == [r for r, _ in MALFORMED]
    assert np.all(status[1::2] == 0)
    assert labels.tolist() == [g[1] for g in expect_rows]
    assert dense.tolist() == [g[2] for g in expect_rows]
    assert np.array_equal(ids, np.stack([_expected_ids(g[3]) for g in expect_rows]))
    assert line_end.tolist() == np.cumsum([len(ln.encode("latin-1")) + 1 for ln in lines]).tolist()


def test_parser_line_endings_and_last_line(backend):
    good = GOOD[2][0]
    ref = backend.parse_criteo((good + "\n").encode(), ND, NS)
    for buf in [(good + "\r\n").encode(), good.encode(), (good + "\r").encode()]:
        out = backend.parse_criteo(buf, ND, NS)
        assert out[3].tolist() == [0] and out[4].tolist() == [len(buf)]
        for a, b in zip(out[:3], ref[:3]):
            assert np.array_equal(a, b)
    empty = backend.parse_criteo(b"", ND, NS)
    assert [x.shape for x in empty] == [(0,), (0, ND), (0, NS), (0,), (0,)]
    assert backend.parse_criteo(b"\n\n", ND, NS)[3].tolist() == [1, 1]


def test_reader_counts_and_reports_malformed_lines(tmp_path, backend, caplog):
    lines = []
    for i, (_, bad) in enumerate(MALFORMED):
        lines += [GOOD[i % 3][0], bad]
    lines.append("0\t" + "9" * 5000)                      # longer than max_line_bytes below
    lines.append(GOOD[0][0])
    path = tmp_path / "bad.txt"
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="recboost"):
        reader = recboost.CriteoReader(path, batch_size=8, chunk_bytes=700, max_line_bytes=2000,
                                       max_warnings=3)
        rows = _read_all(reader)
    st = reader.stats()
    expect = {r: sum(1 for reason, _ in MALFORMED if reason == r) for r in recboost._CRITEO_REASONS[1:]}
    expect["too_long"] = 1
    assert st["malformed"] == expect
    assert st["lines"] == len(lines) and st["rows"] == st["rows_yielded"] == len(MALFORMED) + 1
    assert rows[2].ravel().tolist() == [GOOD[i % 3][1] for i in range(len(MALFORMED))] + [GOOD[0][1]]
    assert np.all(np.isfinite(rows[0]))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 3
    assert msgs[0].startswith("CriteoReader: line 2 skipped (field_count)")
    assert "line 4 skipped" in msgs[1] and "only counted in stats()" in msgs[2]


def test_reader_chunking_drop_remainder_and_sources(tmp_path, backend):
    path = tmp_path / "d.txt"
    recboost.SyntheticClickStream(seed=5).write_criteo(path, 2500)
    ref = _read_all(recboost.CriteoReader(path, batch_size=1000))
    small = tmp_path / "small.txt"
    small.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:300]))
    for chunk in (37, 1000, 1 << 22):                     # chunks smaller than a line work too
        got = _read_all(recboost.CriteoReader(small, batch_size=128, chunk_bytes=chunk))
        assert all(np.array_equal(a, b[:300]) for a, b in zip(got, ref))
    assert [b[0].shape[0] for b in recboost.CriteoReader(path, batch_size=1000)] == [1000, 1000, 500]
    assert [b[0].shape[0] for b in recboost.CriteoReader(path, batch_size=1000, drop_remainder=True)] \
        == [1000, 1000]
    gz = tmp_path / "d.txt.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    got = _read_all(recboost.CriteoReader(str(gz), batch_size=1000))
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    got = _read_all(recboost.CriteoReader(io.BytesIO(path.read_bytes()), batch_size=1000))
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    with open(path, "r") as text_file:
        with pytest.raises(TypeError, match="opened in binary mode"):
            next(recboost.CriteoReader(text_file))
    with pytest.raises(TypeError, match="'source' must be a path or a binary file object"):
        recboost.CriteoReader(42)
    with pytest.raises(TypeError, match="'start' must be None, a byte offset or a dict"):
        recboost.CriteoReader(path, start={"offset": 3})


def test_reader_resumes_from_position(tmp_path, backend):
    path = tmp_path / "d.txt"
    recboost.SyntheticClickStream(seed=6).write_criteo(path, 3000)
    with open(path, "ab") as fh:          # malformed lines between rows must not shift the resume
        fh.write(b"garbage\n")
    recboost.SyntheticClickStream(seed=6).write_criteo(tmp_path / "tail.txt", 500, start_row=3000)
    with open(path, "ab") as fh:
        fh.write((tmp_path / "tail.txt").read_bytes())
    full = _read_all(recboost.CriteoReader(path, batch_size=700))
    first = recboost.CriteoReader(path, batch_size=700, chunk_bytes=10_000)
    head = [next(first) for _ in range(3)]
    pos = first.position()
    assert pos["rows"] == 2100 and pos["lines"] == 2100
    assert pos["offset"] == len(b"".join(path.read_bytes().splitlines(keepends=True)[:2100]))
    rest = recboost.CriteoReader(path, batch_size=700, start=pos)
    tail = _read_all(rest)
    for col in range(3):
        assert np.array_equal(np.concatenate([h[col] for h in head] + [tail[col]]), full[col])
    assert rest.position() == {"offset": path.stat().st_size, "lines": 3501, "rows": 3500}
    assert rest.stats()["malformed"]["field_count"] == 1


# ---- fuzz: random and mutated bytes never crash, never give NaN, both backends agree -----------------
def _mutate(rng, data):
    data = bytearray(data)
    for _ in range(int(rng.integers(1, 8))):
        op, pos = int(rng.integers(0, 4)), int(rng.integers(0, len(data) + 1))
        if op == 0 and data:
            del data[pos % len(data)]
        elif op == 1:
            data[pos:pos] = bytes([int(rng.choice(list(b"\t\n\r-+0123456789abcdefX \x00\xff")))])
        elif op == 2 and data:
            data[pos % len(data)] = int(rng.integers(0, 256))
        else:
            data[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8).tobytes()
    return bytes(data)


def test_parser_fuzz(backend, tmp_path):
    rng = np.random.default_rng(2024)
    s = recboost.SyntheticClickStream(seed=9)
    s.write_criteo(tmp_path / "seed.txt", 200)
    seed_lines = (tmp_path / "seed.txt").read_bytes().splitlines(keepends=True)
    alphabet = np.frombuffer(b"\t\t\t\t\n\r-+0123456789abcdefABCDEF \x00\xff", np.uint8)
    deadline, cases = time.monotonic() + 1.5, 0
    while time.monotonic() < deadline or cases < 50:
        kind = cases % 3
        if kind == 0:
            buf = rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        elif kind == 1:
            buf = alphabet[rng.integers(0, alphabet.size, int(rng.integers(0, 2000)))].tobytes()
        else:
            picks = rng.integers(0, len(seed_lines), int(rng.integers(1, 6)))
            buf = _mutate(rng, b"".join(seed_lines[i] for i in picks))
        labels, dense, ids, status, line_end = backend.parse_criteo(buf, ND, NS)
        assert status.size == line_end.size == buf.count(b"\n") + (0 if buf.endswith(b"\n") or not buf else 1)
        assert labels.size == dense.shape[0] == ids.shape[0] == int(np.sum(status == 0))
        assert np.all((status >= 0) & (status <= 4))
        assert np.all(np.diff(line_end) > 0) and (line_end.size == 0 or line_end[-1] == len(buf))
        assert np.all(np.isfinite(recboost._dense_transform(dense))) and np.all(ids >= 1)
        assert set(labels.tolist()) <= {0.0, 1.0}
        if backend.name == "fast":
            twin = recboost._py_parse_criteo(buf, ND, NS)
            for a, b in zip((labels, dense, ids, status, line_end), twin):
                assert a.dtype == b.dtype and np.array_equal(a, b), buf
        cases += 1
    # the reader on a mutated file: counts add up, batches are clean
    data = _mutate(rng, b"".join(seed_lines))
    reader = recboost.CriteoReader(io.BytesIO(data), batch_size=64, chunk_bytes=997)
    got = _read_all(reader)
    st = reader.stats()
    assert st["lines"] == data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    assert st["rows"] + sum(st["malformed"].values()) == st["lines"]
    if got is not None:
        assert got[0].shape[0] == st["rows"] and np.all(np.isfinite(got[0]))


# ---- criteo_split: a held-out tail found in one streaming pass ----------------------------------------
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_criteo_split_holds_out_exactly_the_last_lines(tmp_path, compressed, trailing_newline):
    """The offset is where the last N lines begin, whatever chunk the split falls in; reading up to it
    gives the rows of the lines before, reading from it the rows of the held-out lines; both together
    are the whole file, nothing twice."""
    plain = tmp_path / "day.txt"
    recboost.SyntheticClickStream(seed=7).write_criteo(str(plain), 700)
    text = plain.read_bytes()
    if not trailing_newline:
        text = text[:-1]
    lines = text.split(b"\n") if not text.endswith(b"\n") else text[:-1].split(b"\n")
    path = tmp_path / ("day.txt.gz" if compressed else "day2.txt")
    if compressed:
        with gzip.open(path, "wb") as fh:
            fh.write(text)
    else:
        path.write_bytes(text)
    whole = _read_all(recboost.CriteoReader(str(path), batch_size=64))
    for last, chunk in ((150, 1000), (150, 1 << 22), (1, 333), (0, 4096), (700, 512), (5000, 512)):
        offset, total = recboost.criteo_split(str(path), last, chunk_bytes=chunk)
        assert total == 700 == len(lines)
        first = max(700 - last, 0)
        assert offset == min(sum(len(line) + 1 for line in lines[:first]), len(text))   # where line `first` starts
        head = _read_all(recboost.CriteoReader(str(path), batch_size=64, stop=offset, chunk_bytes=chunk))
        tail = _read_all(recboost.CriteoReader(str(path), batch_size=64, start=offset, chunk_bytes=chunk))
        rows = [0 if part is None else part[0].shape[0] for part in (head, tail)]
        assert rows == [first, 700 - first]
        for k in range(3):
            joined = np.concatenate([part[k] for part in (head, tail) if part is not None])
            np.testing.assert_array_equal(joined, whole[k])


def test_criteo_split_and_stop_name_bad_arguments(tmp_path):
    path = tmp_path / "day.txt"
    recboost.SyntheticClickStream(seed=7).write_criteo(str(path), 10)
    with pytest.raises(ValueError, match="'last_lines' must be an int >= 0, but got -1"):
        recboost.criteo_split(str(path), -1)
    with pytest.raises(ValueError, match="'stop' must be an int >= 100, but got 50"):
        recboost.CriteoReader(str(path), start=100, stop=50)
