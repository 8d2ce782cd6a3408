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

# ---- Criteo parsing (twin of _fast.parse_criteo; hashing helpers live in the Data section) --------
_HEX_VALUE = np.full(256, -1, dtype=np.int16)
_HEX_VALUE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX_VALUE[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX_VALUE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _py_criteo_digits(a, starts, ends, max_digits, base):
    """Parse fields ``a[starts:ends]`` (flat arrays) as unsigned numbers of 1..max_digits digits in
    ``base`` (10 or 16) -> (uint64 values, ok). Empty fields come back as (0, False)."""
    count = ends - starts
    ok = (count >= 1) & (count <= max_digits)
    acc = np.zeros(starts.size, dtype=np.uint64)
    if starts.size == 0:
        return acc, ok
    last = a.size - 1
    with np.errstate(over="ignore"):
        for k in range(min(max_digits, int(count.max()))):     # longer fields are already not ok
            live = k < count
            ch = a[np.minimum(starts + k, last)]
            digit = _HEX_VALUE[ch] if base == 16 else ch.astype(np.int16) - 48
            ok &= ~live | ((digit >= 0) & (digit < base))
            acc = np.where(live & ok, acc * np.uint64(base) + np.maximum(digit, 0).astype(np.uint64), acc)
    return acc, ok


def _py_parse_criteo(buf, num_dense, num_sparse):
    """Numpy twin of ``_fast.parse_criteo``: every line of ``buf`` (bytes; the last line may lack its
    newline) -> ``(labels float32 [rows], dense int64 [rows, num_dense], ids int64 [rows, num_sparse],
    status int8 [lines], line_end int64 [lines])``, one row per line with status 0, in order.

    A line (one trailing ``\\r`` dropped) must have exactly ``num_dense + num_sparse`` tabs (else
    status 1), a label ``0`` or ``1`` (else 2), dense fields that are empty (-> 0) or an optional
    sign and 1-19 decimal digits within int64 (else 3), categorical fields that are empty (-> the
    field's missing id) or 1-16 hex digits of either case (-> ``_hash_feature(field, value)``, else 4).
    The first failing field decides the status."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n, nf = a.size, num_dense + num_sparse
    ends = np.flatnonzero(a == 10)                  # end of each line's content + its '\r'
    if n and a[-1] != 10:
        ends = np.append(ends, n)
    line_end = np.minimum(ends + 1, n).astype(np.int64)
    n_lines = ends.size
    if n_lines == 0:
        return (np.zeros(0, np.float32), np.zeros((0, num_dense), np.int64),
                np.zeros((0, num_sparse), np.int64), np.zeros(0, np.int8), line_end)
    starts = np.concatenate([[0], line_end[:-1]]).astype(np.int64)
    cend = ends - ((ends > starts) & (a[np.maximum(ends - 1, 0)] == 13))
    tabs = np.flatnonzero(a == 9)
    tab_line = np.searchsorted(ends, tabs, side="left")
    status = np.where(np.bincount(tab_line, minlength=n_lines) == nf, 0, 1).astype(np.int8)
    good = np.flatnonzero(status == 0)
    gtabs = tabs[status[tab_line] == 0].reshape(good.size, nf)
    fstart = np.concatenate([starts[good, None], gtabs + 1], axis=1)
    fend = np.concatenate([gtabs, cend[good, None]], axis=1)
    # label
    lab_ok = (fend[:, 0] - fstart[:, 0] == 1)
    lab_ch = a[np.minimum(fstart[:, 0], n - 1)]
    lab_ok &= (lab_ch == 48) | (lab_ch == 49)
    # dense
    ds, de = fstart[:, 1:1 + num_dense].ravel(), fend[:, 1:1 + num_dense].ravel()
    first = a[np.minimum(ds, n - 1)]
    empty = de == ds
    neg = ~empty & (first == 45)
    signed = neg | (~empty & (first == 43))
    mag, dok = _py_criteo_digits(a, ds + signed, de, 19, 10)
    dok &= np.where(neg, mag <= np.uint64(1 << 63), mag <= np.uint64((1 << 63) - 1))
    with np.errstate(over="ignore"):
        dval = np.where(neg, (np.uint64(0) - mag), mag).view(np.int64)
    dok |= empty
    dval = np.where(empty | ~dok, 0, dval).reshape(good.size, num_dense)
    dense_ok = dok.reshape(good.size, num_dense).all(axis=1)
    # categorical
    cs, ce = fstart[:, 1 + num_dense:].ravel(), fend[:, 1 + num_dense:].ravel()
    cval, cok = _py_criteo_digits(a, cs, ce, 16, 16)
    cempty = ce == cs
    cok |= cempty
    field = np.tile(np.arange(num_sparse), good.size)
    ids = np.where(cempty, _missing_feature_id(field, num_sparse),
                   _hash_feature(field, cval, num_sparse)).reshape(good.size, num_sparse)
    cat_ok = cok.reshape(good.size, num_sparse).all(axis=1)
    status[good] = np.where(~lab_ok, 2, np.where(~dense_ok, 3, np.where(~cat_ok, 4, 0)))
    rows = status[good] == 0
    labels = (lab_ch[rows] - 48).astype(np.float32)
    return (labels, dval[rows].astype(np.int64), ids[rows].astype(np.int64), status,
            line_end.astype(np.int64))


# ---- backend binding -------------------------------------------------------------------------------
#: Names of the kernels that exist in both backends (one per line, each issue adds its own).
_KERNEL_NAMES = (
    "parse_criteo",
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
# Both sources yield the same batch: ``(dense float32 [B, num_dense], ids int64 [B, num_sparse],
# label float32 [B, 1])``. Categorical values become raw 64-bit ids through one explicit hash of
# (field index, value), so all fields can share one hash table; dense integers go through
# ``sign(x) * log1p(|x|)`` with a missing value read as 0.

import logging  # noqa: E402  (only the data section logs)

_DATA_LOG = logging.getLogger("recboost")
_DATA_MASK64 = (1 << 64) - 1
_MIX_M1 = 0xBF58476D1CE4E5B9          # splitmix64 finaliser constants
_MIX_M2 = 0x94D049BB133111EB
_FIELD_MUL = 0x9E3779B97F4A7C15       # golden-ratio multiplier: field index -> 64-bit salt
_MISSING_SALT = 0x6A09E667F3BCC909    # marks "this categorical field was empty"
# Per-line status codes of the parser kernel (index = code) and the name of each reason in stats().
_CRITEO_OK = 0
_CRITEO_REASONS = ("ok", "field_count", "label", "dense", "categorical", "too_long")
_CRITEO_TOO_LONG = 5


def _mix64(x):
    """splitmix64 finaliser of a uint64 array (wrapping 64-bit arithmetic, a bijection)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(_MIX_M1)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(_MIX_M2)
        x = x ^ (x >> np.uint64(31))
    return x


def _id_from_hash(h):
    """uint64 hash -> raw feature id in [1, 2**63): the top bit is dropped, 0 becomes 1."""
    ids = (np.asarray(h, dtype=np.uint64) >> np.uint64(1)).astype(np.int64)
    return np.maximum(ids, 1)


def _field_salts(num_fields):
    return np.array([((f + 1) * _FIELD_MUL) & _DATA_MASK64 for f in range(num_fields)], dtype=np.uint64)


def _hash_feature(field, values, num_fields=None):
    """Raw int64 id of categorical ``values`` (uint64) of field ``field`` (int or array broadcasting
    against ``values``): ``id(h)`` with ``h = mix64(mix64(value) ^ (field + 1) * 0x9E3779B97F4A7C15)``
    and ``id(h) = max(h >> 1, 1)``, so ids are positive int64 and every field has its own id space."""
    field = np.asarray(field)
    salt = _field_salts(num_fields or int(np.max(field)) + 1)[field]
    return _id_from_hash(_mix64(_mix64(values) ^ salt))


def _missing_feature_id(field, num_fields=None):
    """Raw int64 id that stands for an empty categorical value of field ``field`` (int or array):
    ``id(mix64((field + 1) * 0x9E3779B97F4A7C15 ^ 0x6A09E667F3BCC909))``."""
    field = np.asarray(field)
    salt = _field_salts(num_fields or int(np.max(field)) + 1)[field]
    return _id_from_hash(_mix64(salt ^ np.uint64(_MISSING_SALT)))


def _dense_transform(raw):
    """Criteo integer features -> model input: ``sign(x) * log1p(|x|)`` in float64, then float32."""
    x = np.asarray(raw).astype(np.float64)
    return (np.sign(x) * np.log1p(np.abs(x))).astype(np.float32)


def _hash_gauss(h):
    """About standard normal draws keyed by uint64 hashes: the sum of the four 16-bit quarters of
    ``mix64(h)`` (an Irwin-Hall sum of four uniforms, in [-3.46, 3.46]), centred and scaled."""
    x = _mix64(h)
    m = np.uint64(0xFFFF)
    s = ((x & m) + ((x >> np.uint64(16)) & m) + ((x >> np.uint64(32)) & m) + (x >> np.uint64(48)))
    return (s.astype(np.float64) - 2.0 * 65535.0) * (1.0 / (65536.0 * np.sqrt(4.0 / 12.0)))


#: Default cardinalities of the 26 categorical fields of the synthetic stream (about 700K ids live
#: at any time; Criteo's own fields range from 3 to about 10M).
_SYN_VOCAB = (1000, 500, 100000, 50000, 300, 20, 10000, 600, 3, 50000, 5000, 100000, 3000,
              25, 10000, 100000, 10, 4000, 2000, 4, 100000, 15, 15, 50000, 80, 40000)
_SYN_BLOCK = 4096          # rows generated per RNG block; the stream is defined row by row


class SyntheticClickStream:
    """An endless, seeded click stream in the Criteo layout, with a known ground truth.

    Each row has ``num_dense`` integer features (counts with missing values) and ``num_sparse``
    categorical features. Field ``f`` draws a popularity rank from a Zipf law with exponent
    ``zipf_a`` over ``vocab_sizes[f]`` slots; each slot holds one id at a time and is given a new id
    at random moments, on average ``drift`` times per million rows, so new ids keep appearing and old
    ones stop (admission and eviction matter). The hidden click model is logistic: a bias (set so
    that the mean click rate is ``ctr``), one additive weight per slot (scaled per field; a new id
    inherits its slot's weight, so the click model is stationary, but a model must learn each new id
    afresh), mild dense effects on the transformed dense values, and a few factorisation-machine
    interactions between small fields. A Wide&Deep with 16-dim embeddings can learn it;
    ``oracle_auc()`` is the AUC of the true probabilities.

    Iterating yields batches ``(dense, ids, label)``: dense float32 ``[B, num_dense]``
    (``sign(x) * log1p(|x|)`` of the raw integers, missing -> 0, the same rule as ``CriteoReader``),
    ids int64 ``[B, num_sparse]`` (raw 64-bit ids hashed from (field, value), in ``[1, 2**63)``, all
    fields in one id space), label float32 ``[B, 1]``; then, if asked, ``prob`` float32 ``[B, 1]`` (the
    true click probability) and ``timestamp`` (int64 0-d array: data time in seconds of the batch's
    first row, ``start_time + row // rows_per_second``).

    The stream is a function of ``seed`` and the row index only: the same seed gives the same bits
    whatever the batch size, and ``start_row`` (or ``seek``) resumes anywhere. ``num_batches=None``
    means endless.
    """

    def __init__(self, seed=0, num_dense=13, num_sparse=26, vocab_sizes=None, zipf_a=1.1, drift=0.05,
                 batch_size=2048, ctr=0.25, with_probability=False, with_timestamp=False, start_row=0,
                 num_batches=None, start_time=1_700_000_000, rows_per_second=2048):
        where = "SyntheticClickStream"
        self.seed = _check_int(where, "seed", seed, 0)
        self.num_dense = _check_int(where, "num_dense", num_dense, 0)
        self.num_sparse = _check_int(where, "num_sparse", num_sparse, 1)
        if vocab_sizes is None:
            vocab_sizes = [_SYN_VOCAB[f % len(_SYN_VOCAB)] for f in range(self.num_sparse)]
        if not isinstance(vocab_sizes, (list, tuple)) or len(vocab_sizes) != self.num_sparse:
            _fail(where, "'vocab_sizes'", "a list of %d ints" % self.num_sparse, vocab_sizes)
        self.vocab_sizes = tuple(_check_int(where, "vocab_sizes[%d]" % f, v, 1, 1 << 31)
                                 for f, v in enumerate(vocab_sizes))
        self.zipf_a = _check_number(where, "zipf_a", zipf_a, 0.0)
        self.drift = _check_number(where, "drift", drift, 0.0)
        self.batch_size = _check_int(where, "batch_size", batch_size, 1)
        self.ctr = _check_number(where, "ctr", ctr, 0.0, 1.0, strict_min=True)
        if self.ctr >= 1.0:
            _fail(where, "'ctr'", "a number in (0, 1)", ctr)
        self.with_probability = _check_bool(where, "with_probability", with_probability)
        self.with_timestamp = _check_bool(where, "with_timestamp", with_timestamp)
        self.num_batches = None if num_batches is None else _check_int(where, "num_batches", num_batches, 0)
        self.start_time = _check_int(where, "start_time", start_time, 0)
        self.rows_per_second = _check_number(where, "rows_per_second", rows_per_second, 0.0, strict_min=True)
        self._row = _check_int(where, "start_row", start_row, 0)
        self._batches = 0
        self._block = (-1, None)
        self._build_truth()

    # ---- the hidden model ---------------------------------------------------------------------------
    def _build_truth(self):
        rng = np.random.default_rng([self.seed, 1])
        nd, ns = self.num_dense, self.num_sparse
        # Per-field Zipf CDFs; the slots' drift phases and speeds of all fields in one array.
        self._cdf, phase, speed = [], [], []
        for v in self.vocab_sizes:
            p = np.arange(1, v + 1, dtype=np.float64) ** -self.zipf_a
            cdf = np.cumsum(p)
            self._cdf.append(cdf / cdf[-1])
            phase.append(rng.random(v))
            speed.append(rng.uniform(0.5, 1.5, v))
        self._phase = np.concatenate(phase)
        self._speed = np.concatenate(speed)
        self._offset = np.concatenate([[0], np.cumsum(self.vocab_sizes)[:-1]]).astype(np.int64)
        self._value_salt = rng.integers(0, 1 << 63, ns, dtype=np.uint64)
        self._weight_salt = rng.integers(0, 1 << 63, dtype=np.uint64)
        self._sparse_missing = np.where(rng.random(ns) < 0.3, rng.uniform(0.02, 0.3, ns), 0.0)
        # Per-field weight scale: large fields carry smaller per-slot effects (their tails are rare).
        self._sigma = rng.uniform(0.13, 0.4, ns) / (1.0 + 0.15 * np.log10(self.vocab_sizes))
        self._dense_mu = rng.uniform(0.0, 4.0, nd)
        self._dense_sd = rng.uniform(0.5, 1.5, nd)
        self._dense_missing = rng.uniform(0.0, 0.4, nd)
        self._dense_w = rng.normal(0.0, 0.15, nd)
        small = [f for f in range(ns) if self.vocab_sizes[f] <= 1000]
        pairs = []
        for _ in range(min(3, len(small) * (len(small) - 1) // 2)):
            f, g = sorted(rng.choice(small, 2, replace=False).tolist())
            pairs.append((f, g))
        self._pairs = pairs
        self._bias = 0.0
        self._slot_tables()
        # Standardise the dense effects and set the bias to the target click rate on a calibration
        # block of its own (a negative block index: never part of the stream, whatever start_row).
        self._dense_loc = np.zeros(nd)
        self._dense_scale = np.ones(nd)
        cal = self._generate(block=-1 - self.seed % 1000, calibrate=True)
        t = cal["dense"].astype(np.float64)
        self._dense_loc = t.mean(0)
        self._dense_scale = t.std(0) + 1e-6
        logit = self._logit(cal["keys"], cal["dense"])
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) < self.ctr:
                lo = mid
            else:
                hi = mid
        self._bias = 0.5 * (lo + hi)

    def _slot_tables(self):
        """Per-slot hidden parameters, indexed by slot key (all fields' slots, then one missing key
        per field): the additive weight and, for the interacting fields, 4 FM latent factors."""
        ns = self.num_sparse
        keys = np.arange(self._offset[-1] + self.vocab_sizes[-1] + ns, dtype=np.uint64)
        field = np.concatenate([np.repeat(np.arange(ns), self.vocab_sizes), np.arange(ns)])
        wsalt = np.uint64(self._weight_salt)
        self._slot_weight = _hash_gauss(keys ^ wsalt) * self._sigma[field]
        self._slot_latent = [_hash_gauss(keys ^ (wsalt ^ np.uint64((k + 1) * 0x1000193))) for k in range(4)]

    def _logit(self, keys, dense):
        """True logit from the slot keys ``[n, num_sparse]`` and the dense features."""
        z = self._bias + self._slot_weight[keys].sum(1)
        if self.num_dense:
            t = (dense.astype(np.float64) - self._dense_loc) / self._dense_scale
            z += t @ self._dense_w + 0.4 * np.tanh(t[:, 0])
        for f, g in self._pairs:        # FM interactions with 4 latent dims
            dot = 0.0
            for lat in self._slot_latent:
                dot = dot + lat[keys[:, f]] * lat[keys[:, g]]
            z += 0.1 * dot
        return z

    def _generate(self, block, calibrate=False):
        """All columns of rows ``[block * _SYN_BLOCK, (block + 1) * _SYN_BLOCK)``."""
        n = _SYN_BLOCK
        rng = np.random.default_rng([self.seed, 2, block + (1 << 40)])
        nd, ns = self.num_dense, self.num_sparse
        rows = block * n + np.arange(n, dtype=np.float64)
        t = np.maximum(rows, 0.0) * (self.drift * 1e-6)
        u = rng.random((n, ns))
        cmiss = rng.random((n, ns)) < self._sparse_missing
        field = np.arange(ns)
        slot = np.empty((n, ns), dtype=np.int64)
        for f in range(ns):
            slot[:, f] = np.searchsorted(self._cdf[f], u[:, f], side="right")
        slot = np.minimum(slot, np.array(self.vocab_sizes) - 1) + self._offset
        gen = np.floor(t[:, None] * self._speed[slot] + self._phase[slot]).astype(np.uint64)
        key = _mix64(self._value_salt ^ (slot - self._offset).astype(np.uint64))
        with np.errstate(over="ignore"):
            values = _mix64(key + gen * np.uint64(_FIELD_MUL)) & np.uint64(0xFFFFFFFF)
        ids = np.where(cmiss, _missing_feature_id(field, ns), _hash_feature(field, values, ns))
        # The hidden weights belong to the slot, not to its current id: a new id inherits the
        # appeal of the one it replaces (so the click model stays stationary), but a model has to
        # learn it afresh. An empty field has a key of its own.
        keys = np.where(cmiss, self._offset[-1] + self.vocab_sizes[-1] + field, slot)
        z = rng.standard_normal((n, nd))
        dmiss = rng.random((n, nd)) < self._dense_missing
        raw = np.floor(np.expm1(np.maximum(self._dense_mu + self._dense_sd * z, 0.0))).astype(np.int64)
        if nd > 1:
            raw[:, 1] -= 2                       # one field with small negative values, like Criteo's I2
        raw[dmiss] = 0
        dense = _dense_transform(raw)
        out = {"ids": ids, "keys": keys, "dense": dense}
        if calibrate:
            return out
        prob = 1.0 / (1.0 + np.exp(-self._logit(keys, dense)))
        out.update(values=values, cmiss=cmiss, raw=raw, dmiss=dmiss, prob=prob,
                   label=(rng.random(n) < prob).astype(np.float32))
        return out

    def _block_data(self, block):
        if self._block[0] != block:
            self._block = (block, self._generate(block))
        return self._block[1]

    def _rows(self, start, count, keys):
        """Columns ``keys`` of rows ``[start, start + count)``, gathered across blocks."""
        parts = {k: [] for k in keys}
        row, end = start, start + count
        while row < end:
            block, off = divmod(row, _SYN_BLOCK)
            take = min(end - row, _SYN_BLOCK - off)
            data = self._block_data(block)
            for k in keys:
                parts[k].append(data[k][off:off + take])
            row += take
        return {k: (v[0] if len(v) == 1 else np.concatenate(v)) for k, v in parts.items()}

    # ---- iteration ------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self.num_batches is not None and self._batches >= self.num_batches:
            raise StopIteration
        start, b = self._row, self.batch_size
        cols = self._rows(start, b, ("dense", "ids", "label", "prob"))
        out = [cols["dense"].copy(), cols["ids"].copy(), cols["label"].reshape(b, 1).copy()]
        if self.with_probability:
            out.append(cols["prob"].astype(np.float32).reshape(b, 1))
        if self.with_timestamp:
            out.append(np.array(self.timestamp_of(start), dtype=np.int64))
        self._row += b
        self._batches += 1
        return tuple(out)

    def take(self, n_batches):
        """The next ``n_batches`` batches as a list (the stream advances past them)."""
        n_batches = _check_int("SyntheticClickStream.take", "n_batches", n_batches, 0)
        return [next(self) for _ in range(n_batches)]

    def timestamp_of(self, row):
        """Data time in whole seconds of row ``row``: ``start_time + floor(row / rows_per_second)``."""
        return self.start_time + int(row // self.rows_per_second)

    def position(self):
        """``{"rows": n}``: rows yielded so far; pass ``start_row=n`` to resume right after them."""
        return {"rows": self._row}

    def seek(self, row):
        """Continue the stream at row ``row`` (for checkpoint resume)."""
        self._row = _check_int("SyntheticClickStream.seek", "row", row, 0)

    def oracle_auc(self, num_rows=262144, start_row=None):
        """AUC of the true click probabilities against the labels on ``num_rows`` rows starting at
        ``start_row`` (default: the current position); the stream itself does not advance."""
        num_rows = _check_int("SyntheticClickStream.oracle_auc", "num_rows", num_rows, 1)
        start = self._row if start_row is None else \
            _check_int("SyntheticClickStream.oracle_auc", "start_row", start_row, 0)
        cols = self._rows(start, num_rows, ("label", "prob"))
        return roc_auc(cols["label"], cols["prob"])

    def write_criteo(self, path, n_rows, start_row=0):
        """Write rows ``[start_row, start_row + n_rows)`` of this stream to ``path`` in the Criteo text
        format (label, the raw dense integers, categorical values as 8 lowercase hex digits; missing
        values are empty fields). Reading the file back with ``CriteoReader`` gives the same ids and
        labels, and the same dense features (the transform is the same). The stream does not advance."""
        where = "SyntheticClickStream.write_criteo"
        n_rows = _check_int(where, "n_rows", n_rows, 0)
        start_row = _check_int(where, "start_row", start_row, 0)
        with open(path, "w", encoding="ascii", newline="\n") as fh:
            row = start_row
            while row < start_row + n_rows:
                take = min(start_row + n_rows - row, 65536)
                c = self._rows(row, take, ("label", "raw", "dmiss", "values", "cmiss"))
                cols = [list(map("%d".__mod__, c["label"].astype(np.int64)))]
                for j in range(self.num_dense):
                    txt = np.array(list(map("%d".__mod__, c["raw"][:, j])), dtype=object)
                    txt[c["dmiss"][:, j]] = ""
                    cols.append(txt.tolist())
                for f in range(self.num_sparse):
                    txt = np.array(list(map("%08x".__mod__, c["values"][:, f].tolist())), dtype=object)
                    txt[c["cmiss"][:, f]] = ""
                    cols.append(txt.tolist())
                fh.write("\n".join(map("\t".join, zip(*cols))))
                fh.write("\n")
                row += take


class CriteoReader:
    """Stream batches from a file in the Criteo display-advertising text format.

    Each line is ``label<TAB>I1..I13<TAB>C1..C26`` (counts configurable): label ``0``/``1``, integer
    dense features, categorical features as hex strings; any feature may be empty. ``source`` is a
    path (``.gz`` is decompressed) or a binary file object. The file is read ``chunk_bytes`` at a
    time and parsed by the ``parse_criteo`` kernel; batches are the tuple of ``SyntheticClickStream``:
    dense float32 ``[B, num_dense]`` = ``sign(x) * log1p(|x|)`` with empty -> 0, ids int64
    ``[B, num_sparse]`` = ``_hash_feature(field, hex value)`` or the field's missing id when empty,
    label float32 ``[B, 1]``. The last batch is short unless ``drop_remainder``.

    Malformed lines (wrong field count, bad label, a dense field that is not an int64 integer, a
    categorical field that is not 1-16 hex digits, a line longer than ``max_line_bytes``) are
    skipped and counted by reason in ``stats()``; the first ``max_warnings`` are logged with their
    line number. They never reach a batch.

    ``position()`` after a batch gives ``{"offset", "lines", "rows"}``: the byte offset just past the
    last row yielded, the lines and rows up to it. ``CriteoReader(path, start=that_dict)`` continues
    right after it (``start`` may also be a plain byte offset at a line start).
    """

    def __init__(self, source, batch_size=2048, drop_remainder=False, num_dense=13, num_sparse=26,
                 start=None, chunk_bytes=1 << 22, max_line_bytes=1 << 20, max_warnings=5):
        where = "CriteoReader"
        self.batch_size = _check_int(where, "batch_size", batch_size, 1)
        self.drop_remainder = _check_bool(where, "drop_remainder", drop_remainder)
        self.num_dense = _check_int(where, "num_dense", num_dense, 0)
        self.num_sparse = _check_int(where, "num_sparse", num_sparse, 1)
        self.chunk_bytes = _check_int(where, "chunk_bytes", chunk_bytes, 1)
        self.max_line_bytes = _check_int(where, "max_line_bytes", max_line_bytes, 1)
        self.max_warnings = _check_int(where, "max_warnings", max_warnings, 0)
        if start is None:
            start = {"offset": 0, "lines": 0, "rows": 0}
        elif isinstance(start, (int, np.integer)) and not isinstance(start, (bool, np.bool_)):
            start = {"offset": start, "lines": 0, "rows": 0}
        if not isinstance(start, dict) or sorted(start) != ["lines", "offset", "rows"]:
            _fail(where, "'start'", "None, a byte offset or a dict from position()", start, TypeError)
        for key in ("offset", "lines", "rows"):
            _check_int(where, "start['%s']" % key, start[key], 0)
        if isinstance(source, (str, os.PathLike)):
            import gzip
            path = os.fspath(source)
            self._fh = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
            self._owned = True
        elif hasattr(source, "read"):
            self._fh, self._owned = source, False
        else:
            _fail(where, "'source'", "a path or a binary file object", source, TypeError)
        if start["offset"]:
            self._fh.seek(start["offset"])
        self._base = int(start["offset"])     # byte offset of the next unparsed byte's line start
        self._lines = int(start["lines"])     # lines parsed so far
        self._carry = b""                     # an incomplete last line, waiting for more bytes
        self._skipping = False                # inside a line longer than max_line_bytes
        self._eof = False
        self._pending = []                    # parsed, not yet yielded: [labels, dense, ids, end, line]
        self._pending_rows = 0
        self._parsed_rows = 0
        self._malformed = np.zeros(len(_CRITEO_REASONS), dtype=np.int64)
        self._warned = 0
        self._batches = 0
        self._position = dict(start)

    # ---- reading and parsing -------------------------------------------------------------------------
    def _read(self):
        data = self._fh.read(self.chunk_bytes)
        if not isinstance(data, (bytes, bytearray)):
            _fail("CriteoReader", "the file", "opened in binary mode ('rb')", type(data).__name__, TypeError)
        return bytes(data)

    def _fill(self):
        """Read one chunk and parse its complete lines (at end of file, the last partial line too)."""
        data = self._read()
        if not data:
            self._eof = True
            if self._skipping:
                self._skip_done(0)
            elif self._carry:
                buf, self._carry = self._carry, b""
                self._parse(buf)
            self._close_owned()
            return
        if self._skipping:
            cut = data.find(b"\n")
            if cut < 0:
                self._base += len(data)
                return
            self._skip_done(cut + 1)
            data = data[cut + 1:]
        buf = self._carry + data
        cut = buf.rfind(b"\n") + 1
        self._carry = buf[cut:]
        if cut:
            self._parse(buf[:cut])
        if len(self._carry) > self.max_line_bytes:
            self._base += len(self._carry)
            self._carry = b""
            self._skipping = True

    def _skip_done(self, tail):
        """The over-long line ends ``tail`` bytes into the current chunk: count it once."""
        self._base += tail
        self._lines += 1
        self._skipping = False
        self._count_bad(np.array([_CRITEO_TOO_LONG]), np.array([self._lines]))

    def _count_bad(self, codes, line_numbers):
        self._malformed += np.bincount(codes, minlength=len(_CRITEO_REASONS))
        for code, line in zip(codes[:max(0, self.max_warnings - self._warned)], line_numbers):
            self._warned += 1
            _DATA_LOG.warning("CriteoReader: line %d skipped (%s)%s", line, _CRITEO_REASONS[code],
                              "; further malformed lines are only counted in stats()"
                              if self._warned == self.max_warnings else "")

    def _parse(self, buf):
        labels, dense, ids, status, line_end = parse_criteo(buf, self.num_dense, self.num_sparse)
        bad = np.flatnonzero(status != _CRITEO_OK)
        if bad.size:
            self._count_bad(status[bad].astype(np.int64), self._lines + bad + 1)
        good = np.flatnonzero(status == _CRITEO_OK)
        if good.size:
            self._pending.append([labels, dense, ids, self._base + line_end[good], self._lines + good + 1])
            self._pending_rows += good.size
            self._parsed_rows += good.size
        self._lines += status.size
        self._base += len(buf)

    def _close_owned(self):
        if self._owned and not self._fh.closed:
            self._fh.close()

    # ---- iteration -----------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        while self._pending_rows < self.batch_size and not self._eof:
            self._fill()
        take = min(self.batch_size, self._pending_rows)
        if take == 0 or (take < self.batch_size and self.drop_remainder):
            raise StopIteration
        parts, need = [], take
        while need:
            head = self._pending[0]
            k = min(need, head[0].size)
            parts.append([col[:k] for col in head])
            if k == head[0].size:
                self._pending.pop(0)
            else:
                self._pending[0] = [col[k:] for col in head]
            need -= k
        cols = [p[0] if len(parts) == 1 else np.concatenate(p) for p in zip(*parts)]
        labels, raw, ids, ends, lines = cols
        self._pending_rows -= take
        self._batches += 1
        self._position = {"offset": int(ends[-1]), "lines": int(lines[-1]),
                          "rows": self._position["rows"] + take}
        return _dense_transform(raw), np.ascontiguousarray(ids), labels.reshape(take, 1)

    def position(self):
        """Where the rows yielded so far end: ``{"offset": bytes, "lines": n, "rows": n}``; pass it as
        ``start`` to a new reader to continue right after the last yielded row."""
        return dict(self._position)

    def stats(self):
        """Counts so far: ``lines`` and ``rows`` parsed (reading runs up to one chunk ahead of the
        batches), ``batches`` and ``rows_yielded``, and ``malformed``: skipped lines by reason."""
        return {"lines": self._lines, "rows": self._parsed_rows, "batches": self._batches,
                "rows_yielded": self._position["rows"],
                "malformed": {r: int(c) for r, c in zip(_CRITEO_REASONS[1:], self._malformed[1:])}}

    def close(self):
        """Close the file if the reader opened it."""
        self._close_owned()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# =====================================================================================================
# Callbacks and metrics
# =====================================================================================================
# ---- metrics ----------------------------------------------------------------------------------------
# Metrics follow MindSpore's protocol (``clear`` / ``update(y_pred, y)`` / ``eval``; ``set_indexes``
# works) and accept Tensors, lists or arrays of any shape with one score per sample.


def _metric_arrays(where, scores, labels):
    """Flatten (scores, labels) to float64 vectors of one length; labels must be 0/1, scores finite."""
    scores = np.asarray(scores.asnumpy() if isinstance(scores, Tensor) else scores, dtype=np.float64).ravel()
    labels = np.asarray(labels.asnumpy() if isinstance(labels, Tensor) else labels).ravel()
    if scores.shape != labels.shape:
        _fail(where, "the number of scores and labels", "equal",
              "%d scores, %d labels" % (scores.size, labels.size))
    if not np.all(np.isfinite(scores)):
        _fail(where, "the scores", "finite", scores[~np.isfinite(scores)][:3].tolist())
    bad = (labels != 0) & (labels != 1)
    if np.any(bad):
        _fail(where, "the labels", "0 or 1", labels[bad][:3].tolist())
    return scores, labels.astype(bool)


def _auc_from_counts(pos, neg):
    """AUC from positive/negative counts per distinct score, in ascending score order (ties count 1/2)."""
    n_pos, n_neg = float(pos.sum()), float(neg.sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC is undefined when only one class is present (%d positive, %d negative "
                         "samples)." % (n_pos, n_neg))
    neg_below = np.cumsum(neg) - neg
    return float(np.sum(pos * (neg_below + 0.5 * neg)) / (n_pos * n_neg))


def _score_counts(scores, labels):
    values, inverse = np.unique(scores, return_inverse=True)
    pos = np.bincount(inverse, weights=labels, minlength=values.size)
    neg = np.bincount(inverse, minlength=values.size) - pos
    return values, pos, neg


def roc_auc(labels, scores):
    """Exact area under the ROC curve: the probability that a random positive scores above a random
    negative, ties counting one half (the Mann-Whitney U statistic over n_pos * n_neg). Raises
    ValueError when only one class is present."""
    scores, labels = _metric_arrays("roc_auc", scores, labels)
    _, pos, neg = _score_counts(scores, labels)
    return _auc_from_counts(pos, neg)


def log_loss(labels, probs, eps=1e-7):
    """Mean binary cross-entropy of probabilities ``probs`` (clipped to ``[eps, 1 - eps]``)."""
    probs, labels = _metric_arrays("log_loss", probs, labels)
    eps = _check_number("log_loss", "eps", eps, 0.0, 0.5, strict_min=True)
    if labels.size == 0:
        raise ValueError("For 'log_loss', there must be at least one sample, but got none.")
    p = np.clip(probs, eps, 1.0 - eps)
    return float(-np.mean(np.where(labels, np.log(p), np.log1p(-p))))


class AUC(ms.train.Metric):
    """Exact streaming ROC AUC (``update(scores, labels)``). It keeps one (score, positives,
    negatives) triple per distinct score seen, merged as it goes, so memory follows the number of
    distinct scores, not of samples, and ``eval`` is exact (ties count one half). Scores may be
    probabilities or logits."""

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self):
        """Forget all samples."""
        self._values = np.zeros(0)
        self._pos = np.zeros(0)
        self._neg = np.zeros(0)
        self._pending = []
        self._pending_n = 0

    @ms.train.rearrange_inputs
    def update(self, *inputs):
        """Add a batch: ``update(scores, labels)``."""
        if len(inputs) != 2:
            _fail("AUC.update", "the inputs", "(scores, labels)", "%d inputs" % len(inputs))
        scores, labels = _metric_arrays("AUC.update", inputs[0], inputs[1])
        self._pending.append((scores, labels))
        self._pending_n += scores.size
        if self._pending_n >= max(1 << 16, self._values.size):
            self._merge()

    def _merge(self):
        if not self._pending:
            return
        scores = np.concatenate([self._values] + [s for s, _ in self._pending])
        pos_w = np.concatenate([self._pos] + [l.astype(np.float64) for _, l in self._pending])
        neg_w = np.concatenate([self._neg] + [(~l).astype(np.float64) for _, l in self._pending])
        self._values, inverse = np.unique(scores, return_inverse=True)
        self._pos = np.bincount(inverse, weights=pos_w, minlength=self._values.size)
        self._neg = np.bincount(inverse, weights=neg_w, minlength=self._values.size)
        self._pending, self._pending_n = [], 0

    def eval(self):
        """The AUC of every sample since ``clear``; RuntimeError when there is none, ValueError when
        only one class was seen."""
        self._merge()
        if self._values.size == 0:
            raise RuntimeError("AUC.eval needs at least one sample; call update() first.")
        return _auc_from_counts(self._pos, self._neg)


class LogLoss(ms.train.Metric):
    """Streaming mean binary cross-entropy (``update(probs, labels)``, probabilities clipped to
    ``[eps, 1 - eps]``); ``from_logits=True`` takes logits instead."""

    def __init__(self, eps=1e-7, from_logits=False):
        super().__init__()
        self.eps = _check_number("LogLoss", "eps", eps, 0.0, 0.5, strict_min=True)
        self.from_logits = _check_bool("LogLoss", "from_logits", from_logits)
        self.clear()

    def clear(self):
        """Forget all samples."""
        self._sum, self._count = 0.0, 0

    @ms.train.rearrange_inputs
    def update(self, *inputs):
        """Add a batch: ``update(probs, labels)``."""
        if len(inputs) != 2:
            _fail("LogLoss.update", "the inputs", "(probs, labels)", "%d inputs" % len(inputs))
        p, labels = _metric_arrays("LogLoss.update", inputs[0], inputs[1])
        if self.from_logits:
            p = 1.0 / (1.0 + np.exp(-p))
        p = np.clip(p, self.eps, 1.0 - self.eps)
        self._sum += float(-np.sum(np.where(labels, np.log(p), np.log1p(-p))))
        self._count += p.size

    def eval(self):
        """Mean log loss since ``clear``; RuntimeError when there is no sample."""
        if self._count == 0:
            raise RuntimeError("LogLoss.eval needs at least one sample; call update() first.")
        return self._sum / self._count


class Accuracy(ms.train.Metric):
    """Streaming binary accuracy (``update(probs, labels)``): a sample is predicted positive when its
    probability is >= ``threshold`` (0.5); ``from_logits=True`` applies the sigmoid first."""

    def __init__(self, threshold=0.5, from_logits=False):
        super().__init__()
        self.threshold = _check_number("Accuracy", "threshold", threshold, 0.0, 1.0)
        self.from_logits = _check_bool("Accuracy", "from_logits", from_logits)
        self.clear()

    def clear(self):
        """Forget all samples."""
        self._correct, self._count = 0, 0

    @ms.train.rearrange_inputs
    def update(self, *inputs):
        """Add a batch: ``update(probs, labels)``."""
        if len(inputs) != 2:
            _fail("Accuracy.update", "the inputs", "(probs, labels)", "%d inputs" % len(inputs))
        p, labels = _metric_arrays("Accuracy.update", inputs[0], inputs[1])
        if self.from_logits:
            p = 1.0 / (1.0 + np.exp(-p))
        self._correct += int(np.sum((p >= self.threshold) == labels))
        self._count += p.size

    def eval(self):
        """Fraction of correct predictions since ``clear``; RuntimeError when there is no sample."""
        if self._count == 0:
            raise RuntimeError("Accuracy.eval needs at least one sample; call update() first.")
        return self._correct / self._count


# =====================================================================================================
# RecModel
# =====================================================================================================

# =====================================================================================================
# Command line: python -m recboost ...
# =====================================================================================================

__all__ = [
    "FAST_BACKEND",
    "FAST_BACKEND_REASON",
    # Data: Criteo-format reader and synthetic click stream
    "SyntheticClickStream",
    "CriteoReader",
    "parse_criteo",
    # Callbacks and metrics: metrics
    "AUC",
    "LogLoss",
    "Accuracy",
    "roc_auc",
    "log_loss",
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
