"""Worker of tests/test_tables_dist.py, launched by msrun (2 ranks, CPU, 127.0.0.1).

``<out> [--resume CHECKPOINT] [none|row_wise ...]``: for each sharding given in turn (default: none),
in one launch (an msrun start costs more than most of what it runs), trains a WideDeep-like network with
four HashEmbeddings (data-parallel, the default sharding, or row-wise; a deep and a wide table reading the
same ids item, multi-hot bags with a "mean" combiner and a padding id, and a table fed by two features)
on this rank's half of every global batch and writes
``<out>/[row_wise_]rank_<r>.npz``: dense parameters, the table's cache,
rows and slots, the initial rows handed out (with the step and the ids' home rank), predictions,
the resolved sharding and the bytes this rank sent. With ``--resume``, every rank then also resumes from
that one checkpoint (written by one process) with ``online_train(..., resume_from=...)``, trains its half
of the global batches left and writes ``<out>/[row_wise_]resume_<r>.npz`` (1 -> 2 ranks). ``--finite``
last runs tests/_finite_dist_worker.py's cases (``finite_rank_<r>.npz``). The test imports
``global_batches``, ``half`` and ``make_model`` to train one process on the concatenated batches.
"""
import os
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn, ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recboost as rb  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

STEPS, BATCH, FIELDS, DENSE, DIM, BAG = 8, 64, 4, 5, 6, 3      # BATCH rows per rank, 2 * BATCH per global batch
NAN_STEP = 4                                          # rank 1's half has a NaN there: every rank skips it
OVERFLOW_STEP = 2                                     # rank 1's half overflows there: no rank updates


class Net(nn.Cell):
    """WideDeep's shape with a deep and a wide table on the same ids, a pooled table and a table of two
    features (FeatureSpecs "a" and "b", sharing rows and counts):
    ``(dense, ids [B, F], bags [B, BAG], a [B], b [B]) -> [B, 1]``."""

    def __init__(self, table, bags, pair, wide):
        super().__init__()
        self.table, self.bags, self.pair, self.wide = table, bags, pair, wide
        self.mlp = nn.SequentialCell([nn.Dense(DENSE + FIELDS * DIM + 3 * DIM, 12), nn.ReLU(), nn.Dense(12, 1)])

    def construct(self, dense, ids, bags, a, b):
        deep = self.table(ids)                                  # [B, F, DIM]
        pooled = self.bags(bags)                                # [B, DIM]
        x = ops.concat((dense, deep.reshape((deep.shape[0], -1)), pooled, self.pair(a), self.pair(b)), 1)
        return self.mlp(x) + self.wide(ids).sum(1)


def global_batches():
    """STEPS global batches of 2 * BATCH rows. Ids come from pool A (steps 0-2), pool B (steps 3-5),
    then pool A again (steps 6-7): with time 10 * step, eviction_threshold 15 and an EvictHook every
    10 time units, pool A's ids are evicted while B plays and re-admitted after. Rows of rank 0's
    half and rank 1's half draw from different sub-pools on some fields, so some ids are first
    admitted on rank 1's half only."""
    rng = np.random.default_rng(11)
    out = []
    for step in range(STEPS):
        pool = 1000 if step in (3, 4, 5) else 0
        ids = rng.integers(0, 30, (2 * BATCH, FIELDS)) + pool
        ids[BATCH:, 0] += 500                         # field 0 of rank 1's rows: ids only rank 1 sees
        ids[:, 1] = rng.integers(0, 3, 2 * BATCH) + 5000 + pool     # a few ids shared by both halves
        dense = rng.normal(size=(2 * BATCH, DENSE)).astype(np.float32)
        if step == NAN_STEP:
            dense[BATCH + 3, 2] = np.nan
        if step == OVERFLOW_STEP:                     # finite, but the first layer's sums overflow (weights 1)
            dense[BATCH + 5, :2] = 3e38
        bags = rng.integers(0, 40, (2 * BATCH, BAG)) + 7000
        bags[rng.random((2 * BATCH, BAG)) < 0.3] = -1            # padding: bags of 0 to BAG ids
        label = ((dense[:, :1] + 0.01 * (ids[:, :1] % 7)) > 0).astype(np.float32)
        a = rng.integers(0, 40, 2 * BATCH) + 9000                  # "a" and "b" share ids: one table, full
        b = rng.integers(20, 60, 2 * BATCH) + 9000
        out.append({"dense": dense, "ids": ids.astype(np.int64), "bags": bags.astype(np.int64), "a": a, "b": b,
                    "label": label, "timestamp": 10 * step})
    return out


def half(batch, rank):
    """Rank ``rank``'s half of a global batch; rank 0's timestamp is one less (the union takes the max)."""
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return {"dense": batch["dense"][sl], "ids": batch["ids"][sl], "bags": batch["bags"][sl],
            "a": batch["a"][sl], "b": batch["b"][sl], "label": batch["label"][sl],
            "timestamp": batch["timestamp"] - (1 if rank == 0 else 0)}


def make_model(sharding=None):
    """The model, its tables (each with ``sharding``; the "pair" table full, the others growing; "wide"
    reads the ids of "ids", admits at first sight and never evicts) and
    an EvictHook; dense parameters set from numpy (the same in every process, whatever MindSpore's
    seeding does)."""
    table = rb.HashEmbedding(DIM, 16, access_threshold=1, eviction_threshold=15, use_dynamic_expansion=True,
                             input_index=1, seed=3, init_stddev=0.1, name="ids", optimizer=rb.SparseAdam(0.02),
                             sharding=sharding)
    bags = rb.HashEmbedding(DIM, 8, use_dynamic_expansion=True, input_index=2, seed=4, init_stddev=0.1,
                            name="bags", combiner="mean", padding_id=-1, optimizer=rb.SparseRowWiseAdagrad(0.05),
                            sharding=sharding)                          # one slot value per row, across ranks
    pair = rb.create_table("pair", DIM, 12, access_threshold=3, optimizer=rb.SparseSGD(0.1), seed=5, sharding=sharding,
                           feature_spec=[rb.FeatureSpec("a", table_name="pair", access_threshold=3),
                                         rb.FeatureSpec("b", table_name="pair", access_threshold=3)])
    # (mx_rec's thresholds: a row at an id's third sighting, the table's access_threshold 2)
    wide = rb.HashEmbedding(1, 16, use_dynamic_expansion=True, input_index=1, seed=6, init_stddev=0.1, name="wide",
                            optimizer=rb.SparseFtrl(0.05), sharding=sharding)      # the ids of "ids", its own rules
    net = Net(table, bags, pair, wide)
    rng = np.random.default_rng(5)
    for p in net.trainable_params():
        p.set_data(ms.Tensor(rng.normal(0, 0.2, p.shape).astype(np.float32)))
    first = net.mlp[0].weight.asnumpy()
    first[:, :2] = 1.0                                # the OVERFLOW_STEP row: inf in every hidden unit
    net.mlp[0].weight.set_data(ms.Tensor(first))
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    return table, model, rb.EvictHook(evict_time_interval=10)


def record_initial_rows(table, log):
    """Wrap ``table.take`` so every initial row it hands out is logged as (ids, rows)."""
    take = table.take

    def logged(batch, **kwargs):
        undo = take(batch, **kwargs)
        if batch.new_rows.size:
            log.append((np.array(batch.new_ids, np.int64), table.weight[batch.new_rows].copy()))
        return undo
    table.take = logged


def results(table, model, hook, predict_batch):
    """What both the workers and the one-process reference report (table entries prefixed by the
    table's name)."""
    out = {"dense:" + p.name: p.asnumpy().copy() for p in model.state_parameters()}    # not a view
    for t in model.tables:
        state = t.state_dict()
        out.update({t.table_name + ":cache:" + k: np.asarray(v) for k, v in state["cache"].items()})
        out[t.table_name + ":table"] = state["table"]
        out.update({t.table_name + ":slot:" + k: v for k, v in state["slots"].items()})
    out["predict"] = model.predict(*(predict_batch[k] for k in ("dense", "ids", "bags", "a", "b"))).asnumpy()
    only_padding = dict(predict_batch, bags=np.full_like(predict_batch["bags"], -1))     # no id in the bags table
    out["predict_padding"] = model.predict(*(only_padding[k] for k in ("dense", "ids", "bags", "a", "b"))).asnumpy()
    out["skipped"] = np.array(model.skipped_batches["nonfinite"])
    out["overflow_steps"] = np.array(model.overflow_steps)
    out["evictions"] = np.array(hook.evictions)
    out["step"] = np.array(model.step)
    return out


def resume(out_dir, rank, checkpoint, sharding):
    """1 -> 2 ranks: resume from ``checkpoint`` (one process's) on the whole stream again (online_train
    skips what the checkpoint consumed) and write ``<out>/[row_wise_]resume_<rank>.npz``."""
    table, model, hook = make_model(sharding)
    batches = global_batches()
    model.online_train([half(b, rank) for b in batches], callbacks=[hook], resume_from=checkpoint)
    np.savez(os.path.join(out_dir, "%sresume_%d.npz" % ("row_wise_" if sharding else "", rank)),
             **results(table, model, hook, batches[0]))


def run(out_dir, rank, sharding):
    """One sharding's straight run, restore, failing batch (and, row-wise, refused export and failing
    save): ``<out>/[row_wise_]rank_<rank>.npz``."""
    tag = "" if sharding is None else sharding + "_"
    table, model, hook = make_model(sharding)
    log = []
    record_initial_rows(table, log)
    batches = global_batches()
    start = time.perf_counter()
    model.train(1, [half(b, rank) for b in batches], callbacks=[hook])
    seconds = time.perf_counter() - start
    out = results(table, model, hook, batches[0])
    out["sharding"] = np.array([t.resolved_sharding for t in model.tables])
    out["tables"] = np.array([t.table_name for t in model.tables])
    stats = model.exchange_stats()
    assert (stats["rank"], stats["world"]) == (rank, 2)
    out["bytes_sent"] = np.array(stats["bytes_sent"])
    out["mean"] = np.array(stats["mean"])
    out["seconds"] = np.array(seconds)
    out["init_ids"] = np.concatenate([ids for ids, _ in log])
    out["init_rows"] = np.concatenate([rows for _, rows in log])
    out["init_calls"] = np.array([len(ids) for ids, _ in log])
    # restore: after 5 global batches each rank saves its own checkpoint (data-parallel), or its part of
    # one (row-wise, the same path on every rank); a fresh model restores it and trains the rest (pool A's
    # ids come back there): it ends where the straight run ended
    _, first, first_hook = make_model(sharding)
    first.train(1, [half(b, rank) for b in batches[:5]], callbacks=[first_hook])
    path = os.path.join(out_dir, "ckpt_row_wise.npz" if sharding == "row_wise" else "ckpt_rank_%d.npz" % rank)
    first.save_checkpoint(path)
    table_b, model_b, hook_b = make_model(sharding)
    log_b = []
    record_initial_rows(table_b, log_b)
    model_b.load_checkpoint(path)
    model_b.train(1, [half(b, rank) for b in batches[5:]], callbacks=[hook_b])
    out.update({"restored:" + k: v for k, v in results(table_b, model_b, hook_b, batches[0]).items()})
    out["restored:init_ids"] = np.concatenate([ids for ids, _ in log_b])
    out["restored:init_rows"] = np.concatenate([rows for _, rows in log_b])
    # a batch that fails its checks on rank 1 only: every rank raises at that step (none waits forever)
    _, model, _ = make_model(sharding)
    parts = [half(b, rank) for b in batches[:3]]
    if rank == 1:
        parts[1] = dict(parts[1], ids=parts[1]["ids"].astype(np.float32))
    try:
        model.train(1, parts)
        out["failure"] = np.array("")
    except (TypeError, ValueError, RuntimeError) as exc:
        out["failure"] = np.array("%s: %s" % (type(exc).__name__, exc))
    out["failure_step"] = np.array(model.step)
    if sharding == "row_wise":
        # a row-wise model holds one shard per rank: export refuses it
        try:
            model_b.export(os.path.join(out_dir, "bundle_%d" % rank))
            out["export"] = np.array("")
        except ValueError as exc:
            out["export"] = np.array(str(exc))
        # rank 1 cannot write its part (a full disk): every rank's save raises OSError, no manifest is
        # written, and the ranks go on training in step
        real = rb._atomic_write
        if rank == 1:
            def full_disk(path, write, size=None, recycle=None):
                if ".part-" in path:
                    raise OSError(28, "No space left on device (test)")
                return real(path, write, size=size, recycle=recycle)
            rb._atomic_write = full_disk
        try:
            model_b.save_checkpoint(os.path.join(out_dir, "ckpt_full_disk.npz"))
            out["save_failure"] = np.array("")
        except OSError as exc:
            out["save_failure"] = np.array(str(exc))
        rb._atomic_write = real
        model_b.train(1, [half(batches[0], rank)])
        out["after_failure_step"] = np.array(model_b.step)
        out["after_failure_predict"] = model_b.predict(*(batches[1][k] for k in ("dense", "ids", "bags", "a", "b"))
                                                       ).asnumpy()
    np.savez(os.path.join(out_dir, "%srank_%d.npz" % (tag, rank)), **out)


def main():
    args = sys.argv[1:]
    checkpoint, finite = None, "--finite" in args
    if finite:
        args.remove("--finite")
    if "--resume" in args:
        at = args.index("--resume")
        checkpoint = args[at + 1]
        del args[at:at + 2]
    out_dir, shardings = args[0], [None if s == "none" else s for s in args[1:]] or [None]
    rank, _ = init_data_parallel()
    for sharding in shardings:
        run(out_dir, rank, sharding)
        if checkpoint:
            resume(out_dir, rank, checkpoint, sharding)
    if finite:                      # last: it sets gradients_mean=False
        import _finite_dist_worker
        _finite_dist_worker.run(out_dir, rank)


if __name__ == "__main__":
    main()
