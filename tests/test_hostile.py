"""Hostile input, table-driven: every case gets a clear error or a documented, counted skip, and
nothing already trained is lost."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

import recboost as rb

BATCH, FIELDS, DENSE, DIM = 64, 4, 3, 4
I64 = np.iinfo(np.int64)


# ---- kernels, both backends ---------------------------------------------------------------------
@pytest.mark.parametrize("ids, exc, match", [
    (np.array([1.5, 2.0]), TypeError, "'ids' must be an array of integers"),
    (np.array(["a", "b"]), TypeError, "'ids' must be an array of integers"),
    (np.array([None, 1], dtype=object), TypeError, "'ids' must be an array of integers"),
    (np.array([True, False]), TypeError, "'ids' must be an array of integers"),
])
def test_cache_rejects_bad_ids(backend, ids, exc, match):
    cache = backend.HashCache(16)
    with pytest.raises(exc, match=match):
        cache.lookup(ids)
    assert len(cache) == 0 and cache.stats()["looked_up"] == 0


def test_cache_takes_every_int64_id(backend):
    """No id is reserved: negative, zero and the int64 extremes are ids like any other."""
    cache = backend.HashCache(16)
    ids = np.array([I64.min, -1, 0, 1, I64.max, I64.min], np.int64)
    rows = cache.lookup(ids)
    assert rows[0] == rows[-1] and len(set(rows[:5].tolist())) == 5
    assert rows.min() >= rb.HASH_SCRATCH_ROW + 1
    np.testing.assert_array_equal(cache.find(ids), rows)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"capacity": 2}, ValueError, "'capacity' must be an int >= 3"),
    ({"capacity": 16, "access_threshold": -2}, ValueError, "'access_threshold' must be an int >= -1"),
    ({"capacity": 16, "eviction_threshold": -5}, ValueError, "'eviction_threshold' must be an int >= -1"),
    ({"capacity": 16.0}, TypeError, "'capacity' must be an int"),
])
def test_cache_rejects_bad_config(backend, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        backend.HashCache(**kwargs)


def test_cache_rejects_bad_timestamp(backend):
    cache = backend.HashCache(16)
    with pytest.raises(TypeError, match="'timestamp' must be an int"):
        cache.lookup(np.arange(3), timestamp=1.5)
    assert cache.stats()["looked_up"] == 0


# ---- RecModel over hostile batches --------------------------------------------------------------
def _good(rng):
    dense = rng.normal(size=(BATCH, DENSE)).astype(np.float32)
    ids = rng.integers(0, 500, size=(BATCH, FIELDS)).astype(np.int64)
    label = (rng.random((BATCH, 1)) < 0.3).astype(np.float32)
    return dense, ids, label


def _model():
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, 1024, max_unique=BATCH * FIELDS + 1, input_index=1, name="ids")
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _state(table, model):
    out = {p.name: p.asnumpy().copy() for p in model.state_parameters()}
    out["table"] = table.weight.copy()
    out["cache"] = table.cache.state_dict()["keys"].copy()
    return out


def _bad_shape(b):
    return b[0][:-1], b[1], b[2]


def _str_item(b):
    return b[0].astype(str), b[1], b[2]


def _nan_dense(b):
    d = b[0].copy()
    d[3, 1] = np.nan
    return d, b[1], b[2]


def _inf_dense(b):
    d = b[0].copy()
    d[0, 0] = np.inf
    return d, b[1], b[2]


def _label_two(b):
    y = b[2].copy()
    y[5] = 2.0
    return b[0], b[1], y


def _label_nan(b):
    y = b[2].copy()
    y[1] = np.nan
    return b[0], b[1], y


def _label_half(b):
    y = b[2].copy()
    y[0] = 0.5
    return b[0], b[1], y


def _empty(b):
    return tuple(a[:0] for a in b)


def _float_ids(b):
    return b[0], b[1].astype(np.float64), b[2]


def _timestamp_text(b):
    return {"dense": b[0], "ids": b[1], "label": b[2], "timestamp": "yesterday"}


def _not_a_batch(b):
    return 42


CASES = [
    # (case, make the bad batch, expected: exception (type, match) or the counter that moves)
    ("rows differ", _bad_shape, (ValueError, "arrays with the same number of rows")),
    ("ids with a column more", lambda b: (b[0], np.concatenate([b[1], b[1][:, :1]], 1), b[2]),
     (ValueError, r"batch item 1 must be of shape \[B, 4\] like the first batch")),
    ("float16 dense", lambda b: (b[0].astype(np.float16), b[1], b[2]), None),
    ("text features", _str_item, (TypeError, "batch item 0 must be a numeric array, but got dtype")),
    ("NaN feature", _nan_dense, "nonfinite"),
    ("Inf feature", _inf_dense, "nonfinite"),
    ("label 2", _label_two, "bad_label"),
    ("label NaN", _label_nan, "bad_label"),
    ("label 0.5", _label_half, None),       # a soft label (label smoothing): trained, as Model trains it
    ("empty batch", _empty, "empty"),
    ("float ids", _float_ids, (TypeError, "batch item 1 must be of dtype integer like the first batch, but got "
                                          "'dtype float64'")),
    ("text timestamp", _timestamp_text, (TypeError, r"the time column 'timestamp' must be integers \(data time\), but got 'yesterday'")),
    ("not a batch", _not_a_batch, (TypeError, "each batch must be a non-empty tuple of arrays, but got 'int'")),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, make, expected", CASES, ids=[c[0] for c in CASES])
def test_online_train_hostile_batch(graph_mode, backend, case, make, expected):
    rng = np.random.default_rng(1)
    table, model = _model()
    model.online_train([_good(rng) for _ in range(2)], dataset_sink_mode=False)
    before = _state(table, model)
    bad, after_good = make(_good(rng)), _good(rng)
    if expected is None:                   # accepted (widened to float32, or a soft label) and trained
        model.online_train([bad, after_good], dataset_sink_mode=False)
        assert model.step == 4
    elif isinstance(expected, tuple):
        exc, match = expected
        with pytest.raises(exc, match=match):
            model.online_train([bad, after_good], dataset_sink_mode=False)
        assert model.step == 2
        now = _state(table, model)
        for key in before:
            np.testing.assert_array_equal(before[key], now[key], err_msg=key)
        model.online_train([after_good], dataset_sink_mode=False)      # the model trains on
        assert model.step == 3
    else:
        model.online_train([bad, after_good], dataset_sink_mode=False)
        counter = model.overflow_steps if expected == "overflow_steps" else model.skipped_batches[expected]
        assert counter == 1
        assert model.step == (4 if expected == "overflow_steps" else 3)
        assert np.isfinite(model.train_network.scale_sense.asnumpy()).all()
        for p in model.state_parameters():
            assert np.isfinite(p.asnumpy()).all(), p.name
        assert np.isfinite(table.weight).all()


@pytest.mark.parametrize("make, exc, match", [
    (lambda net: rb.RecModel(net, nn.BCEWithLogitsLoss(), optimizer="adam"), TypeError, "'optimizer' must be an optimizer"),
    (lambda net: rb.RecModel("net"), TypeError, "'network' must be a Cell"),
    (lambda net: rb.RecModel(net, eval_indexes=[0, 1]), ValueError, "'eval_indexes' must be None or a list of three"),
    (lambda net: rb.RecModel(net, eval_network=net, eval_indexes=[0, -1, 2]), ValueError,
     r"'eval_indexes' must be None or a list of three ints >= 0 .*, but got \[0, -1, 2\]"),
    (lambda net: rb.RecModel(net, eval_indexes=[0, 1, 2]), ValueError,
     r"'eval_indexes' must be None when 'eval_network' is None .*, but got \[0, 1, 2\]"),
    (lambda net: rb.RecModel(net, eval_network="net"), TypeError, "'eval_network' must be a Cell or None"),
    (lambda net: rb.RecModel(net, amp_level="O9"), ValueError, "'level' must be one of"),
    (lambda net: rb.RecModel(net, boost_config_dict={}, colour="red"), TypeError, "keyword arguments must be among"),
    (lambda net: rb.OnlineCheckpoint("d"), ValueError, "'every_steps' or 'every_seconds' must be set"),
    (lambda net: rb.OnlineCheckpoint("d", every_steps=0), ValueError, "'every_steps' must be an int >= 1"),
    (lambda net: rb.ProgressMonitor(every_seconds=-1), ValueError, "'every_seconds' must be a number > 0"),
    (lambda net: rb.ProgressMonitor(eval_every=-1), ValueError, "'eval_every' must be an int >= 0"),
])
def test_bad_configuration_is_named(make, exc, match):
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), vocab_size=10)
    with pytest.raises(exc, match=match):
        make(net)


# ---- config parser fuzz (bounded time) ----------------------------------------------------------
@pytest.mark.slow
def test_boost_config_parser_fuzz(tmp_path):
    """Random configs: AutoBoost either accepts them (and then every algorithm flag is a bool) or
    raises ValueError/TypeError in recboost's one error form; random JSON files likewise."""
    import json
    import random
    import time
    rng = random.Random(2026)
    sections = {"boost": ["mode", "less_bn", "grad_freeze", "adasum", "grad_accumulation", "dim_reduce"],
                "common": ["gradient_split_groups", "device_number"], "less_bn": ["fn_flag", "gc_flag"],
                "grad_freeze": ["param_groups", "freeze_type", "freeze_p", "total_steps"],
                "grad_accumulation": ["grad_accumulation_step"],
                "dim_reduce": ["rho", "gamma", "alpha", "sigma", "n_components", "pca_mat_path",
                               "weight_load_dir", "timeout"], "bogus": ["x"]}
    values = [True, False, 0, 1, -1, 2, 0.5, 1.5, -0.1, "auto", "manual", "enable_all", "disable_all", "fast",
              None, [], [50, 100], [1, "a"], {}, 10 ** 9, float("nan"), "", "O1"]
    accepted = rejected = 0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        cfg = {}
        for _ in range(rng.randint(0, 4)):
            section = rng.choice(list(sections))
            keys = sections[section] + ["unknown_key"]
            cfg[section] = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 3))}
            if rng.random() < 0.05:
                cfg[section] = rng.choice(values)
        level = rng.choice(["O0", "O1", "O2", "O3", "", None, 1])
        try:
            boost = rb.AutoBoost(level, cfg)
        except (ValueError, TypeError) as exc:
            assert str(exc).startswith("For '") and "but got" in str(exc), exc
            rejected += 1
        else:
            assert all(isinstance(v, bool) for v in boost.boost_config.values())
            accepted += 1
    assert accepted > 20 and rejected > 20
    for k in range(30):
        path = tmp_path / ("cfg%d.json" % k)
        blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        path.write_bytes(blob if k % 2 else json.dumps({"boost": {"mode": "manual"}}).encode()[:rng.randint(0, 20)])
        with pytest.raises((ValueError, TypeError)) as info:
            rb.AutoBoost("O1", str(path))
        assert "For '" in str(info.value)
