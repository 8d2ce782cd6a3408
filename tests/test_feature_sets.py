"""Real feature sets: multi-hot features pooled by a combiner, padding ids, ragged (values, offsets)
input, several features sharing a table, and FeatureSpec-driven models with several tables fed by
dict batches keyed by feature name (issue: feature sets, multi-hot, many tables, export)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops

import recboost as rb
from _stopping import StopAfter

DIM = 4
PAD = 0


def _table(combiner, padding_id=PAD, capacity=64, lr=0.5, **kw):
    return rb.HashEmbedding(DIM, capacity, combiner=combiner, padding_id=padding_id,
                            optimizer=rb.SparseSGD(lr), init_stddev=0.5, name="t", **kw)


def _padded(rng, bags, length, vocab=40, pad=PAD):
    """[bags, length] ids in 1..vocab, each bag with a random number of trailing pads (some all-pad)."""
    ids = rng.integers(1, vocab, size=(bags, length)).astype(np.int64)
    keep = rng.integers(0, length + 1, size=bags)
    keep[0], keep[1] = 0, length                         # an all-padding bag and a full one
    ids[np.arange(length)[None, :] >= keep[:, None]] = pad
    return ids


def _to_ragged(ids, pad=PAD):
    values = [row[row != pad] for row in ids]
    offsets = np.concatenate([[0], np.cumsum([v.size for v in values])]).astype(np.int64)
    return np.concatenate(values).astype(np.int64), offsets


def _reference_pool(table, ids, combiner, pad=PAD):
    """float64 reference: per bag the rows of its non-padding ids, pooled."""
    out = np.zeros((ids.shape[0], DIM))
    for b, row in enumerate(ids):
        real = row[row != pad]
        if real.size == 0:
            continue
        rows = table.weight[table.cache.find(real)].astype(np.float64)
        total = rows.sum(0)
        out[b] = total if combiner == "sum" else total / real.size if combiner == "mean" else \
            total / np.sqrt(real.size)
    return out


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_pool_like_a_numpy_reference_and_train_each_row(backend, combiner):
    rng = np.random.default_rng(1)
    ids = _padded(rng, 30, 6)
    emb = _table(combiner)
    batch = emb.prepare(ids)
    emb.take(batch)
    pooled = emb.gather(batch)
    assert pooled.shape == (30, DIM) and pooled.dtype == np.float32
    np.testing.assert_allclose(pooled, _reference_pool(emb, ids, combiner), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(pooled[0], 0)                         # all padding: zeros
    # backward: each bag's gradient times its scale reaches each of its rows; SGD: w -= lr * sum
    before = emb.weight.copy()
    grad = rng.standard_normal((30, DIM)).astype(np.float32)
    emb.apply_gradients(batch, grad)
    expected = before.astype(np.float64)
    for b, row in enumerate(ids):
        real = row[row != PAD]
        factor = 1.0 if combiner == "sum" else 1.0 / max(real.size, 1) if combiner == "mean" else \
            1.0 / np.sqrt(max(real.size, 1))
        for i in real:
            expected[emb.cache.find(np.array([i]))[0]] -= 0.5 * factor * grad[b]
    np.testing.assert_allclose(emb.weight, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5, 3, 4), (2, 5, 3, 4)])
def test_ids_of_any_rank_pool_over_their_last_axis(backend, shape):
    """[B, F, L] ids pool to [B, F, dim], and so does any [..., L]: the pooled rows are the reference pool
    of each bag, and the update is, bit for bit, the one of the same bags given as [N, L] ids."""
    rng = np.random.default_rng(2)
    bags = int(np.prod(shape[:-1]))
    ids = _padded(rng, bags, shape[-1]).reshape(shape)
    emb, flat = _table("mean"), _table("mean")
    batch, flat_batch = emb.prepare(ids), flat.prepare(ids.reshape(bags, shape[-1]))
    emb.take(batch)
    flat.take(flat_batch)
    pooled = emb.gather(batch)
    assert pooled.shape == shape[:-1] + (DIM,)
    reference = _reference_pool(emb, ids.reshape(bags, shape[-1]), "mean")
    np.testing.assert_allclose(pooled.reshape(bags, DIM), reference, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(pooled.reshape(bags, DIM), flat.gather(flat_batch))
    grad = rng.standard_normal(pooled.shape).astype(np.float32)
    emb.apply_gradients(batch, grad)
    flat.apply_gradients(flat_batch, grad.reshape(bags, DIM))
    np.testing.assert_array_equal(emb.weight, flat.weight)


def test_padding_is_never_counted_admitted_given_a_row_or_trained(backend):
    rng = np.random.default_rng(3)
    for combiner in ("sum", None):
        emb = _table(combiner, access_threshold=0, eviction_threshold=5)
        looked_up = 0
        for step in range(6):
            ids = _padded(rng, 16, 5)
            batch = emb.prepare(ids, timestamp=step)
            looked_up += int(np.count_nonzero(ids != PAD))
            emb.take(batch)
            out = emb.gather(batch)
            if combiner is None:
                assert out.shape == (16, 5, DIM)
                np.testing.assert_array_equal(out[ids == PAD], 0)       # a padding position is zeros
            emb.apply_gradients(batch, np.ones_like(out))
            emb.evict(step)
        state = emb.cache.state_dict()
        assert PAD not in state["keys"]                                 # never counted
        assert emb.cache.find(np.array([PAD]))[0] == rb.HASH_DEFAULT_ROW
        assert emb.cache.stats()["looked_up"] == looked_up              # padding never reached the cache


def test_ragged_and_padded_forms_give_the_same_bits_and_the_same_training(backend):
    rng = np.random.default_rng(4)
    ids = _padded(rng, 40, 7)
    results = []
    for form in ("padded", "ragged"):
        emb = _table("sqrtn", lr=0.1)
        for step in range(3):
            batch = emb.prepare(ids if form == "padded" else _to_ragged(ids))
            emb.take(batch)
            pooled = emb.gather(batch)
            emb.apply_gradients(batch, np.sin(pooled * 3 + step).astype(np.float32))
        results.append((pooled, emb.weight.copy(), emb.cache.state_dict()["keys"]))
    np.testing.assert_array_equal(results[0][0].view(np.uint32), results[1][0].view(np.uint32))
    np.testing.assert_array_equal(results[0][1].view(np.uint32), results[1][1].view(np.uint32))
    np.testing.assert_array_equal(results[0][2], results[1][2])


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
def test_pooled_training_is_bit_identical_on_both_backends(kind):
    if not rb.FAST_BACKEND:
        pytest.skip("compiled-vs-twin parity needs the compiled backend: " + rb.FAST_BACKEND_REASON)
    optimizer = {"sgd": rb.SparseSGD(0.1), "adagrad": rb.SparseAdagrad(0.1), "adam": rb.SparseAdam(0.01),
                 "rowwise_adagrad": rb.SparseRowWiseAdagrad(0.1), "ftrl": rb.SparseFtrl(0.1, l1=0.001)}[kind]
    rng = np.random.default_rng(5)
    batches = [_padded(rng, 64, 9) for _ in range(3)]
    weights = []
    for name in ("py", "fast"):
        saved = {k: getattr(rb, k) for k in rb._KERNEL_NAMES if k != "HashCache"}
        try:
            for k, fn in rb._backend_kernels(name).items():
                if k != "HashCache":
                    setattr(rb, k, fn)
            emb = rb.HashEmbedding(DIM, 256, combiner="mean", padding_id=PAD, optimizer=optimizer, name="t")
            for ids in batches:
                batch = emb.prepare(ids)
                emb.take(batch)
                pooled = emb.gather(batch)
                emb.apply_gradients(batch, np.cos(pooled * 7).astype(np.float32))
            weights.append((pooled.copy(), emb.weight.copy()) + tuple(emb.slots[k].copy() for k in sorted(emb.slots)))
        finally:
            for k, fn in saved.items():
                setattr(rb, k, fn)
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_two_features_of_one_table_share_rows_and_counts(backend):
    emb = rb.HashEmbedding(DIM, 32, access_threshold=1, optimizer=rb.SparseSGD(1.0), name="t")
    a, b = np.array([[5], [6]]), np.array([[5, 7], [8, 9]])
    batch = emb.prepare_features([a, b])
    emb.take(batch)
    rows_a, rows_b = emb.gather(batch)
    assert rows_a.shape == (2, 1, DIM) and rows_b.shape == (2, 2, DIM)
    assert emb.cache.find(np.array([5]))[0] >= 2                       # seen twice in the batch: admitted
    assert emb.cache.find(np.array([6, 7, 8, 9])).tolist() == [0, 0, 0, 0]   # once: not yet
    np.testing.assert_array_equal(rows_a[0, 0], rows_b[0, 0])          # one row for id 5
    before = emb.weight[emb.cache.find(np.array([5]))[0]].copy()
    emb.apply_gradients(batch, [np.ones_like(rows_a), 2 * np.ones_like(rows_b)])
    np.testing.assert_allclose(emb.weight[emb.cache.find(np.array([5]))[0]], before - 3.0)   # 1 + 2


# ---- FeatureSpec-driven models: several tables, shared tables, dict batches by name -------------------
B, FIELDS_A, FIELDS_B, HIST = 64, 3, 2, 5


class _ThreeTables(nn.Cell):
    """user fields (table "user"), item fields and the item history (shared table "item", the
    history pooled by a second, pooled table view "hist" over the same ids would be a different
    table; here "hist" is its own pooled table), and a dense input."""

    def __init__(self, user, item, hist, specs):
        super().__init__()
        self.user, self.item, self.hist = user, item, hist
        width = (FIELDS_A + 2 * FIELDS_B) * DIM + DIM + 2
        self.fc = nn.Dense(width, 1, weight_init="normal")
        self.concat = ops.Concat(1)

    def construct(self, dense, user_ids, item_ids, cand_ids, history):
        parts = (self.user(user_ids).reshape(user_ids.shape[0], -1), self.item(item_ids).reshape(item_ids.shape[0], -1),
                 self.item(cand_ids).reshape(cand_ids.shape[0], -1), self.hist(history), dense)
        return self.fc(self.concat(parts))


def _specs():
    # mx_rec's thresholds (count >= t admits, now - last >= t evicts): the tables hold 0 / 1 and 30
    return {"user": rb.FeatureSpec("user_ids", table_name="user", access_threshold=1, eviction_threshold=31),
            "item": rb.FeatureSpec("item_ids", table_name="item", access_threshold=2, eviction_threshold=31),
            "cand": rb.FeatureSpec("cand_ids", table_name="item", access_threshold=2, eviction_threshold=31),
            "hist": rb.FeatureSpec("history", table_name="hist"),
            "time": rb.FeatureSpec("event_time", is_timestamp=True, index_key="event_time")}


def _spec_model(seed=0):
    ms.set_seed(seed)
    s = _specs()
    user = rb.create_table("user", DIM, 64, feature_spec=[s["user"], s["time"]], use_dynamic_expansion=True,
                           optimizer=rb.SparseAdam(0.01), seed=seed)
    item = rb.create_table("item", DIM, 64, feature_spec=[s["item"], s["cand"], s["time"]],
                           use_dynamic_expansion=True, optimizer=rb.SparseAdagrad(0.05), seed=seed + 1)
    hist = rb.create_table("hist", DIM, 64, feature_spec=s["hist"], combiner="mean", padding_id=PAD,
                           use_dynamic_expansion=True, optimizer=rb.SparseSGD(0.05), seed=seed + 2)
    net = _ThreeTables(user, item, hist, s)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    return (user, item, hist), model


def _spec_stream(seed=0, n=None, ragged=False):
    rng = np.random.default_rng(seed)
    k = 0
    while n is None or k < n:
        hist = _padded(rng, B, HIST, vocab=200)
        batch = {"label": rng.integers(0, 2, size=(B, 1)).astype(np.float32),   # any order: matched by name
                 "history": _to_ragged(hist) if ragged else hist,
                 "user_ids": rng.integers(1, 150, size=(B, FIELDS_A)),
                 "event_time": np.int64(100 + k),
                 "item_ids": rng.integers(1, 150, size=(B, FIELDS_B)),
                 "cand_ids": rng.integers(1, 150, size=(B, FIELDS_B)),
                 "dense": rng.standard_normal((B, 2)).astype(np.float32)}
        yield batch
        k += 1


def _state(tables, model):
    out = {"dense:" + p.name: p.asnumpy() for p in model.state_parameters()}
    for t in tables:
        state = t.state_dict()
        out[t.table_name] = state["table"]
        out.update({t.table_name + ":" + k: np.asarray(v) for k, v in state["cache"].items()})
        out.update({t.table_name + ":slot:" + k: v for k, v in state["slots"].items()})
    return out


@pytest.mark.slow
@pytest.mark.live_backend
def test_feature_spec_model_trains_three_tables_from_named_dict_batches(graph_mode, backend):
    tables, model = _spec_model()
    user, item, hist = tables
    model.online_train(_spec_stream(), callbacks=[rb.EvictHook(evict_step_interval=5), StopAfter(12)],
                       dataset_sink_mode=False)
    assert model.step == 12
    assert [t.input_index for t in tables] == [None, None, None]
    assert model.table_positions == [(1,), (2, 3), (4,)]               # construct's parameters, by name
    for t in tables:                  # the timestamp spec's column times every table (2 batches prefetched)
        assert t.cache.stats()["admitted"] > 0
        assert t.cache.now == 100 + model._feed_state["taken"] - 1 == 113
    # item_ids and cand_ids share one cache: every id of both is counted there, once per occurrence
    assert item.cache.stats()["looked_up"] == model._feed_state["taken"] * B * 2 * FIELDS_B
    assert hist.cache.stats()["looked_up"] < model._feed_state["taken"] * B * HIST            # padding is not looked up
    assert PAD not in hist.cache.state_dict()["keys"]
    assert user.cache.stats()["evicted"] == 0                           # eviction is by data time: none is 30 old
    # ragged history gives the same run, bit for bit
    tables_r, model_r = _spec_model()
    model_r.online_train(_spec_stream(ragged=True), callbacks=[rb.EvictHook(evict_step_interval=5),
                                                               StopAfter(12)], dataset_sink_mode=False)
    a, b = _state(tables, model), _state(tables_r, model_r)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # predict takes a dict by name too (label-free) and does not admit
    batch = next(_spec_stream(seed=9))
    batch.pop("label")
    before = item.cache.stats()
    out = model.predict(batch).asnumpy()
    assert out.shape == (B, 1) and np.isfinite(out).all()
    assert item.cache.stats() == before


@pytest.mark.slow
def test_feature_spec_model_resumes_exactly_from_a_checkpoint(graph_mode, tmp_path):
    tables_a, model_a = _spec_model()
    model_a.online_train(_spec_stream(), callbacks=[StopAfter(14)], dataset_sink_mode=False)
    tables_b, model_b = _spec_model()
    ckpt = rb.OnlineCheckpoint(str(tmp_path), every_steps=6, keep=1, save_on_end=False)
    model_b.online_train(_spec_stream(), callbacks=[ckpt, StopAfter(8)], dataset_sink_mode=False)
    tables_c, model_c = _spec_model(seed=3)
    model_c.online_train(_spec_stream(), callbacks=[StopAfter(14)], dataset_sink_mode=False,
                         resume_from=str(tmp_path))
    a, c = _state(tables_a, model_a), _state(tables_c, model_c)
    for key in a:
        np.testing.assert_array_equal(a[key], c[key], err_msg=key)


# ---- bad input: clear errors, nothing trained lost ---------------------------------------------------
@pytest.mark.parametrize("make, exc, match", [
    (lambda: _table("mean").prepare(np.array([1, 2, 3])), ValueError,
     r"the ids of table 't' \(combiner 'mean'\) must be \[B, L\] or \[B, F, L\] ids .* but got 'ids of shape \(3,\)'"),
    (lambda: _table("sum").prepare((np.array([1, 2, 3]), np.array([0, 2, 1, 3]))), ValueError,
     r"the offsets of a ragged feature of table 't' must be non-decreasing from 0 to len\(values\) = 3, but got "
     r"\[0, 2, 1, 3\]"),
    (lambda: _table("sum").prepare((np.array([1, 2, 3]), np.array([0, 2]))), ValueError,
     r"non-decreasing from 0 to len\(values\) = 3, but got \[0, 2\]"),
    (lambda: _table("sum").prepare((np.array([1, 2, 3]), np.array([1, 3]))), ValueError,
     r"non-decreasing from 0 to len\(values\) = 3, but got \[1, 3\]"),
    (lambda: _table(None, None).prepare((np.array([1, 2]), np.array([0, 2]))), ValueError,
     r"a ragged feature \(values, offsets\) of table 't' must be a table with a combiner"),
    (lambda: _table("sum").prepare((np.array([[1, 2], [3, 4]]), np.array([0, 2, 4]))), ValueError,   # (not flattened)
     r"the values of a ragged feature of table 't' must be a 1-D int array .*, but got 'shape \(2, 2\)'"),
    (lambda: _table("sum").prepare((np.array([1, 2, 3]), np.array([0, 2**63 + 1, 3], np.uint64))), ValueError,
     r"non-decreasing from 0 to len\(values\) = 3, but got \[0, 9223372036854775809, 3\]"),   # (as given)
    (lambda: _table("sum").prepare([[1, 2], [3]]), ValueError,
     r"'ids' must be a rectangular array \(ragged ids go as a tuple \(values, offsets\)"),
    (lambda: _table("min"), ValueError,
     r"'combiner' must be one of \[None, 'sum', 'mean', 'sqrtn', 'max'\], but got 'min'"),
    (lambda: rb.create_table("a", DIM, 8, feature_spec=rb.FeatureSpec("f", table_name="b")), ValueError,
     r"the table_name of FeatureSpec 'f' must be 'a', but got 'b'"),
    (lambda: rb.create_table("a", DIM, 8, feature_spec=[rb.FeatureSpec("f", table_name="a", access_threshold=1),
                                                        rb.FeatureSpec("g", table_name="a")]), ValueError,
     r"the access_threshold of the features of table 'a' must be one value, but got \[-1, 1\]"),
    (lambda: rb.FeatureSpec("t", table_name="x", is_timestamp=True), ValueError,
     r"'table_name' must be None for a timestamp spec"),
])
def test_bad_table_input_is_named(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_a_feature_the_network_does_not_take_is_named():
    table = rb.create_table("t", DIM, 8, feature_spec=rb.FeatureSpec("clicks", table_name="t"))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.t = table

        def construct(self, dense, ids):
            return self.t(ids).sum(1)

    with pytest.raises(ValueError, match=r"feature 'clicks' of hash table 't' must be an index_key among the "
                                         r"parameters of Net.construct \['dense', 'ids'\], but got 'clicks'"):
        rb.RecModel(Net(), nn.BCEWithLogitsLoss(), nn.Adam(nn.Dense(1, 1).trainable_params()))


@pytest.mark.slow
@pytest.mark.parametrize("change, exc, match", [
    (lambda b: b.pop("cand_ids"), ValueError, r"no key 'cand_ids' among"),
    (lambda b: b.update(extra=np.zeros((B, 1), np.float32)), ValueError, r"but got \"also \['label', 'extra'\]\""),
    (lambda b: b.update(history=(b["history"][0], b["history"][1][::-1].copy())), ValueError,
     r"the offsets of a ragged feature of table 'hist' \(batch item 4 'history'\) must be non-decreasing from 0 "
     r"to len\(values\)"),
    (lambda b: b.update(history=b["history"][0][:B]), ValueError, r"batch item 4 must be of shape \[B, ragged\]"),
    (lambda b: b.update(history=[[1, 2], [3]] * (B // 2)), ValueError, r"batch item 4 must be a rectangular array "
                                                                      r"\(ragged ids go as a tuple \(values, offsets\)"),
])
def test_a_bad_dict_batch_is_named_and_changes_nothing(graph_mode, change, exc, match):
    tables, model = _spec_model()
    batches = list(_spec_stream(ragged=True, n=8))
    model.online_train(batches[:3], dataset_sink_mode=False)
    before = _state(tables, model)
    bad = dict(batches[3])
    change(bad)
    with pytest.raises(exc, match=match):
        model.online_train([bad], dataset_sink_mode=False)
    after = _state(tables, model)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg=key)
    model.online_train(batches[3:], dataset_sink_mode=False)            # and it goes on
    assert model.step == 8


@pytest.mark.slow
@pytest.mark.live_backend
def test_a_three_table_pooled_model_serves_its_export_and_deltas_exactly(graph_mode, backend, tmp_path):
    tables, model = _spec_model()
    batches = list(_spec_stream(n=20, ragged=True))
    model.online_train(batches[:8], callbacks=[rb.EvictHook(evict_step_interval=4)], dataset_sink_mode=False)
    query = dict(batches[19])
    query.pop("label")
    full = model.export(str(tmp_path / "full"))
    _, fresh = _spec_model(seed=5)
    predictor = rb.Predictor(fresh.network, full)
    np.testing.assert_array_equal(predictor.predict(query), model.predict(query).asnumpy())
    model.online_train(batches[8:14], dataset_sink_mode=False)
    delta = model.export(str(tmp_path / "delta"), base=full)
    predictor.apply(delta)
    np.testing.assert_array_equal(predictor.predict(query), model.predict(query).asnumpy())
    _, other = _spec_model(seed=6)
    np.testing.assert_array_equal(rb.Predictor(other.network, model.export(str(tmp_path / "full2"))).predict(query),
                                  predictor.predict(query))


@pytest.mark.slow
@pytest.mark.parametrize("boost, amp", [("O1", "O0"), ("O2", "O0"), ("O0", "O2"), ("O1", "O3")])
def test_a_three_table_pooled_model_trains_at_every_boost_and_amp_level(graph_mode, boost, amp):
    tables, base = _spec_model()
    net = base.network
    kw = {"loss_scale_manager": rb.DynamicLossScaleManager(2 ** 10, 2, 50)} if amp != "O0" else {}
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), boost_level=boost,
                        amp_level=amp, **kw)
    batches = list(_spec_stream(n=6, ragged=True))
    model.online_train(batches[:1], dataset_sink_mode=False)
    before = {t.table_name: t.weight.copy() for t in tables}
    model.online_train(batches[1:], dataset_sink_mode=False)
    assert model.step == 6 and model.overflow_steps == 0
    for t in tables:                 # every table's rows were trained by its own optimizer, all finite
        rows = min(before[t.table_name].shape[0], t.weight.shape[0])
        assert np.isfinite(t.weight).all()
        assert not np.array_equal(before[t.table_name][:rows], t.weight[:rows]), t.table_name
    assert all(np.isfinite(p.asnumpy()).all() for p in net.trainable_params())


class _TwoBags(nn.Cell):
    """``construct(dense, a, b)``: two "sum" tables, each reading its own ragged feature."""

    def __init__(self):
        super().__init__()
        self.a = rb.HashEmbedding(DIM, 64, input_index=1, combiner="sum", name="ta", optimizer=rb.SparseSGD(0.05))
        self.b = rb.HashEmbedding(DIM, 64, input_index=2, combiner="sum", name="tb", optimizer=rb.SparseSGD(0.05))
        self.out = nn.Dense(2 + 2 * DIM, 1)

    def construct(self, dense, a, b):
        return self.out(ops.concat((dense, self.a(a), self.b(b)), 1))


def test_bad_offsets_of_one_of_two_ragged_features_name_the_feature_and_its_table(graph_mode):
    """Issue 61 item 12: bad offsets of the second of two ragged features were "the offsets of a ragged
    feature must be non-decreasing", naming neither. The error names the table, the batch item and, for a
    dict batch (a dataset's "<name>:offsets" column), its key; nothing trains."""
    ms.set_seed(0)
    net = _TwoBags()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(0)
    dense, label = rng.standard_normal((B, 2)).astype(np.float32), rng.integers(0, 2, (B, 1)).astype(np.float32)
    good = _to_ragged(_padded(rng, B, 3))
    bad = (good[0], good[1][::-1].copy())
    with pytest.raises(ValueError, match=r"For 'RecModel.train', the offsets of a ragged feature of table 'tb' "
                                         r"\(batch item 2\) must be non-decreasing from 0 to len\(values\)"):
        model.train(1, [(dense, good, bad, label)])
    columns = {"dense": dense, "a": good[0], "a" + rb.OFFSETS_SUFFIX: good[1], "b": bad[0],
               "b" + rb.OFFSETS_SUFFIX: bad[1], "label": label}
    with pytest.raises(ValueError, match=r"the offsets of a ragged feature of table 'tb' \(batch item 2 'b'\) must be "
                                         r"non-decreasing from 0 to len\(values\)"):
        model.train(1, [columns])
    assert model.step == 0 and len(net.a.cache) == len(net.b.cache) == 0
