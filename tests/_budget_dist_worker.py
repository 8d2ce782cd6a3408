"""Worker of tests/test_budget_dist.py, run by tests/_dist_jobs_worker.py under msrun (2 ranks, CPU,
127.0.0.1; launched alone: ``<out>``).

``<out>``: trains a network with four tables in a fixed memory budget (an "lru" table with the
default admission sketch, an "lfu" table admitting at first sight with the exact counter, a "score"
table admitting and replacing by the scores its ids earn from the labels, and a growing table
counting its candidates in a small, ageing "sketch") on this rank's half of every
global batch, once with the tables data-parallel (the default) and once row-wise. For each it
trains straight through, then again for ``SAVE_AT`` batches, saves a checkpoint, restores it into a
fresh model and trains the rest. Writes ``<out>/<sharding>_rank_<r>.npz``: each table's cache,
rows and slots, the dense parameters, predictions (after the straight run, and after ``SAVE_AT``
batches), of the straight run and (prefixed ``restored:``) of the restored one. The test imports
``global_batches``, ``half``, ``make_model`` and ``results`` to replay the job in one process.
"""
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import nn, ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recboost as rb  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

STEPS, BATCH, FIELDS, MORE, DENSE, DIM = 10, 32, 3, 2, 4, 4   # BATCH rows per rank, 2 * BATCH per global batch
SAVE_AT = 6                                          # the checkpoint of the restored run
SHARDINGS = ("data_parallel", "row_wise")


class Net(nn.Cell):
    """``(dense [B, DENSE], ids [B, FIELDS], more [B, MORE]) -> [B, 1]``: the "lru" and "sketch"
    tables read ``ids``, the "lfu" and "score" tables read ``more``."""

    def __init__(self, lru, lfu, sketch, score):
        super().__init__()
        self.lru, self.lfu, self.sketch, self.score = lru, lfu, sketch, score
        self.mlp = nn.SequentialCell([nn.Dense(DENSE + 2 * (FIELDS + MORE) * DIM, 8), nn.ReLU(), nn.Dense(8, 1)])

    def construct(self, dense, ids, more):
        parts = (dense, self.lru(ids), self.sketch(ids), self.lfu(more), self.score(more))
        return self.mlp(ops.concat([p.reshape((p.shape[0], -1)) for p in parts], 1))


def global_batches():
    """STEPS global batches of 2 * BATCH rows of a drifting stream: half of the ids are a few hot
    ids, the rest come from a window that moves 12 ids a step (every table fills within a step or
    two and then replaces rows; the sketch table keeps growing). Time is 10 per step."""
    rng = np.random.default_rng(23)
    out = []
    for step in range(STEPS):
        hot = rng.random((2 * BATCH, FIELDS)) < 0.5
        ids = np.where(hot, rng.integers(0, 8, (2 * BATCH, FIELDS)), 100 + 12 * step + rng.integers(0, 60, (2 * BATCH, FIELDS)))
        more = np.where(rng.random((2 * BATCH, MORE)) < 0.4, 5000 + rng.integers(0, 6, (2 * BATCH, MORE)),
                        6000 + 9 * step + rng.integers(0, 40, (2 * BATCH, MORE)))
        dense = rng.normal(size=(2 * BATCH, DENSE)).astype(np.float32)
        label = ((dense[:, :1] + 0.2 * (ids[:, :1] < 8)) > 0.1).astype(np.float32)
        out.append({"dense": dense, "ids": ids.astype(np.int64), "more": more.astype(np.int64), "label": label,
                    "timestamp": 10 * step})
    return out


def half(batch, rank):
    """Rank ``rank``'s half of a global batch; rank 0's timestamp is one less (the step takes the latest)."""
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return dict({k: batch[k][sl] for k in ("dense", "ids", "more", "label")},
                timestamp=batch["timestamp"] - (1 if rank == 0 else 0))


def make_model(sharding=None):
    """The model and its four tables (each with ``sharding``), dense parameters set from numpy (the
    same in every process)."""
    lru = rb.HashEmbedding(DIM, 26, access_threshold=1, eviction_policy="lru", input_index=1, seed=3,
                           init_stddev=0.1, name="lru", optimizer=rb.SparseAdam(0.02), sharding=sharding)
    lfu = rb.HashEmbedding(DIM, 20, access_threshold=0, eviction_policy="lfu", lfu_half_life=15, input_index=2,
                           seed=4, init_stddev=0.1, name="lfu", admission_counter="exact",
                           optimizer=rb.SparseRowWiseAdagrad(0.05), sharding=sharding)
    sketch = rb.HashEmbedding(DIM, 8, access_threshold=2, use_dynamic_expansion=True, input_index=1, seed=5,
                              init_stddev=0.1, name="sketch", admission_counter="sketch", sketch_width=64,
                              sketch_depth=2, sketch_window=40, optimizer=rb.SparseFtrl(0.05), sharding=sharding)
    score = rb.HashEmbedding(DIM, 24, eviction_policy="score", score_half_life=40, admit_score=0.25, input_index=2,
                             seed=6, init_stddev=0.1, name="score", optimizer=rb.SparseSGD(0.05), sharding=sharding)
    net = Net(lru, lfu, sketch, score)
    rng = np.random.default_rng(5)
    for p in net.trainable_params():
        p.set_data(ms.Tensor(rng.normal(0, 0.3, p.shape).astype(np.float32)))
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def results(model, predict_batch):
    """The tables' states (prefixed by the table's name), the dense parameters (``dense:``), the
    predictions of ``predict_batch`` and the step."""
    out = {"dense:" + p.name: p.asnumpy().copy() for p in model.state_parameters()}
    for t in model.tables:
        state = t.state_dict()
        out.update({t.table_name + ":cache:" + k: np.asarray(v) for k, v in state["cache"].items()})
        out[t.table_name + ":table"] = state["table"]
        out.update({t.table_name + ":slot:" + k: v for k, v in state["slots"].items()})
    out["predict"] = model.predict(*(predict_batch[k] for k in ("dense", "ids", "more"))).asnumpy()
    out["step"] = np.array(model.step)
    return out


def run(out_dir, rank):
    """Both shardings on this rank, results in ``<out_dir>/<sharding>_rank_<rank>.npz``."""
    batches = global_batches()
    mine = [half(b, rank) for b in batches]
    for sharding in SHARDINGS:
        model = make_model(None if sharding == "data_parallel" else sharding)
        model.train(1, mine)
        out = results(model, batches[0])
        out["sharding"] = np.array([t.resolved_sharding for t in model.tables])
        first = make_model(None if sharding == "data_parallel" else sharding)
        first.train(1, mine[:SAVE_AT])
        out["first:predict"] = first.predict(*(batches[0][k] for k in ("dense", "ids", "more"))).asnumpy()
        path = os.path.join(out_dir, "ckpt_row_wise.npz" if sharding == "row_wise" else "ckpt_rank_%d.npz" % rank)
        first.save_checkpoint(path)
        restored = make_model(None if sharding == "data_parallel" else sharding)
        restored.load_checkpoint(path)
        restored.train(1, mine[SAVE_AT:])
        out.update({"restored:" + k: v for k, v in results(restored, batches[0]).items()})
        np.savez(os.path.join(out_dir, "%s_rank_%d.npz" % (sharding, rank)), **out)


def main():
    rank, _ = init_data_parallel()
    run(sys.argv[1], rank)


if __name__ == "__main__":
    main()
