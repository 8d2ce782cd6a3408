"""Serving in a fresh process (tests/test_export.py): build the network afresh, load a bundle with
recboost.Predictor, predict the inputs of an .npz file and save the outputs.

    python tests/_export_worker.py BUNDLE INPUTS.npz OUT.npz [DELTA ...]

``network(seed)`` is the network the tests train and export (imported by test_export.py too); the
seed only changes the fresh copy's initial values, which the bundle replaces.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402

import recboost as rb  # noqa: E402

BATCH, FIELDS, DENSE, DIM = 64, 5, 4, 6


def network(seed=0, capacity=32, access=1, evict=6, dim=DIM, hidden=(8,), num_dense=DENSE, policy=None,
            row_dtype="float32", deepfm=False, cls=None):
    """``(table, net)``: a WideDeep (DeepFM with ``deepfm``; of the class ``cls``, a WideDeep's subclass,
    when given) over one HashEmbedding (admission, eviction on) that grows, or with an eviction
    ``policy`` stays at ``capacity``; its rows stored as ``row_dtype``."""
    ms.set_seed(seed)
    table = rb.HashEmbedding(dim + 1, capacity, access_threshold=access, eviction_threshold=evict,
                             use_dynamic_expansion=policy is None, max_unique=BATCH * FIELDS + 1, input_index=1,
                             seed=seed, name="ids", optimizer=rb.SparseAdam(0.02), eviction_policy=policy,
                             row_dtype=row_dtype)
    return table, (cls or rb.WideDeep)(num_dense, FIELDS, dim, hidden, embedding=table, deepfm=deepfm)


def main(argv):
    bundle, inputs, out = argv[:3]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    _, net = network(seed=12345)
    predictor = rb.Predictor(net, bundle)
    for delta in argv[3:]:
        predictor.apply(delta)
    with np.load(inputs) as data:
        result = predictor.predict(data["dense"], data["ids"])
    np.savez(out, out=result, fast=np.array(rb.FAST_BACKEND), bundle_id=np.array(predictor.bundle_id))


if __name__ == "__main__":
    main(sys.argv[1:])
