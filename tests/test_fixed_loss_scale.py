"""A fixed loss scale as MindSpore users write it: ``FixedLossScaleManager(scale, drop_overflow_update=False)``
with the optimizer's ``loss_scale`` set to the same scale. Compared with ``mindspore.train.Model`` on the same
network and batches: on a dense network, and with a hash table against the same network over
``nn.EmbeddingLookup`` (its rows get the gradient the dense parameters get, unscaled once). A manager and an
optimizer whose scales would divide the gradients twice, or not at all, are refused before anything runs."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

import recboost as rb

BATCH, FIELDS, DIM, VOCAB = 8, 3, 4, 40


class _Net(nn.Cell):
    """ids ``[B, F]`` -> one logit: a lookup cell (a hash table or nn.EmbeddingLookup), then a Dense layer."""

    def __init__(self, lookup, weight):
        super().__init__()
        self.lookup = lookup
        self.dense = nn.Dense(FIELDS * DIM, 1, weight_init=Tensor(weight), bias_init="zeros")

    def construct(self, ids):
        return self.dense(self.lookup(ids).reshape((-1, FIELDS * DIM)))


def _batches(n, seed=0):
    """Each batch's ids distinct (MindSpore's dense gradient and a table's summed row gradient then agree)."""
    rng = np.random.default_rng(seed)
    return [(rng.permutation(VOCAB)[:BATCH * FIELDS].reshape(BATCH, FIELDS).astype(np.int64),
             (rng.random((BATCH, 1)) < 0.4).astype(np.float32)) for _ in range(n)]


def _weight(seed=1):
    return np.random.default_rng(seed).normal(0, 0.3, (1, FIELDS * DIM)).astype(np.float32)


def _dataset(batches):
    return ms.dataset.GeneratorDataset(lambda: iter(batches), ["ids", "label"], shuffle=False)


class _Losses(ms.train.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_step_end(self, run_context):
        out = run_context.original_args().net_outputs
        assert not isinstance(out, (tuple, list))           # the loss alone, as TrainOneStepCell returns it
        self.losses.append(out.asnumpy().copy())


def _dense_net():
    ms.set_seed(0)
    rows = np.random.default_rng(2).normal(0, 0.5, (VOCAB, DIM)).astype(np.float32)
    return _Net(nn.EmbeddingLookup(VOCAB, DIM, param_init=Tensor(rows), target="DEVICE", sparse=False), _weight())


@pytest.mark.parametrize("make_opt", [lambda p, s: nn.Adam(p, 0.05, loss_scale=s),
                                      lambda p, s: nn.SGD(p, 0.5, loss_scale=s)], ids=["adam", "sgd"])
def test_a_dense_network_trains_as_under_model(graph_mode, make_opt):
    """No hash table: RecModel builds what Model builds for the manager (TrainOneStepCell with the scale as
    its sens, the optimizer dividing): losses and every parameter equal Model's, bit for bit."""
    data = _batches(5)
    results = []
    for cls in (ms.train.Model, rb.RecModel):
        net = _dense_net()
        opt = make_opt(net.trainable_params(), 1024.0)
        model = cls(net, nn.BCEWithLogitsLoss(), opt,
                    loss_scale_manager=ms.amp.FixedLossScaleManager(1024.0, drop_overflow_update=False))
        losses = _Losses()
        model.train(1, _dataset(data) if cls is ms.train.Model else data, callbacks=[losses],
                    dataset_sink_mode=False)
        results.append((losses.losses, [p.asnumpy().copy() for p in net.trainable_params()]))
    (want_losses, want), (got_losses, got) = results
    assert len(got_losses) == len(want_losses) == 5
    np.testing.assert_array_equal(np.array(got_losses), np.array(want_losses))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(want[0], _dense_net().trainable_params()[0].asnumpy())     # it trained


def test_hash_table_rows_get_the_gradient_the_dense_parameters_get(graph_mode, backend):
    """A hash table (SparseSGD) in place of nn.EmbeddingLookup (SGD): under RecModel with
    FixedLossScaleManager(1024, drop_overflow_update=False) and SGD(loss_scale=1024), against Model over
    nn.EmbeddingLookup with the same manager and optimizer, from the same rows on the same ids: the losses,
    the Dense layer and every row equal, bit for bit (the rows' gradient is unscaled once, as the dense
    parameters' is)."""
    from mindspore.common.initializer import Normal
    data, lr = _batches(5), 0.5
    table = rb.HashEmbeddingLookup(DIM, ms.int64, Normal(0.5), capacity=64, optimizer=rb.SparseSGD(lr), seed=3)
    vocab = np.arange(VOCAB, dtype=np.int64)
    rb.sparse_lookup(table, vocab)                                   # every id admitted: the vocabulary
    start = table.rows_float32(table.cache.find(vocab))
    hashed = _Net(table, _weight())
    stock = _Net(nn.EmbeddingLookup(VOCAB, DIM, param_init=Tensor(start), target="DEVICE", sparse=False), _weight())
    manager = ms.amp.FixedLossScaleManager(1024.0, drop_overflow_update=False)
    theirs, ours = _Losses(), _Losses()
    ms.train.Model(stock, nn.BCEWithLogitsLoss(), nn.SGD(stock.trainable_params(), lr, loss_scale=1024.0),
                   loss_scale_manager=manager).train(1, _dataset(data), callbacks=[theirs], dataset_sink_mode=False)
    dense = [p for p in hashed.trainable_params() if p is not table.embedding_table]
    model = rb.RecModel(hashed, nn.BCEWithLogitsLoss(), nn.SGD(dense, lr, loss_scale=1024.0),
                        loss_scale_manager=manager)
    model.train(1, data, callbacks=[ours])
    assert len(ours.losses) == len(theirs.losses) == 5
    np.testing.assert_array_equal(np.array(ours.losses), np.array(theirs.losses))
    np.testing.assert_array_equal(hashed.dense.weight.asnumpy(), stock.dense.weight.asnumpy())
    np.testing.assert_array_equal(hashed.dense.bias.asnumpy(), stock.dense.bias.asnumpy())
    rows = table.rows_float32(table.cache.find(vocab))
    np.testing.assert_array_equal(rows, stock.lookup.embedding_table.asnumpy())
    assert not np.array_equal(rows, start)                            # the rows trained
    assert model.step == 5 and isinstance(model.train_network, rb.TrainOneStepWithLossScaleCell)


def _model(optimizer_scale, manager, tables=False, **kwargs):
    from mindspore.common.initializer import Normal
    lookup = rb.HashEmbeddingLookup(DIM, ms.int64, Normal(0.5), capacity=64) if tables else \
        nn.EmbeddingLookup(VOCAB, DIM, target="DEVICE", sparse=False)
    net = _Net(lookup, _weight())
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01, loss_scale=optimizer_scale),
                       loss_scale_manager=manager, **kwargs)


@pytest.mark.parametrize("tables", [False, True], ids=["dense", "hash"])
def test_scales_that_divide_twice_or_not_at_all_are_refused_naming_both(graph_mode, tables):
    """MindSpore's rule (FixedLossScaleManager's docs): without dropping overflow steps the optimizer's
    loss_scale must be the manager's (the optimizer alone divides); with an update cell (dropping, or dynamic)
    the train cell unscales, so the optimizer's must be 1. Anything else is a ValueError at RecModel(...),
    naming the optimizer's loss_scale, the manager's scale and the fix."""
    fixed = rb.FixedLossScaleManager(1024.0, drop_overflow_update=False)
    with pytest.raises(ValueError, match=r"For 'RecModel', the optimizer's 'loss_scale' must be the loss scale of "
                                         r"FixedLossScaleManager\(1024.0, drop_overflow_update=False\), 1024.0 .*"
                                         r"give the optimizer loss_scale=1024.0, or use FixedLossScaleManager\(1024.0, "
                                         r"drop_overflow_update=True\) with the optimizer's loss_scale 1, but got 1.0"):
        _model(1.0, fixed, tables)
    with pytest.raises(ValueError, match=r"the optimizer's 'loss_scale' must be the loss scale .*but got 512.0"):
        _model(512.0, fixed, tables)
    for manager in (rb.FixedLossScaleManager(1024.0, drop_overflow_update=True), ms.amp.FixedLossScaleManager(1024.0),
                    rb.DynamicLossScaleManager(1024.0)):
        with pytest.raises(ValueError, match=r"For 'RecModel', the optimizer's 'loss_scale' must be 1 with "
                                             r"%s\(1024.0\) \(its train cell unscales the gradients: the optimizer "
                                             r"would divide them again\), but got 1024.0" % type(manager).__name__):
            _model(1024.0, manager, tables)
    _model(1024.0, fixed, tables)                                     # the pairs MindSpore documents
    _model(1.0, rb.FixedLossScaleManager(1024.0, drop_overflow_update=True), tables)
    if tables:                      # boost's train cells unscale the gradients themselves: a dropping manager
        with pytest.raises(ValueError, match=r"For 'RecModel', 'loss_scale_manager' must be "
                                             r"FixedLossScaleManager\(1024.0, drop_overflow_update=True\) with the "
                                             r"optimizer's loss_scale 1 at boost_level O1 when the network has hash "
                                             r"tables, but got 'FixedLossScaleManager\(1024.0, "
                                             r"drop_overflow_update=False\)'"):
            _model(1024.0, fixed, tables, boost_level="O1")
