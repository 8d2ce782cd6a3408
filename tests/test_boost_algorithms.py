"""The boost algorithms on CPU in GRAPH mode, checked against numpy."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

import recboost as rb
from _stock_boost import moved


class MLP(nn.Cell):
    def __init__(self, seed=0, sizes=(8, 16, 16, 1)):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.layers = nn.CellList([
            nn.Dense(a, b, weight_init=Tensor(rng.normal(0, 0.3, (b, a)).astype(np.float32)),
                     bias_init=Tensor(rng.normal(0, 0.1, b).astype(np.float32)))
            for a, b in zip(sizes[:-1], sizes[1:])])

    def construct(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = ops.relu(x)
        return x


def _data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    return rng.random((n, 8), np.float32), rng.random((n, 1), np.float32)


def _values(cell):
    return {p.name: p.asnumpy().copy() for p in cell.trainable_params()}


def test_freeze_steps_skip_frozen_groups(graph_mode):
    net = nn.WithLossCell(MLP(), nn.MSELoss())
    opt = nn.SGD(net.trainable_params(), 0.1)
    groups = rb.GradientFreeze(3, 1, 0.5, 10).split_parameters_groups(net, 3)
    # MindSpore's layer rule gives 2 layer groups here: (w, b, w, b), (w, b)
    assert len(groups) == 2
    assert [p.name for p in groups[0]] == [p.name for p in net.trainable_params()]
    assert [p.name for p in groups[1]] == ["layers.2.weight", "layers.2.bias"]
    fopt = rb.FreezeOpt(opt, groups, [1, 0])
    cell = rb.BoostTrainOneStepCell(net, fopt)
    x, y = map(Tensor, _data())
    for names in (["layers.2.weight", "layers.2.bias"], [p.name for p in net.trainable_params()]):
        before = _values(net)
        cell(x, y)
        after = _values(net)
        changed = sorted(n for n in before if not np.array_equal(before[n], after[n]))
        assert changed == sorted(names)
    # a frozen step's update equals an SGD step on its group only
    reference = nn.WithLossCell(MLP(), nn.MSELoss())
    ms.load_param_into_net(reference, {n: ms.Parameter(Tensor(v), n) for n, v in after.items()})
    grads = ops.GradOperation(get_by_list=True)(reference, ms.ParameterTuple(reference.trainable_params()))(x, y)
    cell(x, y)  # index 1 again (the schedule repeats)
    for p, g in zip(reference.trainable_params(), grads):
        want = p.asnumpy() - 0.1 * g.asnumpy() if p.name.startswith("layers.2") else p.asnumpy()
        np.testing.assert_allclose(_values(net)[p.name], want, rtol=1e-5, atol=1e-6)


def test_mindspore_stride_zero_is_fixed():
    """Fewer layer groups than freeze groups (the default 10 on any Wide&Deep): MindSpore's stride 0 makes
    every freeze group "all parameters", so its freezing freezes nothing while building 10 graphs; here
    there is one freeze point per layer group."""
    from mindspore.boost.grad_freeze import GradientFreeze as MsGradientFreeze
    net = nn.WithLossCell(MLP(sizes=(8, 8, 8, 8, 1)), nn.MSELoss())        # 2 layer groups
    everything = [p.name for p in net.trainable_params()]
    theirs = MsGradientFreeze(10, 1, 0.7, 100).split_parameters_groups(net, 10)
    assert [[p.name for p in g] for g in theirs] == [everything] * 10
    groups = rb.GradientFreeze(10, 1, 0.7, 100).split_parameters_groups(net, 10)
    assert [[p.name for p in g] for g in groups] == [everything, everything[4:]]


def _sgd_step_on(net_seed, x, y, lr):
    ref = nn.WithLossCell(MLP(net_seed), nn.MSELoss())
    grads = ops.GradOperation(get_by_list=True)(ref, ms.ParameterTuple(ref.trainable_params()))(Tensor(x), Tensor(y))
    return {p.name: p.asnumpy() - lr * g.asnumpy() for p, g in zip(ref.trainable_params(), grads)}


@pytest.mark.slow
def test_gradient_accumulation_equals_concatenated_batch(graph_mode):
    x, y = _data(48)
    want = _sgd_step_on(3, x, y, 0.05)
    # through AutoBoost (MindSpore's manual grad_accumulation crashes)
    net = nn.WithLossCell(MLP(3), nn.MSELoss())
    cell = rb._boost_train_cell(net, nn.SGD(net.trainable_params(), 0.05), "O0",
                                {"boost": {"mode": "manual", "grad_accumulation": True},
                                 "grad_accumulation": {"grad_accumulation_step": 3}})
    assert cell.use_grad_accumulation and cell.max_accumulation_step == 3
    start = _values(net)
    for i in range(2):
        cell(Tensor(x[16 * i:16 * (i + 1)]), Tensor(y[16 * i:16 * (i + 1)]))
        assert all(np.array_equal(start[n], v) for n, v in _values(net).items())  # no update yet
    cell(Tensor(x[32:]), Tensor(y[32:]))
    for name, value in _values(net).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6)
    # the standalone cell
    net2 = nn.WithLossCell(MLP(3), nn.MSELoss())
    opt2 = nn.SGD(net2.trainable_params(), 0.05)
    acc = rb.GradientAccumulation(3, opt2)
    grad = ops.GradOperation(get_by_list=True)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net, self.acc, self.weights = net2, acc, opt2.parameters

        def construct(self, a, b):
            return self.acc(self.net(a, b), grad(self.net, self.weights)(a, b))

    step = Step()
    for i in range(3):
        step(Tensor(x[16 * i:16 * (i + 1)]), Tensor(y[16 * i:16 * (i + 1)]))
    for name, value in _values(net2).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6)


def _gc_groups(groups):
    return {tuple(p.name for p in g["params"]): g.get("grad_centralization", False) for g in groups}


def test_grad_centralization_equals_numpy_and_selects_what_mindspore_selects(graph_mode):
    """MindSpore's rule: a grouped optimizer's weights (not bias) get GC, and of those only gradients
    whose shape[1] is a multiple of 16: layers.0.weight ([16, 8]) and an [N, 1] table are left alone."""
    from mindspore.boost.base import OptimizerProcess as MsOptimizerProcess
    net = MLP(4, sizes=(8, 16, 16, 1))
    net.wide = Parameter(Tensor(np.zeros((50, 1), np.float32)), name="wide")
    opt = nn.SGD([{"params": net.trainable_params()}], 0.1)
    process = rb.OptimizerProcess(opt)
    process.add_grad_centralization(net)
    want = MsOptimizerProcess(opt)
    want.add_grad_centralization(net)
    assert _gc_groups(process.origin_params) == _gc_groups(want.origin_params) == {
        ("wide", "layers.0.weight", "layers.1.weight", "layers.2.weight"): True,
        ("layers.0.bias", "layers.1.bias", "layers.2.bias"): False}
    new_opt = process.generate_new_optimizer()
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=p.shape).astype(np.float32) for p in new_opt.parameters]
    before = [p.asnumpy().copy() for p in new_opt.parameters]
    new_opt(tuple(Tensor(g) for g in grads))
    for p, b, g in zip(new_opt.parameters, before, grads):
        centralized = p.name in ("layers.1.weight", "layers.2.weight")       # shape[1] == 16
        want_g = g - g.mean(axis=1, keepdims=True) if centralized else g
        np.testing.assert_allclose(p.asnumpy(), b - 0.1 * want_g, rtol=1e-5, atol=1e-6)
        assert np.any(p.asnumpy() != b), p.name                              # every parameter moved


def test_grad_centralization_needs_parameter_groups_as_in_mindspore(graph_mode, capfd):
    net = MLP(4, sizes=(8, 16, 16, 1))
    process = rb.OptimizerProcess(nn.SGD(net.trainable_params(), 0.1))
    process.add_grad_centralization(net)
    assert "only group parameters support gradient centralization" in capfd.readouterr().err
    new_opt = process.generate_new_optimizer()
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=p.shape).astype(np.float32) for p in new_opt.parameters]
    before = [p.asnumpy().copy() for p in new_opt.parameters]
    new_opt(tuple(Tensor(g) for g in grads))
    for p, b, g in zip(new_opt.parameters, before, grads):                  # plain SGD: no GC anywhere
        np.testing.assert_allclose(p.asnumpy(), b - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_parameter_process_keeps_group_options():
    net = MLP()
    params = net.trainable_params()
    origin = [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:4], "lr": 0.5}]
    out = rb.ParameterProcess.generate_group_params(params, origin)
    assert [([p.name for p in g["params"]], {k: v for k, v in g.items() if k != "params"}) for g in out] == [
        (["layers.0.weight", "layers.0.bias"], {"weight_decay": 0.01}),
        (["layers.1.weight", "layers.1.bias"], {"lr": 0.5}),
        (["layers.2.weight", "layers.2.bias"], {"weight_decay": 0.01})]
    assert rb.ParameterProcess.generate_group_params(params[:1], params) == [{"params": params[:1]}]
    process = rb.ParameterProcess()
    process.assign_parameter_group(params, [2, 4])
    assert [p.comm_fusion for p in params] == [1, 1, 2, 2, 3, 3]


def test_less_bn_fn_head(graph_mode):
    body = nn.SequentialCell([nn.Dense(8, 16), nn.ReLU(), nn.Dense(16, 3)])
    weight, bias = body[2].weight.asnumpy(), body[2].bias.asnumpy()
    net = rb.LessBN(body, fn_flag=True)
    assert isinstance(body.cell_list[2], rb._CommonHeadLastFN)
    assert body[2].weight.name == "2.weight"          # parameters (and checkpoint names) kept
    x = np.random.default_rng(0).random((4, 8), np.float32)
    h = np.maximum(body[0](Tensor(x)).asnumpy(), 0)
    want = (h / np.linalg.norm(h, axis=1, keepdims=True)) @ (
        weight / np.linalg.norm(weight, axis=1, keepdims=True)).T + bias
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-6)
    plain = rb.LessBN(nn.SequentialCell([nn.Dense(8, 2)]))
    assert isinstance(plain.network[0], nn.Dense)


def test_group_loss_scale_manager_scales_backward(graph_mode):
    manager = rb.GroupLossScaleManager(8.0, [])
    manager.set_loss_scale_status(2, 8.0)
    assert [float(p.asnumpy()) for p in manager.dynamic_loss_scale] == [1.0, 8.0, 8.0, 1.0]
    assert float(manager.update_loss_scale_status(0, 0.5).asnumpy()) == 4.0

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.Parameter(Tensor(np.float32(2.0)), name="w")
            self.m = manager

        def construct(self, x):
            return (self.m(x * self.w, 1, 3) ** 2).sum()

    net = Net()
    x = Tensor(np.array([1.0, 2.0], np.float32))
    g = ops.GradOperation(get_by_list=True)(net, ms.ParameterTuple([net.w]))(x)[0].asnumpy()
    np.testing.assert_allclose(g, 4.0 * (2 * 2.0 * (1 + 4)))  # scale[1] / scale[3] = 4
    assert manager.get_update_cell() is manager and manager.get_loss_scale() == 8.0


def test_adasum_single_group_applies_delta(graph_mode):
    class Holder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.params = ms.ParameterTuple([ms.Parameter(Tensor(np.ones((2, 3), np.float32)), name="p")])
            self.old = ms.ParameterTuple([ms.Parameter(Tensor(np.full((2, 3), 5.0, np.float32)), name="old")])
            self.adasum = rb.AdaSum(0, 1, 1, self.params)

        def construct(self, delta):
            return self.adasum((delta,), self.params, self.old)

    holder = Holder()
    holder(Tensor(np.full((2, 3), 0.5, np.float32)))
    np.testing.assert_allclose(holder.params[0].asnumpy(), 4.5)
    with pytest.raises(ValueError, match="'group_number' must be a power of 2"):
        rb.AdaSum(0, 1, 3, holder.params)


def test_adasum_rule_numpy():
    # the pairwise rule itself: orthogonal updates add, identical updates average
    a = np.array([1.0, 0.0]); b = np.array([0.0, 2.0])
    rule = lambda a, b: (1 - a @ b / (2 * a @ a)) * a + (1 - a @ b / (2 * b @ b)) * b  # noqa: E731
    np.testing.assert_allclose(rule(a, b), a + b)
    np.testing.assert_allclose(rule(a, a), a)


def test_freeze_groups_share_one_adam_state(graph_mode):
    x, y = map(Tensor, _data())
    net = nn.WithLossCell(MLP(8), nn.MSELoss())
    opt = nn.Adam(net.trainable_params(), 0.01)
    groups = rb.GradientFreeze(2, 0, 0.5, 10).split_parameters_groups(net, 2)
    fopt = rb.FreezeOpt(opt, groups, [0, 1])
    assert fopt.opts[1].moment1[0] is fopt.opts[0].moment1[4]
    assert fopt.opts[1].beta1_power is fopt.opts[0].beta1_power
    cell = rb.BoostTrainOneStepCell(net, fopt)
    ref = nn.WithLossCell(MLP(8), nn.MSELoss())
    ref_cell = nn.TrainOneStepCell(ref, nn.Adam(ref.trainable_params(), 0.01))
    cell(x, y)
    ref_cell(x, y)
    after_one = _values(ref)
    cell(x, y)           # trains layers.2 only, continuing the same Adam moments and step count
    ref_cell(x, y)
    for name, value in _values(ref).items():
        want = value if name.startswith("layers.2") else after_one[name]
        np.testing.assert_allclose(_values(net)[name], want, rtol=1e-5, atol=1e-6)


class _WideDeepZoo(nn.Cell):
    """The model zoo's Wide&Deep shape: an ``[N, 1]`` wide table and an ``[N, 8]`` deep table
    (gathered Parameters), a 48-32-16-1 MLP (the last weight ``[1, 16]``)."""

    def __init__(self, vocab=200, fields=6, dim=8):
        super().__init__()
        rng = np.random.default_rng(0)
        self.wide_w = Parameter(Tensor(rng.normal(0, .01, (vocab, 1)).astype(np.float32)), name="wide_w")
        self.deep_w = Parameter(Tensor(rng.normal(0, .01, (vocab, dim)).astype(np.float32)), name="deep_w")
        self.dense1, self.dense2, self.last = nn.Dense(fields * dim, 32), nn.Dense(32, 16), nn.Dense(16, 1)
        self.gather, self.relu = ops.Gather(), ops.ReLU()

    def construct(self, ids):
        wide = self.gather(self.wide_w, ids, 0).sum(1)
        deep = self.gather(self.deep_w, ids, 0).reshape((ids.shape[0], -1))
        return wide + self.last(self.relu(self.dense2(self.relu(self.dense1(deep)))))


def _zoo_batches(n=12, batch=64, vocab=200, fields=6):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, (batch, fields)).astype(np.int32)
        out.append((ids, ((ids % 7 == 0).sum(1, keepdims=True) > 0).astype(np.float32)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_every_parameter_of_a_wide_and_deep_trains_at_every_boost_level(graph_mode, level):
    """The [N, 1] wide table trains at O1/O2 (gradient centralization leaves shape[1] % 16 != 0 alone,
    as MindSpore does): RecModel updates every trainable parameter. Stock Model at the same level on CPU
    (its GC off: Ascend-only) updates every one it keeps: all but the last layer, whose weight its
    LessBN copies into a new FN head and whose bias it drops."""
    names, ours = moved("recboost", _WideDeepZoo, _zoo_batches(), ["ids", "label"], level)
    _, theirs = moved("mindspore", _WideDeepZoo, _zoo_batches(), ["ids", "label"], level, {"less_bn": {"gc_flag": False}})
    assert ours == sorted(names)
    assert theirs == sorted(n for n in names if not n.startswith("last."))


def _table_model(level, config=None, seed=0):
    """A recboost Wide&Deep whose embeddings are a host hash table, at boost ``level``."""
    ms.set_seed(seed)
    table = rb.HashEmbedding(7, 1024, access_threshold=1, input_index=1, seed=seed, optimizer=rb.SparseAdam(0.02))
    net = rb.WideDeep(4, 5, 6, (16, 16), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), boost_level=level,
                        boost_config_dict=config or "")
    return model, net, table


def _click_batches(n, seed=0):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=4, num_sparse=5, vocab_sizes=[200] * 5, batch_size=64)
    return [next(stream) for _ in range(n)]


def _table_state(table):
    """Every trained number of the table's rows (row, optimizer slots) as a matrix, the optimizer's
    scalars, and which rows hold an id."""
    state = table.state_dict()
    rows = np.concatenate([state["table"]] + list(state["slots"].values()), axis=1)
    return rows, np.array(list(state["scalars"].values())), state["live"].astype(bool)


def _rows_changed(table, before):
    """Whether a step trained the rows that held an id before it (rows admitted by the step are new)."""
    rows, scalars, live = before
    now_rows, now_scalars, _ = _table_state(table)
    return not np.array_equal(now_rows[live], rows[live]) or not np.array_equal(now_scalars, scalars)


@pytest.mark.slow
@pytest.mark.live_backend
def test_gradient_freezing_freezes_network_layers_and_trains_the_hash_tables_every_step(graph_mode, backend):
    """MindSpore's freezing splits the network's trainable Parameters into layer groups; host hash tables
    are not among them (their rows are step inputs), so they train at every freeze index, rows and
    optimizer state alike, while a frozen step leaves the frozen layers alone. (Freezing the tables with
    the first layer group was measured and not taken: see docs/boost.md.)"""
    config = {"grad_freeze": {"param_groups": 2, "freeze_type": 0, "freeze_p": 0.5}}   # indices 0, 1, 0, 1, ...
    model, net, table = _table_model("O1", config)
    cell = model.train_network
    assert all(c.row_inputs == cell.row_inputs for c in cell.freeze_nets) and cell.row_inputs
    later = {p.name for p in cell.optimizer.opts[1].parameters}
    everything = {p.name for p in net.trainable_params()}
    assert later and later < everything
    for k, batch in enumerate(_click_batches(4)):
        before, rows = _values(net), _table_state(table)
        model.online_train([batch], dataset_sink_mode=False)
        after = _values(net)
        changed = {n for n in before if not np.array_equal(before[n], after[n])}
        assert changed == (everything if k % 2 == 0 else later)
        assert _rows_changed(table, rows), k
    assert model.step == 4 and model.overflow_steps == 0


class _Nested(nn.Cell):
    """Dense layers at three depths: direct children, inside a child cell, inside a SequentialCell,
    and a cell holding one Dense only (LessBN converts the last Dense of every cell that holds any)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Dense(8, 16)
        self.b = nn.Dense(16, 16)
        self.block = nn.SequentialCell([nn.Dense(16, 16), nn.ReLU(), nn.Dense(16, 16)])
        self.inner = _OneDense()
        self.head = nn.Dense(16, 1)

    def construct(self, x):
        return self.head(self.inner(self.block(self.b(self.a(x)))))


class _OneDense(nn.Cell):
    def __init__(self):
        super().__init__()
        self.only = nn.Dense(16, 16)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.relu(self.only(x))


def _fn_heads(net):
    return sorted(name for name, cell in net.cells_and_names() if type(cell).__name__.endswith("HeadLastFN"))


def test_less_bn_converts_the_cells_mindspore_converts():
    """fn_flag: the last Dense of every cell holding Dense layers, at every depth (MindSpore's
    ``_convert_to_less_bn_net``); no fn_flag: nothing converted, the network marked."""
    from mindspore.boost.less_batch_normalization import LessBN as MsLessBN
    ms.set_seed(0)
    ours, theirs = _Nested(), _Nested()
    rb.LessBN(ours, fn_flag=True)
    MsLessBN(theirs, fn_flag=True)
    assert _fn_heads(ours) == _fn_heads(theirs) == ["block.2", "head", "inner.only"]
    plain = _Nested()
    rb.LessBN(plain)
    assert _fn_heads(plain) == [] and "less_bn" in plain.get_flags()


@pytest.mark.parametrize("layers,groups", [(12, 4), (12, 3), (9, 2), (12, 6)])
def test_freeze_groups_are_mindspores_when_it_has_a_stride(layers, groups):
    """With at least as many layer groups as freeze groups (MindSpore's stride >= 1), the freeze groups
    are MindSpore's parameter for parameter (its layer rule pairs two Dense layers here: 12 layers, 6 layer
    groups); the stride-0 case is test_mindspore_stride_zero_is_fixed."""
    from mindspore.boost.grad_freeze import GradientFreeze as MsGradientFreeze
    net = nn.WithLossCell(MLP(sizes=(8,) + (8,) * (layers - 1) + (1,)), nn.MSELoss())
    ours = rb.GradientFreeze(groups, 1, 0.7, 100).split_parameters_groups(net, groups)
    theirs = MsGradientFreeze(groups, 1, 0.7, 100).split_parameters_groups(net, groups)
    assert [[p.name for p in g] for g in ours] == [[p.name for p in g] for g in theirs]
    assert len(ours) == groups and len(ours[-1]) < len(ours[0])
