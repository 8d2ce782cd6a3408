"""PCA from checkpoints, per-rank row loading, and DimReduce against a numpy reference."""
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

import recboost as rb


def test_compute_pca_mat_matches_full_svd():
    rng = np.random.default_rng(0)
    data = rng.normal(size=(12, 40)) @ np.diag(np.linspace(3, 0.1, 40))
    ours = rb.compute_pca_mat(data, 4, seed=1)
    assert ours.dtype == np.float32 and ours.shape == (4, 40)
    _, _, vt = np.linalg.svd(data - data.mean(0), full_matrices=False)
    for a, b in zip(ours, vt[:4]):
        assert abs(abs(float(a @ b)) - 1) < 1e-4
    np.testing.assert_allclose(ours @ ours.T, np.eye(4), atol=1e-5)
    np.testing.assert_array_equal(ours, rb.compute_pca_mat(data, 4, seed=1))  # seeded
    with pytest.raises(ValueError, match="at least n_components=20 rows"):
        rb.compute_pca_mat(data, 20)


@pytest.mark.parametrize("rank_size", [1, 2, 3, 4])
def test_rows_split_with_ceiling_division(backend, tmp_path, rank_size):
    mat = np.arange(5 * 7, dtype=np.float64).reshape(5, 7)
    path = rb.save_pca_mat(mat, str(tmp_path / "pca.npy"))
    assert os.listdir(tmp_path) == ["pca.npy"]               # the temporary file was renamed away
    parts = [rb.load_pca_rows(path, r, rank_size) for r in range(rank_size)]
    local = -(-5 // rank_size)
    assert all(p.shape == (local, 7) and p.dtype == np.float32 for p in parts)
    stacked = np.concatenate(parts)
    np.testing.assert_array_equal(stacked[:5], mat.astype(np.float32))   # no component dropped
    assert not stacked[5:].any()                                          # padding is zero
    np.testing.assert_array_equal(rb.load_pca_rows(path, 0, 1, n_components=2), mat[:2].astype(np.float32))
    for r in range(rank_size):   # tiny chunks: rows are copied piecewise, same result
        np.testing.assert_array_equal(rb.load_pca_rows(path, r, rank_size, chunk_bytes=12), parts[r])


def test_incomplete_file_is_refused(tmp_path):
    path = str(tmp_path / "pca.npy")
    rb.save_pca_mat(np.ones((4, 100)), path)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match="a complete .npy file"):
        rb.load_pca_rows(path, 0, 1)


class Linear(nn.Cell):
    def __init__(self, w):
        super().__init__()
        self.w = ms.Parameter(Tensor(w.astype(np.float32)), name="w")

    def construct(self, x, y):
        return ((ops.matmul(x, self.w) - y) ** 2).mean()


def _numpy_dim_reduce(w, batches, pca, cfg):
    k = pca.shape[0]
    state = dict(bk=np.eye(k), gk_last=np.zeros(k), sk=np.zeros(k), m=np.zeros_like(w))
    loss_fn = lambda w, x, y: float(((x @ w - y) ** 2).mean())  # noqa: E731
    for x, y in batches:
        g = (2 * x.T @ (x @ w - y) / y.size)
        loss = loss_fn(w, x, y)
        gk = pca @ g.ravel()
        yk, sk = gk - state["gk_last"], state["sk"]
        ys = yk @ sk
        bk = state["bk"]
        if ys > 1e-20:
            t1 = np.eye(k) - np.outer(yk, sk) / ys
            bk = t1.T @ bk @ t1 + np.outer(sk, sk) / ys
        dk = -bk @ gk
        dn = (pca.T @ dk).reshape(w.shape)
        gp = (pca.T @ gk).reshape(w.shape)
        gd = gk @ dk
        rho = 0.0
        if loss + cfg["sigma"] * gd > loss_fn(w + dn, x, y):
            rho = 1.0
        elif loss + cfg["sigma"] * cfg["rho"] * gd > loss_fn(w + cfg["rho"] * dn, x, y):
            rho = cfg["rho"]
        if rho:
            state.update(sk=rho * dk, bk=bk, gk_last=gk)
        state["m"] = cfg["gamma"] * state["m"] + g - gp
        w = w - (cfg["alpha"] * state["m"] - rho * dn)
    return w


def test_dim_reduce_matches_numpy(graph_mode, tmp_path):
    rng = np.random.default_rng(0)
    d = 24
    w0 = rng.normal(0, 0.5, (d, 1))
    ckpt_dir = tmp_path / "ckpts"
    ckpt_dir.mkdir()
    for i in range(8):   # a short "trajectory" of saved weights
        ms.save_checkpoint([{"name": "w", "data": Tensor((w0 + rng.normal(0, 0.1, w0.shape)).astype(np.float32))}],
                           str(ckpt_dir / ("step_%d.ckpt" % i)))
    cfg = {"rho": 0.55, "gamma": 0.9, "alpha": 0.01, "sigma": 0.4}
    config = {"boost": {"mode": "manual", "dim_reduce": True},
              "dim_reduce": dict(cfg, n_components=4, weight_load_dir=str(ckpt_dir), seed=3)}
    net = Linear(w0)
    cell = rb._boost_train_cell(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), "O0", config)
    assert cell.check_dim_reduce_enable() and isinstance(cell.dim_reduce, rb.DimReduce)
    pca_path = str(ckpt_dir / "pca_mat.npy")
    pca = np.load(pca_path)
    data = np.stack([ms.load_checkpoint(str(ckpt_dir / ("step_%d.ckpt" % i)))["w"].asnumpy().ravel()
                     for i in range(8)])
    np.testing.assert_array_equal(pca, rb.compute_pca_mat(data, 4, seed=3))
    w_true = rng.normal(size=(d, 1))
    batches = []
    for _ in range(4):
        x = rng.normal(size=(32, d))
        batches.append((x, x @ w_true))
    for x, y in batches:
        cell(Tensor(x.astype(np.float32)), Tensor(y.astype(np.float32)))
    want = _numpy_dim_reduce(w0.astype(np.float32).astype(np.float64), batches, pca.astype(np.float64), cfg)
    np.testing.assert_allclose(net.w.asnumpy(), want, rtol=2e-3, atol=2e-4)
    assert not np.allclose(want, w0)
    # a second AutoBoost reuses the saved matrix instead of recomputing it
    mtime = os.path.getmtime(pca_path)
    config["dim_reduce"]["pca_mat_path"] = pca_path
    rb._boost_train_cell(Linear(w0), nn.Momentum(net.trainable_params(), 0.1, 0.9), "O0", config)
    assert os.path.getmtime(pca_path) == mtime


def test_dim_reduce_needs_a_source():
    net = Linear(np.zeros((3, 1)))
    boost = rb.AutoBoost("O0", {"boost": {"mode": "manual", "dim_reduce": True}})
    with pytest.raises(ValueError, match="'dim_reduce.weight_load_dir' must be an existing directory"):
        boost.network_auto_process_train(net, nn.SGD(net.trainable_params()))


def _dim_reduce_cell(net, pca_path, timeout):
    """A DimReduce train cell over a given PCA path (MindSpore's order: the optimizer is marked)."""
    boost = rb.AutoBoost("O0", {"boost": {"mode": "manual", "dim_reduce": True},
                                "dim_reduce": {"pca_mat_path": pca_path, "n_components": 2, "timeout": timeout}})
    opt = nn.SGD(net.trainable_params(), 1.0)
    opt.dim_reduce = True
    return rb.BoostTrainOneStepCell(net, opt, boost=boost)


def test_dim_reduce_timeout_bounds_the_wait_for_the_pca_file(tmp_path):
    import threading
    import time
    path = str(tmp_path / "pca.npy")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"'dim_reduce.timeout' = 0.3 seconds"):
        _dim_reduce_cell(Linear(np.zeros((3, 1))), path, 0.3)
    assert 0.3 <= time.monotonic() - start < 5
    # a file that appears while the cell waits (another rank writing it) is picked up
    writer = threading.Timer(0.3, rb.save_pca_mat, (np.eye(2, 3), path))
    writer.start()
    cell = _dim_reduce_cell(Linear(np.zeros((3, 1))), path, 60)
    writer.join()
    local = np.concatenate([t.asnumpy() for t in cell.dim_reduce.pca_list_local], axis=1)
    np.testing.assert_array_equal(local, np.eye(2, 3, dtype=np.float32))
