"""The peak memory of a checkpoint's save and load and of an export, in a process of its own (so its RSS
is theirs): ``python _memory_worker.py OUT_JSON SCRATCH_DIR``. A Wide&Deep over one HashEmbedding of
2^21 rows, 8 + 1 wide, SparseAdam (~230 MB of rows and slots), filled to 90% through prepare + take.
Each phase's peak is VmHWM after a reset (``/proc/self/clear_refs``), or, where the kernel refuses
it, VmRSS sampled every millisecond; its extra is the peak minus the RSS before it. ``cache_state``:
the extra of ``HashCache.state_dict()`` alone, the cache's own part of a load (its arrays are made
from the hash map, sorted by id); ``cache_keys``: that of ``HashCache.keys()``, the ids sorted whole,
which a save and an export no longer hold: they sort them ``KEYS_HELD`` at a time (``keys_held``;
the other fields are looked up a chunk at a time);
``state_read_back``: the state after the load is the one saved, bit for bit. ``restart``: the peak extra
of a new model's load of the checkpoint (a job restarting), ``restart_kept`` the RSS it keeps (its table
and map), ``restart_read_back`` whether its cache state, rows, slots and live flags are the ones saved.
``new_adagrad``, ``adagrad_slots``: what a new SparseAdagrad table adds to the RSS when made, and at
the first use of its slots. ``map``: what a bare ``HashCache`` of ``MAP_ROWS``
rows adds to the RSS once 90% of its rows are admitted (its map, in batches of ``2^16`` ids), and
``map_entry`` the entry's bytes ``bytes_per_row`` counts; ``map_full``: the peak extra of a full one
under an LRU policy while it replaces rows for 4 batches of new ids. ``serve``: the peak extra of a
``Predictor`` starting on the exported bundle (a fresh copy of the network made before),
``serve_tables`` the bytes of the bundle's table files, ``serve_read_back`` whether it predicts as
the model. ``fast_backend``: whether the
compiled kernels ran (the numpy twin's cache has no map). Run with
``MALLOC_MMAP_THRESHOLD_=1048576`` (the test sets it) so that memory freed by one phase is given back
and does not hide the next one's."""
import hashlib
import json
import os
import sys
import threading

import numpy as np
import mindspore as ms
from mindspore import nn

import recboost as rb

ROWS, DIM, FIELDS, DENSE = 1 << 21, 8, 26, 13
MAP_ROWS, BATCH = 1 << 22, 1 << 16      # (a map is capped from 2^22 slots on: _fast._CAPPED_FROM)
KEYS_HELD = 1 << 15                     # a save's range of sorted ids (rb._KEYS_HELD): 1.9M entries in ~58 ranges
ENTRY_CHUNK = 1 << 14                   # ids looked up at a time (rb._ENTRY_CHUNK, 2^16): the buffers are a range and chunks


def _status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _peak_extra(fn):
    """(extra bytes of RSS at the peak of ``fn()`` over the RSS before it, how it was measured)."""
    before = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        peak, done = [before], threading.Event()

        def watch():
            while not done.wait(0.001):
                peak[0] = max(peak[0], _status("VmRSS"))
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        fn()
        done.set()
        thread.join()
        return max(peak[0], _status("VmRSS")) - before, "VmRSS sampled"
    fn()
    return _status("VmHWM") - before, "VmHWM"


def _state_digest(state):
    """The sha256 of a HashCache state's entry arrays (their dtypes and bytes)."""
    sha = hashlib.sha256()
    for field in ("keys", "rows", "counts", "last_seen"):
        sha.update(str(state[field].dtype).encode() + state[field].tobytes())
    return sha.hexdigest()


def _map_figures():
    """(``map``, ``map_full``): the RSS a HashCache's map takes at 90% of its rows, and the peak a full
    LRU table adds while it replaces rows for new ids (a rehash would hold two maps)."""
    ids = np.arange(1, 2 * MAP_ROWS, dtype=np.int64)
    live = int(0.9 * MAP_ROWS)
    cache = rb.HashCache(MAP_ROWS)
    before = _status("VmRSS")
    for lo in range(0, live, BATCH):
        cache.lookup(ids[lo:min(lo + BATCH, live)])
    assert len(cache) == live, len(cache)
    at_90 = _status("VmRSS") - before
    del cache
    cache = rb.HashCache(MAP_ROWS, eviction_policy="lru")
    full = MAP_ROWS - 2                          # (rows 0 and 1 are reserved)
    for lo in range(0, full, BATCH):
        cache.lookup(ids[lo:min(lo + BATCH, full)])
    assert len(cache) == full and cache.stats()["replaced"] == 0, cache.stats()

    def replace():
        for lo in range(full, full + 4 * BATCH, BATCH):
            cache.lookup(ids[lo:lo + BATCH])
            cache.take_replaced()
    extra, _ = _peak_extra(replace)
    assert len(cache) == full and cache.stats()["replaced"] == 4 * BATCH, cache.stats()
    return at_90, extra


def _new_slots():
    """(``new_adagrad``, ``adagrad_slots``): the RSS a new table trained by SparseAdagrad (whose
    accumulators start at 0.1) adds when made, and then at the first use of its slots."""
    before = _status("VmRSS")
    table = rb.HashEmbedding(DIM + 1, ROWS, optimizer=rb.SparseAdagrad(0.01), seed=0, name="adagrad")
    made = _status("VmRSS") - before
    assert table.slots["accum"].min() == np.float32(0.1)
    return made, _status("VmRSS") - before - made


def _model():
    """The worker's model, untrained: ``(model, its table)``."""
    table = rb.HashEmbedding(DIM + 1, ROWS, input_index=1, optimizer=rb.SparseAdam(1e-3), seed=0, name="ids")
    net = rb.WideDeep(DENSE, FIELDS, DIM, (16,), embedding=table)
    return rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3)), table


def main():
    out, scratch = sys.argv[1], sys.argv[2]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    model, table = _model()
    live = int(0.9 * ROWS)
    for lo in range(0, live, 1 << 16):
        table.take(table.prepare(-np.arange(lo + 1, min(lo + (1 << 16), live) + 1, dtype=np.int64)))
    store = table.store
    table_bytes = store.weight.nbytes + sum(a.nbytes for a in store.slots.values()) + store.live.nbytes
    path = os.path.join(scratch, "ckpt.npz")
    model.state_parameters()                     # the train cell is built before anything is measured
    figures = {"rows": ROWS, "width": DIM + 1, "live": len(table.cache), "table_bytes": int(table_bytes)}
    figures["cache_state"], method = _peak_extra(table.cache.state_dict)
    figures["cache_keys"], _ = _peak_extra(table.cache.keys)
    saved = _state_digest(table.cache.state_dict())
    rb._KEYS_HELD = KEYS_HELD                    # (the default, 2^24, would be one range here)
    rb._ENTRY_CHUNK = ENTRY_CHUNK
    figures["keys_held"], figures["entry_chunk"] = KEYS_HELD, ENTRY_CHUNK
    figures["save"], _ = _peak_extra(lambda: model.save_checkpoint(path))
    figures["file_bytes"] = os.path.getsize(path)
    figures["load"], _ = _peak_extra(lambda: model.load_checkpoint(path))
    figures["state_read_back"] = _state_digest(table.cache.state_dict()) == saved
    figures["export"], _ = _peak_extra(lambda: model.export(os.path.join(scratch, "bundle")))
    served, served_table = _model()              # a server starting on the bundle: a fresh copy of the network
    served.state_parameters()
    bundle, serving = os.path.join(scratch, "bundle"), []
    figures["serve"], _ = _peak_extra(lambda: serving.append(rb.Predictor(served.network, bundle)))
    figures["serve_tables"] = sum(os.path.getsize(os.path.join(bundle, name)) for name in os.listdir(bundle)
                                  if name.startswith("table-"))
    state = table.cache.state_dict()
    probe = (np.zeros((2, DENSE), np.float32), np.sort(state["keys"][state["rows"] >= 0])[:2 * FIELDS].reshape(2, -1))
    figures["serve_read_back"] = np.array_equal(serving[0].predict(*probe), model.predict(*probe).asnumpy())
    restarted, its_table = _model()              # a job restarting: a new model loads the checkpoint
    restarted.state_parameters()
    before = _status("VmRSS")
    figures["restart"], _ = _peak_extra(lambda: restarted.load_checkpoint(path))
    figures["restart_kept"] = _status("VmRSS") - before
    figures["restart_read_back"] = _state_digest(its_table.cache.state_dict()) == saved and all(
        np.array_equal(a, b) for a, b in [(its_table.store.weight, store.weight), (its_table.store.live, store.live)]
        + [(its_table.store.slots[name], a) for name, a in store.slots.items()])
    figures["method"] = method
    figures["new_adagrad"], figures["adagrad_slots"] = _new_slots()
    figures["map_rows"], figures["map_entry"] = MAP_ROWS, table.bytes_per_row["cache"]
    figures["map"], figures["map_full"] = _map_figures()
    figures["fast_backend"] = rb.FAST_BACKEND
    with open(out, "w") as fh:
        json.dump(figures, fh)


if __name__ == "__main__":
    main()
