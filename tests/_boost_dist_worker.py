"""Worker of tests/test_boost_dist.py, run by tests/_dist_jobs_worker.py under msrun (2 ranks, CPU,
127.0.0.1; launched alone: ``<out>``).

Runs three data-parallel scenarios with recboost's boost cells and writes this rank's results to
``<out>/rank_<r>.npz``: plain gradient reduction, AdaSum across 2 "servers", DimReduce.
"""
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recboost as rb  # noqa: E402
from _dist import init_data_parallel  # noqa: E402
from test_boost_dimreduce import Linear  # noqa: E402  (the same model the single-process tests use)

D = 12


def data(rank, steps):
    rng = np.random.default_rng(100 + rank)
    w_true = np.random.default_rng(7).normal(size=(D, 1))
    out = []
    for _ in range(steps):
        x = rng.normal(size=(16, D))
        out.append((x.astype(np.float32), (x @ w_true).astype(np.float32)))
    return out


def run(out_dir, rank):
    """The three scenarios on this rank, results in ``<out_dir>/rank_<rank>.npz``."""
    w0 = np.random.default_rng(1).normal(0, 0.5, (D, 1))
    result = {}
    # 1. gradient reduction through the boost cell (O0)
    net = Linear(w0)
    cell = rb._boost_train_cell(net, nn.SGD(net.trainable_params(), 0.05), "O0", "")
    for x, y in data(rank, 3):
        cell(Tensor(x), Tensor(y))
    result["reduce"] = net.w.asnumpy()
    # 2. AdaSum: one device per server, two servers
    net = Linear(w0)
    cell = rb._boost_train_cell(net, nn.SGD(net.trainable_params(), 0.05), "O0",
                                {"boost": {"mode": "manual", "adasum": True}, "common": {"device_number": 1}})
    result["adasum_enabled"] = np.array(cell.enable_adasum)
    for x, y in data(rank, 2):
        cell(Tensor(x), Tensor(y))
    result["adasum"] = net.w.asnumpy()
    # 3. DimReduce: rank 0 computes the PCA matrix from checkpoints, every rank loads its rows
    ckpt_dir = os.path.join(out_dir, "ckpts")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        rng = np.random.default_rng(5)
        for i in range(8):
            ms.save_checkpoint([{"name": "w", "data": Tensor((w0 + rng.normal(0, 0.1, w0.shape)).astype(np.float32))}],
                               os.path.join(ckpt_dir, "s%d.ckpt" % i))
    ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()    # every rank sees the checkpoints
    net = Linear(w0)
    cfg = {"boost": {"mode": "manual", "dim_reduce": True},
           "dim_reduce": {"n_components": 5, "alpha": 0.01, "weight_load_dir": ckpt_dir, "seed": 2}}
    cell = rb._boost_train_cell(net, nn.SGD(net.trainable_params(), 0.05), "O0", cfg)
    result["pca_rows"] = np.array(cell.dim_reduce.local_dim)
    for x, y in data(rank, 3):
        cell(Tensor(x), Tensor(y))
    result["dim_reduce"] = net.w.asnumpy()
    np.savez(os.path.join(out_dir, "rank_%d.npz" % rank), **result)


def main():
    rank, _ = init_data_parallel()
    run(sys.argv[1], rank)


if __name__ == "__main__":
    main()
