"""Weighted ids (issue #39 item 1): a pooled feature with a weight per id (``WeightedIds``, padded or
ragged) and the "max" combiner, through HashEmbedding: against float64 references, against MindSpore's
own ``nn.MultiFieldEmbeddingLookup`` (sum/mean/max with weights, forward and every row's update after
SGD and Adam steps), weights 1 being the unweighted table bit for bit, and bad weights refused."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

import recboost as rb
from _stopping import StopAfter
from test_hash_embedding import TableIds, _OneRank, ref_adam, ref_sgd
from test_host_kernels import FAST, KINDS, PY, _bits, _fresh_state, _run, needs_fast

DIM = 4
PAD = 0


def _table(combiner, padding_id=PAD, capacity=96, optimizer=None, **kw):
    return rb.HashEmbedding(DIM, capacity, combiner=combiner, padding_id=padding_id,
                            optimizer=optimizer or rb.SparseSGD(0.5), init_stddev=0.5, name="t", **kw)


def _weighted_batch(rng, bags, length, vocab=40, positive=False, distinct=False):
    """[bags, length] ids in 1..vocab-1 with trailing pads (bag 0 all padding, bag 1 full) and their
    weights (0 at the pads; > 0 with ``positive``); ``distinct``: no id twice in a bag."""
    ids = np.stack([rng.choice(np.arange(1, vocab), length, replace=not distinct) for _ in range(bags)])
    keep = rng.integers(1, length + 1, size=bags)
    keep[0], keep[1] = 0, length
    ids[np.arange(length)[None, :] >= keep[:, None]] = PAD
    weights = rng.uniform(0.2, 2.0, ids.shape) if positive else rng.standard_normal(ids.shape)
    weights[ids == PAD] = 0
    return ids.astype(np.int64), weights.astype(np.float32)


def _reference(rows_of, ids, weights, combiner):
    """float64 reference pooling: ``rows_of(ids)`` gives each real id's row."""
    out = np.zeros(ids.shape[:-1] + (DIM,))
    for at in np.ndindex(*ids.shape[:-1]):
        real = ids[at] != PAD
        if not real.any():
            continue
        w = weights[at][real].astype(np.float64)
        e = rows_of(ids[at][real]).astype(np.float64) * w[:, None]
        if combiner == "max":
            out[at] = e.max(0)
            continue
        div = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[at] = e.sum(0) / div if div else 0
    return out


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
def test_weighted_combiners_pool_and_train_like_a_float64_reference(backend, combiner):
    """Forward: weighted sum, mean (sum w*e / sum w), sqrtn (sum w*e / sqrt(sum w^2)), max of w*e;
    backward: each id's row moves by -lr * (the bag's gradient times w / the divisor), or, for max, by
    -lr * g * w at the columns its w*e was the max; padded and ragged forms give the same bits."""
    rng = np.random.default_rng(3)
    ids, weights = _weighted_batch(rng, 24, 5, positive=combiner == "mean", distinct=combiner == "max")
    emb = _table(combiner)
    batch = emb.prepare(rb.WeightedIds(ids, weights))
    emb.take(batch)
    before = emb.weight.copy()
    pooled = emb.gather(batch)
    assert pooled.shape == (24, DIM) and pooled.dtype == np.float32
    want = _reference(lambda i: before[emb.cache.find(i)], ids, weights, combiner)
    np.testing.assert_allclose(pooled, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(pooled[0], 0)                            # all padding: zeros

    real = ids != PAD                                                      # the same bags, ragged
    values = ids[real]
    offsets = np.concatenate([[0], np.cumsum(real.sum(1))]).astype(np.int64)
    ragged = emb.prepare(rb.WeightedIds(values, weights[real], offsets), is_train=False)
    np.testing.assert_array_equal(emb.gather(ragged).view(np.uint32), pooled.view(np.uint32))

    grad = rng.standard_normal((24, DIM)).astype(np.float32)
    emb.apply_gradients(batch, grad)
    step = np.zeros((emb.capacity, DIM))
    for b in range(24):
        r, w = emb.cache.find(ids[b][real[b]]), weights[b][real[b]].astype(np.float64)
        if combiner == "max" and r.size:
            e = before[r].astype(np.float64) * w[:, None]
            np.add.at(step, r[e.argmax(0)], np.eye(DIM) * (grad[b] * w[e.argmax(0)]))
            continue
        div = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum()), "max": 1.0}[combiner] if r.size else 1
        np.add.at(step, r, grad[b][None, :] * (w / div)[:, None])
    np.testing.assert_allclose(emb.weight, before - 0.5 * step, rtol=1e-5, atol=2e-6)
    touched = np.unique(emb.cache.find(values))
    assert (emb.weight[touched] != before[touched]).any()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
def test_weights_of_one_are_the_unweighted_table_bit_for_bit(backend, combiner):
    """WeightedIds with every weight 1 pool and train exactly as the plain ids (and a weighted feature
    beside a plain one of the same table weighs the plain ids 1)."""
    rng = np.random.default_rng(4)
    plain, weighted, mixed = _table(combiner), _table(combiner), _table(combiner)
    for _ in range(3):
        ids, _ = _weighted_batch(rng, 16, 6, distinct=combiner == "max")
        other, _ = _weighted_batch(rng, 16, 6, distinct=combiner == "max")
        grads = [rng.standard_normal((16, DIM)).astype(np.float32) for _ in range(2)]
        outs = []
        for emb, features in ((plain, [ids, other]), (weighted, [rb.WeightedIds(ids, np.ones(ids.shape)),
                                                                  rb.WeightedIds(other, np.ones(other.shape))]),
                              (mixed, [rb.WeightedIds(ids, np.ones(ids.shape, np.float32)), other])):
            batch = emb.prepare_features(features)
            emb.take(batch)
            outs.append([a.copy() for a in emb.gather(batch)])
            emb.apply_gradients(batch, grads)
        for got in outs[1:]:
            for a, b in zip(outs[0], got):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        for emb in (weighted, mixed):
            np.testing.assert_array_equal(plain.weight.view(np.uint32), emb.weight.view(np.uint32))


def test_max_pooling_ties_take_the_first_position_and_the_gradient_reaches_it_alone(backend):
    emb = _table("max", optimizer=rb.SparseSGD(1.0))
    ids = np.array([[5, 5, 7], [PAD, PAD, PAD]])
    batch = emb.prepare(ids)
    emb.take(batch)
    before = emb.weight.copy()
    r5, r7 = emb.cache.find(np.array([5, 7]))
    pooled = emb.gather(batch)
    np.testing.assert_array_equal(pooled[0], np.maximum(before[r5], before[r7]))
    np.testing.assert_array_equal(pooled[1], 0)                             # an empty bag: zeros
    emb.apply_gradients(batch, np.ones((2, DIM), np.float32))
    first = before[r5] >= before[r7]                                        # id 5's columns (a tie: 5, first)
    np.testing.assert_array_equal(emb.weight[r5], before[r5] - first)       # one gradient, not two (5 twice)
    np.testing.assert_array_equal(emb.weight[r7], before[r7] - ~first)
    fresh = emb.prepare(ids)
    emb.take(fresh)
    with pytest.raises(ValueError, match=r"the batch of a max-pooled table must be gathered first"):
        emb.apply_gradients(fresh, np.ones((2, DIM), np.float32))


# ---- the fused update kernels: the bags' weights and arg-max summed per row, no per-position gradient ---
def _kernel_bags(rng, k, nb, d, capacity, max_len=5):
    """Random bags over ``capacity`` rows (repeated rows, the reserved rows 0 and 1, empty bags, weights 0
    among them), a bag gradient and scale (of either sign), and the max pooling's arg-max over a random
    table (``k.gather_max``)."""
    lengths = rng.integers(0, max_len + 1, size=nb)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, capacity, size=int(offsets[-1])).astype(np.int32)
    rows[: min(2, rows.size)] = [0, 1][: min(2, rows.size)]
    weights = np.where(rng.random(rows.size) < 0.1, 0, rng.standard_normal(rows.size)).astype(np.float32)
    grad = rng.standard_normal((nb, d)).astype(np.float32)
    scale = np.where(rng.random(nb) < 0.5, rng.random(nb), -rng.random(nb)).astype(np.float32)
    table = rng.standard_normal((capacity, d)).astype(np.float32)
    argmax = {w_key: np.empty((nb, d), np.int64) for w_key in ("plain", "weighted")}
    for w_key, w in (("plain", None), ("weighted", weights)):
        k.gather_max(table, rows, offsets, w, np.empty((nb, d), np.float32), argmax[w_key])
    return rows, offsets, weights, grad, scale, argmax


def _bag_options(mode, weights, argmax):
    """The kernels' ``weights`` / ``argmax`` keywords for ``mode`` ("plain": none, the unweighted sum)."""
    return {"plain": {}, "weights": {"weights": weights}, "max": {"argmax": argmax["plain"]},
            "weighted_max": {"weights": weights, "argmax": argmax["weighted"]}}[mode]


@pytest.mark.fallback          # as test_host_kernels' kernel tests (it holds their bags case, "plain")
@pytest.mark.parametrize("mode", ["plain", "weights", "max", "weighted_max"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_with_weights_and_argmax_equal_the_spread_gradient(backend, kind, mode):
    """Every sparse_*_update given the bags (``plain``: alone, the unweighted sum; or with ``weights``
    and/or ``argmax``) moves rows and slots as the same kernel given the per-position gradient the table
    built before (position p of bag b: ``(grad[b] * scale[b]) * weights[p]``, +0.0 off the arg-max)
    without bags, bit for bit; with the rows' preparation (clipping, decay) too. The plain case runs at
    16 columns (whole vectors), the others at 6 (a remainder)."""
    rng = np.random.default_rng(21)
    d, capacity = (16, 40) if mode == "plain" else (6, 30)
    fused = _fresh_state(rng, capacity, d)
    spread = {key: value.copy() for key, value in fused.items()}
    mark = np.full(capacity, -1, np.int32)
    for step in range(3):
        rows, offsets, weights, grad, scale, argmax = _kernel_bags(rng, backend, 40, d, capacity)
        given = _bag_options(mode, weights, argmax)
        g_pos = (grad * scale[:, None])[np.repeat(np.arange(40), np.diff(offsets))]
        if "weights" in given:
            g_pos = g_pos * weights[:, None]
        if "argmax" in given:
            am = given["argmax"][np.repeat(np.arange(40), np.diff(offsets))]
            g_pos = np.where(am == np.arange(rows.size)[:, None], g_pos, np.float32(0))
        uniq, inverse = backend.unique_inverse(rows, mark)
        prep = {"clip_norm": np.float32(0.8), "weight_decay": np.float32(0.01)} if step == 2 else None
        _run(backend, kind, fused, uniq, inverse, grad, np.empty((uniq.size + 1, d), np.float32), offsets, scale,
             prep=prep, weighted=given)
        _run(backend, kind, spread, uniq, inverse, np.ascontiguousarray(g_pos), np.empty((uniq.size, d), np.float32),
             prep=prep)
        for name in fused:
            np.testing.assert_array_equal(_bits(fused[name]), _bits(spread[name]), err_msg=name)
    assert not np.array_equal(fused["w"], _fresh_state(np.random.default_rng(21), capacity, d)["w"])
    if mode == "plain":
        return
    with pytest.raises(ValueError, match="weights and argmax are per bag: give them with offsets and scale"):
        _run(backend, kind, fused, uniq, inverse, np.ascontiguousarray(g_pos), np.empty((uniq.size, d), np.float32),
             weighted=given)


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 33])
@pytest.mark.parametrize("mode", ["weights", "max", "weighted_max"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_with_weights_and_argmax_compiled_equal_twin(kind, mode, d):
    """The compiled update kernels and their numpy twins given ``weights`` / ``argmax``: the same bits
    (rows and slots, many repeated rows); no positions at all changes nothing."""
    rng = np.random.default_rng(300 + d)
    capacity = 200
    py_state = _fresh_state(rng, capacity, d)
    fast_state = {key: value.copy() for key, value in py_state.items()}
    mark = np.full(capacity, -1, np.int32)
    for _ in range(3):
        rows, offsets, weights, grad, scale, argmax = _kernel_bags(rng, FAST, 150, d, capacity, max_len=10)
        given = _bag_options(mode, weights, argmax)
        uniq, inverse = FAST.unique_inverse(rows, mark)
        for k, state in ((PY, py_state), (FAST, fast_state)):
            _run(k, kind, state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), offsets, scale,
                 weighted=given)
        for name in py_state:
            np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]), err_msg=name)
    before = {key: value.copy() for key, value in fast_state.items()}
    for k in (FAST, PY):                                                  # 3 empty bags
        _run(k, kind, fast_state, np.empty(0, np.int32), np.empty(0, np.int32), np.ones((3, d), np.float32),
             np.empty((0, d), np.float32), np.zeros(4, np.int64), np.ones(3, np.float32),
             weighted=_bag_options(mode, np.empty(0, np.float32), {"plain": np.full((3, d), -1, np.int64),
                                                                    "weighted": np.full((3, d), -1, np.int64)}))
    for name in before:
        np.testing.assert_array_equal(fast_state[name], before[name])


# ---- against MindSpore's MultiFieldEmbeddingLookup (deprecated, still in 2.10, runs on CPU) -----------
def _multifield(table, vocab, fields, combiner):
    ref = np.zeros((vocab, DIM), np.float32)
    rb.init_rows(np.arange(1, vocab, dtype=np.int64), table.seed, float(table.init_stddev), ref[1:])
    net = nn.MultiFieldEmbeddingLookup(vocab, DIM, field_size=fields, param_init=Tensor(ref),
                                       operator=combiner.upper(), target="CPU")
    return net, ref


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
def test_weighted_bags_match_mindspore_multifield_embedding_lookup(backend, pynative, combiner, optimizer):
    """Three steps of [B, F, L] weighted ids (padding: id 0, weight 0 for MindSpore): the pooled rows
    equal MultiFieldEmbeddingLookup's output, and after each step every row equals the dense
    reference: MindSpore's gradient of its table, put through the optimizer's formula on the rows
    the batch touched (recboost's sparse optimizers are lazy)."""
    vocab, bags, fields, length = 30, 5, 2, 4
    opt = rb.SparseSGD(0.5) if optimizer == "sgd" else rb.SparseAdam(0.05, beta1=0.8, beta2=0.95, eps=1e-6)
    ref_step = ref_sgd if optimizer == "sgd" else ref_adam
    emb = _table(combiner, optimizer=opt, capacity=64)
    net, ref = _multifield(emb, vocab, fields, combiner)
    slots = {name: np.zeros((vocab, DIM), np.float32) for name in ("moment1", "moment2")}
    rng = np.random.default_rng(7)
    field_ids = Tensor(np.repeat(np.arange(fields), length)[None, :].repeat(bags, 0).astype(np.int32))
    for t in range(1, 4):
        ids, weights = _weighted_batch(rng, bags * fields, length, vocab, positive=combiner == "mean",
                                       distinct=combiner == "max")
        ids, weights = ids.reshape(bags, fields, length), weights.reshape(bags, fields, length)
        batch = emb.prepare(rb.WeightedIds(ids, weights))
        emb.take(batch)
        pooled = emb.gather(batch)
        flat_ids = Tensor(ids.reshape(bags, -1).astype(np.int32))
        flat_w = Tensor(weights.reshape(bags, -1))
        np.testing.assert_allclose(pooled, net(flat_ids, flat_w, field_ids).asnumpy(), rtol=1e-5, atol=1e-6)
        upstream = rng.standard_normal((bags, fields, DIM)).astype(np.float32)
        loss = lambda: (net(flat_ids, flat_w, field_ids) * Tensor(upstream)).sum()  # noqa: E731
        (g,) = ms.grad(lambda *a: loss(), grad_position=None, weights=net.trainable_params())()
        g = g.asnumpy()
        if g.shape != (vocab, DIM):                    # the sparse lookup's gradient: one row per position
            assert g.shape == (ids.size, DIM)
            dense = np.zeros((vocab, DIM), np.float32)
            np.add.at(dense, ids.reshape(-1), g)
            g = dense
        emb.apply_gradients(batch, upstream)
        touched = np.unique(ids[ids != PAD])
        ref[touched], new_slots = ref_step(opt, ref[touched], {k: v[touched] for k, v in slots.items()},
                                           g[touched], t)
        for name, value in new_slots.items():
            slots[name][touched] = value
        net.embedding_table.set_data(Tensor(ref))
        seen = np.unique(ids[ids != PAD]) if t == 1 else np.union1d(seen, ids[ids != PAD])
        np.testing.assert_allclose(emb.weight[emb.cache.find(seen)], ref[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharding", ["data_parallel", "row_wise"])
@pytest.mark.parametrize("combiner", ["sum", "max"])
def test_weighted_bags_through_the_exchange_layouts_equal_one_process(backend, combiner, sharding):
    """A weighted table laid out data-parallel or row-wise over a world of one rank (the exchange's step
    messages, no communication) gathers and trains as the one-process table: the weights stay with
    this rank's positions."""
    rng = np.random.default_rng(8)
    make = lambda: _table(combiner, optimizer=rb.SparseAdam(0.05), capacity=80)  # noqa: E731
    local, laid = make(), make()
    ex = _OneRank()
    laid.set_layout(sharding, 0, 1, ex)
    seen = np.empty(0, np.int64)
    for step in range(4):
        ids, weights = _weighted_batch(rng, 12, 4, distinct=combiner == "max")
        grad = rng.standard_normal((12, DIM)).astype(np.float32)
        want = local.prepare(rb.WeightedIds(ids, weights))
        local.take(want)
        rows = local.gather(want)
        local.apply_gradients(want, grad)
        parts = laid.check_features([rb.WeightedIds(ids, weights)])
        entries = [TableIds(None, [p.ids for p in parts])]
        shared, = ex.share_ids(ex.share_headers(0, [1], entries), entries)
        batch = laid.prepare_step(parts, None, True, (), shared)
        laid.take(batch)
        np.testing.assert_allclose(laid.gather(batch), rows, rtol=1e-6, atol=1e-7)
        laid.apply_gradients(batch, grad)
        seen = np.union1d(seen, ids[ids != PAD])
    np.testing.assert_allclose(laid.weight[laid.cache.find(seen)], local.weight[local.cache.find(seen)],
                               rtol=1e-5, atol=1e-7)


# ---- bad weights ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, exc, message", [
    (lambda: _table("sum").prepare(rb.WeightedIds([[1, 2]], [[1.0]])), ValueError,
     r"For 'HashEmbedding.prepare', the weights of table 't' must be the ids' shape \(1, 2\), but got "
     r"'shape \(1, 1\)'"),
    (lambda: _table("sum").prepare(rb.WeightedIds([[1, 2]], [[1.0, np.nan]])), ValueError,
     r"the weights of table 't' must be finite numbers float32 holds \(0, or of magnitude 1.4e-45 to 3.4e38\), "
     r"but got 'nan at position 1'"),
    (lambda: _table("mean").prepare(rb.WeightedIds([[1, 2]], [[1.0, -0.5]])), ValueError,
     r"the weights of table 't' must be >= 0 for the combiner 'mean' .*, but got '-0.5 at position 1'"),
    # float64 weights float32 rounds to infinity or to 0 (they pooled zeros and trained nothing): named as given
    (lambda: _table("mean").prepare(rb.WeightedIds([[1, 2]], np.array([[1e-46, 3e-46]]))), ValueError,
     r"the weights of table 't' must be finite numbers float32 holds .*, but got '1e-46 at position 0'"),
    (lambda: _table("sum").prepare(rb.WeightedIds([[1, 2]], np.array([[1.0, 1e39]]))), ValueError,
     r"the weights of table 't' must be finite numbers float32 holds .*, but got '1e\+39 at position 1'"),
    (lambda: _table("sum").prepare(rb.WeightedIds([[1, 2]], [["a", "b"]])), TypeError,
     r"the weights of table 't' must be real numbers of the ids' shape \(1, 2\), but got 'dtype <U1'"),
    (lambda: _table(None, None).prepare(rb.WeightedIds([[1, 2]], [[1.0, 1.0]])), ValueError,
     r"weighted ids \(WeightedIds\) of table 't' must be a table with a combiner"),
    (lambda: _table("sum").prepare(rb.WeightedIds([1, 2, 3], [1.0, 1.0], [0, 3])), ValueError,
     r"the weights of table 't' must be the ids' shape \(3,\), but got 'shape \(2,\)'"),
    (lambda: _table("sum").prepare(rb.WeightedIds([1, 2, 3], [1.0, 1.0, 1.0], [0, 2])), ValueError,
     r"the offsets of a ragged feature of table 't' must be non-decreasing from 0 to len\(values\) = 3"),
])
def test_bad_weights_are_refused_naming_the_table(backend, make, exc, message):
    with pytest.raises(exc, match=message):
        make()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
def test_bfloat16_weights_pool_and_train_as_their_float32_values(backend, combiner):
    """A bfloat16 Tensor of weights (a model's half-precision scores): float32 holds each of its values, so the
    bags pool and train as with the float32 weights of the same values, bit for bit; a bfloat16 infinity is
    refused as a float32 one, naming its position."""
    ids = np.array([[3, 7, 9], [4, 4, PAD]])
    weights = np.array([[0.5, 1.5, 3.0], [0.25, 2.0, 0.0]], np.float32)        # each exact in bfloat16
    grad = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM) / 8
    states = []
    for given in (weights, Tensor(weights).astype(ms.bfloat16)):
        table = _table(combiner)
        batch = table.prepare(rb.WeightedIds(ids, given))
        table.take(batch)
        pooled, taken = table.gather(batch), table.state_dict()["table"]
        table.apply_gradients(batch, grad)
        states.append((pooled, table.state_dict()["table"]))
        assert not np.array_equal(states[-1][1], taken)        # (it trained)
    np.testing.assert_array_equal(states[1][0], states[0][0])
    np.testing.assert_array_equal(states[1][1], states[0][1])
    infinite = Tensor(np.array([[1.0, np.inf, 1.0], [1.0, 1.0, 0.0]], np.float32)).astype(ms.bfloat16)
    with pytest.raises(ValueError, match=r"the weights of table 't' must be finite .*, but got 'inf at position 1'"):
        _table(combiner).prepare(rb.WeightedIds(ids, infinite))


# ---- through RecModel: dict batches by feature name, checkpoints (a replayed batch keeps its weights) ----
class _WeightedNet(nn.Cell):
    def __init__(self, combiner, seed):
        super().__init__()
        self.hist = rb.create_table("hist", DIM, 64, feature_spec=rb.FeatureSpec("history", table_name="hist"),
                                    combiner=combiner, padding_id=PAD, use_dynamic_expansion=True,
                                    optimizer=rb.SparseAdam(0.02), seed=seed)
        self.fc = nn.Dense(DIM + 2, 1, weight_init="normal")
        self.concat = ops.Concat(1)

    def construct(self, dense, history):
        return self.fc(self.concat((self.hist(history), dense)))


def _weighted_model(combiner, seed=0):
    ms.set_seed(seed)
    net = _WeightedNet(combiner, seed)
    return net.hist, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _weighted_stream(ragged=False):
    rng = np.random.default_rng(5)
    while True:
        ids, weights = _weighted_batch(rng, 32, 5, vocab=100, positive=True)
        history = rb.WeightedIds(ids, weights)
        if ragged:
            real = ids != PAD
            history = rb.WeightedIds(ids[real], weights[real],
                                     np.concatenate([[0], np.cumsum(real.sum(1))]).astype(np.int64))
        yield {"history": history, "dense": rng.standard_normal((32, 2)).astype(np.float32),
               "label": rng.integers(0, 2, (32, 1)).astype(np.float32)}


def _table_and_dense(table, model):
    out = {"dense:" + p.name: p.asnumpy() for p in model.state_parameters()}
    state = table.state_dict()
    out.update(table=state["table"], keys=state["cache"]["keys"], **{"slot:" + k: v for k, v in state["slots"].items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("combiner", ["sqrtn", "max"])
def test_a_weighted_feature_trains_resumes_and_serves_exactly_through_recmodel(graph_mode, tmp_path, combiner):
    """RecModel takes a WeightedIds batch item by the feature's name: ragged and padded runs are the
    same bits; a run resumed from a checkpoint (written with prefetched weighted batches to replay)
    ends where the uninterrupted one does; Predictor serves the export as RecModel.predict does."""
    table_a, model_a = _weighted_model(combiner)
    model_a.online_train(_weighted_stream(), callbacks=[StopAfter(10)], dataset_sink_mode=False)
    table_r, model_r = _weighted_model(combiner)
    model_r.online_train(_weighted_stream(ragged=True), callbacks=[StopAfter(10)],
                         dataset_sink_mode=False)
    table_b, model_b = _weighted_model(combiner)
    ckpt = rb.OnlineCheckpoint(str(tmp_path / "ckpt"), every_steps=4, keep=1, save_on_end=False)
    model_b.online_train(_weighted_stream(), callbacks=[ckpt, StopAfter(6)], dataset_sink_mode=False)
    table_c, model_c = _weighted_model(combiner, seed=3)
    model_c.online_train(_weighted_stream(), callbacks=[StopAfter(10)], dataset_sink_mode=False,
                         resume_from=str(tmp_path / "ckpt"))
    a = _table_and_dense(table_a, model_a)
    for other in (_table_and_dense(table_r, model_r), _table_and_dense(table_c, model_c)):
        for key in a:
            np.testing.assert_array_equal(a[key], other[key], err_msg=key)
    batch = next(_weighted_stream())
    batch.pop("label")
    model_a.export(str(tmp_path / "bundle"))
    _, fresh = _weighted_model(combiner)
    served = rb.Predictor(fresh.network, str(tmp_path / "bundle")).predict(batch)
    np.testing.assert_array_equal(served, model_a.predict(batch).asnumpy())
    with pytest.raises(ValueError, match=r"batch item 1 must be of shape WeightedIds of \[B, 5\] like the "
                       r"first batch, but got 'shape \(32, 5\)'"):
        model_a.online_train(iter([dict(batch, history=batch["history"].ids, label=np.zeros((32, 1), np.float32))]),
                             dataset_sink_mode=False)


@pytest.mark.slow
def test_a_mindspore_dataset_gives_weights_as_a_column_beside_the_ids(graph_mode):
    """A MindSpore dataset's column "history:weights" (WEIGHTS_SUFFIX) joins the column "history": the
    run equals the one fed WeightedIds, bit for bit; a weights column without its ids column is named."""
    batches = [b for _, b in zip(range(6), _weighted_stream())]
    rows = [(b["history"].ids, b["history"].weights, b["dense"], b["label"]) for b in batches]
    table_a, model_a = _weighted_model("mean")
    model_a.train(1, batches)
    names = ["history", "history" + rb.WEIGHTS_SUFFIX, "dense", "label"]
    data = ms.dataset.GeneratorDataset(lambda: iter(rows), column_names=names, shuffle=False)
    table_d, model_d = _weighted_model("mean")
    model_d.train(1, data)
    assert model_a.step == model_d.step == 6
    a, d = _table_and_dense(table_a, model_a), _table_and_dense(table_d, model_d)
    for key in a:
        np.testing.assert_array_equal(a[key], d[key], err_msg=key)
    lone = {"dense": rows[0][2], "history" + rb.WEIGHTS_SUFFIX: rows[0][1]}
    with pytest.raises(ValueError, match=r"the weights column 'history:weights' of a dict batch must be beside "
                                         r"its ids column 'history'"):
        model_d.predict(lone)


@pytest.mark.slow
def test_a_mindspore_dataset_gives_ragged_weighted_ids_as_offsets_and_weights_columns(graph_mode):
    """A MindSpore dataset's columns "history" (the values), "history:offsets" (OFFSETS_SUFFIX) and
    "history:weights" (one per value) join as WeightedIds(values, weights, offsets): online_train on a
    GeneratorDataset ends with the rows and dense weights of the run fed those WeightedIds directly, bit
    for bit; weights of another length than the values are refused naming the column and both counts."""
    batches = [b for _, b in zip(range(5), _weighted_stream(ragged=True))]
    table_a, model_a = _weighted_model("sum")
    model_a.online_train(iter(batches), dataset_sink_mode=False)
    rows = [(b["history"].ids, b["history"].offsets, b["history"].weights, b["dense"], b["label"]) for b in batches]
    names = ["history", "history" + rb.OFFSETS_SUFFIX, "history" + rb.WEIGHTS_SUFFIX, "dense", "label"]
    assert len({r[0].size for r in rows}) > 1                      # bags of another total length each batch
    data = ms.dataset.GeneratorDataset(lambda: iter(rows), column_names=names, shuffle=False)
    table_d, model_d = _weighted_model("sum")
    model_d.online_train(data, dataset_sink_mode=False)
    assert model_a.step == model_d.step == 5
    a, d = _table_and_dense(table_a, model_a), _table_and_dense(table_d, model_d)
    for key in a:
        np.testing.assert_array_equal(a[key], d[key], err_msg=key)
    ids, offsets, weights = rows[0][:3]
    short = dict(zip(names[:4], (ids, offsets, weights[:-1], rows[0][3])))
    with pytest.raises(ValueError, match=r"For 'RecModel.predict', the weights column 'history:weights' must be "
                                         r"%d weights, one per value of the ragged feature 'history', but got "
                                         r"'%d weights'" % (ids.size, ids.size - 1)):
        model_d.predict(short)
    padded = next(_weighted_stream())["history"]
    with pytest.raises(ValueError, match=r"the weights column 'history:weights' must be of the shape \(32, 5\) of "
                                         r"its ids column 'history', but got 'shape \(32, 4\)'"):
        model_d.predict({"history": padded.ids, "history" + rb.WEIGHTS_SUFFIX: padded.weights[:, :4],
                         "dense": rows[0][3][:32]})
    with pytest.raises(ValueError, match=r"the offsets column 'history:offsets' of a dict batch must be beside its "
                                         r"ids column 'history'"):
        model_d.predict({"dense": rows[0][3], "history" + rb.OFFSETS_SUFFIX: offsets})


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("magnitude", [1e20, 1e-25, 1e-40, 1e38, "mixed"])
def test_extreme_finite_weights_pool_and_train_like_a_float64_reference(backend, combiner, magnitude):
    """Issue 61 item 3: finite weights far from 1 (1e20, 1e-25, denormal 1e-40, 1e38, and bags mixing
    1e-30 with 1e30) pool and train as the float64 reference: the divisors Σw and Σw² no longer
    overflow or underflow float32 (sqrtn pooled zeros, mean ±inf); both backends give the same bits."""
    rng = np.random.default_rng(5)
    ids, weights = _weighted_batch(rng, 24, 5, positive=combiner == "mean")
    scale = 10.0 ** rng.integers(-30, 31, ids.shape) if magnitude == "mixed" else magnitude
    weights = (weights.astype(np.float64) * scale).astype(np.float32)
    assert np.isfinite(weights).all()
    emb = _table(combiner)
    batch = emb.prepare(rb.WeightedIds(ids, weights))
    emb.take(batch)
    before = emb.weight.copy()
    pooled = emb.gather(batch).copy()
    want = _reference(lambda i: before[emb.cache.find(i)], ids, weights, combiner)
    assert np.isfinite(pooled).all() and np.abs(want[1]).max() > 0.01
    np.testing.assert_allclose(pooled, want, rtol=2e-6, atol=1e-6)
    twin = np.empty_like(pooled)                    # the numpy twin, on the batch's bags: the same bits
    PY.gather_pool(before, batch.rows, batch.offsets, batch.scale, twin, batch.weights)
    np.testing.assert_array_equal(_bits(twin), _bits(pooled))

    grad = rng.standard_normal((24, DIM)).astype(np.float32)
    emb.apply_gradients(batch, grad)
    step = np.zeros((emb.capacity, DIM))
    real = ids != PAD
    for b in range(24):
        r, w = emb.cache.find(ids[b][real[b]]), weights[b][real[b]].astype(np.float64)
        div = {"mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner] if r.size else 1
        np.add.at(step, r, grad[b][None, :] * (w / div)[:, None])
    np.testing.assert_allclose(emb.weight, before - 0.5 * step, rtol=1e-5, atol=2e-6)
    twin = before.copy()
    PY.sparse_sgd_update(twin, batch.uniq, batch.inverse, grad, np.zeros((batch.uniq.size, DIM), np.float32),
                         0.5, batch.offsets, batch.scale, weights=batch.weights)
    np.testing.assert_array_equal(_bits(twin), _bits(emb.weight))


def test_tables_reading_one_item_each_check_its_weights_with_their_own_combiner(graph_mode):
    """Two tables pool one weighted item, "sum" then "mean": a negative weight is refused naming the "mean"
    table, before anything changes (the item was checked once, by the first table's combiner: the "mean"
    table divided by a sum of weights near 0 and its rows blew up), as it is with the tables swapped."""
    class Two(nn.Cell):
        def __init__(self, first, second):
            super().__init__()
            self.ta = rb.HashEmbedding(4, 256, input_index=0, name="ta", combiner=first, padding_id=0)
            self.tb = rb.HashEmbedding(4, 256, input_index=0, name="tb", combiner=second, padding_id=0)
            self.out = nn.Dense(8, 1)

        def construct(self, x):
            return self.out(ops.concat((self.ta(x), self.tb(x)), 1))

    ids = np.array([[3, 7, 5], [4, 6, 8]], np.int64)
    batch = (rb.WeightedIds(ids, np.array([[1, -1.999, 1], [1, 1, 1]], np.float32)), np.ones((2, 1), np.float32))
    for first, second, named in (("sum", "mean", "tb"), ("mean", "sum", "ta")):
        ms.set_seed(0)
        net = Two(first, second)
        model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
        before = {t: t.weight.copy() for t in (net.ta, net.tb)}
        with pytest.raises(ValueError, match=r"the weights of table '%s' must be >= 0 for the combiner 'mean'" % named):
            model.online_train([batch], dataset_sink_mode=False)
        assert model.step == 0 and all(len(t.cache) == 0 and np.array_equal(t.weight, w) for t, w in before.items())
        with pytest.raises(ValueError, match=r"the weights of table '%s' must be >= 0 for the combiner 'mean'" % named):
            model.predict(batch[0])


def test_a_weights_column_beside_a_column_no_table_reads_is_refused_naming_it(graph_mode):
    """Issue 61 item 13: a "dense:weights" column wrapped the dense column as WeightedIds, refused as
    "batch item 0 must be a numeric array, but got dtype('O')", naming no column. Refused naming the
    weights column, the column it was joined to and the tables' feature columns; nothing trains."""
    batches = [b for _, b in zip(range(3), _weighted_stream())]
    table, model = _weighted_model("mean")
    model.train(1, batches[:2])
    before = _table_and_dense(table, model)
    bad = dict(batches[2], **{"dense" + rb.WEIGHTS_SUFFIX: np.ones((32, 2), np.float32)})
    for offsets in (False, True):
        if offsets:
            bad = dict(batches[2], **{"dense" + rb.OFFSETS_SUFFIX: np.arange(33)})
        with pytest.raises(ValueError, match=r"For 'RecModel.train', the %s column 'dense:%s' of a dict batch must be "
                                             r"beside the ids column of a hash table's feature \(one of \['history'\]\), "
                                             r"but got \"beside 'dense', which no hash table reads\"" % (
                                                 ("offsets",) * 2 if offsets else ("weights",) * 2)):
            model.train(1, [bad])
        with pytest.raises(ValueError, match=r"'dense:.*' of a dict batch must be beside the ids column"):
            model.predict({k: v for k, v in bad.items() if k != "label"})
    assert model.step == 2
    after = _table_and_dense(table, model)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg=key)
