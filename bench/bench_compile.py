"""A new model's first train step: nearly all of it is MindSpore compiling the train graph (CPU, PyNative,
each cell's ``construct`` under ``mindspore.jit`` as RecModel compiles its own). Three first steps,
each on a fresh cell or model, interleaved (ABBA), one process:

- ``recboost``: a ``RecModel`` of Wide&Deep (4 dense, 6 fields x 8 on one ``HashEmbedding`` with
  ``SparseAdagrad``, MLP 16-1, Adam), its first ``train`` step of 16 rows;
- ``recboost_cell``: recboost's ``TrainOneStepWithLossScaleCell(..., None)`` (RecModel's step without
  tables: the overflow check guards the update) of a dense 52-16-1 MLP with Adam and
  ``BCEWithLogitsLoss``;
- ``mindspore``: MindSpore's ``nn.TrainOneStepCell`` of the same MLP (no overflow check), the limit.

Reported, not gated: seconds per first step and the ratios. Later steps take milliseconds.

    .venv/bin/python -m pytest -q -s bench/bench_compile.py
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb
from _harness import QUICK, compare, record

ROWS = 16


class _Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mlp = nn.SequentialCell(nn.Dense(52, 16), nn.ReLU(), nn.Dense(16, 1))

    def construct(self, x):
        return self.mlp(x)


def _mlp():
    ms.set_seed(0)
    net = _Mlp()
    return nn.WithLossCell(net, nn.BCEWithLogitsLoss()), nn.Adam(net.trainable_params(), 0.01)


def _jitted(cell):
    cell.construct = ms.jit(cell.construct)
    return cell


def _model():
    ms.set_seed(0)
    table = rb.HashEmbedding(9, 256, input_index=1, seed=0, optimizer=rb.SparseAdagrad(0.05))   # (8 + the wide weight)
    net = rb.WideDeep(4, 6, 8, (16,), embedding=table)
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def test_first_step_compile(benchmark):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    rng = np.random.default_rng(0)
    x = Tensor(rng.random((ROWS, 52), dtype=np.float32))
    y = Tensor((rng.random((ROWS, 1)) < 0.3).astype(np.float32))
    batch = [next(rb.SyntheticClickStream(seed=0, num_dense=4, num_sparse=6, vocab_sizes=[200] * 6,
                                          batch_size=ROWS))]

    def recboost_first_step(model):
        model.train(1, batch)
        return model.step

    def recboost_cell_first_step(cell):
        return cell(x, y)[0].asnumpy()

    def mindspore_first_step(cell):
        return cell(x, y).asnumpy()

    prepare = {"recboost": lambda: (_model(),),
               "recboost_cell": lambda: (_jitted(rb.TrainOneStepWithLossScaleCell(*_mlp(), None)),),
               "mindspore": lambda: (_jitted(nn.TrainOneStepCell(*_mlp())),)}
    times, ratios = compare(benchmark, recboost_first_step, {"recboost_cell": recboost_cell_first_step,
                                                             "mindspore": mindspore_first_step},
                            rounds=4 if QUICK else 10, warmup=1, prepare=prepare, check=lambda step: step == 1)
    record("first_step_compile", {"seconds": times, "recmodel_over_mindspore_cell": ratios["mindspore"],
                                  "recboost_cell_over_mindspore_cell": times["recboost_cell"] / times["mindspore"],
                                  "targets": "none (reported)"}, benchmark)
