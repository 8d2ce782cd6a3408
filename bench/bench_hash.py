"""Hash embeddings benchmark: host lookup throughput and end-to-end step time (one run, ratios).

    .venv/bin/python bench/bench_hash.py            # full: 1M and 10M resident ids, e2e at 1M/10M rows
    .venv/bin/python bench/bench_hash.py --quick    # smoke (< 30 s): 200k resident ids, small e2e

Lookup: batches of 26x4096 ids with admission (access_threshold=1) and data timestamps on, ids drawn
uniformly or Zipf-skewed from the resident ids. Compared in the same process against
  - a pure-Python dict implementation of the same semantics (written below),
  - a minimal C linear-probing find-or-insert loop (keys/values arrays, no prefetch) compiled here
    with ``cc -O2`` and called through ctypes: the plain-C limit,
and the numpy twin (recboost's fallback). Rows are checked against the dict implementation.

End to end: a Wide&Deep-shaped network (26 fields x 16, MLP 400-400-1, batch 2048, Adam) with a
recboost HashEmbedding + SparseAdam at 1M and 10M rows, against MindSpore's nn.Embedding + Adam and
nn.EmbeddingLookup(target='CPU', sparse=True) + nn.LazyAdam at the large size.
"""
import argparse
import ctypes
import gc
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import recboost  # noqa: E402

FIELDS, BATCH, DIM = 26, 4096, 16

# ---- the alternatives -----------------------------------------------------------------------------
C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#define EMPTY INT64_MIN
static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL; x ^= x >> 27; x *= 0x94d049bb133111ebULL; return x ^ (x >> 31);
}
typedef struct { int64_t *keys; int32_t *vals; uint64_t mask; int32_t next; } lp_t;
lp_t *lp_new(uint64_t nslots) {
    lp_t *t = malloc(sizeof *t);
    t->keys = malloc(nslots * 8); t->vals = malloc(nslots * 4); t->mask = nslots - 1; t->next = 0;
    for (uint64_t i = 0; i < nslots; i++) t->keys[i] = EMPTY;
    return t;
}
void lp_free(lp_t *t) { free(t->keys); free(t->vals); free(t); }
void lp_lookup(lp_t *t, const int64_t *ids, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        uint64_t j = mix((uint64_t)k) & t->mask;
        while (t->keys[j] != EMPTY && t->keys[j] != k) j = (j + 1) & t->mask;
        if (t->keys[j] == EMPTY) { t->keys[j] = k; t->vals[j] = t->next++; }
        out[i] = t->vals[j];
    }
}
"""


def _build_c(tmp):
    src = os.path.join(tmp, "lp.c")
    lib = os.path.join(tmp, "liblp.so")
    with open(src, "w") as fh:
        fh.write(C_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    dll = ctypes.CDLL(lib)
    dll.lp_new.restype = ctypes.c_void_p
    dll.lp_new.argtypes = [ctypes.c_uint64]
    dll.lp_lookup.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    dll.lp_free.argtypes = [ctypes.c_void_p]
    return dll


class CLinearProbe:
    """The plain-C limit: find-or-insert, values numbered in insertion order, load <= 0.6."""

    def __init__(self, dll, n_ids):
        self.dll = dll
        slots = 1 << int(np.ceil(np.log2(n_ids / 0.6)))
        self.t = dll.lp_new(slots)

    def lookup(self, ids):
        out = np.empty(ids.size, np.int32)
        self.dll.lp_lookup(self.t, ids.ctypes.data, ids.size, out.ctypes.data)
        return out.reshape(ids.shape)

    def close(self):
        self.dll.lp_free(self.t)


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
def _batches(rng, resident_ids, dist, n):
    out = []
    for _ in range(n):
        if dist == "uniform":
            idx = rng.integers(0, resident_ids.size, FIELDS * BATCH)
        else:
            idx = np.minimum(rng.zipf(1.1, FIELDS * BATCH), resident_ids.size) - 1
        out.append(resident_ids[idx].reshape(BATCH, FIELDS))
    return out


def _rate(fn, batches, start_ts):
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        fn(b, start_ts + i)
    return sum(b.size for b in batches) / (time.perf_counter() - t0)


def bench_lookup(resident, dists, n_batches, dict_batches, dll, seed=0):
    rng = np.random.default_rng(seed)
    # arbitrary 64-bit ids; the permutation makes the preload order random
    resident_ids = rng.permutation(rng.choice(2 ** 62, size=resident, replace=False).astype(np.int64))
    capacity = resident + 2 * FIELDS * BATCH + 2
    fast = recboost._backend_kernels("fast")["HashCache"](capacity, access_threshold=1, eviction_threshold=10 ** 9)
    twin = recboost._backend_kernels("py")["HashCache"](capacity, access_threshold=1, eviction_threshold=10 ** 9)
    dct = DictCache(capacity, 1)
    c = CLinearProbe(dll, resident + FIELDS * BATCH)
    chunk = 1 << 20
    t0 = time.perf_counter()
    for i in range(0, resident, chunk):            # each id twice: admitted, rows 2.. in this order
        part = resident_ids[i:i + chunk]
        both = np.concatenate([part, part])
        fast.lookup(both, timestamp=0)
        twin.lookup(both, timestamp=0)
        c.lookup(part)
        dct.lookup(both, 0)
    preload = time.perf_counter() - t0
    results = []
    for dist in dists:
        batches = _batches(rng, resident_ids, dist, n_batches)
        want = dct.lookup(batches[0], 1)
        np.testing.assert_array_equal(fast.lookup(batches[0], timestamp=1), want)
        np.testing.assert_array_equal(twin.lookup(batches[0], timestamp=1), want)
        np.testing.assert_array_equal(c.lookup(batches[0]) + 2, want)  # same ids, same numbering
        r_fast = _rate(fast.lookup, batches, 2)
        r_c = _rate(lambda b, ts: c.lookup(b), batches, 2)
        r_twin = _rate(twin.lookup, batches[:max(2, n_batches // 5)], 2)
        r_dict = _rate(dct.lookup, batches[:dict_batches], 2)
        results.append(dict(resident=resident, dist=dist, fast=r_fast, c=r_c, twin=r_twin, dict=r_dict))
        print("lookup %5s resident %-9s fast %6.1f M ids/s | C-LP %6.1f M (fast/C %.2fx) | dict %5.2f M "
              "(fast/dict %5.1fx) | numpy twin %5.2f M" % (
                  "%dM" % (resident // 10 ** 6) if resident >= 10 ** 6 else "%dk" % (resident // 1000), dist,
                  r_fast / 1e6, r_c / 1e6, r_fast / r_c, r_dict / 1e6, r_fast / r_dict, r_twin / 1e6),
              flush=True)
    print("  (preload of %d ids into all four: %.1f s)" % (resident, preload))
    c.close()
    return results


# ---- end to end -----------------------------------------------------------------------------------
def _mlp():
    from mindspore import nn
    return nn.SequentialCell([nn.Dense(FIELDS * DIM, 400), nn.ReLU(), nn.Dense(400, 400), nn.ReLU(),
                              nn.Dense(400, 1)])


def _timer(run, n_data):
    """``time(steps)`` -> seconds per step of ``run(i)`` (which returns tensors to sync on)."""
    state = {"i": 0}

    def time_steps(steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = run(state["i"] % n_data)
            state["i"] += 1
        for t in out:
            t.asnumpy()
        return (time.perf_counter() - t0) / steps
    return time_steps


def _e2e_hash(rows, batch, seed=0):
    import mindspore as ms
    from mindspore import ParameterTuple, Tensor, nn, ops

    class Net(nn.Cell):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb
            self.mlp = _mlp()

        def construct(self, inverse):
            e = self.emb(inverse)
            return self.mlp(e.reshape(e.shape[0], FIELDS * DIM)).squeeze(-1)

    class Step(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.loss = nn.BCEWithLogitsLoss()
            self.dense = ParameterTuple(net.mlp.trainable_params())
            self.params = ParameterTuple([net.emb.active] + list(self.dense))
            self.grad = ops.GradOperation(get_by_list=True)
            self.opt = nn.Adam(self.dense, 1e-3)

        def forward(self, inverse, labels):
            return self.loss(self.net(inverse), labels)

        def construct(self, inverse, labels):
            loss = self.forward(inverse, labels)
            grads = self.grad(self.forward, self.params)(inverse, labels)
            self.opt(grads[1:])
            return loss, grads[0]

    emb = recboost.HashEmbedding(DIM, rows, access_threshold=1, eviction_threshold=10 ** 9,
                                 max_unique=FIELDS * batch + 1, seed=seed)
    step = Step(Net(emb))
    rng = np.random.default_rng(seed)
    # a steady state: the table full of admitted ids (each seen twice), batches drawn from them
    universe = rng.choice(2 ** 62, size=rows - 2, replace=False).astype(np.int64)
    for i in range(0, universe.size, 1 << 20):
        part = universe[i:i + (1 << 20)]
        emb.cache.lookup(np.concatenate([part, part]), timestamp=0)
    data = [(universe[rng.integers(0, universe.size, (batch, FIELDS))],
             Tensor((rng.random(batch) < 0.3).astype(np.float32))) for _ in range(8)]

    def run(i):
        ids, labels = data[i]
        unique_rows, inverse = emb.prepare(ids, timestamp=1 + i)
        rows_t = Tensor(unique_rows)
        emb.load_rows(rows_t)
        loss, grad = step(Tensor(inverse), labels)
        return emb.apply_gradients(rows_t, grad), loss       # syncing on both waits for the update
    return _timer(run, len(data))


def _e2e_mindspore(kind, rows, batch, seed=0):
    from mindspore import Tensor, nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            if kind == "embedding":
                self.emb = nn.Embedding(rows, DIM)
            else:
                self.emb = nn.EmbeddingLookup(rows, DIM, target="CPU", sparse=True)
            self.mlp = _mlp()

        def construct(self, ids):
            e = self.emb(ids)
            return self.mlp(e.reshape(e.shape[0], FIELDS * DIM)).squeeze(-1)

    net = Net()
    loss_net = nn.WithLossCell(net, nn.BCEWithLogitsLoss())
    opt = (nn.Adam if kind == "embedding" else nn.LazyAdam)(net.trainable_params(), 1e-3)
    train = nn.TrainOneStepCell(loss_net, opt)
    rng = np.random.default_rng(seed)
    data = [(Tensor(rng.integers(0, rows, (batch, FIELDS)).astype(np.int32)),
             Tensor((rng.random(batch) < 0.3).astype(np.float32))) for _ in range(8)]
    return _timer(lambda i: (train(*data[i]),), len(data))


def bench_e2e(small, large, batch, steps, rounds, mindspore_too):
    """All variants built first, then timed in interleaved rounds (drift hits them alike); the
    median round is reported."""
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    variants = {"hash_small": _e2e_hash(small, batch), "hash_large": _e2e_hash(large, batch)}
    if mindspore_too:
        variants["embedding"] = _e2e_mindspore("embedding", large, batch)
        variants["lookup"] = _e2e_mindspore("lookup", large, batch)
    for time_steps in variants.values():         # warm-up: compile
        time_steps(2)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, time_steps in variants.items():
            times[name].append(time_steps(steps))
    t = {name: float(np.median(v)) for name, v in times.items()}
    print("e2e recboost HashEmbedding+SparseAdam: %.1f ms/step at %d rows, %.1f ms at %d rows "
          "(ratio %.2f, target <= 1.2)" % (t["hash_small"] * 1e3, small, t["hash_large"] * 1e3, large,
                                          t["hash_large"] / t["hash_small"]), flush=True)
    for kind, label in (("embedding", "nn.Embedding+Adam"),
                        ("lookup", "nn.EmbeddingLookup(CPU, sparse)+LazyAdam")):
        if kind in t:
            print("e2e MindSpore %s at %d rows: %.1f ms/step (recboost at %d rows: %.2fx its speed)"
                  % (label, large, t[kind] * 1e3, large, t[kind] / t["hash_large"]), flush=True)
    return t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 30 s)")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-lookup", action="store_true")
    args = parser.parse_args(argv)
    if not recboost.FAST_BACKEND:
        sys.exit("bench_hash needs the compiled backend: " + recboost.FAST_BACKEND_REASON)
    print("recboost %s, compiled backend; batches of %dx%d ids, admission + timestamps on"
          % (recboost.__version__, FIELDS, BATCH), flush=True)
    if not args.no_lookup:
        with tempfile.TemporaryDirectory() as tmp:
            dll = _build_c(tmp)
            sizes = [200_000] if args.quick else [1_000_000, 10_000_000]
            for resident in sizes:
                bench_lookup(resident, ("uniform", "zipf"), 5 if args.quick else 30,
                             1 if args.quick else 3, dll)
                gc.collect()
    if not args.no_e2e:
        if args.quick:
            bench_e2e(100_000, 1_000_000, 256, 3, 2, mindspore_too=False)
        else:
            bench_e2e(1_000_000, 10_000_000, 2048, 5, 4, mindspore_too=True)


def test_bench_hash_quick():
    """The < 30 s smoke version, for pytest (e.g. ``pytest bench/bench_hash.py``)."""
    main(["--quick"])


if __name__ == "__main__":
    main()
