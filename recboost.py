"""recboost: training acceleration for recommendation (CTR) models on MindSpore, CPU first.

One flat module. It holds AutoBoost and the boost algorithms (same names and arguments as
``mindspore.boost``), train-step cells and loss scaling that work on CPU, mixed precision levels,
hash embeddings with feature admission, eviction and growth (the Rec SDK features), and
``RecModel`` with ``online_train`` over unbounded streams (same names as ``mindspore_rec``).

Host-side hot paths have a compiled twin in ``_fast.pyx`` (built as ``_recboost_fast``). Without it
this file still works on its own (vendor it by copying), on numpy, only slower:

- ``recboost.FAST_BACKEND`` is True when the compiled kernels are live;
- ``RECBOOST_NO_EXTENSIONS=1`` forces the numpy fallback;
- ``RECBOOST_REQUIRE_EXTENSIONS=1`` makes a missing or stale extension an ImportError.

Copyright 2026 the recboost authors. Licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0). This notice travels with vendored copies.
"""

__version__ = "0.1.0"
__license__ = "Apache-2.0"

# =====================================================================================================
# Imports and backend selection
# =====================================================================================================
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype


def _select_backend():
    """Return ``(compiled module or None, reason it is not used)``; the one place that decides."""
    no_ext = os.environ.get("RECBOOST_NO_EXTENSIONS") == "1"
    require = os.environ.get("RECBOOST_REQUIRE_EXTENSIONS") == "1"
    if no_ext and require:
        raise ImportError("RECBOOST_NO_EXTENSIONS=1 and RECBOOST_REQUIRE_EXTENSIONS=1 are both set; "
                          "unset one of them.")
    if no_ext:
        return None, "forced off by RECBOOST_NO_EXTENSIONS=1"
    try:
        import _recboost_fast as mod
    except ImportError as exc:
        reason = "the compiled extension _recboost_fast cannot be imported (%s); " \
                 "build it with `pip install -e .`" % exc
    else:
        if getattr(mod, "__version__", None) == __version__:
            return mod, ""
        reason = ("the compiled extension %s is version %r but recboost.py is %r; rebuild it with "
                  "`pip install -e .`" % (mod.__file__, getattr(mod, "__version__", None), __version__))
    if require:
        raise ImportError("RECBOOST_REQUIRE_EXTENSIONS=1 but " + reason)
    return None, reason


_fast, FAST_BACKEND_REASON = _select_backend()
#: True when the compiled kernels of ``_fast.pyx`` are live, False on the numpy fallback.
FAST_BACKEND = _fast is not None

# =====================================================================================================
# Constants
# =====================================================================================================

# =====================================================================================================
# Errors and argument checks
# =====================================================================================================
# One message form everywhere: where, which argument, what was expected, what was given.


def _fail(where, name, expected, got, exc=ValueError):
    """Raise ``exc`` with recboost's one error form."""
    raise exc("For '%s', %s must be %s, but got %r." % (where, name, expected, got))


def _check_bool(where, name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(where, "'%s'" % name, "a bool", value, TypeError)
    return bool(value)


def _check_int(where, name, value, minimum=None, maximum=None):
    """An int (bools refused) within ``[minimum, maximum]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        _fail(where, "'%s'" % name, "an int", value, TypeError)
    if minimum is not None and value < minimum:
        _fail(where, "'%s'" % name, "an int >= %s" % minimum, value)
    if maximum is not None and value > maximum:
        _fail(where, "'%s'" % name, "an int <= %s" % maximum, value)
    return int(value)


def _check_number(where, name, value, minimum=None, maximum=None, strict_min=False):
    """A finite real number (bools refused) within the bounds."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(where, "'%s'" % name, "a number", value, TypeError)
    value = float(value)
    if not np.isfinite(value):
        _fail(where, "'%s'" % name, "a finite number", value)
    if minimum is not None and (value <= minimum if strict_min else value < minimum):
        _fail(where, "'%s'" % name, "a number %s %s" % (">" if strict_min else ">=", minimum), value)
    if maximum is not None and value > maximum:
        _fail(where, "'%s'" % name, "a number <= %s" % maximum, value)
    return value


def _check_one_of(where, name, value, choices):
    if value not in choices:
        _fail(where, "'%s'" % name, "one of %s" % list(choices), value)
    return value


def _check_no_kwargs(where, kwargs, allowed=()):
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        _fail(where, "the keyword arguments", "among %s" % sorted(allowed), unknown[0], TypeError)


# =====================================================================================================
# Configuration
# =====================================================================================================

# =====================================================================================================
# Host kernels: pure-numpy twins of _fast.pyx
# =====================================================================================================
# Every compiled kernel ``_recboost_fast.NAME`` has a twin ``_py_NAME`` here with bit-identical
# results. The block at the end of this section binds the public names once.

# ---- hash cache: id -> row map with admission, eviction and growth (twin of _fast.HashCache) --------
#: Row every id maps to while it is not admitted (or could not get a row): never owned by an id.
HASH_DEFAULT_ROW = 0
#: Row no id ever gets; callers use it as padding (HashEmbedding pads its unique rows with it).
HASH_SCRATCH_ROW = 1
_HASH_RESERVED_ROWS = 2
_HASH_MAX_CAPACITY = 2 ** 31 - 1        # rows are int32
_HASH_TIME_LIMIT = 2 ** 62              # |times| and thresholds stay below this: no int64 overflow
_HASH_STAT_NAMES = ("admitted", "rejected", "overflowed", "evicted", "forgotten", "grown", "looked_up")


def _hash_cache_config(capacity, access_threshold, eviction_threshold, grow):
    """Validated ``(capacity, access_threshold, eviction_threshold, grow)`` of a HashCache (both backends)."""
    where = "HashCache"
    capacity = _check_int(where, "capacity", capacity, _HASH_RESERVED_ROWS + 1, _HASH_MAX_CAPACITY)
    access_threshold = _check_int(where, "access_threshold", access_threshold, -1, _HASH_TIME_LIMIT)
    eviction_threshold = _check_int(where, "eviction_threshold", eviction_threshold, -1, _HASH_TIME_LIMIT)
    return capacity, access_threshold, eviction_threshold, _check_bool(where, "grow", grow)


def _hash_ids(where, ids):
    """``ids`` as a C-contiguous int64 array (any shape); integer dtypes only (uint64 keeps its bits)."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        _fail(where, "'ids'", "an array of integers", "array of dtype %s" % arr.dtype, TypeError)
    if arr.dtype == np.uint64:
        arr = arr.view(np.int64)
    return np.ascontiguousarray(arr, dtype=np.int64)


def _hash_time(where, name, value):
    """A time (data timestamp or step) as an int within +-2**62."""
    return _check_int(where, name, value, -_HASH_TIME_LIMIT, _HASH_TIME_LIMIT)


def _hash_state_check(where, state):
    """Validate a HashCache state dict; return it with normalised dtypes (shared by both backends)."""
    if not isinstance(state, dict):
        _fail(where, "'state'", "a dict made by HashCache.state_dict()", type(state).__name__, TypeError)
    need = ("keys", "rows", "counts", "last_seen", "free_rows", "next_row", "capacity", "step", "now",
            "access_threshold", "eviction_threshold", "grow") + _HASH_STAT_NAMES
    missing = [k for k in need if k not in state]
    if missing:
        _fail(where, "'state'", "a dict with the key %r" % missing[0], sorted(state))
    out = dict(state)
    for name, dtype in (("keys", np.int64), ("rows", np.int32), ("counts", np.int64),
                        ("last_seen", np.int64), ("free_rows", np.int32)):
        out[name] = np.ascontiguousarray(state[name], dtype=dtype).ravel()
    n = out["keys"].size
    if any(out[name].size != n for name in ("rows", "counts", "last_seen")):
        _fail(where, "the arrays of 'state'", "of one length", [out[k].size for k in
                                                                ("keys", "rows", "counts", "last_seen")])
    if n > 1 and not np.all(out["keys"][1:] > out["keys"][:-1]):
        _fail(where, "state['keys']", "strictly increasing", "unsorted or repeated ids")
    cap = _check_int(where, "state['capacity']", state["capacity"], _HASH_RESERVED_ROWS + 1,
                     _HASH_MAX_CAPACITY)
    nxt = _check_int(where, "state['next_row']", state["next_row"], _HASH_RESERVED_ROWS, cap)
    owned = out["rows"][out["rows"] >= 0]
    if owned.size and (owned.min() < _HASH_RESERVED_ROWS or owned.max() >= nxt):
        _fail(where, "state['rows']", "-1 or in [%d, next_row)" % _HASH_RESERVED_ROWS, "out of range rows")
    free = out["free_rows"]
    if free.size and (np.any(free[1:] <= free[:-1]) or free[0] < _HASH_RESERVED_ROWS or free[-1] >= nxt):
        _fail(where, "state['free_rows']", "increasing rows in [2, next_row)", "unsorted or out of range")
    if owned.size + free.size != nxt - _HASH_RESERVED_ROWS or np.intersect1d(owned, free).size \
            or np.unique(owned).size != owned.size:
        _fail(where, "the rows of 'state'", "owned rows and free rows that partition [2, next_row)",
              "overlapping or missing rows")
    return out


class _py_HashCache:
    """Map arbitrary int64 ids to rows of a device table, with admission, eviction and growth.

    Rows: row 0 (``HASH_DEFAULT_ROW``) is where every id without a row of its own maps, row 1
    (``HASH_SCRATCH_ROW``) is never handed out (padding for callers); ids get rows ``2 ..
    capacity-1``. ``capacity`` is the number of rows of the table, reserved ones included.

    ``lookup(ids, timestamp=None)`` takes a batch of any shape and returns int32 rows of that shape.
    Its time is ``timestamp`` when given (data time), else the number of earlier lookups (the step).
    Every element of the batch, in order, adds 1 to its id's count and sets its last-seen time.
    Admission: an id gets a row at the element where its count first exceeds ``access_threshold``
    (``-1``: at its first element). Rows are handed out in the order of those elements, always the
    lowest free row. All elements of one batch see the row their id holds at the end of the batch
    (so repeats in one batch share a row), or row 0 if it holds none: counted in ``stats()`` as
    ``rejected`` (count still <= threshold) or ``overflowed`` (table full and ``grow`` False; the
    id keeps its count and gets a row once one is free). With ``grow`` the capacity doubles
    whenever a row is needed and none is free (``grown`` counts it, ``capacity`` shows it).

    ``evict(now=None)`` forgets every id whose last-seen time is older than ``eviction_threshold``
    (``now - last_seen > eviction_threshold``; ``now`` defaults to the time of the last lookup) and
    returns ``(freed_ids, freed_rows)`` of the ids that had rows, ordered by row; those rows are
    reused. ``-1`` disables eviction. ``state_dict()`` / ``load_state_dict()`` round-trip all state.
    The compiled backend (``_recboost_fast.HashCache``) gives bit-identical results.
    """

    def __init__(self, capacity, access_threshold=-1, eviction_threshold=-1, grow=False):
        (self._capacity, self._access_threshold, self._eviction_threshold,
         self._grow) = _hash_cache_config(capacity, access_threshold, eviction_threshold, grow)
        self._keys = np.empty(0, np.int64)          # sorted ids (admitted ones and candidates)
        self._rows = np.empty(0, np.int32)          # their rows, -1 for candidates
        self._counts = np.empty(0, np.int64)
        self._last = np.empty(0, np.int64)
        self._free = np.empty(0, np.int32)          # freed rows below _next_row, ascending
        self._next_row = _HASH_RESERVED_ROWS        # rows >= _next_row were never handed out
        self._step = 0
        self._now = 0
        self._stats = dict.fromkeys(_HASH_STAT_NAMES, 0)

    # -- read-only views
    capacity = property(lambda self: self._capacity, doc="Rows of the table (grows with ``grow``).")
    access_threshold = property(lambda self: self._access_threshold)
    eviction_threshold = property(lambda self: self._eviction_threshold)
    grow = property(lambda self: self._grow)
    step = property(lambda self: self._step, doc="Number of lookups so far.")
    now = property(lambda self: self._now, doc="Time of the last lookup (timestamp or step).")

    def __len__(self):
        return int(np.count_nonzero(self._rows >= 0))

    def stats(self):
        """Counters: ids ``size`` (own a row), ``candidates`` (tracked, no row), ``capacity``, and the
        totals ``admitted``, ``rejected``, ``overflowed`` (batch elements sent to the default row),
        ``evicted`` (ids that lost a row), ``forgotten`` (candidates dropped by evict), ``grown``,
        ``looked_up`` (batch elements)."""
        size = len(self)
        out = {"size": size, "candidates": int(self._keys.size) - size, "capacity": self._capacity}
        out.update(self._stats)
        return out

    def _positions(self, uniq):
        pos = np.searchsorted(self._keys, uniq)
        hit = pos < self._keys.size
        hit[hit] = self._keys[pos[hit]] == uniq[hit]
        return pos, hit

    def _allocate(self, m):
        """Up to ``m`` rows, lowest free first, growing the capacity when allowed."""
        avail = self._free.size + self._capacity - self._next_row
        while m > avail and self._grow and self._capacity < _HASH_MAX_CAPACITY:
            self._capacity = min(2 * self._capacity, _HASH_MAX_CAPACITY)
            self._stats["grown"] += 1
            avail = self._free.size + self._capacity - self._next_row
        take = min(m, avail)
        reused, self._free = self._free[:take], self._free[take:]
        fresh = np.arange(self._next_row, self._next_row + take - reused.size, dtype=np.int32)
        self._next_row += fresh.size
        return np.concatenate([reused, fresh])

    def lookup(self, ids, timestamp=None):
        """Rows (int32, shape of ``ids``) for a batch of ids; counts, times and admission as above."""
        where = "HashCache.lookup"
        arr = _hash_ids(where, ids)
        now = self._step if timestamp is None else _hash_time(where, "timestamp", timestamp)
        self._step += 1
        self._now = now
        flat = arr.ravel()
        if flat.size == 0:
            return np.zeros(arr.shape, np.int32)
        uniq, inv, cnt = np.unique(flat, return_inverse=True, return_counts=True)
        pos, hit = self._positions(uniq)
        if not hit.all():
            at = pos[~hit]
            self._keys = np.insert(self._keys, at, uniq[~hit])
            self._rows = np.insert(self._rows, at, np.int32(-1))
            self._counts = np.insert(self._counts, at, np.int64(0))
            self._last = np.insert(self._last, at, np.int64(0))
            pos = np.searchsorted(self._keys, uniq)
        before = self._counts[pos]
        after = before + cnt
        self._counts[pos] = after
        self._last[pos] = now
        rows = self._rows[pos]
        t = self._access_threshold
        want = np.flatnonzero((rows < 0) & (after > t))
        if want.size:
            # the element at which each id's count first exceeds t: its (t - before)-th occurrence
            order = np.argsort(inv, kind="stable")
            starts = np.cumsum(cnt) - cnt
            event = order[starts[want] + np.maximum(t - before[want], 0)]
            want = want[np.argsort(event, kind="stable")]
            got = self._allocate(want.size)
            want = want[:got.size]
            rows[want] = got
            self._rows[pos[want]] = got
            self._stats["admitted"] += int(got.size)
        out = rows[inv]
        miss = out < 0
        if miss.any():
            over = int(np.count_nonzero(after[inv[miss]] > t))
            self._stats["overflowed"] += over
            self._stats["rejected"] += int(np.count_nonzero(miss)) - over
            out[miss] = HASH_DEFAULT_ROW
        self._stats["looked_up"] += int(flat.size)
        return out.astype(np.int32).reshape(arr.shape)

    def find(self, ids):
        """Rows of ``ids`` without counting or admitting anything (row 0 for ids without a row)."""
        arr = _hash_ids("HashCache.find", ids)
        flat = arr.ravel()
        pos, hit = self._positions(flat)
        out = np.full(flat.size, HASH_DEFAULT_ROW, np.int32)
        out[hit] = np.maximum(self._rows[pos[hit]], HASH_DEFAULT_ROW)
        return out.reshape(arr.shape)

    def evict(self, now=None):
        """Forget ids with ``now - last_seen > eviction_threshold``; return ``(freed_ids, freed_rows)``
        (int64, int32) of those that held rows, ordered by row. Does nothing when the threshold is -1."""
        now = self._now if now is None else _hash_time("HashCache.evict", "now", now)
        if self._eviction_threshold < 0:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        gone = (now - self._last) > self._eviction_threshold
        had_row = gone & (self._rows >= 0)
        order = np.argsort(self._rows[had_row], kind="stable")
        freed_ids, freed_rows = self._keys[had_row][order], self._rows[had_row][order]
        keep = ~gone
        self._keys, self._rows = self._keys[keep], self._rows[keep]
        self._counts, self._last = self._counts[keep], self._last[keep]
        self._free = np.union1d(self._free, freed_rows).astype(np.int32)
        self._stats["evicted"] += int(freed_rows.size)
        self._stats["forgotten"] += int(np.count_nonzero(gone)) - int(freed_rows.size)
        return freed_ids, freed_rows

    def state_dict(self):
        """All state as a dict of numpy arrays and ints (entries sorted by id)."""
        state = {"keys": self._keys.copy(), "rows": self._rows.copy(), "counts": self._counts.copy(),
                 "last_seen": self._last.copy(), "free_rows": self._free.copy(),
                 "next_row": self._next_row, "capacity": self._capacity, "step": self._step,
                 "now": self._now, "access_threshold": self._access_threshold,
                 "eviction_threshold": self._eviction_threshold, "grow": self._grow}
        state.update(self._stats)
        return state

    def load_state_dict(self, state):
        """Restore ``state`` exactly; the capacity becomes ``max(self.capacity, state['capacity'])``."""
        s = _hash_state_check("HashCache.load_state_dict", state)
        cfg = _hash_cache_config(max(self._capacity, int(s["capacity"])), s["access_threshold"],
                                 s["eviction_threshold"], s["grow"])
        (self._capacity, self._access_threshold, self._eviction_threshold, self._grow) = cfg
        self._keys, self._rows = s["keys"].copy(), s["rows"].copy()
        self._counts, self._last = s["counts"].copy(), s["last_seen"].copy()
        self._free = s["free_rows"].copy()
        self._next_row = int(s["next_row"])
        self._step = int(s["step"])
        self._now = int(s["now"])
        self._stats = {k: int(s[k]) for k in _HASH_STAT_NAMES}


# ---- backend binding -------------------------------------------------------------------------------
#: Names of the kernels that exist in both backends (one per line, each issue adds its own).
_KERNEL_NAMES = (
    "HashCache",
)


def _backend_kernels(backend):
    """The kernels of ``backend`` ('fast' or 'py') as a dict name -> object (used by the tests)."""
    _check_one_of("recboost backends", "'backend'", backend, ("fast", "py"))
    if backend == "fast":
        if _fast is None:
            raise RuntimeError("the compiled backend is not available: " + FAST_BACKEND_REASON)
        return {name: getattr(_fast, name) for name in _KERNEL_NAMES}
    return {name: globals()["_py_" + name] for name in _KERNEL_NAMES}


globals().update(_backend_kernels("fast" if FAST_BACKEND else "py"))

# =====================================================================================================
# Hash embedding
# =====================================================================================================

# =====================================================================================================
# Gradient freeze
# =====================================================================================================

# =====================================================================================================
# PCA loading
# =====================================================================================================

# =====================================================================================================
# Loss scaling
# =====================================================================================================

# =====================================================================================================
# Mixed precision
# =====================================================================================================

# =====================================================================================================
# Train-step cells
# =====================================================================================================

# =====================================================================================================
# Boost algorithms
# =====================================================================================================

# =====================================================================================================
# AutoBoost
# =====================================================================================================

# =====================================================================================================
# Data: Criteo-format reader and synthetic click stream
# =====================================================================================================

# =====================================================================================================
# Callbacks and metrics
# =====================================================================================================

# =====================================================================================================
# RecModel
# =====================================================================================================

# =====================================================================================================
# Command line: python -m recboost ...
# =====================================================================================================

__all__ = [
    "FAST_BACKEND",
    "FAST_BACKEND_REASON",
]


def main(argv=None):
    """Entry point of ``python -m recboost``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m recboost", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version="recboost %s (%s backend)"
                        % (__version__, "compiled" if FAST_BACKEND else "numpy"))
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
