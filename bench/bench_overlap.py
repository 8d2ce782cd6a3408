"""Is there room to hide the tables' host work behind the dense step on this machine? (issue #38 item 4)

The issue asks to overlap the gather of step t+1 and the table update of step t with the dense compute
of step t, or to show by profile why not: MindSpore's intra-op threads against ours. This bench
measures that room, on the bench Wide&Deep of ``bench_tables`` (1M-row ``HashEmbedding``, SparseAdam,
admission on), past warm-up on a fresh stream (every timed batch is new to the table: admissions and
all, as online training meets them), in one process, interleaved rounds:

- ``dense``: the dense limit with the rows' gradient (``bench_tables``' ``dense_limit_row_grad``), and
  the CPU seconds the process spends per wall second while it runs: how many of the cores MindSpore's
  step keeps busy.
- ``thread``: ``RecModel.online_train`` as shipped: each batch's host preparation (its ids checked,
  looked up, admitted) runs on the prefetch thread, overlapped with the step before it.
- ``sync``: the same model and stream with that preparation on the training thread
  (``_SyncFeeder``, what a data-parallel table uses), serial with the step.
- per step, the host parts of the ``sync`` rounds, each timed where it runs: ``prepare`` (the part
  the thread overlaps), ``inputs`` (take + gather: before the step) and ``finish`` (the rows' gradient
  read and the fused update: after it), and ``other`` (the rest of the loop: the step's call,
  callbacks, bookkeeping, beyond ``dense``).
- ``pair``: a step's take-free host work (gather + fused update of a prepared batch) on a thread
  beside the dense step, against the same two one after the other: the most overlap can win here.

Reported: the cores the dense step uses; ``hidden``, the share of a host part's time that running it
beside the dense step takes off the step (measured twice: the prefetch thread, ``(sync - thread) /
prepare``, and the pair); online_train's fraction of the dense limit; and the fraction if every host
part were overlapped at the measured ``hidden`` share: ``dense / (dense + other + (1 - hidden) * host)``.
That projection is what the issue's target (>= 0.95) is held against. Not gated (minutes of
training; run on demand, on a quiet machine):

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_overlap.py
"""
import collections
import contextlib
import resource
import statistics
import threading
import time

import numpy as np

import recboost as rb
import bench_tables as bt
from _harness import QUICK, abba, record, warm_online

STEPS = 20 if QUICK else 40
ROUNDS = 4 if QUICK else 8
WARM = 150


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _SerialFeeder(rb._SyncFeeder):
    """``_SyncFeeder`` for one process: each batch prepared on the training thread when it is asked
    for (no rank to tell at the stream's end)."""

    def __init__(self, iterator, produce, depth, replay=()):
        super().__init__(iterator, produce, replay)

    def __next__(self):
        if self._items:
            return self._items.popleft()
        return self._produce(next(self._iterator))


@contextlib.contextmanager
def _feeder(kind):
    shipped = rb._Prefetcher
    rb._Prefetcher = shipped if kind == "thread" else _SerialFeeder
    try:
        yield
    finally:
        rb._Prefetcher = shipped


@contextlib.contextmanager
def _parts_timed(spent):
    """The host parts' seconds, added to ``spent`` while inside: each method timed where it runs."""
    parts = {"prepare": (rb._StepPipeline, "prepare"), "inputs": (rb._StepPipeline, "inputs"),
             "finish": (rb.RecModel, "_finish_step")}
    shipped = {name: getattr(cls, attr) for name, (cls, attr) in parts.items()}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return run
    for name, (cls, attr) in parts.items():
        setattr(cls, attr, timed(name, shipped[name]))
    try:
        yield
    finally:
        for name, (cls, attr) in parts.items():
            setattr(cls, attr, shipped[name])


def _pair_table(batches):
    """A 1M-row table with the timed batches prepared and taken, and a fixed gradient: the host work
    of ``pair`` (gather + update) without the lookups."""
    table = rb.HashEmbedding(bt.DIM + 1, bt.ROWS, seed=0, name="ids", optimizer=rb.SparseAdam(1e-3))   # (every id admitted)
    prepared = []
    for _, ids, _, stamp in batches:
        batch = table.prepare(ids, int(stamp))
        table.take(batch)
        prepared.append(batch)
    grad = (np.random.default_rng(2).standard_normal((bt.BATCH, bt.FIELDS, bt.DIM + 1)) * 1e-3).astype(np.float32)

    def host(batch):
        table.gather(batch)
        table.apply_gradients(batch, grad)
    return host, prepared


def test_host_overlap_room():
    bt._graph()
    batches = bt._stream_batches(WARM + ROUNDS * STEPS)
    dicts = bt._as_dicts(batches)
    cell, ready = bt._prepare_limit(bt._ready_rows(batches[:STEPS + bt.WARMUP]), "row_grad")
    models = {kind: warm_online(bt._recmodel(), dicts, WARM)[0] for kind in ("thread", "sync")}
    host, prepared = _pair_table(batches[WARM:WARM + STEPS])

    def dense(x):
        out = cell(*x)
        out[3].asnumpy()
        out[0].asnumpy()

    def beside(x, batch):
        worker = threading.Thread(target=host, args=(batch,))
        worker.start()
        dense(x)
        worker.join()

    step_kinds = {"dense": lambda x, batch: dense(x), "host": lambda x, batch: host(batch),
                  "pair_serial": lambda x, batch: (host(batch), dense(x)), "pair_beside": beside}
    spent = collections.defaultdict(float)
    samples = collections.defaultdict(list)
    for order in abba(["models", "steps"], ROUNDS):
        for name in order:
            if name == "steps":              # the step kinds alternate step by step (ABBA), on the same batches
                for i, (x, batch) in enumerate(zip(ready, prepared)):
                    for kind in (list(step_kinds) if i % 2 == 0 else list(step_kinds)[::-1]):
                        t0 = time.perf_counter()
                        step_kinds[kind](x, batch)
                        samples[kind].append(time.perf_counter() - t0)
                continue
            for kind in (("thread", "sync") if len(samples["thread"]) % 2 == 0 else ("sync", "thread")):
                start = WARM + len(samples[kind]) * STEPS          # each model: the same new batches
                t0 = time.perf_counter()
                with _feeder(kind), (_parts_timed(spent) if kind == "sync" else contextlib.nullcontext()):
                    models[kind].online_train(dicts[start:start + STEPS], dataset_sink_mode=False)
                samples[kind].append((time.perf_counter() - t0) / STEPS)
    c0, t0 = _cpu(), time.perf_counter()
    for x in ready:
        dense(x)
    cores = (_cpu() - c0) / (time.perf_counter() - t0)
    for a, b in zip(models["thread"].train_network.trainable_params(), models["sync"].train_network.trainable_params()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())       # the same training, either feeder
    # per-step kinds: their mean (a round of the models is a mean over its steps); rounds: the median
    med = {name: (statistics.median if name in ("thread", "sync") else statistics.fmean)(v) for name, v in samples.items()}
    med["dense_cores"] = cores
    parts = {name: spent[name] / (ROUNDS * STEPS) for name in ("prepare", "inputs", "finish")}
    host_total = sum(parts.values())
    parts["other"] = med["sync"] - med["dense"] - host_total
    hidden_thread = (med["sync"] - med["thread"]) / parts["prepare"]
    hidden_pair = (med["pair_serial"] - med["pair_beside"]) / med["host"]
    best = max(hidden_thread, hidden_pair)
    projected = med["dense"] / (med["dense"] + max(parts["other"], 0.0) + (1 - best) * host_total)
    ms = lambda s: round(s * 1e3, 3)
    record("overlap", {
        "steps": STEPS, "rounds": ROUNDS, "ms_per_step": {k: ms(v) for k, v in med.items() if k != "dense_cores"},
        "dense_step_cores_used": med["dense_cores"],
        "host_ms_per_step": {k: ms(v) for k, v in parts.items()},
        "hidden_by_prefetch_thread": hidden_thread, "hidden_beside_dense_step": hidden_pair,
        "fraction_of_dense_limit_row_grad": {"thread": med["dense"] / med["thread"], "sync": med["dense"] / med["sync"],
                                             "all_host_overlapped_projected": projected},
        "target": {"fraction_of_dense_limit_row_grad": ">= 0.95"}})
    assert med["dense_cores"] > 1.0                      # MindSpore's step runs on both cores
    assert 0 < parts["prepare"] and 0 < parts["inputs"] and 0 < parts["finish"]
