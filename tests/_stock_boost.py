"""Stock ``mindspore.train.Model`` at a boost level, on CPU, beside RecModel: which of a network's
parameters a few steps update (tests of issue #23).

Three things make a stock Model run its boost level for real on CPU, and the tests ask for them:
``metrics`` (without metrics or an eval network Model skips boosting, with a warning); an optimizer
MindSpore can rebuild (its ``OptimizerProcess`` passes Adam an invalid ``kwargs`` key: Momentum here);
and ``less_bn.gc_flag`` False where gradient centralization would select a weight (MindSpore's
Centralization op is Ascend-only). AutoBoost's process-wide singleton is reset for every test
(``conftest._fresh_mindspore_autoboost``). MindSpore's LessBN replaces each head it converts by a new
cell with a copy of its weight and no bias, so its original head parameters are left untrained."""
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn

import recboost as rb


def moved(trainer, make_net, batches, columns, level, config=""):
    """``(every original trainable parameter's name, the names a pass over batches changed)`` under
    ``trainer`` ("mindspore" or "recboost"), at boost ``level`` with ``config``."""
    ms.set_seed(0)
    net = make_net()
    params = list(net.trainable_params())
    before = [p.asnumpy().copy() for p in params]
    names = [p.name for p in params]                    # MindSpore's LessBN renames them (its cell prefix)
    opt = nn.Momentum(params, 0.01, 0.9)
    if trainer == "mindspore":
        model = ms.train.Model(net, nn.BCEWithLogitsLoss(), opt, metrics={"loss": ms.train.Loss()}, boost_level=level,
                               boost_config_dict=config)
        model.train(1, ds.GeneratorDataset(batches, columns, shuffle=False), dataset_sink_mode=False)
    else:
        rb.RecModel(net, nn.BCEWithLogitsLoss(), opt, boost_level=level, boost_config_dict=config).train(1, batches)
    return names, sorted(n for n, p, b in zip(names, params, before) if not np.array_equal(p.asnumpy(), b))
