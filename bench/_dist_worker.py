"""Worker of bench/bench_dist.py, launched by msrun (1 or 2 ranks on 127.0.0.1, CPU).

Each rank trains a Wide&Deep (26 fields x (16+1) on one HashEmbedding, 13 dense, MLP 400-400-1, dense
Adam, SparseAdam table of 1M rows) with RecModel on its share of every global batch (the whole batch
with one rank, rank r's half with two), and writes ``<out>/rank_<r>.json``: seconds per step over
the timed steps (after warm-up steps that compile the graph and fill the table), the bytes this rank
put into the id exchange and the row-gradient AllReduce per step, and the seconds spent in them.

    msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 --join=True \
        bench/_dist_worker.py OUT GLOBAL_BATCH STEPS WARMUP
"""
import json
import os
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import recboost as rb  # noqa: E402

FIELDS, DENSE, DIM, ROWS = 26, 13, 16, 1 << 20


def main():
    out_dir, global_batch, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    from mindspore.communication import get_group_size, get_rank, init
    init()
    rank, size = get_rank(), get_group_size()
    if size > 1:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=size)
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, ROWS, input_index=1, optimizer=rb.SparseAdam(1e-3), name="ids")
    net = rb.WideDeep(DENSE, FIELDS, DIM, (400, 400), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    stream = rb.SyntheticClickStream(seed=0, batch_size=global_batch, with_timestamp=True)
    share = global_batch // size
    sl = slice(rank * share, (rank + 1) * share)
    batches = []
    for _ in range(warmup + steps):
        dense, ids, label, ts = next(stream)
        batches.append({"dense": dense[sl], "ids": ids[sl], "label": label[sl], "timestamp": ts})
    model.train(1, batches[:warmup])
    ex = model._exchange
    spent = [0.0]
    if ex is not None:                        # time the collectives of the exchange
        for name in ("gather_int64", "sum_rows"):
            fn = getattr(ex, name)

            def timed(*a, _fn=fn):
                t0 = time.perf_counter()
                out = _fn(*a)
                spent[0] += time.perf_counter() - t0
                return out
            setattr(ex, name, timed)
    sent0 = ex.bytes_sent if ex is not None else 0
    t0 = time.perf_counter()
    model.train(1, batches[warmup:])
    seconds = time.perf_counter() - t0
    result = {"ranks": size, "rank": rank, "global_batch": global_batch, "steps": steps,
              "seconds_per_step": seconds / steps,
              "bytes_sent_per_step": ((ex.bytes_sent - sent0) / steps) if ex is not None else 0.0,
              "exchange_seconds_per_step": spent[0] / steps,
              "sharding": table.resolved_sharding, "ids_held": len(table.cache)}
    with open(os.path.join(out_dir, "rank_%d.json" % rank), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
