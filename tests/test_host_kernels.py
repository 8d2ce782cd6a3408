"""Host-table kernels (gather, grouping by row, the fused sparse optimizers, id-keyed initial rows):
each backend against a plain reference, and the compiled ones bit-identical to their numpy twins
(those parity tests need the compiled backend; the fallback run checks the twins against the
references)."""
import types

import numpy as np
import pytest

import recboost

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


def _run(k, kind, state, uniq, inverse, grad, acc):
    if kind == "sgd":
        k.sparse_sgd_update(state["w"], uniq, inverse, grad, acc, np.float32(0.3))
    elif kind == "adagrad":
        k.sparse_adagrad_update(state["w"], state["a"], uniq, inverse, grad, acc, np.float32(0.3))
    elif kind == "adam":
        k.sparse_adam_update(state["w"], state["m"], state["v"], uniq, inverse, grad, acc, np.float32(0.01),
                             np.float32(0.9), np.float32(0.999), np.float32(1) - np.float32(0.9),
                             np.float32(1) - np.float32(0.999), np.float32(1e-8))
    else:
        lr_power = -0.5 if kind == "ftrl" else -0.3
        k.sparse_ftrl_update(state["w"], state["a"], state["m"], uniq, inverse, grad, acc, np.float32(0.2),
                             np.float32(lr_power), np.float32(0.01), np.float32(0.02))


def _fresh_state(rng, capacity, d):
    w = rng.standard_normal((capacity, d)).astype(np.float32)
    return {"w": w, "a": np.full((capacity, d), 0.1, np.float32), "m": np.zeros((capacity, d), np.float32),
            "v": np.zeros((capacity, d), np.float32)}


KINDS = ["sgd", "adagrad", "adam", "ftrl", "ftrl_p03"]


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


@needs_fast
@pytest.mark.parametrize("d", [1, 16, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_are_bit_identical(kind, d):
    rng = np.random.default_rng(d)
    capacity = 500
    py_state = _fresh_state(rng, capacity, d)
    fast_state = {k: v.copy() for k, v in py_state.items()}
    mark = np.full(capacity, -1, np.int32)
    for _ in range(4):                                   # slot state evolves over steps
        rows, grad = _batch(rng, 300, capacity, d, 200)
        uniq, inverse = FAST.unique_inverse(rows, mark)
        u_py, i_py = PY.unique_inverse(rows, mark)
        np.testing.assert_array_equal(uniq, u_py)
        np.testing.assert_array_equal(inverse, i_py)
        _run(PY, kind, py_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32))
        _run(FAST, kind, fast_state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32))
        for name in py_state:
            np.testing.assert_array_equal(_bits(fast_state[name]), _bits(py_state[name]), err_msg=name)
    # empty batch: nothing changes
    before = {k: v.copy() for k, v in fast_state.items()}
    _run(FAST, kind, fast_state, np.empty(0, np.int32), np.empty(0, np.int32), np.empty((0, d), np.float32),
         np.empty((0, d), np.float32))
    for name in before:
        np.testing.assert_array_equal(fast_state[name], before[name])


@needs_fast
def test_gather_and_init_rows_are_bit_identical():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((1000, 17)).astype(np.float32)
    rows = rng.integers(0, 1000, 5000).astype(np.int32)
    a, b = np.empty((5000, 17), np.float32), np.empty((5000, 17), np.float32)
    np.testing.assert_array_equal(FAST.gather_rows(table, rows, a), PY.gather_rows(table, rows, b))
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
