"""Step time of recboost's TrainOneStepWithLossScaleCell (dynamic update cell) against MindSpore's
nn.TrainOneStepCell on the bench Wide&Deep (26 fields x dim 16, 13 dense, MLP 400-400-1, batch 2048),
CPU, GRAPH mode, same batches, one process. Target ratio <= 1.10.

    .venv/bin/python -m pytest -q -s bench/bench_loss_scale.py
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb
from _harness import QUICK, interleaved, record

BATCH, FIELDS, DENSE, VOCAB = 2048, 26, 13, 26 * 4000


def _cell(kind):
    ms.set_seed(0)
    net = rb.WideDeep(DENSE, FIELDS, 16, (400, 400), vocab_size=VOCAB)
    loss = nn.WithLossCell(_Pair(net), nn.BCEWithLogitsLoss())
    opt = nn.Adam(net.trainable_params(), 1e-3)
    if kind == "mindspore":
        return nn.TrainOneStepCell(loss, opt)
    return rb.TrainOneStepWithLossScaleCell(loss, opt, rb.DynamicLossScaleUpdateCell(2 ** 12, 2, 1000))


class _Pair(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return self.net(x[0], x[1])


def test_loss_scale_step_overhead():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    rng = np.random.default_rng(0)
    dense = Tensor(rng.random((BATCH, DENSE), dtype=np.float32))
    ids = Tensor(rng.integers(0, VOCAB, (BATCH, FIELDS)).astype(np.int32))
    label = Tensor((rng.random((BATCH, 1)) < 0.3).astype(np.float32))
    cells = {"mindspore": _cell("mindspore"), "recboost": _cell("recboost")}

    def step(cell):
        out = cell((dense, ids), label)
        loss = out[0] if isinstance(out, tuple) else out
        value = loss.asnumpy()
        assert np.isfinite(value)
        return value

    times = interleaved({k: (lambda c=c: step(c)) for k, c in cells.items()},
                        rounds=5 if QUICK else 20, inner=2, warmup=3)
    ratio = times["recboost"] / times["mindspore"]
    record("loss_scale", {"ms_per_step_mindspore": times["mindspore"] * 1e3,
                          "ms_per_step_recboost": times["recboost"] * 1e3,
                          "ratio_recboost_over_mindspore": ratio, "target": "<= 1.10"})
    assert ratio < 1.5, ratio      # a hard failure only for gross regressions; the gate sets floors
