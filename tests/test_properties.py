"""Property-based tests (hypothesis) of the public entry points that take numbers or arrays: weights,
ragged offsets, learning rates, thresholds, capacities and batch items. Each generated input is
refused with a ValueError or TypeError naming the argument, or gives the float64 reference's result
within the documented tolerance. Deterministic (``derandomize=True``) and bounded."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import recboost as rb
from test_weighted_ids import DIM, PAD, _reference, _table

BOUNDED = settings(max_examples=60, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

#: the hostile values: 0, ±denormals, tiny and huge finite, NaN, ±Inf, negatives, and ordinary ones
HOSTILE = st.one_of(st.sampled_from([0.0, -0.0, 1e-40, -1e-40, 1e-30, 1e30, -1e30, float("nan"), float("inf"),
                                     -float("inf"), -0.5, 1.0]),
                    st.floats(-1e3, 1e3, allow_nan=False, width=32))


@st.composite
def _bags(draw, max_bags=6, length=4):
    bags = draw(st.integers(1, max_bags))
    ids = np.array(draw(st.lists(st.lists(st.integers(0, 30), min_size=length, max_size=length),
                                 min_size=bags, max_size=bags)), np.int64)
    weights = np.array(draw(st.lists(st.lists(HOSTILE, min_size=length, max_size=length),
                                     min_size=bags, max_size=bags)), np.float32)
    return ids, weights


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
@BOUNDED
@given(bag=_bags())
def test_weights_are_refused_by_name_or_pool_as_float64(combiner, bag):
    ids, weights = bag
    weights = np.where(ids == PAD, 0, weights).astype(np.float32)       # (a pad's weight is not read)
    emb = _table(combiner)
    try:
        batch = emb.prepare(rb.WeightedIds(ids, weights))
    except (ValueError, TypeError) as exc:
        assert "weights" in str(exc), str(exc)
        real = weights[ids != PAD]
        assert not np.isfinite(real).all() or (combiner in ("mean", "sqrtn") and (real < 0).any()), str(exc)
        return
    emb.take(batch)
    before = emb.weight.copy()
    pooled = emb.gather(batch)
    # (max: over the ids of nonzero weight, as MultiFieldEmbeddingLookup: weight 0 marks padding)
    shown = np.where(weights == 0, PAD, ids) if combiner == "max" else ids
    want = _reference(lambda i: before[emb.cache.find(i)], shown, weights, combiner)
    assert np.isfinite(weights).all()
    scale = np.maximum(np.abs(want).max(-1, keepdims=True), 1)          # (a bag's tolerance: its own magnitude)
    error = np.abs(pooled.astype(np.float64) - want)
    assert (error <= 2e-6 * np.abs(want) + 1e-6 * scale).all(), (pooled, want)


@BOUNDED
@given(offsets=st.lists(st.integers(-3, 12), min_size=0, max_size=6), n=st.integers(0, 10))
def test_ragged_offsets_are_refused_by_name_or_pool_as_float64(offsets, n):
    values = (np.arange(n) % 29 + 1).astype(np.int64)
    weights = np.linspace(0.5, 1.5, n).astype(np.float32)
    emb = _table("sum")
    try:
        batch = emb.prepare(rb.WeightedIds(values, weights, np.array(offsets, np.int64)))
    except (ValueError, TypeError) as exc:
        assert "offsets" in str(exc), str(exc)
        o = np.array(offsets)
        assert o.size < 1 or o[0] != 0 or o[-1] != n or (np.diff(o) < 0).any(), str(exc)
        return
    emb.take(batch)
    before = emb.weight.copy()
    pooled = emb.gather(batch)
    want = np.zeros((len(offsets) - 1, DIM))
    for b in range(len(offsets) - 1):
        seg = slice(offsets[b], offsets[b + 1])
        rows = before[emb.cache.find(values[seg])].astype(np.float64)
        want[b] = (rows * weights[seg, None]).sum(0)
    np.testing.assert_allclose(pooled, want, rtol=2e-6, atol=1e-6)


@BOUNDED
@given(rate=st.one_of(HOSTILE, st.integers(-2, 3), st.sampled_from(["0.1", None, True])))
def test_learning_rates_are_refused_by_name_or_train_as_float64(rate):
    try:
        emb = _table("sum", optimizer=rb.SparseSGD(rate))
    except (ValueError, TypeError) as exc:
        assert "learning_rate" in str(exc), str(exc)
        assert isinstance(rate, (str, bool)) or rate is None or not np.isfinite(rate) or rate <= 0, str(exc)
        return
    ids = np.array([[3, 4, 5]], np.int64)
    batch = emb.prepare(ids)
    emb.take(batch)
    before = emb.weight.copy()
    grad = np.float32([[1.0, -2.0, 0.5, 0.25]])
    emb.apply_gradients(batch, grad)
    want = before.astype(np.float64)
    want[emb.cache.find(ids[0])] -= float(np.float32(rate)) * grad.astype(np.float64)
    np.testing.assert_allclose(emb.weight, want, rtol=1e-6, atol=1e-6 * max(1.0, abs(float(rate))))


INTEGERS = st.one_of(st.integers(-5, 5000), st.sampled_from([2 ** 40, 2 ** 63, -2 ** 63, 1.5, float("nan"),
                                                             "64", None, True]))


@BOUNDED
@given(capacity=INTEGERS)
def test_capacities_are_refused_by_name_or_kept(capacity):
    try:
        emb = rb.HashEmbedding(DIM, capacity, name="t")
    except (ValueError, TypeError, OSError) as exc:
        assert "capacity" in str(exc), str(exc)
        return
    assert isinstance(capacity, int) and not isinstance(capacity, bool) and emb.capacity == capacity > 0


@pytest.mark.parametrize("argument", ["access_threshold", "eviction_threshold"])
@BOUNDED
@given(value=st.one_of(st.integers(-10, 10 ** 6), st.sampled_from([2 ** 62, -2 ** 40, 1.5, float("nan"), "3",
                                                                   None, True])))
def test_thresholds_are_refused_by_name_or_kept(argument, value):
    try:
        emb = rb.HashEmbedding(DIM, 64, name="t", **{argument: value})
    except (ValueError, TypeError) as exc:
        assert argument in str(exc), str(exc)
        return
    assert isinstance(value, int) and not isinstance(value, bool) and value >= -1
    assert getattr(emb.config, argument) == value


@pytest.fixture(scope="module")
def trained():
    """A tiny model that has trained one batch (the run's schema) and that batch."""
    from mindspore import nn
    table = rb.HashEmbedding(9, 256, input_index=1, seed=0, name="ids", optimizer=rb.SparseAdagrad(0.05))
    net = rb.WideDeep(4, 6, 8, (16,), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    stream = rb.SyntheticClickStream(seed=0, num_dense=4, num_sparse=6, vocab_sizes=[200] * 6, batch_size=8)
    good = [np.asarray(a) for a in next(stream)]
    model.train(1, [tuple(good)])
    return model, good


MUTATIONS = st.sampled_from(["float64", "int32", "bool", "str", "object", "drop_column", "extra_column", "nan",
                             "inf", "1e30", "empty", "rows_mismatch"])


def _mutated(array, how):
    a = np.array(array, copy=True)
    if how in ("float64", "int32", "bool"):
        return a.astype(how)
    if how == "str":
        return a.astype(str)
    if how == "object":
        return a.astype(object)
    if how == "drop_column":
        return a[..., :-1] if a.ndim > 1 else a[:-1]
    if how == "extra_column":
        return np.concatenate([a, a[..., :1]], -1) if a.ndim > 1 else np.concatenate([a, a[:1]])
    if how == "empty":
        return a[:0]
    if how == "rows_mismatch":
        return a[:-1]
    if a.dtype.kind != "f":
        return a
    a.flat[0] = {"nan": np.nan, "inf": np.inf, "1e30": 1e30}[how]
    return a


@BOUNDED
@given(item=st.integers(0, 2), how=MUTATIONS)
def test_batch_items_are_refused_by_name_or_leave_the_model_finite(trained, item, how):
    """A batch item of another dtype or shape, or holding NaN, Inf or 1e30, is refused naming the
    batch item, or the step keeps every parameter and row finite (a non-finite update is skipped)."""
    model, good = trained
    if item >= len(good):
        return
    batch = list(good)
    batch[item] = _mutated(good[item], how)
    try:
        model.train(1, [tuple(batch)])
    except (ValueError, TypeError) as exc:
        assert "batch item" in str(exc) or "label" in str(exc), str(exc)
        return
    for param in model.network.get_parameters():
        assert np.isfinite(param.asnumpy()).all(), (param.name, item, how)
    assert np.isfinite(model.tables[0].weight).all()
