"""Cost of the table optimizers' schedules, clipping and decay (issue #39 item 2), kernel by kernel.

Each fused update (``sparse_{sgd,adagrad,rowwise_adagrad,adam,ftrl}_update``) on a 1M-row table, dim 16,
53K skewed ids per step (~12K distinct rows; hot rows recur, as in training), timed interleaved (ABBA)
in one process, as ratios:

- ``off / before``: this tree's kernel with every option off against the kernel before the options
  (the compiled module of the tree ``RECBOOST_BENCH_BEFORE`` names, e.g. a checkout of main with its
  ``_recboost_fast`` built; loaded beside this one). Target: <= 1.02 (the options cost nothing when off).
  Without ``RECBOOST_BENCH_BEFORE`` this row is left out.
- ``on / off``: clip by value and by norm, L2 decay into the gradient and decoupled decay all on
  (FTRL: the two clips and L2 decay), against the same kernel with them off: what the options cost when used.
- ``schedule / constant``: ``SparseAdam.update`` with an ``nn.ExponentialDecayLR`` (one host call of the
  schedule Cell per step, on an int32 Tensor [step], as ``Optimizer.get_lr`` calls it) against a constant
  rate: the host cost of a schedule per table per step. ``cosine_schedule / constant``: the same with an
  ``nn.CosineDecayLR``, which a table calls once for 256 steps (``_RATE_AHEAD_SCHEDULES``).

Every pair is checked to compute the same bits where it should (``off`` against ``before``).

``test_bfloat16_update_kernels``: each fused update on bfloat16 rows (a uint16 table: each touched row
decoded, stepped and rounded back in one pass, a block of 16 rows at a time) against the same work in
three passes (``bf16_decode`` of the touched rows, their slots gathered, the float32 kernel on the
compact copies, the slots scattered back, ``bf16_encode``: the same bits, checked) and against the same
kernel on float32 rows (the update without rounding: its limit), on a ``BF16_ROWS``-row table (2^24; quick
2^20), dim 16, 53K uniform ids per step (the cache-miss worst case), interleaved (ABBA). Ratios
``fused / three_passes`` and ``fused / float32``.

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_table_optimizers.py -k bfloat16

    RECBOOST_BENCH_BEFORE=/path/to/main-checkout \\
        .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_table_optimizers.py
        (RECBOOST_BENCH_QUICK=1: a 100k-row table, fewer rounds)
"""
import importlib.machinery
import importlib.util
import glob
import os
import sys

import numpy as np
from mindspore import nn

import recboost as rb
from _harness import AB, QUICK, compare, interleaved, record

BATCH, FIELDS, DIM = 2048, 26, 16
ROWS = 100_000 if QUICK else 1_000_000
ROUNDS = 5 if QUICK else 15
BF16_ROWS = 1 << (20 if QUICK else 24)
PREP = {"clip_value": np.float32(1.0), "clip_norm": np.float32(2.0), "weight_decay": np.float32(1e-4),
        "decay": np.float32(1e-5)}


def _before_module():
    """The compiled kernels of the tree ``RECBOOST_BENCH_BEFORE`` names (None without it), loaded under
    their own name beside this tree's (an extension module loads from its file path)."""
    tree = os.environ.get("RECBOOST_BENCH_BEFORE")
    if not tree:
        return None
    found = glob.glob(os.path.join(tree, "_recboost_fast*.so"))
    if not found:
        raise RuntimeError("RECBOOST_BENCH_BEFORE=%r holds no built _recboost_fast*.so" % tree)
    mine = sys.modules.pop("_recboost_fast", None)
    try:
        loader = importlib.machinery.ExtensionFileLoader("_recboost_fast", found[0])
        spec = importlib.util.spec_from_file_location("_recboost_fast", found[0], loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    finally:
        if mine is not None:
            sys.modules["_recboost_fast"] = mine
    return module


def _state(rng, rows=ROWS):
    w = rng.standard_normal((rows, DIM)).astype(np.float32) * np.float32(0.1)
    return {"w": w, "a": np.full((rows, DIM), 0.1, np.float32), "m": np.zeros((rows, DIM), np.float32),
            "v": np.zeros((rows, DIM), np.float32), "r": np.full((rows, 1), 0.1, np.float32)}


def _call(k, kind, s, batch, acc, prep):
    """One fused update of ``kind`` with kernels ``k`` (a module or namespace) on state ``s``; ``prep``:
    the options' keywords (None: the call the kernels before the options took)."""
    f = np.float32
    uniq, inverse, grad = batch
    extra = dict(prep or {})
    if kind == "sgd":
        k.sparse_sgd_update(s["w"], uniq, inverse, grad, acc, f(0.01), **extra)
    elif kind == "adagrad":
        k.sparse_adagrad_update(s["w"], s["a"], uniq, inverse, grad, acc, f(0.01), **extra)
    elif kind == "rowwise":
        k.sparse_rowwise_adagrad_update(s["w"], s["r"], uniq, inverse, grad, acc, f(0.01), f(1e-8), **extra)
    elif kind == "adam":
        k.sparse_adam_update(s["w"], s["m"], s["v"], uniq, inverse, grad, acc, f(1e-3), f(0.9), f(0.999),
                             f(1) - f(0.9), f(1) - f(0.999), f(1e-8), **extra)
    else:
        extra = {key: value for key, value in extra.items() if key != "decay"}      # (no decoupled decay)
        k.sparse_ftrl_update(s["w"], s["a"], s["m"], uniq, inverse, grad, acc, f(0.01), f(-0.5), f(0.0),
                             f(0.0), **extra)


def test_table_optimizer_kernels(benchmark):
    """Per kernel: off / before (when a before tree is given), on / off; the Adam kernel's is the
    benchmark's contender (``compare``), the others timed ``interleaved``."""
    fast = rb                    # the live backend's kernels (compiled when built), bound in recboost
    before = _before_module()
    rng = np.random.default_rng(0)
    n = BATCH * FIELDS
    batches = []
    for _ in range(4):
        ids = np.minimum(rng.zipf(1.1, n), ROWS - 1).astype(np.int32)
        uniq, inverse = fast.unique_inverse(ids, np.full(ROWS, -1, np.int32))
        batches.append((uniq, inverse, rng.standard_normal((n, DIM)).astype(np.float32)))
    acc = np.empty((max(b[0].size for b in batches), DIM), np.float32)
    out = {}
    for kind in ("sgd", "adagrad", "rowwise", "adam", "ftrl"):
        states = {name: _state(np.random.default_rng(1)) for name in ("before", "off", "on")}
        turn = {"i": 0}

        def run(name, kind=kind, states=states):
            k = before if name == "before" else fast
            _call(k, kind, states[name], batches[turn["i"] % len(batches)], acc, PREP if name == "on" else None)
            turn["i"] += 1

        if before is not None and not AB:            # the same call, the same bits
            a, b = _state(np.random.default_rng(2)), _state(np.random.default_rng(2))
            _call(before, kind, a, batches[0], acc, None)
            _call(fast, kind, b, batches[0], acc, None)
            assert all(np.array_equal(a[key], b[key]) for key in a), kind
        names = ["off", "on"] + (["before"] if before is not None else [])
        if kind == "adam":
            times, ratios = compare(benchmark, lambda: run("off"), {name: (lambda name=name: run(name))
                                                                   for name in names if name != "off"},
                                    rounds=ROUNDS, warmup=1, ab_rounds=31)
            t = dict(times, off=times["recboost"])
        else:
            t = interleaved({name: (lambda name=name: run(name)) for name in names}, rounds=ROUNDS)
        out[kind] = {"seconds": t, "on_over_off": t["on"] / t["off"],
                     "off_over_before": t["off"] / t["before"] if before is not None else None}
    out.update(_schedule_cost(batches, acc))
    record("table_optimizers", out, benchmark)


#: Steps a table evaluates a CosineDecayLR for at once (recboost's ``_RATE_AHEAD``): each timing of the
#: schedules covers that many steps, so it holds exactly one call of the cosine schedule.
AHEAD = 256


def _schedule_cost(batches, acc):
    """SparseAdam.update with an ExponentialDecayLR (called once a step: it has a ``Pow``) and with a
    CosineDecayLR (called once for ``AHEAD`` steps), each against a constant rate (the same kernel): the
    ratios of their median times per step, interleaved, each timing ``AHEAD`` steps."""
    opts = {"constant": rb.SparseAdam(1e-3), "schedule": rb.SparseAdam(nn.ExponentialDecayLR(1e-3, 0.9, 100)),
            "cosine": rb.SparseAdam(nn.CosineDecayLR(1e-5, 1e-3, 10_000))}
    states = {name: _state(np.random.default_rng(1)) for name in opts}
    steps = {name: 0 for name in opts}

    def run(name):
        s, opt = states[name], opts[name]
        uniq, inverse, grad = batches[steps[name] % len(batches)]
        opt.update(s["w"], {"moment1": s["m"], "moment2": s["v"]}, scalars[name], uniq, inverse, grad, acc,
                   step=steps[name])
        steps[name] += 1

    scalars = {name: {"beta1_power": np.float32(1), "beta2_power": np.float32(1)} for name in opts}
    t = interleaved({name: (lambda name=name: run(name)) for name in opts}, rounds=max(3, ROUNDS // 3),
                    inner=AHEAD)
    return {"schedule_over_constant": t["schedule"] / t["constant"],
            "cosine_schedule_over_constant": t["cosine"] / t["constant"]}


#: the slots of each kind's kernel in ``_call``'s state
SLOTS = {"sgd": (), "adagrad": ("a",), "rowwise": ("r",), "adam": ("m", "v"), "ftrl": ("a", "m")}


def test_bfloat16_update_kernels():
    """Per kernel on bfloat16 rows: the fused update / the three passes it replaced, and / the same kernel
    on float32 rows (see the module's doc); the two bfloat16 ways checked bit for bit first."""
    rng = np.random.default_rng(0)
    n = BATCH * FIELDS
    batches = []
    for _ in range(4):
        uniq = rng.choice(BF16_ROWS, n, replace=False).astype(np.int32)     # distinct, uniform: every row a miss
        batches.append((uniq, rng.permutation(n).astype(np.int32), rng.standard_normal((n, DIM)).astype(np.float32)))
    acc = np.empty((n, DIM), np.float32)
    compact = {key: np.empty((n, 1 if key == "r" else DIM), np.float32) for key in ("w", "a", "m", "v", "r")}
    arange = np.arange(n, dtype=np.int32)
    out = {}
    for kind in ("sgd", "adagrad", "rowwise", "adam", "ftrl"):
        states = {}
        for name in ("fused", "three_passes", "float32"):
            full = _state(np.random.default_rng(1), BF16_ROWS)
            states[name] = {key: full[key] for key in ("w",) + SLOTS[kind]}      # (only what the kernel takes)
            del full
            if name != "float32":
                bits = np.empty((BF16_ROWS, DIM), np.uint16)
                rb.bf16_encode(states[name]["w"], np.arange(BF16_ROWS, dtype=np.int32), bits, 0, 0, False)
                states[name]["w"] = bits
        turn = {"fused": 0, "three_passes": 0, "float32": 0}

        def run(name, kind=kind, states=states):
            s, counter = states[name], turn[name]
            uniq, inverse, grad = batches[counter % len(batches)]
            turn[name] += 1
            if name != "three_passes":
                _call(rb, kind, s, (uniq, inverse, grad), acc, {"seed": 5, "counter": counter} if name == "fused"
                      else None)
                return
            work = dict(s, w=rb.bf16_decode(s["w"], uniq, compact["w"]))
            for key in SLOTS[kind]:
                work[key] = rb.gather_rows(s[key], uniq, compact[key])
            _call(rb, kind, work, (arange, inverse, grad), acc, None)
            for key in SLOTS[kind]:
                rb.scatter_rows(work[key], uniq, s[key])
            rb.bf16_encode(work["w"], uniq, s["w"], 5, counter, True)

        run("fused")
        run("three_passes")
        assert all(np.array_equal(states["fused"][key], states["three_passes"][key]) for key in states["fused"]), kind
        t = interleaved({name: (lambda name=name: run(name)) for name in turn}, rounds=ROUNDS)
        out[kind] = {"seconds": t, "fused_over_three_passes": t["fused"] / t["three_passes"],
                     "fused_over_float32": t["fused"] / t["float32"]}
        del states
    record("bfloat16_update_kernels", dict(out, rows=BF16_ROWS, ids_per_step=n))
