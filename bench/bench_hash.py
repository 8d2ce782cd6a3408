"""Hash embeddings benchmark: host lookup throughput and end-to-end step time (one run, ratios).

    .venv/bin/python -m pytest -q -s -o python_files='bench_*.py' bench/bench_hash.py
        full: 1M and 10M resident ids, e2e at 1M/10M rows (RECBOOST_BENCH_QUICK=1: 200k resident
        ids, e2e at 100k/1M rows, batch 256; under a minute)
    .venv/bin/python bench/bench_hash.py [--quick]    # the same through pytest

The contender is the live ``recboost.HashCache`` (the compiled kernel, or its numpy twin under
``RECBOOST_NO_EXTENSIONS=1``: the gate's demonstration of a slowed hot path).

Lookup: batches of 26x4096 ids with admission (access_threshold=1) and data timestamps on, ids drawn
uniformly or Zipf-skewed from the resident ids. Compared in the same process against
  - a pure-Python dict implementation of the same semantics (written below),
  - the C reference: the same work (counts, last-seen, admission) with the same tricks (32-byte
    packed slots, the same hash, prefetch 64 ids ahead, huge pages), through ctypes,
  - a naive C find-or-insert loop (keys/values arrays, no prefetch, no counting), labelled naive,
both C loops built with the extension's flags (``C_FLAGS``: ``-O3 -ffp-contract=off
-fno-math-errno``, as in setup.py), and the numpy twin (recboost's fallback). Why the reference is
only a little faster than the naive loop: they do different work. The naive loop reads and writes 12
bytes per id in two arrays and does no counting, no timestamp and no admission; the reference does
all three on a 32-byte slot per id. Its tricks pay for that extra work rather than beat the naive
loop at a smaller job. The gap is reported (``speed_vs_c_naive``), never gated. Rows are checked against the dict implementation.

End to end: a Wide&Deep-shaped network (26 fields x 16, MLP 400-400-1, batch 2048, Adam) with a
recboost HashEmbedding + SparseAdam at 1M and 10M rows, against MindSpore's nn.Embedding + Adam and
nn.EmbeddingLookup(target='CPU', sparse=True) + nn.LazyAdam with unique ids at the large size.
"""
import argparse
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import recboost  # noqa: E402
from _harness import AB, QUICK, compare, record  # noqa: E402

FIELDS, BATCH, DIM = 26, 4096, 16
# The C loops are built with the extension's own optimisation flags (setup.py), so the comparison is
# of code, not of compiler settings.
C_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]

# ---- the alternatives -----------------------------------------------------------------------------
C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL; x ^= x >> 27; x *= 0x94d049bb133111ebULL; return x ^ (x >> 31);
}
/* naive: keys and values in two arrays, no prefetch, find-or-insert only */
#define EMPTY INT64_MIN
typedef struct { int64_t *keys; int32_t *vals; uint64_t mask; int32_t next; } lp_t;
lp_t *lp_new(uint64_t nslots) {
    lp_t *t = malloc(sizeof *t);
    t->keys = malloc(nslots * 8); t->vals = malloc(nslots * 4); t->mask = nslots - 1; t->next = 0;
    for (uint64_t i = 0; i < nslots; i++) t->keys[i] = EMPTY;
    return t;
}
void lp_free(lp_t *t) { free(t->keys); free(t->vals); free(t); }
void lp_lookup(lp_t *t, const int64_t *ids, int64_t n, int64_t now, int64_t thr, int32_t *out) {
    (void)now; (void)thr;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        uint64_t j = mix((uint64_t)k) & t->mask;
        while (t->keys[j] != EMPTY && t->keys[j] != k) j = (j + 1) & t->mask;
        if (t->keys[j] == EMPTY) { t->keys[j] = k; t->vals[j] = t->next++; }
        out[i] = t->vals[j];
    }
}
/* the C reference: the same work as HashCache.lookup (count, last-seen, admission past a threshold)
   with the same tricks: one 32-byte slot per entry, the same hash, software prefetch 64 ids ahead,
   slots 2 MiB-aligned on transparent huge pages, -O3 */
typedef struct { int64_t key, last, count; int32_t row, pad; } slot_t;
typedef struct { slot_t *s; uint64_t mask; int32_t next; } ref_t;
ref_t *ref_new(uint64_t nslots) {
    ref_t *t = malloc(sizeof *t);
    size_t bytes = nslots * sizeof(slot_t), huge = (size_t)2 << 20;
    bytes = (bytes + huge - 1) / huge * huge;
    t->s = aligned_alloc(huge, bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(t->s, bytes, MADV_HUGEPAGE);
#endif
    for (uint64_t i = 0; i < nslots; i++) t->s[i].row = -2;
    t->mask = nslots - 1; t->next = 2;
    return t;
}
void ref_free(ref_t *t) { free(t->s); free(t); }
void ref_lookup(ref_t *t, const int64_t *restrict ids, int64_t n, int64_t now, int64_t thr,
                int32_t *restrict out) {
    slot_t *restrict s = t->s; uint64_t mask = t->mask, ring[64]; int32_t next = t->next;
    for (int64_t i = 0; i < n && i < 64; i++) { ring[i] = mix((uint64_t)ids[i]) & mask; __builtin_prefetch(&s[ring[i]], 1, 3); }
    for (int64_t i = 0; i < n; i++) {
        uint64_t j = ring[i & 63];
        if (i + 64 < n) { uint64_t h = mix((uint64_t)ids[i + 64]) & mask; ring[i & 63] = h; __builtin_prefetch(&s[h], 1, 3); }
        int64_t k = ids[i];
        slot_t *e = &s[j];
        while (e->row != -2 && e->key != k) { j = (j + 1) & mask; e = &s[j]; }
        if (e->row == -2) { e->key = k; e->count = 0; e->row = -1; }
        e->count++; e->last = now;
        if (e->row < 0 && e->count > thr) e->row = next++;
        out[i] = e->row < 0 ? 0 : e->row;
    }
    t->next = next;
}
"""


def _build_c(tmp):
    src = os.path.join(tmp, "lp.c")
    lib = os.path.join(tmp, "liblp.so")
    with open(src, "w") as fh:
        fh.write(C_SOURCE)
    subprocess.run(["cc"] + C_FLAGS + ["-shared", "-fPIC", "-o", lib, src], check=True)
    dll = ctypes.CDLL(lib)
    for prefix in ("lp", "ref"):
        getattr(dll, prefix + "_new").restype = ctypes.c_void_p
        getattr(dll, prefix + "_new").argtypes = [ctypes.c_uint64]
        getattr(dll, prefix + "_lookup").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_int64, ctypes.c_void_p]
        getattr(dll, prefix + "_free").argtypes = [ctypes.c_void_p]
    return dll


class CLoop:
    """A C find-or-insert loop through ctypes: ``kind="ref"`` the C reference (HashCache's work and
    tricks, rows from 2 like HashCache), ``kind="lp"`` the naive loop (rows from 0); load <= 0.6."""

    def __init__(self, dll, n_ids, kind, access_threshold=1):
        self.dll, self.kind, self.thr = dll, kind, access_threshold
        slots = 1 << int(np.ceil(np.log2(n_ids / 0.6)))
        self.t = getattr(dll, kind + "_new")(slots)

    def lookup(self, ids, timestamp=0):
        out = np.empty(ids.size, np.int32)
        getattr(self.dll, self.kind + "_lookup")(self.t, ids.ctypes.data, ids.size, timestamp, self.thr,
                                                 out.ctypes.data)
        return out.reshape(ids.shape)

    def close(self):
        getattr(self.dll, self.kind + "_free")(self.t)


class DictCache:
    """Pure-Python HashCache semantics (admission, counts, last-seen, lowest free row) on a dict."""

    def __init__(self, capacity, access_threshold):
        self.capacity, self.t = capacity, access_threshold
        self.entries = {}                 # id -> [row or -1, count, last_seen]
        self.next_row = 2
        self.free = []

    def lookup(self, ids, timestamp):
        entries, t = self.entries, self.t
        flat = ids.ravel().tolist()
        pending = []
        out = []
        for key in flat:
            ent = entries.get(key)
            if ent is None:
                ent = entries[key] = [-1, 0, 0]
            ent[1] += 1
            ent[2] = timestamp
            if ent[0] < 0 and ent[1] > t:
                if self.free:
                    ent[0] = self.free.pop()
                elif self.next_row < self.capacity:
                    ent[0] = self.next_row
                    self.next_row += 1
            if ent[0] < 0:
                pending.append((len(out), ent))
            out.append(ent[0])
        for i, ent in pending:
            out[i] = max(ent[0], 0)
        return np.array(out, np.int32).reshape(ids.shape)


# ---- lookup throughput ----------------------------------------------------------------------------
LOOKUP_SIZES = [200_000] if QUICK else [1_000_000, 10_000_000]
LOOKUP_BATCHES = 5 if QUICK else 20


def _size_label(n):
    return "%dM" % (n // 10 ** 6) if n >= 10 ** 6 else "%dk" % (n // 1000)


def _batches(rng, resident_ids, dist, n):
    out = []
    for _ in range(n):
        if dist == "uniform":
            idx = rng.integers(0, resident_ids.size, FIELDS * BATCH)
        else:
            idx = np.minimum(rng.zipf(1.1, FIELDS * BATCH), resident_ids.size) - 1
        out.append(resident_ids[idx].reshape(BATCH, FIELDS))
    return out


@pytest.fixture(scope="module")
def c_loop(tmp_path_factory):
    return _build_c(str(tmp_path_factory.mktemp("c_loop")))


@pytest.mark.parametrize("resident", LOOKUP_SIZES, ids=_size_label)
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_hash_lookup(benchmark, c_loop, resident, dist):
    """Each call looks up the same LOOKUP_BATCHES batches of 26x4096 ids in every implementation."""
    rng = np.random.default_rng(0)
    # arbitrary 64-bit ids; the permutation makes the preload order random
    resident_ids = rng.permutation(rng.choice(2 ** 62, size=resident, replace=False).astype(np.int64))
    capacity = resident + 2 * FIELDS * BATCH + 2
    live = recboost.HashCache(capacity, access_threshold=1, eviction_threshold=10 ** 9)
    twin = recboost._py_HashCache(capacity, access_threshold=1, eviction_threshold=10 ** 9)
    dct = DictCache(capacity, 1)
    c = CLoop(c_loop, resident + FIELDS * BATCH, "ref")
    naive = CLoop(c_loop, resident + FIELDS * BATCH, "lp")
    chunk = 1 << 20
    for i in range(0, resident, chunk):            # each id twice: admitted, rows 2.. in this order
        part = resident_ids[i:i + chunk]
        both = np.concatenate([part, part])
        live.lookup(both, timestamp=0)
        twin.lookup(both, timestamp=0)
        c.lookup(both)
        naive.lookup(part)
        dct.lookup(both, 0)
    batches = _batches(rng, resident_ids, dist, LOOKUP_BATCHES)
    clock = {"live": 1, "twin": 1, "dict": 1, "c": 1, "c_naive": 1}
    last = {}

    def over_batches(name, fn):
        def go():
            out = [fn(b, clock[name] + k) for k, b in enumerate(batches)]
            clock[name] += len(batches)
            last[name] = out
            return out
        return go

    def check(rows):                   # same rows as the dict reference and both C loops
        for got, want, c_rows, naive_rows in zip(rows, last["dict"], last["c"], last["c_naive"]):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(c_rows, want)
            np.testing.assert_array_equal(naive_rows + 2, want)      # the naive loop numbers from 0

    alternatives = {"c": over_batches("c", c.lookup), "c_naive": over_batches("c_naive", naive.lookup),
                    "dict": over_batches("dict", dct.lookup),
                    "numpy_twin": over_batches("twin", lambda b, ts: twin.lookup(b, timestamp=ts))}
    times, ratios = compare(benchmark, over_batches("live", lambda b, ts: live.lookup(b, timestamp=ts)),
                            alternatives, rounds=7 if QUICK else 10, warmup=1, check=check, ab_rounds=21)
    c.close()
    naive.close()
    n_ids = LOOKUP_BATCHES * FIELDS * BATCH
    rates = {k: n_ids / t for k, t in times.items()}
    record("hash_lookup_%s_%s" % (dist, _size_label(resident)), {
        "resident_ids": resident, "dist": dist, "ids_per_call": n_ids,
        "backend": "compiled" if recboost.FAST_BACKEND else "numpy",
        "ids_per_second": rates,
        "speed_vs_c": 1 / ratios["c"], "speed_vs_c_naive": 1 / ratios["c_naive"], "speed_vs_dict": 1 / ratios["dict"],
        "speed_vs_numpy_twin": 1 / ratios["numpy_twin"],
        "targets": {"vs C": ">= 0.8", "vs dict": ">= 10"}}, benchmark)


# ---- end to end -----------------------------------------------------------------------------------
def _mlp():
    from mindspore import nn
    return nn.SequentialCell([nn.Dense(FIELDS * DIM, 400), nn.ReLU(), nn.Dense(400, 400), nn.ReLU(),
                              nn.Dense(400, 1)])


def _stepper(run, n_data, steps):
    """A callable running ``steps`` steps of ``run(i)`` (which returns tensors), synced; returns the
    last step's outputs as numpy arrays."""
    state = {"i": 0}

    def go():
        for _ in range(steps):
            out = run(state["i"] % n_data)
            state["i"] += 1
        return [t.asnumpy() for t in out]
    return go


def _e2e_hash(rows, batch, steps, seed=0):
    """recboost's host table driven by hand: prepare, take, gather, recboost's train cell (dense Adam
    inside, the rows' gradient out), the fused SparseAdam update."""
    from mindspore import Tensor, nn

    class Net(nn.Cell):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb
            self.mlp = _mlp()

        def construct(self, rows):
            e = self.emb(rows)
            return self.mlp(e.reshape(e.shape[0], FIELDS * DIM)).squeeze(-1)

    emb = recboost.HashEmbedding(DIM, rows, access_threshold=1, eviction_threshold=10 ** 9, seed=seed)
    net = Net(emb)
    step = recboost.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, nn.BCEWithLogitsLoss()),
                                                  nn.Adam(net.trainable_params(), 1e-3), None, row_inputs=(0,))
    rng = np.random.default_rng(seed)
    # a steady state: the table full of admitted ids (each seen twice), batches drawn from them
    universe = rng.choice(2 ** 62, size=rows - 2, replace=False).astype(np.int64)
    for i in range(0, universe.size, 1 << 20):
        part = universe[i:i + (1 << 20)]
        emb.prepare(np.concatenate([part, part]), timestamp=0)
    data = [(universe[rng.integers(0, universe.size, (batch, FIELDS))],
             Tensor((rng.random(batch) < 0.3).astype(np.float32))) for _ in range(8)]

    def run(i):
        ids, labels = data[i]
        table_batch = emb.prepare(ids, timestamp=1 + i)
        emb.take(table_batch)
        loss, _, _, grad = step(Tensor(emb.gather(table_batch)), labels)
        emb.apply_gradients(table_batch, grad.asnumpy())
        return Tensor(table_batch.rows), loss
    return _stepper(run, len(data), steps)


def _e2e_mindspore(kind, rows, batch, steps, seed=0):
    """MindSpore's tables: ``nn.Embedding`` + dense Adam, or (``kind="lookup"``, MindSpore's best)
    ``nn.EmbeddingLookup(sparse)`` + LazyAdam on the batch's unique ids (padded to one length, made
    before the clock), gathered back by the inverse in the graph."""
    from mindspore import Tensor, nn, ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            if kind == "embedding":
                self.emb = nn.Embedding(rows, DIM)
            else:
                self.emb = nn.EmbeddingLookup(rows, DIM, target="CPU", sparse=True)
            self.mlp = _mlp()

        def construct(self, ids, inverse):
            e = self.emb(ids) if kind == "embedding" else ops.gather(self.emb(ids), inverse, 0)
            return self.mlp(e.reshape(e.shape[0], FIELDS * DIM)).squeeze(-1)

    class Loss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net, self.loss = net, nn.BCEWithLogitsLoss()

        def construct(self, ids, inverse, label):
            return self.loss(self.net(ids, inverse), label)

    net = Net()
    opt = (nn.Adam if kind == "embedding" else nn.LazyAdam)(net.trainable_params(), 1e-3)
    train = nn.TrainOneStepCell(Loss(net), opt)
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, rows, (batch, FIELDS)).astype(np.int32) for _ in range(8)]
    uniques = [np.unique(b, return_inverse=True) for b in batches]
    pad = max(u.size for u, _ in uniques) + 1
    data = []
    for b, (u, inv) in zip(batches, uniques):
        ids = b if kind == "embedding" else np.concatenate([u, np.zeros(pad - u.size, np.int32)]).astype(np.int32)
        data.append((Tensor(ids), Tensor(inv.reshape(b.shape).astype(np.int32)),
                     Tensor((rng.random(batch) < 0.3).astype(np.float32))))
    return _stepper(lambda i: (train(*data[i]),), len(data), steps)


def test_hash_e2e(benchmark):
    """Step time with a large hash table (the contender) against a 10x smaller one (the cost must
    follow the batch, not the table) and against MindSpore's two embeddings at the large size."""
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    small, large, batch, steps = (100_000, 1_000_000, 2048, 2) if QUICK else (1_000_000, 10_000_000, 2048, 5)
    alternatives = {} if AB else {"hash_small": _e2e_hash(small, batch, steps),
                                  "embedding": _e2e_mindspore("embedding", large, batch, steps),
                                  "lookup": _e2e_mindspore("lookup", large, batch, steps)}

    def check(out):
        rows, loss = out
        assert np.isfinite(loss).all() and (rows >= 0).all() and (rows < large).all()

    times, ratios = compare(benchmark, _e2e_hash(large, batch, steps), alternatives,
                            rounds=7 if QUICK else 6, warmup=1, check=check)
    record("hash_e2e", {
        "rows_small": small, "rows_large": large, "batch": batch, "steps_per_call": steps,
        "ms_per_step": {k: t / steps * 1e3 for k, t in times.items()},
        "large_over_small": ratios["hash_small"], "speed_vs_embedding": 1 / ratios["embedding"],
        "speed_vs_embedding_lookup": 1 / ratios["lookup"],
        "targets": {"large/small": "<= 1.05", "vs nn.Embedding+Adam": "> 1",
                    "vs nn.EmbeddingLookup+LazyAdam": "> 1"}}, benchmark)


def main(argv=None):
    """Run this file's benchmarks through pytest (``--quick``: RECBOOST_BENCH_QUICK=1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    args = parser.parse_args(argv)
    env = dict(os.environ, RECBOOST_BENCH_QUICK="1" if args.quick else os.environ.get("RECBOOST_BENCH_QUICK", ""))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-o", "python_files=bench_*.py",
                            os.path.abspath(__file__)], env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
