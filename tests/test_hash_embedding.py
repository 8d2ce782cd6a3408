"""HashEmbedding (device side): sparse optimizers vs their dense numpy formulas, eviction re-init,
growth, exact checkpoint resume, the Rec SDK style API, EvictHook, and a training test (AUC)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import ParameterTuple, Tensor, nn, ops
from mindspore.train.callback import RunContext, _InternalCallbackParam

import recboost

DIM = 4


# ---- numpy references of the sparse rules (dense formulas applied to the touched rows) -----------
def ref_sgd(opt, w, slots, g, t):
    return w - np.float32(opt.learning_rate) * g, {}


def ref_adagrad(opt, w, slots, g, t):
    acc = slots["accum"] + g * g
    return w - np.float32(opt.learning_rate) * g / np.sqrt(acc), {"accum": acc}


def ref_adam(opt, w, slots, g, t):
    b1, b2 = np.float32(opt.beta1), np.float32(opt.beta2)
    m = b1 * slots["moment1"] + (1 - b1) * g
    v = b2 * slots["moment2"] + (1 - b2) * g * g
    lr_t = opt.learning_rate * np.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)
    return w - np.float32(lr_t) * m / (np.sqrt(v) + np.float32(opt.eps)), {"moment1": m, "moment2": v}


def ref_ftrl(opt, w, slots, g, t):
    acc, lin = slots["accum"], slots["linear"]
    acc_new = acc + g * g
    p = -opt.lr_power
    sigma = (acc_new ** p - acc ** p) / opt.learning_rate
    lin = lin + g - sigma * w
    quad = acc_new ** p / opt.learning_rate + 2 * opt.l2
    w_new = np.where(np.abs(lin) > opt.l1, (np.sign(lin) * opt.l1 - lin) / quad, 0.0)
    return w_new.astype(np.float32), {"accum": acc_new, "linear": lin}


OPTIMIZERS = [
    (lambda: recboost.SparseSGD(0.5), ref_sgd),
    (lambda: recboost.SparseAdagrad(0.3, initial_accumulator_value=0.2), ref_adagrad),
    (lambda: recboost.SparseAdam(0.05, beta1=0.8, beta2=0.95, eps=1e-6), ref_adam),
    (lambda: recboost.SparseFtrl(0.2, initial_accum=0.1, l1=0.01, l2=0.02), ref_ftrl),
]


@pytest.mark.parametrize("make, ref", OPTIMIZERS, ids=["sgd", "adagrad", "adam", "ftrl"])
def test_sparse_update_equals_dense_formula(backend, graph_mode, make, ref):
    opt = make()
    emb = recboost.HashEmbedding(DIM, 50, optimizer=opt, max_unique=8, seed=3)
    rng = np.random.default_rng(0)
    table = emb.table.asnumpy().copy()
    slots = {k: p.asnumpy().copy() for k, p in emb._slots.items()}
    for t in range(1, 5):
        ids = rng.integers(0, 12, size=(3, 2))
        unique_rows, inverse = emb.prepare(ids)
        k = np.count_nonzero(unique_rows != recboost.HASH_SCRATCH_ROW)
        np.testing.assert_array_equal(unique_rows[:k], np.unique(emb.cache.find(ids)))
        emb.load_rows(Tensor(unique_rows))
        np.testing.assert_array_equal(emb(Tensor(inverse)).asnumpy(), table[unique_rows][inverse])
        grad = np.zeros((8, DIM), np.float32)
        grad[:k] = rng.standard_normal((k, DIM)).astype(np.float32)
        emb.apply_gradients(Tensor(unique_rows), Tensor(grad))
        rows = unique_rows[:k]
        new_w, new_slots = ref(opt, table[rows], {n: s[rows] for n, s in slots.items()}, grad[:k], t)
        got = emb.table.asnumpy()
        touched = np.zeros(50, bool)
        touched[unique_rows] = True
        np.testing.assert_allclose(got[rows], new_w, rtol=2e-5, atol=1e-6)
        assert (got[rows] != table[rows]).any(axis=1).all()          # every touched row moved
        # untouched rows (all but the batch's rows and the scratch row) are bit-identical
        np.testing.assert_array_equal(got[~touched], table[~touched])
        table = got.copy()
        for name, s in slots.items():
            now = emb._slots[name].asnumpy()
            np.testing.assert_allclose(now[rows], new_slots[name], rtol=2e-5, atol=1e-7)
            np.testing.assert_array_equal(now[~touched], s[~touched])
            slots[name] = now.copy()


def test_eviction_reinitialises_rows_and_resets_slots(backend, ms_mode):
    emb = recboost.HashEmbedding(DIM, 20, eviction_threshold=1, max_unique=8, seed=5,
                                 optimizer=recboost.SparseAdagrad(0.1))
    twin_rng = np.random.default_rng(5)
    initial = twin_rng.standard_normal((20, DIM), dtype=np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(emb.table.asnumpy(), initial)
    for step, ids in enumerate([[10, 11], [12], [12], [12]]):
        unique_rows, _ = emb.prepare(np.array(ids), timestamp=step)
        emb.load_rows(Tensor(unique_rows))
        emb.apply_gradients(Tensor(unique_rows), Tensor(np.ones((8, DIM), np.float32)))
    accum = emb._slots["accum"].asnumpy()
    assert accum[2, 0] > 0.2 and accum[3, 0] > 0.2
    freed = emb.evict()                       # now = 3: ids 10, 11 (last seen 0) are stale
    np.testing.assert_array_equal(freed, [10, 11])
    reinit = twin_rng.standard_normal((2, DIM), dtype=np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(emb.table.asnumpy()[2:4], reinit)
    np.testing.assert_array_equal(emb._slots["accum"].asnumpy()[2:4], np.float32(0.2 - 0.1))
    assert emb._slots["accum"].asnumpy()[4, 0] > 0.2           # id 12's row keeps its state
    unique_rows, inverse = emb.prepare(np.array([99]), timestamp=4)
    assert unique_rows[0] == 2                                   # the freed row is reused


def test_growth_grows_table_and_slots(backend, graph_mode):
    emb = recboost.HashEmbedding(DIM, 4, use_dynamic_expansion=True, max_unique=8, seed=1)
    unique_rows, _ = emb.prepare(np.array([1, 2]))
    emb.load_rows(Tensor(unique_rows))
    emb.apply_gradients(Tensor(unique_rows), Tensor(np.ones((8, DIM), np.float32)))
    before = emb.table.asnumpy().copy()
    m1 = emb._slots["moment1"].asnumpy().copy()
    unique_rows, inverse = emb.prepare(np.array([3, 4, 5, 6, 7]))
    assert emb.capacity == emb.cache.capacity == 16 and emb.cache.stats()["grown"] == 2
    assert emb.table.shape == (16, DIM) and emb._slots["moment2"].shape == (16, DIM)
    np.testing.assert_array_equal(emb.table.asnumpy()[:4], before)
    np.testing.assert_array_equal(emb._slots["moment1"].asnumpy()[:4], m1)
    assert np.all(emb._slots["moment1"].asnumpy()[4:] == 0)
    emb.load_rows(Tensor(unique_rows))
    out = emb(Tensor(inverse)).asnumpy()
    np.testing.assert_array_equal(out, emb.table.asnumpy()[[4, 5, 6, 7, 8]])
    emb.apply_gradients(Tensor(unique_rows), Tensor(np.ones((8, DIM), np.float32)))
    assert not np.array_equal(emb.table.asnumpy()[8], out[4])


# ---- a small model and an honest train loop -----------------------------------------------------
class _Net(nn.Cell):
    def __init__(self, emb, fields):
        super().__init__()
        self.emb = emb
        self.dense = nn.Dense(fields * emb.embedding_size, 1, weight_init="normal", bias_init="zeros")
        self.flat = fields * emb.embedding_size

    def construct(self, inverse):
        e = self.emb(inverse)
        return self.dense(e.reshape(e.shape[0], self.flat)).squeeze(-1)


class _Step(nn.Cell):
    """Loss and grads w.r.t. [emb.active] + dense params; the dense params are updated here (SGD),
    the table by emb.apply_gradients outside (as the lead's train cells will do)."""

    def __init__(self, net, lr=0.05):
        super().__init__()
        self.net = net
        self.loss = nn.BCEWithLogitsLoss()
        self.dense = ParameterTuple(net.dense.trainable_params())
        self.params = ParameterTuple([net.emb.active] + list(self.dense))
        self.grad = ops.GradOperation(get_by_list=True)
        self.opt = nn.SGD(self.dense, learning_rate=lr)

    def forward(self, inverse, labels):
        return self.loss(self.net(inverse), labels)

    def construct(self, inverse, labels):
        loss = self.forward(inverse, labels)
        grads = self.grad(self.forward, self.params)(inverse, labels)
        self.opt(grads[1:])
        return loss, grads[0]


def _train(emb, step, batches, start=0, evict_every=0):
    losses = []
    for i, (ids, labels) in enumerate(batches):
        unique_rows, inverse = emb.prepare(ids, timestamp=start + i)
        rows_t = Tensor(unique_rows)
        emb.load_rows(rows_t)
        loss, grad = step(Tensor(inverse), Tensor(labels))
        emb.apply_gradients(rows_t, grad)
        losses.append(float(loss.asnumpy()))
        if evict_every and (start + i) % evict_every == evict_every - 1:
            emb.evict()
    return losses


def _click_data(seed, n_batches, batch, fields=4, vocab=3000):
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(99).standard_normal((fields, vocab)) * 1.2
    batches = []
    for _ in range(n_batches):
        local = np.minimum(rng.zipf(1.25, size=(batch, fields)), vocab) - 1
        logit = weights[np.arange(fields), local].sum(1) - 0.3
        labels = (rng.random(batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        ids = local + np.arange(fields) * 1_000_003 + 7          # distinct id ranges per field
        batches.append((ids.astype(np.int64), labels))
    return batches


def test_checkpoint_resume_is_bit_identical(backend, graph_mode):
    batches = _click_data(1, 12, 64)

    def fresh(seed=0):
        ms.set_seed(0)
        emb = recboost.HashEmbedding(DIM, 40, access_threshold=1, eviction_threshold=3,
                                     use_dynamic_expansion=True, max_unique=257, seed=seed)
        net = _Net(emb, 4)
        return emb, net, _Step(net)

    emb, net, step = fresh()
    _train(emb, step, batches, evict_every=4)
    want = emb.state_dict()
    want_dense = [p.asnumpy() for p in net.dense.trainable_params()]
    assert emb.cache.stats()["evicted"] > 0 and emb.cache.stats()["grown"] > 0

    emb, net, step = fresh()
    _train(emb, step, batches[:7], evict_every=4)
    saved = emb.state_dict()
    saved_dense = [p.asnumpy() for p in net.dense.trainable_params()]
    emb2, net2, step2 = fresh(seed=123)                 # a different init: everything must come back
    emb2.load_state_dict(saved)
    for p, data in zip(net2.dense.trainable_params(), saved_dense):
        p.set_data(Tensor(data))
    _train(emb2, step2, batches[7:], start=7, evict_every=4)
    got = emb2.state_dict()
    np.testing.assert_array_equal(got["table"], want["table"])
    for kind in ("slots", "scalars"):
        for name in want[kind]:
            np.testing.assert_array_equal(got[kind][name], want[kind][name])
    for name, value in want["cache"].items():
        np.testing.assert_array_equal(got["cache"][name], value)
    assert got["rng"] == want["rng"]
    for p, data in zip(net2.dense.trainable_params(), want_dense):
        np.testing.assert_array_equal(p.asnumpy(), data)


def _auc(scores, labels):
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


def _fit_and_auc(access_threshold, eviction_threshold, capacity, train, test):
    ms.set_seed(0)
    emb = recboost.HashEmbedding(8, capacity, access_threshold, eviction_threshold,
                                 use_dynamic_expansion=False, max_unique=4 * 512 + 1, seed=0,
                                 optimizer=recboost.SparseAdam(0.02))
    net = _Net(emb, 4)
    step = _Step(net, lr=0.05)
    losses = _train(emb, step, train, evict_every=10 if eviction_threshold >= 0 else 0)
    scores, labels = [], []
    for ids, y in test:
        unique_rows, inverse = emb.prepare(ids, is_train=False)
        emb.load_rows(Tensor(unique_rows))
        scores.append(net(Tensor(inverse)).asnumpy())
        labels.append(y)
    return _auc(np.concatenate(scores), np.concatenate(labels)), losses, emb


def test_training_with_admission_and_eviction_matches_exact_vocabulary(backend, graph_mode):
    train, test = _click_data(2, 120, 512), _click_data(3, 8, 512)
    exact_auc, exact_losses, exact = _fit_and_auc(-1, -1, 4 * 3000 + 2, train, test)
    hash_auc, hash_losses, emb = _fit_and_auc(2, 30, 4 * 3000 + 2, train, test)
    s = emb.cache.stats()
    assert s["rejected"] > 0 and s["evicted"] > 0            # both features were really on
    assert exact.cache.stats()["rejected"] == 0 and exact.cache.stats()["evicted"] == 0
    assert exact_auc > 0.7                                     # the task is learned
    assert np.mean(hash_losses[-20:]) < np.mean(hash_losses[:5])
    assert abs(hash_auc - exact_auc) <= 0.01, (hash_auc, exact_auc)


# ---- the Rec SDK style API -------------------------------------------------------------------------
def test_feature_spec_create_table_sparse_lookup(backend, ms_mode):
    spec = recboost.FeatureSpec("user", access_threshold=1, eviction_threshold=100)
    ts = recboost.FeatureSpec("ts", is_timestamp=True)
    assert spec.table_name == "user" and ts.index_key == "timestamp" and ts.table_name is None
    table = recboost.create_table("user", DIM, 30, feature_spec=spec, optimizer=recboost.SparseSGD(0.1),
                                  max_unique=9)
    assert isinstance(table, recboost.HashEmbedding) and table.table_name == "user"
    ms_rec = recboost.HashEmbeddingLookup(DIM, ms.int32, "zeros", capacity=10, access_threshold=0)
    assert isinstance(ms_rec, recboost.HashEmbedding) and not ms_rec.table.asnumpy().any()
    assert ms_rec.cache.access_threshold == 0
    with pytest.raises(ValueError, match="For 'HashEmbeddingLookup', 'param_init' must be one of"):
        recboost.HashEmbeddingLookup(DIM, param_init="uniform", capacity=10)
    with pytest.raises(TypeError, match="For 'HashEmbeddingLookup', the keyword arguments must be among"):
        recboost.HashEmbeddingLookup(DIM, capacity=10, vocab_size=3)
    assert table.cache.access_threshold == 1 and table.cache.eviction_threshold == 100
    out = recboost.sparse_lookup(table, np.array([[3, 3], [4, 5]]), timestamp=7)
    assert out.shape == (2, 2, DIM)
    t = table.table.asnumpy()
    np.testing.assert_array_equal(out.asnumpy(), t[[[2, 2], [0, 0]]])   # 3 admitted, 4 and 5 not
    ev = recboost.sparse_lookup(table, np.array([4, 3]), is_train=False)
    np.testing.assert_array_equal(ev.asnumpy(), t[[0, 2]])
    assert table.cache.find([4])[0] == 0 and table.cache.step == 1      # eval changed nothing
    with pytest.raises(ValueError, match="For 'create_table', 'access_threshold' must be -1 or the "
                                         "feature_spec's 1, but got 3"):
        recboost.create_table("user", DIM, 30, access_threshold=3, feature_spec=spec)
    with pytest.raises(TypeError, match="For 'FeatureSpec', the keyword arguments must be among"):
        recboost.FeatureSpec("x", bogus=1)
    with pytest.raises(ValueError, match="For 'FeatureSpec', 'access_threshold' must be an int >= -1"):
        recboost.FeatureSpec("x", access_threshold=-3)


def test_evict_hook_by_step_and_by_time(backend, graph_mode):
    emb = recboost.HashEmbedding(DIM, 30, eviction_threshold=2, max_unique=5, name="a")
    net = nn.SequentialCell([emb])
    params = _InternalCallbackParam()
    params.train_network = net
    ctx = RunContext(params)
    hook = recboost.EvictHook(evict_time_interval=None, evict_step_interval=3)
    for step in range(1, 7):
        emb.prepare(np.array([step]))         # time = the cache's step: 0, 1, ...
        params.cur_step_num = step
        hook.on_train_step_end(ctx)
    assert hook.evictions == 2                 # at steps 3 and 6
    assert emb.cache.stats()["evicted"] == 3   # ids 1 (at step 3) and 2, 3 (at step 6)
    by_time = recboost.EvictHook(evict_time_interval=100, tables=[emb])
    emb2 = recboost.HashEmbedding(DIM, 30, eviction_threshold=50, max_unique=5)
    hook2 = recboost.EvictHook(evict_time_interval=100, tables=[emb2])
    for step, ts in enumerate([1000, 1040, 1090, 1101, 1150], start=1):
        emb2.prepare(np.array([ts]), timestamp=ts)
        params.cur_step_num = step
        hook2.on_train_step_end(ctx)
    assert hook2.evictions == 1 and emb2.cache.stats()["evicted"] == 2    # at 1101: 1000, 1040
    off = recboost.EvictHook(evict_enable=False, evict_step_interval=1, tables=[emb2])
    off.on_train_step_end(ctx)
    assert emb2.cache.stats()["evicted"] == 2 and by_time.evictions == 0
    with pytest.raises(TypeError, match="For 'EvictHook', every item of 'tables' must be a HashEmbedding"):
        recboost.EvictHook(tables=[net])
    with pytest.raises(ValueError, match="'evict_step_interval' must be an int >= 1"):
        recboost.EvictHook(evict_step_interval=0)


def test_hash_embedding_errors(backend, graph_mode):
    with pytest.raises(ValueError, match="For 'HashEmbedding', 'capacity' must be an int >= 3"):
        recboost.HashEmbedding(DIM, 2)
    with pytest.raises(ValueError, match="For 'HashCache', 'access_threshold' must be an int >= -1"):
        recboost.HashEmbedding(DIM, 10, access_threshold=-2)
    with pytest.raises(TypeError, match="'optimizer' must be a SparseSGD"):
        recboost.HashEmbedding(DIM, 10, optimizer=nn.Adam)
    with pytest.raises(ValueError, match="For 'SparseAdam', 'beta1' must be a number <= 1"):
        recboost.SparseAdam(beta1=1.5)
    emb = recboost.HashEmbedding(DIM, 100, max_unique=3)
    with pytest.raises(ValueError, match="the number of distinct ids of a batch must be < max_unique=3"):
        emb.prepare(np.arange(5))
    assert emb.cache.step == 0 and len(emb.cache) == 0         # refused before the cache changed
    unique_rows, _ = emb.prepare(np.array([7, 7, 8, 8]))       # 4 ids but 2 distinct: fits
    assert unique_rows.tolist() == [2, 3, 1]
    other = recboost.HashEmbedding(DIM + 1, 100, max_unique=3)
    with pytest.raises(ValueError, match="state\\['embedding_size'\\]"):
        other.load_state_dict(emb.state_dict())


def test_step_inlined_in_one_graph(backend, graph_mode):
    """load_rows / apply_gradients inside another Cell's construct (how train cells use them)."""
    emb = recboost.HashEmbedding(DIM, 50, max_unique=9, optimizer=recboost.SparseSGD(0.5),
                                 use_dynamic_expansion=True)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emb = emb

        def construct(self, inverse):
            return self.emb(inverse).sum()

    class Step(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.grad = ops.GradOperation(get_by_list=True)
            self.params = ParameterTuple([emb.active])

        def construct(self, rows, inverse):
            rows = ops.depend(rows, self.net.emb.load_rows(rows))
            loss = self.net(inverse)
            grads = self.grad(self.net, self.params)(inverse)
            return ops.depend(loss, self.net.emb.apply_gradients(rows, grads[0]))

    step = Step(Net())
    unique_rows, inverse = emb.prepare(np.array([[1, 2], [2, 3]]))
    before = emb.table.asnumpy().copy()
    loss = step(Tensor(unique_rows), Tensor(inverse)).asnumpy()
    np.testing.assert_allclose(loss, before[[[2, 3], [3, 4]]].sum(), rtol=1e-6)
    delta = emb.table.asnumpy() - before
    np.testing.assert_allclose(delta[2:5], -0.5 * np.array([[1.0], [2.0], [1.0]]) * np.ones(DIM), rtol=1e-6)
    assert not delta[5:].any() and not delta[:1].any()
    gen = emb.generation
    for k in range(8):                                     # 67 ids: grows from 50 to 100 rows
        emb.prepare(np.arange(100 + 8 * k, 108 + 8 * k))
    assert emb.generation == gen + 1 and emb.capacity == 100
    unique_rows, inverse = emb.prepare(np.array([[150, 151], [151, 1]]))
    step = Step(Net())                                     # rebuilt after growth
    before = emb.table.asnumpy().copy()
    step(Tensor(unique_rows), Tensor(inverse)).asnumpy()
    changed = np.flatnonzero((emb.table.asnumpy() != before).any(1))
    np.testing.assert_array_equal(changed, np.sort(emb.cache.find([1, 150, 151])))


def test_two_tables_in_one_network_have_distinct_parameter_names(backend, graph_mode):
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = recboost.HashEmbedding(DIM, 6, use_dynamic_expansion=True)   # lazy max_unique
            self.b = recboost.HashEmbedding(DIM, 6)

        def construct(self, ia, ib):
            return self.a(ia).sum() + self.b(ib).sum()

    net = Net()
    for k in range(4):                              # a grows (new Parameters) before its first step
        ua, ia = net.a.prepare(np.array([2 * k, 2 * k + 1]))
    ub, ib = net.b.prepare(np.array([3, 4]))
    assert net.a.capacity == 12
    names = [p.name for p in net.get_parameters()]
    assert len(names) == len(set(names)) == 2 * 6
    net.a.load_rows(Tensor(ua))
    net.b.load_rows(Tensor(ub))
    grads = ops.GradOperation(get_by_list=True)(net, ParameterTuple([net.a.active, net.b.active]))(
        Tensor(ia), Tensor(ib))
    np.testing.assert_array_equal(grads[0].asnumpy(), np.array([[1] * DIM, [1] * DIM, [0] * DIM]))
