"""HashEmbedding (host tables): the fused sparse optimizers vs their dense numpy formulas, id-keyed
initial rows, eviction, growth, exact checkpoint resume through the train cell's row gradients, the
Rec SDK style API, EvictHook, and a training test (AUC against an exact vocabulary)."""
import collections
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn
from mindspore.train.callback import RunContext

import recboost
from _faults import differences, table_snapshot

DIM = 4
# what a rank gives the exchange for one table: its fields, as the step pipeline names them
TableIds = collections.namedtuple("TableIds", "time ids labels", defaults=(None,))


# ---- numpy references of the sparse rules (dense formulas applied to the touched rows) -----------
def ref_sgd(opt, w, slots, g, t):
    return w - np.float32(opt.learning_rate) * g, {}


def ref_adagrad(opt, w, slots, g, t):
    acc = slots["accum"] + g * g
    return w - np.float32(opt.learning_rate) * g / np.sqrt(acc), {"accum": acc}


def ref_rowwise_adagrad(opt, w, slots, g, t):
    acc = slots["accum"] + (g * g).mean(axis=1, keepdims=True)             # one accumulator per row
    return w - np.float32(opt.learning_rate) * g / (np.sqrt(acc) + np.float32(opt.eps)), {"accum": acc}


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
    (lambda: recboost.SparseRowWiseAdagrad(0.3, initial_accumulator_value=0.05, eps=1e-4), ref_rowwise_adagrad),
    (lambda: recboost.SparseAdam(0.05, beta1=0.8, beta2=0.95, eps=1e-6), ref_adam),
    (lambda: recboost.SparseFtrl(0.2, initial_accum=0.1, l1=0.01, l2=0.02), ref_ftrl),
]


def test_every_registered_sparse_optimizer_has_a_dense_reference():
    """The registry (``sparse_optimizers``) and the optimizers tested against a dense formula here are the same:
    a new optimizer is not live untested."""
    assert [type(make()).__name__ for make, _ in OPTIMIZERS] == list(recboost.sparse_optimizers())


@pytest.mark.parametrize("make, ref", OPTIMIZERS, ids=["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
def test_sparse_update_equals_dense_formula(backend, make, ref):
    opt = make()
    emb = recboost.HashEmbedding(DIM, 50, optimizer=opt, max_unique=2, seed=3, init_stddev=0.5)
    rng = np.random.default_rng(0)
    for t in range(1, 5):
        ids = rng.integers(0, 12, size=(3, 2))                      # repeated ids in every batch
        batch = emb.prepare(ids)
        emb.take(batch)
        table = emb.weight.copy()
        slots = {k: a.copy() for k, a in emb.slots.items()}
        rows = emb.gather(batch)
        np.testing.assert_array_equal(rows, table[emb.cache.find(ids)])
        grad = rng.standard_normal((3, 2, DIM)).astype(np.float32)
        emb.apply_gradients(batch, grad)
        touched = np.unique(emb.cache.find(ids))
        summed = np.zeros((50, DIM), np.float32)
        np.add.at(summed, emb.cache.find(ids).ravel(), grad.reshape(-1, DIM))   # one update per row
        new_w, new_slots = ref(opt, table[touched], {n: s[touched] for n, s in slots.items()},
                               summed[touched], t)
        np.testing.assert_allclose(emb.weight[touched], new_w, rtol=2e-5, atol=1e-6)
        assert (emb.weight[touched] != table[touched]).any(axis=1).all()      # every touched row moved
        untouched = np.ones(50, bool)
        untouched[touched] = False
        np.testing.assert_array_equal(emb.weight[untouched], table[untouched])
        for name, s in slots.items():
            np.testing.assert_allclose(emb.slots[name][touched], new_slots[name], rtol=2e-5, atol=1e-7)
            np.testing.assert_array_equal(emb.slots[name][untouched], s[untouched])

def test_an_init_stddev_whose_rows_float32_cannot_hold_is_refused(backend):
    """Initial rows lie within 3.46 init_stddev: the largest init_stddev is float32's largest over 4, whose
    rows are finite on many ids; above it (3e38 gave Inf rows) a ValueError names it."""
    largest = float(np.finfo(np.float32).max) / 4
    with pytest.raises(ValueError, match=r"For 'HashEmbedding', 'init_stddev' must be a number in \[0, 8\.507"):
        recboost.HashEmbedding(DIM, 64, init_stddev=3e38)
    recboost.HashEmbedding(DIM, 64, init_stddev=largest)
    rows = np.empty((100000, DIM), np.float32)
    recboost.init_rows(np.arange(100000, dtype=np.int64), 0, largest, rows)
    assert np.isfinite(rows).all() and np.abs(rows).max() > largest


def test_initial_rows_are_keyed_by_id_and_come_back_after_eviction(backend):
    emb = recboost.HashEmbedding(DIM, 20, eviction_threshold=1, seed=5, init_stddev=0.1,
                                 optimizer=recboost.SparseAdagrad(0.1, initial_accumulator_value=0.2))
    assert not emb.weight.any()                                  # default row (and free rows): zeros
    initial = np.empty((3, DIM), np.float32)
    recboost.init_rows(np.array([10, 11, 12], np.int64), 5, 0.1, initial)
    assert np.abs(initial).max() > 0
    for step, ids in enumerate([[10, 11], [12], [12], [12]]):
        batch = emb.prepare(np.array(ids), timestamp=step)
        emb.take(batch)
        if step == 0:
            np.testing.assert_array_equal(emb.weight[2:4], initial[:2])
        emb.apply_gradients(batch, np.ones((len(ids), DIM), np.float32))
    assert emb.slots["accum"][2, 0] > 0.2 and emb.slots["accum"][4, 0] > 0.2
    np.testing.assert_array_equal(emb.evict(), [10, 11])        # now = 3: ids 10, 11 are stale
    batch = emb.prepare(np.array([11, 10]), timestamp=4)          # re-admitted, rows swapped
    emb.take(batch)
    np.testing.assert_array_equal(batch.rows, [2, 3])
    np.testing.assert_array_equal(emb.weight[[3, 2]], initial[:2])   # each id its own initial row
    np.testing.assert_array_equal(emb.slots["accum"][2:4], np.float32(0.2))   # slots reset
    assert emb.slots["accum"][4, 0] > 0.2                        # id 12's row keeps its state
    other = recboost.HashEmbedding(DIM, 50, seed=5, init_stddev=0.1)
    batch = other.prepare(np.array([1, 2, 3, 12]))
    other.take(batch)
    np.testing.assert_array_equal(other.weight[batch.rows[3]], initial[2])   # same id, other row


@pytest.mark.parametrize("optimizer, row_dtype", [(recboost.SparseAdagrad(0.5, 0.2), "float32"),
                                                   (recboost.SparseRowWiseAdagrad(0.5), "float32"),
                                                   (recboost.SparseFtrl(0.5, l1=0.01), "float32"),
                                                   (recboost.SparseFtrl(0.5, lr_power=-0.3), "bfloat16")],
                         ids=["adagrad", "rowwise", "ftrl", "ftrl_p03_bfloat16"])
def test_the_growth_bound_covers_every_row_through_growth_eviction_and_loads(backend, optimizer, row_dtype):
    """What the step's overflow check reads of a table's growing slots (``growth_bound``) comes from running
    bounds, not a pass over the rows: through updates, growth, eviction and re-admission, and a loaded state,
    the accumulators' bound equals their largest entry over every row (they never shrink) and FTRL's
    |linear| and |weight| bounds are at least theirs (bfloat16 rows: as stored, after the rounding); each
    reported bound is the power of two at or above. The table's arrays cannot be written through."""
    emb = recboost.HashEmbedding(DIM, 40, eviction_threshold=3, seed=2, init_stddev=0.5, optimizer=optimizer,
                                 row_dtype=row_dtype, use_dynamic_expansion=True)
    rng = np.random.default_rng(0)
    up = lambda x: 2.0 ** np.ceil(np.log2(float(x))) if x > 0 else 0.0

    def check():
        largest = emb.store.largest()
        exact = [emb.slots["accum"].max(), np.abs(emb.slots["linear"]).max() if "linear" in emb.slots else 0.0,
                 np.abs(emb.store.rows_float32(np.arange(emb.capacity))).max()]
        assert largest[0] == exact[0]
        if isinstance(optimizer, recboost.SparseFtrl):
            assert largest[1] >= exact[1] and largest[2] * (1 + 2.0 ** -7) >= exact[2] > 0
            bound = emb.growth_bound()
            assert (bound.accum, bound.linear) == (up(largest[0]), up(largest[1]))
            assert bound.weight == up(largest[2] * (1 + 2.0 ** -7) if row_dtype == "bfloat16" else largest[2])
        else:
            assert emb.growth_bound() == (up(largest[0]), 0.0, 0.0, 0.0, 1.0, float("inf"), 0.0)
    for step in range(12):
        ids = rng.integers(0, 30 + 10 * step, 24)
        batch = emb.prepare(ids, timestamp=step)
        emb.take(batch)
        check()
        grad = rng.normal(scale=3.0, size=(ids.size, DIM)).astype(np.float32)
        emb.apply_gradients(batch, grad)
        check()
        if step % 4 == 3:
            emb.evict()
    assert emb.capacity > 40                                    # it grew
    state = emb.state_dict()
    state["slots"]["accum"][5] = np.float32(1e6)                # a loaded state: its bounds are computed afresh
    emb.load_state_dict(state)
    assert emb.store.largest()[0] == np.float32(1e6)
    check()
    with pytest.raises(ValueError, match="read-only"):
        emb.weight[2] = 0
    with pytest.raises(ValueError, match="read-only"):
        emb.slots["accum"][2] = 0


def test_a_row_wise_slot_is_one_value_per_row_through_growth_reset_and_state(backend):
    """SparseRowWiseAdagrad's accumulator is (capacity, 1): it grows with the rows, a re-admitted id's
    is reset, a state round-trips it, and a state with an accumulator per value is refused."""
    opt = recboost.SparseRowWiseAdagrad(0.1, initial_accumulator_value=0.25)
    emb = recboost.HashEmbedding(DIM, 4, eviction_threshold=0, use_dynamic_expansion=True, optimizer=opt, seed=1)
    assert emb.slots["accum"].shape == (4, 1) and (emb.slots["accum"] == np.float32(0.25)).all()
    for step, ids in enumerate([[1, 2], [3, 4, 5, 6, 7], [1]]):
        batch = emb.prepare(np.array(ids), timestamp=step)
        emb.take(batch)
        emb.apply_gradients(batch, np.ones((len(ids), DIM), np.float32))
    assert emb.capacity == 16 and emb.slots["accum"].shape == (16, 1)
    np.testing.assert_array_equal(emb.slots["accum"][emb.cache.find([1, 3]), 0], [2.25, 1.25])   # + mean(1*1)
    assert (emb.slots["accum"][9:] == np.float32(0.25)).all()                            # grown rows: fresh
    emb.evict(3)                                                   # every id is stale at 3
    batch = emb.prepare(np.array([3]), timestamp=4)
    emb.take(batch)
    assert emb.slots["accum"][batch.rows[0], 0] == np.float32(0.25)                      # re-admitted: reset
    state = emb.state_dict()
    other = recboost.HashEmbedding(DIM, 16, eviction_threshold=0, use_dynamic_expansion=True, seed=2,
                                   optimizer=recboost.SparseRowWiseAdagrad(0.1, initial_accumulator_value=0.25))
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.slots["accum"], emb.slots["accum"])
    bad = dict(state, slots={"accum": np.zeros((16, DIM), np.float32)})
    with pytest.raises(ValueError, match=r"slots.*accum.*float32 of shape \(16, 1\)"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="eps"):
        recboost.SparseRowWiseAdagrad(eps=0)
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        recboost.SparseRowWiseAdagrad(initial_accumulator_value=-1)


def test_bytes_per_row_is_read_from_the_arrays_and_docs_tables_md_shows_it(backend):
    """``bytes_per_row`` per optimizer and row storage, with and without an eviction policy, equals
    what trained tables' arrays hold per row (rows and slots: nbytes / capacity; the cache entry:
    the ids' state fields, padded to 8 bytes as the compiled map entry is, and its sizeof when
    compiled); the table in docs/tables.md is these figures, line by line."""
    import os
    optimizers = [kind(0.1) for kind in recboost.sparse_optimizers().values()]       # each registered one
    lines = []
    for opt in optimizers:
        got = {}
        for row_dtype, policy in (("float32", None), ("bfloat16", None), ("bfloat16", "lru")):
            emb = recboost.create_table("t", 16, 64, optimizer=opt, eviction_policy=policy, row_dtype=row_dtype)
            for step in range(3):
                batch = emb.prepare(np.arange(step, 70 + step))                # fills the table: replacements
                emb.take(batch)
                emb.apply_gradients(batch, np.ones((70, 16), np.float32))
            state = emb.cache.state_dict()
            entry = sum(state[k].itemsize for k in ("keys", "rows", "counts", "last_seen"))
            entry = -(-entry // 8) * 8                                          # int64 fields: 8-byte aligned
            if recboost.FAST_BACKEND:
                assert recboost._fast.HASH_ENTRY_BYTES == entry
                assert recboost._fast.HASH_POLICY_ROW_BYTES == 3 * state["counts"].itemsize
            b = got[row_dtype, policy] = emb.bytes_per_row
            assert b["row"] == emb.weight.nbytes // emb.capacity == {"float32": 4, "bfloat16": 2}[row_dtype] * 16
            assert b["slots"] == sum(a.nbytes for a in emb.slots.values()) // emb.capacity
            assert b["cache"] == entry + (0 if policy is None else 3 * state["counts"].itemsize)
            assert b["total"] == b["row"] + b["slots"] + b["cache"]
        f32, b16, b16p = got["float32", None], got["bfloat16", None], got["bfloat16", "lru"]
        lines.append("| `%s` | %d | %d | %d | %d | %d | %d | %d |" % (
            type(opt).__name__, f32["row"], b16["row"], f32["slots"], f32["cache"], f32["total"], b16["total"],
            b16p["total"]))
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "tables.md")).read().splitlines()
    assert [line for line in doc if line.startswith("| `Sparse")] == lines


def test_growth_grows_rows_and_slots(backend):
    emb = recboost.HashEmbedding(DIM, 4, use_dynamic_expansion=True, seed=1)
    batch = emb.prepare(np.array([1, 2]))
    emb.take(batch)
    emb.apply_gradients(batch, np.ones((2, DIM), np.float32))
    before, m1 = emb.weight.copy(), emb.slots["moment1"].copy()
    batch = emb.prepare(np.array([3, 4, 5, 6, 7]))
    assert emb.cache.capacity == 16 and emb.capacity == 4        # rows follow on the training side
    emb.take(batch)
    assert emb.capacity == 16 and emb.cache.stats()["grown"] == 2
    assert emb.weight.shape == (16, DIM) and emb.slots["moment2"].shape == (16, DIM)
    np.testing.assert_array_equal(emb.weight[:4], before)
    np.testing.assert_array_equal(emb.slots["moment1"][:4], m1)
    assert not emb.slots["moment1"][4:].any()
    out = emb.gather(batch)
    np.testing.assert_array_equal(out, emb.weight[[4, 5, 6, 7, 8]])
    emb.apply_gradients(batch, np.ones((5, DIM), np.float32))
    assert not np.array_equal(emb.weight[8], out[4])


# ---- a small model trained through the train cell's row gradients -----------------------------------
class _Net(nn.Cell):
    def __init__(self, emb, fields):
        super().__init__()
        self.emb = emb
        self.dense = nn.Dense(fields * emb.embedding_size, 1, weight_init="normal", bias_init="zeros")
        self.flat = fields * emb.embedding_size

    def construct(self, rows):
        e = self.emb(rows)
        return self.dense(e.reshape(e.shape[0], self.flat)).squeeze(-1)


def _step_cell(net, lr=0.05):
    """recboost's loss-scaled train cell at scale 1: dense SGD inside, the rows' gradient returned."""
    loss = recboost._WithLossCell(net, nn.BCEWithLogitsLoss())
    return recboost.TrainOneStepWithLossScaleCell(loss, nn.SGD(net.trainable_params(), lr), None,
                                                  row_inputs=(0,))


def _train(emb, step, batches, start=0, evict_every=0):
    losses = []
    for i, (ids, labels) in enumerate(batches):
        batch = emb.prepare(ids, timestamp=start + i)
        emb.take(batch)
        loss, overflow, _, grad = step(Tensor(emb.gather(batch)), Tensor(labels))
        assert not bool(overflow.asnumpy())
        emb.apply_gradients(batch, grad)
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


@pytest.mark.slow
def test_row_gradient_of_the_train_cell_is_the_sum_per_row(backend, graph_mode):
    emb = recboost.HashEmbedding(DIM, 30, optimizer=recboost.SparseSGD(0.5), seed=2)
    net = _Net(emb, 2)
    step = _step_cell(net, lr=0.0)
    ids = np.array([[5, 6], [6, 6], [7, 5]])
    batch = emb.prepare(ids)
    emb.take(batch)
    before = emb.weight.copy()
    w = net.dense.weight.asnumpy().reshape(2, DIM)
    labels = np.array([1, 0, 1], np.float32)
    _, _, _, grad = step(Tensor(emb.gather(batch)), Tensor(labels))
    logits = (before[batch.rows].reshape(3, 2 * DIM) @ w.reshape(-1))
    dlogit = (1 / (1 + np.exp(-logits)) - labels) / 3                     # BCE mean
    np.testing.assert_allclose(grad.asnumpy(), dlogit[:, None, None] * w[None], rtol=1e-5, atol=1e-7)
    emb.apply_gradients(batch, grad)
    summed = {5: 0, 6: 0, 7: 0}
    for (i, j), x in np.ndenumerate(ids):
        summed[x] = summed[x] + dlogit[i] * w[j]
    for x, g in summed.items():
        row = emb.cache.find([x])[0]
        np.testing.assert_allclose(emb.weight[row], before[row] - 0.5 * g, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, row_dtype", [(recboost.SparseAdam, "float32"),
                                                  (recboost.SparseRowWiseAdagrad, "float32"),
                                                  (recboost.SparseAdam, "bfloat16")],
                         ids=["adam", "rowwise_adagrad", "adam_bfloat16"])
@pytest.mark.live_backend
def test_checkpoint_resume_is_bit_identical(backend, graph_mode, optimizer, row_dtype):
    batches = _click_data(1, 12, 64)

    def fresh(seed=0):
        ms.set_seed(0)
        emb = recboost.HashEmbedding(DIM, 40, access_threshold=1, eviction_threshold=3, row_dtype=row_dtype,
                                     use_dynamic_expansion=True, seed=seed, optimizer=optimizer(0.05))
        net = _Net(emb, 4)
        return emb, net, _step_cell(net)

    emb, net, step = fresh()
    _train(emb, step, batches, evict_every=4)
    want = emb.state_dict()
    want_dense = [p.asnumpy() for p in net.dense.trainable_params()]
    assert emb.cache.stats()["evicted"] > 0 and emb.cache.stats()["grown"] > 0

    emb, net, step = fresh()
    _train(emb, step, batches[:7], evict_every=4)
    saved = emb.state_dict()
    saved_dense = [p.asnumpy() for p in net.dense.trainable_params()]
    emb2, net2, step2 = fresh(seed=123)                 # another seed: everything must come back
    emb2.load_state_dict(saved)
    assert emb2.seed == 0
    for p, data in zip(net2.dense.trainable_params(), saved_dense):
        p.set_data(Tensor(data))
    _train(emb2, step2, batches[7:], start=7, evict_every=4)
    got = emb2.state_dict()
    for key in ("table", "live"):
        np.testing.assert_array_equal(got[key], want[key])
    for kind in ("slots", "scalars"):
        for name in want[kind]:
            np.testing.assert_array_equal(got[kind][name], want[kind][name])
    for name, value in want["cache"].items():
        np.testing.assert_array_equal(got["cache"][name], value)
    for p, data in zip(net2.dense.trainable_params(), want_dense):
        np.testing.assert_array_equal(p.asnumpy(), data)


def _auc(scores, labels):
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


def _fit_and_auc(access_threshold, eviction_threshold, capacity, train, test, row_dtype="float32"):
    ms.set_seed(0)
    emb = recboost.HashEmbedding(8, capacity, access_threshold, eviction_threshold, seed=0,
                                 optimizer=recboost.SparseAdam(0.02), row_dtype=row_dtype)
    net = _Net(emb, 4)
    losses = _train(emb, _step_cell(net), train, evict_every=10 if eviction_threshold >= 0 else 0)
    scores, labels = [], []
    for ids, y in test:
        batch = emb.prepare(ids, is_train=False)
        scores.append(net(Tensor(emb.gather(batch))).asnumpy())
        labels.append(y)
    return _auc(np.concatenate(scores), np.concatenate(labels)), losses, emb


@pytest.mark.slow
@pytest.mark.live_backend
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


@pytest.mark.slow
@pytest.mark.live_backend
def test_bfloat16_rows_train_as_well_as_float32(backend, graph_mode):
    """The same seeded model and stream with bfloat16 rows (stochastic rounding) and float32 rows:
    held-out AUC within 0.001. Measured on six seeded streams (``_click_data`` seeds 2-7, held out
    102-107): differences -8e-5 .. +2e-5, so the bound is over 10x the largest."""
    train, test = _click_data(2, 120, 512), _click_data(3, 8, 512)
    auc32, _, emb32 = _fit_and_auc(-1, -1, 4 * 3000 + 2, train, test)
    auc16, losses16, emb16 = _fit_and_auc(-1, -1, 4 * 3000 + 2, train, test, "bfloat16")
    assert emb16.weight.dtype == np.uint16 and emb16.store.rounds == len(train)
    assert auc32 > 0.8 and np.mean(losses16[-20:]) < np.mean(losses16[:5])
    assert abs(auc16 - auc32) <= 0.001, (auc16, auc32)
    rows = emb16.cache.find(train[0][0][:, 0])
    np.testing.assert_array_equal(emb16.rows_float32(rows).view(np.uint32) >> 16, emb16.weight[rows])


def test_bfloat16_rows_store_16_bits_and_serve_float32(backend):
    """bfloat16 storage: uint16 rows, initial rows the float32 ones rounded to nearest, gather (ids
    and bags) gives their exact float32 values, the state holds the 16-bit rows, a state of the
    other row_dtype is refused unless strict=False (then converted)."""
    emb = recboost.create_table("t", DIM, 32, optimizer=recboost.SparseSGD(0.1), seed=4, init_stddev=0.3,
                                row_dtype="bfloat16")
    assert emb.weight.dtype == np.uint16 and emb.bytes_per_row["row"] == 2 * DIM
    ids = np.array([[5, 6], [7, 5]])
    batch = emb.prepare(ids)
    emb.take(batch)
    init = np.empty((3, DIM), np.float32)
    recboost.init_rows(np.array([5, 6, 7], np.int64), 4, 0.3, init)
    want = np.zeros((3, DIM), np.uint16)
    recboost._py_bf16_encode(init, np.arange(3, dtype=np.int32), want, 0, 0, False)
    np.testing.assert_array_equal(emb.weight[emb.cache.find([5, 6, 7])], want)
    rows = emb.gather(batch)
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows.view(np.uint32) >> 16, emb.weight[batch.rows].reshape(2, 2, DIM))
    emb.apply_gradients(batch, np.ones((2, 2, DIM), np.float32))
    state = emb.state_dict()
    assert state["table"].dtype == np.uint16 and state["rounds"] == 1 and state["settings"]["row_dtype"] == "bfloat16"
    pooled = recboost.HashEmbedding(DIM, 32, combiner="sum", row_dtype="bfloat16", optimizer=recboost.SparseSGD(0.1))
    pooled.load_state_dict(state, strict=False)                  # (the combiner differs)
    got = pooled.gather(pooled.prepare(ids, is_train=False))     # bags of bfloat16 rows
    want = np.stack([emb.rows_float32(emb.cache.find(bag)).sum(0) for bag in ids])
    np.testing.assert_array_equal(got, want)
    plain = recboost.HashEmbedding(DIM, 32, optimizer=recboost.SparseSGD(0.1), init_stddev=0.3)
    with pytest.raises(ValueError, match="the setting 'row_dtype' of hash table 'hash_embedding' must be 'bfloat16'"):
        plain.load_state_dict(state)
    assert not plain.weight.any()
    plain.load_state_dict(state, strict=False)                   # goes on in float32: the exact values
    assert plain.weight.dtype == np.float32
    np.testing.assert_array_equal(plain.weight, emb.rows_float32(np.arange(32)))
    with pytest.raises(ValueError, match="row_dtype"):
        recboost.HashEmbedding(DIM, 32, row_dtype="float16")


# ---- the Rec SDK style API -------------------------------------------------------------------------
def test_feature_spec_create_table_sparse_lookup(backend):
    spec = recboost.FeatureSpec("user", access_threshold=2, eviction_threshold=101)    # mx_rec's: count >= 2
    ts = recboost.FeatureSpec("ts", is_timestamp=True)
    assert spec.table_name == "user" and ts.index_key == "timestamp" and ts.table_name is None
    table = recboost.create_table("user", DIM, 30, feature_spec=spec, optimizer=recboost.SparseSGD(0.1),
                                  max_unique=9)
    assert isinstance(table, recboost.HashEmbedding) and table.table_name == "user"
    ms_rec = recboost.HashEmbeddingLookup(DIM, ms.int32, "zeros", capacity=10, permit_filter_value=2)
    batch = ms_rec.prepare(np.array([1, 2]))
    ms_rec.take(batch)
    assert isinstance(ms_rec, recboost.HashEmbedding) and not ms_rec.weight.any()
    assert ms_rec.cache.access_threshold == 1            # a row at the second lookup
    with pytest.raises(ValueError, match="For 'HashEmbeddingLookup', 'param_init' must be 'normal', "):
        recboost.HashEmbeddingLookup(DIM, param_init="uniform", capacity=10)
    with pytest.raises(TypeError, match="For 'HashEmbeddingLookup', the keyword arguments must be among"):
        recboost.HashEmbeddingLookup(DIM, capacity=10, vocab_size=3)
    half = recboost.HashEmbeddingLookup(DIM, param_dtype=ms.bfloat16, capacity=10)      # mindspore_rec's name
    assert half.row_dtype == "bfloat16" and half.weight.dtype == np.uint16
    assert recboost.HashEmbeddingLookup(DIM, capacity=10).row_dtype == "float32"
    with pytest.raises(ValueError, match=r"'row_dtype' must be 'bfloat16' as 'param_dtype' \(BFloat16\) says"):
        recboost.HashEmbeddingLookup(DIM, param_dtype=ms.bfloat16, capacity=10, row_dtype="float32")
    with pytest.raises(ValueError, match="'param_dtype' must be one of"):
        recboost.HashEmbeddingLookup(DIM, param_dtype=ms.float16, capacity=10)
    assert table.cache.access_threshold == 1 and table.cache.eviction_threshold == 100
    out = recboost.sparse_lookup(table, np.array([[3, 3], [4, 5]]), timestamp=7)
    assert out.shape == (2, 2, DIM)
    t = table.weight
    assert t[2].any() and not t[0].any()
    np.testing.assert_array_equal(out.asnumpy(), t[[[2, 2], [0, 0]]])   # 3 admitted, 4 and 5 not
    ev = recboost.sparse_lookup(table, np.array([4, 3]), is_train=False)
    np.testing.assert_array_equal(ev.asnumpy(), t[[0, 2]])
    assert table.cache.find([4])[0] == 0 and table.cache.step == 1      # eval changed nothing
    with pytest.raises(ValueError, match="For 'create_table', 'access_threshold' must be -1 or the "
                                         "feature_spec's 2, but got 3"):
        recboost.create_table("user", DIM, 30, access_threshold=3, feature_spec=spec)
    with pytest.raises(TypeError, match="For 'FeatureSpec', the keyword arguments must be among"):
        recboost.FeatureSpec("x", bogus=1)
    with pytest.raises(ValueError, match="For 'FeatureSpec', 'access_threshold' must be an int >= -1"):
        recboost.FeatureSpec("x", access_threshold=-3)


def test_evict_hook_by_step_and_by_time(backend):
    emb = recboost.HashEmbedding(DIM, 30, eviction_threshold=2, name="a")
    net = nn.SequentialCell([emb])
    params = recboost._CallbackParams()            # what RecModel hands its callbacks
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
    emb2 = recboost.HashEmbedding(DIM, 30, eviction_threshold=50)
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


def test_hash_embedding_errors_and_large_batches(backend):
    with pytest.raises(ValueError, match="For 'HashEmbedding', 'capacity' must be an int >= 3"):
        recboost.HashEmbedding(DIM, 2)
    with pytest.raises(ValueError, match="For 'HashEmbedding', 'access_threshold' must be an int >= -1"):
        recboost.HashEmbedding(DIM, 10, access_threshold=-2)
    with pytest.raises(TypeError, match="'optimizer' must be a SparseSGD"):
        recboost.HashEmbedding(DIM, 10, optimizer=nn.Adam)
    with pytest.raises(ValueError, match=r"For 'SparseAdam', 'beta1' must be a number in \[0, 1\]"):
        recboost.SparseAdam(beta1=1.5)
    emb = recboost.HashEmbedding(DIM, 100, max_unique=3)
    batch = emb.prepare(np.arange(40))                 # more distinct ids than max_unique: the buffer grows
    emb.take(batch)
    emb.apply_gradients(batch, np.ones((40, DIM), np.float32))
    assert np.count_nonzero(emb.weight.any(axis=1)) == 40
    before = table_snapshot(emb)
    shape = r"'HashEmbedding.apply_gradients', the shape of 'grad' must be \(40, %d\) \(gather's: one row per id\)" \
        % DIM
    for grad, message in [(np.ones((39, DIM), np.float32), shape + r", but got \(39, %d\)" % DIM),
                          (np.ones((DIM, 40), np.float32), shape + r", but got \(%d, 40\)" % DIM),      # transposed
                          (np.ones(40 * DIM, np.float32), shape + r", but got \(%d,\)" % (40 * DIM)),
                          (np.ones((40, DIM, 1), np.float32), shape + r", but got \(40, %d, 1\)" % DIM)]:
        with pytest.raises(ValueError, match=message):
            emb.apply_gradients(batch, grad)
    for grad in (np.ones((40, DIM), np.bool_), np.ones((40, DIM), np.int32)):
        with pytest.raises(TypeError, match=r"the dtype of 'grad' must be a float type, but got '%s'" % grad.dtype):
            emb.apply_gradients(batch, grad)
    assert not differences(table_snapshot(emb), before)

    def trained(flat):                  # [B, F] ids: the gradient as gather's shape or flat, the same update
        table = recboost.HashEmbedding(DIM, 100, seed=5)
        pairs = table.prepare_features([np.arange(6).reshape(3, 2), np.arange(3)])
        table.take(pairs)
        got = table.gather(pairs)
        with pytest.raises(ValueError, match=r"the shape of 'grad'\[0\] must be \(3, 2, %d\) \(gather's\) or "
                                             r"\(6, %d\) \(one row per id\), but got \(2, 3, %d\)" % ((DIM,) * 3)):
            table.apply_gradients(pairs, [np.ones((2, 3, DIM), np.float32), got[1]])
        table.apply_gradients(pairs, [(got[0] * 0.5).reshape(6, DIM) if flat else got[0] * 0.5, got[1]])
        return table.weight
    np.testing.assert_array_equal(trained(flat=True), trained(flat=False))
    other = recboost.HashEmbedding(DIM + 1, 100)
    state = emb.state_dict()
    with pytest.raises(ValueError, match="state\\['embedding_size'\\]"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state\\['table'\\]' must be float32"):
        emb.load_state_dict(dict(state, table=state["table"].astype(np.float64)))
    with pytest.raises(ValueError, match="'state\\['live'\\]' must be bool of shape \\(100,\\), but got missing"):
        emb.load_state_dict({k: v for k, v in state.items() if k != "live"})
    np.testing.assert_array_equal(emb.weight, state["table"])            # refused whole


@pytest.mark.parametrize("optimizer", ["SparseSGD", "SparseAdam", "SparseAdagrad", "SparseRowWiseAdagrad", "SparseFtrl"])
def test_apply_gradients_by_hand_refuses_what_the_overflow_check_would_skip(backend, optimizer):
    """By hand, with no train cell to skip the step: a gradient with a NaN or an infinity (named by its row of
    the flattened gradient and its column), or of entries 1e19 (finite, but the square of their sum is not:
    the train step's check skips such a step) is refused, and nothing of the table changes; the same batch then
    trains with an ordinary gradient."""
    table = recboost.HashEmbedding(DIM, 64, optimizer=getattr(recboost, optimizer)(0.1), seed=0)
    batch = table.prepare(np.array([[5, 6], [6, 7]]))
    table.take(batch)
    shape = table.gather(batch).shape
    before = table_snapshot(table)
    for value, message in [
            (np.nan, r"each entry of 'grad' must be finite .*, but got 'nan at row 2, column 3'"),
            (-np.inf, r"each entry of 'grad' must be finite .*, but got '-inf at row 2, column 3'"),
            (1e19, r"'grad' must be small enough that the update keeps the table's rows and optimizer slots finite "
                   r".*, but got 'entries whose magnitudes sum to 1.6e\+20")]:
        grad = np.ones(shape, np.float32)
        grad[1, 0, 3] = value
        if value == 1e19:
            grad[:] = value
        with pytest.raises(ValueError, match="For 'HashEmbedding.apply_gradients', " + message):
            table.apply_gradients(batch, grad)
        assert not differences(table_snapshot(table), before)
    table.apply_gradients(batch, np.ones(shape, np.float32))
    assert not np.array_equal(table.state_dict()["table"], before["table"])


def test_a_batch_is_gathered_and_trained_only_by_its_own_table_once_taken(backend):
    """By hand, a batch reaches only the rows its own table mapped it to, and only once they hold what the
    step needs: a batch of another table is refused by gather and apply_gradients (it would read and train
    that table's row numbers on this one), a batch not taken though it admitted ids (its rows hold no initial
    rows yet), and, by apply_gradients, a batch of evaluation (is_train=False: its ids unadmitted, on the
    shared default row). Each refusal changes neither table; the same batches then go as they should."""
    a = recboost.HashEmbedding(DIM, 64, optimizer=recboost.SparseSGD(0.1), name="a", seed=1)
    b = recboost.HashEmbedding(DIM, 64, optimizer=recboost.SparseSGD(0.1), name="b", seed=2)
    grad = np.ones((3, DIM), np.float32)
    untaken = a.prepare(np.array([5, 6, 7]))
    states = [table_snapshot(a), table_snapshot(b)]
    for call, batch, message in [
            (a.gather, untaken, r"'HashEmbedding.gather', 'batch' must be taken first .*, but got 'a batch not taken'"),
            (lambda batch: a.apply_gradients(batch, grad), untaken,
             r"'HashEmbedding.apply_gradients', 'batch' must be taken first .*, but got 'a batch not taken'")]:
        with pytest.raises(ValueError, match=message):
            call(batch)
        for table, state in zip((a, b), states):
            assert not differences(table_snapshot(table), state)
    a.take(untaken)
    states = [table_snapshot(a), table_snapshot(b)]
    evaluation = a.prepare(np.array([5, 8, 9]), is_train=False)
    for call, batch, message in [
            (b.gather, untaken, r"'HashEmbedding.gather', 'batch' must be a batch of table 'b' \(its prepare's\), "
                                r"but got \"one of another table 'a'\""),
            (lambda batch: b.apply_gradients(batch, grad), untaken,
             r"'HashEmbedding.apply_gradients', 'batch' must be a batch of table 'b' .*, but got \"one of another table 'a'"),
            (lambda batch: a.apply_gradients(batch, grad), evaluation,
             r"'batch' must be a batch prepared for training \(prepare\(..., is_train=True\)\), but got 'one "
             r"prepared with is_train=False'")]:
        with pytest.raises(ValueError, match=message):
            call(batch)
        for table, state in zip((a, b), states):
            assert not differences(table_snapshot(table), state)
    np.testing.assert_array_equal(a.gather(evaluation)[0], a.gather(untaken)[0])      # (id 5, gathered)
    a.apply_gradients(untaken, grad)
    assert not np.array_equal(a.state_dict()["table"], states[0]["table"])


def test_gather_fills_only_an_out_it_can_fill_and_refuses_any_other_naming_it(backend):
    """``gather(batch, out)`` fills ``out`` (the same rows as without it) and returns a view of it; an ``out``
    of another dtype, shape or layout, read-only, or not an array is refused naming ``'out'``, the same on
    both backends (neither a kernel's buffer error nor a new array that leaves the buffer unfilled)."""
    table = recboost.HashEmbedding(DIM, 64, optimizer=recboost.SparseSGD(0.5), seed=1)
    batch = table.prepare(np.array([3, 4, 5]))
    table.take(batch)
    out = np.zeros((3, DIM), np.float32)
    filled = table.gather(batch, out)
    assert np.shares_memory(filled, out)        # (a view of it, shaped as the ids)
    np.testing.assert_array_equal(out, table.gather(batch))
    assert np.abs(out).sum() > 0
    read_only = np.zeros((3, DIM), np.float32)
    read_only.flags.writeable = False
    expected = r"'HashEmbedding.gather', 'out' must be a writeable C-contiguous float32 array of shape " \
               r"\(3, 4\) \(the batch's outputs by the row width\), but got '%s'"
    strided = np.zeros((3, 2 * DIM), np.float32)[:, ::2]
    for given, got in [(np.zeros((3, DIM)), r"a float64 array of shape \(3, 4\)"),
                       (strided, r"a strided float32 array of shape \(3, 4\)"),
                       (read_only, r"a read-only float32 array of shape \(3, 4\)"),
                       (np.zeros((4, DIM), np.float32), r"a float32 array of shape \(4, 4\)")]:
        with pytest.raises(ValueError, match=expected % got):
            table.gather(batch, given)
        assert not given.any()
    with pytest.raises(TypeError, match=r"'out' must be None or a numpy array, but got 'list'"):
        table.gather(batch, [[0.0] * DIM] * 3)


def _evicting_table(name="t", row_dtype="float32"):
    """Eight rows, two reserved: six ids fill it; an id unseen for more than 5 time units is evicted."""
    return recboost.HashEmbedding(DIM, 8, access_threshold=-1, eviction_threshold=5, use_dynamic_expansion=False,
                                  optimizer=recboost.SparseSGD(0.5), name=name, seed=1, row_dtype=row_dtype)


def test_a_batch_whose_rows_went_to_other_ids_is_refused_by_hand(backend):
    """By hand, a batch held while its ids were evicted and their rows given to new ids by a later batch (taken)
    no longer maps its ids to their rows: gather would return the new ids' rows as its own, apply_gradients
    would train them and take would reset them. Each is refused naming the rows, and changes nothing; so is
    a batch prepared before the table's state was loaded, and a second take of a batch that admitted ids (it
    would reset their trained rows). The new ids' batch trains as it should."""
    table = _evicting_table()
    held = table.prepare(np.array([11, 12, 13]), timestamp=0)
    table.take(held)
    untaken = table.prepare(np.array([14]), timestamp=1)            # admits 14 on row 5, not taken
    np.testing.assert_array_equal(table.evict(now=100), [11, 12, 13, 14])
    later = table.prepare(np.array([21, 22, 23, 24]), timestamp=100)
    np.testing.assert_array_equal(np.sort(later.new_rows), [2, 3, 4, 5])    # the evicted ids' rows, re-used
    table.take(later)
    before = table_snapshot(table)
    stale = r"'batch' must be a batch whose rows still belong to its ids \(prepare its ids again\), but got 'one " \
            r"whose rows %s were given to other ids since its prepare \(evicted, then taken by a later batch\)'"
    for call, message in [(lambda: table.gather(held), "'HashEmbedding.gather', " + stale % r"\[2, 3, 4\]"),
                          (lambda: table.apply_gradients(held, np.ones((3, DIM), np.float32)),
                           "'HashEmbedding.apply_gradients', " + stale % r"\[2, 3, 4\]"),
                          (lambda: table.take(untaken), "'HashEmbedding.take', " + stale % r"\[5\]"),
                          (lambda: table.take(later), r"'HashEmbedding.take', 'batch' must be a batch not taken yet "
                                                      r"\(a second take would reset .*\), but got 'one taken already'")]:
        with pytest.raises(ValueError, match=message):
            call()
        assert not differences(table_snapshot(table), before)
    rows = table.gather(later)
    table.apply_gradients(later, np.ones((4, DIM), np.float32))
    np.testing.assert_allclose(table.gather(later), rows - 0.5, rtol=0, atol=1e-6)
    table.load_state_dict(table.state_dict())
    with pytest.raises(ValueError, match=r"'HashEmbedding.gather', 'batch' must be a batch whose rows still belong to "
                                         r"its ids .*, but got \"one prepared before the table's state was loaded\""):
        table.gather(later)
    again = table.prepare(np.array([21, 22, 23, 24]), timestamp=101)
    np.testing.assert_array_equal(table.gather(again), rows - 0.5)


def test_a_batch_held_in_stream_order_through_an_eviction_still_trains(backend):
    """Stream order, as RecModel's prefetching runs it: a batch is prepared, an eviction frees the rows of ids it
    does not hold and a later batch (prepared meanwhile) gives them to new ids; the held batch is taken, gathered
    and trained before the later one is taken. Nothing is refused, and the ids end where one batch at a time puts
    them: each ends at its initial row trained once (the evicted ids' rows in between are reset)."""
    table = _evicting_table()
    first = table.prepare(np.array([11, 12, 13, 14]), timestamp=0)
    table.take(first)
    table.apply_gradients(first, np.ones((4, DIM), np.float32))
    held = table.prepare(np.array([13, 14]), timestamp=6)
    np.testing.assert_array_equal(table.evict(now=10), [11, 12])     # 13, 14 seen at 6: kept
    later = table.prepare(np.array([21, 22]), timestamp=10)
    np.testing.assert_array_equal(np.sort(later.new_rows), [2, 3])
    table.take(held)
    table.apply_gradients(held, np.ones((2, DIM), np.float32))
    table.take(later)
    table.apply_gradients(later, np.ones((2, DIM), np.float32))
    reference = _evicting_table()
    for ids, times in [([13, 14], 2), ([21, 22], 1)]:
        batch = reference.prepare(np.array(ids), timestamp=0)
        reference.take(batch)
        initial = reference.gather(batch).copy()
        np.testing.assert_allclose(table.gather(table.prepare(np.array(ids), timestamp=10, is_train=False)),
                                   initial - 0.5 * times, rtol=0, atol=1e-6)


def test_a_batch_older_than_the_tables_log_of_takes_is_refused_unchecked(backend, monkeypatch):
    """A table remembers the last takes that gave evicted rows to new ids (here 3, in place of 64): a batch
    prepared before them can no longer be checked, and is refused saying so rather than trained unchecked.
    Takes that give rows never given before are not remembered: they cannot make a batch stale."""
    monkeypatch.setattr(recboost, "_GIVEN_TAKES", 3)
    table = _evicting_table()
    held = table.prepare(np.array([1]), timestamp=0)
    table.take(held)
    for first in range(10, 15):             # rows 3..7, each given for the first time: nothing remembered
        table.take(table.prepare(np.array([first]), timestamp=0))
    grad = np.ones((1, DIM), np.float32)
    table.apply_gradients(held, grad)       # (were those five takes remembered, it would be too old here)
    for k in range(1, 5):
        table.prepare(np.array([1]), timestamp=10 * k)                      # (id 1 stays)
        assert table.evict(now=10 * k).size == 5
        table.take(table.prepare(np.arange(5 * k + 10, 5 * k + 15), timestamp=10 * k))     # rows 3..7 again
        if k < 4:
            table.apply_gradients(held, grad)      # checked: none of its rows was given again
    with pytest.raises(ValueError, match=r"'batch' must be a batch whose rows still belong to its ids .*, but got "
                                         r"'one prepared before the last 3 takes that gave rows to ids \(too old to check\)'"):
        table.apply_gradients(held, grad)


@pytest.mark.parametrize("at_largest", [True, False])
def test_apply_gradients_by_hand_bounds_the_update_with_the_tables_accumulators(backend, at_largest):
    """The refusal reads the table's growth bound, as the train step's check does: entries of 1e17 square to
    a finite sum, but added to accumulators at float32's largest they would not be, so the update is refused,
    nothing changed; with the accumulators as trained, the same gradient trains (finite)."""
    table = recboost.HashEmbedding(DIM, 64, optimizer=recboost.SparseAdagrad(0.1), seed=0)
    table.take(table.prepare(np.array([5, 6, 7])))
    if at_largest:
        state = table.store.state_dict()
        state["slots"]["accum"][2:] = np.finfo(np.float32).max
        table.store.load_state_dict(state)
    batch = table.prepare(np.array([5, 6, 7]))          # (after the load: a batch before it is stale)
    table.take(batch)
    before = table_snapshot(table)
    grad = np.full((3, DIM), 1e17, np.float32)
    if at_largest:
        with pytest.raises(ValueError, match=r"'grad' must be small enough .*, but got 'entries whose magnitudes sum "
                                             r"to 1.2e\+18, on accumulators up to 3.403e\+38'"):
            table.apply_gradients(batch, grad)
        assert not differences(table_snapshot(table), before)
    else:
        table.apply_gradients(batch, grad)
        after = table.state_dict()
        assert np.isfinite(after["table"]).all() and np.isfinite(after["slots"]["accum"]).all()
        assert not np.array_equal(after["table"], before["table"])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_full_table_replaces_by_its_policy_and_the_new_id_starts_afresh(backend, policy):
    """A full table (one bucket of 32 rows) with an eviction policy gives a new id the row of the id
    its policy ranks lowest: id 0, seen once and least recently. The row is the new id's initial row,
    with fresh slots; id 0 is forgotten (count 0, no row); the ids of the batch are never replaced."""
    emb = recboost.HashEmbedding(DIM, 2 + 32, eviction_policy=policy, optimizer=recboost.SparseAdam(0.1), seed=3,
                                 init_stddev=0.1)
    for ids in (np.arange(32), np.arange(1, 32)):
        batch = emb.prepare(ids)
        emb.take(batch)
        emb.apply_gradients(batch, np.ones((ids.size, DIM), np.float32))
    row_of_0 = int(emb.cache.find(np.array([0]))[0])
    trained = emb.weight[row_of_0].copy()
    assert emb.slots["moment1"][row_of_0].any() and len(emb.cache) == 32
    batch = emb.prepare(np.array([100, 5, 100]))
    assert batch.rows.tolist() == [row_of_0, int(emb.cache.find(np.array([5]))[0]), row_of_0]
    emb.take(batch)
    fresh = np.empty((1, DIM), np.float32)
    recboost.init_rows(np.array([100], np.int64), 3, 0.1, fresh)
    np.testing.assert_array_equal(emb.weight[row_of_0], fresh[0])
    assert not np.array_equal(trained, fresh[0])
    for name, fill in emb.optimizer.slot_fills:
        assert (emb.slots[name][row_of_0] == fill).all()
    assert emb.cache.find(np.array([0])).tolist() == [0] and emb.cache.counts(np.array([0])).tolist() == [0]
    stats = emb.cache.stats()
    assert (stats["replaced"], stats["overflowed"], stats["size"]) == (1, 0, 32)
    # a batch whose ids fill the bucket: a new id among them finds no id to replace
    batch = emb.prepare(np.concatenate([np.arange(1, 32), [100, 200]]))
    assert batch.rows[-1] == recboost.HASH_DEFAULT_ROW and emb.cache.stats()["replaced"] == 1


def test_a_state_without_copies_is_the_table_s_own_and_loads_in_place(backend):
    """``state_dict(copy=False)`` gives read-only views of the table's own rows, slots and live flags
    (how a checkpoint writes them: no second copy of the table); ``load_state_dict(state, copy=False)`` takes the
    state's arrays as they are and reloads the table's cache object in place, and the table then
    trains exactly as after a copying load. A cache loaded from a state holds none of the replaced
    ids of before it (the kernel's reset; the numpy twin kept them)."""
    def trained():
        emb = recboost.HashEmbedding(DIM, 2 + 32, eviction_policy="lru", optimizer=recboost.SparseAdam(0.1),
                                     seed=3, init_stddev=0.1)
        for ids in (np.arange(32), np.arange(20, 40)):             # the second batch replaces ids 0..7
            batch = emb.prepare(ids)
            emb.take(batch)
            emb.apply_gradients(batch, np.ones((ids.size, DIM), np.float32))
        return emb

    src = trained()
    views, copies = src.state_dict(copy=False), src.state_dict()
    for mine, own in [("table", src.weight), ("live", src.store.live)] + [(n, a) for n, a in src.slots.items()]:
        got, copied = (views[mine], copies[mine]) if mine in views else (views["slots"][mine], copies["slots"][mine])
        assert np.shares_memory(got, own) and not got.flags.writeable and not np.shares_memory(copied, own)
        np.testing.assert_array_equal(got, copied)
    kept, loaded = trained(), trained()
    cache = loaded.cache
    assert cache.lookup(np.arange(100, 104)).min() >= 2            # a full table: 4 ids replaced, not taken
    state = src.state_dict()
    loaded.load_state_dict(state, copy=False)
    kept.load_state_dict(src.state_dict())
    assert loaded.cache is cache and cache.take_replaced()[0].size == 0
    assert np.shares_memory(loaded.weight, state["table"]) and not np.shares_memory(kept.weight, src.weight)
    for emb in (kept, loaded):
        batch = emb.prepare(np.array([5, 25, 33, 200]))
        emb.take(batch)
        emb.apply_gradients(batch, np.full((4, DIM), 0.5, np.float32))
    np.testing.assert_array_equal(loaded.weight, kept.weight)
    for name in kept.slots:
        np.testing.assert_array_equal(loaded.slots[name], kept.slots[name])
    np.testing.assert_array_equal(loaded.cache.state_dict()["keys"], kept.cache.state_dict()["keys"])
    np.testing.assert_array_equal(loaded.cache.state_dict()["rows"], kept.cache.state_dict()["rows"])
    twin = backend.HashCache(2 + 32, eviction_policy="lru")
    twin.lookup(np.arange(32))
    twin.lookup(np.arange(40, 44))                                 # replaces 4 ids, not taken
    twin.load_state_dict(src.cache.state_dict())
    assert twin.take_replaced()[0].size == 0


def test_an_eviction_policy_needs_a_fixed_capacity(backend):
    with pytest.raises(ValueError, match=r"For 'HashEmbedding', 'use_dynamic_expansion' must be False with an "
                                         r"eviction_policy \('lru' keeps the table at its capacity"):
        recboost.HashEmbedding(DIM, 64, use_dynamic_expansion=True, eviction_policy="lru")
    with pytest.raises(ValueError, match=r"For 'HashEmbedding', 'eviction_policy' must be None, 'lru', 'lfu' or 'score', "
                                         r"but got 'fifo'\."):
        recboost.HashEmbedding(DIM, 64, eviction_policy="fifo")
    with pytest.raises(ValueError, match=r"For 'HashCache', 'lfu_half_life' must be an int >= 1, but got 0\."):
        recboost.HashCache(64, eviction_policy="lfu", lfu_half_life=0)
    with pytest.raises(ValueError, match=r"For 'HashCache', 'grow' must be False with an eviction_policy"):
        recboost.HashCache(64, grow=True, eviction_policy="lfu")


def test_a_row_wise_shard_with_a_policy_is_full_on_its_own(backend):
    """A row-wise shard of a table with an eviction policy holds its share of the rows and no more:
    it does not grow and does not share the table's free rows with the other shards (it replaces
    among its own ids instead)."""
    table = recboost.HashEmbedding(DIM, 2 + 64, eviction_policy="lfu", lfu_half_life=7, sharding="row_wise")
    table.set_layout("row_wise", 1, 3)
    cache = table.cache
    assert (cache.capacity, cache.grow, cache.eviction_policy, cache.lfu_half_life) == (2 + 22, False, "lfu", 7)
    assert table.weight.shape == (2 + 22, DIM) and not table.layout.shared_capacity
    assert table.shard == table.layout.shard == (1, 3) and table.resolved_sharding == "row_wise"
    plain = recboost.HashEmbedding(DIM, 2 + 64, sharding="row_wise")
    plain.set_layout("row_wise", 1, 3)
    assert plain.cache.grow and plain.cache.eviction_policy is None and plain.layout.shared_capacity
    assert plain.layout.table_rows == 64


def test_the_table_holds_a_row_store_and_a_layout_that_never_calls_back(backend):
    """HashEmbedding's rows, slots, scalars, seed, clock and rounding counter live in its row store
    (``table.store``; the table reads them through it, and ``shard`` is the layout's alone); the
    layouts work on the store and the cache they are given: with every row method of the table
    broken, a data-parallel and a row-wise step (one rank), and a checkpoint re-laid out from two
    shards, run and equal the one-process table."""
    def make(**kw):
        return recboost.HashEmbedding(DIM, 2 + 40, access_threshold=1, optimizer=recboost.SparseAdagrad(0.1),
                                      seed=6, row_dtype="bfloat16", use_dynamic_expansion=True, **kw)

    def broken(*args, **kwargs):
        raise AssertionError("a layout called back into the table")
    plain = make()
    store = plain.store
    assert plain.weight.base is store.weight and not plain.weight.flags.writeable and plain.scalars is store.scalars
    assert all(plain.slots[k].base is a and not plain.slots[k].flags.writeable for k, a in store.slots.items())
    assert plain.seed == store.seed == 6 and plain.optimizer is store.optimizer and "shard" not in vars(plain)
    for sharding in ("data_parallel", "row_wise"):
        laid, ex = make(), _OneRank()
        laid.set_layout(sharding, 0, 1, ex)
        assert laid.shard == (0, 1) and (laid.layout.shard is None) == (sharding == "data_parallel")
        for name in ("map_ids", "update_rows", "sum_gradients", "rows_float32", "reshard_states", "reset_rows",
                     "grow_table"):
            setattr(laid, name, broken)
        rng, ref = np.random.default_rng(4), make()
        for step in range(3):
            ids = rng.integers(0, 30, (6, 2))
            want = ref.prepare(ids, timestamp=step)
            ref.take(want)
            ref.apply_gradients(want, np.cos(ref.gather(want) + step).astype(np.float32))
            parts = laid.check_features([ids])
            assert parts[0].ids.dtype == np.int64 and parts[0].counts is None and parts[0].shape == (6, 2)
            entries = [TableIds(step, [p.ids for p in parts])]
            shared, = ex.share_ids(ex.share_headers(0, [1], entries), entries)
            batch = laid.prepare_step(parts, shared.time, True, (), shared)
            laid.take(batch)
            laid.apply_gradients(batch, np.cos(laid.gather(batch) + step).astype(np.float32))
        assert laid.store.clock == laid.clock == ref.clock == "data" and laid.store.rounds == ref.store.rounds == 3
        probe = np.arange(30)
        np.testing.assert_array_equal(laid.store.rows_float32(laid.cache.find(probe)),
                                      ref.store.rows_float32(ref.cache.find(probe)))
    shards = []
    for rank in range(2):
        shard = make(sharding="row_wise")
        shard.set_layout("row_wise", rank, 2)
        ids = np.arange(40)
        for _ in range(2):                                  # admitted at the second lookup
            shard.take(shard.prepare(ids[recboost._owner_of(ids, 2) == rank]))
        shards.append(shard.check_state_dict(shard.state_dict()))
    whole = make()
    whole.reshard_states = broken
    whole.load_state_dict(whole.restore_states(shards))
    assert len(whole.cache) == sum(int((s["cache"]["rows"] >= 0).sum()) for s in shards) == 40
    assert whole.store.state_dict()["live"][:2 + len(whole.cache)].all()


def test_the_row_store_reads_the_tables_config_and_holds_only_its_capacity_seed_and_optimizer(backend):
    """A row store reads every setting of its table from the table's TableConfig (the one home of each):
    the row width, the row storage, the initial rows' spread and the default seed. Its own are its
    capacity (a row-wise shard's), its seed (a loaded state brings one) and its optimizer (a train
    cell's may replace the config's); ``emptied`` (a shard's store) keeps those and mindspore_rec's
    ``lookup_once`` / ``zero_default``, which are False until HashEmbeddingLookup sets them."""
    config = recboost.TableConfig(3, 2 + 8, optimizer=recboost.SparseAdagrad(0.1, initial_accumulator_value=0.25),
                                  seed=5, init_stddev=0.5, row_dtype="bfloat16", name="t")
    table = recboost.HashEmbedding(config)
    assert table.store.config is config and table.init_stddev == 0.5 and table.seed == 5
    store_type, ids = type(table.store), np.array([11, 12], np.int64)

    def initial(seed):               # the id-keyed rows of spread 0.5, to bfloat16 to nearest
        rows, bits = np.empty((2, 3), np.float32), np.zeros((2, 3), np.uint16)
        backend.init_rows(ids, seed, 0.5, rows)
        return backend.bf16_encode(rows, np.arange(2, dtype=np.int32), bits, 0, 0, False)
    own = store_type(config, 6)
    assert own.dim == 3 and own.capacity == 6 and own.weight.dtype == np.uint16 and own.seed == 5
    assert own.optimizer is config.optimizer and own.slots["accum"].shape == (6, 3) and own.clock is None
    assert not own.lookup_once and not own.zero_default and own.live.tolist() == [True] * 2 + [False] * 4
    own.reset_rows(np.array([2, 3]), ids)
    assert np.array_equal(own.weight[2:4], initial(5)) and np.all(own.slots["accum"][2:4] == np.float32(0.25))
    loaded = store_type(config, 6, seed=9)                     # a loaded state's seed
    loaded.reset_rows(np.array([2, 3]), ids)
    assert loaded.seed == 9 and np.array_equal(loaded.weight[2:4], initial(9))
    assert not np.array_equal(initial(9), initial(5))
    sgd = recboost.SparseSGD(0.2)
    loaded.use_optimizer(sgd)
    loaded.lookup_once = loaded.zero_default = True
    shard = loaded.emptied(4)
    assert shard.config is config and shard.capacity == 4 and shard.seed == 9 and shard.optimizer is sgd
    assert shard.slots == {} and shard.lookup_once and shard.zero_default and not shard.weight.any()
    kept = own.emptied(5)                                      # the config's optimizer: fresh slots of it
    assert kept.optimizer is config.optimizer and np.all(kept.slots["accum"] == np.float32(0.25))
    assert kept.seed == 5 and not kept.lookup_once and kept.weight.shape == (5, 3)


def test_set_layout_checks_its_arguments_and_refuses_a_used_table(backend):
    """``set_layout`` names a bad sharding, rank or world, and refuses to make a table that has
    looked up ids a row-wise shard (its storage unchanged); "none" and "data_parallel" keep the
    whole table, and a local ``prepare`` on any layout looks up in the table itself."""
    table = recboost.HashEmbedding(DIM, 2 + 64)
    with pytest.raises(ValueError, match=r"For 'HashEmbedding.set_layout', 'sharding' must be one of "
                                         r"\['none', 'data_parallel', 'row_wise'\], but got 'columns'\."):
        table.set_layout("columns")
    with pytest.raises(ValueError, match=r"For 'HashEmbedding.set_layout', 'rank' must be .*3"):
        table.set_layout("row_wise", 3, 3)
    with pytest.raises(ValueError, match=r"For 'HashEmbedding.set_layout', 'world' must be .*0"):
        table.set_layout("row_wise", 0, 0)
    assert table.layout.shard is None and table.capacity == 66
    table.set_layout("data_parallel")
    assert table.resolved_sharding == "data_parallel" and table.capacity == 66 and table.layout.shard is None
    assert table.exchanges_ids(True) and not table.exchanges_ids(False)
    batch = table.prepare(np.array([5, 7, 5], np.int64))
    assert batch.layout.sharding == "none" and batch.rows[0] == batch.rows[2] != batch.rows[1]
    assert len(table.cache) == 2
    with pytest.raises(ValueError, match=r"For 'test', hash table 'hash_embedding' for row-wise sharding must be "
                                         r"a table that has not looked up ids yet, but got '1 lookups'\."):
        table.set_layout("row_wise", 0, 2, where="test")
    assert table.capacity == 66 and len(table.cache) == 2


class _OneRank(recboost._RankExchange):
    """The rank exchange of a world of one rank, without communication: each collective gives back
    this rank's buffer (what MindSpore's AllGather and AllReduce give with one rank)."""

    def __init__(self):                     # pylint: disable=super-init-not-called (no MindSpore ops)
        self.rank, self.size, self.mean, self.bytes_sent, self.seconds, self.timeout = 0, 1, True, 0, 0.0, 0
        self._waiting = self._watchdog = self._all_gather = self._all_reduce = None

    def _collective(self, op, array, what):
        self.bytes_sent += array.nbytes
        return array.copy()


_WATCHDOG_AT_EXIT = """
import atexit, threading
atexit.register(lambda: print("at exit:", [t.name for t in threading.enumerate() if t.name.startswith("recboost")]))
import recboost   # its atexit handlers run before the one above (last registered, first run)


class Exchange(recboost._RankExchange):
    def __init__(self):                     # no MindSpore ops: the watchdog alone
        self.rank, self.size, self.timeout, self._waiting, self._watchdog = 0, 2, 30.0, None, None


exchange = Exchange()
with exchange.waiting("an AllGather"):
    pass
print("watchdog alive:", exchange._watchdog.is_alive())
"""


def test_the_exchange_watchdog_ends_before_the_interpreter_exits(tmp_path):
    """A rank's watchdog thread (started by its first wait for the other ranks) is stopped and joined
    by an atexit handler: no thread of recboost's wakes while the interpreter and MindSpore's
    communication are torn down (a worker of the docs' msrun example once ended with SIGSEGV there)."""
    import subprocess
    import sys
    script = tmp_path / "watchdog.py"
    script.write_text(_WATCHDOG_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ["watchdog alive: True", "at exit: []"], proc.stdout


@pytest.mark.parametrize("sharding", ["data_parallel", "row_wise"])
def test_a_layout_over_one_rank_trains_as_the_local_table(backend, sharding):
    """A data-parallel or row-wise table over a world of one rank, fed through the exchange's step
    messages (headers, ids, admissions, rows from owners, gradients to owners, summed rows), gathers
    and trains as the same table in one process: a full table that does not grow (the admissions are
    agreed), two features, Adam, a threshold. Bit for bit, except (row-wise) the shared default row 0:
    its gradient is summed per key first, then over the keys on it, so it agrees to rounding."""
    rng = np.random.default_rng(3)
    make = lambda: recboost.HashEmbedding(DIM, 2 + 40, access_threshold=1, optimizer=recboost.SparseAdam(0.05),
                                          seed=4, name="t")
    local, laid = make(), make()
    ex = _OneRank()
    laid.set_layout(sharding, 0, 1, ex)
    assert laid.exchanges_ids(True) and laid.exchanges_ids(False) == (sharding == "row_wise")
    assert ex.share_config({"a": [1, "x"]}) == [{"a": [1, "x"]}]
    for step in range(8):
        features = [rng.integers(0, 90, (16, 3)), rng.integers(0, 90, 16)]
        grads = [rng.normal(size=(16, 3, DIM)).astype(np.float32), rng.normal(size=(16, DIM)).astype(np.float32)]
        want = local.prepare_features(features, timestamp=step)
        local.take(want)
        rows = local.gather(want)
        local.apply_gradients(want, grads)
        parts = laid.check_features(features)
        entries = [TableIds(step, [p.ids for p in parts])]
        heads = ex.share_headers(0, [2], entries)
        assert heads.codes.tolist() == [0] and heads.given[0].tolist() == [True]
        assert heads.counts.tolist() == [[48, 16]]
        shared, = ex.share_ids(heads, entries)
        np.testing.assert_array_equal(shared.union, np.concatenate([f.reshape(-1) for f in features]))
        assert shared.time == step and (shared.mine == np.arange(64)).all() and (shared.rank_of == 0).all()
        batch = laid.prepare_step(parts, shared.time, True, (), shared)
        assert batch.layout is laid.layout
        laid.take(batch)
        got = laid.gather(batch)
        for a, b, f in zip(got, rows, features):
            held = (local.cache.find(f) >= 2)[..., None]
            np.testing.assert_array_equal(np.where(held, a, 0), np.where(held, b, 0))
            exact = np.testing.assert_array_equal if sharding == "data_parallel" else \
                lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
            exact(a, b)
        laid.apply_gradients(batch, grads)
    assert local.cache.stats() == laid.cache.stats() and len(local.cache) == 40      # full: admissions were refused
    ids = np.arange(90)
    np.testing.assert_array_equal(local.cache.find(ids) >= 2, laid.cache.find(ids) >= 2)
    held = local.cache.find(ids) >= 2
    np.testing.assert_array_equal(local.weight[local.cache.find(ids[held])], laid.weight[laid.cache.find(ids[held])])
    if sharding == "data_parallel":
        np.testing.assert_array_equal(local.weight[0], laid.weight[0])
    else:
        np.testing.assert_allclose(local.weight[0], laid.weight[0], rtol=1e-5, atol=1e-7)
    sizes, digests, same = ex.share_part_record("x.npz", 123, "ab" * 32)
    assert sizes.tolist() == [123] and digests == ["ab" * 32] and same


@pytest.mark.parametrize("sharding", ["data_parallel", "row_wise"])
def test_bfloat16_rows_through_the_exchange_layouts_equal_one_process(backend, sharding):
    """bfloat16 rows through the data-parallel and row-wise paths (the rows fetched from their
    owner and decoded, the gradients sent back and the rows rounded stochastically), in a world of
    one rank, equal the one-process table bit for bit."""
    def make():
        return recboost.HashEmbedding(DIM, 64, optimizer=recboost.SparseAdam(0.05), seed=3, init_stddev=0.2,
                                      row_dtype="bfloat16", use_dynamic_expansion=True)
    plain, laid, ex = make(), make(), _OneRank()
    laid.set_layout(sharding, 0, 1, ex)
    rng = np.random.default_rng(9)
    for step in range(4):
        ids = rng.integers(0, 40, (8, 3))
        batch = plain.prepare(ids)
        plain.take(batch)
        want = plain.gather(batch)
        plain.apply_gradients(batch, np.sin(want * 5 + step).astype(np.float32))
        parts = laid.check_features([ids])
        entries = [TableIds(None, [p.ids for p in parts])]
        shared, = ex.share_ids(ex.share_headers(0, [1], entries), entries)
        assert shared.time is None and (shared.mine == np.arange(ids.size)).all()
        lb = laid.prepare_step(parts, None, True, (), shared)
        assert lb.layout is laid.layout
        laid.take(lb)
        got = laid.gather(lb)
        np.testing.assert_array_equal(got, want)
        laid.apply_gradients(lb, np.sin(got * 5 + step).astype(np.float32))
    assert laid.weight.dtype == np.uint16 and laid.store.rounds == plain.store.rounds == 4
    probe = np.arange(40)
    np.testing.assert_array_equal(laid.rows_float32(laid.cache.find(probe)),
                                  plain.rows_float32(plain.cache.find(probe)))


@pytest.mark.parametrize("sharding, row_dtype", [("none", "float32"), ("none", "bfloat16"),
                                                 ("data_parallel", "float32"), ("row_wise", "float32")])
def test_an_evaluation_reads_an_id_only_a_batch_not_taken_admitted_as_unknown(backend, sharding, row_dtype):
    """Ids evicted, then admitted again on their rows by a training batch not taken yet (RecModel's
    prefetched one): their rows still hold the evicted ids' trained values. An evaluation batch reads
    those ids as the default row, as unknown ids (no trained step has looked them up), in one process and
    through each layout over one rank (row-wise: the owner hides them at the evaluation's prepare); ids
    taken read their own rows; after the take the new ids read their initial rows. By hand, a row-wise
    batch is trained only once gathered (its rows and gradients go through their owners). bfloat16 rows
    read the same way (gathered from their distinct rows in float32)."""
    table = _evicting_table(row_dtype=row_dtype)
    values = table.rows_float32                                # rows' values in float32, of either storage
    if sharding != "none":
        table.set_layout(sharding, 0, 1, _OneRank())

    def batch(ids, time, is_train=True):
        if sharding == "none":
            return table.prepare(ids, timestamp=time, is_train=is_train)
        parts = table.check_features([ids])
        entries = [TableIds(time, [p.ids for p in parts])]
        shared, = table.layout.exchange.share_ids(table.layout.exchange.share_headers(0, [1], entries), entries)
        return table.prepare_step(parts, time, is_train, (), shared)

    old = batch(np.array([11, 12, 13]), 0)
    table.take(old)
    if sharding == "row_wise":
        before = table_snapshot(table)
        with pytest.raises(ValueError, match=r"'HashEmbedding.apply_gradients', 'batch' must be gathered first "
                                             r"\(gather\(batch\): .*\), but got 'a row-wise batch not gathered'"):
            table.apply_gradients(old, np.ones((3, DIM), np.float32))
        assert not differences(table_snapshot(table), before)
    table.gather(old)
    table.apply_gradients(old, np.ones((3, DIM), np.float32))
    kept = batch(np.array([31]), 99)
    table.take(kept)
    np.testing.assert_array_equal(table.evict(now=100), [11, 12, 13])
    ahead = batch(np.array([21, 22, 23]), 100)                  # rows 2, 3, 4 again; not taken
    held = table.cache.find(np.array([21, 22, 23]))
    np.testing.assert_array_equal(np.sort(held), [2, 3, 4])
    assert (np.abs(values(held)) > 0).all()                     # the evicted ids' trained rows
    probe = np.array([21, 31, 22, 23, 77])
    got = table.gather(batch(probe, 100, is_train=False))
    want = np.repeat(values([0]), 5, axis=0)
    want[1] = values(table.cache.find(np.array([31])))[0]
    np.testing.assert_array_equal(got, want)
    assert not (got[[0, 2, 3]] == values(held)).all(axis=1).any()
    table.take(ahead)
    got = table.gather(batch(probe, 100, is_train=False))
    np.testing.assert_array_equal(got[[0, 2, 3]], values(held))
    np.testing.assert_array_equal(got[[1, 4]], want[[1, 4]])


# ---- the sketch admission counter through tables (issue #25 item 2) --------------------------------
def test_tables_take_the_admission_counter(backend):
    """HashEmbedding, create_table (FeatureSpec-driven too) and HashEmbeddingLookup pass the admission
    counter to the cache; it is a setting; a row-wise shard has a sketch of the same sizes."""
    spec = recboost.FeatureSpec("a", table_name="t", access_threshold=2)
    table = recboost.create_table("t", DIM, 1000, feature_spec=[spec], admission_counter="sketch", sketch_depth=2)
    cache = table.cache
    assert (cache.admission_counter, cache.sketch_width, cache.sketch_depth, cache.sketch_window) == \
        ("sketch", 4000, 2, 2000)
    assert {k: table.settings()[k] for k in ("admission_counter", "sketch_width", "sketch_depth", "sketch_window")} \
        == {"admission_counter": "sketch", "sketch_width": 4000, "sketch_depth": 2, "sketch_window": 2000}
    assert recboost.create_table("e", DIM, 1000).settings()["admission_counter"] == "exact"
    lookup = recboost.HashEmbeddingLookup(DIM, capacity=100, admission_counter="sketch", sketch_width=64)
    assert (lookup.cache.sketch_width, lookup.cache.sketch_window) == (64, 32)
    shard = recboost.HashEmbedding(DIM, 2 + 64, admission_counter="sketch", sketch_width=300, sharding="row_wise")
    shard.set_layout("row_wise", 1, 3)
    assert (shard.cache.capacity, shard.cache.sketch_width, shard.cache.sketch_window) == (2 + 22, 300, 150)
    with pytest.raises(ValueError, match=r"For 'HashEmbedding', 'sketch_depth' must be None with "
                                         r"admission_counter='exact'"):
        recboost.HashEmbedding(DIM, 64, admission_counter="exact", sketch_depth=2)
    with pytest.raises(ValueError, match=r"For 'create_table', 'admission_counter' must be one of"):
        recboost.create_table("t", DIM, 64, admission_counter="bloom")


@pytest.mark.parametrize("kwargs, counter", [
    ({}, "exact"),                                                     # grows or overflows: as before
    ({"access_threshold": 1}, "exact"),
    ({"eviction_policy": "lru"}, "exact"),                             # admits at first sight: counts nothing
    ({"eviction_policy": "lru", "access_threshold": 0}, "exact"),
    ({"eviction_policy": "lru", "access_threshold": 1}, "sketch"),     # a fixed budget that counts
    ({"eviction_policy": "lfu", "access_threshold": 3}, "sketch"),
    ({"sketch_depth": 2}, "sketch"),                                   # a sketch size asks for the sketch
    ({"eviction_policy": "lru", "access_threshold": 1, "admission_counter": "exact"}, "exact")])
def test_the_default_admission_counter_keeps_a_fixed_budget_table_in_its_memory(backend, kwargs, counter):
    """admission_counter=None (the tables' default) is the sketch exactly where a table lives in a fixed
    budget and counts ids before admitting them; the resolved counter is the table's setting and what
    create_table and a row-wise shard use too."""
    table = recboost.HashEmbedding(DIM, 64, **kwargs)
    assert table.cache.admission_counter == table.settings()["admission_counter"] == counter
    same = dict(kwargs, access_threshold=kwargs["access_threshold"] + 1) if "access_threshold" in kwargs else kwargs
    assert recboost.create_table("t", DIM, 64, **same).cache.admission_counter == counter     # mx_rec's threshold
    shard = recboost.HashEmbedding(DIM, 64, sharding="row_wise", **kwargs)
    shard.set_layout("row_wise", 0, 2)
    assert shard.cache.admission_counter == counter
    assert recboost.HashCache(64).admission_counter == "exact"          # the primitive: what it is given


def test_a_sketch_re_laid_out_across_ranks_keeps_every_count(backend):
    """Row-wise shards each count their own ids; re-laid out into one table (or any other number of
    ranks) the sketch is the counter-wise maximum of the shards': no id's count goes down, and each
    stays at least its true count."""
    kw = dict(admission_counter="sketch", sketch_width=256, sketch_depth=3, sketch_window=10 ** 6, access_threshold=3)
    ids = np.random.default_rng(0).integers(0, 10 ** 9, 400)
    stream = np.concatenate([ids, ids[:200], ids[:100], ids[:20]])          # seen 1 to 4 times
    shards = []
    for rank in range(2):
        shard = recboost.HashEmbedding(DIM, 2 + 64, sharding="row_wise", **kw)
        shard.set_layout("row_wise", rank, 2)
        shard.cache.lookup(stream[recboost._owner_of(stream, 2) == rank])
        shards.append(shard)
    states = [shard.check_state_dict(shard.state_dict()) for shard in shards]
    whole = recboost.HashEmbedding(DIM, 2 + 64, **kw)
    state = whole.restore_states(states)
    np.testing.assert_array_equal(state["cache"]["sketch"], np.maximum(*[s["cache"]["sketch"] for s in states]))
    whole.load_state_dict(state)
    uniq, true = np.unique(stream, return_counts=True)
    owner = recboost._owner_of(uniq, 2)
    for rank, shard in enumerate(shards):
        mine = uniq[owner == rank]
        assert (whole.cache.counts(mine) >= shard.cache.counts(mine)).all()
    assert (whole.cache.counts(uniq) >= true).all() and len(whole.cache) == sum(len(s.cache) for s in shards) > 0


def test_evict_hook_keeps_a_schedule_per_table_when_tables_share_a_name(backend):
    """Two tables with one name (two default-named HashEmbeddings, as mindrec's two
    HashEmbeddingLookup(embedding_size=...)) each keep their own time schedule: both are due every
    evict_time_interval, and both evict (the second was never due by time when the schedule was keyed by
    name alone: due gave [True, False]). The schedule's state names them 'hash_embedding' and
    'hash_embedding#2' and restores."""
    wide = recboost.HashEmbedding(1, 16, eviction_threshold=1)
    deep = recboost.HashEmbedding(DIM, 16, eviction_threshold=1)
    assert wide.table_name == deep.table_name == "hash_embedding"
    params = recboost._CallbackParams()
    params.train_network = nn.SequentialCell([wide, deep])
    ctx = RunContext(params)
    hook = recboost.EvictHook(evict_time_interval=2, evict_step_interval=None)
    for step in range(1, 7):
        for table in (wide, deep):
            table.prepare(np.array([step]))            # time = the cache's step before it: 0, 1, ...
        params.cur_step_num = step
        hook.on_train_step_end(ctx)
    assert hook.evictions == 4                             # each table at times 2 and 4
    assert wide.cache.stats()["evicted"] == deep.cache.stats()["evicted"] == 3      # id 1, then ids 2 and 3
    state = hook.state_dict()
    assert state["last_time"] == {"hash_embedding": 4, "hash_embedding#2": 4}
    again = recboost.EvictHook(evict_time_interval=2, evict_step_interval=None)
    again.load_state_dict(state)
    for table in (wide, deep):
        table.prepare(np.array([9]))                       # time 6
    assert again.due(7, [wide, deep]) == [True, True]
    assert recboost._table_keys([wide, deep, recboost.HashEmbedding(DIM, 8, name="hash_embedding#2")]) == \
        ["hash_embedding", "hash_embedding#2", "hash_embedding#2#2"]


def test_a_table_too_large_to_allocate_is_named_with_its_capacity_and_bytes(monkeypatch):
    """Issue 61 item 11: ``HashEmbedding(64, 2**31 - 1)`` was a bare "[Errno 12] Cannot allocate memory".
    It is an OSError of that errno naming the table, its capacity and the bytes its rows need (the real
    allocation where the kernel refuses it, and any table when the allocation fails)."""
    import errno
    want = r"\[Errno 12\] For 'HashEmbedding', the hash table '%s' of capacity %d must be a table this process " \
           r"can allocate: its rows alone take %d bytes \(%d rows of %d %s values; .*\), but got '(OSError|MemoryError)"
    with open("/proc/sys/vm/overcommit_memory") as fh:            # (0 or 2: a 512 GB mapping is refused)
        refused = fh.read().strip() != "1"
    if refused:
        with pytest.raises(OSError, match=want % ("big", 2 ** 31 - 1, (2 ** 31 - 1) * 64 * 4, 2 ** 31 - 1, 64,
                                                   "float32")) as raised:
            recboost.HashEmbedding(64, 2 ** 31 - 1, name="big")
        assert raised.value.errno == errno.ENOMEM

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(recboost, "_host_array", no_memory)
    with pytest.raises(OSError, match=want % ("ids", 1000, 1000 * 8 * 2, 1000, 8, "bfloat16")) as raised:
        recboost.HashEmbedding(8, 1000, name="ids", row_dtype="bfloat16")
    assert raised.value.errno == errno.ENOMEM
