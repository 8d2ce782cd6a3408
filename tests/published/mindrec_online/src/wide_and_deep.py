"""Stand-in for the online example's wide_and_deep.py: the same structure (wide and deep
nn.EmbeddingLookup tables on the same ids, masked by the weights; five dense layers; two losses, the deep
one with an L2 term on the deep table; a complete train cell with FTRL on the wide parameters and Adam on
the deep ones and a fixed loss scale; PredictWithSigmoid), at small sizes with seeded initial values."""
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

_RNG = np.random.default_rng(0)


def _param(shape, name, scale=0.1):
    return Parameter(Tensor(_RNG.normal(0.0, scale, shape).astype(np.float32)), name=name)


class DenseLayer(nn.Cell):
    def __init__(self, input_dim, output_dim, use_activation=True):
        super().__init__()
        self.weight = _param([input_dim, output_dim], "weight")
        self.bias = _param([output_dim], "bias")
        self.matmul = ops.MatMul()
        self.bias_add = ops.BiasAdd()
        self.use_activation = use_activation

    def construct(self, x):
        wx = self.bias_add(self.matmul(x, self.weight), self.bias)
        return ops.relu(wx) if self.use_activation else wx


class WideDeepModel(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.batch_size, self.field_size, self.emb_dim = config.batch_size, config.field_size, config.emb_dim
        dims = [self.field_size * self.emb_dim] + config.deep_layer_dim + [1]
        self.wide_b = _param([1], "Wide_b")
        self.dense_layers = nn.CellList([DenseLayer(dims[i], dims[i + 1], use_activation=i < len(dims) - 2)
                                         for i in range(len(dims) - 1)])
        self.deep_embeddinglookup = nn.EmbeddingLookup(config.vocab_size, self.emb_dim, target="DEVICE",
                                                       sparse=config.sparse,
                                                       param_init=Tensor(_RNG.normal(0, 0.1, (config.vocab_size,
                                                                                             self.emb_dim))
                                                                         .astype(np.float32)))
        self.wide_embeddinglookup = nn.EmbeddingLookup(config.vocab_size, 1, target="DEVICE", sparse=config.sparse,
                                                       param_init=Tensor(_RNG.normal(0, 0.1, (config.vocab_size, 1))
                                                                         .astype(np.float32)))
        self.embedding_table = self.deep_embeddinglookup.embedding_table

    def construct(self, id_hldr, wt_hldr):
        mask = wt_hldr.reshape((self.batch_size, self.field_size, 1))
        wide_out = ((self.wide_embeddinglookup(id_hldr) * mask).sum(1) + self.wide_b).reshape((-1, 1))
        deep = (self.deep_embeddinglookup(id_hldr) * mask).reshape((-1, self.field_size * self.emb_dim))
        for layer in self.dense_layers:
            deep = layer(deep)
        return wide_out + deep, self.embedding_table


class NetWithLossClass(nn.Cell):
    def __init__(self, network, config):
        super().__init__(auto_prefix=False)
        self.network = network
        self.l2_coef = config.l2_coef
        self.loss = ops.SigmoidCrossEntropyWithLogits()

    def construct(self, batch_ids, batch_wts, label):
        predict, embedding_table = self.network(batch_ids, batch_wts)
        log_loss = self.loss(predict, label)
        wide_loss = log_loss.mean()
        deep_loss = log_loss.mean() + self.l2_coef * (embedding_table ** 2).sum() / 2
        return wide_loss, deep_loss


class IthOutputCell(nn.Cell):
    def __init__(self, network, output_index):
        super().__init__()
        self.network = network
        self.output_index = output_index

    def construct(self, x1, x2, x3):
        return self.network(x1, x2, x3)[self.output_index]


class TrainStepWrap(nn.Cell):
    def __init__(self, network, sens=1024.0):
        super().__init__()
        self.network = network
        self.network.set_train()
        params = network.trainable_params()
        self.weights_w = ParameterTuple([p for p in params if "wide" in p.name.lower()])
        self.weights_d = ParameterTuple([p for p in params if "wide" not in p.name.lower()])
        self.optimizer_d = nn.Adam(self.weights_d, learning_rate=3.5e-3, eps=1e-8, loss_scale=sens)
        self.optimizer_w = nn.FTRL(learning_rate=5e-2, params=self.weights_w, l1=1e-8, l2=1e-8, initial_accum=1.0,
                                   loss_scale=sens)
        self.grad_w = ops.GradOperation(get_by_list=True, sens_param=True)
        self.grad_d = ops.GradOperation(get_by_list=True, sens_param=True)
        self.sens = sens
        self.loss_net_w = IthOutputCell(network, output_index=0)
        self.loss_net_d = IthOutputCell(network, output_index=1)
        self.loss_net_w.set_grad()
        self.loss_net_d.set_grad()

    def construct(self, batch_ids, batch_wts, label):
        loss_w, loss_d = self.network(batch_ids, batch_wts, label)
        sens_w = ops.fill(loss_w.dtype, loss_w.shape, self.sens)
        sens_d = ops.fill(loss_d.dtype, loss_d.shape, self.sens)
        grads_w = self.grad_w(self.loss_net_w, self.weights_w)(batch_ids, batch_wts, label, sens_w)
        grads_d = self.grad_d(self.loss_net_d, self.weights_d)(batch_ids, batch_wts, label, sens_d)
        return ops.depend(loss_w, self.optimizer_w(grads_w)), ops.depend(loss_d, self.optimizer_d(grads_d))


class PredictWithSigmoid(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network
        self.sigmoid = ops.Sigmoid()

    def construct(self, batch_ids, batch_wts, labels):
        logits, _ = self.network(batch_ids, batch_wts)
        return logits, self.sigmoid(logits), labels
