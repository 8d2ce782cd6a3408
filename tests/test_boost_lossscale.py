"""BoostTrainOneStepWithLossScaleCell on CPU: overflow steps change nothing, normal steps match."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

import recboost as rb
from test_boost_algorithms import MLP, _data, _values


class ScaledMSE(nn.Cell):
    """MSE times a factor given as an input (inf makes every gradient overflow)."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, x, y, factor):
        return ((self.net(x) - y) ** 2).mean() * factor


def _state(cell):
    return {p.name: p.asnumpy().copy() for p in cell.get_parameters()}


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_overflow_step_changes_nothing_then_normal_step_matches(graph_mode, level):
    x, y = map(Tensor, _data())
    net = ScaledMSE(MLP(5))
    opt = nn.Adam(net.trainable_params(), 0.01)
    update = rb.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 100)
    # less_bn off: this test compares freezing with loss scaling against plain Adam steps
    cell = rb._boost_train_cell(net, opt, level, {"boost": {"mode": "manual", "less_bn": False},
                                                  "grad_freeze": {"freeze_p": 0.5, "freeze_type": 0}}, update)
    assert isinstance(cell, rb.BoostTrainOneStepWithLossScaleCell) and cell.freeze == (level == "O1")
    before = _state(cell)
    loss, overflow, scale = cell(x, y, Tensor(np.float32(np.inf)))
    assert bool(overflow.asnumpy()) and float(scale.asnumpy()) == 2.0 ** 9
    after = _state(cell)
    moved = [n for n in before if not np.array_equal(before[n], after[n])
             and "scale" not in n and "iter" not in n and "step" not in n]
    assert moved == []
    # a normal step updates exactly like a plain Adam step on the unscaled gradient
    ref = ScaledMSE(MLP(5))
    ref_opt = nn.Adam(ref.trainable_params(), 0.01)
    nn.TrainOneStepCell(ref, ref_opt)(x, y, Tensor(np.float32(1.0)))
    loss, overflow, _ = cell(x, y, Tensor(np.float32(1.0)))
    assert not bool(overflow.asnumpy())
    start = {p.name: before[p.name] for p in net.trainable_params()}
    for name, value in _values(ref).items():
        # O1 (freeze pattern 0, 1, 0, 1, ...): the second step trains only the last layer
        want = value if level == "O0" or name.startswith("net.layers.2") or name.startswith("layers.2") \
            else start[name]
        np.testing.assert_allclose(_values(net)[name], want, rtol=1e-4, atol=1e-6)


def test_tensor_scale_and_bad_scale(graph_mode):
    net = ScaledMSE(MLP(6))
    opt = nn.SGD(net.trainable_params(), 0.1)
    cell = rb.BoostTrainOneStepWithLossScaleCell(net, opt, Tensor(np.float32(64.0)))
    x, y = map(Tensor, _data())
    ref = ScaledMSE(MLP(6))
    nn.TrainOneStepCell(ref, nn.SGD(ref.trainable_params(), 0.1))(x, y, Tensor(np.float32(1.0)))
    _, overflow, scale = cell(x, y, Tensor(np.float32(1.0)))
    assert not bool(overflow.asnumpy()) and float(scale.asnumpy()) == 64.0
    for name, value in _values(ref).items():
        np.testing.assert_allclose(_values(net)[name], value, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="the shape of 'scale_sense' must be"):
        rb.BoostTrainOneStepWithLossScaleCell(net, opt, Tensor(np.ones((2,), np.float32)))
    with pytest.raises(TypeError, match="'scale_sense' must be a Cell, a Tensor or None"):
        rb.BoostTrainOneStepWithLossScaleCell(net, opt, 3.0)


def test_loss_scale_groups(graph_mode):
    manager = rb.GroupLossScaleManager(16.0, [])

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = nn.Dense(8, 8)
            self.b = nn.Dense(8, 1)
            self.amp = manager

        def construct(self, x, y, factor):
            h = self.amp(ops.relu(self.a(self.amp(x, 0, 1))), 1, 2)
            out = self.amp(self.b(h), 2, 3)
            return ((out - y) ** 2).mean() * factor

    net = Net()
    manager.loss_scale_groups = [[net.a.weight, net.a.bias], [net.b.weight, net.b.bias]]
    opt = nn.SGD(net.trainable_params(), 0.1)
    boost = rb.AutoBoost("O0", {"boost": {"mode": "manual", "loss_scale_group": True}})
    cell = rb.BoostTrainOneStepWithLossScaleCell(net, opt, manager, boost=boost)
    x, y = map(Tensor, _data())
    start = _values(net)
    grads = ops.GradOperation(get_by_list=True)(net, ms.ParameterTuple(net.trainable_params()))(
        x, y, Tensor(np.float32(1.0)))
    _, overflow, _ = cell(x, y, Tensor(np.float32(1.0)))
    assert not bool(overflow.asnumpy())
    growth = 2 ** (1 / 1000)
    assert np.allclose([float(p.asnumpy()) for p in manager.dynamic_loss_scale],
                       [1.0, 16 * growth, 16 * growth, 1.0])
    # the plain-gradient call above saw the scales too (16 for both groups): the cell unscales them
    for p, g in zip(net.trainable_params(), grads):
        np.testing.assert_allclose(p.asnumpy(), start[p.name] - 0.1 * g.asnumpy() / 16, rtol=1e-4, atol=1e-6)
    _, overflow, _ = cell(x, y, Tensor(np.float32(np.inf)))
    assert bool(overflow.asnumpy())
    assert np.allclose([float(p.asnumpy()) for p in manager.dynamic_loss_scale][1:3],
                       [16 * growth * 2 ** -0.5] * 2)


def test_loss_scale_groups_guard_accumulators(graph_mode):
    """Per-group loss scales (the boost's own step) check the optimizer's growing states too: Adagrad's
    accumulators at float32's largest value, a loss x1e17 gives finite gradients whose squares take them to
    Inf; the step is flagged and changes nothing (issue #35 item 4)."""
    manager = rb.GroupLossScaleManager(1.0, [])

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = nn.Dense(8, 1)
            self.amp = manager

        def construct(self, x, y, factor):
            out = self.amp(self.a(self.amp(x, 0, 1)), 1, 2)
            return ((out - y) ** 2).mean() * factor

    net = Net()
    manager.loss_scale_groups = [[net.a.weight], [net.a.bias]]
    opt = nn.Adagrad(net.trainable_params(), accum=float(np.finfo(np.float32).max), learning_rate=0.1)
    boost = rb.AutoBoost("O0", {"boost": {"mode": "manual", "loss_scale_group": True}})
    cell = rb.BoostTrainOneStepWithLossScaleCell(net, opt, manager, boost=boost)
    x, y = map(Tensor, _data())
    _, overflow, _ = cell(x, y, Tensor(np.float32(1.0)))
    assert not bool(overflow.asnumpy())
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    grads = ops.GradOperation(get_by_list=True)(net, ms.ParameterTuple(net.trainable_params()))(
        x, y, Tensor(np.float32(1e17)))
    largest = max(float(np.abs(g.asnumpy()).max()) for g in grads)
    assert 1e16 < largest and sum(float(np.abs(g.asnumpy()).sum()) for g in grads) < 1e19   # T * T finite
    _, overflow, _ = cell(x, y, Tensor(np.float32(1e17)))
    assert bool(overflow.asnumpy())
    for p in cell.get_parameters():
        if "loss_scale" not in p.name:             # the groups' scales do their own bookkeeping
            np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)


@pytest.mark.slow
@pytest.mark.parametrize("level, extra", [("O1", {}), ("O1", {"loss_scale_manager": "dynamic"})])
def test_recmodel_boost_level(graph_mode, level, extra):
    """RecModel(boost_level=...) builds the boost cells through build_train_network and trains."""
    rng = np.random.default_rng(0)
    batches = [(rng.random((64, 13), np.float32), rng.integers(0, 500, (64, 26)).astype(np.int32),
                (rng.random((64, 1)) < 0.3).astype(np.float32)) for _ in range(6)]
    if extra:
        extra = {"loss_scale_manager": rb.DynamicLossScaleManager(2 ** 10, 2, 100)}
    net = rb.WideDeep(13, 26, 8, (32, 32), vocab_size=500)
    table = net.embedding.embedding_table.asnumpy().copy()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3), boost_level=level,
                        boost_config_dict={"grad_freeze": {"freeze_type": 0}}, **extra)
    model.train(1, batches)
    cell = model._train_cell
    assert isinstance(cell, rb.BoostTrainOneStepWithLossScaleCell if extra else rb.BoostTrainOneStepCell)
    assert cell.freeze and model.step == 6
    assert not np.array_equal(table, net.embedding.embedding_table.asnumpy())


def test_an_accumulated_mean_that_would_overflow_is_not_applied(graph_mode):
    """With gradient accumulation the optimizer applies the accumulated mean, not the step's gradient: a sum
    held at 1e20 per entry (finite; as a resumed cell's buffer may hold) would make Adam's second moment
    Inf (1e40) on the step that completes it, though that step's own gradient is small. The step is
    flagged and changes nothing (buffer and count included); normal accumulation steps are not."""
    x, y = map(Tensor, _data())
    net = ScaledMSE(MLP(5))
    boost = rb.AutoBoost("O0", {"boost": {"mode": "manual", "grad_accumulation": True},
                                "grad_accumulation": {"grad_accumulation_step": 2}})
    cell = rb.BoostTrainOneStepWithLossScaleCell(net, nn.Adam(net.trainable_params(), 0.01), None, boost=boost)
    assert cell.use_grad_accumulation
    one = Tensor(np.float32(1.0))
    for _ in range(3):
        _, overflow, _ = cell(x, y, one)
        assert not bool(overflow.asnumpy())
    assert int(cell.accumulation_step.asnumpy()) == 1          # the next step applies the mean
    for held in cell.grad_accumulation:
        held.set_data(Tensor(np.full(held.shape, 1e20, np.float32)))
    before = _state(cell)
    _, overflow, _ = cell(x, y, one)
    assert bool(overflow.asnumpy())
    after = _state(cell)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
