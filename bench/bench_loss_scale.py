"""Step time of recboost's TrainOneStepWithLossScaleCell (dynamic update cell) against MindSpore's
nn.TrainOneStepCell on the bench Wide&Deep (26 fields x dim 16, 13 dense, MLP 400-400-1, batch 2048),
CPU, GRAPH mode, same batches, one process. Target ratio <= 1.10.

    .venv/bin/python -m pytest -q -s bench/bench_loss_scale.py
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb
from _harness import QUICK, compare, record

BATCH, FIELDS, DENSE, VOCAB = 2048, 26, 13, 26 * 4000


STEPS = 4       # consecutive steps per timing


def _cell(kind):
    ms.set_seed(0)
    net = rb.WideDeep(DENSE, FIELDS, 16, (400, 400), vocab_size=VOCAB)
    loss = nn.WithLossCell(_Pair(net), nn.BCEWithLogitsLoss())
    opt = nn.Adam(net.trainable_params(), 1e-3)
    if kind == "mindspore":
        return net, nn.TrainOneStepCell(loss, opt)
    return net, rb.TrainOneStepWithLossScaleCell(loss, opt, rb.DynamicLossScaleUpdateCell(2 ** 12, 2, 1000))


def _sync(net):
    """Wait for every update of the step: the returned loss can be ready while the optimizer still
    writes the weights (that work would otherwise be billed to whatever runs next)."""
    return net.embedding.embedding_table.asnumpy()[0, 0] + net.mlp[-1].weight.asnumpy()[0, 0]


class _Pair(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return self.net(x[0], x[1])


def test_loss_scale_step_overhead(benchmark):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    rng = np.random.default_rng(0)
    dense = Tensor(rng.random((BATCH, DENSE), dtype=np.float32))
    ids = Tensor(rng.integers(0, VOCAB, (BATCH, FIELDS)).astype(np.int32))
    label = Tensor((rng.random((BATCH, 1)) < 0.3).astype(np.float32))
    (ms_net, ms_cell), (rb_net, rb_cell) = _cell("mindspore"), _cell("recboost")

    def recboost_step():
        for _ in range(STEPS):
            loss, overflow, scale = rb_cell((dense, ids), label)
        _sync(rb_net)
        return loss.asnumpy(), overflow.asnumpy(), scale.asnumpy()

    def mindspore_step():
        for _ in range(STEPS):
            loss = ms_cell((dense, ids), label)
        _sync(ms_net)
        return loss.asnumpy()

    def check(result):
        loss, overflow, scale = result
        assert np.isfinite(loss) and not overflow and scale == 2 ** 12, result

    times, ratios = compare(benchmark, recboost_step, {"mindspore": mindspore_step},
                    rounds=30 if QUICK else 40, warmup=3, check=check, ab_rounds=11)
    record("loss_scale", {"ms_per_step_mindspore": times["mindspore"] / STEPS * 1e3,
                          "ms_per_step_recboost": times["recboost"] / STEPS * 1e3,
                          "ratio_recboost_over_mindspore": ratios["mindspore"],
                          "target": "<= 1.10"}, benchmark)
