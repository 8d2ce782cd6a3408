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
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb
from _harness import QUICK, compare, record, run_online, warm_online

BATCH, FIELDS, DENSE, DIM = 2048, 26, 13, 16
VOCAB = 1 << 20
STEPS = 20 if QUICK else 60
WARMUP = 3


def _plain_net():
    ms.set_seed(0)
    return rb.WideDeep(DENSE, FIELDS, DIM, (400, 400), vocab_size=VOCAB)


def _batches(n):
    stream = rb.SyntheticClickStream(seed=0, batch_size=BATCH, with_timestamp=True)
    return [stream.__next__() for _ in range(n)]


def _plain(batches):
    """Ready batches for a plain embedding: ids folded into [0, VOCAB)."""
    return [(d, (i % VOCAB).astype(np.int32), y) for d, i, y, _ in batches]


def _prepare_bare(plain):
    net = _plain_net()
    cell = nn.TrainOneStepCell(rb._WithLossCell(net, nn.BCEWithLogitsLoss()), nn.Adam(net.trainable_params(), 1e-3))
    tensors = [tuple(map(Tensor, b)) for b in plain]
    for b in tensors[:WARMUP]:
        cell(*b).asnumpy()
    return cell, tensors[WARMUP:]


def run_bare(cell, tensors):
    for b in tensors:
        loss = cell(*b)
    loss = loss.asnumpy()
    assert np.isfinite(loss)
    return loss


def _prepare_model(dataset_fn, plain):
    net = _plain_net()
    model = ms.train.Model(rb._WithLossCell(net, nn.BCEWithLogitsLoss()), optimizer=nn.Adam(net.trainable_params(), 1e-3))
    model.train(1, dataset_fn(plain[:WARMUP]), dataset_sink_mode=False)
    return model, dataset_fn, plain[WARMUP:]


def run_model(model, dataset_fn, plain):
    model.train(1, dataset_fn(plain), dataset_sink_mode=False)


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


def _check_recboost(model):
    """Every batch trained (none skipped, no overflow) and the hash table admitted ids."""
    assert model.step == STEPS and model.samples == STEPS * BATCH, (model.step, model.samples)
    assert model.overflow_steps == 0 and not any(model.skipped_batches.values()), model.skipped_batches
    assert len(model._tables[0].cache) > 0


def _prepare_text(path):
    model = _recmodel()
    reader = iter(rb.CriteoReader(path, batch_size=BATCH))
    model.online_train([next(reader) for _ in range(WARMUP)], dataset_sink_mode=False)
    return model, reader


def test_online_train_throughput(benchmark, tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    batches = _batches(STEPS)
    plain = _plain(batches)
    dicts = [{"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in batches]
    path = str(tmp_path / "stream.txt")
    rb.SyntheticClickStream(seed=0, batch_size=BATCH).write_criteo(path, BATCH * STEPS)
    # each call gets a fresh, compiled model (prepare, untimed) and trains STEPS - WARMUP batches
    alternatives = {"bare": run_bare, "model_generator": run_model, "model_numpy_slices": run_model,
                    "recboost_text": lambda model, reader: _check_recboost(run_online(model, reader))}
    prepare = {"bare": lambda: _prepare_bare(plain),
               "model_generator": lambda: _prepare_model(_generator, plain),
               "model_numpy_slices": lambda: _prepare_model(_numpy_slices, plain),
               "recboost_text": lambda: _prepare_text(path),
               "recboost": lambda: warm_online(_recmodel(), dicts, WARMUP)}
    times, ratios = compare(benchmark, run_online, alternatives, rounds=3, warmup=0,
                    prepare=prepare, check=_check_recboost)
    rate = {k: BATCH * (STEPS - WARMUP) / t for k, t in times.items()}
    speed = {k: 1 / r for k, r in ratios.items()}      # recboost's samples/s over the alternative's
    record("online", {"samples_per_second": rate,
                      "ratio_recboost_over_model_generator": speed["model_generator"],
                      "ratio_recboost_over_bare": speed["bare"],
                      "ratio_numpy_slices_over_model_generator":
                          rate["model_numpy_slices"] / rate["model_generator"],
                      "ratio_text_over_ready": ratios["recboost_text"],
                      "vocab_rows": VOCAB, "steps": STEPS,
                      "targets": {"recboost/model_generator": ">= 1.0", "text/ready": ">= 0.8"}}, benchmark)
