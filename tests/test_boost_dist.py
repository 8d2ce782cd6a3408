"""AdaSum, DimReduce and gradient reduction in a real 2-worker data-parallel job (msrun, CPU)."""
import os
import sys

import numpy as np
import pytest

from test_boost_dimreduce import _numpy_dim_reduce

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _boost_dist_worker as worker  # noqa: E402

# msrun jobs or kills at chosen moments: the whole suite's serial part (make test-all), not the
# newcomer's check (make test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def job(dist_jobs):
    """``(output folder, [rank 0's results, rank 1's])`` of tests/_boost_dist_worker.py's job, run in
    conftest's shared msrun launch (``dist_jobs``)."""
    out = dist_jobs / "boost"
    return out, [dict(np.load(out / ("rank_%d.npz" % r))) for r in range(2)]


def _grad(w, x, y):
    return 2 * x.T @ (x @ w - y) / y.size


def _w0():
    return np.random.default_rng(1).normal(0, 0.5, (worker.D, 1)).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("key", ["reduce", "adasum", "dim_reduce"])
def test_ranks_end_identical(job, key):
    _, ranks = job
    np.testing.assert_array_equal(ranks[0][key], ranks[1][key])
    assert not np.allclose(ranks[0][key], _w0())


def test_gradient_reduction_is_the_mean(job):
    _, ranks = job
    w = _w0()
    for (x0, y0), (x1, y1) in zip(worker.data(0, 3), worker.data(1, 3)):
        w = w - 0.05 * (_grad(w, x0, y0) + _grad(w, x1, y1)) / 2
    np.testing.assert_allclose(ranks[0]["reduce"], w, rtol=1e-4, atol=1e-5)


def test_adasum_combines_the_two_updates(job):
    _, ranks = job
    assert bool(ranks[0]["adasum_enabled"]) and bool(ranks[1]["adasum_enabled"])
    w, eps = _w0(), 1e-12
    for (x0, y0), (x1, y1) in zip(worker.data(0, 2), worker.data(1, 2)):
        a, b = 0.05 * _grad(w, x0, y0).ravel(), 0.05 * _grad(w, x1, y1).ravel()
        dot = a @ b + eps
        combined = (1 - dot / (2 * (a @ a + eps))) * a + (1 - dot / (2 * (b @ b + eps))) * b
        w = w - combined.reshape(w.shape)
    np.testing.assert_allclose(ranks[0]["adasum"], w, rtol=1e-4, atol=1e-5)
    # AdaSum is not the plain sum or mean of the updates here
    assert not np.allclose(combined, a + b) and not np.allclose(combined, (a + b) / 2)


def test_dim_reduce_over_two_ranks(job):
    import mindspore as ms
    import recboost as rb
    out, ranks = job
    assert int(ranks[0]["pca_rows"]) == 3 and int(ranks[1]["pca_rows"]) == 3   # ceil(5 / 2), none dropped
    ckpts = out / "ckpts"
    data = np.stack([ms.load_checkpoint(str(ckpts / ("s%d.ckpt" % i)))["w"].asnumpy().ravel() for i in range(8)])
    pca = rb.compute_pca_mat(data, 5, seed=2)
    np.testing.assert_array_equal(np.load(ckpts / "pca_mat.npy"), pca)
    batches = [(np.concatenate([x0, x1]).astype(np.float64), np.concatenate([y0, y1]).astype(np.float64))
               for (x0, y0), (x1, y1) in zip(worker.data(0, 3), worker.data(1, 3))]
    want = _numpy_dim_reduce(_w0(), batches, pca.astype(np.float64),
                             {"rho": 0.55, "gamma": 0.9, "alpha": 0.01, "sigma": 0.4})
    np.testing.assert_allclose(ranks[0]["dim_reduce"], want, rtol=2e-3, atol=2e-4)
