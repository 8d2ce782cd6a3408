"""Host-table kernels (gather, bag pooling, grouping by row, the fused sparse optimizers with and without
bags, id-keyed initial rows):
each backend against a plain reference, and the compiled ones bit-identical to their numpy twins
(those parity tests need the compiled backend; the fallback run checks the twins against the
references)."""
import types

import numpy as np
import pytest

import recboost

pytestmark = pytest.mark.fallback       # also on make test's numpy-fallback run (pytest.ini)

PY = types.SimpleNamespace(**recboost._backend_kernels("py"))
FAST = types.SimpleNamespace(**recboost._backend_kernels("fast")) if recboost.FAST_BACKEND else None
needs_fast = pytest.mark.skipif(FAST is None, reason="compiled-vs-twin parity needs the compiled backend (the "
                                "fallback run checks the twins against the plain references): " +
                                recboost.FAST_BACKEND_REASON)


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _batch(rng, n, capacity, d, vocab):
    rows = rng.integers(0, min(vocab, capacity), size=n).astype(np.int32)
    rows[: min(3, n)] = [0, 1, 0][: min(3, n)]                    # default and reserved rows too
    grad = rng.standard_normal((n, d)).astype(np.float32)
    return rows, grad


def test_gather_rows(backend):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((30, 5)).astype(np.float32)
    rows = np.array([3, 0, 3, 29, 1], np.int32)
    out = np.empty((5, 5), np.float32)
    assert backend.gather_rows(table, rows, out) is out
    np.testing.assert_array_equal(out, table[rows])
    assert backend.gather_rows(table, rows[:0], np.empty((0, 5), np.float32)).shape == (0, 5)
    with pytest.raises(IndexError, match="row 30"):
        backend.gather_rows(table, np.array([2, 30], np.int32), np.empty((2, 5), np.float32))


def test_scatter_rows(backend):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((30, 5)).astype(np.float32)
    src = rng.standard_normal((5, 5)).astype(np.float32)
    rows = np.array([3, 0, 3, 29, 1], np.int32)             # row 3 twice: the last write stays
    want = table.copy()
    for i, r in enumerate(rows):
        want[r] = src[i]
    assert backend.scatter_rows(src, rows, table) is table
    np.testing.assert_array_equal(table, want)
    np.testing.assert_array_equal(table[3], src[2])
    assert backend.scatter_rows(src[:0], rows[:0], table) is table
    np.testing.assert_array_equal(table, want)
    with pytest.raises(IndexError, match="row 30"):                 # refused before anything is written
        backend.scatter_rows(src[:2], np.array([2, 30], np.int32), table)
    np.testing.assert_array_equal(table, want)
    with pytest.raises(ValueError, match=r"src has shape \(2, 5\), expected \(3, 5\)"):
        backend.scatter_rows(src[:2], rows[:3], table)


def test_unique_inverse(backend):
    rows = np.array([7, 3, 7, 0, 3, 9, 0], np.int32)
    mark = np.full(12, -1, np.int32)
    uniq, inverse = backend.unique_inverse(rows, mark)
    assert uniq.tolist() == [7, 3, 0, 9] and inverse.tolist() == [0, 1, 0, 2, 1, 3, 2]
    assert (mark == -1).all()
    uniq, inverse = backend.unique_inverse(rows[:0], mark)
    assert uniq.size == 0 and inverse.size == 0
    with pytest.raises(IndexError):
        backend.unique_inverse(np.array([12], np.int32), mark)


def test_unique_ids(backend):
    ids = np.array([7, -3, 7, 2 ** 62, -3, 9, 2 ** 62, 0], np.int64)
    keys, inverse = backend.unique_ids(ids)
    assert keys.dtype == np.int64 and inverse.dtype == np.int32
    assert keys.tolist() == [7, -3, 2 ** 62, 9, 0] and inverse.tolist() == [0, 1, 0, 2, 1, 3, 2, 4]
    keys, inverse = backend.unique_ids(ids[:0])
    assert keys.size == 0 and inverse.size == 0
    rng = np.random.default_rng(3)
    ids = rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64)[rng.integers(0, 3000, 20000)]
    keys, inverse = backend.unique_ids(ids)
    np.testing.assert_array_equal(keys[inverse], ids)
    _, first = np.unique(ids, return_index=True)
    np.testing.assert_array_equal(keys, ids[np.sort(first)])          # first-occurrence order


@needs_fast
def test_unique_ids_compiled_equals_twin():
    rng = np.random.default_rng(4)
    for n, vocab in ((1, 1), (1000, 10), (50000, 40000), (70000, 2 ** 40)):
        ids = rng.integers(0, vocab, n, dtype=np.int64)
        for got, want in zip(FAST.unique_ids(ids), PY.unique_ids(ids)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def _run(k, kind, state, uniq, inverse, grad, acc, *bags, largest=None, prep=None, weighted=None):
    """One fused update of ``kind``; ``bags`` is () or (offsets, scale); ``largest``: the running bounds of a
    growing optimizer's kernel (``GROWING``); ``prep``: the row preparation keywords (clipping, decay);
    ``weighted``: the bags' ``weights`` and ``argmax`` keywords (weighted ids, max pooling)."""
    prep = dict(prep or {}, **(weighted or {}))
    if kind == "sgd":
        k.sparse_sgd_update(state["w"], uniq, inverse, grad, acc, np.float32(0.3), *bags, largest=largest, **prep)
    elif kind == "adagrad":
        k.sparse_adagrad_update(state["w"], state["a"], uniq, inverse, grad, acc, np.float32(0.3), *bags,
                                largest=largest, **prep)
    elif kind == "rowwise":
        k.sparse_rowwise_adagrad_update(state["w"], state["r"], uniq, inverse, grad, acc, np.float32(0.3),
                                        np.float32(1e-8), *bags, largest=largest, **prep)
    elif kind == "adam":
        k.sparse_adam_update(state["w"], state["m"], state["v"], uniq, inverse, grad, acc, np.float32(0.01),
                             np.float32(0.9), np.float32(0.999), np.float32(1) - np.float32(0.9),
                             np.float32(1) - np.float32(0.999), np.float32(1e-8), *bags, largest=largest, **prep)
    else:
        lr_power = -0.5 if kind == "ftrl" else -0.3
        k.sparse_ftrl_update(state["w"], state["a"], state["m"], uniq, inverse, grad, acc, np.float32(0.2),
                             np.float32(lr_power), np.float32(0.01), np.float32(0.02), *bags, largest=largest,
                             **{key: value for key, value in prep.items() if key in ("clip_value", "clip_norm",
                                                                                     "weight_decay", "weights",
                                                                                     "argmax", "seed", "counter")})


def _fresh_state(rng, capacity, d):
    w = rng.standard_normal((capacity, d)).astype(np.float32)
    return {"w": w, "a": np.full((capacity, d), 0.1, np.float32), "m": np.zeros((capacity, d), np.float32),
            "v": np.zeros((capacity, d), np.float32), "r": np.full((capacity, 1), 0.1, np.float32)}


KINDS = ["sgd", "adagrad", "rowwise", "adam", "ftrl", "ftrl_p03"]
#: the kernels that keep running bounds: per entry of ``largest``, the state it bounds and whether in magnitude
GROWING = {"adagrad": (("a", False),), "rowwise": (("r", False),),
           "ftrl": (("a", False), ("m", True), ("w", True)), "ftrl_p03": (("a", False), ("m", True), ("w", True))}


@pytest.mark.parametrize("kind", KINDS)
def test_fused_update_equals_plain_reference(backend, kind):
    """One row at a time in float64-free numpy: the gradient of a row is the sum of its ids' rows."""
    rng = np.random.default_rng(1)
    d, capacity = 16, 40
    state = _fresh_state(rng, capacity, d)
    rows, grad = _batch(rng, 50, capacity, d, 25)
    uniq, inverse = recboost._py_unique_inverse(rows, np.full(capacity, -1, np.int32))
    want = {k: v.copy() for k, v in state.items()}
    for k, r in enumerate(uniq):
        g = np.zeros(d, np.float32)
        for i in np.flatnonzero(inverse == k):
            g = g + grad[i]
        one = {name: arr[r:r + 1].copy() for name, arr in want.items()}
        _run(PY, kind, one, np.array([0], np.int32), np.array([0], np.int32), g[None], np.empty((1, d), np.float32))
        for name in want:
            want[name][r] = one[name][0]
    _run(backend, kind, state, uniq, inverse, grad, np.empty((uniq.size + 3, d), np.float32))
    for name in state:
        np.testing.assert_array_equal(state[name], want[name], err_msg=name)
    assert not np.array_equal(state["w"][uniq], _fresh_state(np.random.default_rng(1), capacity, d)["w"][uniq])


@pytest.mark.parametrize("kind", list(GROWING))
def test_fused_updates_raise_their_running_bounds(backend, kind):
    """Given ``largest``, an Adagrad, row-wise Adagrad or FTRL kernel raises each of its entries to the largest
    value it writes of the state it bounds (accumulators as they are, FTRL's linear and weights in magnitude),
    passing NaNs over (a NaN gradient row), and keeps an entry nothing written exceeds; the rows and slots
    are updated exactly as without it. A ``largest`` too short is refused."""
    rng = np.random.default_rng(5)
    d, capacity = 8, 60
    state = _fresh_state(rng, capacity, d)
    plain = {k: v.copy() for k, v in state.items()}
    largest = np.float32([0.5, 0.25, 1e6])                  # the weights' entry stays: nothing written reaches it
    for step in range(4):
        rows, grad = _batch(rng, 70, capacity, d, 50)
        if step == 2:
            grad[5] = np.nan
        uniq, inverse = backend.unique_inverse(rows, np.full(capacity, -1, np.int32))
        before = largest.copy()
        _run(backend, kind, state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), largest=largest)
        _run(backend, kind, plain, uniq, inverse, grad, np.empty((uniq.size, d), np.float32))
        for name in state:
            np.testing.assert_array_equal(state[name], plain[name], err_msg=name)
        for i, (name, magnitude) in enumerate(GROWING[kind]):
            written = np.abs(state[name][uniq]) if magnitude else state[name][uniq]
            assert largest[i] == max(before[i], np.nanmax(written)), (step, name)
        assert (step != 2) or np.isnan(state[GROWING[kind][0][0]][uniq]).any()     # (a NaN accumulator written)
    assert largest[0] > 0.5 and (kind not in ("ftrl", "ftrl_p03") or (largest[1] > 0.25 and largest[2] == 1e6))
    with pytest.raises(ValueError, match="largest has 0 entries"):
        _run(backend, kind, state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
             largest=np.zeros(0, np.float32))


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_are_bit_identical(kind, d):
    rng = np.random.default_rng(d)
    capacity = 500
    py_state = _fresh_state(rng, capacity, d)
    fast_state = {k: v.copy() for k, v in py_state.items()}
    py_largest, fast_largest = (np.zeros(3, np.float32) if kind in GROWING else None for _ in range(2))
    mark = np.full(capacity, -1, np.int32)
    for _ in range(4):                                   # slot state evolves over steps
        rows, grad = _batch(rng, 300, capacity, d, 200)
        uniq, inverse = FAST.unique_inverse(rows, mark)
        u_py, i_py = PY.unique_inverse(rows, mark)
        np.testing.assert_array_equal(uniq, u_py)
        np.testing.assert_array_equal(inverse, i_py)
        _run(PY, kind, py_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), largest=py_largest)
        _run(FAST, kind, fast_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
             largest=fast_largest)
        for name in py_state:
            np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]), err_msg=name)
        if kind in GROWING:
            np.testing.assert_array_equal(_bits(fast_largest), _bits(py_largest))
    # empty batch: nothing changes
    before = {k: v.copy() for k, v in fast_state.items()}
    _run(FAST, kind, fast_state, np.empty(0, np.int32), np.empty(0, np.int32), np.empty((0, d), np.float32),
         np.empty((0, d), np.float32))
    for name in before:
        np.testing.assert_array_equal(fast_state[name], before[name])


@needs_fast
def test_gather_scatter_and_init_rows_are_bit_identical():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((1000, 17)).astype(np.float32)
    rows = rng.integers(0, 1000, 5000).astype(np.int32)
    a, b = np.empty((5000, 17), np.float32), np.empty((5000, 17), np.float32)
    np.testing.assert_array_equal(FAST.gather_rows(table, rows, a), PY.gather_rows(table, rows, b))
    src = rng.standard_normal((5000, 17)).astype(np.float32)        # repeated rows: the last write stays
    np.testing.assert_array_equal(FAST.scatter_rows(src, rows, table.copy()), PY.scatter_rows(src, rows, table.copy()))
    ids = np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64), [0, -1, 2 ** 63 - 1]])
    for seed, std in ((0, 0.01), (2 ** 63 - 1, 1.0), (12345, 0.0)):
        x, y = np.empty((ids.size, 16), np.float32), np.empty((ids.size, 16), np.float32)
        FAST.init_rows(ids, seed, std, x)
        PY.init_rows(ids, seed, std, y)
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_init_rows_are_keyed_by_seed_and_id(backend):
    ids = np.arange(100000, dtype=np.int64) * 7919 - 3
    out = backend.init_rows(ids, 7, 0.05, np.empty((ids.size, 4), np.float32))
    assert abs(out.mean()) < 0.05 * 0.01 and abs(out.std() / 0.05 - 1) < 0.01      # mean 0, stddev 0.05
    assert np.abs(out).max() <= 0.05 * 3 ** 0.5 * 2                                 # bounded (Irwin-Hall)
    again = backend.init_rows(ids[::-1].copy(), 7, 0.05, np.empty((ids.size, 4), np.float32))
    np.testing.assert_array_equal(again[::-1], out)                                 # order does not matter
    other = backend.init_rows(ids[:10], 8, 0.05, np.empty((10, 4), np.float32))
    assert (other != out[:10]).all()                                                # the seed matters
    assert (backend.init_rows(ids[:5], 7, 0.0, np.empty((5, 4), np.float32)) == 0).all()


# ---- bags: multi-hot pooling and the bag gradient spread to its ids ---------------------------------
def _bags(rng, nb, max_len, capacity, vocab):
    """Random bags: int32 rows per position, int64 offsets (nb+1), the lengths (empty bags included)."""
    lengths = rng.integers(0, max_len + 1, size=nb)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, min(vocab, capacity), size=int(offsets[-1])).astype(np.int32)
    return rows, offsets, lengths


def _scale(mode, lengths):
    n = np.maximum(lengths, 1).astype(np.float32)
    return {"sum": np.ones_like(n), "mean": np.float32(1) / n, "sqrtn": np.float32(1) / np.sqrt(n)}[mode]


@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_gather_pool_equals_plain_reference(backend, mode):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((40, 7)).astype(np.float32)
    table[39] = -0.0
    lengths = np.array([3, 0, 1, 5, 0, 2, 1, 1], np.int64)                     # empty bags, bags of one
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, 39, size=int(offsets[-1])).astype(np.int32)
    rows[offsets[6]] = 39                                                       # a bag of one -0.0 row
    scale = _scale(mode, lengths)
    out = np.full((8, 7), np.nan, np.float32)
    assert backend.gather_pool(table, rows, offsets, scale, out) is out
    want = np.empty_like(out)
    for b in range(8):
        acc = np.zeros(7, np.float32)
        for p in range(offsets[b], offsets[b + 1]):
            acc = acc + table[rows[p]]
        want[b] = acc * scale[b]
    np.testing.assert_array_equal(_bits(out), _bits(want))
    assert (_bits(out[[1, 4, 6]]) == 0).all()                                   # +0.0: empty bags, -0.0 row
    if mode == "sum":
        np.testing.assert_array_equal(out[[2, 7]], table[rows[offsets[[2, 7]]]])  # a bag of one is its row
    empty = backend.gather_pool(table, rows[:0], np.zeros(1, np.int64), np.empty(0, np.float32),
                                np.empty((0, 7), np.float32))
    assert empty.shape == (0, 7)


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 33])
def test_gather_pool_is_bit_identical(d):
    rng = np.random.default_rng(d)
    table = rng.standard_normal((1000, d)).astype(np.float32)
    rows, offsets, lengths = _bags(rng, 1000, 20, 1000, 1000)
    assert 4000 < rows.size < 16000
    scale = np.where(rng.random(1000) < 0.5, _scale("mean", lengths), rng.standard_normal(1000)).astype(np.float32)
    a, b = np.empty((1000, d), np.float32), np.empty((1000, d), np.float32)
    FAST.gather_pool(table, rows, offsets, scale, a)
    PY.gather_pool(table, rows, offsets, scale, b)
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _bag_batch(rng, capacity, d, nb=60):
    rows, offsets, lengths = _bags(rng, nb, 6, capacity, 25)
    rows[: min(2, rows.size)] = [0, 1][: min(2, rows.size)]
    grad = rng.standard_normal((nb, d)).astype(np.float32)
    scale = np.where(rng.random(nb) < 0.5, _scale("sqrtn", lengths), rng.standard_normal(nb)).astype(np.float32)
    return rows, offsets, grad, scale


# the update with bags against the expanded gradient: tests/test_weighted_ids.py's
# test_fused_updates_with_weights_and_argmax_equal_the_spread_gradient[plain] (no weights, no arg-max)


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_with_bags_are_bit_identical(kind, d):
    rng = np.random.default_rng(100 + d)
    capacity = 500
    py_state = _fresh_state(rng, capacity, d)
    fast_state = {k: v.copy() for k, v in py_state.items()}
    mark = np.full(capacity, -1, np.int32)
    for _ in range(4):
        rows, offsets, lengths = _bags(rng, 200, 8, capacity, 200)
        grad = rng.standard_normal((200, d)).astype(np.float32)
        scale = _scale("mean", lengths)
        uniq, inverse = FAST.unique_inverse(rows, mark)
        _run(PY, kind, py_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), offsets, scale)
        _run(FAST, kind, fast_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), offsets, scale)
        for name in py_state:
            np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]), err_msg=name)
    # no positions (every bag empty, or no bags): nothing changes
    before = {k: v.copy() for k, v in fast_state.items()}
    for nb in (3, 0):
        for k in (FAST, PY):
            _run(k, kind, fast_state, np.empty(0, np.int32), np.empty(0, np.int32), np.ones((nb, d), np.float32),
                 np.empty((0, d), np.float32), np.zeros(nb + 1, np.int64), np.ones(nb, np.float32))
    for name in before:
        np.testing.assert_array_equal(fast_state[name], before[name])


@pytest.mark.parametrize("opt", [recboost.sparse_optimizer(name, learning_rate=0.1, **{"SparseFtrl": {"l1": 0.01}}.get(
    name, {})) for name in recboost.sparse_optimizers()], ids=lambda o: type(o).__name__)      # each registered one
def test_optimizer_step_passes_bags_through(backend, opt):
    rng = np.random.default_rng(7)
    d, capacity = 8, 40
    rows, offsets, grad, scale = _bag_batch(rng, capacity, d)
    uniq, inverse = backend.unique_inverse(rows, np.full(capacity, -1, np.int32))
    g_pos = (grad * scale[:, None])[np.repeat(np.arange(grad.shape[0]), np.diff(offsets))]
    results = []
    for args in ((g_pos,), (grad, offsets, scale)):
        weight = np.random.default_rng(8).standard_normal((capacity, d)).astype(np.float32)
        slots = opt.new_slots(capacity, d)
        scalars = dict(opt.scalar_inits)
        opt.update(weight, slots, scalars, uniq, inverse, args[0], np.empty((uniq.size, d), np.float32), *args[1:])
        results.append((weight, slots, scalars))
    (w1, s1, c1), (w2, s2, c2) = results
    np.testing.assert_array_equal(_bits(w1), _bits(w2))
    for name in s1:
        np.testing.assert_array_equal(_bits(s1[name]), _bits(s2[name]), err_msg=name)
    assert c1 == c2


def test_rowwise_adagrad_update_equals_its_formula_in_float64(backend):
    """The row-wise rule against its formula computed independently (float64, whole batch at once):
    ``acc += mean(g*g) over the row; w -= lr * g / (sqrt(acc) + eps)``, g the row's summed gradient,
    one accumulator per row; bags spread ``grad[b] * scale[b]`` to their positions first."""
    rng = np.random.default_rng(11)
    d, capacity, lr, eps = 12, 60, 0.3, 1e-3
    w = rng.standard_normal((capacity, d)).astype(np.float32)
    a = rng.uniform(0, 1, (capacity, 1)).astype(np.float32)
    want_w, want_a = w.astype(np.float64), a.astype(np.float64)
    w0, a0, seen = w.copy(), a.copy(), set()
    for bags in (False, True, False):
        if bags:
            rows, offsets, grad, scale = _bag_batch(rng, capacity, d)
            g_pos = (grad.astype(np.float64) * scale[:, None])[np.repeat(np.arange(grad.shape[0]), np.diff(offsets))]
            extra = (offsets, scale)
        else:
            rows, grad = _batch(rng, 80, capacity, d, 30)
            g_pos, extra = grad.astype(np.float64), ()
        uniq, inverse = backend.unique_inverse(rows, np.full(capacity, -1, np.int32))
        g = np.zeros((capacity, d))
        np.add.at(g, rows, g_pos)
        touched = np.unique(rows)
        want_a[touched] += (g[touched] ** 2).mean(axis=1, keepdims=True)
        want_w[touched] -= lr * g[touched] / (np.sqrt(want_a[touched]) + eps)
        backend.sparse_rowwise_adagrad_update(w, a, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
                                              np.float32(lr), np.float32(eps), *extra)
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(w, want_w, rtol=1e-4, atol=1e-5)
        seen.update(touched.tolist())
    moved, kept = sorted(seen), sorted(set(range(capacity)) - seen)
    assert kept and (a[moved] > a0[moved]).all() and (w[moved] != w0[moved]).any(axis=1).all()
    np.testing.assert_array_equal(w[kept], w0[kept])
    np.testing.assert_array_equal(a[kept], a0[kept])


def test_rowwise_adagrad_refuses_an_accumulator_per_value(backend):
    w, grad = np.ones((10, 4), np.float32), np.ones((1, 4), np.float32)
    for bad in (np.zeros((10, 4), np.float32), np.zeros((9, 1), np.float32)):
        with pytest.raises(ValueError, match=r"accum has shape \(%d, %d\), expected \(10, 1\)" % bad.shape):
            backend.sparse_rowwise_adagrad_update(w, bad, np.array([3], np.int32), np.array([0], np.int32), grad,
                                                  np.empty((1, 4), np.float32), np.float32(0.1), np.float32(1e-8))
        assert (w == 1).all() and not bad.any()


def test_gather_pool_errors(backend):
    table = np.zeros((30, 4), np.float32)
    rows = np.array([1, 2, 3, 4, 5], np.int32)
    off = np.array([0, 2, 5], np.int64)
    sc = np.ones(2, np.float32)
    out = np.full((2, 4), 7, np.float32)

    def pool(rows=rows, off=off, sc=sc, out=out):
        return backend.gather_pool(table, rows, off, sc, out)

    with pytest.raises(IndexError, match=r"row 30 \(at 3\) is outside the table of 30 rows"):
        pool(rows=np.array([1, 2, 3, 30, -1], np.int32))
    with pytest.raises(IndexError, match=r"row -1 \(at 4\)"):
        pool(rows=np.array([1, 2, 3, 4, -1], np.int32))
    with pytest.raises(ValueError, match="offsets is empty"):
        pool(off=np.empty(0, np.int64), sc=np.empty(0, np.float32))
    with pytest.raises(ValueError, match=r"offsets\[0\] is 1, expected 0"):
        pool(off=np.array([1, 2, 5], np.int64))
    with pytest.raises(ValueError, match=r"offsets\[2\] is 4, expected 5 \(the number of positions\)"):
        pool(off=np.array([0, 2, 4], np.int64))
    with pytest.raises(ValueError, match=r"offsets decrease at bag 1 \(3 > 2\)"):
        pool(off=np.array([0, 3, 2, 5], np.int64), sc=np.ones(3, np.float32), out=np.empty((3, 4), np.float32))
    with pytest.raises(ValueError, match="scale has 3 entries, expected 2 \\(one per bag\\)"):
        pool(sc=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"out has shape \(2, 5\), expected \(2, 4\)"):
        pool(out=np.empty((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"out has shape \(3, 4\), expected \(2, 4\)"):
        pool(out=np.empty((3, 4), np.float32))
    assert (out == 7).all()                                                     # nothing written on errors


def test_fused_update_bag_errors(backend):
    d = 4
    w = np.ones((10, d), np.float32)
    uniq, inverse = np.array([3, 5], np.int32), np.array([0, 1, 0], np.int32)
    off, sc, grad = np.array([0, 1, 3], np.int64), np.ones(2, np.float32), np.ones((2, d), np.float32)
    acc = np.empty((2, d), np.float32)

    def sgd(grad=grad, off=off, sc=sc):
        backend.sparse_sgd_update(w, uniq, inverse, grad, acc, np.float32(0.1), off, sc)

    for args in ((off, None), (None, sc)):
        with pytest.raises(ValueError, match="offsets and scale go together"):
            sgd(off=args[0], sc=args[1])
    with pytest.raises(ValueError, match="offsets and scale go together"):
        backend.sparse_sgd_update(w, uniq, inverse, grad, acc, np.float32(0.1), scale=sc)
    with pytest.raises(ValueError, match=r"grad has 3 rows, expected 2 \(one per bag\)"):
        sgd(grad=np.ones((3, d), np.float32))
    with pytest.raises(ValueError, match="scale has 1 entries, expected 2"):
        sgd(sc=np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"offsets\[2\] is 4, expected 3 \(the number of positions\)"):
        sgd(off=np.array([0, 1, 4], np.int64))
    with pytest.raises(ValueError, match="offsets decrease at bag 1"):
        sgd(off=np.array([0, 2, 1, 3], np.int64), sc=np.ones(3, np.float32), grad=np.ones((3, d), np.float32))
    with pytest.raises(ValueError, match=r"offsets\[0\] is 1"):
        sgd(off=np.array([1, 1, 3], np.int64))
    assert (w == 1).all()                                                       # nothing updated on errors
    sgd()
    lr = np.float32(0.1)                                    # row 3: positions 0 and 2, row 5: position 1
    np.testing.assert_array_equal(w[[3, 5]], [[np.float32(1) - lr * np.float32(2)] * d, [np.float32(1) - lr] * d])


def test_sum_by_row(backend):
    """The per-row gradient sum alone (data-parallel tables combine it across ranks): against a plain
    loop, with and without bags; the compiled result bit-identical to the twin's."""
    rng = np.random.default_rng(3)
    rows, grad = _batch(rng, 200, 60, 8, 60)
    uniq, inverse = backend.unique_inverse(rows, np.full(60, -1, np.int32))
    acc = np.full((uniq.size + 3, 8), 7.0, np.float32)
    out = backend.sum_by_row(uniq, inverse, grad, acc)
    want = np.zeros((uniq.size, 8), np.float32)
    for i, k in enumerate(inverse):
        want[k] += grad[i]
    np.testing.assert_array_equal(out, want)
    assert out.shape == (uniq.size, 8) and np.shares_memory(out, acc)
    # bags: 50 bags over the 200 positions, grad one row per bag
    offsets = np.sort(rng.integers(0, 201, 49)).astype(np.int64)
    offsets = np.concatenate([[0], offsets, [200]]).astype(np.int64)
    scale = rng.random(50).astype(np.float32)
    bag_grad = rng.standard_normal((50, 8)).astype(np.float32)
    out = backend.sum_by_row(uniq, inverse, bag_grad, acc, offsets, scale)
    want[...] = 0
    for b in range(50):
        for p in range(offsets[b], offsets[b + 1]):
            want[inverse[p]] += bag_grad[b] * scale[b]
    np.testing.assert_array_equal(out, want)
    if FAST is not None:
        np.testing.assert_array_equal(_bits(FAST.sum_by_row(uniq, inverse, bag_grad, acc.copy(), offsets, scale)),
                                      _bits(PY.sum_by_row(uniq, inverse, bag_grad, acc.copy(), offsets, scale)))
    with pytest.raises(ValueError, match="offsets and scale"):
        backend.sum_by_row(uniq, inverse, bag_grad, acc, offsets)


# ---- bfloat16 rows --------------------------------------------------------------------------------
def _bf16_neighbours(x):
    """The bfloat16 values just below and above |x| (as float64, with x's sign), found independently
    of the kernels: bfloat16 keeps float32's exponent and the top 7 mantissa bits."""
    ax = np.abs(x.astype(np.float64))
    e = np.floor(np.log2(np.maximum(ax, 2.0 ** -126)))
    gap = 2.0 ** (np.maximum(e, -126) - 7)                           # the spacing of bfloat16 at |x|
    lo = np.floor(ax / gap) * gap
    return np.sign(x) * lo, np.sign(x) * (lo + gap), gap


def test_bf16_decode_is_exact_and_nearest_encoding_rounds_half_to_even(backend):
    rng = np.random.default_rng(20)
    x = (rng.standard_normal((300, 7)) * 10.0 ** rng.integers(-30, 30, (300, 7))).astype(np.float32)
    x[0] = [1.0, 1.00390625, 1.01171875, -1.00390625, 0.0, -2.5, 3e-39]   # ties to even, zero, a subnormal
    rows = rng.permutation(400)[:300].astype(np.int32)
    table = np.zeros((400, 7), np.uint16)
    backend.bf16_encode(x, rows, table, 0, 0, False)
    got = backend.bf16_decode(table, rows, np.empty((300, 7), np.float32)).astype(np.float64)
    lo, hi, gap = _bf16_neighbours(x)
    down, up = np.abs(x - lo), np.abs(hi - x)
    even_lo = (np.round(np.abs(lo) / gap) % 2) == 0
    want = np.where(down < up, lo, np.where(up < down, hi, np.where(even_lo, lo, hi)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0, :4], [1.0, 1.0, 1.015625, -1.0])
    assert not table[np.setdiff1d(np.arange(400), rows)].any()                 # other rows untouched
    back = backend.bf16_decode(table, rows, np.empty((300, 7), np.float32))
    np.testing.assert_array_equal(back.view(np.uint32) >> 16, table[rows])        # decoding: bits << 16
    assert (back.view(np.uint32) & 0xFFFF == 0).all()
    with pytest.raises(IndexError, match=r"row 400 \(at 1\) is outside the table of 400 rows"):
        backend.bf16_encode(x[:2], np.array([0, 400], np.int32), table, 0, 0, False)
    with pytest.raises(IndexError, match=r"row -1 \(at 0\)"):
        backend.bf16_decode(table, np.array([-1], np.int32), np.empty((1, 7), np.float32))


def test_bf16_stochastic_rounding_is_unbiased_and_keyed_by_seed_counter_row_column(backend):
    """Each value rounds to one of its two bfloat16 neighbours, up with probability (x - lo) / gap:
    over 4000 counters the mean is x within 5 standard errors (the rounding's standard deviation is
    at most gap/2). The bits depend on (seed, counter, row, column) only: rows written in another
    order or alone get the same values."""
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((4, 16)) * 10.0 ** rng.integers(-5, 5, (4, 16))).astype(np.float32)
    rows = np.array([3, 0, 2, 1], np.int32)
    lo, hi, gap = _bf16_neighbours(x)
    n = 4000
    total, ups = np.zeros(x.shape), np.zeros(x.shape)
    table = np.zeros((4, 16), np.uint16)
    for counter in range(n):
        backend.bf16_encode(x, rows, table, 7, counter, True)
        got = backend.bf16_decode(table, rows, np.empty(x.shape, np.float32)).astype(np.float64)
        exact = x.astype(np.float64) == lo
        assert ((got == lo) | (got == hi)).all()
        total += got
        ups += (got == hi) & ~exact
    err = np.abs(total / n - x.astype(np.float64))
    assert (err <= 5 * (gap / 2) / np.sqrt(n)).all(), (err / gap).max()
    p = (np.abs(x.astype(np.float64)) - np.abs(lo)) / gap
    assert (np.abs(ups / n - p) <= 5 * 0.5 / np.sqrt(n)).all()
    one = np.zeros((4, 16), np.uint16)
    for k in (2, 0, 3, 1):                                      # one row at a time, another order
        backend.bf16_encode(x[k:k + 1], rows[k:k + 1], one, 7, n - 1, True)
    np.testing.assert_array_equal(one, table)
    other = np.zeros((4, 16), np.uint16)
    backend.bf16_encode(x, rows, other, 8, n - 1, True)          # another seed: other bits
    assert (other != table).any()


@needs_fast
def test_bf16_kernels_are_bit_identical():
    rng = np.random.default_rng(22)
    for d in (1, 16, 33):
        x = (rng.standard_normal((500, d)) * 10.0 ** rng.integers(-40, 39, (500, d))).astype(np.float32)
        x[0, :1] = np.nan
        x[1, :1] = np.inf
        x[2, :1] = -np.inf
        x[3, :1] = np.float32(3.4e38)                            # may round to infinity
        x[4:8, -1] = [np.nan, np.inf, -np.inf, 3.4e38]          # ... and in the last column (a vector's tail)
        x[8:12, d // 2] = [np.nan, np.inf, -np.inf, -3.4e38]      # ... and mid-row
        rows = rng.permutation(700)[:500].astype(np.int32)
        for seed, counter, stochastic in ((0, 0, False), (5, 2 ** 40 + 3, True), (2 ** 63, 1, True)):
            a, b = np.zeros((700, d), np.uint16), np.zeros((700, d), np.uint16)
            FAST.bf16_encode(x, rows, a, seed, counter, stochastic)
            PY.bf16_encode(x, rows, b, seed, counter, stochastic)
            np.testing.assert_array_equal(a, b)
            assert a[rows[0], 0] & 0x7F80 == 0x7F80 and a[rows[0], 0] & 0x7F     # NaN stays NaN
            assert a[rows[1], 0] == 0x7F80 and a[rows[2], 0] == 0xFF80            # infinities stay
            o1, o2 = np.empty((500, d), np.float32), np.empty((500, d), np.float32)
            FAST.bf16_decode(a, rows, o1)
            PY.bf16_decode(a, rows, o2)
            np.testing.assert_array_equal(_bits(o1), _bits(o2))


def _bf16_state(rng, capacity, d):
    """``_fresh_state`` with its rows as bfloat16 bits (rounded to nearest: ``w`` uint16)."""
    state = _fresh_state(rng, capacity, d)
    bits = np.zeros((capacity, d), np.uint16)
    PY.bf16_encode(state["w"], np.arange(capacity, dtype=np.int32), bits, 0, 0, False)
    return dict(state, w=bits)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_on_bfloat16_rows_equal_decode_step_encode(backend, kind):
    """A fused update of bfloat16 rows (a uint16 table, ``seed`` and ``counter``) equals, bit for bit: the
    whole table decoded to float32, the float32 twin's update of it, and the touched rows encoded back
    stochastically with that seed and counter (``bf16_encode``); untouched rows keep their bits, slots and
    running bounds are the float32 update's. Over steps, at batch sizes around the kernels' blocks of
    16 rows (1, 16, 37), widths 16 and 17 (a row of 34 bytes straddles cache lines), with the row options
    and ``largest`` on, and with bags. Another counter gives other bits."""
    rng = np.random.default_rng(40)
    capacity = 120
    for d in (16, 17):
        state = _bf16_state(rng, capacity, d)
        largest = np.zeros(3, np.float32)
        for step, u in enumerate((1, 16, 37, 37)):
            uniq = rng.permutation(capacity)[:u].astype(np.int32)
            inverse = np.concatenate([np.arange(u), rng.integers(0, u, u)]).astype(np.int32)
            grad = rng.standard_normal((2 * u, d)).astype(np.float32)
            bags = ()
            if step == 3:                               # bags: one per two positions
                bags = (np.arange(0, 2 * u + 1, 2, dtype=np.int64), rng.random(u).astype(np.float32))
                grad = grad[:u]
            prep = PREP if step % 2 else {}
            want = {name: array.copy() for name, array in state.items()}
            want_largest = largest.copy()
            floats = PY.bf16_decode(want["w"], np.arange(capacity, dtype=np.int32),
                                    np.empty((capacity, d), np.float32))
            _run(PY, kind, dict(want, w=floats), uniq, inverse, grad, np.empty((u, d), np.float32), *bags,
                 largest=want_largest, prep=prep)
            PY.bf16_encode(np.ascontiguousarray(floats[uniq]), uniq, want["w"], 9, step, True)
            _run(backend, kind, state, uniq, inverse, grad, np.empty((u, d), np.float32), *bags, largest=largest,
                 prep=dict(prep, seed=9, counter=step))
            for name in state:
                np.testing.assert_array_equal(state[name].view(np.uint8), want[name].view(np.uint8),
                                              err_msg="%s d=%d step %d" % (name, d, step))
            np.testing.assert_array_equal(_bits(largest), _bits(want_largest))
        assert largest[2] > 0                   # (the L2 decay's steps raise the bound of |weight|)
    before = state["w"].copy()
    other = {name: array.copy() for name, array in state.items()}
    for arrays, counter in ((state, 7), (other, 8)):
        _run(backend, kind, arrays, uniq, inverse, grad, np.empty((u, d), np.float32), *bags,
             prep={"seed": 9, "counter": counter})
    assert (state["w"][uniq] != other["w"][uniq]).any() and (state["w"][uniq] != before[uniq]).any()


@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_take_only_float32_or_bfloat16_rows(backend, kind):
    """A table of another dtype (float64, int16) is a TypeError before anything is written, on both
    backends naming the dtype and the two it takes (the compiled kernel's dispatch alone said "No
    matching signature found")."""
    rng = np.random.default_rng(41)
    for dtype in (np.float64, np.int16):
        state = dict(_fresh_state(rng, 20, 4), w=np.ones((20, 4), dtype))
        before = {name: array.copy() for name, array in state.items()}
        with pytest.raises(TypeError, match="table has dtype %s, expected float32 rows or bfloat16 bits"
                           % np.dtype(dtype)):
            _run(backend, kind, state, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32),
                 np.ones((3, 4), np.float32), np.empty((3, 4), np.float32))
        for name in state:
            np.testing.assert_array_equal(state[name], before[name], err_msg=name)


#: clipping by value and by norm, L2 decay into the gradient and decoupled decay, all on (FTRL: no decoupled decay)
PREP = {"clip_value": np.float32(0.7), "clip_norm": np.float32(1.5), "weight_decay": np.float32(0.05),
        "decay": np.float32(0.01)}


def _prepared_reference(w, g, prep, ftrl):
    """A touched row's prepared gradient and row, in float64 from the definitions: np.clip, then scaled to
    at most clip_norm in L2 norm, then + wd * w; the row times (1 - decay) (FTRL: not decayed)."""
    g = np.clip(g.astype(np.float64), -prep["clip_value"], prep["clip_value"])
    norm = np.sqrt((g * g).sum())
    if norm > prep["clip_norm"]:
        g = g * (float(prep["clip_norm"]) / norm)
    return w * (1.0 - (0.0 if ftrl else float(prep["decay"]))), g + float(prep["weight_decay"]) * w.astype(np.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_rows_equal_the_plain_update_of_the_clipped_and_decayed_gradient(backend, kind):
    """With clipping and decay each touched row's update is the plain kernel's (no options) on the row and
    gradient prepared by the definitions (float64, so within float32 rounding): rows whose gradient is
    clipped by value, by norm, both or neither."""
    rng = np.random.default_rng(11)
    d, capacity = 6, 30
    state = _fresh_state(rng, capacity, d)
    rows, grad = _batch(rng, 40, capacity, d, 20)
    grad *= np.float32(0.35)
    uniq, inverse = PY.unique_inverse(rows, np.full(capacity, -1, np.int32))
    want = {k: v.copy() for k, v in state.items()}
    summed = np.zeros((uniq.size, d), np.float32)
    np.add.at(summed, inverse, grad)
    clipped = 0
    for k, r in enumerate(uniq):
        w, g = _prepared_reference(want["w"][r], summed[k], PREP, kind.startswith("ftrl"))
        clipped += not np.allclose(g - PREP["weight_decay"] * want["w"][r], summed[k])
        one = {name: arr[r:r + 1].copy() for name, arr in want.items()}
        one["w"][0] = w.astype(np.float32)
        _run(PY, kind, one, np.array([0], np.int32), np.array([0], np.int32), g.astype(np.float32)[None],
             np.empty((1, d), np.float32))
        for name in want:
            want[name][r] = one[name][0]
    assert 0 < clipped < uniq.size
    _run(backend, kind, state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), prep=PREP)
    for name in state:
        np.testing.assert_allclose(state[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_with_clipping_and_decay_are_bit_identical(kind, d):
    """The compiled kernels and their twins with every row option on, over 4 steps, and their running bounds
    (with an L2 decay every kernel also raises the bound of |weight|, ``largest[2]``)."""
    rng = np.random.default_rng(100 + d)
    capacity = 300
    py_state = _fresh_state(rng, capacity, d)
    fast_state = {k: v.copy() for k, v in py_state.items()}
    py_largest, fast_largest = np.zeros(3, np.float32), np.zeros(3, np.float32)
    for _ in range(4):
        rows, grad = _batch(rng, 200, capacity, d, 150)
        grad *= np.float32(2.0)
        uniq, inverse = FAST.unique_inverse(rows, np.full(capacity, -1, np.int32))
        _run(PY, kind, py_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32), largest=py_largest,
             prep=PREP)
        _run(FAST, kind, fast_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
             largest=fast_largest, prep=PREP)
        for name in py_state:
            np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]), err_msg=name)
        np.testing.assert_array_equal(_bits(fast_largest), _bits(py_largest))
    assert fast_largest[2] > 0 and (kind.startswith("ftrl") or fast_largest[2] == np.abs(fast_state["w"]).max()
                                    or fast_largest[2] >= np.abs(fast_state["w"][uniq]).max())


@needs_fast
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_bit_identical_with_each_option_alone_and_without_largest(kind):
    """Each compiled kernel runs its row loop from two call sites, one with the options and bounds off as
    constants (``_fast.pyx``, "The options off"): every combination reaches one of them (nothing on; each
    option alone; ``largest`` given or not, which turns the bounds on), and each matches the twin bit for bit
    over 3 steps, with its bounds."""
    d, capacity = 16, 200
    alone = [{}] + [{key: value} for key, value in PREP.items()
                    if not (kind.startswith("ftrl") and not key.startswith("clip"))]
    for case, prep in enumerate(alone):
        for with_largest in (False, True):
            rng = np.random.default_rng(300 + case)
            py_state = _fresh_state(rng, capacity, d)
            fast_state = {k: v.copy() for k, v in py_state.items()}
            py_largest, fast_largest = ((np.zeros(3, np.float32) if with_largest else None) for _ in range(2))
            for _ in range(3):
                rows, grad = _batch(rng, 150, capacity, d, 120)
                grad *= np.float32(2.0)
                uniq, inverse = PY.unique_inverse(rows, np.full(capacity, -1, np.int32))
                _run(PY, kind, py_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
                     largest=py_largest, prep=prep)
                _run(FAST, kind, fast_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32),
                     largest=fast_largest, prep=prep)
            for name in py_state:
                np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]),
                                              err_msg="%s %s %s" % (name, prep, with_largest))
            if with_largest:
                np.testing.assert_array_equal(_bits(fast_largest), _bits(py_largest), err_msg=str(prep))
            assert not np.array_equal(fast_state["w"], _fresh_state(np.random.default_rng(300 + case), capacity,
                                                                    d)["w"])


# ---- weighted ids and max pooling: per-position weights, the arg-max, the gradient spread to positions --
def _weighted_bags(rng, nb=12, d=5, capacity=30):
    lengths = rng.integers(0, 5, size=nb)
    lengths[:2] = [0, 3]                                                          # an empty bag, a full one
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, capacity, size=int(offsets[-1])).astype(np.int32)
    weights = rng.standard_normal(rows.size).astype(np.float32)
    return rng.standard_normal((capacity, d)).astype(np.float32), rows, offsets, weights


def test_gather_pool_with_weights_equals_plain_reference(backend):
    rng = np.random.default_rng(11)
    table, rows, offsets, weights = _weighted_bags(rng)
    scale = rng.random(offsets.size - 1).astype(np.float32)
    out = np.full((offsets.size - 1, table.shape[1]), np.nan, np.float32)
    assert backend.gather_pool(table, rows, offsets, scale, out, weights) is out
    for b in range(offsets.size - 1):
        acc = np.zeros(table.shape[1], np.float32)
        for p in range(offsets[b], offsets[b + 1]):
            acc = acc + table[rows[p]] * weights[p]
        np.testing.assert_array_equal(_bits(out[b]), _bits(acc * scale[b]))
    ones = np.empty_like(out)
    backend.gather_pool(table, rows, offsets, scale, ones, np.ones_like(weights))    # weights 1: unweighted
    np.testing.assert_array_equal(_bits(ones), _bits(backend.gather_pool(table, rows, offsets, scale,
                                                                         np.empty_like(out))))
    with pytest.raises(ValueError, match=r"weights has 3 entries, expected %d \(one per position\)" % rows.size):
        backend.gather_pool(table, rows, offsets, scale, out, weights[:3])


@pytest.mark.parametrize("weighted", [False, True])
def test_gather_max_takes_the_first_largest_and_leaves_out_weight_zero(backend, weighted):
    rng = np.random.default_rng(12)
    table, rows, offsets, weights = _weighted_bags(rng)
    rows[4] = rows[3]                                   # bag 1: a repeated row ties (unweighted): the first wins
    weights[[3, 4]] = 1.0
    weights[5] = 0.0                                    # weight 0: left out
    weights[offsets[2]:offsets[3]] = 0.0                # a bag of zero weights: as empty
    w = weights if weighted else None
    out, argmax = np.full((offsets.size - 1, 5), np.nan, np.float32), np.zeros((offsets.size - 1, 5), np.int64)
    assert backend.gather_max(table, rows, offsets, w, out, argmax) is out
    for b in range(offsets.size - 1):
        for j in range(5):
            best, at = np.float32(0), -1
            for p in range(offsets[b], offsets[b + 1]):
                if weighted and weights[p] == 0:
                    continue
                v = table[rows[p], j] * weights[p] if weighted else table[rows[p], j]
                if at < 0 or v > best:
                    best, at = v, p
            assert (_bits(out[b, j]), argmax[b, j]) == (_bits(best), at)
    assert (argmax[1] != 4).all() and (argmax[0] == -1).all() and (_bits(out[0]) == 0).all()
    if weighted and offsets[3] > offsets[2]:
        assert (argmax[2] == -1).all() and (_bits(out[2]) == 0).all()
    with pytest.raises(ValueError, match=r"out/argmax have shapes"):
        backend.gather_max(table, rows, offsets, w, out, argmax[:2])


def _spread_and_sum(uniq, inverse, grad, offsets, scale, weights, argmax):
    """The weighted / max-pooled bag gradient summed per row the long way (as before the update kernels
    took weights): each position's gradient ``(grad[b] * scale[b]) * weights[p]`` (float32; +0.0 where
    the position is not a value's arg-max), then added to its row position by position, in order."""
    want = np.zeros((uniq.size, grad.shape[1]), np.float32)
    for b in range(offsets.size - 1):
        for p in range(offsets[b], offsets[b + 1]):
            x = grad[b] * scale[b] if weights is None else (grad[b] * scale[b]) * weights[p]
            if argmax is not None:
                x = np.where(argmax[b] == p, x, np.float32(0))
            want[inverse[p]] = want[inverse[p]] + x
    return want


@pytest.mark.parametrize("mode", ["weights", "max", "weighted_max"])
def test_sum_by_row_spreads_weighted_and_max_bags_to_their_rows(backend, mode):
    """``sum_by_row`` with ``weights`` (weighted ids) and ``argmax`` (max pooling, gather_max's): the
    per-position gradient summed per row, without building it, bit for bit; bad ones are refused."""
    rng = np.random.default_rng(13)
    table, rows, offsets, weights = _weighted_bags(rng)
    rows[5:9] = rows[2]                                                           # a row at several positions
    nb, d = offsets.size - 1, table.shape[1]
    grad = rng.standard_normal((nb, d)).astype(np.float32)
    scale = rng.random(nb).astype(np.float32)
    w = None if mode == "max" else weights
    argmax = None
    if mode != "weights":
        argmax = np.empty((nb, d), np.int64)
        backend.gather_max(table, rows, offsets, w, np.empty((nb, d), np.float32), argmax)
    uniq, inverse = backend.unique_inverse(rows, np.full(table.shape[0], -1, np.int32))
    acc = np.full((uniq.size + 2, d), np.nan, np.float32)
    out = backend.sum_by_row(uniq, inverse, grad, acc, offsets, scale, w, argmax)
    np.testing.assert_array_equal(_bits(out), _bits(_spread_and_sum(uniq, inverse, grad, offsets, scale, w, argmax)))
    if argmax is not None:                 # each value's gradient reaches one row: the rows' sum is the bags'
        np.testing.assert_allclose(out.sum(0), np.where(argmax >= 0, grad * scale[:, None] * (
            1 if w is None else w[np.maximum(argmax, 0)]), 0).sum(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"weights has 3 entries, expected %d \(one per position\)" % rows.size):
        backend.sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights[:3], argmax)
    with pytest.raises(ValueError, match="weights and argmax are per bag: give them with offsets and scale"):
        backend.sum_by_row(uniq, inverse, np.zeros((rows.size, d), np.float32), acc, None, None, weights)
    bad = np.full((nb, d), -1, np.int64)
    bad[3, 2] = offsets[4]                                                    # the first position of the next bag
    with pytest.raises(ValueError, match=r"argmax\[3, 2\] is %d, expected -1 or a position of bag 3 \(%d \.\. %d\)"
                       % (offsets[4], offsets[3], offsets[4] - 1)):
        backend.sum_by_row(uniq, inverse, grad, acc, offsets, scale, w, bad)
    with pytest.raises(ValueError, match=r"argmax has shape \(%d, %d\), expected \(%d, %d\)" % (nb, d - 1, nb, d)):
        backend.sum_by_row(uniq, inverse, grad, acc, offsets, scale, w, bad[:, 1:].copy())


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 33])
def test_weighted_and_max_kernels_are_bit_identical(d):
    rng = np.random.default_rng(100 + d)
    table = rng.standard_normal((1000, d)).astype(np.float32)
    rows, offsets, lengths = _bags(rng, 500, 12, 1000, 300)                       # repeated rows: ties
    weights = np.where(rng.random(rows.size) < 0.1, 0, rng.standard_normal(rows.size)).astype(np.float32)
    scale = rng.random(500).astype(np.float32)
    grad = rng.standard_normal((500, d)).astype(np.float32)
    a, b = np.empty((500, d), np.float32), np.empty((500, d), np.float32)
    FAST.gather_pool(table, rows, offsets, scale, a, weights)
    PY.gather_pool(table, rows, offsets, scale, b, weights)
    np.testing.assert_array_equal(_bits(a), _bits(b))
    for w in (None, weights):
        ia, ib = np.empty((500, d), np.int64), np.empty((500, d), np.int64)
        FAST.gather_max(table, rows, offsets, w, a, ia)
        PY.gather_max(table, rows, offsets, w, b, ib)
        np.testing.assert_array_equal(_bits(a), _bits(b))
        np.testing.assert_array_equal(ia, ib)
        uniq, inverse = FAST.unique_inverse(rows, np.full(1000, -1, np.int32))
        for arg in (None, ia):
            if w is None and arg is None:
                continue                                      # (the unweighted bags: tested with the updates)
            ga, gb = np.empty((uniq.size, d), np.float32), np.empty((uniq.size, d), np.float32)
            FAST.sum_by_row(uniq, inverse, grad, ga, offsets, scale, w, arg)
            PY.sum_by_row(uniq, inverse, grad, gb, offsets, scale, w, arg)
            np.testing.assert_array_equal(_bits(ga), _bits(gb))
