"""Host-table kernels (gather, grouping by row, the fused sparse optimizers, id-keyed initial rows):
each against a plain reference, and all but gather (an exact copy) against the bits recorded when
the compiled kernels and their numpy twins agreed, on every backend: the compiled run checks both
backends against them, the fallback run the twins."""
import types

import numpy as np
import pytest

import recboost

PY = types.SimpleNamespace(**recboost._backend_kernels("py"))


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


# Digests (conftest ``digest``) recorded when both backends gave these bits: the grouping of each of
# the 4 batches below (by dim: the batches depend on it alone), and the state after the 4 steps; a
# backend that differs in one bit of one row or slot fails.
RECORDED_GROUPINGS = {
    1: ['d7d12d434a4adb47', '9bb984c77c051fcd', 'bb78fa652cf3afd5', '0fd2db4b579663c3'],
    16: ['e183047e34a881e8', '52a1de4930be654e', 'b741a1c95bcdf1f8', 'd0e7a3ecd768e4dd'],
    64: ['867c288f0996e7c8', '521ed8022a1dbb0d', 'd92db3b64df49c16', '5bc9418ad9bc5d1e'],
}
RECORDED_UPDATES = {
    ('sgd', 1): '48fdf5cf5ff185ca', ('sgd', 16): '6329ee5c097493c1', ('sgd', 64): '58bb157a53db7372',
    ('adagrad', 1): 'd6e1bce0938a7043', ('adagrad', 16): 'b816c5bdd6b6eb3f', ('adagrad', 64): 'e5a179230333af8a',
    ('adam', 1): '6980a620adeb4d9f', ('adam', 16): '09aa23779ede0507', ('adam', 64): '1a89d85b88d3d03d',
    ('ftrl', 1): '0ae446cc9f9c7261', ('ftrl', 16): 'b5e125a88ac36dcd', ('ftrl', 64): '038a94c71fc0273b',
    ('ftrl_p03', 1): '2807396d1e32b692', ('ftrl_p03', 16): '40aac73a1da8a599', ('ftrl_p03', 64): 'e7d7af2686979ca7',
}


@pytest.mark.parametrize("d", [1, 16, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_updates_give_the_recorded_bits(backend, digest, kind, d):
    rng = np.random.default_rng(d)
    capacity = 500
    state = _fresh_state(rng, capacity, d)
    mark = np.full(capacity, -1, np.int32)
    steps = []
    for _ in range(4):                                   # slot state evolves over steps
        rows, grad = _batch(rng, 300, capacity, d, 200)
        uniq, inverse = backend.unique_inverse(rows, mark)
        steps.append(digest(uniq, inverse))
        _run(backend, kind, state, uniq, inverse, grad, np.empty((uniq.size, d), np.float32))
    assert steps == RECORDED_GROUPINGS[d]
    got = digest(*(state[name] for name in sorted(state)))
    assert got == RECORDED_UPDATES[kind, d]
    # empty batch: nothing changes
    _run(backend, kind, state, np.empty(0, np.int32), np.empty(0, np.int32), np.empty((0, d), np.float32),
         np.empty((0, d), np.float32))
    assert digest(*(state[name] for name in sorted(state))) == got


RECORDED_INIT_ROWS = {(0, 0.01): '1626df552492049d', (2 ** 63 - 1, 1.0): 'b2dfc92197c0808e',
                      (12345, 0.0): 'a1dc7d5fb044edda'}


def test_gather_exact_and_init_rows_give_the_recorded_bits(backend, digest):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((1000, 17)).astype(np.float32)
    rows = rng.integers(0, 1000, 5000).astype(np.int32)
    out = backend.gather_rows(table, rows, np.empty((5000, 17), np.float32))
    np.testing.assert_array_equal(out.view(np.uint32), table[rows].view(np.uint32))
    ids = np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64), [0, -1, 2 ** 63 - 1]])
    for seed, std in ((0, 0.01), (2 ** 63 - 1, 1.0), (12345, 0.0)):
        x = backend.init_rows(ids, seed, std, np.empty((ids.size, 16), np.float32))
        assert digest(x) == RECORDED_INIT_ROWS[seed, std], (seed, std)


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
