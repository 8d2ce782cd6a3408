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
    if (n and out["rows"].min() < -1) or \
            (owned.size and (owned.min() < _HASH_RESERVED_ROWS or owned.max() >= nxt)):
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
# Host: a HashCache turns raw ids into rows, prepare() uniques them and pads to ``max_unique``.
# Device: load_rows() gathers those rows of the big table into the small Parameter ``active``,
# construct() gathers from ``active``, the step differentiates w.r.t. ``active`` only and
# apply_gradients() runs the table's sparse optimizer on those rows. The big table is never
# differentiated, so a step costs O(batch), not O(table).


def _hash_bucket(n):
    """Padded length of ``n`` reset rows: a power of two, so evictions compile few graphs."""
    return 1 << max(4, int(n - 1).bit_length())


class _HashLoadRows(nn.Cell):
    """``active <- table[rows]`` (GRAPH mode)."""

    def __init__(self, table, active):
        super().__init__()
        self.table = table
        self.active = active

    def construct(self, rows):
        return ops.assign(self.active, ops.gather(self.table, rows, 0))


class _HashResetRows(nn.Cell):
    """Write ``values`` to rows of the table and each slot's fill value to the same rows of the slots."""

    def __init__(self, table, slots, fills):
        super().__init__()
        self.table = table
        self.slots = ms.ParameterTuple(slots)
        self.fills = tuple(float(f) for f in fills)

    def construct(self, rows, values):
        out = ops.scatter_update(self.table, rows, values)
        for slot, fill in zip(self.slots, self.fills):
            out = ops.depend(out, ops.scatter_update(slot, rows, ops.zeros_like(values) + fill))
        return ops.depend(rows, out)        # small: returning the table would copy it


class _SparseUpdateCell(nn.Cell):
    """One table's sparse optimizer step: gather rows, apply the rule, scatter them back (GRAPH mode)."""

    def __init__(self, rule, table, slots, scalars):
        super().__init__()
        self.rule = rule
        self.table = table
        self.slots = ms.ParameterTuple(slots)
        self.scalars = ms.ParameterTuple(scalars)

    def construct(self, rows, grad):
        weight = ops.gather(self.table, rows, 0)
        olds = [ops.gather(slot, rows, 0) for slot in self.slots]
        new_weight, news = self.rule(weight, olds, grad, self.scalars)
        out = ops.scatter_update(self.table, rows, new_weight)
        for slot, new in zip(self.slots, news):
            out = ops.depend(out, ops.scatter_update(slot, rows, new))
        return ops.depend(rows, out)        # small: returning the table would copy it


class _SparseOptimizer:
    """Base of the sparse table optimizers: hyper-parameters here, state per table in ``bind``."""
    _slot_fills = ()            # (name, initial value) per row slot
    _scalar_inits = ()          # (name, initial value) per table-wide scalar (e.g. Adam's beta powers)

    def __init__(self, learning_rate):
        self.learning_rate = _check_number(type(self).__name__, "learning_rate", learning_rate, 0,
                                           strict_min=True)

    def _bind(self, table, capacity, dim, slot_data=None, scalar_data=None):
        """Slot Parameters for ``table`` (fresh, or from ``slot_data``) and its update Cell."""
        slots, scalars = [], []
        for name, fill in self._slot_fills:
            data = np.full((capacity, dim), fill, np.float32) if slot_data is None else slot_data[name]
            slots.append(Parameter(Tensor(data), name="%s.%s" % (table.name[:-len(".table")], name),
                                   requires_grad=False))
        for name, init in self._scalar_inits:
            value = init if scalar_data is None else scalar_data[name]
            scalars.append(Parameter(Tensor(np.float32(value)),
                                     name="%s.%s" % (table.name[:-len(".table")], name), requires_grad=False))
        return slots, scalars, _SparseUpdateCell(self._rule, table, slots, scalars)

    def __repr__(self):
        args = ", ".join("%s=%r" % kv for kv in sorted(vars(self).items()))
        return "%s(%s)" % (type(self).__name__, args)


class SparseSGD(_SparseOptimizer):
    """Plain SGD on the touched rows: ``w -= lr * g``."""

    def __init__(self, learning_rate=0.01):
        super().__init__(learning_rate)

    def _rule(self, w, olds, g, scalars):
        return w - self.learning_rate * g, []


class SparseAdagrad(_SparseOptimizer):
    """Adagrad on the touched rows (MindSpore's form): ``acc += g*g; w -= lr * g / sqrt(acc)``."""

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.1):
        super().__init__(learning_rate)
        self.initial_accumulator_value = _check_number("SparseAdagrad", "initial_accumulator_value",
                                                       initial_accumulator_value, 0, strict_min=True)
        self._slot_fills = (("accum", self.initial_accumulator_value),)

    def _rule(self, w, olds, g, scalars):
        acc = olds[0] + g * g
        return w - self.learning_rate * g / ops.sqrt(acc), [acc]


class SparseAdam(_SparseOptimizer):
    """Lazy Adam on the touched rows (MindSpore's LazyAdam): per-row moments, table-wide beta powers.

    ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``, t counting this table's steps."""
    _slot_fills = (("moment1", 0.0), ("moment2", 0.0))
    _scalar_inits = (("beta1_power", 1.0), ("beta2_power", 1.0))

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, eps=1e-8):
        super().__init__(learning_rate)
        self.beta1 = _check_number("SparseAdam", "beta1", beta1, 0, 1)
        self.beta2 = _check_number("SparseAdam", "beta2", beta2, 0, 1)
        self.eps = _check_number("SparseAdam", "eps", eps, 0, strict_min=True)

    def _rule(self, w, olds, g, scalars):
        b1p, b2p = scalars
        b1p_new = b1p * self.beta1
        b2p_new = b2p * self.beta2
        g = ops.depend(g, ops.assign(b1p, b1p_new))
        g = ops.depend(g, ops.assign(b2p, b2p_new))
        m = self.beta1 * olds[0] + (1.0 - self.beta1) * g
        v = self.beta2 * olds[1] + (1.0 - self.beta2) * g * g
        lr_t = self.learning_rate * ops.sqrt(1.0 - b2p_new) / (1.0 - b1p_new)
        return w - lr_t * m / (ops.sqrt(v) + self.eps), [m, v]


class SparseFtrl(_SparseOptimizer):
    """FTRL-proximal on the touched rows (MindSpore's FTRL form, ``lr_power`` <= 0)."""
    _slot_fills = (("accum", 0.1), ("linear", 0.0))

    def __init__(self, learning_rate=0.001, initial_accum=0.1, lr_power=-0.5, l1=0.0, l2=0.0):
        super().__init__(learning_rate)
        self.initial_accum = _check_number("SparseFtrl", "initial_accum", initial_accum, 0, strict_min=True)
        self.lr_power = _check_number("SparseFtrl", "lr_power", lr_power, maximum=0)
        self.l1 = _check_number("SparseFtrl", "l1", l1, 0)
        self.l2 = _check_number("SparseFtrl", "l2", l2, 0)
        self._slot_fills = (("accum", self.initial_accum), ("linear", 0.0))

    def _rule(self, w, olds, g, scalars):
        acc, lin = olds
        acc_new = acc + g * g
        p = -self.lr_power
        sigma = (ops.pow(acc_new, p) - ops.pow(acc, p)) / self.learning_rate
        lin = lin + g - sigma * w
        quad = ops.pow(acc_new, p) / self.learning_rate + 2.0 * self.l2
        shrunk = (ops.sign(lin) * self.l1 - lin) / quad
        w_new = ops.select(ops.abs(lin) > self.l1, shrunk, ops.zeros_like(w))
        return w_new, [acc_new, lin]


class HashEmbedding(nn.Cell):
    """An embedding table addressed by raw int64 ids through a ``HashCache``, trained sparsely.

    Rows (``capacity`` of them, ``embedding_size`` wide): row 0 is the shared default row of ids
    that have no row (not yet admitted, or table full without growth) and is trained like any row;
    row 1 is the scratch row that pads ``unique_rows`` (no id owns it); ids own rows 2.. (see
    ``HashCache`` for admission, eviction and growth). A step is:

    1. host: ``unique_rows, inverse = emb.prepare(ids, timestamp)`` (numpy; ``unique_rows`` has the
       fixed length ``max_unique``, so graphs never recompile);
    2. device: ``emb.load_rows(Tensor(unique_rows))`` copies those rows into ``emb.active``;
    3. the network calls ``emb(Tensor(inverse))`` (shape ``inverse.shape + (embedding_size,)``) and
       the step differentiates w.r.t. ``emb.active`` (listed explicitly; it has requires_grad=False
       so dense optimizers never see it, nor the table);
    4. ``emb.apply_gradients(Tensor(unique_rows), grad_active)`` updates only those rows of the table
       and of the optimizer slots.

    ``evict(now)`` frees rows of stale ids, re-initialises their embeddings (seeded) and resets their
    slots. With ``use_dynamic_expansion`` the table and slots double when the cache grows (new
    Parameters; the helper graphs recompile once per doubling). ``state_dict()`` /
    ``load_state_dict()`` save and restore cache, table, slots and the init RNG exactly.

    ``load_rows`` and ``apply_gradients`` may also be called inside another Cell's ``construct``
    (they are sub-cells, inlined into that graph). Growth and ``load_state_dict`` replace the table
    Parameters and those sub-cells and add 1 to ``generation``: a graph that inlined them must be
    rebuilt then (``emb.active`` and ``construct`` are unaffected).

    Args:
        embedding_size (int): width of a row.
        capacity (int): rows of the table (>= 3; two are reserved).
        access_threshold, eviction_threshold (int): see ``HashCache`` (-1 disables).
        use_dynamic_expansion (bool): let the table grow when full.
        optimizer: a sparse optimizer (``SparseSGD``, ``SparseAdagrad``, ``SparseAdam``,
            ``SparseFtrl``); default ``SparseAdam()``.
        max_unique (int): rows per step: > the distinct ids of any batch (one more for the default
            row); default: the number of ids of the first batch + 1.
        input_index (int): position of this table's ids among the network inputs (train cells use it).
        seed (int): seed of the row initialiser (normal, stddev ``init_stddev``).
        name (str): name prefix of the Parameters.
    """

    def __init__(self, embedding_size, capacity, access_threshold=-1, eviction_threshold=-1,
                 use_dynamic_expansion=False, optimizer=None, max_unique=None, input_index=None,
                 seed=0, init_stddev=0.01, name="hash_embedding"):
        super().__init__(auto_prefix=False)   # helper sub-cells must not rename our Parameters
        where = "HashEmbedding"
        self.embedding_size = _check_int(where, "embedding_size", embedding_size, 1)
        capacity = _check_int(where, "capacity", capacity, _HASH_RESERVED_ROWS + 1, _HASH_MAX_CAPACITY)
        grow = _check_bool(where, "use_dynamic_expansion", use_dynamic_expansion)
        if optimizer is None:
            optimizer = SparseAdam()
        if not isinstance(optimizer, _SparseOptimizer):
            _fail(where, "'optimizer'", "a SparseSGD, SparseAdagrad, SparseAdam or SparseFtrl",
                  optimizer, TypeError)
        self.optimizer = optimizer
        self.max_unique = None if max_unique is None else _check_int(where, "max_unique", max_unique, 2)
        self.input_index = None if input_index is None else _check_int(where, "input_index",
                                                                       input_index, 0)
        self.seed = _check_int(where, "seed", seed, 0)
        self.init_stddev = _check_number(where, "init_stddev", init_stddev, 0)
        if not isinstance(name, str) or not name:
            _fail(where, "'name'", "a non-empty str", name, TypeError)
        self.table_name = name
        self.cache = HashCache(capacity, access_threshold, eviction_threshold, grow)
        self._rng = np.random.default_rng(self.seed)
        self.active = None
        self._build_table(self._init_rows(capacity))
        if self.max_unique is not None:
            self._build_active()

    # ---- building ---------------------------------------------------------------------------------
    def _init_rows(self, n):
        return (self._rng.standard_normal((n, self.embedding_size), dtype=np.float32)
                * np.float32(self.init_stddev))

    def _prefix(self):
        """Name prefix of our Parameters: ``name``, plus the path a parent Cell prefixed to the table."""
        table = getattr(self, "table", None)
        return self.table_name if table is None else table.name[:-len(".table")]

    def _build_table(self, data, slot_data=None, scalar_data=None):
        """(Re)create the table, its slots and the helper graphs around ``data``; bumps ``generation``."""
        self.generation = getattr(self, "generation", -1) + 1
        self.table = Parameter(Tensor(data), name=self._prefix() + ".table", requires_grad=False)
        slots, scalars, self._update = self.optimizer._bind(self.table, data.shape[0],
                                                            self.embedding_size, slot_data, scalar_data)
        self._slots = {name: p for (name, _), p in zip(self.optimizer._slot_fills, slots)}
        self._scalars = {name: p for (name, _), p in zip(self.optimizer._scalar_inits, scalars)}
        self._reset = _HashResetRows(self.table, slots, [f for _, f in self.optimizer._slot_fills])
        if self.active is not None:
            self._load = _HashLoadRows(self.table, self.active)

    def _build_active(self):
        self.active = Parameter(Tensor(np.zeros((self.max_unique, self.embedding_size), np.float32)),
                                name=self._prefix() + ".active", requires_grad=False)
        self._load = _HashLoadRows(self.table, self.active)

    def _grow_to(self, capacity):
        old = self.table.shape[0]
        if capacity == old:
            return
        extra = capacity - old
        data = np.concatenate([self.table.asnumpy(), self._init_rows(extra)])
        slots = {name: np.concatenate([p.asnumpy(), np.full((extra, self.embedding_size), fill, np.float32)])
                 for (name, fill), p in zip(self.optimizer._slot_fills, self._slots.values())}
        scalars = {name: p.asnumpy() for name, p in self._scalars.items()}
        self._build_table(data, slots, scalars)

    # ---- the step ---------------------------------------------------------------------------------
    @property
    def capacity(self):
        """Rows of the table."""
        return int(self.table.shape[0])

    def prepare(self, ids, timestamp=None, is_train=True):
        """Host side of a step: ``(unique_rows int32[max_unique], inverse int32[ids.shape])``.

        With ``is_train`` the ids go through ``cache.lookup`` (counts, admission, growth: the table
        grows here when the cache did); otherwise through ``cache.find`` (no state changes)."""
        where = "HashEmbedding.prepare"
        arr = _hash_ids(where, ids)
        if self.max_unique is None:
            self.max_unique = arr.size + 1
            self._build_active()
        if arr.size + 1 > self.max_unique:        # checked before the cache changes
            distinct = np.unique(arr).size
            if distinct + 1 > self.max_unique:
                _fail(where, "the number of distinct ids of a batch", "< max_unique=%d (create the "
                      "table with a larger max_unique)" % self.max_unique, distinct)
        rows = self.cache.lookup(arr, timestamp) if is_train else self.cache.find(arr)
        if self.cache.capacity != self.capacity:
            self._grow_to(self.cache.capacity)
        uniq, inverse = np.unique(rows.ravel(), return_inverse=True)
        unique_rows = np.full(self.max_unique, HASH_SCRATCH_ROW, np.int32)
        unique_rows[:uniq.size] = uniq
        return unique_rows, inverse.astype(np.int32).reshape(rows.shape)

    def load_rows(self, unique_rows):
        """Device: ``active <- table[unique_rows]``."""
        return self._load(unique_rows)

    def construct(self, inverse):
        return ops.gather(self.active, inverse, 0)

    def apply_gradients(self, unique_rows, grad_active):
        """Device: the sparse optimizer step on rows ``unique_rows`` with the gradient of ``active``.
        Returns ``unique_rows`` after the update (``asnumpy()`` on it waits for the update)."""
        return self._update(unique_rows, grad_active)

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(self, now=None):
        """Evict stale ids (``HashCache.evict``), re-initialise their rows and reset their slots.
        Returns the freed ids (int64)."""
        ids, rows = self.cache.evict(now)
        if rows.size:
            n = _hash_bucket(rows.size)
            pad_rows = np.full(n, HASH_SCRATCH_ROW, np.int32)
            pad_rows[:rows.size] = rows
            values = np.zeros((n, self.embedding_size), np.float32)
            values[:rows.size] = self._init_rows(rows.size)
            self._reset(Tensor(pad_rows), Tensor(values))
        return ids

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self):
        """Cache, table, optimizer slots and init RNG from one point (call it between steps)."""
        return {"cache": self.cache.state_dict(), "table": self.table.asnumpy().copy(),
                "slots": {name: p.asnumpy().copy() for name, p in self._slots.items()},
                "scalars": {name: p.asnumpy().copy() for name, p in self._scalars.items()},
                "rng": self._rng.bit_generator.state, "embedding_size": self.embedding_size,
                "max_unique": self.max_unique, "optimizer": type(self.optimizer).__name__}

    def load_state_dict(self, state):
        """Restore ``state`` exactly (into an equal or larger capacity; extra rows are initialised)."""
        where = "HashEmbedding.load_state_dict"
        if not isinstance(state, dict) or not {"cache", "table", "slots", "scalars", "rng"} <= set(state):
            _fail(where, "'state'", "a dict made by HashEmbedding.state_dict()",
                  type(state).__name__ if not isinstance(state, dict) else sorted(state), TypeError)
        if state.get("embedding_size") != self.embedding_size:
            _fail(where, "state['embedding_size']", "%d" % self.embedding_size, state.get("embedding_size"))
        if state.get("optimizer") != type(self.optimizer).__name__:
            _fail(where, "state['optimizer']", repr(type(self.optimizer).__name__), state.get("optimizer"))
        if self.max_unique is None and state.get("max_unique") is not None:
            self.max_unique = int(state["max_unique"])
            self._build_active()
        self.cache.load_state_dict(state["cache"])
        self._rng.bit_generator.state = state["rng"]
        self._build_table(np.asarray(state["table"], np.float32), state["slots"], state["scalars"])
        self._grow_to(max(self.cache.capacity, self.capacity))


class HashEmbeddingLookup(HashEmbedding):
    """``HashEmbedding`` under mindspore_rec's name and leading arguments: ``HashEmbeddingLookup(
    embedding_size, key_dtype=int64, param_init='normal', param_dtype=float32, capacity=..., ...)``;
    the other keywords are HashEmbedding's. ``param_init`` is 'normal' (stddev ``init_stddev``) or
    'zeros'; keys may be int32 or int64 (both are hashed as int64); tables are float32."""

    def __init__(self, embedding_size, key_dtype=mstype.int64, param_init="normal",
                 param_dtype=mstype.float32, capacity=None, **kwargs):
        where = "HashEmbeddingLookup"
        _check_one_of(where, "key_dtype", key_dtype, (mstype.int32, mstype.int64))
        _check_one_of(where, "param_init", param_init, ("normal", "zeros"))
        _check_one_of(where, "param_dtype", param_dtype, (mstype.float32,))
        if capacity is None:
            _fail(where, "'capacity'", "given (the rows of the table)", capacity, TypeError)
        _check_no_kwargs(where, kwargs, ("access_threshold", "eviction_threshold", "use_dynamic_expansion",
                                         "optimizer", "max_unique", "input_index", "seed", "init_stddev",
                                         "name"))
        if param_init == "zeros":
            kwargs["init_stddev"] = 0.0
        super().__init__(embedding_size, capacity, **kwargs)


def _hash_tables(network):
    """Every HashEmbedding inside ``network`` (a Cell), in cells_and_names order."""
    return [cell for _, cell in network.cells_and_names() if isinstance(cell, HashEmbedding)]


class FeatureSpec:
    """One sparse feature, as in the Rec SDK: which table it uses and its admission/eviction.

    ``is_timestamp=True`` marks the feature that carries the batch's data timestamp (its
    ``index_key`` is the column name, "timestamp" by default); such a spec names no table."""

    def __init__(self, name, table_name=None, access_threshold=-1, eviction_threshold=-1,
                 is_timestamp=False, index_key=None, batch_size=None, **kwargs):
        where = "FeatureSpec"
        _check_no_kwargs(where, kwargs)
        if not isinstance(name, str) or not name:
            _fail(where, "'name'", "a non-empty str", name, TypeError)
        self.name = name
        self.is_timestamp = _check_bool(where, "is_timestamp", is_timestamp)
        self.table_name = None if self.is_timestamp else (name if table_name is None else table_name)
        self.index_key = index_key if index_key is not None else ("timestamp" if self.is_timestamp else name)
        self.access_threshold = _check_int(where, "access_threshold", access_threshold, -1)
        self.eviction_threshold = _check_int(where, "eviction_threshold", eviction_threshold, -1)
        self.batch_size = None if batch_size is None else _check_int(where, "batch_size", batch_size, 1)

    def __repr__(self):
        return "FeatureSpec(%s)" % ", ".join("%s=%r" % kv for kv in vars(self).items())


def create_table(name, dim, capacity, access_threshold=-1, eviction_threshold=-1, optimizer=None,
                 use_dynamic_expansion=False, max_unique=None, seed=0, init_stddev=0.01, feature_spec=None):
    """A ``HashEmbedding`` named ``name`` (the Rec SDK's ``create_table``). With ``feature_spec`` the
    admission and eviction thresholds come from it (explicit different thresholds are an error)."""
    where = "create_table"
    if feature_spec is not None:
        if not isinstance(feature_spec, FeatureSpec):
            _fail(where, "'feature_spec'", "a FeatureSpec", feature_spec, TypeError)
        for arg, value in (("access_threshold", access_threshold), ("eviction_threshold", eviction_threshold)):
            spec_value = getattr(feature_spec, arg)
            if value != -1 and value != spec_value:
                _fail(where, "'%s'" % arg, "-1 or the feature_spec's %d" % spec_value, value)
        access_threshold, eviction_threshold = feature_spec.access_threshold, feature_spec.eviction_threshold
    return HashEmbedding(dim, capacity, access_threshold, eviction_threshold, use_dynamic_expansion,
                         optimizer, max_unique, seed=seed, init_stddev=init_stddev, name=name)


def sparse_lookup(table, ids, timestamp=None, is_train=True):
    """Embeddings (Tensor, ``ids.shape + (dim,)``) of raw ids through ``table``, eagerly: prepare,
    load_rows, gather. Training steps use the three calls separately (see ``HashEmbedding``)."""
    if not isinstance(table, HashEmbedding):
        _fail("sparse_lookup", "'table'", "a HashEmbedding", table, TypeError)
    unique_rows, inverse = table.prepare(ids, timestamp, is_train)
    table.load_rows(Tensor(unique_rows))
    return table(Tensor(inverse))


class EvictHook(ms.train.Callback):
    """Evict every HashEmbedding of the train network on a time or step interval (Rec SDK EvictHook).

    Fires in ``on_train_step_end``. Time is the tables' own clock (the data timestamp of their last
    lookup, or their step when batches carry no timestamp), so a replayed stream evicts the same way:
    a table is evicted when its clock has advanced ``evict_time_interval`` since its last eviction (or
    its first sight), or when ``evict_step_interval`` global steps have passed. ``None`` disables an
    interval. The tables are ``tables`` when given, else every HashEmbedding found in
    ``run_context.original_args().train_network``."""

    def __init__(self, evict_enable=True, evict_time_interval=24 * 60 * 60, evict_step_interval=None,
                 tables=None):
        super().__init__()
        where = "EvictHook"
        self.evict_enable = _check_bool(where, "evict_enable", evict_enable)
        self.evict_time_interval = None if evict_time_interval is None else \
            _check_int(where, "evict_time_interval", evict_time_interval, 1)
        self.evict_step_interval = None if evict_step_interval is None else \
            _check_int(where, "evict_step_interval", evict_step_interval, 1)
        if tables is not None:
            tables = list(tables)
            for t in tables:
                if not isinstance(t, HashEmbedding):
                    _fail(where, "every item of 'tables'", "a HashEmbedding", t, TypeError)
        self.tables = tables
        self._last_time = {}
        self._last_step = 0
        self.evictions = 0          # eviction rounds done

    def _tables_of(self, run_context):
        if self.tables is not None:
            return self.tables
        return _hash_tables(run_context.original_args().train_network)

    def on_train_step_end(self, run_context):
        """After each train step: evict when an interval has passed."""
        if not self.evict_enable:
            return
        step = int(run_context.original_args().cur_step_num)
        by_step = self.evict_step_interval is not None and step - self._last_step >= self.evict_step_interval
        if by_step:
            self._last_step = step
        for table in self._tables_of(run_context):
            now = table.cache.now
            last = self._last_time.setdefault(id(table), now)
            by_time = self.evict_time_interval is not None and now - last >= self.evict_time_interval
            if by_step or by_time:
                self._last_time[id(table)] = now
                table.evict(now)
                self.evictions += 1


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
    # Hash embedding
    "HASH_DEFAULT_ROW",
    "HASH_SCRATCH_ROW",
    "HashCache",
    "HashEmbedding",
    "HashEmbeddingLookup",
    "SparseSGD",
    "SparseAdagrad",
    "SparseAdam",
    "SparseFtrl",
    "FeatureSpec",
    "create_table",
    "sparse_lookup",
    "EvictHook",
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
