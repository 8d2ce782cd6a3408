"""Seeded fuzz tests of the files recboost writes and reads back.

Each damaged copy of a file (flipped bits, cuts, zeroed blocks, edited fields, a file removed or
grown) must be refused by one ValueError naming the file, or load bit-exact. Every case derives from
its seed alone (``numpy.random.default_rng(seed)``): a failure names the seed and the damage, and
reruns alone with that seed.
"""
import json
import os

import numpy as np
from mindspore import nn

import recboost as rb


# ---- bundles (RecModel.export) and train-config.json --------------------------------------------------
# A small Wide&Deep is trained and exported on each kernel backend (the bundle's ids and rows come from
# the backend's HashCache): a full bundle, then a delta with new, changed and evicted ids. Each seed
# damages one file of the chain, which is then loaded as a Predictor loads it (the delta, resolved
# through its base, checked against the network) and must be refused by one ValueError naming the
# damaged bundle (and the file, for the files the manifest lists) or give the served state bit for bit.
# train-config.json is damaged the same way and read as a resume (and serve-check) reads it.
BUNDLE_SEEDS = 300
JOB_CONFIG_SEEDS = 400
_BUNDLE_WHERE = "Predictor"


def _bundle_chain(folder):
    """Train, export a full bundle at step 4 and a delta on it at step 8; returns (full, delta, network
    record, table specs)."""
    import _export_worker as worker
    table, net = worker.network(seed=0)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.02))
    stream = rb.SyntheticClickStream(seed=0, num_dense=worker.DENSE, num_sparse=worker.FIELDS,
                                     vocab_sizes=[120] * worker.FIELDS, batch_size=worker.BATCH, drift=20000.0,
                                     with_timestamp=True, rows_per_second=32)
    batches = ({"dense": d, "ids": i, "label": y, "timestamp": t} for d, i, y, t in stream)
    hooks = [rb.EvictHook(evict_time_interval=3)]
    model.online_train(batches, callbacks=hooks + [rb._StopAfter(4)], dataset_sink_mode=False)
    full = model.export(os.path.join(folder, "full"))
    model.online_train(batches, callbacks=hooks + [rb._StopAfter(8)], dataset_sink_mode=False)
    delta = model.export(os.path.join(folder, "delta"), base=full)
    assert np.load(os.path.join(delta, "table-0-evicted.npy")).size and \
        np.load(os.path.join(delta, "table-0-ids.npy")).size
    return full, delta, rb._network_record(net), [rb._table_spec(t) for t in model.tables]


def _bundle_load(path, record, specs):
    """The delta ``path`` resolved and checked as a Predictor does before it changes anything: the served
    state (step, id, per table its ids and weight, the dense parameters' bytes)."""
    state = rb._resolve_bundle(_BUNDLE_WHERE, "directory", path, dense=True)
    against = "the bundle %r ('directory')" % state.directory
    rb._check_specs(_BUNDLE_WHERE, "'network'", state.specs, specs, against)
    rb._check_network(_BUNDLE_WHERE, "'network'", state.network, record, against)
    return {"step": state.manifest["step"], "id": state.id,
            "tables": [(m.ids.tobytes(), m.weight.tobytes()) for m in state.maps],
            "dense": {name: (str(p.dtype), tuple(p.shape), p.asnumpy().tobytes()) for name, p in state.dense.items()}}


def _other_type(rng, value):
    """A JSON value of another type than ``value`` (an int is never given a bool)."""
    kinds = [k for k in ("int", "str", "null", "list", "object", "float", "bool")
             if not (k == "int" and type(value) is int or k == "str" and isinstance(value, str) or
                     k == "null" and value is None or k == "list" and isinstance(value, list) or
                     k == "object" and isinstance(value, dict) or k == "float" and type(value) is float or
                     k == "bool" and isinstance(value, bool))]
    kind = kinds[rng.integers(len(kinds))]
    return {"int": lambda: int(rng.integers(-3, 10 ** 6)), "str": lambda: "x%d" % rng.integers(100),
            "null": lambda: None, "list": lambda: [int(rng.integers(10))], "object": lambda: {"a": 1},
            "float": lambda: float(rng.random()), "bool": lambda: bool(rng.integers(2))}[kind]()


def _any_value(rng, value):
    """``value`` changed: of another type, or (for an int, a str, a bool) another value of its type."""
    if rng.random() < 0.5:
        if type(value) is int:
            return value + int(rng.choice([-1, 1, 7, -(1 << 20)]))
        if isinstance(value, str):
            return value[:-1] + chr(ord(value[-1]) ^ 1) if value else "x"
        if isinstance(value, bool):
            return not value
    return _other_type(rng, value)


def _json_paths(value, at=()):
    """Every (path, value) of a JSON document, containers included (the root excluded)."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found.append((at + (key,), item))
        found.extend(_json_paths(item, at + (key,)))
    return found


def _json_set(document, path, value):
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def _damage_bytes(rng, data):
    """``(kind, damaged bytes)``: bits flipped, a cut, a zeroed block, bytes appended, or a digit of
    the first 128 bytes (a .npy header's shape, a JSON field) changed."""
    kind = ["flip", "cut", "zero", "append", "digit"][rng.integers(5)]
    buf = bytearray(data)
    if kind == "flip":
        for _ in range(rng.integers(1, 4)):
            at = int(rng.integers(len(buf)))
            buf[at] ^= 1 << int(rng.integers(8))
    elif kind == "cut":
        del buf[int(rng.integers(len(buf))):]
    elif kind == "zero":
        at = int(rng.integers(len(buf)))
        n = min(len(buf) - at, int(rng.integers(1, 65)))
        buf[at:at + n] = bytes(n)
    elif kind == "append":
        buf += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
    else:
        digits = [i for i in range(min(128, len(buf))) if 48 <= buf[i] <= 57]
        if digits:
            at = digits[int(rng.integers(len(digits)))]
            buf[at] = ord(str((int(chr(buf[at])) + int(rng.integers(1, 10))) % 10))
    return kind, bytes(buf)


def _assert_refused_naming(exc, names, what):
    assert type(exc) is ValueError, "%s: %s: %s" % (what, type(exc).__name__, exc)
    text = str(exc)
    assert all(name in text for name in names), "%s: the message does not name %s: %s" % (what, names, text)


def test_fuzz_bundle_damage_is_refused_naming_the_file_or_loads_bit_exact(backend, graph_mode, tmp_path):
    full, delta, record, specs = _bundle_chain(str(tmp_path))
    want = _bundle_load(delta, record, specs)
    files = {(folder, name): open(os.path.join(folder, name), "rb").read()
             for folder in (full, delta) for name in sorted(os.listdir(folder))}
    keys = sorted(files)
    outcomes = {}
    for seed in range(BUNDLE_SEEDS):
        rng = np.random.default_rng(seed)
        folder, name = keys[rng.integers(len(keys))]
        path, data = os.path.join(folder, name), files[(folder, name)]
        if name == "manifest.json" and rng.random() < 0.5:     # a field edited, its checksum made again or not
            document = json.loads(data)
            signed = bool(rng.integers(2))
            if signed:
                del document["sha256"]
            fields = _json_paths(document)
            field, value = fields[rng.integers(len(fields))]
            _json_set(document, field, _other_type(rng, value) if signed else _any_value(rng, value))
            kind = "edit %s of %s%s" % (".".join(map(str, field)), name, " (signed)" if signed else "")
            damaged = rb._json_checked_bytes(document) if signed else json.dumps(document).encode()
        elif rng.random() < 0.04:
            kind, damaged = "removed", None
        else:
            kind, damaged = _damage_bytes(rng, data)
        what = "seed %d: %s of %s/%s" % (seed, kind, os.path.basename(folder), name)
        os.chmod(path, 0o644)
        if damaged is None:
            os.remove(path)
        else:
            with open(path, "wb") as fh:
                fh.write(damaged)
        try:
            got = _bundle_load(delta, record, specs)
        except Exception as exc:                      # noqa: BLE001 -- judged below: one ValueError, named
            _assert_refused_naming(exc, [repr(folder)] + ([] if name == "manifest.json" else [repr(name)]), what)
            outcomes["refused"] = outcomes.get("refused", 0) + 1
        else:
            assert got == want, "%s: loaded, but not bit-exact" % what
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
        finally:
            with open(path, "wb") as fh:
                fh.write(data)
    assert outcomes.get("refused", 0) > BUNDLE_SEEDS * 0.9, outcomes
    assert _bundle_load(delta, record, specs) == want                   # restored: loads again


_JOB_CONFIG = {"timestamp_column": None, "data": "/data/days", "model": "widedeep", "batch_size": 2048,
               "capacity": 1 << 20, "access_threshold": 1, "eviction_threshold": 3600, "eviction_policy": "lru",
               "growth": True, "learning_rate": 1e-3, "seed": 0, "boost_level": "O0", "amp_level": "O0",
               "holdout": 2, "admission_counter": None}


def test_fuzz_job_config_damage_is_one_error_naming_the_file(tmp_path):
    """train-config.json damaged in bytes, in a field (its checksum made again or not) or replaced by
    another JSON document: a resume refuses it with one ValueError naming the file, unless it still
    holds exactly the settings it was written with."""
    folder = str(tmp_path)
    rb._job_config_write(folder, dict(_JOB_CONFIG))
    path = os.path.join(folder, "train-config.json")
    with open(path, "rb") as fh:
        data = fh.read()
    refused = 0
    for seed in range(JOB_CONFIG_SEEDS):
        rng = np.random.default_rng(seed)
        pick = rng.random()
        if pick < 0.4:
            document = json.loads(data)
            signed = bool(rng.integers(2))
            if signed:
                del document["sha256"]
            field = list(_JOB_CONFIG)[rng.integers(len(_JOB_CONFIG))]
            document[field] = _any_value(rng, document[field])
            kind = "edit %s%s" % (field, " (signed)" if signed else "")
            damaged = rb._json_checked_bytes(document) if signed else json.dumps(document).encode()
        elif pick < 0.5:
            document = [None, [], 1, "x", {}, {"sha256": "0" * 64}, [dict(_JOB_CONFIG)]][rng.integers(7)]
            signed = isinstance(document, dict) and not document and bool(rng.integers(2))
            kind = "replaced by %r%s" % (document, " (signed)" if signed else "")
            damaged = rb._json_checked_bytes(document) if signed else json.dumps(document).encode()
        else:
            kind, damaged = _damage_bytes(rng, data)
        with open(path, "wb") as fh:
            fh.write(damaged)
        try:
            rb._job_config_check("recboost train", folder, dict(_JOB_CONFIG))
        except Exception as exc:                      # noqa: BLE001 -- judged below: one ValueError, named
            _assert_refused_naming(exc, [path], "seed %d: %s" % (seed, kind))
            refused += 1
        else:
            assert rb._read_json_checked(path, "the job settings") == _JOB_CONFIG, "seed %d: %s: accepted" % (
                seed, kind)
    assert refused > JOB_CONFIG_SEEDS * 0.9
