"""Worker of tests/test_ranks.py, run by tests/_dist_jobs_worker.py under msrun (2 ranks, CPU,
127.0.0.1): ranks that stall, end early or are configured apart.

``run_all(out, rank, STALL, cases)`` (launched alone: ``<out> <stall seconds>``, every case) runs cases
one after the other, each training a fresh small WideDeep over one data-parallel HashEmbedding on this
rank's batches, and writes ``<out>/<case>_<rank>.npz``
(``step``, ``consumed``, ``weight``, and ``error``: the message of a ValueError raised by training,
or ""):

- ``seed``: rank r's table has seed r;
- ``capacity``: rank r's table has capacity 256 + 64 r;
- ``uneven``: rank 1's stream is 4 batches shorter than rank 0's (10);
- ``stall``: rank 1's data source sleeps ``<stall seconds>`` before its third batch.
"""
import os
import sys
import time

import numpy as np
from mindspore import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recboost as rb  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

BATCH, FIELDS, DENSE, DIM, STEPS = 32, 4, 3, 4, 10
STALL = 35                       # seconds: longer than MindSpore 2.10's CPU collective timeout (30 s)


def batches(rank, n, stall=0.0):
    rng = np.random.default_rng(100 + rank)
    for k in range(n):
        if stall and rank == 1 and k == 2:
            time.sleep(stall)
        yield {"dense": rng.normal(size=(BATCH, DENSE)).astype(np.float32),
               "ids": rng.integers(0, 300, (BATCH, FIELDS)).astype(np.int64),
               "label": (rng.random((BATCH, 1)) < 0.3).astype(np.float32)}


def run(out, rank, case, stall):
    table = rb.HashEmbedding(DIM + 1, 256 + (64 * rank if case == "capacity" else 0),
                             seed=rank if case == "seed" else 0, input_index=1, name="ids")
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    n = STEPS - (4 if case == "uneven" and rank == 1 else 0)
    error = ""
    try:
        model.online_train(batches(rank, n, stall if case == "stall" else 0.0), dataset_sink_mode=False)
    except ValueError as exc:
        error = str(exc)
    np.savez(os.path.join(out, "%s_%d.npz" % (case, rank)), step=model.step, consumed=model.batches_consumed,
             error=np.array(error), weight=table.weight[:len(table.cache) + 2])


CASES = ("seed", "capacity", "uneven", "stall")


def run_all(out, rank, stall, cases=CASES):
    """``cases`` in turn on this rank."""
    for case in cases:
        run(out, rank, case, stall)


def main():
    rank, _ = init_data_parallel()
    run_all(sys.argv[1], rank, float(sys.argv[2]))


if __name__ == "__main__":
    main()
