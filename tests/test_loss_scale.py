"""Loss scaling, mixed precision and the loss-scale train-step cell, on CPU (GRAPH and PYNATIVE)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn
from mindspore.common import dtype as mstype

import recboost as rb

FLAGS = [False, False, False, True, False, False, False, False, True, True]
# Measured from MindSpore's nn.DynamicLossScaleUpdateCell (the reference sequence).
EXPECTED_SCALES = [4096, 4096, 8192, 4096, 4096, 4096, 8192, 8192, 4096, 2048]


class _Net(nn.Cell):
    def __init__(self, d_in=4, d_out=1, bn=False):
        super().__init__()
        self.dense = nn.Dense(d_in, 8, weight_init="normal")
        self.bn = nn.BatchNorm1d(8) if bn else None
        self.out = nn.Dense(8, d_out, weight_init="normal")

    def construct(self, x):
        h = self.dense(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.out(ops_relu(h))


def ops_relu(x):
    return ms.ops.relu(x)


def _data(seed=0, n=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    return Tensor(x), Tensor(y)


def _params(cell):
    return {p.name: p.asnumpy().copy() for p in cell.get_parameters()}


def test_dynamic_update_cell_reference_sequence(ms_mode):
    cell = rb.DynamicLossScaleUpdateCell(2 ** 12, scale_factor=2, scale_window=3)
    scale = Parameter(Tensor(2.0 ** 12, mstype.float32), name="scale")
    got = []
    for flag in FLAGS:
        out = cell(scale, Tensor(flag))
        assert bool(out.asnumpy()) is flag
        got.append(float(scale.asnumpy()))
    assert got == EXPECTED_SCALES


def test_dynamic_update_cell_floor_is_one():
    cell = rb.DynamicLossScaleUpdateCell(4, scale_factor=2, scale_window=100)
    scale = Parameter(Tensor(4.0, mstype.float32), name="scale")
    got = []
    for _ in range(4):
        cell(scale, Tensor(True))
        got.append(float(scale.asnumpy()))
    assert got == [2.0, 1.0, 1.0, 1.0]


def test_host_manager_matches_device_cell():
    manager = rb.DynamicLossScaleManager(2 ** 12, scale_factor=2, scale_window=3)
    got = []
    for flag in FLAGS:
        manager.update_loss_scale(flag)
        got.append(manager.get_loss_scale())
    assert got == EXPECTED_SCALES


def test_manager_reference_values():
    manager = rb.DynamicLossScaleManager()
    assert manager.get_loss_scale() == 2 ** 24
    assert manager.get_drop_overflow_update() is True
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 2 ** 23
    cell = manager.get_update_cell()
    assert isinstance(cell, rb.DynamicLossScaleUpdateCell) and cell.get_loss_scale() == 2 ** 23
    assert isinstance(manager, ms.amp.LossScaleManager)

    fixed = rb.FixedLossScaleManager(128, drop_overflow_update=False)
    assert fixed.get_update_cell() is None
    assert fixed.get_loss_scale() == 128 and fixed.get_drop_overflow_update() is False
    fixed = rb.FixedLossScaleManager(128, drop_overflow_update=True)
    cell = fixed.get_update_cell()
    assert isinstance(cell, rb.FixedLossScaleUpdateCell) and cell.get_loss_scale() == 128
    fixed.update_loss_scale(True)
    assert fixed.get_loss_scale() == 128


@pytest.mark.parametrize("make, match", [
    (lambda: rb.DynamicLossScaleManager(init_loss_scale=0.5), r"'init_loss_scale' must be a number in \[1, "),
    # a fixed 2**127: 1 / scale below float32's normal range, gradients unscaled to 0 (nothing trained, no
    # overflow): a fixed scale is at most 2**126; 2**128 is float32's infinity (every step an overflow)
    (lambda: rb.FixedLossScaleManager(2.0 ** 127), r"'loss_scale' must be a number in \[1, 8.507059173023462e\+37\], "
                                                   r"but got 1.7014118346046923e\+38"),
    (lambda: rb.FixedLossScaleUpdateCell(2.0 ** 127), r"'loss_scale_value' must be a number in \[1, 8.5070"),
    (lambda: rb.DynamicLossScaleManager(2 ** 128), r"'init_loss_scale' must be a number in \[1, 3.4028"),
    (lambda: rb.DynamicLossScaleManager(scale_window=0), "'scale_window' must be an int >= 1"),
    (lambda: rb.DynamicLossScaleManager(scale_factor=1), "'scale_factor' must be a number > 1"),
    (lambda: rb.FixedLossScaleManager(loss_scale=0), r"'loss_scale' must be a number in \[1, 8.5070.*\], but got 0"),
    (lambda: rb.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 0), "'scale_window' must be an int >= 1"),
    (lambda: rb.FixedLossScaleUpdateCell(float("nan")), "'loss_scale_value' must be a finite number"),
])
def test_bad_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_types_are_named():
    with pytest.raises(TypeError, match="'drop_overflow_update' must be a bool"):
        rb.FixedLossScaleManager(128, drop_overflow_update="yes")
    with pytest.raises(TypeError, match="'scale_window' must be an int, but got 2.5"):
        rb.DynamicLossScaleManager(scale_window=2.5)


def _train_cell(scale_sense, seed=1, opt="adam"):
    ms.set_seed(seed)
    net = _Net()
    loss = nn.WithLossCell(net, nn.BCEWithLogitsLoss())
    optimizer = nn.Adam(net.trainable_params(), 0.01) if opt == "adam" else \
        nn.Momentum(net.trainable_params(), 0.01, 0.9)
    return net, optimizer, rb.TrainOneStepWithLossScaleCell(loss, optimizer, scale_sense)


def test_overflow_step_leaves_everything_untouched(ms_mode):
    net, optimizer, cell = _train_cell(rb.DynamicLossScaleUpdateCell(2 ** 12, 2, 3))
    x, y = _data()
    for _ in range(2):
        loss, overflow, scale = cell(x, y)
        assert not bool(overflow.asnumpy()) and np.isfinite(loss.asnumpy())
    before = _params(cell)             # network, optimizer moments, step, loss-scale counters
    bad = Tensor(np.full((16, 4), np.inf, np.float32))
    loss, overflow, scale = cell(bad, y)
    assert bool(overflow.asnumpy()) is True
    assert float(scale.asnumpy()) == 2 ** 11
    after = _params(cell)
    changed = sorted(k for k in before if not np.array_equal(before[k], after[k]))
    # only the loss scale and its step counters move on an overflow step
    assert changed == ["current_iterator_step", "last_overflow_iterator_step", "scale_sense"]
    assert any("moment1" in k for k in before) and any("global_step" in k for k in before)


def test_no_overflow_matches_plain_train_step_exactly(ms_mode):
    """With a power-of-two scale the scaled/unscaled gradients are exact: same bits as TrainOneStepCell."""
    x, y = _data()
    net_a, _, cell_a = _train_cell(rb.FixedLossScaleUpdateCell(1024), opt="momentum")
    ms.set_seed(1)
    net_b = _Net()
    plain = nn.TrainOneStepCell(nn.WithLossCell(net_b, nn.BCEWithLogitsLoss()),
                                nn.Momentum(net_b.trainable_params(), 0.01, 0.9))
    for step in range(4):
        la, overflow, scale = cell_a(x, y)
        lb = plain(x, y)
        assert la.asnumpy() == lb.asnumpy(), step
        assert float(scale.asnumpy()) == 1024 and not bool(overflow.asnumpy())
    for pa, pb in zip(net_a.trainable_params(), net_b.trainable_params()):
        np.testing.assert_array_equal(pa.asnumpy(), pb.asnumpy())


def test_tensor_scale_sense_and_set_sense_scale(ms_mode):
    net, optimizer, cell = _train_cell(Tensor(np.float32(2.0 ** 126)))     # (the largest a fixed scale may be)
    x, y = _data()
    x = Tensor(x.asnumpy() * 1e4)
    w0 = net.dense.weight.asnumpy().copy()
    _, overflow, scale = cell(x, y)
    assert bool(overflow.asnumpy()) is True        # 2^126 * grad overflows
    assert float(scale.asnumpy()) == 2.0 ** 126    # a Tensor scale is never updated
    np.testing.assert_array_equal(net.dense.weight.asnumpy(), w0)
    cell.set_sense_scale(Tensor(np.float32(256.0)))
    _, overflow, scale = cell(x, y)
    assert bool(overflow.asnumpy()) is False and float(scale.asnumpy()) == 256.0
    assert not np.array_equal(net.dense.weight.asnumpy(), w0)
    with pytest.raises(TypeError, match="'sens' must be a Tensor"):
        cell.set_sense_scale(2.0)


def test_scale_sense_errors():
    net = _Net()
    loss = nn.WithLossCell(net, nn.MSELoss())
    opt = nn.SGD(net.trainable_params())
    with pytest.raises(ValueError, match=r"the shape of 'scale_sense' must be \(1,\) or \(\)"):
        rb.TrainOneStepWithLossScaleCell(loss, opt, Tensor(np.ones((2,), np.float32)))
    with pytest.raises(TypeError, match="'scale_sense' must be a Cell, a Tensor or None, but got 'float'"):
        rb.TrainOneStepWithLossScaleCell(loss, opt, 1.0)
    # a scale at which every step overflows (0, NaN, inf) or 1/scale does (below 2^-126), or above 2^126
    # (1/scale flushes the gradients to 0): MindSpore takes them and never trains
    for bad in (0.0, -1.0, np.nan, np.inf, 2.0 ** -127, 2.0 ** 127):
        with pytest.raises(ValueError, match=r"'scale_sense' must be a loss scale in \[2\*\*-126, 2\*\*126\]"):
            rb.TrainOneStepWithLossScaleCell(loss, opt, Tensor(np.float32(bad)))
    cell = rb.TrainOneStepWithLossScaleCell(loss, opt, Tensor(np.float32(2.0 ** -126)))
    with pytest.raises(ValueError, match=r"'sens' must be a loss scale in \[2\*\*-126, 2\*\*126\], but got nan"):
        cell.set_sense_scale(Tensor(np.float32(np.nan)))
    assert float(cell.scale_sense.asnumpy()) == 2.0 ** -126                    # unchanged
    cell.set_sense_scale(Tensor(np.float32(2.0 ** 126)))
    dynamic = rb.TrainOneStepWithLossScaleCell(loss, opt, rb.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 100))
    dynamic.set_sense_scale(Tensor(np.float32(np.finfo(np.float32).max)))      # its overflows bring it down
    with pytest.raises(ValueError, match=r"'sens' must be a loss scale in \[2\*\*-126, 3.4e38\], but got 0.0"):
        dynamic.set_sense_scale(Tensor(np.float32(0)))


def test_float16_network_overflowing_every_step(ms_mode):
    """float16 network, scale float32.max: every step overflows; nothing moves but the scale."""
    ms.set_seed(3)
    net = _Net()
    net.to_float(mstype.float16)
    loss_net = nn.WithLossCell(net, nn.MSELoss())
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    start = float(np.finfo(np.float32).max)
    cell = rb.TrainOneStepWithLossScaleCell(loss_net, opt, rb.DynamicLossScaleUpdateCell(start, 2, 1000))
    x, y = _data(seed=5)
    w0 = [p.asnumpy().copy() for p in net.trainable_params()]
    losses, scales = [], []
    for _ in range(5):
        loss, overflow, scale = cell(x, y)
        assert bool(overflow.asnumpy()) is True
        losses.append(loss.asnumpy().item())
        scales.append(float(scale.asnumpy()))
    assert len(set(losses)) == 1 and np.isfinite(losses[0])
    assert scales == [np.float32(start / 2 ** k) for k in range(1, 6)]
    for p, w in zip(net.trainable_params(), w0):
        np.testing.assert_array_equal(p.asnumpy(), w)


def test_build_train_network_levels(graph_mode):
    x, y = _data(n=32)
    results = {}
    for level in ("O0", "O2", "O3", "auto"):
        ms.set_seed(7)
        net = _Net(bn=True)
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
        cell = rb.build_train_network(net, opt, nn.BCEWithLogitsLoss(), level=level)
        if level == "O2":
            assert isinstance(cell, rb.TrainOneStepWithLossScaleCell)
            assert isinstance(cell.loss_scaling_manager, rb.DynamicLossScaleUpdateCell)
            assert net.dense.weight.dtype == mstype.float32     # parameters stay fp32, compute is fp16
            assert net.dense.get_flags()["fp16"] and net.bn.get_flags()["fp32"]  # BatchNorm kept fp32
        else:
            if level == "O3":
                assert net.dense.get_flags()["fp16"] and net.bn.get_flags()["fp16"]
            assert isinstance(cell, nn.TrainOneStepCell) and not isinstance(cell, rb.TrainOneStepWithLossScaleCell)
        losses = []
        for _ in range(30):
            out = cell(x, y)
            losses.append(float((out[0] if isinstance(out, tuple) else out).asnumpy()))
        assert losses[-1] < losses[0] * 0.8, (level, losses[0], losses[-1])
        results[level] = losses
    # auto is MindSpore 2.10's auto_mixed_precision(network, "auto") on every device (it was O0 on CPU):
    # the run of MindSpore's own build_train_network at "auto", loss for loss
    ms.set_seed(7)
    net = _Net(bn=True)
    cell = ms.amp.build_train_network(net, nn.Momentum(net.trainable_params(), 0.05, 0.9), nn.BCEWithLogitsLoss(),
                                      level="auto")
    theirs = [float(cell(x, y).asnumpy()) for _ in range(30)]
    assert results["auto"] == theirs and results["auto"] != results["O0"]


def test_build_train_network_overrides_and_errors(graph_mode):
    net = _Net()
    opt = nn.SGD(net.trainable_params())
    cell = rb.build_train_network(net, opt, nn.MSELoss(), level="O2",
                                  loss_scale_manager=rb.FixedLossScaleManager(64, drop_overflow_update=False))
    assert isinstance(cell, nn.TrainOneStepCell) and not isinstance(cell, rb.TrainOneStepWithLossScaleCell)
    assert cell.sens == 64.0
    cell = rb.build_train_network(_Net(), nn.SGD(_Net().trainable_params()), nn.MSELoss(), level="O0",
                                  loss_scale_manager=rb.DynamicLossScaleManager(2 ** 10))
    assert isinstance(cell, rb.TrainOneStepWithLossScaleCell)
    with pytest.raises(ValueError, match=r"'level' must be one of \['O0', 'O1', 'O2', 'O3', 'auto'\], but got 'O5'"):
        rb.build_train_network(net, opt, level="O5")
    with pytest.raises(TypeError, match="keyword arguments must be among"):
        rb.build_train_network(net, opt, level="O2", keep_bn=True)
    with pytest.raises(TypeError, match="'keep_batchnorm_fp32' must be a bool"):
        rb.build_train_network(net, opt, level="O2", keep_batchnorm_fp32=1)
    with pytest.raises(TypeError, match="'loss_scale_manager' must be a LossScaleManager or None"):
        rb.build_train_network(net, opt, level="O2", loss_scale_manager=3)
    # MindSpore's own managers take a NaN or an infinite scale (every step then overflows, nothing trains)
    for manager in (ms.amp.FixedLossScaleManager(float("nan")), ms.amp.DynamicLossScaleManager(float("inf"))):
        with pytest.raises(ValueError, match=r"the loss scale of 'loss_scale_manager' must be a number from 1 to "
                                             r"(2\*\*126|float32's largest) .*, but got (nan|inf)\."):
            rb.build_train_network(net, opt, level="O2", loss_scale_manager=manager)
    # ... and a fixed scale of 2**127, whose reciprocal flushes the unscaled gradients to 0 (recboost's refuses it)
    with pytest.raises(ValueError, match=r"the loss scale of 'loss_scale_manager' must be a number from 1 to "
                                         r"2\*\*126 .*, but got 1.7014118346046923e\+38\."):
        rb.build_train_network(net, opt, level="O2", loss_scale_manager=ms.amp.FixedLossScaleManager(2.0 ** 127))
    rb.build_train_network(net, opt, level="O2", loss_scale_manager=ms.amp.DynamicLossScaleManager(2.0 ** 127))
    rb.build_train_network(net, opt, level="O2", loss_scale_manager=ms.amp.DynamicLossScaleManager(2 ** 16))
