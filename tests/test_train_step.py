"""The one train step every cell shares: MindSpore's overridable hooks, sparse (RowTensor) gradients,
amp levels (int labels, O1), boost precedence, and the boost x amp x hash-table matrix of RecModel."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn
from mindspore.train.callback import Callback

import recboost as rb
from _stopping import StopAfter


def _data(seed=0, n=32, d=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    return Tensor(x), Tensor(y)


def _params(cell):
    return {p.name: p.asnumpy().copy() for p in cell.trainable_params()}


class _Mlp(nn.Cell):
    def __init__(self, d=6, out=1):
        super().__init__()
        self.a = nn.Dense(d, 16, weight_init="normal")
        self.relu = nn.ReLU()
        self.b = nn.Dense(16, out, weight_init="normal")

    def construct(self, x):
        return self.b(self.relu(self.a(x)))


def test_every_cell_is_the_one_step():
    for cls in (rb.TrainOneStepWithLossScaleCell, rb.BoostTrainOneStepCell, rb.BoostTrainOneStepWithLossScaleCell,
                rb._FreezeStepCell):
        assert issubclass(cls, rb._TrainStep)
        assert "construct" not in vars(cls) and "_gradients" not in vars(cls)   # nobody rewrites the step


def test_subclass_overriding_get_overflow_status_is_used(graph_mode):
    class Paranoid(rb.TrainOneStepWithLossScaleCell):
        """Reports an overflow on every step (a user's own check, MindSpore's signature)."""

        def get_overflow_status(self, status, compute_output):
            flag = super().get_overflow_status(status, compute_output)
            return ms.ops.logical_or(flag, Tensor(True))

    net = nn.WithLossCell(_Mlp(), nn.MSELoss())
    cell = Paranoid(net, nn.SGD(net.trainable_params(), 0.5), rb.DynamicLossScaleUpdateCell(2.0 ** 8, 2, 100))
    before = _params(net)
    x, y = _data()
    for _ in range(2):
        _, overflow, scale = cell(x, y)
    assert bool(overflow.asnumpy()) and float(scale.asnumpy()) == 2.0 ** 6       # halved twice
    for name, value in _params(net).items():
        np.testing.assert_array_equal(value, before[name])                       # nothing applied


def test_unit_scale_step_equals_train_one_step_cell_and_guards_nan(graph_mode):
    x, y = _data()
    ms.set_seed(1)
    net = nn.WithLossCell(_Mlp(), nn.MSELoss())
    ms.set_seed(1)
    ref = nn.WithLossCell(_Mlp(), nn.MSELoss())
    cell = rb.TrainOneStepWithLossScaleCell(net, nn.Adam(net.trainable_params(), 0.01), None)
    ref_cell = nn.TrainOneStepCell(ref, nn.Adam(ref.trainable_params(), 0.01))
    for _ in range(3):
        loss, overflow, scale = cell(x, y)
        assert float(loss.asnumpy()) == float(ref_cell(x, y).asnumpy())          # bit for bit
        assert not bool(overflow.asnumpy()) and float(scale.asnumpy()) == 1.0
    before = _params(net)
    bad = x.asnumpy().copy()
    bad[3, 2] = np.nan
    _, overflow, _ = cell(Tensor(bad), y)
    assert bool(overflow.asnumpy())
    for name, value in _params(net).items():
        np.testing.assert_array_equal(value, before[name])
    with pytest.raises(ValueError, match="the cell must be made with a scale Tensor or update cell"):
        cell.set_sense_scale(Tensor(np.float32(2.0)))


class _SparseNet(nn.Cell):
    """MindSpore's test_embedding_lookup_with_mix_precision shape: a sparse EmbeddingLookup (its
    gradient is a RowTensor) under amp O2 with dynamic loss scaling."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingLookup(20, 4, target="CPU", sparse=True)
        self.out = nn.Dense(8, 1, weight_init="normal")

    def construct(self, ids):
        e = self.emb(ids)
        return self.out(e.reshape((e.shape[0], 8)))


def test_sparse_row_tensor_gradients_are_unscaled_and_checked(graph_mode):
    # A scale Tensor set from the host (MindSpore's documented Tensor flow). With a device update cell
    # MindSpore 2.10's CPU compiler crashes on any sparse-gradient optimizer (docs/training.md, known limits).
    net = _SparseNet()
    rb._cast_network(net, rb._AmpConfig.of("O2"))
    loss_net = rb._WithLossCell(net, nn.MSELoss(), cast_fp32=True)
    cell = rb.TrainOneStepWithLossScaleCell(loss_net, nn.LazyAdam(net.trainable_params(), 0.05),
                                            Tensor(np.float32(2.0 ** 24)))
    ids = Tensor(np.array([[1, 2], [3, 3], [4, 1]], np.int32))
    y = Tensor(np.full((3, 1), 3.0, np.float32))
    before = net.emb.embedding_table.asnumpy().copy()
    _, overflow, _ = cell(ids, y)
    assert bool(overflow.asnumpy())                       # the float16 RowTensor overflowed: caught
    np.testing.assert_array_equal(net.emb.embedding_table.asnumpy(), before)
    cell.set_sense_scale(Tensor(np.float32(2.0 ** 10)))
    losses = []
    for _ in range(20):
        loss, overflow, _ = cell(ids, y)
        assert not bool(overflow.asnumpy())
        losses.append(float(loss.asnumpy()))
    assert losses[-1] < losses[0]
    moved = np.flatnonzero((net.emb.embedding_table.asnumpy() != before).any(axis=1))
    np.testing.assert_array_equal(moved, [1, 2, 3, 4])    # only the looked-up rows, unscaled updates


def test_amp_o2_keeps_int_labels(graph_mode):
    net = _Mlp(out=3)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    cell = rb.build_train_network(net, nn.Adam(net.trainable_params(), 0.01), loss, level="O2")
    x, _ = _data()
    label = Tensor((np.abs(x.asnumpy()).argmax(axis=1) % 3).astype(np.int32))
    losses = [float(cell(x, label)[0].asnumpy()) for _ in range(25)]
    assert np.isfinite(losses[-1]) and losses[-1] < max(v for v in losses if np.isfinite(v))


@pytest.mark.slow
def test_amp_o1_follows_mindspore_or_says_why(graph_mode, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # MindSpore's O1 rewrite writes ./rewritten_network/*.py
    net = _Mlp()
    cell = rb.build_train_network(net, nn.SGD(net.trainable_params(), 0.1), nn.MSELoss(), level="O1")
    x, y = _data()
    losses = [float(cell(x, y).asnumpy()) for _ in range(5)]
    assert losses[-1] < losses[0]
    deep = rb.WideDeep(4, 3, 4, (8,), vocab_size=50)      # MindSpore's rewrite cannot parse ops.concat
    with pytest.raises(ValueError, match="amp level 'O1' applies MindSpore's auto_mixed_precision"):
        rb.RecModel(deep, nn.BCEWithLogitsLoss(), nn.Adam(deep.trainable_params()), amp_level="O1").train_network


def test_boost_precedence_is_the_train_steps():
    net = nn.WithLossCell(_Mlp(), nn.MSELoss())
    both = rb.AutoBoost("O1", {"boost": {"mode": "manual", "dim_reduce": True}})
    assert both.boost_config["grad_freeze"] and both.boost_config["dim_reduce"]
    with pytest.raises(ValueError, match="DimReduce|pca"):
        both.network_auto_process_train(net, nn.Momentum(net.trainable_params(), 0.1, 0.9))
    out_net, opt = rb.AutoBoost("O2").network_auto_process_train(net, nn.Momentum(net.trainable_params(), 0.1, 0.9))
    assert isinstance(opt, rb.FreezeOpt) and opt.adasum and isinstance(out_net, rb.LessBN)
    cell = rb.BoostTrainOneStepWithLossScaleCell(out_net, opt, None)
    assert cell.freeze and not cell.enable_adasum        # freezing runs; AdaSum waits (one process)


B, F, DENSE, DIM = 64, 5, 4, 6


def _stream(seed=0):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=DENSE, num_sparse=F, vocab_sizes=[200] * F, batch_size=B)
    for dense, ids, label in stream:
        yield dense, ids, label


_LEVELS = [(boost, amp) for boost in ("O0", "O1", "O2") for amp in ("O0", "O2", "O3")]


@pytest.mark.slow
@pytest.mark.parametrize("boost, amp", _LEVELS)
def test_boost_amp_hash_table_matrix_trains(graph_mode, boost, amp):
    """Every boost level with every amp level trains a hash table, on the live kernel backend."""
    _levels_train_a_table(boost, amp)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["py"], indirect=True)
@pytest.mark.parametrize("boost, amp", [("O0", "O0"), ("O1", "O2"), ("O2", "O3")])
def test_boost_amp_hash_table_matrix_trains_on_the_twins(graph_mode, backend, boost, amp):
    """The matrix's diagonal on the numpy twins (whose every kernel is checked against the compiled one
    elsewhere: the levels do not reach the kernels but through the table)."""
    _levels_train_a_table(boost, amp)


def _levels_train_a_table(boost, amp):
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, 1024, access_threshold=1, input_index=1, seed=0,
                             optimizer=rb.SparseAdam(0.02))
    net = rb.WideDeep(DENSE, F, DIM, (16, 16), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), amp_level=amp,
                        boost_level=boost, boost_config_dict={"grad_freeze": {"param_groups": 2}})
    losses = []

    class Losses(Callback):
        def on_train_step_end(self, run_context):
            out = run_context.original_args().net_outputs       # MindSpore's: the loss, or (loss, overflow, scale)
            losses.append(float((out[0] if isinstance(out, tuple) else out).asnumpy()))

    model.online_train(_stream(), callbacks=[Losses(), StopAfter(60)], dataset_sink_mode=False)
    cell = model.train_network
    assert isinstance(cell, rb.BoostTrainOneStepWithLossScaleCell if boost != "O0" else rb.TrainOneStepWithLossScaleCell)
    assert cell.freeze == (boost != "O0")
    assert len(losses) == 60 and np.isfinite(losses).all()
    # O2's dynamic scale starts at 2**24: its first steps overflow (skipped) until the scale fits
    assert model.overflow_steps <= (12 if amp == "O2" else 0)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.02        # the loss falls
    assert np.isfinite(table.weight).all() and table.cache.stats()["admitted"] > 100


# ---- nothing non-finite enters the model (issue #35 item 4) --------------------------------------------
_OPTIMIZERS = {
    "Adam": lambda params: nn.Adam(params, 0.01),
    "LazyAdam": lambda params: nn.LazyAdam(params, 0.01),
    "SGD": lambda params: nn.SGD(params, 0.1),
    "Momentum": lambda params: nn.Momentum(params, 0.1, 0.9),
    "Adagrad": lambda params: nn.Adagrad(params, learning_rate=0.1),
    "FTRL": lambda params: nn.FTRL(params),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_a_finite_gradient_whose_update_would_overflow_is_skipped(graph_mode, name):
    """Features x1e30: the loss and every gradient are finite (about 1e29), but g * g is Inf in float32, so
    Adam's second moment (and with it the weights) would become Inf/NaN. The step is flagged and changes no
    parameter and no optimizer state (under every optimizer); the next normal step trains as usual."""
    ms.set_seed(0)
    net = nn.WithLossCell(_Mlp(), nn.BCEWithLogitsLoss())
    cell = rb.TrainOneStepWithLossScaleCell(net, _OPTIMIZERS[name](net.trainable_params()), None)
    x, y = _data()
    cell(x, y)
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    huge = Tensor(x.asnumpy() * np.float32(1e30))
    loss, overflow, _ = cell(huge, y)
    assert np.isfinite(loss.asnumpy()).all() and bool(overflow.asnumpy())
    for p in cell.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)
    _, overflow, _ = cell(x, y)
    assert not bool(overflow.asnumpy())
    assert any(not np.array_equal(p.asnumpy(), before[p.name]) for p in cell.get_parameters())
    assert all(np.isfinite(p.asnumpy()).all() for p in cell.get_parameters())


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_ACCUMULATING = {
    "Adagrad": lambda params: nn.Adagrad(params, accum=_FLOAT32_MAX, learning_rate=0.1),
    "ProximalAdagrad": lambda params: nn.ProximalAdagrad(params, accum=_FLOAT32_MAX),
    "FTRL": lambda params: nn.FTRL(params, initial_accum=_FLOAT32_MAX),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_ACCUMULATING))
def test_a_step_that_would_overflow_an_accumulator_is_skipped(graph_mode, name):
    """An accumulator at float32's largest value (as a long run of huge but finite gradients leaves it): a
    normal step keeps it finite (g * g is far below its spacing) and runs; features x1e17 give gradients
    whose T * T is finite (~1e35) but accum + g * g is Inf (the weights would then be NaN for FTRL, frozen
    for Adagrad). The step is flagged and changes no parameter and no optimizer state."""
    ms.set_seed(0)
    net = nn.WithLossCell(nn.Dense(6, 1), nn.BCEWithLogitsLoss())
    optimizer = _ACCUMULATING[name](net.trainable_params())
    cell = rb.TrainOneStepWithLossScaleCell(net, optimizer, None)
    x, y = _data()
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    _, overflow, _ = cell(x, y)
    assert not bool(overflow.asnumpy()) and int(optimizer.global_step.asnumpy()[0]) == 1    # it ran
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    huge = Tensor(x.asnumpy() * np.float32(1e17))
    grads = ms.ops.GradOperation(get_by_list=True)(net, net.trainable_params())(huge, y)
    totals = np.array([np.abs(g.asnumpy()).sum() for g in grads], np.float32)
    assert np.isfinite(totals * totals).all()                       # the gradient check alone lets it pass
    largest = np.abs(grads[0].asnumpy()).max(keepdims=True)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(_FLOAT32_MAX) + largest * largest).all()    # Adagrad's accum would be Inf
    _, overflow, _ = cell(huge, y)
    assert bool(overflow.asnumpy())
    for p in cell.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)


def test_an_ftrl_step_that_would_overflow_linear_is_skipped(graph_mode):
    """FTRL's linear grows by g - sigma * w, sigma = (sqrt(accum + g * g) - sqrt(accum)) / lr: with weights of
    -1e20 (finite) and gradients of ~1e16 (T * T and accum + g * g finite), sigma * w is ~1e39, Inf in float32,
    and the new weights NaN. The step is flagged and changes nothing."""
    ms.set_seed(0)
    net = nn.WithLossCell(nn.Dense(6, 1, weight_init=Tensor(np.full((1, 6), -1e20, np.float32))),
                          nn.BCEWithLogitsLoss())
    cell = rb.TrainOneStepWithLossScaleCell(net, nn.FTRL(net.trainable_params()), None)
    x, y = _data()
    huge = Tensor(x.asnumpy() * np.float32(1e17))
    grads = ms.ops.GradOperation(get_by_list=True)(net, net.trainable_params())(huge, y)
    totals = np.array([np.abs(g.asnumpy()).sum() for g in grads], np.float32)
    assert np.isfinite(totals * totals).all() and (totals * totals < 1e38).all()   # accum + g * g finite too
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    _, overflow, _ = cell(huge, y)
    assert bool(overflow.asnumpy())
    for p in cell.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)


def _dead_column_data():
    """The test data with feature 0 at 0: the weight entry it feeds gets a gradient of exactly 0, so its
    FTRL accumulator stays where it starts."""
    x, y = _data()
    x = x.asnumpy()
    x[:, 0] = 0.0
    return Tensor(x), y


def _assert_unchanged(cell, before):
    for p in cell.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)


def _step_skips_or_trains(cell, inputs, flagged, trained):
    """One step of ``cell`` on ``inputs``: flagged as an overflow exactly when ``flagged``; a flagged step
    changes no parameter of the cell, an unflagged one leaves ``trained`` (a Parameter) finite and changed."""
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    _, overflow, _ = cell(*inputs)
    assert bool(overflow.asnumpy()) == flagged
    if flagged:
        _assert_unchanged(cell, before)
    else:
        assert np.isfinite(trained.asnumpy()).all()
        assert not np.array_equal(trained.asnumpy(), before[trained.name])


@pytest.mark.parametrize("initial_accum", [1e-30, 0.0], ids=["tiny accum", "zero accum"])
def test_an_ftrl_step_whose_new_weight_would_overflow_is_skipped(graph_mode, initial_accum):
    """FTRL's new weight is (l1 sign(linear) - linear) / (accum^q / lr + 2 l2): with l2 = 0, an entry whose
    accumulator is still tiny (1e-30: a divisor of 1e-12) or 0 and whose linear is huge but finite (1e30)
    becomes Inf although the gradients, accumulators and linears all stay finite. The step is flagged and
    changes nothing. Before that, normal steps run, the zero-gradient entry included (linear 0 there
    keeps the weight 0 even over a divisor of 0)."""
    ms.set_seed(0)
    net = nn.WithLossCell(nn.Dense(6, 1), nn.BCEWithLogitsLoss())
    optimizer = nn.FTRL(net.trainable_params(), initial_accum=initial_accum, learning_rate=0.01)
    cell = rb.TrainOneStepWithLossScaleCell(net, optimizer, None)
    x, y = _dead_column_data()
    for _ in range(2):
        _, overflow, _ = cell(x, y)
        assert not bool(overflow.asnumpy())
    assert np.isfinite(net.trainable_params()[0].asnumpy()).all()
    linear = optimizer.linear[0].asnumpy().copy()
    linear[0, 0] = np.float32(1e30)
    optimizer.linear[0].set_data(Tensor(linear))
    before = {p.name: p.asnumpy().copy() for p in cell.get_parameters()}
    _, overflow, _ = cell(x, y)
    assert bool(overflow.asnumpy())
    _assert_unchanged(cell, before)


class _Decay(nn.Cell):
    """A weight decay schedule (a Cell of the global step), constant here."""

    def __init__(self, value):
        super().__init__()
        self.value = Tensor(np.float32(value))

    def construct(self, global_step):
        return self.value * 1.0


@pytest.mark.slow
@pytest.mark.parametrize("decay", ["float", "schedule"])
def test_a_step_whose_weight_decay_would_overflow_is_skipped(graph_mode, decay):
    """Adam adds weight_decay * w to the gradient before squaring it: weights of 1e22 (finite) and a decay
    of 1 give a decayed gradient of 1e22 whose square is Inf (Adam's second moment, then the weights,
    would be Inf/NaN), though the loss's own gradient is small. The step is flagged and changes nothing;
    the same decay on normal weights trains as usual."""
    ms.set_seed(0)
    rate = 1.0 if decay == "float" else _Decay(1.0)
    x, y = _data()
    for init, flagged in ((np.float32(0.1), False), (np.float32(1e22), True)):
        net = nn.WithLossCell(nn.Dense(6, 1, weight_init=Tensor(np.full((1, 6), init, np.float32))),
                              nn.BCEWithLogitsLoss())
        cell = rb.TrainOneStepWithLossScaleCell(net, nn.Adam(net.trainable_params(), 0.01, weight_decay=rate), None)
        _step_skips_or_trains(cell, (x, y), flagged, net.trainable_params()[0])


class _LookupNet(nn.Cell):
    """An nn.EmbeddingLookup(sparse=True) whose rows the loss reads times 0: their RowTensor gradient lists
    the looked-up rows (id 2 twice) with values of exactly 0, whatever the rows hold."""

    def __init__(self, init):
        super().__init__()
        self.emb = nn.EmbeddingLookup(50, 4, param_init=Tensor(np.full((50, 4), init, np.float32)), sparse=True)
        self.dense = nn.Dense(4, 1)

    def construct(self, ids, y):
        return (self.dense(self.emb(ids).sum(1) * 0.0) - y).mean()


_SPARSE_IDS = Tensor(np.array([[1, 2, 2], [3, 4, 1]], np.int32))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["LazyAdam with weight decay", "FTRL from zero accumulators"])
def test_sparse_gradients_are_bounded_as_the_optimizer_applies_them(graph_mode, name):
    """Sparse (RowTensor) gradients of 0: LazyAdam's weight decay adds 1.0 * w to each listed row (rows of 1e22
    square to Inf in its second moment), FTRL from zero accumulators divides a huge linear by 0 there. On
    rows of 0.1 both train (decay moves them; FTRL sets them to 0); with the huge state the step is flagged
    and changes nothing."""
    ms.set_seed(0)
    y = Tensor(np.ones((2, 1), np.float32))
    for huge in (False, True):
        net = _LookupNet(np.float32(1e22) if huge and name.startswith("LazyAdam") else np.float32(0.1))
        if name.startswith("LazyAdam"):
            optimizer = nn.LazyAdam(net.trainable_params(), 0.01, weight_decay=1.0)
        else:
            optimizer = nn.FTRL(net.trainable_params(), initial_accum=0.0, learning_rate=0.01)
        cell = rb.TrainOneStepWithLossScaleCell(net, optimizer, None)
        if huge and not name.startswith("LazyAdam"):
            # the looked-up rows' gradient is 0, so their accumulators stay 0: a linear of 1e30 there would
            # give weights of -1e30 / 0
            linear = optimizer.linear[0].asnumpy().copy()
            linear[:, 0] = np.float32(1e30)
            optimizer.linear[0].set_data(Tensor(linear))
        _step_skips_or_trains(cell, (_SPARSE_IDS, y), huge, net.emb.embedding_table)


@pytest.mark.slow
def test_a_step_that_the_optimizers_loss_scale_would_overflow_is_skipped(graph_mode):
    """An optimizer's own loss_scale divides the gradients it applies (MindSpore's scale_grad): a loss_scale
    of 1e-20 makes gradients of ~1 into ~1e20, whose squares are Inf in Adam's second moment. The step is
    flagged and changes nothing; with loss_scale 1 the same step trains."""
    ms.set_seed(0)
    x, y = _data()
    for loss_scale, flagged in ((1.0, False), (1e-20, True)):
        net = nn.WithLossCell(nn.Dense(6, 1), nn.BCEWithLogitsLoss())
        cell = rb.TrainOneStepWithLossScaleCell(net, nn.Adam(net.trainable_params(), 0.01, loss_scale=loss_scale),
                                                None)
        _step_skips_or_trains(cell, (x, y), flagged, net.trainable_params()[0])


class _SmallAndLarge(nn.Cell):
    """A large weight (above ``_SMALL_GRADIENT`` entries, its gradient's T taken on its own) beside a small
    one ``p`` (taken with the other small gradients in one concatenation) whose gradient is ``(s, -s)``: the
    loss reads ``p[0] * s - p[1] * s``, so its entries cancel in a plain sum."""

    def __init__(self):
        super().__init__()
        self.large = nn.Dense(200, 100)
        self.p = ms.Parameter(Tensor(np.zeros(2, np.float32)), name="p")

    def construct(self, x, s):
        return self.large(x).mean() + (self.p[0] - self.p[1]) * s


def test_small_gradients_checked_together_keep_every_bound(graph_mode):
    """The gradients of small weights are checked in one concatenation (``_TrainStep._small``), the large
    one on its own (a network with sparse gradients, ``_LookupNet``, checks each on its own: MindSpore
    cannot type their concatenation; test_sparse_gradients_are_bounded_as_the_optimizer_applies_them).
    ``p``'s gradient ``(1e30, -1e30)`` sums to 0 but squares to Inf in Adam's second moment:
    the step is flagged and changes nothing. With ``s`` = 1 it trains."""
    ms.set_seed(0)
    net = _SmallAndLarge()
    cell = rb.TrainOneStepWithLossScaleCell(net, nn.Adam(net.trainable_params(), 0.01), None)
    x = Tensor(np.random.default_rng(0).normal(size=(8, 200)).astype(np.float32))
    for s, flagged in ((1e30, True), (1.0, False)):
        _step_skips_or_trains(cell, (x, Tensor(np.float32(s))), flagged, net.p)


def test_row_pooled_is_checked_and_leaves_no_factor_for_unpooled_rows():
    """``row_pooled``: a bool per row input; False gives the rows no factor (nothing for the host to set),
    None every row one."""
    net = nn.WithLossCell(_Mlp(), nn.BCEWithLogitsLoss())
    opt = nn.Adam(net.trainable_params(), 0.01)
    assert rb.TrainOneStepWithLossScaleCell(net, opt, None, row_inputs=(0,), row_pooled=(False,)).row_factors is None
    assert rb.TrainOneStepWithLossScaleCell(net, opt, None, row_inputs=(0,)).row_factors.shape == (1,)
    for bad in ((1,), (True, False), "yes"):
        with pytest.raises(ValueError, match=r"'row_pooled'.*None or a bool per row input \(1\).*but got"):
            rb.TrainOneStepWithLossScaleCell(net, opt, None, row_inputs=(0,), row_pooled=bad)


@pytest.mark.slow
@pytest.mark.parametrize("combiner", [None, "sum"])
def test_recmodel_gives_a_factor_only_to_rows_a_bag_can_reach_twice(graph_mode, combiner):
    """RecModel's train cell: the rows of a table with a combiner are pooled (their gradient factor is set
    each step), a table's without are not (each output row is one id's)."""
    table = rb.HashEmbedding(5, 64, input_index=1, combiner=combiner, optimizer=rb.SparseAdam(0.01), seed=0)
    net = rb.WideDeep(2, 3, 4, (8,), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, (16, 3, 2) if combiner else (16, 3))
    batch = (rng.random((16, 2), dtype=np.float32), ids, (rng.random((16, 1)) < 0.5).astype(np.float32))
    model.online_train([batch], dataset_sink_mode=False)
    assert model.step == 1
    cell = model.train_network
    assert cell.row_pooled == ((combiner is not None),)
    assert (cell.row_factors is None) == (combiner is None)
