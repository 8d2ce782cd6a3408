"""HashCache (host side of hash embeddings): a model-based test against a plain-dict reference of
the documented semantics, on both backends, plus parity at scale and the error cases."""
import os
import tracemalloc

import numpy as np
import pytest

import recboost

MAX_CAPACITY = 2 ** 31 - 1
M64 = (1 << 64) - 1


def mix64(x):
    """splitmix64's finaliser on a Python int (an independent writing of recboost._mix64)."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


class RefSketch:
    """The documented count-min sketch on lists: ``depth`` rows of ``width`` counters; row d counts an
    id at column ``(mix64(id ^ salt_d) >> 32) * width >> 32``, ``salt_d = mix64((d + 1) * golden)``;
    an id's count is its least counter; adding raises its counters to at least a count (capped at
    2**31 - 1); every ``window`` counts added, every counter halves."""

    def __init__(self, width, depth, window):
        self.width, self.depth, self.window = width, depth, window
        self.rows = [[0] * width for _ in range(depth)]
        self.salts = [mix64((d + 1) * 0x9E3779B97F4A7C15) for d in range(depth)]
        self.pending = 0
        self.aged = 0

    def cells(self, key):
        return [(mix64((key & M64) ^ salt) >> 32) * self.width >> 32 for salt in self.salts]

    def count(self, key):
        return min(row[c] for row, c in zip(self.rows, self.cells(key)))

    def add(self, key, count):
        for row, c in zip(self.rows, self.cells(key)):
            row[c] = max(row[c], min(count, 2 ** 31 - 1))

    def age(self, added):
        self.pending += added
        while self.pending >= self.window:
            self.pending -= self.window
            self.aged += 1
            self.rows = [[v >> 1 for v in row] for row in self.rows]

    def flat(self):
        return np.array([v for row in self.rows for v in row], np.int32)


class RefCache:
    """The documented semantics, one batch element at a time, on plain dicts and lists."""

    def __init__(self, capacity, access_threshold=-1, eviction_threshold=-1, grow=False, eviction_policy=None,
                 lfu_half_life=3600, admission_counter="exact", sketch_width=0, sketch_depth=0, sketch_window=0):
        self.capacity, self.t, self.e, self.grow = capacity, access_threshold, eviction_threshold, grow
        self.policy, self.half_life = eviction_policy, lfu_half_life
        self.sketch = RefSketch(sketch_width, sketch_depth, sketch_window) if admission_counter == "sketch" else None
        self.sizes = (sketch_width, sketch_depth, sketch_window)
        self.entries = {}                    # id -> [row or -1, count, last_seen]
        self.free = set()
        self.next_row = 2
        self.step = 0
        self.now = 0
        self.stats = dict(admitted=0, rejected=0, overflowed=0, evicted=0, forgotten=0, grown=0,
                          looked_up=0, replaced=0, aged=0)
        self.replaced = []                   # (id, row) since take_replaced()

    def decayed(self, count, last, now):
        """An LFU count halved once per half-life since the id was last seen."""
        if now <= last:
            return count
        periods = (now - last) // self.half_life
        return 0 if periods >= 63 else count >> periods

    def _replace(self, key, now, batch):
        """A full table's row for ``key``: the lowest-ranked id of its bucket of 32 rows (bucket
        ``(mix64(key) >> 32) * n_buckets >> 32``), never an id of this lookup or one seen at ``now``."""
        n_buckets = -(-(self.capacity - 2) // 32)
        bucket = ((int(recboost._mix64(np.array([key], np.int64).view(np.uint64))[0]) >> 32) * n_buckets) >> 32
        owner = {ent[0]: k for k, ent in self.entries.items() if ent[0] >= 0}
        best = None
        for row in range(2 + 32 * bucket, min(2 + 32 * (bucket + 1), self.capacity)):
            _, count, last = self.entries[owner[row]]
            if owner[row] in batch or last == now:
                continue
            rank = (last if self.policy == "lru" else self.decayed(count, last, now), last, row)
            best = rank if best is None else min(best, rank)
        if best is None:
            return -1
        del self.entries[owner[best[2]]]
        self.replaced.append((owner[best[2]], best[2]))
        self.stats["replaced"] += 1
        return best[2]

    def take_replaced(self):
        found, self.replaced = self.replaced, []
        return np.array([k for k, _ in found], np.int64), np.array([r for _, r in found], np.int32)

    def _allocate(self):
        if self.free:
            row = min(self.free)
            self.free.remove(row)
            return row
        if self.next_row >= self.capacity:
            if not self.grow or self.capacity >= MAX_CAPACITY:
                return -1
            self.capacity = min(2 * self.capacity, MAX_CAPACITY)
            self.stats["grown"] += 1
        self.next_row += 1
        return self.next_row - 1

    def lookup(self, ids, timestamp=None, max_admit=-1):
        now = self.step if timestamp is None else int(timestamp)
        self.step += 1
        self.now = now
        flat = np.asarray(ids).astype(np.int64).ravel().tolist()     # uint64 ids keep their bits
        batch = set(flat)
        fresh = []                           # with the sketch: ids this lookup started tracking
        for key in flat:
            if key not in self.entries and self.sketch is not None:
                fresh.append(key)
                self.entries[key] = [-1, self.sketch.count(key), now]      # the sketch as of before the batch
            ent = self.entries.setdefault(key, [-1, 0, 0])
            if self.policy == "lfu":
                ent[1] = self.decayed(ent[1], ent[2], now)
            ent[1] += 1
            ent[2] = now
            if ent[0] < 0 and ent[1] > self.t and max_admit != 0:
                row = self._allocate()
                if row < 0 and self.policy is not None:
                    row = self._replace(key, now, batch)
                if row >= 0:
                    ent[0] = row
                    self.stats["admitted"] += 1
                    max_admit -= 1
        out = []
        for key in flat:
            row, count, _ = self.entries[key]
            if row < 0:
                self.stats["overflowed" if count > self.t else "rejected"] += 1
            out.append(max(row, 0))
        self.stats["looked_up"] += len(flat)
        if self.sketch is not None and flat:     # ids without a row go back to the sketch, untracked
            for key in fresh:
                if self.entries[key][0] < 0:
                    self.sketch.add(key, self.entries.pop(key)[1])
            self.sketch.age(sum(1 for key in flat if key not in self.entries))
            self.stats["aged"] = self.sketch.aged
        return np.array(out, dtype=np.int32).reshape(np.shape(ids))

    def count_of(self, key):
        """An id's count: its entry's, else the sketch's (0 without one)."""
        if key in self.entries:
            return self.entries[key][1]
        return 0 if self.sketch is None else self.sketch.count(key)

    def find(self, ids):
        flat = [max(self.entries.get(x, [0])[0], 0) for x in np.asarray(ids).astype(np.int64).ravel().tolist()]
        return np.array(flat, dtype=np.int32).reshape(np.shape(ids))

    def evict(self, now=None):
        now = self.now if now is None else now
        if self.e < 0:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        gone = sorted(k for k, (_, _, last) in self.entries.items() if now - last > self.e)
        freed = sorted((self.entries[k][0], k) for k in gone if self.entries[k][0] >= 0)
        for k in gone:
            del self.entries[k]
        self.free.update(r for r, _ in freed)
        self.stats["evicted"] += len(freed)
        self.stats["forgotten"] += len(gone) - len(freed)
        return (np.array([k for _, k in freed], dtype=np.int64),
                np.array([r for r, _ in freed], dtype=np.int32))

    def state(self):
        keys = sorted(self.entries)
        state = {"keys": np.array(keys, np.int64),
                 "rows": np.array([self.entries[k][0] for k in keys], np.int32),
                 "counts": np.array([self.entries[k][1] for k in keys], np.int64),
                 "last_seen": np.array([self.entries[k][2] for k in keys], np.int64),
                 "free_rows": np.array(sorted(self.free), np.int32), "next_row": self.next_row,
                 "capacity": self.capacity, "step": self.step, "now": self.now,
                 "access_threshold": self.t, "eviction_threshold": self.e, "grow": self.grow,
                 "eviction_policy": self.policy or "none", "lfu_half_life": self.half_life,
                 "admission_counter": "exact" if self.sketch is None else "sketch",
                 "sketch_width": self.sizes[0], "sketch_depth": self.sizes[1], "sketch_window": self.sizes[2],
                 "sketch_pending": 0 if self.sketch is None else self.sketch.pending,
                 "sketch": np.empty(0, np.int32) if self.sketch is None else self.sketch.flat(),
                 # the score policy's settings (tests/test_hash_score.py), at their defaults here
                 "score_half_life": 3600, "score_click_weight": 1.0, "score_nonclick_weight": 0.1,
                 "admit_score": -1.0}
        state.update(self.stats)
        return state

    def summary(self):
        size = sum(1 for ent in self.entries.values() if ent[0] >= 0)
        out = {"size": size, "candidates": len(self.entries) - size, "capacity": self.capacity,
               "sketch_bytes": 4 * self.sizes[0] * self.sizes[1]}
        out.update(self.stats)
        return out


def assert_state_equal(got, want):
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            assert got[key] == value and type(got[key]) is type(value), (key, got[key], value)


def _random_ids(rng, universe):
    shape = [(int(rng.integers(0, 40)),), (int(rng.integers(1, 6)), int(rng.integers(1, 8))), (0,),
             (2, 3, 2)][int(rng.choice(4, p=[0.6, 0.3, 0.05, 0.05]))]
    ids = universe[np.minimum(rng.zipf(1.3, size=shape), universe.size) - 1]
    return ids.astype(rng.choice([np.int64, np.int32, np.uint64])) if rng.random() < 0.1 else ids


CONFIGS = [  # capacity, access_threshold, eviction_threshold, grow[, eviction_policy, lfu_half_life[, sketch]]
    (8, -1, -1, False), (8, -1, 4, True), (12, 2, 6, False), (5, 0, 3, True),
    (20, 1, 40, False), (3, 3, 2, True), (64, -1, 20, False), (16, 5, -1, True),
    (40, -1, -1, False, "lru"), (40, 1, 30, False, "lru"), (36, 0, -1, False, "lfu", 3), (40, 1, 200, False, "lfu", 5),
    # the sketch admission counter (width, depth, window): small, so ids share counters and it ages often
    (12, 2, 6, False, None, 3600, "sketch", 16, 2, 30), (8, 1, 4, True, None, 3600, "sketch", 8, 1, 10),
    (20, 3, -1, False, None, 3600, "sketch", 64, 4, 400),
    (40, 1, 30, False, "lru", 3600, "sketch", 32, 3, 50), (36, 2, -1, False, "lfu", 3, "sketch", 64, 4, 200),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_model_based_against_dict_reference(backend, config):
    """>= 10,000 seeded random operations per backend in total, zero divergence."""
    rng = np.random.default_rng(1234 + CONFIGS.index(config))
    # big, negative and extreme ids; few enough that ids repeat, evict and come back
    universe = np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 150, dtype=np.int64),
                               np.arange(-5, 60, dtype=np.int64),
                               np.array([-2 ** 63, 2 ** 63 - 1, 0], dtype=np.int64)])
    rng.shuffle(universe)
    ref = RefCache(*config)
    cache = recboost.HashCache(*config)
    clock = 0
    n_ops = 1300
    for op in range(n_ops):
        kind = rng.choice(["lookup", "lookup_ts", "evict", "evict_now", "find", "state"],
                          p=[0.45, 0.3, 0.08, 0.05, 0.07, 0.05])
        if kind.startswith("lookup"):
            ids = _random_ids(rng, universe)
            ts = None
            if kind == "lookup_ts":
                clock += int(rng.integers(0, 4))
                ts = clock if rng.random() < 0.9 else np.int64(clock)
            limit = int(rng.integers(0, 4)) if rng.random() < 0.2 else -1      # a row-wise shard's budget
            if limit < 0 and rng.random() < 0.5:
                got, want = cache.lookup(ids, ts), ref.lookup(ids, ts)
            else:
                got, want = cache.lookup(ids, ts, max_admit=limit), ref.lookup(ids, ts, limit)
            assert got.dtype == np.int32 and got.shape == np.shape(ids)
            np.testing.assert_array_equal(got, want, err_msg="op %d" % op)
            assert not np.isin(got, [1]).any()          # the scratch row is never handed out
            for g, w in zip(cache.take_replaced(), ref.take_replaced()):
                assert g.dtype == w.dtype
                np.testing.assert_array_equal(g, w, err_msg="op %d" % op)
        elif kind.startswith("evict"):
            now = None if kind == "evict" else clock + int(rng.integers(-3, 8))
            (gi, gr), (wi, wr) = cache.evict(now), ref.evict(now)
            assert gi.dtype == np.int64 and gr.dtype == np.int32
            np.testing.assert_array_equal(gi, wi)
            np.testing.assert_array_equal(gr, wr)
        elif kind == "find":
            ids = _random_ids(rng, universe)
            np.testing.assert_array_equal(cache.find(ids), ref.find(ids))
            counts = cache.counts(ids)
            assert counts.dtype == np.int64 and counts.shape == np.shape(ids)
            want = [ref.count_of(key) for key in np.asarray(ids).astype(np.int64).ravel().tolist()]
            np.testing.assert_array_equal(counts, np.reshape(want, np.shape(ids)))
        else:   # round-trip through a fresh object, sometimes of a larger capacity
            state = cache.state_dict()
            assert_state_equal(state, ref.state())
            keys = cache.keys()         # what a checkpoint writes the entries from, a chunk at a time
            assert keys.dtype == np.int64
            np.testing.assert_array_equal(keys, state["keys"])
            tracked, rows, counts, last = cache.entries(keys)
            assert tracked.all()
            for got, field in ((rows, "rows"), (counts, "counts"), (last, "last_seen")):
                assert got.dtype == state[field].dtype
                np.testing.assert_array_equal(got, state[field])
            policy = len(config) > 4 and config[4] is not None
            bigger = int(rng.random() < 0.3 and cache.capacity < (2 * config[0] if policy else 10_000))
            fresh = recboost.HashCache(cache.capacity * (1 + bigger), 0, 0, not config[3])
            fresh.load_state_dict(state)
            if bigger:
                ref.capacity *= 2
            cache = fresh
        assert len(cache) == ref.summary()["size"]
        assert cache.capacity == ref.capacity
        assert cache.stats() == ref.summary()
    assert_state_equal(cache.state_dict(), ref.state())
    # the sequences really exercised every feature
    s = ref.stats
    if config[1] >= 1:          # t = 0 admits at the first sighting, like -1
        assert s["rejected"] > 0
    if config[2] >= 0:
        assert s["evicted"] > 0 and s["forgotten"] + s["evicted"] > 0
    assert (s["grown"] > 0) if config[3] else (s["overflowed"] > 0 or config[0] == 64 or len(config) > 4)
    if len(config) > 4 and config[4] is not None:         # a full table replaced ids, by its policy
        assert s["replaced"] > (50 if len(config) <= 6 else 20) and s["overflowed"] > 0
    if len(config) > 6:                                   # the sketch aged, and held counts of ids it does not track
        assert s["aged"] > 0 and s["forgotten"] == 0 and any(v for row in ref.sketch.rows for v in row)


def _both_backends(*args, **kwargs):
    """``{"py": twin, "fast": compiled}``: a HashCache of each backend made with these arguments, each
    checking its arguments as ``recboost.HashCache`` does."""
    return {b: type("HashCache", (recboost._HashCacheChecks, recboost._backend_kernels(b)["HashCache"]), {})(
        *args, **kwargs) for b in ("py", "fast")}


@pytest.mark.parametrize("policy, counter", [(None, "exact"), ("lru", "exact"), ("lfu", "exact"),
                                             (None, "sketch"), ("lru", "sketch"), ("lfu", "sketch")])
def test_backends_agree_at_scale(policy, counter):
    """Both backends on the same 400k-id stream (rehashes, mass eviction, growth or, with a policy,
    replacement in a full table; with the sketch, a Zipf stream so ids pass the threshold, and aging):
    identical bits."""
    if not recboost.FAST_BACKEND:
        pytest.skip("compiled-vs-twin parity needs the compiled backend; the model-based test covers the twin")
    sketch = dict(admission_counter="sketch", sketch_width=4096, sketch_depth=3, sketch_window=2000) \
        if counter == "sketch" else {}
    caches = _both_backends(1000, access_threshold=1, eviction_threshold=3, grow=policy is None,
                            eviction_policy=policy, **({"lfu_half_life": 2} if policy == "lfu" else {}), **sketch)
    rng = np.random.default_rng(7)
    for step in range(40):
        if sketch:
            ids = (rng.zipf(1.2, size=(10, 1000)) * 7919 + step // 5 * 1_000_003) % (1 << 40)
        else:
            ids = rng.integers(0, 60_000 + 2_000 * step, size=(10, 1000), dtype=np.int64)
        rows = {b: c.lookup(ids, timestamp=step) for b, c in caches.items()}
        np.testing.assert_array_equal(rows["py"], rows["fast"])
        probe = ids.ravel()[::7] + step % 2
        np.testing.assert_array_equal(caches["py"].counts(probe), caches["fast"].counts(probe))
        replaced = {b: c.take_replaced() for b, c in caches.items()}
        for got, want in zip(replaced["fast"], replaced["py"]):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        if step % 7 == 6:
            freed = {b: c.evict() for b, c in caches.items()}
            np.testing.assert_array_equal(freed["py"][0], freed["fast"][0])
            np.testing.assert_array_equal(freed["py"][1], freed["fast"][1])
            assert freed["py"][1].size > 0 or policy is not None     # a policy replaces the old ids first
    assert_state_equal(caches["fast"].state_dict(), caches["py"].state_dict())
    assert caches["py"].stats()["grown" if policy is None else "replaced"] > 0
    if sketch:
        assert caches["py"].stats()["aged"] > 10 and caches["py"].stats()["candidates"] == 0


def test_a_map_of_64_mb_and_more_is_set_empty_on_two_threads_and_holds_the_same_entries():
    """A compiled map of 64 MB or more has its upper half set empty by a second thread (its first touch,
    on two cores): grown into by a lookup (4M slots, 128 MB) and rebuilt by ``load_state_dict``, it
    holds exactly the entries the twin holds (a slot left unset would read as an entry), and every id
    finds its row."""
    if not recboost.FAST_BACKEND:
        pytest.skip("the map is the compiled backend's (the twin keeps sorted arrays)")
    caches = _both_backends(1 << 21)
    ids = np.random.default_rng(3).choice(1 << 50, size=2_000_000, replace=False).astype(np.int64)
    rows = {b: c.lookup(ids, timestamp=1) for b, c in caches.items()}
    np.testing.assert_array_equal(rows["fast"], rows["py"])
    state = caches["py"].state_dict()
    assert_state_equal(caches["fast"].state_dict(), state)
    rebuilt = _both_backends(1 << 21)["fast"]
    rebuilt.load_state_dict(state)
    assert_state_equal(rebuilt.state_dict(), state)
    np.testing.assert_array_equal(rebuilt.lookup(ids[::-1], timestamp=2), rows["py"][::-1])


def test_semantics_by_hand(backend):
    """The documented rule on a case worked out by hand."""
    c = recboost.HashCache(5, access_threshold=1, eviction_threshold=2)
    # 7 is seen twice in one batch: its count exceeds 1 at its 2nd element, and both elements
    # share the row; 8 is seen once: default row 0.
    np.testing.assert_array_equal(c.lookup([7, 8, 7], timestamp=10), [2, 0, 2])
    np.testing.assert_array_equal(c.lookup([[8], [9]], timestamp=11), [[3], [0]])
    assert len(c) == 2 and c.stats()["rejected"] == 2 and c.stats()["admitted"] == 2
    np.testing.assert_array_equal(c.lookup([9, 10, 10], timestamp=12), [4, 0, 0])  # table full
    assert c.stats()["overflowed"] == 2 and c.capacity == 5
    ids, rows = c.evict(13)                 # 13 - 10 > 2: 7 goes; 8 (11) and 9 (12) stay
    np.testing.assert_array_equal(ids, [7])
    np.testing.assert_array_equal(rows, [2])
    np.testing.assert_array_equal(c.lookup([10], timestamp=13), [2])   # 10 takes the freed row
    np.testing.assert_array_equal(c.find([7, 8, 10, 99]), [0, 3, 2, 0])
    assert c.step == 4 and c.now == 13


def test_growth_doubles_and_reports(backend):
    c = recboost.HashCache(4, grow=True)
    rows = c.lookup(np.arange(100, 107))
    np.testing.assert_array_equal(rows, np.arange(2, 9))
    assert c.capacity == 16 and c.stats()["grown"] == 2 and len(c) == 7
    nogrow = recboost.HashCache(4)
    np.testing.assert_array_equal(nogrow.lookup([5, 6, 7, 6]), [2, 3, 0, 3])
    assert nogrow.stats()["overflowed"] == 1 and nogrow.capacity == 4


def test_eviction_disabled_and_step_clock(backend):
    c = recboost.HashCache(10)
    c.lookup([1, 2])
    ids, rows = c.evict(10 ** 9)
    assert ids.size == 0 and rows.size == 0 and len(c) == 2
    e = recboost.HashCache(10, eviction_threshold=1)
    for step in range(4):                    # no timestamps: the time is the step 0, 1, 2, 3
        e.lookup([step])
    np.testing.assert_array_equal(e.evict()[0], [0, 1])      # now = 3: 3 - 1 > 1 but 3 - 2 = 1


def test_state_dict_into_larger_capacity(backend):
    c = recboost.HashCache(6, access_threshold=0, eviction_threshold=5, grow=False)
    c.lookup([1, 2, 2, 3, 4, 5, 6], timestamp=1)
    big = recboost.HashCache(64)
    big.load_state_dict(c.state_dict())
    assert big.capacity == 64 and big.access_threshold == 0 and big.eviction_threshold == 5
    np.testing.assert_array_equal(big.find([1, 2, 3, 4, 5, 6]), c.find([1, 2, 3, 4, 5, 6]))
    # the ids that overflowed before now get rows
    np.testing.assert_array_equal(big.lookup([5, 6], timestamp=2), [6, 7])
    small = recboost.HashCache(3)
    small.load_state_dict(c.state_dict())
    assert small.capacity == 6


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(capacity=2), ValueError, "'capacity' must be an int >= 3, but got 2"),
    (dict(capacity=2 ** 31), ValueError, "'capacity' must be an int <= 2147483647"),
    (dict(capacity=10.0), TypeError, "'capacity' must be an int"),
    (dict(capacity=10, access_threshold=-2), ValueError, "'access_threshold' must be an int >= -1, but got -2"),
    (dict(capacity=10, eviction_threshold=-5), ValueError, "'eviction_threshold' must be an int >= -1"),
    (dict(capacity=10, grow=1), TypeError, "'grow' must be a bool"),
])
def test_constructor_errors(backend, kwargs, exc, text):
    with pytest.raises(exc, match="For 'HashCache', " + text.replace("(", r"\(")):
        recboost.HashCache(**kwargs)


def test_constructor_refuses_arguments_it_does_not_take_naming_them(backend):
    """HashCache's arguments are its settings (one rule each), named in recboost's error form."""
    with pytest.raises(TypeError, match=r"For 'HashCache', the keyword arguments must be among \[.*'lfu_half_life', "
                                        r".*\], but got 'half_life'\."):
        recboost.HashCache(10, half_life=5)
    with pytest.raises(TypeError, match=r"For 'HashCache', 'grow' must be given once \(positionally or by keyword\), "
                                        r"but got True\."):
        recboost.HashCache(10, -1, -1, False, grow=True)
    with pytest.raises(TypeError, match=r"For 'HashCache', the positional arguments must be at most \d+ \(capacity, "
                                        r"access_threshold, eviction_threshold, grow, .*\), but got 40\."):
        recboost.HashCache(*range(3, 43))


def test_call_errors(backend):
    c = recboost.HashCache(10, eviction_threshold=1)
    with pytest.raises(TypeError, match="For 'HashCache.lookup', 'ids' must be an array of integers"):
        c.lookup(np.array([1.5, 2.0]))
    with pytest.raises(TypeError, match="'timestamp' must be an int"):
        c.lookup([1], timestamp=1.5)
    with pytest.raises(ValueError, match="'timestamp' must be an int <= "):
        c.lookup([1], timestamp=2 ** 62 + 1)
    with pytest.raises(TypeError, match="For 'HashCache.evict', 'now' must be an int"):
        c.evict("soon")
    with pytest.raises(TypeError, match="For 'HashCache.find', 'ids' must be an array of integers"):
        c.find(["a"])
    with pytest.raises(TypeError, match="For 'HashCache.counts', 'ids' must be an array of integers"):
        c.counts([0.5])
    with pytest.raises(ValueError, match="For 'HashCache.lookup', 'max_admit' must be an int >= -1"):
        c.lookup([1], max_admit=-2)
    assert c.step == 0 and c.stats()["looked_up"] == 0        # failed calls changed nothing
    c.lookup([1, 2, 3])
    good = c.state_dict()
    for key, value, text in [("keys", good["keys"][::-1], "strictly increasing"),
                             ("rows", np.array([2, 2, 3], np.int32), "partition"),
                             ("rows", np.array([2, 3, 9], np.int32), "out of range rows"),
                             ("rows", np.array([2, 3, -2], np.int32), "out of range rows"),
                             ("counts", np.array([1, 1], np.int64), "of one length")]:
        bad = dict(good, **{key: value})
        with pytest.raises(ValueError, match=text):
            recboost.HashCache(10).load_state_dict(bad)
    assert good["rows"].tolist() == [2, 3, 4] and good["next_row"] == 5 and good["free_rows"].size == 0
    for changes in (dict(free_rows=np.array([4], np.int32), next_row=6),     # a row owned and free, row 5 in neither
                    dict(next_row=6),                                        # row 5 neither owned nor free
                    dict(free_rows=np.array([3], np.int32))):                # a row owned and free, one too many
        with pytest.raises(ValueError, match=r"'state\['rows'\]' must be owned rows that with the free rows "
                           r"partition \[2, next_row\), but got 'overlapping or missing rows'"):
            recboost.HashCache(10).load_state_dict(dict(good, **changes))
    recboost.HashCache(10).load_state_dict(dict(good, free_rows=np.array([5], np.int32), next_row=6))  # a partition
    tracemalloc.start()                                 # an edited next_row far past the rows read: refused
    try:                                                # without a mark array of next_row bytes
        with pytest.raises(ValueError, match=r"'state\['rows'\]' must be owned rows that with the free rows"):
            recboost.HashCache(10).load_state_dict(dict(good, capacity=2 ** 31 - 1, next_row=2 ** 31 - 1))
        assert tracemalloc.get_traced_memory()[1] < 1 << 24
    finally:
        tracemalloc.stop()
    fresh = recboost.HashCache(10)
    fresh.lookup([7])
    for key, value, exc, text in [
            ("access_threshold", -5, ValueError, r"'state\['access_threshold'\]' must be an int >= -1, but got -5"),
            ("grow", 1, TypeError, r"'state\['grow'\]' must be a bool"),
            ("step", -1, ValueError, r"'state\['step'\]' must be an int >= 0"),
            ("now", 2 ** 63, ValueError, r"'state\['now'\]' must be an int <= 4611686018427387904"),
            ("evicted", 1.5, TypeError, r"'state\['evicted'\]' must be an int"),
            ("next_row", 11, ValueError, r"'state\['next_row'\]' must be an int <= 10")]:
        with pytest.raises(exc, match="For 'HashCache.load_state_dict', " + text):
            fresh.load_state_dict(dict(good, **{key: value}))
        assert fresh.step == 1 and len(fresh) == 1 and fresh.find([7, 1])[0] == 2     # unchanged
    bad = dict(good)
    del bad["step"]
    with pytest.raises(ValueError, match=r"'state\['step'\]' must be an int >= 0, but got missing"):
        recboost.HashCache(10).load_state_dict(bad)
    with pytest.raises(TypeError, match="a dict made by HashCache.state_dict"):
        recboost.HashCache(10).load_state_dict([1, 2])


# ---- edges: 0-d ids, the ends of the time range, a lookup that fails --------------------------------
def test_zero_d_ids_keep_their_shape(backend):
    c = recboost.HashCache(10)
    for ids in (np.array(7), np.int64(7), 7):
        assert c.lookup(ids).shape == ()
        assert c.find(ids).shape == () and c.counts(ids).shape == ()
    assert int(c.find(7)) == 2 and int(c.counts(np.array(7))) == 3


@pytest.mark.parametrize("last, now, threshold, evicted", [
    (-2 ** 62, 2 ** 62, 0, True),             # now - last = 2**63: one past int64
    (-2 ** 62, 2 ** 62, 2 ** 62, True),
    (0, 2 ** 62, 2 ** 62, False),             # exactly the threshold: kept
    (2 ** 62, -2 ** 62, 0, False),            # an id seen after "now"
])
def test_eviction_at_the_ends_of_the_time_range(backend, last, now, threshold, evicted):
    c = recboost.HashCache(10, eviction_threshold=threshold)
    c.lookup([5], timestamp=last)
    ids, _ = c.evict(now)
    assert ids.tolist() == ([5] if evicted else [])
    assert len(c) == (0 if evicted else 1)


def test_state_with_times_out_of_range_is_refused(backend):
    c = recboost.HashCache(10)
    c.lookup([5])
    state = dict(c.state_dict(), last_seen=np.array([-2 ** 62 - 1], np.int64))
    with pytest.raises(ValueError, match=r"'state\['last_seen'\]' must be times within \+-2\*\*62"):
        recboost.HashCache(10).load_state_dict(state)

def test_state_counts_and_ids_that_are_no_integers_or_negative_counts_are_refused(backend):
    """A state's integer arrays are taken as integers in their dtype's range only: float counts (NaN, 1.5)
    or ids, and uint64 values past int64, were cast on the way (NaN to -2**63); counts must be >= 0. Each is
    a ValueError naming the field, and the cache is unchanged."""
    c = recboost.HashCache(10)
    c.lookup([5, 6, 7])
    state = c.state_dict()
    target = recboost.HashCache(10)
    target.lookup([1])
    before = target.state_dict()
    for field, value, expected in (
            ("counts", np.array([np.nan, 1.5, 1.0]), r"an array of int64 \(integers in its range\)"),
            ("keys", np.array([5.0, 6.0, 7.0]), r"an array of int64 \(integers in its range\)"),
            ("counts", np.array([2 ** 63] * 3, np.uint64), r"an array of int64 \(integers in its range\)"),
            ("counts", np.array([-5, 1, 1]), r"counts >= 0, but got '-5 at least'")):
        with pytest.raises(ValueError, match=r"'state\['%s'\]' must be %s" % (field, expected)):
            target.load_state_dict(dict(state, **{field: value}))
        after = target.state_dict()
        assert all(np.array_equal(after[k], before[k]) for k in before), field
    target.load_state_dict(dict(state, counts=state["counts"].astype(np.int32)))    # integers of another width
    assert target.state_dict()["counts"].tolist() == state["counts"].tolist()


_FAILING_LOOKUP = r"""
import resource, sys
import os

import numpy as np
import recboost
assert recboost.FAST_BACKEND == (sys.argv[1] == "fast")
c = recboost.HashCache(1 << 20, access_threshold=0, eviction_threshold=100)
c.lookup(np.arange(1000), timestamp=50)
before = c.state_dict()
big = np.arange(10, 10 + (6 << 20), dtype=np.int64)           # 48 MB of new ids, made before the limit
with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
room = pages * resource.getpagesize() + (64 << 20)              # too little for the batch's working space
resource.setrlimit(resource.RLIMIT_AS, (room, resource.RLIM_INFINITY))
try:
    c.lookup(big, timestamp=60)
except MemoryError:
    pass
else:
    sys.exit("no MemoryError")
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = c.state_dict()
for key, value in before.items():
    assert np.array_equal(after[key], value), key
assert c.step == 1 and c.now == 50 and c.stats()["looked_up"] == 1000
assert c.lookup(np.array([2000]), timestamp=61).tolist() == [1002]
print("unchanged")
"""


def test_a_lookup_that_fails_changes_nothing(backend, tmp_path):
    """A MemoryError inside lookup (address space limited in a child process) leaves step, clock,
    counts and rows as they were, and the cache keeps working."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, RECBOOST_NO_EXTENSIONS="1" if backend.name == "py" else "0", PYTHONPATH=root)
    env.pop("RECBOOST_REQUIRE_EXTENSIONS", None)
    script = tmp_path / "failing_lookup.py"
    script.write_text(_FAILING_LOOKUP)
    done = subprocess.run([sys.executable, str(script), backend.name], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stdout + done.stderr[-3000:]


# ---- the sketch admission counter (issue #25 item 2) ------------------------------------------------
def test_sketch_semantics_by_hand(backend):
    """The documented rule on a case worked out by hand (a sketch wide enough for no collision)."""
    c = recboost.HashCache(6, access_threshold=2, eviction_threshold=5, admission_counter="sketch", sketch_width=1024,
                           sketch_depth=2, sketch_window=5)
    # 7 twice: its count 2 does not pass 2: rejected, and counted in the sketch only (not tracked)
    np.testing.assert_array_equal(c.lookup([7, 7], timestamp=1), [0, 0])
    assert c.stats()["candidates"] == 0 and c.state_dict()["keys"].size == 0
    assert c.counts([7, 8]).tolist() == [2, 0]
    # its third sighting: the sketch's 2 + 1 passes 2, 7 takes a row and an exact count
    np.testing.assert_array_equal(c.lookup([7, 9], timestamp=2), [2, 0])
    assert c.counts([7, 9]).tolist() == [3, 1] and len(c) == 1
    assert c.state_dict()["keys"].tolist() == [7] and c.state_dict()["sketch_pending"] == 3
    # 9 (1 + 1 = 2) and 10 (1) rejected: 5 counts since the start, the window: every counter halves
    np.testing.assert_array_equal(c.lookup([9, 10], timestamp=3), [0, 0])
    assert c.stats()["aged"] == 1 and c.state_dict()["sketch_pending"] == 0
    assert c.counts([9, 10, 7]).tolist() == [1, 0, 3]
    # eviction by time forgets admitted ids only; the sketch keeps its counts
    np.testing.assert_array_equal(c.evict(10)[0], [7])
    assert c.stats()["forgotten"] == 0 and c.counts([9]).tolist() == [1]


def test_sketch_default_sizes(backend):
    small = recboost.HashCache(100, admission_counter="sketch")
    assert (small.sketch_width, small.sketch_depth, small.sketch_window) == (1024, 4, 512)
    c = recboost.HashCache(1000, admission_counter="sketch", sketch_depth=2)
    assert (c.admission_counter, c.sketch_width, c.sketch_depth, c.sketch_window) == ("sketch", 4000, 2, 2000)
    assert c.stats()["sketch_bytes"] == 4 * 4000 * 2
    exact = recboost.HashCache(1000)
    assert (exact.admission_counter, exact.sketch_width, exact.stats()["sketch_bytes"]) == ("exact", 0, 0)


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(admission_counter="bloom"), ValueError,
     "'admission_counter' must be one of [None, 'exact', 'sketch'], but got 'bloom'"),
    (dict(admission_counter="exact", sketch_width=64), ValueError, "'sketch_width' must be None with "
     "admission_counter='exact' (a setting of admission_counter='sketch': Sketch's width), but got 64"),
    (dict(admission_counter="exact", sketch_window=64), ValueError,
     "'sketch_window' must be None with admission_counter='exact'"),
    (dict(admission_counter="sketch", sketch_width=0), ValueError, "'sketch_width' must be an int >= 1, but got 0"),
    (dict(admission_counter="sketch", sketch_depth=17), ValueError, "'sketch_depth' must be an int <= 16, but got 17"),
    (dict(admission_counter="sketch", sketch_window=2.5), TypeError, "'sketch_window' must be an int"),
    (dict(admission_counter="sketch", sketch_width=2 ** 31), ValueError, "'sketch_width' must be an int <= 2147483647"),
])
def test_sketch_constructor_errors(backend, kwargs, exc, text):
    import re
    with pytest.raises(exc, match="For 'HashCache', " + re.escape(text)):
        recboost.HashCache(10, **kwargs)


def test_sketch_state_round_trip_and_errors(backend):
    c = recboost.HashCache(10, access_threshold=1, admission_counter="sketch", sketch_width=64, sketch_depth=3,
                           sketch_window=40)
    c.lookup(np.arange(30) % 13, timestamp=1)
    good = c.state_dict()
    assert good["sketch"].dtype == np.int32 and good["sketch"].size == 64 * 3 and good["sketch"].any()
    again = recboost.HashCache(10)                      # the state brings its admission counter
    again.load_state_dict(good)
    assert again.admission_counter == "sketch"
    assert_state_equal(again.state_dict(), good)
    for cache in (c, again):                            # and both go on alike
        cache.lookup(np.arange(50) % 17, timestamp=2)
    assert_state_equal(again.state_dict(), c.state_dict())
    # a state from before admission counters loads as "exact"
    old = recboost.HashCache(10)
    old.lookup([1, 2, 2])
    legacy = {k: v for k, v in old.state_dict().items() if not k.startswith("sketch") and k not in
              ("admission_counter", "aged")}
    fresh = recboost.HashCache(10)
    fresh.load_state_dict(legacy)
    assert fresh.admission_counter == "exact" and fresh.stats() == old.stats()
    for changes, text in [
            (dict(sketch=good["sketch"][:-1]), r"'state\['sketch'\]' must be 192 counters >= 0 \(sketch_depth x "
                                               r"sketch_width\), but got '191 values'"),
            (dict(sketch=np.where(np.arange(192) == 5, -1, good["sketch"]).astype(np.int32)), r".*192 values with negative ones"),
            (dict(sketch_pending=40), r"'state\['sketch_pending'\]' must be an int below sketch_window \(40\)"),
            (dict(sketch_depth=0), r"'state\['sketch_depth'\]' must be an int >= 1 with admission_counter='sketch'"),
            (dict(admission_counter="exact"), r"'state\['sketch_width'\]' must be 0 with admission_counter='exact'"),
            (dict(rows=np.full(good["rows"].size, -1, np.int32), next_row=2, free_rows=np.empty(0, np.int32)),
             r"'state\['rows'\]' must be rows >= 0 with admission_counter='sketch'")]:
        with pytest.raises(ValueError, match="For 'HashCache.load_state_dict', " + text):
            fresh.load_state_dict(dict(good, **changes))
        assert fresh.admission_counter == "exact"       # unchanged


def test_lfu_decay_across_the_whole_time_range(backend):
    """Times span [-2**62, 2**62]: an id last seen at one end and seen again at the other, 2**63
    time units later (past int64), has decayed to nothing, as the dict reference (Python ints) says;
    one period later than a sighting halves its count."""
    cache, ref = recboost.HashCache(8, 0, -1, False, "lfu", 1), RefCache(8, 0, -1, False, "lfu", 1)
    for c in (cache, ref):
        c.lookup(np.array([1, 1, 1, 1, 1, 2, 2, 2, 2, 2]), -2 ** 62)
        c.lookup(np.array([2]), -2 ** 62 + 2)            # two half-lives: 5 -> 1, then + 1
        c.lookup(np.array([1]), 2 ** 62)                 # 2**63 later: 5 -> 0, then + 1
    assert cache.counts(np.array([1, 2])).tolist() == [1, 2]
    assert [ref.entries[k][1] for k in (1, 2)] == [1, 2]


@pytest.mark.parametrize("policy, evict", [(None, False), (None, True), ("lru", False), ("lru", True),
                                           ("lfu", True)])
def test_sketch_tracks_at_most_twice_the_capacity(backend, policy, evict):
    """A stream of 100x more distinct ids than rows: with the sketch, the ids the cache tracks (rows
    and candidates: the entries of its state) stay <= 2x its capacity after every lookup (in fact
    <= its rows), with and without a policy and time eviction; the exact counter's candidates grow
    past that (what the sketch is for). The sketch still admits the stream's frequent ids."""
    capacity = 1000
    caches = {counter: recboost.HashCache(capacity, 1, 5 if evict else -1, eviction_policy=policy,
                                          admission_counter=counter) for counter in ("exact", "sketch")}
    rng = np.random.default_rng(3)
    head = rng.integers(0, 2 ** 62, 300)
    distinct = set()
    for step in range(100):
        ids = np.concatenate([head[np.minimum(rng.zipf(1.3, 1000), head.size) - 1], rng.integers(0, 2 ** 62, 1000)])
        distinct.update(ids.tolist())
        for cache in caches.values():
            cache.lookup(ids, timestamp=step)
            if evict and step % 3 == 2:
                cache.evict()
        st = caches["sketch"].stats()
        assert st["size"] + st["candidates"] <= 2 * capacity and st["candidates"] == 0 and st["size"] <= capacity
        if step % 10 == 9:
            assert caches["sketch"].state_dict()["keys"].size <= 2 * capacity
    assert len(distinct) >= 100 * capacity
    assert caches["exact"].stats()["candidates"] > 2 * capacity
    head_rows = caches["sketch"].find(head[:50])
    assert np.count_nonzero(head_rows) >= 45            # the frequent ids hold rows


def test_sketch_false_admissions_below_the_documented_bound(backend):
    """docs/tables.md: with the default window (sketch_width // 2), on the seeded Zipf stream of
    bench/bench_admission.py, false admissions stay below 1% of decisions at t = 1; the sketch never
    counts below the truth before it ages (no late admission when the stream is shorter than the
    window); a sketch filled past its width (window = width) exceeds the bound (the measure can fail)."""
    from bench.bench_admission import admission_errors
    shown = admission_errors(1 << 16, steps=60)
    assert shown["decisions"] > 50_000 and shown["admitted"] > 5_000
    assert shown["false_per_decision"] < 0.01
    long_memory = admission_errors(1 << 19, steps=60)              # window 262144 > 60 x 4096 counts
    assert long_memory["aged"] == 0 and long_memory["late_per_admission"] == 0
    assert long_memory["false_per_decision"] < 0.01
    assert admission_errors(1 << 16, window=1 << 16, steps=60)["false_per_decision"] > 0.01


def test_keys_between_gives_a_ranges_ids_sorted_and_sample_keys_some_of_them(backend):
    """``keys_between(low, high, out)``: the ids ``low <= id <= high`` (both ends in, the int64 extremes
    too), sorted into ``out``, and their count, also when ``out`` is too small for them (a checkpoint
    then calls again with room); ranges that tile the int64 line give ``keys()``. ``sample_keys(n)``:
    at most ``n`` distinct ids of entries, spread over them."""
    rng = np.random.default_rng(5)
    ids = np.unique(np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64),
                                    [-2 ** 63, 2 ** 63 - 1, 0, 5, 6]]))
    cache = recboost.HashCache(2 * ids.size, access_threshold=1)
    cache.lookup(ids)                           # every id a candidate (seen once) ...
    cache.lookup(ids[::3])                      # ... and a third of them with a row
    keys = cache.keys()
    np.testing.assert_array_equal(keys, ids)
    for low, high in [(-2 ** 63, 2 ** 63 - 1), (-2 ** 63, -2 ** 63), (2 ** 63 - 1, 2 ** 63 - 1), (5, 6), (5, 5),
                      (1, 4), (int(ids[100]), int(ids[2000]))]:
        want = ids[(ids >= low) & (ids <= high)]
        out = np.full(want.size + 3, 7, np.int64)
        assert cache.keys_between(low, high, out) == want.size, (low, high)
        np.testing.assert_array_equal(out[:want.size], want)        # (past them: scratch)
        if want.size > 1:
            small = np.zeros(want.size - 1, np.int64)
            assert cache.keys_between(low, high, small) == want.size
            assert np.isin(small, want).all()
    cuts = [-2 ** 63] + sorted(int(c) for c in rng.choice(ids, 9, replace=False)) + [2 ** 63]
    tiled = []
    for low, nxt in zip(cuts[:-1], cuts[1:]):
        out = np.empty(ids.size, np.int64)
        tiled.append(out[:cache.keys_between(low, nxt - 1, out)])
    np.testing.assert_array_equal(np.concatenate(tiled), keys)
    for n in (1, 100, 10 ** 6):
        sample = cache.sample_keys(n)
        assert sample.dtype == np.int64 and 1 <= sample.size <= min(n, ids.size)
        assert np.unique(sample).size == sample.size and np.isin(sample, ids).all()
    assert cache.sample_keys(100).size >= 50        # spread over the slots: most of n found an entry
    empty = recboost.HashCache(10)
    assert empty.keys_between(-2 ** 63, 2 ** 63 - 1, np.empty(0, np.int64)) == 0 and empty.sample_keys(5).size == 0


def test_keys_between_and_sample_keys_refuse_bad_arguments_naming_them(backend):
    """Both backends alike: an ``out`` the kernel cannot fill (another dtype, a strided view, read-only, not an
    array) is a TypeError naming it, not Cython's buffer error or a copy filled instead; bounds outside int64 or
    not ints (a float would be cut), and ``n`` below 1 or not an int (0 gave one id), name theirs."""
    cache = recboost.HashCache(64)
    cache.lookup(np.arange(10))
    readonly = np.empty(10, np.int64)
    readonly.flags.writeable = False
    out = r"'HashCache.keys_between', 'out' must be a writeable C-contiguous 1-D int64 numpy array, but got "
    for bad, given in [(np.empty(10, np.int32), r"'a int32 array of shape \(10,\)'"),
                       (np.empty(20, np.int64)[::2], r"'a int64 array of shape \(10,\)'"),
                       (np.empty((2, 5), np.int64), r"'a int64 array of shape \(2, 5\)'"),
                       (readonly, r"'a int64 array of shape \(10,\), read-only'"), ([0] * 10, r"\[0, 0, .*\]")]:
        with pytest.raises(TypeError, match=out + given):
            cache.keys_between(0, 9, bad)
    for low, high, name in [(2 ** 63, 9, "low"), (0, -2 ** 63 - 1, "high"), (0.5, 9, "low"), (0, 8.9, "high")]:
        with pytest.raises((ValueError, TypeError), match=r"'HashCache.keys_between', '%s' must be" % name):
            cache.keys_between(low, high, np.empty(10, np.int64))
    for n in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match=r"'HashCache.sample_keys', 'n' must be an int"):
            cache.sample_keys(n)
    got = np.empty(10, np.int64)
    assert cache.keys_between(np.int64(0), np.int64(9), got) == 10 and got.tolist() == list(range(10))
