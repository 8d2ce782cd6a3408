"""Worker of bench/bench_dist.py, launched by msrun (1 or 2 ranks on 127.0.0.1, CPU).

Each rank trains a Wide&Deep (26 fields x (16+1) on one HashEmbedding, 13 dense, MLP 400-400-1, dense
Adam, SparseAdam table of 1M rows) with RecModel on its share of every global batch (the whole batch
with one rank, rank r's half with two), the table's sharding as given ("none", "data_parallel" or
"row_wise"), and writes ``<out>/rank_<r>.json``: seconds per step over the timed steps (after warm-up
steps that compile the graph and fill the table), the bytes this rank put into the collectives per
step (the id exchange, then the row-gradient AllReduce, or the row fetch and the gradient AllGather)
and the seconds spent in them, and the bytes the formula of bench/bench_dist.py predicts from the
timed batches' ids.

    msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 --join=True \
        bench/_dist_worker.py OUT GLOBAL_BATCH STEPS WARMUP SHARDING
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


#: what a rank sends when its stream ends (once per ``train`` call): a step header of 4 int64 whose
#: code says so (``recboost._RANK_ENDED``), so the ranks stop at the same step
STREAM_END_BYTES = 8 * 4


def bytes_per_step(sharding, ids, dim):
    """``(sent, received)``: the bytes each rank puts into the collectives for one step of one table
    fed by one feature (``ids``: [ranks, ids of each rank's part]), and the bytes it gets back: a
    header of 4 int64 and every rank's ids padded to the longest part (8 bytes each), both by
    AllGather (each rank receives every rank's part), then data-parallel: the gradients of the
    union's distinct rows (4 x dim bytes each; AllReduce: the sum comes back); row-wise: the owned
    rows with a flag (4 x (dim + 1) each, padded to the rank owning most) and the gradients of the
    keys each rank uses (4 x dim each, padded to the rank using most), both by AllGather, and for
    a table that does not grow (this one) the rows each shard holds and the admissions it wants
    (2 int64; the positions of those admissions too when the table lacks rows for all: not here)."""
    ranks = ids.shape[0]
    if ranks == 1:
        return 0, 0
    fixed = 8 * 4 + 8 * ids.shape[1]
    keys = np.unique(ids)
    if sharding == "data_parallel":
        rows = 4 * dim * keys.size
        return fixed + rows, ranks * fixed + rows
    owned = np.bincount(rb._owner_of(keys, ranks), minlength=ranks).max()
    used = max(np.unique(part).size for part in ids)
    sent = fixed + 16 + 4 * (dim + 1) * owned + 4 * dim * used
    return sent, ranks * sent


def main():
    out_dir, global_batch, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sharding = sys.argv[5]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    from mindspore.communication import get_group_size, get_rank, init
    init()
    rank, size = get_rank(), get_group_size()
    if size > 1:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=size)
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, ROWS, input_index=1, optimizer=rb.SparseAdam(1e-3), name="ids",
                             sharding=sharding)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (400, 400), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    stream = rb.SyntheticClickStream(seed=0, batch_size=global_batch, with_timestamp=True)
    share = global_batch // size
    sl = slice(rank * share, (rank + 1) * share)
    batches, predicted = [], 0
    for step in range(warmup + steps):
        dense, ids, label, ts = next(stream)
        batches.append({"dense": dense[sl], "ids": ids[sl], "label": label[sl], "timestamp": ts})
        if step >= warmup:
            predicted += bytes_per_step(sharding, ids.reshape(size, -1), DIM + 1)[0]
    if size > 1:                  # the timed train call ends with the header that says its stream ended
        predicted += STREAM_END_BYTES
    model.train(1, batches[:warmup])
    none = {"bytes_sent": 0, "seconds": 0.0}                 # one process: no exchange
    before = model.exchange_stats() or none                  # seconds: in the exchange's collectives
    t0 = time.perf_counter()
    model.train(1, batches[warmup:])
    seconds = time.perf_counter() - t0
    after = model.exchange_stats() or none
    result = {"ranks": size, "rank": rank, "global_batch": global_batch, "steps": steps,
              "seconds_per_step": seconds / steps,
              "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / steps,
              "exchange_seconds_per_step": (after["seconds"] - before["seconds"]) / steps,
              "predicted_bytes_per_step": predicted / steps,
              "table_rows": table.capacity,
              "sharding": table.resolved_sharding, "ids_held": len(table.cache)}
    with open(os.path.join(out_dir, "rank_%d.json" % rank), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
