"""Online training throughput, one process, same batches (issue: RecModel and online training).

Contenders on the bench Wide&Deep (26 fields x dim 16, 13 dense, MLP 400-400-1, batch 2048, Adam):

- ``bare``: a ``TrainOneStepCell`` loop over ready tensors, plain ``nn.Embedding`` (VOCAB rows);
- ``model_generator``: ``mindspore.train.Model.train`` fed by a ``GeneratorDataset`` yielding whole
  ready batches, same plain embedding;
- ``model_numpy_slices``: ``Model.train`` fed by ``NumpySlicesDataset(...).batch(2048)``;
- ``recboost``: ``RecModel.online_train`` with a ``HashEmbedding`` of VOCAB rows fed raw int64 ids,
  admission and timestamps on (translation on the host, overlapped with the step);
- ``recboost_text``: the same, reading a Criteo-format text file (read, parse, hash, translate, step).

Reported: samples/s of each and the ratios recboost/model_generator (target >= 1.0) and
recboost_text/recboost (target >= 0.8).

    .venv/bin/python -m pytest -q -s bench/bench_online.py      (RECBOOST_BENCH_QUICK=1: short)
"""
import os
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb
from _harness import QUICK, record

BATCH, FIELDS, DENSE, DIM = 2048, 26, 13, 16
VOCAB = 1 << 20
STEPS = 12 if QUICK else 60
WARMUP = 3


class _Loss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.BCEWithLogitsLoss()

    def construct(self, dense, ids, label):
        return self.loss(self.net(dense, ids), label)


def _plain_net():
    ms.set_seed(0)
    return rb.WideDeep(DENSE, FIELDS, DIM, (400, 400), vocab_size=VOCAB)


def _batches(n):
    stream = rb.SyntheticClickStream(seed=0, batch_size=BATCH, with_timestamp=True)
    return [stream.__next__() for _ in range(n)]


def _plain(batches):
    """Ready batches for a plain embedding: ids folded into [0, VOCAB)."""
    return [(d, (i % VOCAB).astype(np.int32), y) for d, i, y, _ in batches]


def _timed(fn, n_samples):
    t0 = time.perf_counter()
    fn()
    return n_samples / (time.perf_counter() - t0)


def run_bare(batches):
    net = _plain_net()
    cell = nn.TrainOneStepCell(_Loss(net), nn.Adam(net.trainable_params(), 1e-3))
    tensors = [tuple(map(Tensor, b)) for b in batches]
    for b in tensors[:WARMUP]:
        cell(*b).asnumpy()

    def go():
        for b in tensors[WARMUP:]:
            loss = cell(*b)
        assert np.isfinite(loss.asnumpy())
    return _timed(go, BATCH * (len(batches) - WARMUP))


def _model_train(dataset_fn, batches):
    net = _plain_net()
    model = ms.train.Model(_Loss(net), optimizer=nn.Adam(net.trainable_params(), 1e-3))
    model.train(1, dataset_fn(batches[:WARMUP]), dataset_sink_mode=False)
    return _timed(lambda: model.train(1, dataset_fn(batches[WARMUP:]), dataset_sink_mode=False),
                  BATCH * (len(batches) - WARMUP))


def _generator(batches):
    return ms.dataset.GeneratorDataset(lambda: iter(batches), ["dense", "ids", "label"], shuffle=False)


def _numpy_slices(batches):
    cols = [np.concatenate([b[k] for b in batches]) for k in range(3)]
    return ms.dataset.NumpySlicesDataset(tuple(cols), ["dense", "ids", "label"], shuffle=False).batch(BATCH)


def _recmodel():
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, VOCAB, access_threshold=1, eviction_threshold=-1,
                             max_unique=BATCH * FIELDS + 1, input_index=1, seed=0, name="ids")
    net = rb.WideDeep(DENSE, FIELDS, DIM, (400, 400), embedding=table)
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))


def run_recboost(batches):
    model = _recmodel()
    dicts = [{"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in batches]
    model.online_train(dicts[:WARMUP], dataset_sink_mode=False)
    return _timed(lambda: model.online_train(dicts[WARMUP:], dataset_sink_mode=False),
                  BATCH * (len(batches) - WARMUP))


def run_recboost_text(path, n_batches):
    model = _recmodel()
    reader = rb.CriteoReader(path, batch_size=BATCH)
    first = [next(iter(reader)) for _ in range(WARMUP)]
    model.online_train(first, dataset_sink_mode=False)
    return _timed(lambda: model.online_train(reader, dataset_sink_mode=False), BATCH * (n_batches - WARMUP))


def test_online_train_throughput(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    batches = _batches(STEPS)
    plain = _plain(batches)
    path = str(tmp_path / "stream.txt")
    rb.SyntheticClickStream(seed=0, batch_size=BATCH).write_criteo(path, BATCH * STEPS)
    rates = {}
    for round_ in range(1 if QUICK else 2):                 # two rounds, alternating order
        order = ["bare", "model_generator", "model_numpy_slices", "recboost", "recboost_text"]
        for name in (order if round_ % 2 == 0 else order[::-1]):
            if name == "bare":
                r = run_bare(plain)
            elif name == "model_generator":
                r = _model_train(_generator, plain)
            elif name == "model_numpy_slices":
                r = _model_train(_numpy_slices, plain)
            elif name == "recboost":
                r = run_recboost(batches)
            else:
                r = run_recboost_text(path, STEPS)
            rates.setdefault(name, []).append(r)
    rate = {k: float(np.median(v)) for k, v in rates.items()}
    result = {"samples_per_second": rate,
              "ratio_recboost_over_model_generator": rate["recboost"] / rate["model_generator"],
              "ratio_recboost_over_bare": rate["recboost"] / rate["bare"],
              "ratio_numpy_slices_over_model_generator": rate["model_numpy_slices"] / rate["model_generator"],
              "ratio_text_over_ready": rate["recboost_text"] / rate["recboost"],
              "vocab_rows": VOCAB, "steps": STEPS, "targets": {"recboost/model_generator": ">= 1.0",
                                                                "text/ready": ">= 0.8"}}
    record("online", result)
    assert rate["recboost"] > 0
