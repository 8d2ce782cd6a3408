"""Stand-in for mindrec's deep_and_cross.py: the same structure (an embedding lookup by Gather, masked
by the weights; cross layers x_{l+1} = x_0 x_l^T w + b + x_l; a deep MLP; a dense head on both; the loss
cell, a complete train cell with Adam and a fixed loss scale, and PredictWithSigmoid returning
(logits, probabilities, labels)), at small sizes and with seeded initial values."""
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

_RNG = np.random.default_rng(0)


def _param(shape, name, scale=0.1):
    return Parameter(Tensor(_RNG.normal(0.0, scale, shape).astype(np.float32)), name=name)


class DenseLayer(nn.Cell):
    def __init__(self, input_dim, output_dim, act=True):
        super().__init__()
        self.weight = _param([input_dim, output_dim], "weight")
        self.bias = _param([output_dim], "bias")
        self.matmul = ops.MatMul()
        self.bias_add = ops.BiasAdd()
        self.act = act

    def construct(self, x):
        wx = self.bias_add(self.matmul(x, self.weight), self.bias)
        return ops.relu(wx) if self.act else wx


class CrossLayer(nn.Cell):
    def __init__(self, cross_col_dim):
        super().__init__()
        self.cross_weight = _param([cross_col_dim, 1], "weight")
        self.cross_bias = _param([cross_col_dim, 1], "bias")
        self.expand_dims = ops.ExpandDims()
        self.squeeze = ops.Squeeze(2)

    def construct(self, inputs, x_0):
        x_0 = self.expand_dims(x_0, 2)
        x_l = self.expand_dims(inputs, 2)
        x_lw = ops.tensor_dot(x_l, self.cross_weight, ((1,), (0,)))
        return self.squeeze(ops.matmul(x_0, x_lw) + self.cross_bias + x_l)


class EmbeddingLookup(nn.Cell):
    def __init__(self, vocab_size, embedding_size):
        super().__init__()
        self.embedding_size = embedding_size
        self.embedding_table = _param([vocab_size, embedding_size], "embedding_table", embedding_size ** -0.5)
        self.gather = ops.Gather()

    def construct(self, input_ids):
        flat = self.gather(self.embedding_table, input_ids.reshape((-1,)), 0)
        return flat.reshape(input_ids.shape + (self.embedding_size,)), self.embedding_table


class DeepCrossModel(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.batch_size, self.field_size, self.emb_dim = config.batch_size, config.field_size, config.emb_dim
        input_size = self.field_size * self.emb_dim
        self.deep_embeddinglookup = EmbeddingLookup(config.vocab_size, self.emb_dim)
        self.cross_layers = nn.CellList([CrossLayer(input_size) for _ in range(config.cross_layer_num)])
        self.dense_layer_1 = DenseLayer(input_size, config.deep_layer_dim[0])
        self.dense_layer_2 = DenseLayer(config.deep_layer_dim[0], config.deep_layer_dim[1])
        self.dense_layer_3 = DenseLayer(input_size + config.deep_layer_dim[1], 1, act=False)
        self.concat = ops.Concat(axis=1)

    def construct(self, id_hldr, wt_hldr):
        mask = wt_hldr.reshape((self.batch_size, self.field_size, 1))
        deep_id_embs, _ = self.deep_embeddinglookup(id_hldr)
        input_x = (deep_id_embs * mask).reshape((-1, self.field_size * self.emb_dim))
        d_2 = self.dense_layer_2(self.dense_layer_1(input_x))
        c = input_x
        for layer in self.cross_layers:
            c = layer(c, input_x)
        return self.dense_layer_3(self.concat((d_2, c)))


class NetWithLossClass(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.loss = ops.SigmoidCrossEntropyWithLogits()
        self.network = network

    def construct(self, batch_ids, batch_wts, label):
        return self.loss(self.network(batch_ids, batch_wts), label).mean()


class TrainStepWrap(nn.Cell):
    def __init__(self, network, lr=0.05, eps=1e-8, loss_scale=1000.0):
        super().__init__(auto_prefix=False)
        self.network = network
        self.network.set_grad()
        self.network.set_train()
        self.weights = ParameterTuple(network.trainable_params())
        self.optimizer = nn.Adam(self.weights, learning_rate=lr, eps=eps, loss_scale=loss_scale)
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.sens = loss_scale

    def construct(self, batch_ids, batch_wts, label):
        loss = self.network(batch_ids, batch_wts, label)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.weights)(batch_ids, batch_wts, label, sens)
        return ops.depend(loss, self.optimizer(grads))


class PredictWithSigmoid(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network
        self.sigmoid = ops.Sigmoid()

    def construct(self, batch_ids, batch_wts, labels):
        logits = self.network(batch_ids, batch_wts)
        return logits, self.sigmoid(logits), labels
