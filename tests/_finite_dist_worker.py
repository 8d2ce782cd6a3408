"""Worker of tests/test_tables_dist.py::test_a_row_wise_row_that_another_ranks_gradient_would_overflow_is_
skipped, launched by msrun (2 ranks, CPU, 127.0.0.1).

``<out>``: a row-wise SparseAdagrad table read as ``logit = sum over fields of (row . x) + b`` trains two
normal steps; then rank 0's shard of accumulators is set to float32's largest value and rank 1's next
batch has features x3e17 (its rows' gradients square to ~1e33, above that value's spacing; its own
shard's accumulators are small). Rank 0 owns some of rank 1's ids and would update them with rank 1's
gradient. Then (``summed_rows``) a data-parallel table whose row gradients are summed over the ranks.
Writes ``<out>/finite_rank_<r>.npz``: the counts and whether any state changed or went non-finite.
tests/_tables_dist_worker.py's launch runs it last (``--finite``), saving an msrun start."""
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recboost as rb  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

BATCH, FIELDS, DIM = 32, 4, 4


class Net(nn.Cell):
    """logit = sum over fields of (row . x) + b: a row's gradient is the features times the logit's."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.b = Parameter(Tensor(np.zeros(1, np.float32)), name="b")

    def construct(self, x, ids):
        return (self.table(ids).sum(1) * x).sum(-1, keepdims=True) + self.b


def state(table, model):
    out = {"table": table.weight.copy()}
    out.update({name: slot.copy() for name, slot in table.slots.items()})
    for p in model.train_network.trainable_params():
        out[p.name] = p.asnumpy().copy()
    return out


def main():
    rank, _ = init_data_parallel()
    run(sys.argv[1], rank)


def run(out_dir, rank):
    """The row-wise and the summed-rows cases on this rank (data-parallel context already joined; this
    sets ``gradients_mean=False``, so tests/_tables_dist_worker.py runs it last)."""
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM, 256, max_unique=2 * BATCH * FIELDS + 1, input_index=1, name="ids", seed=0,
                             optimizer=rb.SparseAdagrad(0.01), sharding="row_wise")
    net = Net(table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(10 + rank)
    good = [(rng.normal(size=(BATCH, DIM)).astype(np.float32), rng.integers(0, 60, (BATCH, FIELDS)).astype(np.int64),
             (rng.random((BATCH, 1)) < 0.3).astype(np.float32)) for _ in range(2)]
    model.online_train(good, dataset_sink_mode=False)
    if rank == 0:
        st = table.store.state_dict()       # (the table's arrays are read-only: a loaded state)
        st["slots"]["accum"].fill(np.finfo(np.float32).max)
        table.store.load_state_dict(st)
    before = state(table, model)
    x, ids, label = good[0]
    if rank == 1:
        x, label = x * np.float32(3e17), 1 - label
    model.online_train([(x, ids, label)], dataset_sink_mode=False)
    after = state(table, model)
    summed = summed_rows(rank)
    np.savez(os.path.join(out_dir, "finite_rank_%d.npz" % rank), step=model.step, overflow_steps=model.overflow_steps,
             changed=[k for k in before if not np.array_equal(before[k], after[k])] + ["-"],
             finite=all(np.isfinite(v).all() for v in after.values()), **summed)


class _MeanLogit(nn.Cell):
    """The mean logit as the loss: each sample's logit gradient is exactly 1 / batch."""

    def construct(self, logit, label):
        return logit.mean() + label.mean() * 0.0


def summed_rows(rank):
    """Row gradients summed over the ranks (``gradients_mean=False``): a data-parallel SparseAdam table of
    one-wide rows, every sample of both ranks on one id with feature c = 1.5e19: each rank's row gradient
    is c (T * T = 2.25e38, finite), their sum 2c squares to Inf in Adam's second moment. The ranks bound
    their gradient times 2, so every rank skips the step (after a normal one with c = 1)."""
    ms.set_auto_parallel_context(gradients_mean=False)
    ms.set_seed(0)
    table = rb.HashEmbedding(1, 16, input_index=1, name="summed", seed=0, optimizer=rb.SparseAdam(0.01),
                             sharding="data_parallel")
    net = Net(table)
    model = rb.RecModel(net, _MeanLogit(), nn.Adam(net.trainable_params(), 0.01))
    ids = np.full((BATCH, 1), 7, np.int64)
    label = np.zeros((BATCH, 1), np.float32)
    model.online_train([(np.ones((BATCH, 1), np.float32), ids, label)], dataset_sink_mode=False)
    before = state(table, model)
    model.online_train([(np.full((BATCH, 1), 1.5e19, np.float32), ids, label)], dataset_sink_mode=False)
    after = state(table, model)
    return {"summed:step": model.step, "summed:overflow_steps": model.overflow_steps,
            "summed:mean": model.exchange_stats()["mean"],
            "summed:changed": [k for k in before if not np.array_equal(before[k], after[k])] + ["-"],
            "summed:finite": all(np.isfinite(v).all() for v in after.values())}


if __name__ == "__main__":
    main()
