"""Stand-in for mindrec's DCN datasets: synthetic click rows (ids, weights, label), batched."""
from enum import Enum

import numpy as np
import mindspore.dataset as ds


class DataType(Enum):
    MINDRECORD = 1
    TFRECORD = 2
    H5 = 3


def create_dataset(data_path, train_mode=True, epochs=1, batch_size=16, data_type=DataType.MINDRECORD,
                   target_column=7, rows=160):
    field_size = target_column - 1
    rng = np.random.default_rng(1 if train_mode else 2)
    ids = rng.integers(0, 120, (rows, field_size)).astype(np.int32)
    wts = rng.random((rows, field_size)).astype(np.float32)
    label = ((ids[:, :1] < 40) ^ (rng.random((rows, 1)) < 0.1)).astype(np.float32)
    data = ds.NumpySlicesDataset({"feat_ids": ids, "feat_vals": wts, "label": label}, shuffle=False)
    return data.batch(batch_size, drop_remainder=True).repeat(epochs)
