"""Worker of tests/test_equivalence.py: one seeded run of the recboost module found in a given folder.

``python _equivalence_worker.py <folder of recboost.py> <out.npz>``: imports ``recboost`` from that
folder only (the checked-out behaviour reference, or this tree), trains a Wide&Deep (one hash table
with admission, eviction by data time and growth; then the same network at boost O1) on a seeded
synthetic stream, saves a checkpoint and writes what must not change to ``out.npz``: every step's
loss, the dense parameters, the table's state and every member of the checkpoint (its manifest
without the run id, which is random per run). Only public names are used, so any version runs it.
"""
import json
import os
import sys

folder, out = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, folder)
import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.train.callback import Callback  # noqa: E402
import recboost as rb  # noqa: E402

assert os.path.dirname(os.path.abspath(rb.__file__)) == folder, rb.__file__


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, run_context):
        outputs = run_context.original_args().net_outputs
        loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        self.losses.append(float(loss.asnumpy()))


# Fields added to saved state since the reference, with the value that means "trained as before" (a
# table without an eviction policy, with the exact admission counter, with float32 rows): a side that has
# one must hold that value, and it is left out of the comparison.
ADDED = {"eviction_policy": (None, "none"), "lfu_half_life": (3600,), "replaced": (0,), "row_dtype": ("float32",),
         "rounds": (0,), "admission_counter": ("exact",), "sketch_width": (0,), "sketch_depth": (0,),
         "sketch_window": (0,), "sketch_pending": (0,), "aged": (0,), "sketch": ()}     # sketch: an empty array


def _added(key, value):
    """Whether ``key`` is a field added since the reference; it must then hold its old meaning."""
    if key not in ADDED:
        return False
    if isinstance(value, np.ndarray) and value.ndim:
        assert value.size == 0, (key, value)
    else:
        assert np.asarray(value).item() in ADDED[key], (key, value)
    return True


def _manifest_without_added(manifest, members):
    for table in manifest["tables"]:
        for key in [k for k in table if k in ADDED and _added(k, table[k])]:
            del table[key]
        for key in [k for k in table["cache"] if k in ADDED and _added(k, members[table["cache"][k]])]:
            del table["cache"][key]
        for key in [k for k in table.get("settings", {}) if _added(k, table["settings"][k])]:
            del table["settings"][key]
    return manifest


def run(level, tag, results):
    ms.set_seed(0)
    table = rb.HashEmbedding(9, 256, access_threshold=1, eviction_threshold=600, use_dynamic_expansion=True,
                             input_index=1, seed=1, name="ids", optimizer=rb.SparseAdam(0.01))
    net = rb.WideDeep(4, 6, 8, (32, 16), embedding=table)       # rows: 8 deep + 1 wide
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), boost_level=level)
    stream = rb.SyntheticClickStream(seed=3, num_dense=4, num_sparse=6, batch_size=256, with_timestamp=True,
                                     num_batches=30, rows_per_second=8)
    batches = [{"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in stream]
    losses = Losses()
    model.online_train(batches, callbacks=[losses, rb.EvictHook(evict_time_interval=300)], dataset_sink_mode=False)
    results[tag + "losses"] = np.array(losses.losses)
    for p in net.trainable_params():
        results[tag + "param:" + p.name] = p.asnumpy()
    state = table.state_dict()
    results[tag + "table"] = state["table"]
    for group in ("slots", "cache"):
        for key, value in state[group].items():
            if not (group == "cache" and _added(key, value)):
                results["%s%s:%s" % (tag, group, key)] = np.asarray(value)
    path = os.path.join(os.path.dirname(os.path.abspath(out)), tag + "checkpoint.npz")
    model.save_checkpoint(path)
    with np.load(path) as data:
        members = {name: data[name] for name in data.files}
    manifest = _manifest_without_added(json.loads(members.pop("manifest").tobytes().decode()), members)
    manifest.pop("run")
    if manifest["format"] == 4:                   # format 3 with checksums (issue 35): compare the rest
        assert sorted(manifest.pop("members")) == sorted(members) and len(manifest.pop("sha256")) == 64
        manifest["format"] = 3
    results[tag + "ckpt:manifest"] = np.array(json.dumps(manifest, sort_keys=True))
    for name, value in members.items():
        field = name.rsplit(".", 1)[1]
        if not (".cache." in name and field in ADDED and _added(field, value)):
            results[tag + "ckpt:" + name] = value


def main():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    results = {}
    run("O0", "O0:", results)
    run("O1", "O1:", results)
    np.savez(out, **results)


if __name__ == "__main__":
    main()
