"""Boost levels train everything they should (issue #23): at O0, O1 and O2, every trainable parameter
and every hash-table row that got a gradient changes after a few steps, on a Wide&Deep and a DeepFM
whose embeddings are host hash tables (an [N, 1] wide column, a [k, 1] last layer), a model of three
tables, and a network with BatchNorm; where stock MindSpore runs the level on CPU (plain networks),
``mindspore.train.Model`` updates the same parameters."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops

import recboost as rb
from _stock_boost import moved
from test_feature_sets import _spec_model, _spec_stream

LEVELS = ["O0", "O1", "O2"]


def _untrained_rows(table):
    """Per id the table holds: whether its row still equals the id's initial row."""
    cache = table.cache.state_dict()
    fresh = np.empty((cache["keys"].size, table.embedding_size), np.float32)
    rb.init_rows(np.ascontiguousarray(cache["keys"], np.int64), table.seed, float(table.init_stddev), fresh)
    return (table.weight[cache["rows"]] == fresh).all(axis=1)


def _click(num_sparse=5, n=1, seed=0):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=4, num_sparse=num_sparse, vocab_sizes=[300] * num_sparse,
                                     batch_size=64)
    return [next(stream) for _ in range(n)]


def _wide_deep():
    table = rb.HashEmbedding(7, 1024, access_threshold=1, input_index=1, seed=0, optimizer=rb.SparseAdam(0.02))
    return rb.WideDeep(4, 5, 6, (16, 16), embedding=table), [table], _click()


def _deepfm():
    table = rb.HashEmbedding(7, 1024, access_threshold=1, input_index=1, seed=0, optimizer=rb.SparseAdam(0.02))
    return rb.WideDeep(4, 5, 6, (16, 16), embedding=table, deepfm=True), [table], _click()


def _three_tables():
    tables, model = _spec_model()
    return model.network, list(tables), list(_spec_stream(n=1))


NETWORKS = {"wide_deep": _wide_deep, "deepfm": _deepfm, "three_tables": _three_tables}


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_every_parameter_and_every_row_with_a_gradient_trains(graph_mode, network, level):
    """The same batch six times (the first step of every freeze schedule trains all layers): every
    trainable parameter moved, and so did the row of every id the tables admitted."""
    ms.set_seed(0)
    net, tables, batch = NETWORKS[network]()
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), boost_level=level)
    model.online_train(batch * 6, dataset_sink_mode=False)
    assert model.step == 6 and model.overflow_steps == 0
    now = {p.name: p.asnumpy() for p in net.trainable_params()}    # O1/O2 add LessBN's FN multiplier
    assert sorted(n for n, v in before.items() if np.array_equal(now[n], v)) == []
    for table in tables:
        assert table.cache.stats()["admitted"] > 0
        assert not _untrained_rows(table).any(), table.table_name


class _BatchNormNet(nn.Cell):
    """Dense (no bias: BatchNorm's mean would cancel it) -> BatchNorm -> ReLU -> Dense -> [16, 1] last layer:
    BN's gamma/beta are left out of gradient centralization, the [16, 1] weight has shape[1] = 1."""

    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(8, 32, has_bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.dense2 = nn.Dense(32, 16)
        self.last = nn.Dense(16, 1)

    def construct(self, x):
        return self.last(ops.relu(self.dense2(ops.relu(self.bn(self.dense1(x))))))


def _plain_batches(n=6):
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        x = rng.standard_normal((32, 8)).astype(np.float32)
        out.append((x, (x[:, :1] + x[:, 1:2] > 0).astype(np.float32)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_batchnorm_network_trains_the_parameters_stock_model_trains(graph_mode, level):
    """RecModel updates every parameter at every level; stock Model (really boosting: see _stock_boost)
    every one it keeps: at O1/O2 its LessBN replaces the last layer by a new FN head."""
    names, ours = moved("recboost", _BatchNormNet, _plain_batches(), ["x", "label"], level)
    _, theirs = moved("mindspore", _BatchNormNet, _plain_batches(), ["x", "label"], level, {"less_bn": {"gc_flag": False}})
    assert ours == sorted(names)
    assert theirs == sorted(n for n in names if level == "O0" or not n.startswith("last."))
