"""Stand-in for mindrec's Wide&Deep datasets (our code): synthetic click rows (feat_ids, feat_vals, label) in
batches of ``batch_size`` whose ids are distinct within each batch (drawn from a vocabulary of ``vocab`` ids
without replacement), where MindSpore's CPU sparse FTRL and LazyAdam kernels, which apply an id's repeats one
by one, and a table's gradient summed per id agree."""
from enum import Enum

import numpy as np
import mindspore.dataset as ds

VOCAB = 100


class DataType(Enum):
    MINDRECORD = 1
    TFRECORD = 2
    H5 = 3


def create_dataset(data_path, train_mode=True, epochs=1, batch_size=16, data_type=DataType.MINDRECORD,
                   line_per_sample=1, rank_size=None, rank_id=None, field_size=4, batches=10):
    rng = np.random.default_rng(1 if train_mode else 2)
    ids = np.concatenate([rng.permutation(VOCAB)[:batch_size * field_size].reshape(batch_size, field_size)
                          for _ in range(batches)]).astype(np.int32)
    wts = rng.random(ids.shape).astype(np.float32)
    label = ((ids[:, :1] < 40) ^ (rng.random((ids.shape[0], 1)) < 0.1)).astype(np.float32)
    data = ds.NumpySlicesDataset({"feat_ids": ids, "feat_vals": wts, "label": label}, shuffle=False)
    return data.batch(batch_size, drop_remainder=True).repeat(epochs)
