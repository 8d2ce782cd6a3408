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

``RECBOOST_EXCHANGE_TIMEOUT`` (seconds, default 600; 0: off): how long a rank waits for the others
in the collectives of hash tables that span ranks before it exits with a clear message (see
``_RankExchange``).

Copyright 2026 the recboost authors. Licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0). This notice travels with vendored copies.
"""

__version__ = "0.2.0"
__license__ = "Apache-2.0"

__all__ = [
    "FAST_BACKEND",
    "FAST_BACKEND_REASON",
    # loss scaling, mixed precision, train-step cells
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleUpdateCell",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "TrainOneStepWithLossScaleCell",
    "build_train_network",
    # RecModel, callbacks
    "WideDeep",
    "RecModel",
    "Predictor",
    "load_mindir",
    "ProgressMonitor",
    "OnlineCheckpoint",
    "OnlineExport",
    "latest_checkpoint",
    "demo",
    "serve",
    "serve_check",
    "train_job",
    # Data: Criteo-format reader and synthetic click stream
    "SyntheticClickStream",
    "CriteoReader",
    "criteo_split",
    "parse_criteo",
    # Callbacks and metrics: metrics
    "AUC",
    "LogLoss",
    "Accuracy",
    "roc_auc",
    "log_loss",
    # Hash embedding
    "HASH_DEFAULT_ROW",
    "HASH_SCRATCH_ROW",
    "HashCache",
    "HashEmbedding",
    "HashEmbeddingLookup",
    "TableConfig",
    "LRU",
    "LFU",
    "Count",
    "Sketch",
    "WeightedIds",
    "WEIGHTS_SUFFIX",
    "OFFSETS_SUFFIX",
    "sparse_optimizers",
    "sparse_optimizer",
    "SparseSGD",
    "SparseAdagrad",
    "SparseRowWiseAdagrad",
    "SparseAdam",
    "SparseFtrl",
    "FeatureSpec",
    "create_table",
    "sparse_lookup",
    "EvictHook",
    # AutoBoost and the boost algorithms
    "AutoBoost",
    "BoostTrainOneStepCell",
    "BoostTrainOneStepWithLossScaleCell",
    "LessBN",
    "GradientFreeze",
    "FreezeOpt",
    "freeze_cell",
    "GradientAccumulation",
    "OptimizerProcess",
    "ParameterProcess",
    "GroupLossScaleManager",
    "AdaSum",
    "DimReduce",
    "compute_pca_mat",
    "save_pca_mat",
    "load_pca_rows",
    "freeze_index_sequence",
    "pca_rows_copy",
]


# =====================================================================================================
# Imports and backend selection
# =====================================================================================================
# The standard library, numpy and MindSpore (imports of optional or heavy modules stay where they are
# used), then ``_select_backend``: the compiled kernels of ``_fast.pyx`` or the numpy fallback, and why.
import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import gzip
import hashlib
import inspect
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import types
import uuid
import zipfile
import zlib

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.sparse_tensor import RowTensorInner
from mindspore.nn.learning_rate_schedule import LearningRateSchedule as _LearningRateSchedule
from mindspore.nn.optim.optimizer import _IteratorLearningRate


from mindspore.train.callback import Callback as _Callback


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
# Every constant, by subject: the numpy side's 64-bit mixer, boost levels, hash tables, mixed precision
# and the train step, the Criteo format, file and checkpoint names and formats.
# The one 64-bit mixer (splitmix64's finaliser and golden-ratio increment) of the numpy side; _fast.pyx
# holds the same constants once.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX_M1 = 0xBF58476D1CE4E5B9
_MIX_M2 = 0x94D049BB133111EB


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


def _owner_of(ids, world):
    """The rank that owns each id of a row-wise table: ``mix64(id) % world`` (int64)."""
    return (_mix64(np.ascontiguousarray(ids, np.int64).view(np.uint64)) % np.uint64(world)).astype(np.int64)


# ---- boost ------------------------------------------------------------------------------------------
# Immutable tables; every AutoBoost builds its own dicts from them (no shared mutable preset).
#: Boost algorithms, in the order of MindSpore's "boost" section.
_BOOST_ALGORITHMS = ("less_bn", "grad_freeze", "adasum", "grad_accumulation", "dim_reduce",
                     "loss_scale_group")
#: Algorithms each level turns on (MindSpore's presets).
_BOOST_LEVELS = {"O0": (), "O1": ("less_bn", "grad_freeze"), "O2": ("less_bn", "grad_freeze", "adasum")}
_BOOST_MODES = ("auto", "manual", "enable_all", "disable_all")


# ---- hash tables ------------------------------------------------------------------------------------
#: Row every id maps to while it is not admitted (or could not get a row): never owned by an id.
HASH_DEFAULT_ROW = 0
#: Row no id ever gets (reserved; callers may use it as padding).
HASH_SCRATCH_ROW = 1
_HASH_RESERVED_ROWS = 2
_HASH_MAX_CAPACITY = 2 ** 31 - 1        # rows are int32
_HASH_TIME_LIMIT = 2 ** 62              # |times| and thresholds stay below this: no int64 overflow
_HASH_COMBINERS = (None, "sum", "mean", "sqrtn", "max")    # HashEmbedding pooling of multi-hot features
#: A dict batch's (a MindSpore dataset's) column "<name>" + WEIGHTS_SUFFIX holds the weights of the ids
#: in the column "<name>" (``WeightedIds``)
WEIGHTS_SUFFIX = ":weights"
#: A dict batch's (a MindSpore dataset's) column "<name>" + OFFSETS_SUFFIX holds the offsets of a ragged
#: feature whose values are the column "<name>" (the pair ``(values, offsets)``)
OFFSETS_SUFFIX = ":offsets"
_HASH_SHARDINGS = (None, "none", "data_parallel", "row_wise")    # HashEmbedding layouts across processes
_HASH_STAT_NAMES = ("admitted", "rejected", "overflowed", "evicted", "forgotten", "grown", "looked_up", "replaced",
                    "aged")
_HASH_POLICIES = (None, "lru", "lfu")    # eviction_policy: which id a full table replaces (None: none)
_HASH_BUCKET = 32                        # rows per eviction bucket (a new id's victim is in its bucket)
_HASH_LFU_HALF_LIFE = 3600               # default lfu_half_life: an hour of data time, or 3600 steps
_HASH_ROW_DTYPES = ("float32", "bfloat16")   # HashEmbedding row storage (bfloat16: uint16 bits)
_HASH_ENTRY_BYTES = 32                   # the compiled cache's map entry per tracked id (_fast.HASH_ENTRY_BYTES)
_HASH_POLICY_ROW_BYTES = 24              # ... and per row with an eviction policy (_fast.HASH_POLICY_ROW_BYTES)
# admission_counter: where ids below access_threshold are counted ("exact": one entry per id; "sketch": a
# count-min sketch of sketch_depth rows of sketch_width int32 counters, halved every sketch_window counts)
_HASH_COUNTERS = ("exact", "sketch")
_HASH_SKETCH_DEPTH = 4                   # default sketch_depth
_HASH_SKETCH_MIN_WIDTH = 1024            # default sketch_width: max(this, 4 x the table's capacity)
_HASH_SKETCH_MAX_DEPTH = 16
_HASH_SKETCH_MAX = 2 ** 31 - 1           # counters are int32, saturating here; widths and windows below it


# ---- mixed precision and the train step -------------------------------------------------------------
#: MindSpore's mixed precision levels; each maps to (cast_model_type, keep_batchnorm_fp32, dynamic
#: loss scaling). O1 runs MindSpore's white-list of ops in float16 (``auto_mixed_precision``). "auto"
#: is O2 on GPU and O3 on Ascend and stays float32 on CPU, where MindSpore 2.10's float16 matmul is
#: slower than float32 (MindSpore 2.10's own "auto" picks by device the same way).
_AMP_LEVELS = {
    "O0": (mstype.float32, False, False),
    "O1": (mstype.float32, False, False),
    "O2": (mstype.float16, True, True),
    "O3": (mstype.float16, False, False),
    "auto": (mstype.float32, False, False),
}
_AMP_KWARGS = ("cast_model_type", "keep_batchnorm_fp32", "loss_scale_manager")


_UNSCALED = "unscaled"      # _TrainStep's scale_sense for a step without loss scaling


# ---- data: Criteo format and the synthetic stream ---------------------------------------------------
_DATA_MASK64 = (1 << 64) - 1
_FIELD_MUL = _GOLDEN                  # golden-ratio multiplier: field index -> 64-bit salt
_MISSING_SALT = 0x6A09E667F3BCC909    # marks "this categorical field was empty"
# Per-line status codes of the parser kernel (index = code) and the name of each reason in stats().
_CRITEO_OK = 0
_CRITEO_REASONS = ("ok", "field_count", "label", "dense", "categorical", "too_long")
_CRITEO_TOO_LONG = 5


#: Default cardinalities of the 26 categorical fields of the synthetic stream (about 700K ids live
#: at any time; Criteo's own fields range from 3 to about 10M).
_SYN_VOCAB = (1000, 500, 100000, 50000, 300, 20, 10000, 600, 3, 50000, 5000, 100000, 3000,
              25, 10000, 100000, 10, 4000, 2000, 4, 100000, 15, 15, 50000, 80, 40000)
_SYN_BLOCK = 4096          # rows generated per RNG block; the stream is defined row by row


# ---- files: locks, temporary files, checkpoints -----------------------------------------------------
_LOCK_NAME = ".recboost.lock"
_TMP_PATTERN = re.compile(r"^\.tmp-(\d+)-.*\.npz$")


# The RecModel checkpoint: one .npz file. Its member "manifest" (JSON as uint8 bytes) describes
# everything and names the array member of every piece (see RecModel.save_checkpoint); loading
# looks arrays up by those names only. Format 4 adds checksums: the manifest holds the sha256 of its
# own content and lists every member's size and sha256 (the section Callbacks: _read_checkpoint_file).
# Format 3 (0.2.0 before the checksums) is still read, its members checked by the zip's CRC-32;
# format 2 (before 0.2.0: metadata in the member "meta", the structure in the array names) is refused
# by name.
_CHECKPOINT_FORMAT = 4       # 3: a manifest naming the arrays; 4: and checksums of every member and of itself
_CHECKPOINT_DELTA_FORMAT = 5  # a delta: format 4's manifest plus "delta" (its predecessor, the patches of its arrays)
_CHECKPOINT_MANIFEST = "manifest"
_SKIP_REASONS = ("empty", "bad_label", "nonfinite")

# The serving bundle (RecModel.export, Predictor; the section "Serving"): a directory whose
# manifest.json (itself checksummed) names every file with its size and sha256, and records the network.
_BUNDLE_FORMAT = 2           # 1: dense.ckpt, per table ids / rows / default row (.npy), deltas add evicted ids
#                              2: manifest.json carries its sha256 and records the network (class, settings,
#                                 parameters); format 1 is refused by name (export again); an optional field
#                                 'mindir' (export's mindir=: dense.mindir and its inputs; absent or null:
#                                 none) that readers of format 2 without it pass over, its file checked
_BUNDLE_MANIFEST = "manifest.json"
_BUNDLE_DENSE = "dense.ckpt"
_BUNDLE_MINDIR = "dense.mindir"   # the network as MindIR (mindspore.export), when exported with mindir=
_TMP_BUNDLE_PATTERN = re.compile(r"^\.tmp-(\d+)-[0-9a-f]{12}\.bundle$")    # a bundle being written (_write_bundle)


# =====================================================================================================
# Errors, argument checks, logging and atomic writes
# =====================================================================================================
# What every other section uses: ``_fail``, the ``_check_*`` validators, the schema rules of saved
# state (``_validate``), the checksummed JSON files, logging and ``_atomic_write``.
# One message form everywhere: where, which argument, what was expected, what was given.


def _fail(where, name, expected, got, exc=ValueError):
    """Raise ``exc`` with recboost's one error form."""
    raise exc("For '%s', %s must be %s, but got %r." % (where, name, expected, got))


class _TrainingStopped(RuntimeError):
    """Training stopped on purpose, its model and last good checkpoint kept: ``OnlineCheckpoint``'s
    failed saves in a row, a run of skipped steps. ``python -m recboost`` ends with exit code 3 and
    the message, no traceback."""


def _check_bool(where, name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(where, "'%s'" % name, "a bool", value, TypeError)
    return bool(value)


def _int_problem(value, minimum=None, maximum=None):
    """None for an int (bools refused) within ``[minimum, maximum]``, else ``(expected, exception
    class)`` for the error."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return "an int", TypeError
    if minimum is not None and value < minimum:
        return "an int >= %s" % minimum, ValueError
    if maximum is not None and value > maximum:
        return "an int <= %s" % maximum, ValueError
    return None


def _check_int(where, name, value, minimum=None, maximum=None):
    """An int (bools refused) within ``[minimum, maximum]``."""
    problem = _int_problem(value, minimum, maximum)
    if problem:
        _fail(where, "'%s'" % name, problem[0], value, problem[1])
    return int(value)


def _check_number(where, name, value, minimum=None, maximum=None, strict_min=False, strict_max=False):
    """A finite real number (bools refused) within the bounds; ``strict_*`` make a bound open. The
    message states the whole interval when both bounds are given, e.g. ``a number in [0, 1)``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(where, "'%s'" % name, "a number", value, TypeError)
    value = float(value)
    if not np.isfinite(value):
        _fail(where, "'%s'" % name, "a finite number", value)
    low_bad = minimum is not None and (value <= minimum if strict_min else value < minimum)
    high_bad = maximum is not None and (value >= maximum if strict_max else value > maximum)
    if low_bad or high_bad:
        if minimum is not None and maximum is not None:
            expected = "a number in %s%s, %s%s" % ("(" if strict_min else "[", minimum, maximum,
                                                   ")" if strict_max else "]")
        elif low_bad:
            expected = "a number %s %s" % (">" if strict_min else ">=", minimum)
        else:
            expected = "a number %s %s" % ("<" if strict_max else "<=", maximum)
        _fail(where, "'%s'" % name, expected, value)
    return value


def _check_one_of(where, name, value, choices):
    """One of ``choices`` (an unhashable or array value is simply not among them)."""
    try:
        found = value in choices
    except (TypeError, ValueError):
        found = False
    if not found:
        _fail(where, "'%s'" % name, "one of %s" % list(choices), value)
    return value


def _check_no_kwargs(where, kwargs, allowed=()):
    """TypeError naming the first of ``kwargs`` (sorted) not among ``allowed``: "the keyword arguments must
    be among [...]", or, with nothing allowed, "must be none (<where> takes no other keywords)"."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        expected = "among %s" % sorted(allowed) if allowed else "none (%s takes no other keywords)" % where
        _fail(where, "the keyword arguments", expected, unknown[0], TypeError)


def _check_path(where, name, value):
    """None or a path string."""
    if value is not None and not isinstance(value, str):
        _fail(where, "'%s'" % name, "None or a path string", value, TypeError)
    return value


def _check_int_list(where, name, value, minimum=0):
    """A list of ints >= ``minimum`` as a tuple; one int means a list of one (MindSpore's list(int)
    raises on it)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        _fail(where, "'%s'" % name, "a list of ints >= %s" % minimum, value, TypeError)
    return tuple(_check_int(where, "%s[%d]" % (name, i), x, minimum) for i, x in enumerate(value))


# ---- declarative checks of saved state -----------------------------------------------------------
# Checkpoint manifests, bundle manifests and state dicts are each described by a schema built of
# the rules below and checked by ``_validate``, which makes the errors: the readers word them for
# their file (``fail``) and keep only the checks that relate fields to each other or to the model.


class _Absent:
    """The "given" of a field that is missing."""

    def __repr__(self):
        return "missing"


_ABSENT = _Absent()
_OMIT = object()            # a rule's default: an absent optional field stays absent in the result


class _Given:
    """How a refused value shows in an error: an array by its dtype and shape, anything else by a
    repr of at most 160 characters."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        if isinstance(self.value, np.ndarray):
            return "%s array of shape %s" % (self.value.dtype, self.value.shape)
        text = repr(self.value)
        return text if len(text) <= 160 else text[:150] + " ... " + text[-5:]


class _Checking:
    """Where ``_validate`` sends errors: ``fail(at, expected, got, exception class)`` raises, and
    ``field(at, key)`` names an object's field below ``at`` (``"a.b"`` or ``"state['b']"``)."""

    def __init__(self, fail, field):
        self.fail, self.field = fail, field

    @classmethod
    def manifest(cls, fail):
        """Fields named as a manifest's JSON paths: ``tables[0].cache['keys']``."""
        return cls(fail, lambda at, key: "%s.%s" % (at, key) if at else key)

    @classmethod
    def state(cls, where):
        """recboost's error form, fields named as subscripts of the root: ``'state['cache']['keys']'``."""
        return cls(cls._raise_for(where), lambda at, key: "%s[%r]" % (at, key))

    @classmethod
    def arguments(cls, where):
        """recboost's error form, a dict's fields named as arguments: ``'capacity'``."""
        return cls(cls._raise_for(where), lambda at, key: key)

    @staticmethod
    def _raise_for(where):
        return lambda at, expected, got, exc: _fail(where, "'%s'" % at, expected, got, exc)


class _Rule:
    """A schema leaf: a value of one of the types ``kinds`` (else TypeError; bools only where
    ``kinds`` names bool) for which ``test`` holds (else ValueError; an exception from ``test``
    counts as False and its text joins ``expected``). ``expected`` words it in errors; ``convert``
    makes the checked value (default: the value as it is; an exception from it fails the value as
    one from ``test`` does). ``default``: the value of an absent field, ``_ABSENT`` when the field
    is required, ``_OMIT`` to leave it out of the result."""

    def __init__(self, expected, kinds=object, test=None, convert=None, default=_ABSENT):
        self.expected, self.kinds, self.test, self.convert, self.default = expected, kinds, test, convert, default
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        self._bools = object in kinds or bool in kinds or np.bool_ in kinds

    def optional(self, default=_OMIT):
        """This rule for a field that may be absent (``default``: its value then)."""
        rule = copy.copy(self)
        rule.default = default
        return rule

    def or_none(self):
        """This rule, or None (JSON null)."""
        return _OrNone(self)

    def check(self, value, at, checking):
        """The checked value; a bad one goes to ``checking.fail`` naming ``at``."""
        if not isinstance(value, self.kinds) or not self._bools and isinstance(value, (bool, np.bool_)):
            checking.fail(at, self.expected, _Given(value), TypeError)
        try:
            ok, why = self.test is None or self.test(value), ""
            if ok and self.convert is not None:
                value = self.convert(value)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            ok, why = False, " (%s)" % exc
        if not ok:
            checking.fail(at, self.expected + why, _Given(value), ValueError)
        return value


class _OrNone(_Rule):
    def __init__(self, rule):
        super().__init__("None or " + rule.expected, default=rule.default)
        self.rule = rule

    def check(self, value, at, checking):
        if value is None:
            return None
        here = lambda where, expected, got, exc: checking.fail(                              # noqa: E731
            where, "None or " + expected if where == at else expected, got, exc)
        return self.rule.check(value, at, _Checking(here, checking.field))


class _Int(_Rule):
    """An int within ``[minimum, maximum]`` (as ``_check_int``), made a Python int."""

    def __init__(self, minimum=None, maximum=None, default=_ABSENT):
        bounds = [op + " %s" % bound for op, bound in ((">=", minimum), ("<=", maximum)) if bound is not None]
        super().__init__(" ".join(["an int"] + [" and ".join(bounds)] * bool(bounds)), default=default)
        self.minimum, self.maximum = minimum, maximum

    def check(self, value, at, checking):
        problem = _int_problem(value, self.minimum, self.maximum)
        if problem:
            checking.fail(at, problem[0], _Given(value), problem[1])
        return int(value)


class _Fields(_Rule):
    """An object (a dict) with the fields ``entries``: name -> rule, or a function of the fields
    checked before it (a dict) -> rule. Other keys pass unchecked and are not in the result.
    ``relate(got, at, checking)``, when given, checks the fields against each other and returns
    the result."""

    def __init__(self, entries, expected="an object", relate=None, default=_ABSENT):
        super().__init__(expected, dict, default=default)
        self.entries, self.relate = entries, relate

    def check(self, value, at, checking):
        super().check(value, at, checking)
        got = {}
        for key, rule in self.entries.items():
            rule = rule if isinstance(rule, _Rule) else rule(got)
            name = checking.field(at, key)
            if key in value:
                got[key] = rule.check(value[key], name, checking)
            elif rule.default is _ABSENT:
                checking.fail(name, rule.expected, _ABSENT, ValueError)
            elif rule.default is not _OMIT:
                got[key] = rule.default
        return got if self.relate is None else self.relate(got, at, checking)


class _List(_Rule):
    """A list whose every item follows ``item``."""

    def __init__(self, item, expected="a list", default=_ABSENT):
        super().__init__(expected, list, default=default)
        self.item = item

    def check(self, value, at, checking):
        super().check(value, at, checking)
        return [self.item.check(v, "%s[%d]" % (at, i), checking) for i, v in enumerate(value)]


class _Map(_Rule):
    """An object whose keys follow ``key`` (else the whole object is refused, as ``expected``) and
    whose every value follows ``value``."""

    def __init__(self, value, key=None, expected="an object of str keys", default=_ABSENT):
        super().__init__(expected, dict, default=default)
        self.value, self.key = value, key or _Rule("a str", str)

    def check(self, value, at, checking):
        super().check(value, at, checking)
        bad_keys = [k for k in value if not isinstance(k, self.key.kinds) or
                    self.key.test is not None and not self.key.test(k)]
        if bad_keys:
            checking.fail(at, self.expected, _Given(value), ValueError)
        return {k: self.value.check(v, "%s[%r]" % (at, k), checking) for k, v in value.items()}


class _Ref(_Rule):
    """A name (a str) of something the file holds elsewhere: ``resolve(name, at)`` returns it (or
    raises, naming ``at``)."""

    def __init__(self, resolve, expected="a name (str)", default=_ABSENT):
        super().__init__(expected, str, default=default)
        self.resolve = resolve

    def check(self, value, at, checking):
        return self.resolve(super().check(value, at, checking), at)


def _validate(value, rule, checking, at=""):
    """``value`` checked against the schema ``rule``: the checked (converted) value, or the first
    problem sent to ``checking.fail`` (which raises)."""
    return rule.check(value, at, checking)


def _one_of(*choices):
    """A rule: one of ``choices`` (worded as ``_check_one_of`` words it)."""
    return _Rule("one of %s" % list(choices), test=lambda v: v in choices)


_TEXT = _Rule("a str", str)
_COUNT = _Int(0)
_ANY = _Rule("a value")
_FILE_NAME = _Rule("a file name (no directory)", str, test=lambda v: os.path.basename(v) == v
                   and v not in ("", ".", ".."))


def _array_rule(dtype, shape):
    """A numpy array of ``dtype`` and ``shape`` (None: any length on that axis), as an ndarray."""
    dtype = np.dtype(dtype)
    expected = "%s of shape (%s%s)" % (dtype.name, ", ".join("n" if d is None else str(d) for d in shape),
                                       "," * (len(shape) == 1))
    return _Rule(expected, test=lambda v: np.asarray(v).dtype == dtype and np.ndim(v) == len(shape) and all(
        d is None or d == g for d, g in zip(shape, np.shape(v))), convert=np.asarray)


def _log(message):
    """recboost's progress and notice lines go to stderr, flushed."""
    print("[recboost] " + message, file=sys.stderr, flush=True)
_WRITING = set()        # temporary files this process is writing right now (see _atomic_write)


def _fsync_path(path):
    """fsync a file or a directory by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _thread_beside(target, name, *args):
    """A daemon thread ``name`` started on ``target(*args)``, or None where no thread can start (the
    interpreter exiting): the helper threads of the file writes and reads, whose callers then do
    without them (:class:`_WritebackBeside`, :func:`_close_beside`, :class:`_FaultInBeside`)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:        # no new threads while the interpreter exits
        return None
    return thread


_WRITEBACK_BYTES = 1 << 28     # a file being written has its disk writes started every 256 MB (_WritebackBeside)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)      # (macOS has no posix_fadvise: nothing recycled there)


class _WritebackBeside:
    """A file written and fsynced, its disk writes started as it grows: a context manager around the
    writing to the open binary file ``fh``. A helper thread reads the file's size every 20 ms and, each
    time ``_WRITEBACK_BYTES`` more are in it, calls ``os.fdatasync`` while the caller writes the rest;
    leaving the context without an error stops the thread, waits for it (so the file is never closed
    under it), raises the OSError one of its fdatasyncs raised (Linux reports a failed write-back to one
    fsync of a file description only: that one is the write's error), then flushes ``fh`` and fsyncs
    it, which now waits only for what came after the thread's last sync. Where no thread can start
    (the interpreter exiting), none is: the final fsync writes everything.

    ``recycle``: descriptors of files this one replaces or follows (the checkpoint it overwrites, the
    one written before it), already on disk. The same thread drops their cached pages
    (``POSIX_FADV_DONTNEED``, in order, one file after the other) ``_WRITEBACK_BYTES`` ahead of the new
    file's size, so that the kernel hands those pages straight to the new file. Without it the new
    file takes pages that sat free: a VM that reports free memory to its host (Linux page_reporting)
    then has the host back each of them again, and an atomic write of 1.3 GB beside its old file took
    1.8-3.4 s against 0.62-0.98 s with the old file's pages dropped first (measured here,
    docs/performance.md). The files themselves are not changed: a later read takes them from disk."""

    def __init__(self, fh, recycle=()):
        self.fh, self.fd = fh, fh.fileno()
        self.error, self.stop, self.thread = None, threading.Event(), None
        self.recycle = [fd for fd in recycle if fd is not None] if _DONTNEED is not None else []

    def __enter__(self):
        self.thread = _thread_beside(self._run, "recboost-writeback")
        return self

    def _run(self):
        synced, sync = 0, getattr(os, "fdatasync", os.fsync)      # (macOS has no fdatasync)
        try:
            pieces = self._recycled_pieces()
            while True:
                size = os.fstat(self.fd).st_size
                pieces = self._dropped(pieces, size + _WRITEBACK_BYTES)
                if size - synced >= _WRITEBACK_BYTES:
                    sync(self.fd)
                    synced = size
                if self.stop.wait(0.02):
                    break
        except OSError as exc:
            self.error = exc

    def _recycled_pieces(self):
        """The recycled files in pieces of ``_WRITEBACK_BYTES``: ``(fd, offset, start)``, ``start``
        counted over the files one after the other."""
        pieces, start = [], 0
        for fd in self.recycle:
            try:
                size = os.fstat(fd).st_size
            except OSError:                             # (advice only: never the write's error)
                continue
            for offset in range(0, size, _WRITEBACK_BYTES):
                pieces.append((fd, offset, start))
                start += min(_WRITEBACK_BYTES, size - offset)
        return pieces

    @staticmethod
    def _dropped(pieces, upto):
        """Drop the cached pages of the ``pieces`` that start before ``upto``; the pieces left (none once
        the advice fails: a file that is not a regular one keeps its pages). Each advice covers its file
        from the start to the piece's end: the kernel drops a large folio (2 MB on x86) only once a
        range covers it whole."""
        k = 0
        try:
            while k < len(pieces) and pieces[k][2] < upto:
                os.posix_fadvise(pieces[k][0], 0, pieces[k][1] + _WRITEBACK_BYTES, _DONTNEED)
                k += 1
        except OSError:
            return []
        return pieces[k:]

    def __exit__(self, kind, value, traceback):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if kind is None:
            if self.error is not None:
                raise self.error
            self.fh.flush()
            os.fsync(self.fd)
        return False


def _held_open(path):
    """``path`` opened read-only (a descriptor), or None where it is not there or cannot be opened: a
    reference that keeps a file about to be replaced or unlinked alive until :func:`_close_beside`
    (non-blocking: a FIFO at ``path`` does not wait for a writer)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None


def _close_beside(fd):
    """Close ``fd`` on a helper thread: the last reference to a file just replaced or unlinked, whose
    cached pages the kernel frees as it goes (0.16 s a GB here, measured), on that thread and not the
    caller's time. In line where no thread can start (the interpreter exiting)."""
    if _thread_beside(os.close, "recboost-release", fd) is None:
        os.close(fd)


def _unlink_beside(path):
    """Remove the file ``path``, its pages freed beside the caller (:func:`_close_beside`)."""
    fd = _held_open(path)
    try:
        os.unlink(path)
    finally:
        if fd is not None:
            _close_beside(fd)


def _io_failed(exc, doing):
    """The OSError ``exc`` (a full disk, an I/O error, a permission...) as an OSError of the same errno,
    and so of the same class (``PermissionError``...), whose message adds ``doing``: what was being
    written where (the path, the bytes). The one form of a failed write (:func:`_atomic_write`, the
    bundle's files)."""
    text = "%s: %s" % (exc.strerror or str(exc), doing)
    return OSError(exc.errno, text) if exc.errno is not None else OSError(text)


def _atomic_write(path, write, size=None, recycle=None):
    """Write the file ``path`` all at once: ``write(fh)`` fills a temporary file in the same folder
    (opened ``wb``), which is flushed, fsynced (its disk writes started while it is written:
    :class:`_WritebackBeside`), renamed onto ``path``, and the folder fsynced; so ``path`` is the old
    file or the complete new one, never a part. The one way recboost writes files that must be
    complete: checkpoints (``RecModel.save_checkpoint``), PCA matrices (:func:`save_pca_mat`) and
    checked JSON files (:func:`_write_json_checked`).

    The temporary file is ``.tmp-<pid>-<random><ext>`` (``<ext>`` from ``path``; mode 0600; named
    per writer, so ``OnlineCheckpoint``'s cleaner, ``_TMP_PATTERN``, can tell whose it is) and is
    listed in ``_WRITING`` while it is being written. On any failure it is removed and the
    exception raised; an OSError (a full disk, an I/O error, no permission) is raised as an OSError
    of the same errno (so the same class, e.g. PermissionError) whose message names ``path``, the
    bytes of content being written (``size``, when the caller gives it) and those written when it
    failed: ``[Errno 28] No space left on device: writing '/ckpt/recboost-8.npz' (1048576 bytes of
    content) failed after 65536 bytes``.

    The cached pages of the file ``path`` replaces, and of ``recycle`` (a path: the file written
    before this one, which stays), are dropped as the new file grows and go to it
    (:class:`_WritebackBeside`'s ``recycle``); what is left of the replaced file's is freed beside
    the caller once it is gone (:func:`_close_beside`)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    held = [_held_open(path)] + ([_held_open(recycle)] if recycle is not None and os.path.abspath(recycle)
                                 != os.path.abspath(path) else [])
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-%d-" % os.getpid(), suffix=os.path.splitext(path)[1], dir=folder)
        _WRITING.add(tmp)
        with os.fdopen(fd, "wb") as fh:
            with _WritebackBeside(fh, held):
                write(fh)
        os.replace(tmp, path)
        _fsync_path(folder)
    except BaseException as exc:
        written = 0
        if tmp is not None and os.path.exists(tmp):
            try:
                written = os.stat(tmp).st_size
                os.unlink(tmp)
            except OSError:
                pass
        if not isinstance(exc, OSError):
            raise
        raise _io_failed(exc, "writing %r%s failed after %d bytes" % (
            path, "" if size is None else " (%d bytes of content)" % size, written)) from exc
    finally:
        _WRITING.discard(tmp)
        for kept in held:
            if kept is not None:
                _close_beside(kept)


# ---- JSON files that carry their own checksum -------------------------------------------------------
# A small JSON file recboost writes and reads back (train-config.json, an input position, a bundle's
# manifest.json) is one object holding, beside its fields, "sha256": the digest of the canonical form
# of the other fields (_json_canonical). The file stays readable and editable by hand; an edit that
# does not recompute the digest is refused on read.
_JSON_CHECKSUM = "sha256"


def _json_canonical(record):
    """The bytes a checked JSON file's digest is taken over: sorted keys, no spaces, ASCII."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _json_checked_bytes(record):
    """The file content of the JSON object ``record`` (a dict without the key ``"sha256"``) with its
    checksum added."""
    if not isinstance(record, dict) or _JSON_CHECKSUM in record:
        raise ValueError("a checked JSON record must be a dict without the key %r" % _JSON_CHECKSUM)
    digest = hashlib.sha256(_json_canonical(record)).hexdigest()
    return json.dumps(dict(record, **{_JSON_CHECKSUM: digest}), indent=1, sort_keys=True,
                      allow_nan=False).encode("ascii") + b"\n"


def _write_json_checked(path, record):
    """Write ``record`` to ``path`` with its checksum, all at once (:func:`_atomic_write`)."""
    content = _json_checked_bytes(record)
    _atomic_write(path, lambda fh: fh.write(content), size=len(content))


def _parse_json_checked(data, what):
    """The record held by the checked JSON content ``data`` (bytes) of the file named in ``what``
    (e.g. ``"the job settings '/x/train-config.json'"``), its checksum verified and removed. Any
    damage is one ValueError naming ``what`` and what failed: bytes that are not UTF-8 JSON, not an
    object, no checksum, or a checksum that does not match the content (an edit or a flipped byte)."""
    def bad(problem):
        raise ValueError("%s is damaged or was edited: %s; recboost refuses to use it." % (what, problem))
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        bad("it is not valid UTF-8 JSON (%s: %s)" % (type(exc).__name__, str(exc)[:200]))
    if not isinstance(record, dict):
        bad("it holds a JSON %s, not an object" % type(record).__name__)
    digest = record.pop(_JSON_CHECKSUM, None)
    if not isinstance(digest, str):
        bad("it has no %r checksum field (written by an older recboost, or by hand)" % _JSON_CHECKSUM)
    try:
        actual = hashlib.sha256(_json_canonical(record)).hexdigest()
    except ValueError as exc:       # NaN or Infinity: never written by recboost
        bad("it holds a value JSON does not allow (%s)" % exc)
    if actual != digest:
        bad("its content's sha256 is %s but the file records %s" % (actual, digest))
    return record


def _read_json_checked(path, what):
    """:func:`_parse_json_checked` of the file at ``path``; ``what`` names it (the path is added). An
    OSError (a missing file among them) is raised as it is: callers decide what a missing file means."""
    with open(path, "rb") as fh:
        data = fh.read()
    return _parse_json_checked(data, "%s %r" % (what, path))


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


# ---- hash cache: id -> row map with admission, eviction and growth (twin of _fast.HashCache) --------
# The public ``HashCache`` (bound with the other kernels at the end of this section) is
# ``_HashCacheChecks`` in front of the live backend's kernel, ``_fast.HashCache`` or its numpy twin
# ``_py_HashCache`` below: every argument is checked here, once, and the kernels take plain values.


# A HashCache's settings, one rule each, in the positional order of ``HashCache`` and of its kernels
# (``_fast.HashCache``, ``_py_HashCache``): ``_HashCacheConfig``'s fields, ``HashCache``'s arguments and a
# state's settings (``_HASH_STATE``) are these. A rule's default (``optional``) is what a state saved
# before the setting holds, and the argument's default (``_HASH_ARGUMENT_DEFAULTS`` where not). A new
# setting goes at the end, with its default: the cache's behaviour before it.
_HASH_CONFIG = {"capacity": _Int(_HASH_RESERVED_ROWS + 1, _HASH_MAX_CAPACITY),
                "access_threshold": _Int(-1, _HASH_TIME_LIMIT),
                "eviction_threshold": _Int(-1, _HASH_TIME_LIMIT),
                "grow": _Rule("a bool", (bool, np.bool_), convert=bool),
                # "none" is how a state holds None (a str: numpy stores it without pickle); absent from
                # states saved before eviction policies: none
                "eviction_policy": _Rule("None, %s or %r" % (", ".join(map(repr, _HASH_POLICIES[1:-1])),
                                                             _HASH_POLICIES[-1]),
                                         test=lambda v: v in _HASH_POLICIES or v == "none",
                                         convert=lambda v: None if v == "none" else v).optional(None),
                "lfu_half_life": _Int(1, _HASH_TIME_LIMIT).optional(_HASH_LFU_HALF_LIFE),
                # absent from states saved before admission counters: exact (and no sketch: sizes 0)
                "admission_counter": _Rule("'exact' or 'sketch'", test=lambda v: v in _HASH_COUNTERS).optional("exact"),
                "sketch_width": _Int(0, _HASH_SKETCH_MAX).optional(0),
                "sketch_depth": _Int(0, _HASH_SKETCH_MAX_DEPTH).optional(0),
                "sketch_window": _Int(0, _HASH_SKETCH_MAX).optional(0)}


#: HashCache's argument defaults where they are not its rule's default: the settings every state has held
#: (no default there), and the sketch's sizes (None: their defaults for "sketch", ``Sketch.resolved``)
_HASH_ARGUMENT_DEFAULTS = {"access_threshold": -1, "eviction_threshold": -1, "grow": False,
                           "sketch_width": None, "sketch_depth": None, "sketch_window": None}
#: HashCache's arguments after ``capacity`` and their defaults, in order (from ``_HASH_CONFIG``)
_HASH_ARGUMENTS = {name: _HASH_ARGUMENT_DEFAULTS.get(name, rule.default)
                   for name, rule in list(_HASH_CONFIG.items())[1:]}


def _hash_config_relations(got, at, checking):
    """An eviction policy keeps a table at its capacity: it cannot grow. A sketch has sizes >= 1, the
    exact counter none (0). (The one check of each; a table names ``grow`` its ``use_dynamic_expansion``.)"""
    if got["eviction_policy"] is not None and got["grow"]:
        checking.fail(checking.field(at, "grow"), "False with an eviction_policy (%r keeps the table at its "
                      "capacity, replacing ids when it is full)" % got["eviction_policy"], got["grow"], ValueError)
    sketch = got["admission_counter"] == "sketch"
    for name in ("sketch_width", "sketch_depth", "sketch_window"):
        if (got[name] >= 1) != sketch:
            checking.fail(checking.field(at, name), "an int >= 1 with admission_counter='sketch'" if sketch else
                          "0 with admission_counter='exact' (no sketch)", got[name], ValueError)
    return got


# ---- a cache's dependent settings as sub-configs: eviction policies and admission counters ----------
# Who owns what (TorchRec's eviction-policy dataclasses): ``eviction=LRU() | LFU(half_life)`` (None: no
# policy) and ``admission=Count() | Sketch(width, depth, window)`` are frozen records, each checking its own
# fields once (``_CacheChoice``). ``_cache_choices`` is the one place the flat spellings (``eviction_policy=``,
# ``lfu_half_life=``, ``admission_counter=``, ``sketch_*=``: the Rec SDK's and the kernels' names) become
# sub-configs, and refuses a flat keyword that another choice owns or a sub-config contradicts;
# ``_cache_kernel_settings`` is the one way back to the flat values the kernels take, states hold and
# ``TableConfig.settings`` records. A new choice is one class here (its fields' ``flat`` names are kernel
# arguments: ``_HASH_CONFIG`` rules, kernel code).
def _choice_field(default, flat, rule):
    """A field of a ``_CacheChoice``: its ``default``, its ``flat`` spelling (the kernels' argument and a
    state's key of the same value) and its ``rule`` (its check, applied in either spelling)."""
    return dataclasses.field(default=default, metadata={"flat": flat, "rule": rule})


@dataclasses.dataclass(frozen=True)
class _CacheChoice:
    """A choice of a cache with its own settings: an eviction policy or an admission counter. A subclass
    with ``choice`` (its flat spelling: ``eviction_policy="lfu"``) registers itself in its kind's
    ``registry`` when defined; its fields are made with ``_choice_field``. Made, it checks each field
    (errors name the class; a field given None takes the default the cache's capacity gives it,
    :meth:`resolved`)."""
    kind = key = None      # the kind's keyword ("eviction") and flat keyword ("eviction_policy"): the bases'
    registry = flat_rule = None        # choice -> class, per kind; the rule of the flat choice (_CACHE_KINDS)
    implied = False        # a flat field given without the kind's key chooses its class (the sketch's sizes)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "choice" in cls.__dict__:
            if not _HASH_CONFIG[cls.key].test(cls.choice):        # the kernels' list: _HASH_POLICIES, _HASH_COUNTERS
                raise TypeError("%s %s: its choice %r is not among the kernels' %s (%s)" % (
                    cls.kind, cls.__name__, cls.choice, cls.key, _HASH_CONFIG[cls.key].expected))
            cls.registry[cls.choice] = cls

    def __post_init__(self):
        self.checked(type(self).__name__, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def checked(cls, where, values, flat=False):
        """``values`` (field -> value; None: the default) checked by the fields' rules, errors naming
        ``where`` and the field (its flat spelling with ``flat``)."""
        out = {}
        for f in dataclasses.fields(cls):
            if values.get(f.name) is not None:
                out[f.name] = f.metadata["rule"].check(values[f.name], f.metadata["flat"] if flat else f.name,
                                                       _Checking.arguments(where))
        return out

    @classmethod
    def from_flat(cls, where, values):
        """The choice of flat keywords ``values`` (flat name -> value), checked naming them and ``where``."""
        fields = {f.metadata["flat"]: f.name for f in dataclasses.fields(cls)}
        return cls(**cls.checked(where, {fields[k]: v for k, v in values.items()}, flat=True))

    @classmethod
    def flat_names(cls):
        """The kind's flat keywords: its key, then every registered choice's fields' (in registry order)."""
        return (cls.key,) + tuple(f.metadata["flat"] for c in cls.registry.values() for f in dataclasses.fields(c))

    @classmethod
    def kernel_of(cls, choice):
        """The kind's flat values for ``choice`` (None: none chosen): the kernels' arguments, a state's keys
        and the recorded settings. A flat value the choice has no field for is its kernel rule's default."""
        out = {name: _HASH_CONFIG[name].default for name in cls.flat_names()}
        out[cls.key] = None if choice is None else choice.choice
        if choice is not None:
            out.update((f.metadata["flat"], getattr(choice, f.name)) for f in dataclasses.fields(choice))
        return out

    @classmethod
    def of_kernel(cls, kernel):
        """The choice a cache (``kernel``: its flat attributes) holds: :meth:`kernel_of`'s inverse."""
        chosen = cls.registry.get(getattr(kernel, cls.key))
        return chosen and chosen(**{f.name: getattr(kernel, f.metadata["flat"]) for f in dataclasses.fields(chosen)})

    @classmethod
    def normalized(cls, flat):
        """Recorded flat settings ``flat`` with the kind's fields that its recorded choice has not at their
        kernel defaults (what the kernel did with them: nothing; ``lfu_half_life`` recorded with "lru")."""
        owned = {f.metadata["flat"] for f in dataclasses.fields(cls.registry.get(flat.get(cls.key), cls))}
        return dict(flat, **{name: _HASH_CONFIG[name].default for name in cls.flat_names()[1:]
                             if name in flat and name not in owned})

    def resolved(self, capacity):
        """This choice with the defaults a cache of ``capacity`` rows gives its None fields (itself here)."""
        return self


@dataclasses.dataclass(frozen=True)
class _EvictionPolicy(_CacheChoice):
    """What a full table (no free row, no growth) does for a new id: replace one (``HashCache``)."""
    kind, key, registry = "eviction", "eviction_policy", {}


@dataclasses.dataclass(frozen=True)
class LRU(_EvictionPolicy):
    """``eviction=LRU()`` (flat: ``eviction_policy="lru"``): a full table replaces the least recently seen
    id of the new id's bucket of 32 rows (see ``HashCache``). The table then stays at its capacity."""
    choice = "lru"


@dataclasses.dataclass(frozen=True)
class LFU(_EvictionPolicy):
    """``eviction=LFU(half_life=3600)`` (flat: ``eviction_policy="lfu", lfu_half_life=...``): a full table
    replaces the least frequently seen id of the new id's bucket, its count decayed to now: it halves per
    ``half_life`` (data time, or steps) unseen (an int >= 1); ties: the least recently seen."""
    choice = "lfu"
    half_life: int = _choice_field(_HASH_LFU_HALF_LIFE, "lfu_half_life", _HASH_CONFIG["lfu_half_life"])


@dataclasses.dataclass(frozen=True)
class _AdmissionCounter(_CacheChoice):
    """Where a cache counts the ids it holds no row for (until ``access_threshold`` admits them)."""
    kind, key, registry, implied = "admission", "admission_counter", {}, True


@dataclasses.dataclass(frozen=True)
class Count(_AdmissionCounter):
    """``admission=Count()`` (flat: ``admission_counter="exact"``): an exact count per id, an entry of the
    cache each (memory that follows the stream's distinct ids)."""
    choice = "exact"


@dataclasses.dataclass(frozen=True)
class Sketch(_AdmissionCounter):
    """``admission=Sketch(width=None, depth=4, window=None)`` (flat: ``admission_counter="sketch"``,
    ``sketch_width``, ``sketch_depth``, ``sketch_window``): a count-min sketch of ``depth`` rows (1..16) of
    ``width`` int32 counters (default ``max(1024, 4 * capacity)``), every counter halved after ``window``
    counts (default ``width // 2``); the cache then tracks only the ids it holds rows for. See ``HashCache``."""
    choice = "sketch"
    width: int = _choice_field(None, "sketch_width", _Int(1, _HASH_SKETCH_MAX))
    depth: int = _choice_field(_HASH_SKETCH_DEPTH, "sketch_depth", _Int(1, _HASH_SKETCH_MAX_DEPTH))
    window: int = _choice_field(None, "sketch_window", _Int(1, _HASH_SKETCH_MAX))

    def resolved(self, capacity):
        """The sizes of a cache of ``capacity`` rows: ``width`` ``max(1024, 4 * capacity)``, ``window``
        ``width // 2`` where None (a bad capacity leaves them None: it fails on its own)."""
        width = self.width
        if width is None and _int_problem(capacity, 0) is None:
            width = min(max(_HASH_SKETCH_MIN_WIDTH, 4 * int(capacity)), _HASH_SKETCH_MAX)
        window = self.window if self.window is not None or width is None else max(1, width // 2)
        return dataclasses.replace(self, width=width, window=window)


#: The kinds of choice: their keywords (``eviction``, ``admission``) and flat keywords, in kernel order; each
#: kind's rule of its flat choice (``eviction_policy``, ``admission_counter``; None: the default), which the
#: command line's option reuses (TableConfig's field's ``rule``): the kernels' ("none" too), the registry's
_CACHE_KINDS = (_EvictionPolicy, _AdmissionCounter)
_EvictionPolicy.flat_rule = _HASH_CONFIG["eviction_policy"]
_AdmissionCounter.flat_rule = _one_of(None, *_AdmissionCounter.registry)
_CACHE_CHOICE_KEYWORDS = tuple(k for kind in _CACHE_KINDS for k in (kind.kind,) + kind.flat_names())


def _cache_choices(where, given):
    """``(eviction, admission)`` from ``given`` (keyword -> value; absent or None: not given): the
    sub-configs ``eviction`` / ``admission`` and the flat spellings (``_CACHE_CHOICE_KEYWORDS``). The one
    place a flat spelling becomes a sub-config. A flat field belongs to one choice (``lfu_half_life``: LFU):
    given with another one it is an error, unless it is the value the kernels hold without it (3600, a
    size 0); a flat keyword a given sub-config contradicts is an error naming both. The sketch's sizes
    alone choose the sketch. A kind given neither way is None (eviction: no policy; admission: the
    caller's default)."""
    out = []
    for kind in _CACHE_KINDS:
        sub, name = given.get(kind.kind), given.get(kind.key)
        if sub is not None and not isinstance(sub, kind):
            _fail(where, "'%s'" % kind.kind, "None or one of %s" % ", ".join(
                "%s(...)" % c.__name__ for c in kind.registry.values()), sub, TypeError)
        if name is not None:
            name = kind.flat_rule.check(name, kind.key, _Checking.arguments(where))
            if sub is not None and type(sub) is not kind.registry.get(name):
                _fail(where, "'%s'" % kind.key, "%r as %s=%r says, or not given" % (sub.choice, kind.kind, sub),
                      given[kind.key])
        owner = {f.metadata["flat"]: (c, f) for c in kind.registry.values() for f in dataclasses.fields(c)}
        fields = {k: given[k] for k in owner if given.get(k) is not None}
        chosen = type(sub) if sub is not None else kind.registry.get(name)
        if chosen is None and given.get(kind.key) is None and kind.implied:    # the fields choose: the sketch's sizes
            chosen = next((owner[k][0] for k, v in fields.items() if v != _HASH_CONFIG[k].default), None)
        for flat, value in fields.items():
            cls, f = owner[flat]
            if cls is chosen and sub is not None and value != getattr(sub, f.name):
                _fail(where, "'%s'" % flat, "%r as %s=%r says, or not given" % (getattr(sub, f.name), kind.kind, sub),
                      value)
            if cls is not chosen and value != _HASH_CONFIG[flat].default:
                _fail(where, "'%s'" % flat, "None with %s=%r (a setting of %s=%r: %s's %s)" % (
                    kind.key, chosen and chosen.choice, kind.key, cls.choice, cls.__name__, f.name), value)
        if sub is None and chosen is not None:
            sub = chosen.from_flat(where, {k: v for k, v in fields.items() if owner[k][0] is chosen})
        out.append(sub)
    return tuple(out)


def _cache_kernel_settings(eviction, admission):
    """The flat settings of the choices ``eviction`` and ``admission`` (resolved): the kernels' arguments,
    a state's keys and what ``TableConfig.settings`` records, by name."""
    return dict(_EvictionPolicy.kernel_of(eviction), **_AdmissionCounter.kernel_of(admission))


def _hash_state_readmit(state, admission):
    """A checked HashCache ``state`` made to count with ``admission`` (``_AdmissionCounter.kernel_of``'s dict)
    instead of its own: exact to sketch, its candidates go into an empty sketch (each raises its
    counters to its count) and are no longer tracked; from a sketch, the sketch's counts are dropped
    (the ids without a row start again from 0, or from an empty sketch of the new size). Rows,
    admitted ids' counts and statistics stay."""
    counter = admission["admission_counter"]
    sizes = {name: admission[name] or 0 for name in ("sketch_width", "sketch_depth", "sketch_window")}
    out = dict(state, admission_counter=counter, sketch_pending=0, **sizes)
    cells = sizes["sketch_width"] * sizes["sketch_depth"]
    out["sketch"] = np.zeros(cells, np.int32)
    if counter == "sketch" and state["admission_counter"] == "exact":
        cand = state["rows"] < 0
        _sketch_raise(out["sketch"], sizes["sketch_width"], sizes["sketch_depth"], state["keys"][cand],
                      state["counts"][cand])
        for key in ("keys", "rows", "counts", "last_seen"):
            out[key] = state[key][~cand]
    return out


@dataclasses.dataclass(frozen=True)
class _HashCacheConfig:
    """What a HashCache is made with: a field for each of ``_HASH_CONFIG``'s settings, in its order (the
    kernels' positional arguments: ``dataclasses.astuple``). Make one with :meth:`checked`, which
    validates every field."""
    __annotations__ = dict.fromkeys(_HASH_CONFIG, object)     # the fields: declared once, by the rules

    @classmethod
    def checked(cls, where, names=None, **values):
        """The configuration from the arguments ``values``, each validated (``_HASH_CONFIG``; an absent
        one takes its rule's default), errors naming ``where`` and the argument (``names``: the caller's
        name of a setting where it differs, e.g. a table's ``use_dynamic_expansion`` for ``grow``)."""
        names = names or {}
        checking = _Checking(_Checking.arguments(where).fail, lambda at, key: names.get(key, key))
        return cls(**_validate(values, _Fields(_HASH_CONFIG, relate=_hash_config_relations), checking))


def _hash_ids(where, ids):
    """``ids`` as a C-contiguous int64 array of the same shape (0-d too); integer dtypes only (uint64
    keeps its bits)."""
    try:
        arr = np.asarray(ids)
    except ValueError:                     # numpy: "inhomogeneous shape"
        _fail(where, "'ids'", "a rectangular array (ragged ids go as a tuple (values, offsets) to a table with "
              "a combiner)", "rows of different lengths")
    if arr.dtype.kind not in "iu":
        _fail(where, "'ids'", "an array of integers", "array of dtype %s" % arr.dtype, TypeError)
    if arr.dtype == np.uint64:
        arr = arr.view(np.int64)
    return np.require(arr, np.int64, "C")          # not ascontiguousarray: it makes a 0-d array 1-d


def _hash_time(where, name, value):
    """A time (data timestamp or step) as an int within +-2**62."""
    return _check_int(where, name, value, -_HASH_TIME_LIMIT, _HASH_TIME_LIMIT)


def _hash_state_relations(got, at, checking):
    """The checks of a HashCache state that relate its fields: its configuration's, parallel arrays of
    one length, times in range, ids sorted, and owned and free rows that partition ``[2, next_row)``."""
    _hash_config_relations(got, at, checking)
    field = functools.partial(checking.field, at)
    n = got["keys"].size
    for name in ("rows", "counts", "last_seen"):
        if got[name].size != n:
            checking.fail(field(name), "of one length with the keys (%d)" % n, "%d values" % got[name].size,
                          ValueError)
    if n and (got["last_seen"].min() < -_HASH_TIME_LIMIT or got["last_seen"].max() > _HASH_TIME_LIMIT):
        checking.fail(field("last_seen"), "times within +-2**62", "[%d, %d]" % (
            got["last_seen"].min(), got["last_seen"].max()), ValueError)
    if n > 1 and not np.all(got["keys"][1:] > got["keys"][:-1]):
        checking.fail(field("keys"), "strictly increasing", "unsorted or repeated ids", ValueError)
    nxt = got["next_row"]
    owned = got["rows"][got["rows"] >= 0]
    if (n and got["rows"].min() < -1) or (owned.size and (owned.min() < _HASH_RESERVED_ROWS or owned.max() >= nxt)):
        checking.fail(field("rows"), "-1 or in [%d, next_row)" % _HASH_RESERVED_ROWS, "out of range rows", ValueError)
    free = got["free_rows"]
    if free.size and (np.any(free[1:] <= free[:-1]) or free[0] < _HASH_RESERVED_ROWS or free[-1] >= nxt):
        checking.fail(field("free_rows"), "increasing rows in [2, next_row)", "unsorted or out of range", ValueError)

    def each_covered():
        """Rows in range and as many as [2, next_row) holds: covering it is partitioning it. No sort;
        the mark array is made only once next_row is known to fit the rows read."""
        covered = np.zeros(nxt, np.bool_)
        covered[owned] = True
        covered[free] = True
        return np.count_nonzero(covered) == nxt - _HASH_RESERVED_ROWS
    if owned.size + free.size != nxt - _HASH_RESERVED_ROWS or not each_covered():
        checking.fail(field("rows"), "owned rows that with the free rows partition [2, next_row)",
                      "overlapping or missing rows", ValueError)
    if got["admission_counter"] == "sketch" and n and got["rows"].min() < 0:
        checking.fail(field("rows"), "rows >= 0 with admission_counter='sketch' (ids below the threshold are "
                      "counted in the sketch, not tracked)", "candidates (-1)", ValueError)
    sketch, size = got["sketch"], got["sketch_width"] * got["sketch_depth"]
    if sketch.size != size or (size and sketch.min() < 0):
        checking.fail(field("sketch"), "%d counters >= 0 (sketch_depth x sketch_width)" % size,
                      "%d values%s" % (sketch.size, " with negative ones" * bool(sketch.size and sketch.min() < 0)),
                      ValueError)
    if got["sketch_pending"] >= max(got["sketch_window"], 1):
        checking.fail(field("sketch_pending"), "an int below sketch_window (%d)" % got["sketch_window"],
                      got["sketch_pending"], ValueError)
    return got


def _flat_array(dtype):
    return _Rule("an array of %s" % np.dtype(dtype).name,
                 convert=lambda v: np.ascontiguousarray(v, dtype=dtype).ravel())


# A HashCache state (``HashCache.state_dict()``): every field, then their relations.
_HASH_STATE = _Fields(dict(
    {"keys": _flat_array(np.int64), "rows": _flat_array(np.int32), "counts": _flat_array(np.int64),
     "last_seen": _flat_array(np.int64), "free_rows": _flat_array(np.int32)},
    **_HASH_CONFIG,
    next_row=lambda got: _Int(_HASH_RESERVED_ROWS, got["capacity"]),
    step=_COUNT, now=_Int(-_HASH_TIME_LIMIT, _HASH_TIME_LIMIT),
    **{name: _COUNT for name in _HASH_STAT_NAMES if name not in ("replaced", "aged")},
    replaced=_COUNT.optional(0),            # absent from states saved before eviction policies
    aged=_COUNT.optional(0),                # ... before admission counters, as the two fields below
    sketch=_flat_array(np.int32).optional(np.empty(0, np.int32)), sketch_pending=_COUNT.optional(0)),
    expected="a dict made by HashCache.state_dict()", relate=_hash_state_relations)


def _hash_state_check(where, state):
    """Validate a HashCache state dict (every field); return a copy with normalised dtypes and
    Python ints, which either backend's kernel can load as it is."""
    return _validate(state, _HASH_STATE, _Checking.state(where), "state")


class _HashCacheChecks:
    """The argument checks of ``HashCache``, in front of a kernel class that follows in the MRO
    (``_fast.HashCache`` or ``_py_HashCache``): each method validates its arguments once, with
    recboost's error form, then calls the kernel's method of the same name with plain values."""

    def __init__(self, capacity, *args, **settings):
        # the arguments are _HASH_CONFIG's, in its order, with _HASH_ARGUMENTS' defaults (the signature), and
        # keyword-only the sub-configs eviction= and admission= (_cache_choices: the flat ones' other spelling)
        where, names = "HashCache", tuple(_HASH_ARGUMENTS)
        if len(args) > len(names):
            _fail(where, "the positional arguments", "at most %d (capacity, %s)" % (len(names) + 1, ", ".join(names)),
                  len(args) + 1, TypeError)
        _check_no_kwargs(where, settings, names + tuple(kind.kind for kind in _CACHE_KINDS))
        for name, value in zip(names, args):
            if name in settings:
                _fail(where, "'%s'" % name, "given once (positionally or by keyword)", settings[name], TypeError)
            settings[name] = value
        eviction, admission = _cache_choices(where, settings)
        given = {name: settings.get(name, default) for name, default in _HASH_ARGUMENTS.items()
                 if name not in _CACHE_CHOICE_KEYWORDS}
        given.update(_cache_kernel_settings(eviction, (admission or Count()).resolved(capacity)))
        super().__init__(*dataclasses.astuple(_HashCacheConfig.checked(where, capacity=capacity, **given)))

    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", "capacity")]
        + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
           for name, default in _HASH_ARGUMENTS.items()]
        + [inspect.Parameter(kind.kind, inspect.Parameter.KEYWORD_ONLY, default=None) for kind in _CACHE_KINDS])

    #: the eviction policy as a sub-config (``LRU()``, ``LFU(half_life)``; None: none), from the flat attributes
    eviction = property(lambda self: _EvictionPolicy.of_kernel(self))
    #: the admission counter as a sub-config (``Count()`` or ``Sketch(width, depth, window)``)
    admission = property(lambda self: _AdmissionCounter.of_kernel(self))

    def lookup(self, ids, timestamp=None, max_admit=-1):
        """Rows (int32, shape of ``ids``) for a batch of ids; counts, times and admission as in the
        class docstring. ``max_admit``: admit at most this many ids in this batch (the first ones
        to qualify; the others are counted as overflowed), -1 for no limit (a row-wise shard of a
        table that does not grow gets its share of the table's free rows this way)."""
        where = "HashCache.lookup"
        arr = _hash_ids(where, ids)
        return super().lookup(arr, None if timestamp is None else _hash_time(where, "timestamp", timestamp),
                              _check_int(where, "max_admit", max_admit, -1, _HASH_MAX_CAPACITY))

    def find(self, ids):
        """Rows of ``ids`` without counting or admitting anything (row 0 for ids without a row)."""
        return super().find(_hash_ids("HashCache.find", ids))

    def counts(self, ids):
        """How often each of ``ids`` has been looked up since it was last forgotten (int64, the shape
        of ``ids``; 0 for an id not tracked; with the "sketch" admission counter, the sketch's count
        of an id without a row, an upper bound). Changes nothing."""
        return super().counts(_hash_ids("HashCache.counts", ids))

    def entries(self, ids):
        """``(tracked, rows, counts, last_seen)`` of each of ``ids`` now (1-d bool, int32, int64, int64 of
        ``ids.size``; zeros where the cache does not track the id). Changes nothing."""
        return super().entries(_hash_ids("HashCache.entries", ids))

    def evict(self, now=None):
        """Forget ids with ``now - last_seen > eviction_threshold``; return ``(freed_ids, freed_rows)``
        (int64, int32) of those that held rows, ordered by row. Does nothing when the threshold is -1."""
        return super().evict(None if now is None else _hash_time("HashCache.evict", "now", now))

    def load_state_dict(self, state):
        """Restore ``state`` exactly; the capacity becomes ``max(self.capacity, state['capacity'])``.
        A bad state raises (naming the field) and changes nothing."""
        checked = _hash_state_check("HashCache.load_state_dict", state)
        checked["capacity"] = max(self.capacity, checked["capacity"])
        super().load_state_dict(checked)


class _py_HashCache:
    """The numpy kernel of ``HashCache``, twin of ``_fast.HashCache``: every result and every bit of
    ``state_dict()`` is the same. It takes checked values (``HashCache`` checks them): ``ids``
    C-contiguous int64 arrays, times ints within +-2**62, a state from ``_hash_state_check``.
    The ids it tracks are kept sorted, with their rows, counts and last-seen times in parallel arrays."""

    def __init__(self, capacity, access_threshold=-1, eviction_threshold=-1, grow=False, eviction_policy=None,
                 lfu_half_life=_HASH_LFU_HALF_LIFE, admission_counter="exact", sketch_width=0, sketch_depth=0,
                 sketch_window=0):
        self._capacity, self._access_threshold = capacity, access_threshold
        self._eviction_threshold, self._grow = eviction_threshold, grow
        self._policy, self._half_life = eviction_policy, lfu_half_life
        self._counter, self._width, self._depth = admission_counter, sketch_width, sketch_depth
        self._window, self._pending = sketch_window, 0       # counts into the sketch since it last aged
        # the sketch: sketch_depth rows of sketch_width int32 counters, row-major (None: the exact counter)
        self._sketch = np.zeros(sketch_width * sketch_depth, np.int32) if admission_counter == "sketch" else None
        self._replaced = []                         # (ids, rows) replaced since take_replaced()
        self._noted = None                          # after record_changes(): changes()'s arrays so far
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
    access_threshold = property(lambda self: self._access_threshold,
                                doc="Admission: an id gets a row once its count exceeds this (-1: at "
                                    "its first sighting).")
    eviction_threshold = property(lambda self: self._eviction_threshold,
                                  doc="``evict`` forgets ids unseen for longer than this (-1: never).")
    grow = property(lambda self: self._grow,
                    doc="Whether the capacity doubles when a row is needed and none is free.")
    eviction_policy = property(lambda self: self._policy,
                               doc="Which id a full table replaces for a new one: None (none: the new id "
                                   "overflows), \"lru\", \"lfu\".")
    lfu_half_life = property(lambda self: self._half_life,
                             doc="With \"lfu\": the time over which an unseen id's count halves.")
    admission_counter = property(lambda self: self._counter,
                                 doc="Where ids without a row are counted: \"exact\" (an entry each) or "
                                     "\"sketch\" (a count-min sketch of fixed size).")
    sketch_width = property(lambda self: self._width, doc="Counters per row of the sketch (0: exact counter).")
    sketch_depth = property(lambda self: self._depth, doc="Rows of the sketch (0: exact counter).")
    sketch_window = property(lambda self: self._window,
                             doc="The sketch halves every counter after this many counts (0: exact counter).")
    step = property(lambda self: self._step, doc="Number of lookups so far.")
    now = property(lambda self: self._now, doc="Time of the last lookup (timestamp or step).")

    def __len__(self):
        """Ids that own a row."""
        return int(np.count_nonzero(self._rows >= 0))

    def stats(self):
        """Counters: ids ``size`` (own a row), ``candidates`` (tracked, no row; always 0 with the
        sketch), ``capacity``, ``sketch_bytes`` (the sketch's counters, 0 without), and the totals
        ``admitted``, ``rejected``, ``overflowed`` (batch elements sent to the default row),
        ``evicted`` (ids that lost a row), ``forgotten`` (candidates dropped by evict), ``grown``,
        ``looked_up`` (batch elements), ``replaced`` (ids a full table's policy took a row from),
        ``aged`` (halvings of the sketch)."""
        size = len(self)
        out = {"size": size, "candidates": int(self._keys.size) - size, "capacity": self._capacity,
               "sketch_bytes": 4 * self._width * self._depth}
        out.update(self._stats)
        return out

    def _sketch_counts(self, ids):
        """The sketch's count of each of ``ids`` (int64): the least of its ``sketch_depth`` counters."""
        return self._sketch[_sketch_cells(ids, self._width, self._depth)].min(axis=0).astype(np.int64)

    def _sketch_add(self, ids, counts, added):
        """Raise the counters of ``ids`` (distinct) to at least their ``counts`` (conservative update,
        saturating at 2**31 - 1), then age the sketch for ``added`` more counts: every counter halves
        once per ``sketch_window`` counts (twin of ``_fast.HashCache._sketch_commit``)."""
        _sketch_raise(self._sketch, self._width, self._depth, ids, counts)
        self._pending += added
        halvings, self._pending = divmod(self._pending, self._window)
        if halvings:
            self._sketch >>= min(halvings, 31)
            self._stats["aged"] += halvings

    def _positions(self, uniq):
        pos = np.searchsorted(self._keys, uniq)
        hit = pos < self._keys.size
        hit[hit] = self._keys[pos[hit]] == uniq[hit]
        return pos, hit

    def _allocate(self, m):
        """Up to ``m`` rows, lowest free first, growing the capacity when allowed: ``(rows, free rows
        left, next row, capacity, doublings)``; nothing of self changes here (the caller commits)."""
        capacity, grown = self._capacity, 0
        avail = self._free.size + capacity - self._next_row
        while m > avail and self._grow and capacity < _HASH_MAX_CAPACITY:
            capacity, grown = min(2 * capacity, _HASH_MAX_CAPACITY), grown + 1
            avail = self._free.size + capacity - self._next_row
        take = min(m, avail)
        reused = self._free[:take]
        fresh = np.arange(self._next_row, self._next_row + take - reused.size, dtype=np.int32)
        return np.concatenate([reused, fresh]), self._free[take:], self._next_row + fresh.size, capacity, grown

    def lookup(self, ids, timestamp=None, max_admit=-1):
        """Rows (int32, shape of ``ids``) of a batch of ids at time ``timestamp`` (None: the step),
        admitting at most ``max_admit`` ids (-1: no limit)."""
        now = self._step if timestamp is None else timestamp
        flat = ids.ravel()
        if flat.size == 0:
            self._step, self._now = self._step + 1, now
            return np.zeros(ids.shape, np.int32)
        # nothing of self changes before the commit at the end: a lookup that fails (a MemoryError)
        # changes nothing, as in the compiled kernel
        uniq, inv, cnt = np.unique(flat, return_inverse=True, return_counts=True)
        pos, hit = self._positions(uniq)
        keys, rows_of, counts, last = self._keys, self._rows, self._counts, self._last
        if not hit.all():
            at = pos[~hit]
            keys = np.insert(keys, at, uniq[~hit])
            rows_of = np.insert(rows_of, at, np.int32(-1))
            # a new candidate starts at 0, or at the sketch's count (read as of before the batch)
            counts = np.insert(counts, at, np.int64(0) if self._sketch is None else self._sketch_counts(uniq[~hit]))
            last = np.insert(last, at, np.int64(now))
            pos = np.searchsorted(keys, uniq)
        before = counts[pos]
        if self._policy == "lfu":               # decayed at each id's first element of the batch
            before = _lfu_decayed(before, last[pos], now, self._half_life)
        after = before + cnt
        rows = rows_of[pos]
        t = self._access_threshold
        free, next_row, capacity = self._free, self._next_row, self._capacity
        stats = dict.fromkeys(("admitted", "grown", "overflowed", "rejected", "replaced"), 0)
        want = np.flatnonzero((rows < 0) & (after > t))
        victims = np.empty(0, np.int64)
        if want.size:
            # the element at which each id's count first exceeds t: its (t - before)-th occurrence
            order = np.argsort(inv, kind="stable")
            starts = np.cumsum(cnt) - cnt
            event = order[starts[want] + np.maximum(t - before[want], 0)]
            want = want[np.argsort(event, kind="stable")]
            limit = want.size if max_admit < 0 else min(max_admit, want.size)
            got, free, next_row, capacity, stats["grown"] = self._allocate(limit)
            rows[want[:got.size]] = got
            if got.size < limit and self._policy is not None:       # full: replace, up to the limit
                victims = self._replace(uniq, want[got.size:], limit - got.size, rows, keys, rows_of, counts,
                                        last, now)
            want = want[rows[want] >= 0]
            stats["admitted"], stats["replaced"] = int(want.size), int(victims.size)
        out = rows[inv]
        miss = out < 0
        if miss.any():
            stats["overflowed"] = int(np.count_nonzero(after[inv[miss]] > t))
            stats["rejected"] = int(np.count_nonzero(miss)) - stats["overflowed"]
            out[miss] = HASH_DEFAULT_ROW
        out = out.astype(np.int32).reshape(ids.shape)
        fresh = self._note(np.concatenate([uniq, keys[victims]]))      # (as they were: self's arrays, unchanged)
        # -- commit
        counts[pos], last[pos] = after, now
        rows_of[pos[want]] = rows[want]
        if victims.size:
            self._replaced.append((keys[victims], rows_of[victims]))
            keys, rows_of, counts, last = (np.delete(a, victims) for a in (keys, rows_of, counts, last))
        if self._sketch is not None:            # the ids left without a row go back to the sketch
            cand = rows_of < 0
            self._sketch_add(keys[cand], counts[cand], stats["rejected"] + stats["overflowed"])
            keys, rows_of, counts, last = (a[~cand] for a in (keys, rows_of, counts, last))
        self._keys, self._rows, self._counts, self._last = keys, rows_of, counts, last
        self._free, self._next_row, self._capacity = free, next_row, capacity
        for name, value in stats.items():
            self._stats[name] += value
        self._stats["looked_up"] += int(flat.size)
        self._step, self._now = self._step + 1, now
        if fresh.size:                          # ids it started and ended without tracking: no change
            self._unnote(fresh[~_sorted_in(fresh, self._keys)])
        return out

    def _replace(self, uniq, waiting, limit, rows, keys, rows_of, counts, last, now):
        """The rows of a full table for the ids ``uniq[waiting]`` (in admission order, at most
        ``limit`` of them), each taken from the id its bucket's policy ranks lowest (as
        ``_fast.HashCache._replace``: every id of the batch, and any seen at ``now``, is kept); sets
        ``rows[w]`` for each id that got one and returns the entries (indices into ``keys``) of the
        ids replaced, in order."""
        capacity = self._capacity
        held = np.flatnonzero(rows_of >= 0)
        row_last = np.full(capacity, now, np.int64)
        row_count = np.zeros(capacity, np.int64)
        owner = np.full(capacity, -1, np.int64)
        row_last[rows_of[held]], row_count[rows_of[held]], owner[rows_of[held]] = last[held], counts[held], held
        row_last[rows[rows >= 0]] = now          # the ids of this batch are kept
        nb = -(-(capacity - _HASH_RESERVED_ROWS) // _HASH_BUCKET)
        buckets = ((_mix64(uniq[waiting]) >> np.uint64(32)) * np.uint64(nb)) >> np.uint64(32)
        victims = []
        for w, b in zip(waiting.tolist(), buckets.tolist()):
            if len(victims) == limit:
                break
            lo = _HASH_RESERVED_ROWS + b * _HASH_BUCKET
            seen = row_last[lo:lo + _HASH_BUCKET]
            open_ = np.flatnonzero(seen != now)
            if not open_.size:
                continue
            score = seen if self._policy == "lru" else _lfu_decayed(row_count[lo:lo + _HASH_BUCKET], seen, now,
                                                                       self._half_life)
            pick = open_[np.lexsort((open_, seen[open_], score[open_]))[0]]
            victims.append(owner[lo + pick])
            rows[w] = lo + pick
            row_last[lo + pick] = now
        return np.asarray(victims, np.int64)

    def take_replaced(self):
        """``(ids, rows)`` (int64, int32) of the ids that lost their row to a new id since the last
        call, in the order it happened; each call takes them once."""
        found, self._replaced = self._replaced, []
        if not found:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found]).astype(np.int32)

    def find(self, ids):
        """Rows of ``ids`` without counting or admitting anything (row 0 for ids without a row)."""
        flat = ids.ravel()
        pos, hit = self._positions(flat)
        out = np.full(flat.size, HASH_DEFAULT_ROW, np.int32)
        out[hit] = np.maximum(self._rows[pos[hit]], HASH_DEFAULT_ROW)
        return out.reshape(ids.shape)

    def counts(self, ids):
        """How often each of ``ids`` has been looked up since it was last forgotten (0: not tracked;
        with the sketch, its count of an id without a row)."""
        flat = ids.ravel()
        pos, hit = self._positions(flat)
        out = np.zeros(flat.size, np.int64)
        out[hit] = self._counts[pos[hit]]
        if self._sketch is not None and not hit.all():
            out[~hit] = self._sketch_counts(flat[~hit])
        return out.reshape(ids.shape)

    def evict(self, now=None):
        """Forget ids with ``now - last_seen > eviction_threshold``; return ``(freed_ids, freed_rows)``
        (int64, int32) of those that held rows, ordered by row. Does nothing when the threshold is -1."""
        now = self._now if now is None else now
        if self._eviction_threshold < 0:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        gone = self._last < now - self._eviction_threshold     # now - last_seen > threshold, never overflowing
        self._note(self._keys[gone])
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

    def record_changes(self):
        """Record from now on which entries change (:meth:`changes`): the record starts empty."""
        self._noted = {"keys": np.empty(0, np.int64), "existed": np.empty(0, np.bool_),
                       "rows": np.empty(0, np.int32), "counts": np.empty(0, np.int64),
                       "last_seen": np.empty(0, np.int64)}

    def _note(self, ids):
        """Add to the record the entries of ``ids`` (about to change) not in it yet, as they are;
        returns those of them not tracked now (sorted)."""
        if self._noted is None or not ids.size:
            return ids[:0]
        ids = np.unique(ids)
        ids = ids[~_sorted_in(ids, self._noted["keys"])]
        pos, hit = self._positions(ids)
        at = pos[hit]
        new = {"keys": ids, "existed": hit, "rows": np.zeros(ids.size, np.int32),
               "counts": np.zeros(ids.size, np.int64), "last_seen": np.zeros(ids.size, np.int64)}
        new["rows"][hit], new["counts"][hit], new["last_seen"][hit] = self._rows[at], self._counts[at], self._last[at]
        order = np.argsort(np.concatenate([self._noted["keys"], ids]), kind="stable")
        self._noted = {name: np.concatenate([self._noted[name], new[name]])[order] for name in new}
        return ids[~hit]

    def _unnote(self, ids):
        """Drop ``ids`` (sorted) from the record."""
        if ids.size:
            keep = ~_sorted_in(self._noted["keys"], ids)
            self._noted = {name: a[keep] for name, a in self._noted.items()}

    def changes(self):
        """None when no record runs (none started, or a load since); else the entries changed since
        :meth:`record_changes` as they were then: a dict of ``keys`` (the ids looked up, evicted or
        replaced since, sorted, int64; not those a lookup started and ended without tracking), ``existed`` (bool: tracked then), ``rows`` (int32), ``counts``
        and ``last_seen`` (int64; 0 where not tracked then)."""
        return None if self._noted is None else {name: a.copy() for name, a in self._noted.items()}

    def keys(self):
        """The id of every entry (those with a row and the candidates), sorted: a new int64 array, 8
        bytes an entry. (``state_dict``'s ``keys``; a checkpoint looks up the entries' other fields
        from it a chunk at a time, :meth:`entries`.)"""
        return self._keys.copy()

    def keys_between(self, low, high, out):
        """The ids ``low <= id <= high`` of the entries, sorted, into ``out`` (int64); returns how many
        there are (when more than ``out`` holds, ``out`` holds some of them: call again with a larger one).
        ``out`` past them is scratch: the compiled kernel may write there."""
        got = self._keys[np.searchsorted(self._keys, low):np.searchsorted(self._keys, high, "right")]
        out[:min(got.size, out.size)] = got[:out.size]
        return got.size

    def sample_keys(self, n):
        """The ids of at most ``n`` (>= 1) entries spread evenly over them."""
        return self._keys[np.linspace(0, self._keys.size - 1, min(max(n, 1), self._keys.size)).astype(np.int64)]

    def entries(self, ids):
        """``(tracked, rows, counts, last_seen)`` of each of ``ids`` now (bool, int32, int64, int64 1-d;
        zeros where not tracked). Changes nothing."""
        pos, hit = self._positions(ids.ravel())
        at = pos[hit]
        rows, counts, last = np.zeros(hit.size, np.int32), np.zeros(hit.size, np.int64), np.zeros(hit.size, np.int64)
        rows[hit], counts[hit], last[hit] = self._rows[at], self._counts[at], self._last[at]
        return hit, rows, counts, last

    def state_dict(self, entries=True):
        """All state as a dict of numpy arrays, ints and strs (entries sorted by id; the eviction policy
        as "none", "lru" or "lfu"). ``entries`` False: the entries' four arrays are empty (an
        incremental checkpoint's delta takes them from :meth:`changes`)."""
        take = np.copy if entries else (lambda a: a[:0].copy())
        state = {"keys": take(self._keys), "rows": take(self._rows), "counts": take(self._counts),
                 "last_seen": take(self._last), "free_rows": self._free.copy(),
                 "next_row": self._next_row, "capacity": self._capacity, "step": self._step,
                 "now": self._now, "access_threshold": self._access_threshold,
                 "eviction_threshold": self._eviction_threshold, "grow": self._grow,
                 "eviction_policy": self._policy or "none", "lfu_half_life": self._half_life,
                 "admission_counter": self._counter, "sketch_width": self._width, "sketch_depth": self._depth,
                 "sketch_window": self._window, "sketch_pending": self._pending,
                 "sketch": np.empty(0, np.int32) if self._sketch is None else self._sketch.copy()}
        state.update(self._stats)
        return state

    def load_state_dict(self, state):
        """Restore ``state`` (checked by ``_hash_state_check``) exactly, its capacity too."""
        self._capacity, self._access_threshold = state["capacity"], state["access_threshold"]
        self._eviction_threshold, self._grow = state["eviction_threshold"], state["grow"]
        self._policy, self._half_life = state["eviction_policy"], state["lfu_half_life"]
        self._counter, self._width, self._depth = state["admission_counter"], state["sketch_width"], state["sketch_depth"]
        self._window, self._pending = state["sketch_window"], state["sketch_pending"]
        self._sketch = state["sketch"].copy() if self._counter == "sketch" else None
        self._replaced = []                         # as the kernel's reset: a loaded state replaced nothing yet
        self._noted = None                          # ... and records no change
        self._keys, self._rows = state["keys"].copy(), state["rows"].copy()
        self._counts, self._last = state["counts"].copy(), state["last_seen"].copy()
        self._free = state["free_rows"].copy()
        self._next_row, self._step, self._now = state["next_row"], state["step"], state["now"]
        self._stats = {k: state[k] for k in _HASH_STAT_NAMES}


def _sketch_cells(ids, width, depth):
    """Where a count-min sketch of ``depth`` rows of ``width`` counters (flat, row-major) counts each
    of ``ids`` (int64): ``(depth, len(ids))`` indices, row ``d`` at column ``((h >> 32) * width) >> 32``
    of ``h = mix64(id ^ salt_d)``, ``salt_d = mix64((d + 1) * golden)`` (twin of ``_fast._sketch_cell``)."""
    with np.errstate(over="ignore"):
        salts = _mix64(np.arange(1, depth + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
    h = _mix64(np.ascontiguousarray(ids, np.int64).view(np.uint64)[None, :] ^ salts[:, None])
    return ((h >> np.uint64(32)) * np.uint64(width) >> np.uint64(32)).astype(np.int64) + \
        np.arange(depth, dtype=np.int64)[:, None] * width


def _sketch_raise(sketch, width, depth, ids, counts):
    """Conservative update of a count-min sketch (flat int32, ``depth`` rows of ``width``): each
    counter of each of ``ids`` (distinct) raised to at least its count, saturating at 2**31 - 1."""
    np.maximum.at(sketch, _sketch_cells(ids, width, depth).ravel(),
                  np.tile(np.minimum(counts, _HASH_SKETCH_MAX).astype(np.int32), depth))


def _lfu_decayed(count, last, now, half_life):
    """LFU counts as of ``now`` (twin of ``_fast._decayed``): halved once per ``half_life`` elapsed
    since each id's ``last`` sighting."""
    elapsed = np.asarray(now, np.int64).astype(np.uint64) - np.asarray(last, np.int64).astype(np.uint64)
    periods = np.where(last < now, elapsed // np.uint64(half_life), 0)   # unsigned: no overflow at 2**63
    return np.where(periods >= 63, 0, count >> np.minimum(periods, 62).astype(np.int64))


# ---- gradient freeze and PCA twins (boost) ----------------------------------------------------------
_U64 = np.uint64


def _py_freeze_index_sequence(groups, strategy, freeze_p, total_steps, seed):
    """Twin of ``_recboost_fast.freeze_index_sequence`` (see there)."""
    total = int(total_steps * 1.01)
    if groups <= 1:
        return np.zeros(total, dtype=np.int32)
    if strategy == 0:
        zero_cnt = int(freeze_p * (groups - 1) // (1 - freeze_p) + 0.5)
        period = np.concatenate([np.zeros(zero_cnt, np.int32), np.arange(1, groups, dtype=np.int32)])
        return np.tile(period, -(-total // len(period)))
    if strategy != 1:
        raise ValueError("unsupported freeze strategy %r" % strategy)
    out = np.zeros(max(total, 1), dtype=np.int32)
    keep = 1.0 - freeze_p
    positions = []
    zero_cnt, freeze_cnt = 1, 0
    for i in range(1, total):           # MindSpore's placement rule, in doubles
        if 1.0 * freeze_cnt / (zero_cnt + freeze_cnt) < keep:
            positions.append(i)
            freeze_cnt += 1
        else:
            zero_cnt += 1
    tri = np.array([(k + 1) * (k + 2) // 2 for k in range(groups - 1)], dtype=np.uint64)
    draws = np.arange(1, freeze_cnt + 1, dtype=np.uint64)     # draw d: mix64(seed + (d + 1) * golden)
    with np.errstate(over="ignore"):
        u = ((_mix64(_U64(seed) + (draws + _U64(1)) * _U64(_GOLDEN)) >> _U64(32)) * tri[-1]) >> _U64(32)
    k = (u[:, None] >= tri[None, :]).sum(axis=1)
    out[np.asarray(positions, dtype=np.int64)] = (groups - 1 - k).astype(np.int32)
    return out


def _py_pca_rows_copy(src, row_start, out):
    """Twin of ``_recboost_fast.pca_rows_copy``: rows of ``src`` into float32 ``out``, zero past the end."""
    if src.shape[1] != out.shape[1]:
        raise ValueError("column mismatch: %d != %d" % (src.shape[1], out.shape[1]))
    lo, hi = max(row_start, 0), min(row_start + out.shape[0], src.shape[0])
    out[...] = 0
    if hi > lo:
        out[lo - row_start:hi - row_start] = src[lo:hi]
    return out


# ---- host tables (twins of the _fast kernels; HashEmbedding drives them) ------------------------------
# Float arithmetic in float32, in the kernels' operation order, with float32 scalars: bit-identical.
# Bags (multi-hot pooling, ``offsets``/``scale``) are described in _fast.pyx's "Host tables" section.
def _py_check_rows_in(rows, c):
    """IndexError for the first row outside a table of c rows, as the compiled kernels word it."""
    if rows.size and (rows.min() < 0 or rows.max() >= c):
        i = int(np.flatnonzero((rows < 0) | (rows >= c))[0])
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (rows[i], i, c))


def _py_gather_rows(table, rows, out):
    """Twin of ``_recboost_fast.gather_rows``: ``out[i] = table[rows[i]]``."""
    _py_check_rows_in(rows, table.shape[0])
    np.take(table, rows, axis=0, out=out)
    return out


def _py_scatter_rows(src, rows, table):
    """Twin of ``_recboost_fast.scatter_rows``: ``table[rows[i]] = src[i]`` in order."""
    if src.shape != (rows.size, table.shape[1]):
        raise ValueError("src has shape %s, expected %s" % (tuple(src.shape), (rows.size, table.shape[1])))
    _py_check_rows_in(rows, table.shape[0])
    table[rows] = src                   # (numpy assigns in order: a repeated row keeps the last)
    return table


def _py_check_bags(offsets, n, scale):
    """Twin of ``_fast._check_bags``: offsets over n positions and one scale per bag; returns nb."""
    m = offsets.shape[0]
    if m < 1:
        raise ValueError("offsets is empty, expected one entry per bag plus one (offsets[0] == 0)")
    if offsets[0] != 0:
        raise ValueError("offsets[0] is %d, expected 0" % offsets[0])
    if offsets[m - 1] != n:
        raise ValueError("offsets[%d] is %d, expected %d (the number of positions)" % (m - 1, offsets[m - 1], n))
    down = np.flatnonzero(offsets[1:] < offsets[:-1])
    if down.size:
        b = int(down[0])
        raise ValueError("offsets decrease at bag %d (%d > %d)" % (b, offsets[b], offsets[b + 1]))
    if scale is not None and scale.shape[0] != m - 1:
        raise ValueError("scale has %d entries, expected %d (one per bag)" % (scale.shape[0], m - 1))
    return m - 1


def _py_check_weights(weights, n):
    """Check per-position ``weights`` (None, or one float32 per position)."""
    if weights is not None and weights.shape[0] != n:
        raise ValueError("weights has %d entries, expected %d (one per position)" % (weights.shape[0], n))


def _py_bag_of_position(offsets):
    """The bag of each position: ``b`` for positions ``offsets[b] .. offsets[b+1]-1``."""
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))


def _py_gather_pool(table, rows, offsets, scale, out, weights=None):
    """Twin of ``_recboost_fast.gather_pool``: zeros, each position's row (times its weight, float32)
    added to its bag in order (np.add.at is unbuffered, in index order), then times the bag's scale."""
    nb = _py_check_bags(offsets, rows.shape[0], scale)
    _py_check_weights(weights, rows.shape[0])
    if out.shape != (nb, table.shape[1]):
        raise ValueError("out has shape %s, expected (%d, %d)" % (tuple(out.shape), nb, table.shape[1]))
    _py_check_rows_in(rows, table.shape[0])
    out[...] = 0
    np.add.at(out, _py_bag_of_position(offsets), table[rows] if weights is None else table[rows] * weights[:, None])
    out *= scale[:, None]
    return out


def _py_gather_max(table, rows, offsets, weights, out, argmax):
    """Twin of ``_recboost_fast.gather_max``: the bags' k-th positions taken together, k = 0, 1, ...;
    a position replaces a bag's kept value where it is the bag's first or ``v > kept``."""
    n, d = rows.shape[0], table.shape[1]
    nb = _py_check_bags(offsets, n, None)
    _py_check_weights(weights, n)
    if out.shape != (nb, d) or argmax.shape != (nb, d):
        raise ValueError("out/argmax have shapes %s/%s, expected (%d, %d)" % (tuple(out.shape), tuple(argmax.shape),
                                                                             nb, d))
    _py_check_rows_in(rows, table.shape[0])
    out[...] = 0
    argmax[...] = -1
    lengths = np.diff(offsets)
    for k in range(int(lengths.max()) if nb else 0):
        bags = np.flatnonzero(lengths > k)
        p = offsets[bags] + k
        if weights is not None:
            keep = weights[p] != 0
            bags, p = bags[keep], p[keep]
        v = table[rows[p]] if weights is None else table[rows[p]] * weights[p][:, None]
        kept, at = out[bags], argmax[bags]
        take = (at < 0) | (v > kept)
        out[bags] = np.where(take, v, kept)
        argmax[bags] = np.where(take, p[:, None], at)
    return out


def _py_unique_inverse(rows, mark):
    """Twin of ``_recboost_fast.unique_inverse`` (``mark`` is not needed here and stays untouched)."""
    if rows.size and (rows.min() < 0 or rows.max() >= mark.shape[0]):
        raise IndexError("a row is outside the mark array of %d" % mark.shape[0])
    uniq, inverse = _first_occurrence_unique(rows)
    return uniq.astype(np.int32), inverse


def _py_unique_ids(ids):
    """Twin of ``_recboost_fast.unique_ids``: ``(keys, inverse)``, the distinct int64 ids in
    first-occurrence order and each id's position among them (int32)."""
    return _first_occurrence_unique(ids)


def _first_occurrence_unique(values):
    """The distinct ``values`` in first-occurrence order and each value's position among them (int32)."""
    uniq, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    return uniq[order], _places(order, order.size)[inverse.reshape(-1)]


def _places(members, size):
    """``place[members[i]] == i`` (int32, length ``size``; the other entries are undefined): each
    member's position among ``members`` (distinct ints in ``[0, size)``)."""
    place = np.empty(size, np.int32)
    place[members] = np.arange(len(members), dtype=np.int32)
    return place


def _py_sum_by_row(uniq, inverse, grad, acc, offsets=None, scale=None, weights=None, argmax=None):
    """Twin of ``_recboost_fast.sum_by_row`` (and of the sum inside every fused update):
    ``acc[:u] = 0; acc[inverse[i]] += grad[i]`` in index order (np.add.at is unbuffered, in order);
    with bags, grad has one row per bag and position p of bag b adds ``grad[b] * scale[b]`` (the
    float32 products expanded to positions first), times ``weights[p]`` with weights; with ``argmax``
    only the arg-max position of each value adds it (the (bag, value) pairs in row-major order)."""
    if (offsets is None) != (scale is None):
        raise ValueError("offsets and scale go together: give both or neither")
    if offsets is None and (weights is not None or argmax is not None):
        raise ValueError("weights and argmax are per bag: give them with offsets and scale")
    index = inverse
    if offsets is not None:
        nb = _py_check_bags(offsets, inverse.shape[0], scale)
        if grad.shape[0] != nb:
            raise ValueError("grad has %d rows, expected %d (one per bag)" % (grad.shape[0], nb))
        _py_check_weights(weights, inverse.shape[0])
        if argmax is not None:
            _py_check_argmax(argmax, offsets, grad.shape[1])
            b, j = np.nonzero(argmax >= 0)
            p = argmax[b, j]
            grad = (grad * scale[:, None])[b, j]
            grad = grad if weights is None else grad * weights[p]
            index = (inverse[p], j)
        else:
            grad = (grad * scale[:, None])[_py_bag_of_position(offsets)]
            grad = grad if weights is None else grad * weights[:, None]
    if uniq.size and (uniq.min() < 0):
        raise IndexError("a negative row")
    total = acc[:uniq.size]
    total[...] = 0
    np.add.at(total, index, grad)
    return total


def _py_check_argmax(argmax, offsets, dim):
    """Twin of the arg-max check in ``_fast._sum_by_row``: shape (bags, dim), each entry -1 or a
    position of its bag."""
    nb = offsets.shape[0] - 1
    if argmax.shape != (nb, dim):
        raise ValueError("argmax has shape (%d, %d), expected (%d, %d) (one per value of each bag)"
                         % (argmax.shape + (nb, dim)))
    bad = np.argwhere((argmax != -1) & ((argmax < offsets[:-1, None]) | (argmax >= offsets[1:, None])))
    if bad.size:
        b, j = bad[0]
        raise ValueError("argmax[%d, %d] is %d, expected -1 or a position of bag %d (%d .. %d)"
                         % (b, j, argmax[b, j], b, offsets[b], offsets[b + 1] - 1))


def _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, decay):
    """Twin of the fused kernels' ``_prepare_row`` on every touched row: ``g`` (the summed gradient, a
    view of the scratch) clipped by value, then by L2 norm (the squares summed in column order), plus
    ``weight_decay * w``, in place; then the rows ``w - decay * w``. A bound of Inf or a decay of 0 is off."""
    f = np.float32
    cv, cn, wd, dc = f(clip_value), f(clip_norm), f(weight_decay), f(decay)
    if cv < f(np.inf):
        g[...] = np.where(g > cv, cv, np.where(g < -cv, -cv, g))
    if cn < f(np.inf):
        s = np.zeros(g.shape[0], np.float32)
        for j in range(g.shape[1]):
            s = s + g[:, j] * g[:, j]
        n = np.sqrt(s)
        big = n > cn
        g[big] = (g[big] * cn) / n[big, None]
    if wd != f(0.0):
        g[...] = g + wd * table[uniq]
    if dc != f(0.0):
        w = table[uniq]
        table[uniq] = w - dc * w


def _py_bfloat16_rows(table):
    """Whether a twin's ``table`` holds bfloat16 bits (uint16) rather than float32 rows. Any other dtype
    is a TypeError naming it (the compiled updates too: ``_rows_checked``)."""
    if table.dtype not in (np.float32, np.uint16):
        raise TypeError("table has dtype %s, expected float32 rows or bfloat16 bits (uint16)" % table.dtype)
    return table.dtype == np.uint16


def _py_bf16_stepped(table, slots, uniq, seed, counter, step):
    """The twins' bfloat16 rows (a uint16 ``table``): rows ``uniq`` decoded exactly, stepped as a compact
    float32 table with compact copies of their ``slots`` by ``step(rows, slots, arange)`` (the float32
    twin), the slots written back, the rows rounded back stochastically with ``bf16_encode``'s bits for
    ``seed`` and ``counter``: the bits of the compiled kernels, which do it a block of rows at a time."""
    uniq = np.ascontiguousarray(uniq, np.int32)
    work = _py_bf16_decode(table, uniq, np.empty((uniq.size, table.shape[1]), np.float32))
    compact = [slot[uniq] for slot in slots]
    step(work, compact, np.arange(uniq.size, dtype=np.int32))
    for slot, rows in zip(slots, compact):
        slot[uniq] = rows
    _py_bf16_encode(work, uniq, table, seed, counter, True)


def _py_sparse_sgd_update(table, uniq, inverse, grad, acc, lr, offsets=None, scale=None, largest=None,
                          clip_value=np.inf, clip_norm=np.inf, weight_decay=0.0, decay=0.0, weights=None,
                          argmax=None, seed=0, counter=0):
    """Twin of ``_recboost_fast.sparse_sgd_update``."""
    if _py_bfloat16_rows(table):
        return _py_bf16_stepped(table, (), uniq, seed, counter, lambda w, s, rows: _py_sparse_sgd_update(
            w, rows, inverse, grad, acc, lr, offsets, scale, largest, clip_value, clip_norm, weight_decay, decay,
            weights, argmax))
    track = largest is not None and np.float32(weight_decay) != 0
    _py_check_largest(largest, 3 if track else 0)
    g = _py_sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights, argmax)
    _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, decay)
    table[uniq] = table[uniq] - np.float32(lr) * g
    if track:
        _raise_largest(largest, 2, table[uniq], True)


def _raise_largest(largest, i, written, magnitude=False):
    """The running bounds of the update kernels (``_RowStore.largest``): ``largest[i]`` becomes the
    larger of itself and the largest entry (of ``|written|`` with ``magnitude``) of ``written``, NaNs
    passed over (``np.fmax``), as the compiled kernels' ``_row_top`` does. Nothing when ``largest``
    is None."""
    if largest is not None:
        values = np.abs(written) if magnitude else written
        largest[i] = np.fmax.reduce(values.reshape(-1), initial=largest[i])


def _py_check_largest(largest, n):
    if largest is not None and largest.shape[0] < n:
        raise ValueError("largest has %d entries, expected at least %d" % (largest.shape[0], n))


def _py_sparse_adagrad_update(table, accum, uniq, inverse, grad, acc, lr, offsets=None, scale=None, largest=None,
                              clip_value=np.inf, clip_norm=np.inf, weight_decay=0.0, decay=0.0, weights=None,
                              argmax=None, seed=0, counter=0):
    """Twin of ``_recboost_fast.sparse_adagrad_update``."""
    if _py_bfloat16_rows(table):
        return _py_bf16_stepped(table, (accum,), uniq, seed, counter, lambda w, s, rows: _py_sparse_adagrad_update(
            w, *s, rows, inverse, grad, acc, lr, offsets, scale, largest, clip_value, clip_norm, weight_decay, decay,
            weights, argmax))
    track_w = largest is not None and np.float32(weight_decay) != 0
    _py_check_largest(largest, 3 if track_w else 1)
    g = _py_sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights, argmax)
    _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, decay)
    a = accum[uniq] + g * g
    accum[uniq] = a
    table[uniq] = table[uniq] - (np.float32(lr) * g) / np.sqrt(a)
    _raise_largest(largest, 0, a)
    if track_w:
        _raise_largest(largest, 2, table[uniq], True)


def _py_sparse_rowwise_adagrad_update(table, accum, uniq, inverse, grad, acc, lr, eps, offsets=None, scale=None,
                                      largest=None, clip_value=np.inf, clip_norm=np.inf, weight_decay=0.0,
                                      decay=0.0, weights=None, argmax=None, seed=0, counter=0):
    """Twin of ``_recboost_fast.sparse_rowwise_adagrad_update`` (the squares summed column by column,
    in order, as the kernel does)."""
    f = np.float32
    if accum.shape != (table.shape[0], 1):
        raise ValueError("accum has shape (%s), expected (%d, 1)" % (", ".join(map(str, accum.shape)), table.shape[0]))
    if _py_bfloat16_rows(table):
        return _py_bf16_stepped(table, (accum,), uniq, seed, counter, lambda w, s, rows: (
            _py_sparse_rowwise_adagrad_update(w, *s, rows, inverse, grad, acc, lr, eps, offsets, scale, largest,
                                              clip_value, clip_norm, weight_decay, decay, weights, argmax)))
    track_w = largest is not None and np.float32(weight_decay) != 0
    _py_check_largest(largest, 3 if track_w else 1)
    g = _py_sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights, argmax)
    _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, decay)
    s = np.zeros(uniq.size, np.float32)
    for j in range(g.shape[1]):
        s = s + g[:, j] * g[:, j]
    a = accum[uniq, 0] + s / f(table.shape[1])
    accum[uniq, 0] = a
    r = f(lr) / (np.sqrt(a) + f(eps))
    table[uniq] = table[uniq] - r[:, None] * g
    _raise_largest(largest, 0, a)
    if track_w:
        _raise_largest(largest, 2, table[uniq], True)


def _py_sparse_adam_update(table, m, v, uniq, inverse, grad, acc, lr_t, beta1, beta2, c1, c2, eps, offsets=None,
                           scale=None, largest=None, clip_value=np.inf, clip_norm=np.inf, weight_decay=0.0, decay=0.0,
                           weights=None, argmax=None, seed=0, counter=0):
    """Twin of ``_recboost_fast.sparse_adam_update``."""
    if _py_bfloat16_rows(table):
        return _py_bf16_stepped(table, (m, v), uniq, seed, counter, lambda w, s, rows: _py_sparse_adam_update(
            w, *s, rows, inverse, grad, acc, lr_t, beta1, beta2, c1, c2, eps, offsets, scale, largest, clip_value,
            clip_norm, weight_decay, decay, weights, argmax))
    f = np.float32
    track = largest is not None and f(weight_decay) != 0
    _py_check_largest(largest, 3 if track else 0)
    g = _py_sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights, argmax)
    _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, decay)
    m1 = f(beta1) * m[uniq] + f(c1) * g
    v1 = f(beta2) * v[uniq] + f(c2) * (g * g)
    m[uniq] = m1
    v[uniq] = v1
    table[uniq] = table[uniq] - f(lr_t) * (m1 / (np.sqrt(v1) + f(eps)))
    if track:
        _raise_largest(largest, 2, table[uniq], True)


def _c_pow32(x, p):
    """``x ** p`` elementwise as the compiled kernel computes it: the C library's double ``pow``
    (``math.pow``), rounded to float32. (numpy's float32 ``power`` may use its own SIMD routine,
    whose last bit differs from the C library's on some CPUs.)"""
    out = np.frompyfunc(math.pow, 2, 1)(x.astype(np.float64), float(p))
    return np.asarray(out, np.float64).astype(np.float32)


def _py_sparse_ftrl_update(table, accum, linear, uniq, inverse, grad, acc, lr, lr_power, l1, l2, offsets=None,
                           scale=None, largest=None, clip_value=np.inf, clip_norm=np.inf, weight_decay=0.0,
                           weights=None, argmax=None, seed=0, counter=0):
    """Twin of ``_recboost_fast.sparse_ftrl_update``."""
    if _py_bfloat16_rows(table):
        return _py_bf16_stepped(table, (accum, linear), uniq, seed, counter, lambda w, s, rows: _py_sparse_ftrl_update(
            w, *s, rows, inverse, grad, acc, lr, lr_power, l1, l2, offsets, scale, largest, clip_value, clip_norm,
            weight_decay, weights, argmax))
    f = np.float32
    _py_check_largest(largest, 3)
    lr, l1 = f(lr), f(l1)
    g = _py_sum_by_row(uniq, inverse, grad, acc, offsets, scale, weights, argmax)
    _py_prepare_rows(table, uniq, g, clip_value, clip_norm, weight_decay, 0.0)
    a = accum[uniq]
    an = a + g * g
    if f(lr_power) == f(-0.5):
        pn, po = np.sqrt(an), np.sqrt(a)
    else:
        pn, po = _c_pow32(an, -f(lr_power)), _c_pow32(a, -f(lr_power))
    lin = (linear[uniq] + g) - ((pn - po) / lr) * table[uniq]
    linear[uniq] = lin
    accum[uniq] = an
    shrunk = (np.sign(lin) * l1 - lin) / (pn / lr + f(2.0) * f(l2))
    table[uniq] = np.where(np.abs(lin) > l1, shrunk, f(0.0))
    _raise_largest(largest, 0, an)
    _raise_largest(largest, 1, lin, True)
    _raise_largest(largest, 2, table[uniq], True)


def _py_init_rows(ids, seed, stddev, out):
    """Twin of ``_recboost_fast.init_rows``: id-keyed initial rows (see there)."""
    u64 = np.uint64
    with np.errstate(over="ignore"):
        k_seed = _mix64(u64(seed) + u64(_GOLDEN))
        k_id = _mix64(k_seed ^ np.asarray(ids, np.int64).view(u64))
        cols = (np.arange(1, out.shape[1] + 1, dtype=u64) * u64(_GOLDEN))
        h = _mix64(k_id[:, None] + cols[None, :])
    mask = u64(0xFFFF)
    s = ((h & mask) + ((h >> u64(16)) & mask) + ((h >> u64(32)) & mask) + (h >> u64(48))).astype(np.float64) + 2.0
    out[...] = (float(stddev) * math.sqrt(3.0)) * (s / 65536.0 - 2.0)
    return out


def _py_bf16_decode(table, rows, out):
    """Twin of ``_recboost_fast.bf16_decode``: bfloat16 bits (uint16) to float32, exactly."""
    if out.shape != (rows.shape[0], table.shape[1]):
        raise ValueError("out has shape (%d, %d), expected (%d, %d)" % (out.shape + (rows.shape[0], table.shape[1])))
    _py_check_rows_in(rows, table.shape[0])
    out[...] = (table[rows].astype(np.uint32) << np.uint32(16)).view(np.float32)
    return out


def _py_bf16_encode(src, rows, table, seed, counter, stochastic):
    """Twin of ``_recboost_fast.bf16_encode`` (see there): float32 to bfloat16 bits, stochastically
    with the same random bits, or to nearest even."""
    n, d = rows.shape[0], table.shape[1]
    if src.shape != (n, d):
        raise ValueError("src has shape (%d, %d), expected (%d, %d)" % (src.shape + (n, d)))
    _py_check_rows_in(rows, table.shape[0])
    u32, u64 = np.uint32, np.uint64
    u = np.ascontiguousarray(src, np.float32).view(u32)
    if stochastic:
        with np.errstate(over="ignore"):
            k_count = _mix64(_mix64(u64(seed) + u64(_GOLDEN)) ^ u64(counter))
            k_row = _mix64(k_count ^ rows.astype(np.int64).view(u64))
            cols = np.arange(1, d + 1, dtype=u64) * u64(_GOLDEN)
            r = (_mix64(k_row[:, None] + cols[None, :]) & u64(0xFFFF)).astype(u32)
    else:
        r = u32(0x7FFF) + ((u >> u32(16)) & u32(1))
    with np.errstate(over="ignore"):
        out = ((u + r) >> u32(16)).astype(np.uint16)
    special = (u & u32(0x7F800000)) == u32(0x7F800000)
    if special.any():
        nan = (u & u32(0x007FFFFF)) != 0
        out[special] = ((u[special] >> u32(16)) | np.where(nan[special], u32(0x40), u32(0))).astype(np.uint16)
    table[rows] = out
    return table


# ---- backend binding -------------------------------------------------------------------------------
# Every kernel by name: the compiled one when the extension is live, else its numpy twin (one per line,
# each issue adds its own). HashCache is the one class: the public ``HashCache`` below puts the
# argument checks in front of the bound kernel class.
parse_criteo = _fast.parse_criteo if _fast else _py_parse_criteo
_HashCacheKernel = _fast.HashCache if _fast else _py_HashCache
freeze_index_sequence = _fast.freeze_index_sequence if _fast else _py_freeze_index_sequence
pca_rows_copy = _fast.pca_rows_copy if _fast else _py_pca_rows_copy
gather_rows = _fast.gather_rows if _fast else _py_gather_rows
scatter_rows = _fast.scatter_rows if _fast else _py_scatter_rows
gather_pool = _fast.gather_pool if _fast else _py_gather_pool
gather_max = _fast.gather_max if _fast else _py_gather_max
unique_inverse = _fast.unique_inverse if _fast else _py_unique_inverse
sum_by_row = _fast.sum_by_row if _fast else _py_sum_by_row
unique_ids = _fast.unique_ids if _fast else _py_unique_ids


def _rows_checked(kernel):
    """The compiled update ``kernel`` (a Cython fused function over float32 rows and bfloat16 bits)
    with the twins' TypeError naming a table of another dtype (``_py_bfloat16_rows``), where Cython's
    dispatch says only "No matching signature found". Nothing is checked before the call: the
    kernel's own dispatch refuses, then the dtype is named."""
    @functools.wraps(kernel)
    def update(table, *args, **kwargs):
        try:
            return kernel(table, *args, **kwargs)
        except TypeError:
            _py_bfloat16_rows(np.asarray(table))
            raise
    return update


#: The compiled updates, each behind ``_rows_checked`` (also what ``_backend_kernels('fast')`` gives).
_FAST_UPDATES = {name: _rows_checked(getattr(_fast, name)) for name in (
    "sparse_sgd_update", "sparse_adagrad_update", "sparse_rowwise_adagrad_update", "sparse_adam_update",
    "sparse_ftrl_update")} if _fast else {}
sparse_sgd_update = _FAST_UPDATES["sparse_sgd_update"] if _fast else _py_sparse_sgd_update
sparse_adagrad_update = _FAST_UPDATES["sparse_adagrad_update"] if _fast else _py_sparse_adagrad_update
sparse_rowwise_adagrad_update = (_FAST_UPDATES["sparse_rowwise_adagrad_update"] if _fast else
                                 _py_sparse_rowwise_adagrad_update)
sparse_adam_update = _FAST_UPDATES["sparse_adam_update"] if _fast else _py_sparse_adam_update
sparse_ftrl_update = _FAST_UPDATES["sparse_ftrl_update"] if _fast else _py_sparse_ftrl_update
init_rows = _fast.init_rows if _fast else _py_init_rows
bf16_decode = _fast.bf16_decode if _fast else _py_bf16_decode
bf16_encode = _fast.bf16_encode if _fast else _py_bf16_encode

#: The numpy twin of each compiled kernel, under the kernel's name in ``_fast`` (one per line).
_PY_KERNELS = {
    "parse_criteo": _py_parse_criteo,
    "HashCache": _py_HashCache,
    "freeze_index_sequence": _py_freeze_index_sequence,
    "pca_rows_copy": _py_pca_rows_copy,
    "gather_rows": _py_gather_rows,
    "scatter_rows": _py_scatter_rows,
    "gather_pool": _py_gather_pool,
    "gather_max": _py_gather_max,
    "unique_inverse": _py_unique_inverse,
    "unique_ids": _py_unique_ids,
    "sum_by_row": _py_sum_by_row,
    "sparse_sgd_update": _py_sparse_sgd_update,
    "sparse_adagrad_update": _py_sparse_adagrad_update,
    "sparse_rowwise_adagrad_update": _py_sparse_rowwise_adagrad_update,
    "sparse_adam_update": _py_sparse_adam_update,
    "sparse_ftrl_update": _py_sparse_ftrl_update,
    "init_rows": _py_init_rows,
    "bf16_decode": _py_bf16_decode,
    "bf16_encode": _py_bf16_encode,
}
#: Names of the kernels that exist in both backends.
_KERNEL_NAMES = tuple(_PY_KERNELS)


def _backend_kernels(backend):
    """The kernels of ``backend`` ('fast' or 'py') as a dict name -> object (the tests use it)."""
    _check_one_of("recboost backends", "'backend'", backend, ("fast", "py"))
    if backend == "py":
        return dict(_PY_KERNELS)
    if _fast is None:
        raise RuntimeError("the compiled backend is not available: " + FAST_BACKEND_REASON)
    return {name: _FAST_UPDATES.get(name) or getattr(_fast, name) for name in _KERNEL_NAMES}


class HashCache(_HashCacheChecks, _HashCacheKernel):
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
    ``lookup(..., max_admit=k)`` admits at most the first ``k`` ids to qualify (the others as if the
    table were full); ``counts(ids)`` reads ids' counts and ``find(ids)`` their rows, changing nothing.

    ``eviction_policy`` (None, "lru" or "lfu"): what a full table (no free row, no growth) does for
    an id that qualifies. None: the id overflows as above. "lru"/"lfu": it takes the row of the id
    ranked lowest in its bucket of ``_HASH_BUCKET`` (32) rows (the bucket a function of the id):
    "lru" the least recently seen, "lfu" the lowest count decayed to now (counts halve per
    ``lfu_half_life`` unseen, admission reads the decayed counts too), then the least recently
    seen; ties to the lowest row. No id the same lookup looks up, nor one seen at the current time,
    is replaced (a bucket of only those: the new id overflows). The replaced id is forgotten;
    ``take_replaced()`` returns ``(ids, rows)`` of those replaced since its last call, and
    ``stats()["replaced"]`` counts them. A table with a policy does not grow (``grow=True`` with a
    policy is refused).

    ``admission_counter`` (``"exact"`` or ``"sketch"``): where ids without a row are counted.
    "exact" (the default): each is an entry of the cache (a *candidate*, ``stats()["candidates"]``)
    holding its exact count, so the cache's memory follows the stream's distinct ids. "sketch": in
    a count-min sketch of fixed size instead, ``sketch_depth`` rows (default 4) of ``sketch_width``
    int32 counters (default ``max(1024, 4 * capacity)``; ``stats()["sketch_bytes"]`` is
    ``4 * width * depth``); the cache then tracks only ids with a row (never more than its
    capacity). Row ``d`` counts an id at column ``((h >> 32) * width) >> 32`` of ``h = mix64(id ^
    salt_d)``, ``salt_d = mix64((d + 1) * 0x9E3779B97F4A7C15)`` (fixed: every process, backend and
    run counts alike); an id's count is the least of its counters, never below its true count
    since the last aging. A lookup reads the sketch as it was before the lookup: an id without a row
    starts at that count and goes on as above (admitted where it passes ``access_threshold``, then
    tracked with that count); after the lookup each id left without a row raises its counters to at
    least its count (conservative update, saturating at 2**31 - 1) and is not tracked. Aging: every
    ``sketch_window`` elements counted into the sketch (default ``sketch_width // 2``; the batch
    elements left on row 0), every counter halves (``stats()["aged"]`` counts the halvings), so
    an id must pass the threshold within roughly that many counts of other ids. ``evict`` then
    forgets admitted ids only (nothing is ``forgotten``); policies work as above. ``counts(ids)``
    gives the sketch's count for ids without a row. The error rate of the decisions against the
    exact counter is in docs/tables.md.

    ``evict(now=None)`` forgets every id whose last-seen time is older than ``eviction_threshold``
    (``now - last_seen > eviction_threshold``; ``now`` defaults to the time of the last lookup) and
    returns ``(freed_ids, freed_rows)`` of the ids that had rows, ordered by row; those rows are
    reused. ``-1`` disables eviction. ``state_dict()`` / ``load_state_dict()`` round-trip all state;
    ``record_changes()``, ``changes()`` and ``entries(ids)`` give what changed since (docs/tables.md).

    ``eviction`` and ``admission`` (keyword-only) are the other spelling of those settings, as sub-configs:
    ``eviction=LFU(half_life=60)`` is ``eviction_policy="lfu", lfu_half_life=60`` and ``admission=Sketch(
    width, depth, window)`` is ``admission_counter="sketch"`` with the ``sketch_*`` sizes (``Count()``: "exact");
    the attributes ``eviction`` and ``admission`` read them back (see ``TableConfig``).

    Arguments are checked here, once (``_HashCacheChecks``: a bad one raises ValueError or TypeError
    naming it and changes nothing); the work is done by the kernel of the live backend,
    ``_fast.HashCache`` or its numpy twin ``_py_HashCache``, with bit-identical results.
    """


# =====================================================================================================
# Hash embedding
# =====================================================================================================
# Host-resident tables: a HashEmbedding holds a HashCache (ids -> rows), a row store (_RowStore: its
# rows and optimizer slots as numpy arrays) and a layout (_LocalLayout and its subclasses: one
# process, data-parallel or row-wise, handed the store and the cache, never the table); no
# table is a graph Parameter, so growth and eviction recompile nothing and a step costs O(batch):
#   prefetch thread   prepare(): the HashCache maps raw ids to rows (counts, admission, growth),
#                     unique_inverse() groups the ids by row, newly admitted ids are listed;
#   training thread   take(): growth and the new ids' initial rows (a function of seed and id);
#                     gather(): each id's row into a ready buffer, an ordinary input of the step;
#                     the step returns that input's gradient (``row_inputs`` of the train cells);
#                     apply_gradients(): the fused sparse optimizer kernel sums the gradient per row
#                     and updates each touched row and its slots in one pass.
# On Ascend/GPU this is the host-table mode: the batch's rows cross to the device each step.


#: The sparse optimizers by class name, in definition order: every public subclass of
#: ``_SparseOptimizer`` registers itself (``__init_subclass__``). Messages, checkpoint reading and the
#: tests read it; :data:`SPARSE_OPTIMIZERS` is its read-only public view.
_SPARSE_OPTIMIZERS = {}


#: The growing states of a table whose running upper bounds ``_RowStore.largest`` keeps, in the order of
#: ``_GrowthBound``'s first fields: the largest accumulator entry (slot "accum"), ``|linear|`` (slot
#: "linear") and ``|weight|`` (the rows); a sparse optimizer's ``grows`` names a prefix of them.
_LARGEST = ("accum", "linear", "weight")
#: Rows decoded at a time when ``_RowStore.largest`` reads bfloat16 rows in one pass.
_LARGEST_CHUNK = 1 << 16


def _read_only(array):
    """A view of ``array`` that cannot be written through."""
    view = array.view()
    view.flags.writeable = False
    return view


#: A table's host arrays (rows, slots, live flags, the row marks) start at a multiple of this: a cache
#: line, so a 64-byte row (dim 16 float32) is one line, not two.
_HOST_ALIGN = 64
#: Host arrays of at least this many bytes are placed on their own anonymous mapping, aligned to it
#: and advised ``MADV_HUGEPAGE`` (2 MB, the x86-64 and arm64 transparent huge page): a random row then
#: costs no TLB miss per 4 KB page (transparent huge pages in "madvise" mode give them to such mappings only).
_HUGE_PAGE = 2 << 20


def _host_array(shape, dtype, fill=0):
    """A new C-contiguous, writeable array of ``shape`` and ``dtype`` holding ``fill``, for a table's
    large host arrays (rows, optimizer slots, live flags): its data starts at a multiple of
    ``_HOST_ALIGN`` bytes, and one of at least ``_HUGE_PAGE`` bytes lies on an anonymous mapping of its
    own, 2 MB aligned and advised ``MADV_HUGEPAGE`` where the platform has it (the mapping stays alive
    through the array's ``base``; without ``madvise`` the array is only aligned). Copies (``np.copy``,
    pickling) are ordinary numpy arrays: :func:`_host_held` brings an array back to this memory."""
    import mmap
    dtype, shape = np.dtype(dtype), (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    size = math.prod(shape) * dtype.itemsize
    if size >= _HUGE_PAGE:
        private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}     # (shared: no THP)
        mapping = mmap.mmap(-1, size + _HUGE_PAGE, **private)          # (anonymous: fileno -1)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:              # (a kernel without transparent huge pages: aligned only)
                pass
        memory, align = mapping, _HUGE_PAGE                 # (anonymous pages read as zeros)
    else:
        memory, align = bytearray(size + _HOST_ALIGN), _HOST_ALIGN
    start = -np.frombuffer(memory, np.uint8).ctypes.data % align
    # (its base the buffer, not another array: its views' base is the array itself, as np.zeros' are)
    array = np.ndarray(shape, dtype, buffer=memory, offset=start)
    if fill:
        array.fill(fill)
    return array


#: Linux's ``madvise`` advice (5.14 on) that faults a range's pages in, writable, without touching them.
_MADV_POPULATE_WRITE = 23
_FAULT_IN_CHUNK = 32 << 20      # :class:`_FaultInBeside` faults a new array's pages in 32 MB at a time
_LIBC_MADVISE = []              # libc's madvise through ctypes (the GIL released), found on first use


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)`` through ctypes, which releases the GIL while it runs,
    or None off Linux (``_MADV_POPULATE_WRITE`` is Linux's number) or where ctypes cannot find it."""
    if not _LIBC_MADVISE:
        call = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes  # pylint: disable=import-outside-toplevel
                call = ctypes.CDLL(None, use_errno=True).madvise
                call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            except (ImportError, OSError, AttributeError):
                call = None
        _LIBC_MADVISE.append(call)
    return _LIBC_MADVISE[0]


class _FaultInBeside:
    """The pages of a new :func:`_host_array` on its own mapping (``_HUGE_PAGE`` bytes or more) faulted
    in on a helper thread (``MADV_POPULATE_WRITE``, ``_FAULT_IN_CHUNK`` at a time, in address order)
    while the caller fills the array from the start: a context manager around the filling (a
    checkpoint's member read into it). A page is faulted in once, by whichever comes first; the
    advice never changes a page already there, so what the caller wrote stays. The first touch of new
    memory (zeroing its pages, which a VM may also have to back) then costs the caller's read no
    page faults: a 2 GB read from the page cache took 3.5-4.6 s with them and 1.0 s beside them,
    measured here. Leaving the context stops the thread after its chunk and waits for it. Where the
    kernel lacks the advice (before 5.14), on other systems, for smaller arrays, or where no thread
    can start, nothing is done: the reader faults its pages in itself, as before."""

    def __init__(self, array):
        self.array, self.stop, self.thread = array, threading.Event(), None

    def __enter__(self):
        madvise = _libc_madvise() if self.array.nbytes >= _HUGE_PAGE and _on_host(self.array) else None
        if madvise is not None:
            self.thread = _thread_beside(self._run, "recboost-fault-in", madvise)
        return self

    def _run(self, madvise):
        start, size = self.array.ctypes.data, self.array.nbytes
        for done in range(0, size, _FAULT_IN_CHUNK):
            if self.stop.is_set() or madvise(start + done, min(_FAULT_IN_CHUNK, size - done), _MADV_POPULATE_WRITE):
                return          # (stopped, or the advice refused: the reader faults the rest in)

    def __exit__(self, kind, value, traceback):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        return False


def _on_host(array):
    """Whether ``array`` lies in memory as :func:`_host_array` places it: C-contiguous, writeable, its
    data at a multiple of ``_HOST_ALIGN`` bytes (of ``_HUGE_PAGE`` from ``_HUGE_PAGE`` bytes on)."""
    align = _HUGE_PAGE if array.nbytes >= _HUGE_PAGE else _HOST_ALIGN
    return array.flags.c_contiguous and array.flags.writeable and (not array.nbytes or array.ctypes.data % align == 0)


def _host_held(array, dtype=None, copy=True):
    """``array`` as ``dtype`` (default its own) in :func:`_host_array`'s memory: a copy there, or with
    ``copy=False`` ``array`` itself when it already is such an array of ``dtype`` (a checkpoint's, just read)."""
    array = np.asarray(array)
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    if not copy and array.dtype == dtype and _on_host(array):
        return array
    out = _host_array(array.shape, dtype)
    out[...] = array
    return out


def _host_grown(array, rows, fill=0):
    """A :func:`_host_array` of ``rows`` rows holding ``array``'s rows, then rows of ``fill``."""
    out = _host_array((rows,) + array.shape[1:], array.dtype)
    out[:array.shape[0]] = array
    if fill:
        out[array.shape[0]:] = fill
    return out


def _power_of_two_at_least(values):
    """Each of ``values`` (floats >= 0) raised to the smallest power of two at least as large, as
    float32: 0, Inf and NaN stay as they are, and a value above 2^127 becomes float32's largest."""
    values = np.asarray(values, np.float64)
    mantissa, exponent = np.frexp(values)
    up = np.where(mantissa == 0.5, values, np.ldexp(1.0, exponent))
    up = np.where((values > 0) & np.isfinite(values), np.minimum(up, np.finfo(np.float32).max), values)
    return up.astype(np.float32)


#: The steps at which a table's learning-rate schedule is recorded in its settings (``_TableRate.setting``)
#: and evaluated again on resume, besides the checkpoint's own step (``HashEmbedding.state_dict``).
_RATE_STEPS = (0, 1, 2, 10, 100, 1000, 10 ** 4, 10 ** 5)
#: The MindSpore schedules a table evaluates for ``_RATE_AHEAD`` steps at once (one call on an int32 Tensor of
#: the steps, ``_TableRate.value``): those whose value on many steps is, entry by entry, the value of the
#: call on that step alone. ``WarmUpLR`` and ``InverseDecayLR`` compute only correctly rounded operations
#: (cast, min, floor, +, *, /), ``CosineDecayLR`` adds ``Sin``, whose CPU kernel gave each entry the same
#: bits at every length and position tried (4,099 inputs over its range, shifted by 1 to 16, against 585
#: calls on one; tests/test_table_optimizers.py checks all three against the call per step). Not ``ExponentialDecayLR``, ``NaturalExpDecayLR`` nor ``PolynomialDecayLR``: MindSpore's ``Pow``
#: on many entries differs from its call on one in the last bit (``pow(e, x)`` for x in [-300, 0]: 40 of
#: 585 entries), so they, a subclass and any other schedule are called once a step, as ``get_lr`` does.
_RATE_AHEAD_SCHEDULES = (nn.WarmUpLR, nn.InverseDecayLR, nn.CosineDecayLR)
#: Steps of a ``_RATE_AHEAD_SCHEDULES`` schedule evaluated in one call.
_RATE_AHEAD = 256


class _TableRate:
    """A sparse optimizer's learning rate as ``nn.Adam`` takes it (``Optimizer.get_lr``): a float, a
    ``mindspore.nn.LearningRateSchedule`` (called on the step), or a per-step array (a list, tuple or
    1-D array: entry ``step``); :meth:`value` is the float32 value at a table step (0 for the first
    update: MindSpore's ``global_step`` before the optimizer advances it). A schedule is called on the
    host once per step, on an int32 Tensor of shape [1] holding the step, as ``get_lr`` calls it (a
    call on many steps at once is not the same: MindSpore's vectorised ``pow`` differs in the last
    bit), and its value is kept for the step (the overflow bound and the update read it); one of
    ``_RATE_AHEAD_SCHEDULES`` (exactly that class), whose call on many steps gives each step's bits, is
    called once for the ``_RATE_AHEAD`` steps from the first one asked for, its values kept."""

    def __init__(self, where, value):
        self.where, self.schedule, self.values, self.constant, self.given = where, None, None, None, None
        self._kept = (0, np.zeros(0, np.float32))   # (first step, float32 values) of the schedule's last call
        self._record = None                      # a schedule's setting(), made once
        if isinstance(value, (Tensor, np.ndarray)) and value.ndim == 0:      # a 0-d Tensor: a constant, as in MindSpore
            value = (value.asnumpy() if isinstance(value, Tensor) else value).item()
        if isinstance(value, _LearningRateSchedule):
            self.schedule = value
        elif isinstance(value, (list, tuple, np.ndarray, Tensor)):
            values = value.asnumpy() if isinstance(value, Tensor) else value
            try:
                values = np.asarray(values, np.float64)
            except (TypeError, ValueError):
                values = None
            if values is None or values.ndim != 1 or values.size < 1 or not np.all(np.isfinite(values)) or \
                    np.any(values < 0):
                _fail(where, "'learning_rate'", "a float, a LearningRateSchedule or a non-empty 1-D per-step "
                      "array of finite numbers >= 0", value)
            self.values = values.astype(np.float32)
        else:
            self.given = _check_number(where, "learning_rate", value, 0, strict_min=True)
            self.constant = np.float32(self.given)

    def value(self, step, table=None):
        """The float32 learning rate of table step ``step`` (a ValueError naming ``learning_rate`` past
        the end of a per-step array, as MindSpore's gather fails there); a schedule's checked each time it
        is read as a constant or a per-step array is checked when given: a NaN, infinite or negative rate
        is a ValueError naming ``learning_rate``, the hash table ``table`` (its name, when given) and the
        step."""
        value = self._value(step)
        if self.schedule is not None and not (np.isfinite(value) and value >= 0):
            _fail(self.where, "'learning_rate' (a LearningRateSchedule)%s" % (
                "" if table is None else " of hash table %r" % table), "a finite number >= 0 at every step (as a "
                "constant or a per-step array must be)", "%s at table step %d" % (value, step))
        return value

    def _value(self, step):
        """:meth:`value` unchecked (a schedule's as it gives it)."""
        if self.constant is not None:
            return self.constant
        if self.values is not None:
            if step >= self.values.size:
                _fail(self.where, "'learning_rate' (a per-step array of %d entries)" % self.values.size,
                      "an entry for every step (steps 0 to %d)" % (self.values.size - 1), "step %d" % step)
            return self.values[step]
        first, values = self._kept
        if not 0 <= step - first < values.size:
            first, values = step, self._evaluate(step)
            self._kept = (first, values)
        return values[step - first]

    def _evaluate(self, step):
        """The schedule's float32 values from ``step`` on: ``_RATE_AHEAD`` of them (fewer near the int32
        end) in one call for a ``_RATE_AHEAD_SCHEDULES`` schedule, else one, called on the step alone."""
        ahead = min(_RATE_AHEAD, 2 ** 31 - step) if type(self.schedule) in _RATE_AHEAD_SCHEDULES else 1
        if ahead <= 1:
            value = self.schedule(Tensor(np.array([step], np.int32))).asnumpy()
            return np.float32(np.asarray(value, np.float32).reshape(())).reshape(1)
        value = self.schedule(Tensor(np.arange(step, step + ahead, dtype=np.int64).astype(np.int32))).asnumpy()
        return np.asarray(value, np.float32).reshape(ahead)

    def recorded(self, step):
        """The rate of ``step`` as a record holds it (:meth:`setting`'s ``values``): the float32 value as a
        JSON float (exact), a non-finite one as its name ('nan', 'inf'), a step the schedule fails on as
        'error' (a custom schedule may not run on every step)."""
        try:
            value = self._value(step)
        except Exception:           # noqa: BLE001 -- any failure of a user's schedule is recorded as such
            return "error"
        return value.item() if np.isfinite(value) else str(value)

    def setting(self, steps=()):
        """The rate as ``settings()`` records it: the float; ``{"schedule": class name, its constructor's
        arguments it keeps as attributes, "values": {step: :meth:`recorded`} at each of ``_RATE_STEPS``}``
        (evaluated once, at the first call: what a resume compares, so a schedule changed in its code, not
        its arguments, is caught), and at each of ``steps`` (a checkpoint's own step); or ``{"per_step":
        entries, "sha256": of the float32 values}``."""
        if self.constant is not None:
            return self.given
        if self.values is not None:
            return {"per_step": int(self.values.size), "sha256": hashlib.sha256(self.values.tobytes()).hexdigest()}
        if self._record is None:
            record = {"schedule": type(self.schedule).__name__}
            for name in inspect.signature(type(self.schedule).__init__).parameters:
                value = getattr(self.schedule, name, None)
                if isinstance(value, (bool, int, float, str)):
                    record[name] = value
            kept = self._kept
            record["values"] = {str(step): self.recorded(step) for step in _RATE_STEPS}
            self._kept, self._record = kept, record
        values = dict(self._record["values"])
        values.update((str(step), self.recorded(step)) for step in steps if str(step) not in values)
        return dict(self._record, values=values)


#: The row preparation options every sparse optimizer takes (clipping, decay) and their "off" values:
#: ``settings()`` records one only when it is on, so a table without them keeps its settings of before.
_OPTIMIZER_OPTIONS = {"clip_norm": None, "clip_value": None, "weight_decay": 0.0, "decoupled_weight_decay": 0.0}


def _decay_add(weight_decay, weight):
    """The ``add`` of a ``_GrowthBound``: a bound of what L2 decay ``weight_decay`` adds to each entry of a
    touched row's gradient (``g + wd * w``, ``_prepare_row``) when every ``|w| <= weight``: ``float32(wd) *
    weight``, the kernel's float32 ``wd`` times the bound (exact in float64; float32 rounding is monotone, so
    the kernel's ``wd * w`` rounded is at most it rounded). 0.0 without decay."""
    return float(np.float32(weight_decay)) * float(weight) if weight_decay else 0.0


class _SparseOptimizer:
    """Base of the sparse table optimizers: hyper-parameters here, row slots and table-wide scalars
    in the table's row store (``_RowStore``), the update in a fused host kernel (:meth:`update`). A table
    reads :attr:`slot_fills`, :attr:`row_slots` and :attr:`scalar_inits` to make its state (through
    :meth:`new_slots` and :meth:`slot_width`), asks :meth:`growth_bound` before a step (for the step's
    overflow check) and calls :meth:`update`: the whole protocol between a table and its optimizer.

    A public subclass registers itself under its class name (:data:`SPARSE_OPTIMIZERS`,
    :func:`sparse_optimizer`); its :attr:`kernel` names its fused kernel (``_fast.<kernel>``, twin
    ``_py_<kernel>``). Two optimizers are equal when they are of one class with equal :meth:`settings`.

    Every one takes ``learning_rate`` as ``nn.Adam`` does (a float, a ``mindspore.nn.LearningRateSchedule``
    or a per-step array: :meth:`rate`, ``_TableRate``) and the row options ``clip_norm``, ``clip_value``,
    ``weight_decay`` (L2 into the gradient) and ``decoupled_weight_decay`` (AdamW's), applied to the touched
    rows only, in the fused kernels (``_prepare_row``); ``SparseFtrl`` takes the clips and ``weight_decay``
    (``nn.FTRL``'s), not ``decoupled_weight_decay`` (FTRL's weights are derived from its slots)."""
    #: the name of the fused update kernel (in ``_KERNEL_NAMES``) :meth:`update` calls
    kernel = None
    #: ``(name, initial value)`` per row slot (a float32 array the shape of the rows, or one value per
    #: row for the names in :attr:`row_slots`)
    slot_fills = ()
    #: the names among :attr:`slot_fills` that hold one value per row: float32 arrays of shape
    #: ``(capacity, 1)`` (``SparseRowWiseAdagrad``'s accumulator)
    row_slots = ()
    #: ``(name, initial value)`` per table-wide float32 scalar (e.g. Adam's beta powers)
    scalar_inits = ()

    def __init__(self, learning_rate, clip_norm=None, clip_value=None, weight_decay=0.0, decoupled_weight_decay=0.0):
        where = type(self).__name__
        self._rate = _TableRate(where, learning_rate)
        #: as given: a float, a ``mindspore.nn.LearningRateSchedule`` or a per-step array (``nn.Adam``'s forms)
        self.learning_rate = self._rate.given if self._rate.constant is not None else learning_rate
        #: a touched row's summed gradient scaled to at most this L2 norm (None: no clipping)
        self.clip_norm = None if clip_norm is None else _check_number(where, "clip_norm", clip_norm, 0, strict_min=True)
        #: each entry of a touched row's summed gradient clipped to [-clip_value, clip_value] (None: none)
        self.clip_value = None if clip_value is None else _check_number(where, "clip_value", clip_value, 0,
                                                                         strict_min=True)
        #: L2 decay into a touched row's gradient, ``g + weight_decay * w`` (``nn.Adam``'s ``weight_decay``)
        self.weight_decay = _check_number(where, "weight_decay", weight_decay, 0)
        #: decoupled decay of a touched row, ``w -= lr * decoupled_weight_decay * w`` (AdamW's), before the rule
        self.decoupled_weight_decay = _check_number(where, "decoupled_weight_decay", decoupled_weight_decay, 0)

    def prepared(self, step):
        """The fused kernels' row preparation arguments at table step ``step`` (``_prepare_row``): the
        clip bounds (Inf: off), the L2 decay and the decoupled decay ``lr * decoupled_weight_decay`` (float32)."""
        f = np.float32
        return {"clip_value": f(np.inf if self.clip_value is None else self.clip_value),
                "clip_norm": f(np.inf if self.clip_norm is None else self.clip_norm),
                "weight_decay": f(self.weight_decay),
                "decay": f(self.rate(step) * f(self.decoupled_weight_decay))}

    @property
    def scheduled(self):
        """Whether the learning rate changes with the step (a schedule or a per-step array): then the
        update reads the table's step (a checkpoint records it either way: ``_CheckpointStore.write``)."""
        return self._rate.constant is None

    def rate(self, step, table=None):
        """The float32 learning rate of table step ``step`` (0 for the first update; a table counts the
        updates it applies, as MindSpore's ``global_step`` counts the optimizer's calls: a skipped step
        advances neither), as ``nn.Adam`` would use it (``_TableRate``; ``table``: the hash table's name
        its errors give)."""
        return self._rate.value(step, table)

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        """Update rows ``uniq`` of ``weight`` and ``slots`` with ``grad`` (one row per id, summed per
        row through ``inverse`` into the scratch ``acc``; with ``offsets`` and ``scale``, one row per
        bag, spread to its ids times the bag's scale; with ``weights``, one float32 per id, times each id's
        weight too; with ``argmax``, max pooling's arg-max ids, each value of a bag to its arg-max id
        alone: the kernel's ``weights`` and ``argmax``, given only for weighted ids or max pooling);
        ``scalars`` is updated in place, and so is
        ``largest`` (float32 ``[3]``, the running bounds of :attr:`grows`, raised to what is written;
        given only to an optimizer whose :attr:`grows` names a state); ``step``: the table's step
        (:meth:`rate`; given only to a :attr:`scheduled` optimizer). ``weight`` is float32, or bfloat16
        bits (uint16): then ``seed`` and ``counter`` key the stochastic rounding of the stepped rows (the
        kernels', as ``bf16_encode``'s)."""
        raise NotImplementedError

    def slot_width(self, name, dim):
        """Columns of slot ``name`` for rows ``dim`` wide: 1 for a slot of :attr:`row_slots`, else ``dim``."""
        return 1 if name in self.row_slots else dim

    def new_slots(self, capacity, dim):
        """Fresh slots for ``capacity`` rows ``dim`` wide: name -> float32 array of shape
        ``(capacity, slot_width(name, dim))`` at the slot's initial value (``_host_array``'s memory)."""
        return {name: _host_array((capacity, self.slot_width(name, dim)), np.float32, fill)
                for name, fill in self.slot_fills}

    #: The optimizer's own states that grow without bound: a prefix of ``_LARGEST`` (see :attr:`grows`).
    state_grows = ()

    @property
    def grows(self):
        """The states whose running bounds the step's overflow check reads: a prefix of ``_LARGEST``
        (``_RowStore.largest`` keeps them; the kernel named by :attr:`kernel` raises them as it writes,
        given ``largest``): :attr:`state_grows`, or all of ``_LARGEST`` with a ``weight_decay`` (the
        applied gradient ``g + wd * w`` needs ``|w|``). Empty: slots that do not grow (Adam's moments and
        SGD stay bounded by the gradients)."""
        return _LARGEST if self.weight_decay else self.state_grows

    def growth_bound(self, largest, step=0):
        """What the step's overflow check needs to prove that an update keeps the table's states
        finite: ``(M, L, W, q, lr, D, add)`` (``_update_bound``: the largest accumulator entry, the
        largest ``|linear|`` and ``|weight|``, FTRL's ``q = -lr_power``, ``lr`` and a lower bound of
        its new weights' divisor), from ``largest``, upper bounds of the first three over every row
        (``_RowStore.largest``), for the update of table step ``step``; and ``add``, a bound of what the
        ``weight_decay`` adds to each entry of a row's gradient (``_decay_add``: ``wd * |w|max``, which
        ``_update_bound`` adds to the gradient's T). This default: ``_NO_GROWTH`` with that ``add``."""
        return _GrowthBound(add=_decay_add(self.weight_decay, largest[2])) if self.weight_decay else _NO_GROWTH

    def settings(self, steps=()):
        """The hyper-parameters, name -> JSON value (what checkpoints record and a resume compares); the
        learning rate as ``_TableRate.setting`` records it (a schedule: its values at ``_RATE_STEPS`` and at
        each of ``steps``, table steps such as a checkpoint's)."""
        out = {key: value for key, value in sorted(vars(self).items())
               if not key.startswith("_") and _OPTIMIZER_OPTIONS.get(key, ()) != value}
        out["learning_rate"] = self._rate.setting(steps)
        return out

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):
            if cls.kernel not in _PY_KERNELS:
                raise TypeError("sparse optimizer %s: its kernel %r is not among the kernels %s"
                                % (cls.__name__, cls.kernel, sorted(_PY_KERNELS)))
            _SPARSE_OPTIMIZERS[cls.__name__] = cls

    def __eq__(self, other):
        return type(self) is type(other) and self.settings() == other.settings()

    def __hash__(self):
        return hash((type(self).__name__, json.dumps(self.settings(), sort_keys=True)))

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join("%s=%r" % kv for kv in self.settings().items()))


class SparseSGD(_SparseOptimizer):
    """Plain SGD on the touched rows: ``w -= lr * g``.

    ``learning_rate`` (a float, schedule or per-step array), ``clip_norm``, ``clip_value``,
    ``weight_decay`` and ``decoupled_weight_decay``: see ``_SparseOptimizer``."""
    kernel = "sparse_sgd_update"

    def __init__(self, learning_rate=0.01, clip_norm=None, clip_value=None, weight_decay=0.0,
                 decoupled_weight_decay=0.0):
        super().__init__(learning_rate, clip_norm, clip_value, weight_decay, decoupled_weight_decay)

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        sparse_sgd_update(weight, uniq, inverse, grad, acc, self.rate(step), offsets, scale, largest,
                          weights=weights, argmax=argmax, seed=seed, counter=counter, **self.prepared(step))


class _AccumulatingOptimizer(_SparseOptimizer):
    """A sparse optimizer whose one slot, ``accum``, starts at ``initial_accumulator_value`` and grows by
    squares of the gradient (the Adagrads)."""
    state_grows = ("accum",)

    @property
    def slot_fills(self):
        return (("accum", self.initial_accumulator_value),)

    def growth_bound(self, largest, step=0):
        """The largest accumulator entry, and the decay's ``add`` (``_decay_add``)."""
        return _GrowthBound(accum=float(largest[0]), add=_decay_add(self.weight_decay, largest[2]))


class SparseAdagrad(_AccumulatingOptimizer):
    """Adagrad on the touched rows (MindSpore's form): ``acc += g*g; w -= lr * g / sqrt(acc)``.

    ``learning_rate`` (a float, schedule or per-step array), ``clip_norm``, ``clip_value``,
    ``weight_decay`` and ``decoupled_weight_decay``: see ``_SparseOptimizer``."""
    kernel = "sparse_adagrad_update"

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.1, clip_norm=None, clip_value=None,
                 weight_decay=0.0, decoupled_weight_decay=0.0):
        super().__init__(learning_rate, clip_norm, clip_value, weight_decay, decoupled_weight_decay)
        self.initial_accumulator_value = _check_number("SparseAdagrad", "initial_accumulator_value",
                                                       initial_accumulator_value, 0, strict_min=True)

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        sparse_adagrad_update(weight, slots["accum"], uniq, inverse, grad, acc, self.rate(step),
                              offsets, scale, largest, weights=weights, argmax=argmax, seed=seed, counter=counter,
                              **self.prepared(step))


class SparseRowWiseAdagrad(_AccumulatingOptimizer):
    """Row-wise Adagrad on the touched rows (FBGEMM's and TorchRec's ``EXACT_ROWWISE_ADAGRAD``): one
    float32 accumulator per row instead of one per value, so the optimizer adds 4 bytes to a row
    (``SparseAdagrad``: 4 per value). ``acc += mean over the row of g*g; w -= lr * g / (sqrt(acc) + eps)``
    (g the row's gradient summed over the batch's ids; the mean's squares added in column order).

    ``learning_rate`` (a float, schedule or per-step array), ``clip_norm``, ``clip_value``,
    ``weight_decay`` and ``decoupled_weight_decay``: see ``_SparseOptimizer``."""
    kernel = "sparse_rowwise_adagrad_update"
    row_slots = ("accum",)

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0, eps=1e-8, clip_norm=None, clip_value=None,
                 weight_decay=0.0, decoupled_weight_decay=0.0):
        super().__init__(learning_rate, clip_norm, clip_value, weight_decay, decoupled_weight_decay)
        self.initial_accumulator_value = _check_number("SparseRowWiseAdagrad", "initial_accumulator_value",
                                                       initial_accumulator_value, 0)
        self.eps = _check_number("SparseRowWiseAdagrad", "eps", eps, 0, strict_min=True)

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        sparse_rowwise_adagrad_update(weight, slots["accum"], uniq, inverse, grad, acc,
                                      self.rate(step), np.float32(self.eps), offsets, scale, largest,
                                      weights=weights, argmax=argmax, seed=seed, counter=counter,
                                      **self.prepared(step))


class SparseAdam(_SparseOptimizer):
    """Lazy Adam on the touched rows (MindSpore's LazyAdam): per-row moments, table-wide beta powers.

    ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    w -= lr_t * (m / (sqrt(v) + eps))`` with ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)``, t counting this
    table's steps: every term in float32 and in the order of MindSpore's CPU LazyAdam kernel
    (``FusedSparseLazyAdam``), so the rows equal its bit for bit on ids seen once per batch (the beta powers
    are float32, as MindSpore keeps them).

    ``learning_rate`` (a float, schedule or per-step array), ``clip_norm``, ``clip_value``,
    ``weight_decay`` and ``decoupled_weight_decay``: see ``_SparseOptimizer``."""
    kernel = "sparse_adam_update"
    slot_fills = (("moment1", 0.0), ("moment2", 0.0))
    scalar_inits = (("beta1_power", 1.0), ("beta2_power", 1.0))

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, eps=1e-8, clip_norm=None, clip_value=None,
                 weight_decay=0.0, decoupled_weight_decay=0.0):
        super().__init__(learning_rate, clip_norm, clip_value, weight_decay, decoupled_weight_decay)
        self.beta1 = _check_number("SparseAdam", "beta1", beta1, 0, 1)
        self.beta2 = _check_number("SparseAdam", "beta2", beta2, 0, 1)
        self.eps = _check_number("SparseAdam", "eps", eps, 0, strict_min=True)

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        b1p = scalars["beta1_power"] = np.float32(scalars["beta1_power"] * b1)
        b2p = scalars["beta2_power"] = np.float32(scalars["beta2_power"] * b2)
        one = np.float32(1.0)        # lr_t in float32, term by term, as MindSpore's LazyAdam kernel computes it
        lr_t = np.float32(self.rate(step) * np.sqrt(one - b2p) / (one - b1p))
        sparse_adam_update(weight, slots["moment1"], slots["moment2"], uniq, inverse, grad, acc, lr_t,
                           b1, b2, np.float32(1.0) - b1, np.float32(1.0) - b2, np.float32(self.eps), offsets, scale,
                           largest, weights=weights, argmax=argmax, seed=seed, counter=counter,
                           **self.prepared(step))


class SparseFtrl(_SparseOptimizer):
    """FTRL-proximal on the touched rows (MindSpore's FTRL form, ``lr_power`` <= 0).

    ``learning_rate`` (a float, schedule or per-step array), ``clip_norm`` and
    ``clip_value``: see ``_SparseOptimizer``. ``weight_decay``: ``nn.FTRL``'s, L2 decay into a touched
    row's gradient, ``g + weight_decay * w`` (after the clips, before the FTRL rule, in float32 as
    MindSpore's ``decay_weight`` does on a sparse gradient of distinct rows), on the touched rows only;
    it is not FTRL's ``l2`` (which only enlarges the new weights' divisor). ``decoupled_weight_decay`` is
    taken only as 0 (anything else is a ValueError naming it): ``nn.FTRL`` has no such decay, and FTRL's
    weights are derived from its ``linear`` and ``accum`` slots at each update, so decaying a weight
    beside them would be overwritten by the next update."""
    kernel = "sparse_ftrl_update"

    def __init__(self, learning_rate=0.001, initial_accum=0.1, lr_power=-0.5, l1=0.0, l2=0.0, clip_norm=None,
                 clip_value=None, weight_decay=0.0, decoupled_weight_decay=0.0):
        if _check_number("SparseFtrl", "decoupled_weight_decay", decoupled_weight_decay, 0) != 0:
            _fail("SparseFtrl", "'decoupled_weight_decay'", "0 (nn.FTRL has no decoupled decay, and FTRL derives "
                  "its weights from its 'linear' and 'accum' slots at each update, so a decayed weight would "
                  "not last: use 'weight_decay', or FTRL's own 'l1' and 'l2')", decoupled_weight_decay)
        super().__init__(learning_rate, clip_norm, clip_value, weight_decay)
        self.initial_accum = _check_number("SparseFtrl", "initial_accum", initial_accum, 0, strict_min=True)
        self.lr_power = _check_number("SparseFtrl", "lr_power", lr_power, maximum=0)
        self.l1 = _check_number("SparseFtrl", "l1", l1, 0)
        self.l2 = _check_number("SparseFtrl", "l2", l2, 0)

    @property
    def slot_fills(self):
        return (("accum", self.initial_accum), ("linear", 0.0))

    state_grows = ("accum", "linear", "weight")

    def growth_bound(self, largest, step=0):
        """The largest accumulator entry, ``|linear|`` and ``|weight|``, ``-lr_power``, the learning
        rate and a lower bound of the new weights' divisor (see ``_update_bound``): a row's
        accumulator starts at ``initial_accum`` > 0 (an evicted row's too) and never decreases, so
        ``initial_accum^q / lr + 2 l2`` bounds it (``_ftrl_divisor``); ``lr`` the rate of ``step``, the
        update's (a schedule's value changes the divisor); and the ``weight_decay``'s ``add``
        (``_decay_add``), which ``_update_bound`` adds to T wherever T enters FTRL's bounds."""
        q, lr = float(np.float32(-self.lr_power)), float(self.rate(step))
        return _GrowthBound(float(largest[0]), float(largest[1]), float(largest[2]), q, lr,
                            _ftrl_divisor(np.float32(self.initial_accum), q, lr, float(np.float32(self.l2))),
                            _decay_add(self.weight_decay, largest[2]))

    def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None, largest=None,
               step=0, weights=None, argmax=None, seed=0, counter=0):
        sparse_ftrl_update(weight, slots["accum"], slots["linear"], uniq, inverse, grad, acc,
                           self.rate(step), np.float32(self.lr_power), np.float32(self.l1),
                           np.float32(self.l2), offsets, scale, largest, weights=weights, argmax=argmax, seed=seed,
                           counter=counter, **{
                               key: value for key, value in self.prepared(step).items() if key != "decay"})


def sparse_optimizers():
    """The registered sparse optimizers, class name -> class, in definition order (a copy): ``SparseSGD``,
    ``SparseAdagrad``, ``SparseRowWiseAdagrad``, ``SparseAdam``, ``SparseFtrl``, and any public subclass of
    their base defined later (a class registers itself)."""
    return dict(_SPARSE_OPTIMIZERS)


def sparse_optimizer(name, **hyper_parameters):
    """A sparse optimizer by its class name, e.g. ``sparse_optimizer("SparseFtrl", learning_rate=0.1,
    l1=0.01)``; an unknown name is a ValueError naming the registered ones (:func:`sparse_optimizers`), a
    hyper-parameter the class does not take a TypeError naming it and the ones it takes."""
    cls = _sparse_optimizer_class("sparse_optimizer", "'name'", name)
    taken = [key for key in inspect.signature(cls.__init__).parameters if key != "self"]
    for key in hyper_parameters:
        if key not in taken:
            _fail("sparse_optimizer", "a hyper-parameter of %s" % name, "one of %s" % taken, key, TypeError)
    return cls(**hyper_parameters)


def _sparse_optimizer_class(where, what, name):
    """The registered sparse optimizer class named ``name``, else a ValueError naming ``what`` and the
    registry's names."""
    cls = _SPARSE_OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        _fail(where, what, "one of the sparse optimizers %s" % list(_SPARSE_OPTIMIZERS), name)
    return cls


def _optimizer_names():
    """The registered sparse optimizers' names as a message lists them: "A, B, ... or Z"."""
    names = list(_SPARSE_OPTIMIZERS)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


class _TableBatch:
    """One table's host side of one batch (made by ``HashEmbedding.prepare``, in stream order, from a
    layout's ``_Mapping``: its six fields become the fields of the same names).

    ``rows``: the row of each id the table sees (int32, flat: every feature of the table in turn,
    padding ids left out); ``uniq``/``inverse``: the distinct rows in first occurrence order and
    each id's position in ``uniq``; ``new_rows``/``new_ids``: rows given to ids admitted by this
    batch (they get their initial rows in ``take``); ``capacity``: the rows the table needs (the
    cache grew to it while mapping this batch). ``offsets``/``scale``: None when every id is an
    output row of its own; else the bags: output row ``b`` pools ``rows[offsets[b]:offsets[b+1]]``
    times ``scale[b]`` (int64 / float32). ``shapes``: each feature's output shape before the
    embedding dimension; ``positions``: each feature's place among the step's inputs (RecModel).
    ``layout``: the table layout that prepared the batch (``_LocalLayout`` and its subclasses), which
    ``gather`` and ``apply_gradients`` call: for a data-parallel step ``uniq`` holds the distinct rows
    of every rank's ids and ``inverse`` this rank's ids' positions in it. ``keys``: None, or for a
    row-wise step the ``_OwnedKeys`` of the step; ``rows``, ``uniq`` and ``inverse`` then index the
    step's keys, not table rows (see ``_RowWiseLayout.prepare``). ``bags``: the ``_Bags`` of the
    batch's features (offsets, scale, weights, max pooling), or None without bags; ``offsets`` and
    ``scale`` are its fields. ``argmax``: with max pooling, the position each output value came from
    (int64 ``[outputs, dim]``, -1 for an empty bag), set by ``gather``.
    """
    __slots__ = ("rows", "uniq", "inverse", "new_rows", "new_ids", "capacity", "offsets", "scale", "shapes",
                 "positions", "layout", "keys", "bags", "argmax")

    def __init__(self, mapping, capacity, bags=None, shapes=None, positions=(), layout=None):
        self.rows, self.uniq, self.inverse = mapping.rows, mapping.uniq, mapping.inverse
        self.new_rows, self.new_ids, self.keys = mapping.new_rows, mapping.new_ids, mapping.keys
        self.capacity, self.bags, self.argmax = capacity, bags, None
        self.offsets, self.scale = (None, None) if bags is None else (bags.offsets, bags.scale)
        self.shapes = [self.rows.shape] if shapes is None else list(shapes)
        self.positions = tuple(positions)
        self.layout = _LOCAL_LAYOUT if layout is None else layout

    #: the weight of each of :attr:`rows` (float32), None when unweighted (its ``_Bags``')
    weights = property(lambda self: None if self.bags is None else self.bags.weights)

    @property
    def outputs(self):
        """Output rows of the batch (bags, or ids without bags)."""
        return int(self.rows.size if self.offsets is None else self.offsets.size - 1)

    def gradient_factor(self):
        """At most how many times the gradient of one output row reaches one table row, as the power of
        two at or above it: 1 without bags; else over the bags the largest of the bag's scale times the
        sum of its positions' |weights| (its count of ids when unweighted: an id repeated in a "sum"
        bag gets the bag's gradient that many times), or with max pooling the largest scale times the
        largest |weight| (each value goes to one position). So a row's gradient is at most this times
        the sum of the output rows' gradients (``_TrainStep.set_row_bounds``' ``factors``)."""
        bags = self.bags
        if bags is None or bags.offsets.size < 2:
            return 1.0
        scale = np.abs(bags.scale.astype(np.float64))
        magnitude = None if bags.weights is None else np.abs(bags.weights.astype(np.float64))
        if bags.maximum:
            largest = scale.max() * (1.0 if magnitude is None or magnitude.size == 0 else magnitude.max())
        elif magnitude is None:
            largest = (scale * np.diff(bags.offsets)).max()
        else:
            summed = np.concatenate([[0.0], np.cumsum(magnitude)])
            largest = (scale * (summed[bags.offsets[1:]] - summed[bags.offsets[:-1]])).max()
        if largest <= 1.0:          # (at most one copy of a gradient row, unscaled up: no rounding to cover)
            return 1.0
        return float(_power_of_two_at_least(largest * (1.0 + 2.0 ** -20)))     # (the kernels' float32 sums)

    def gradient(self, grad, dim, where):
        """``grad``, the gradient of the batch's gathered rows (an array, or a list with one per
        feature; Tensors or arrays), as one float32 array ``[outputs, dim]``; a wrong count of
        gradients or rows is an error naming ``where``."""
        grads = grad if isinstance(grad, (list, tuple)) else [grad]
        if len(grads) != len(self.shapes):
            _fail(where, "'grad'", "%d gradients (one per feature of the batch)" % len(self.shapes), len(grads))
        grads = [np.ascontiguousarray(g.asnumpy() if isinstance(g, Tensor) else g, np.float32).reshape(-1, dim)
                 for g in grads]
        grad = grads[0] if len(grads) == 1 else np.concatenate(grads)
        if grad.shape[0] != self.outputs:
            _fail(where, "the rows of 'grad'", "%d (one per %s of the batch)" % (
                self.outputs, "id" if self.offsets is None else "bag"), grad.shape[0])
        return grad

    def row_gradient(self, grad):
        """``(grad, offsets, scale, weights, argmax)`` as the fused updates take them (``sparse_*_update``,
        ``sum_by_row``): the gradient of the output rows with the bags, which the kernel spreads to
        their positions (times each position's weight, for weighted ids; for max pooling only to the
        arg-max position of each value), or without bags one gradient row per id. Max pooling needs
        ``gather`` first (its arg-max)."""
        bags = self.bags
        if bags is None:
            return grad, None, None, None, None
        if bags.maximum and self.argmax is None:
            _fail("HashEmbedding.apply_gradients", "the batch of a max-pooled table", "gathered first (the "
                  "gradient goes to each value's arg-max row, which gather finds)", "a batch not gathered")
        return grad, bags.offsets, bags.scale, bags.weights, self.argmax if bags.maximum else None


def _bag_keywords(weights, argmax):
    """The keywords that hand a sparse optimizer's ``update`` a batch's per-id ``weights`` and max
    pooling's ``argmax`` (each only when given: an unweighted, sum-pooled update keeps the signature
    an optimizer written before weighted ids has)."""
    return {key: value for key, value in (("weights", weights), ("argmax", argmax)) if value is not None}


class _OwnedKeys:
    """One step of a row-wise table: the distinct ids of every rank's part of the batch ("keys", in
    first-occurrence order, numbered 0..size-1), which rank owns each and which each rank uses.

    ``owned[r]``: the keys rank r owns (int64 key numbers, ascending); ``rows``: this rank's rows of
    its owned keys (int32, row 0 for an id without a row of its own); ``used[r]``: the keys rank r's
    ids use (ascending). After the rows are fetched (``HashEmbedding.gather``), ``values`` holds
    every key's row (float32 ``[size, dim]``) and ``default`` whether the key is on row 0.
    """
    __slots__ = ("size", "owned", "rows", "used", "values", "default")

    def __init__(self, size, owned, rows, used):
        self.size, self.owned, self.rows, self.used = size, owned, rows, used
        self.values = self.default = None


def _ragged_bags(where, values, offsets, what="a ragged feature"):
    """Check a ragged feature ``(values, offsets)`` (the KeyedJaggedTensor / ``embedding_bag``
    convention: bag b is ``values[offsets[b]:offsets[b+1]]``): int ids, int64 offsets. ``what``: the
    feature, as the errors name it."""
    values = _hash_ids(where, values).reshape(-1)
    offsets = offsets.asnumpy() if isinstance(offsets, Tensor) else np.asarray(offsets)
    if offsets.ndim != 1 or offsets.size < 1 or offsets.dtype.kind not in "iu":
        _fail(where, "the offsets of %s" % what, "a 1-D int array of length bags + 1",
              "%s of shape %s" % (offsets.dtype, offsets.shape), TypeError if offsets.dtype.kind not in "iu"
              else ValueError)
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1]) or offsets[-1] != values.size:
        _fail(where, "the offsets of %s" % what, "non-decreasing from 0 to len(values) = %d"
              % values.size, offsets.tolist() if offsets.size <= 8 else "%s ... %s" % (
                  offsets[:4].tolist(), offsets[-4:].tolist()))
    return values, offsets


#: A checked feature of a table (``HashEmbedding.check_features``): its kept ids (int64, flat, padding
#: ids dropped), the ids per output row (int64; None without bags), the output shape before the
#: embedding dimension and the kept ids' weights (float32, flat; None: unweighted).
_Feature = collections.namedtuple("_Feature", "ids counts shape weights", defaults=(None,))
#: The bags of a table's batch (``_feature_bags``): ``offsets`` (int64, bags + 1), ``scale`` (float32 per
#: bag: the combiner's factor), ``weights`` (float32 per position, None: unweighted) and ``maximum``
#: (the "max" combiner: ``gather_max`` in place of ``gather_pool``).
_Bags = collections.namedtuple("_Bags", "offsets scale weights maximum")
#: The ids every rank gave a step for one exchanged table (``_RankExchange.share_ids``): ``union``, the
#: ids of every rank in the order one process would see the concatenated batch; ``mine``, this rank's
#: positions in it (int64, in its own flat order); ``rank_of``, the rank of each id; ``time``, the
#: latest time any rank gave (None when none gave one).
_SharedIds = collections.namedtuple("_SharedIds", "union mine rank_of time")
#: What this rank gives a step for one exchanged table (``_RankExchange.share_headers`` and
#: ``share_ids``): its data time (None when none) and the flat ids of each of its features.
_TableIds = collections.namedtuple("_TableIds", "time ids")
#: A layout's mapping of a step's ids (``prepare``; the fields of ``_TableBatch`` of the same names):
#: ``rows``, ``uniq``, ``inverse``, ``new_rows``, ``new_ids`` and ``keys`` (None, or a row-wise
#: step's ``_OwnedKeys``).
_Mapping = collections.namedtuple("_Mapping", "rows uniq inverse new_rows new_ids keys")


class _LocalLayout:
    """How a hash table is laid out across processes: a strategy object (``HashEmbedding.layout``, set
    by :meth:`HashEmbedding.set_layout`) that maps a step's ids (:meth:`prepare`), says where
    ``gather`` reads rows from (:meth:`rows`), applies the gradients (:meth:`apply`) and lays out a
    checkpoint's states for its layout (:meth:`restore`). It works on what it is given, the table's
    row store (``_RowStore``) and cache, and never calls back into the table; a batch records the
    layout that prepared it.

    This one: the whole table in one process ("none"). It also serves the local lookups of every
    layout (``HashEmbedding.prepare`` on any table, evaluation of a data-parallel table, batches
    replayed from a checkpoint)."""
    #: the table's ``resolved_sharding``
    sharding = "none"
    #: ``(rank, world)`` of a row-wise shard (its checkpoints are written in parts); None: whole here
    shard = None

    def exchanges(self, training):
        """Whether a step's ids are shared across ranks (RecModel then prepares on the training thread)."""
        return False

    def prepare(self, store, cache, parts, timestamp, is_train, shared):
        """The ``_Mapping`` of a step of checked features ``parts`` (``_Feature``s) through ``cache``
        and ``store``; ``shared``: the ``_SharedIds`` of the ids the ranks shared, unused here. With
        ``is_train`` the ids go through ``cache.lookup`` (``store.map_ids``), else ``cache.find``."""
        flat = parts[0].ids if len(parts) == 1 else np.concatenate([p.ids for p in parts])
        if is_train:
            return store.map_ids(cache, flat, timestamp)
        rows = cache.find(flat)
        uniq, inverse = unique_inverse(rows, np.full(cache.capacity, -1, np.int32))
        return _Mapping(rows, uniq, inverse, np.empty(0, np.int32), np.empty(0, np.int64), None)

    def rows(self, store, batch):
        """The rows ``gather`` reads ``batch.rows`` from: the store's own."""
        return store.weight

    def apply(self, store, batch, grad):
        """The sparse optimizer step on the batch's rows with ``grad`` (one row per output row)."""
        store.update_rows(batch.uniq, batch.inverse, *batch.row_gradient(grad))

    def restore(self, states, store, cache):
        """The state to load from checked ``states`` that together hold each id once: one whole table,
        or the shards of a row-wise checkpoint in rank order. The same layout as this one (one whole
        state for a whole table, ``world`` shards for shard ``rank`` of ``world``) is used as it is;
        any other is re-laid out by :func:`_reshard_states` (for ``store``'s optimizer and width, at
        least ``cache``'s capacity)."""
        rank, world = self.shard or (0, 1)
        return states[rank] if len(states) == world else _reshard_states(states, rank, world, store, cache)


_LOCAL_LAYOUT = _LocalLayout()


class _DataParallelLayout(_LocalLayout):
    """Every rank holds the whole table; a training step maps the union of every rank's ids
    (identically on every rank), and the union rows' gradients are summed across ranks through
    ``exchange`` (a ``_RankExchange``)."""
    sharding = "data_parallel"

    def __init__(self, exchange):
        self.exchange = exchange

    def exchanges(self, training):
        """Training steps share their ids (evaluation looks up locally)."""
        return training

    def prepare(self, store, cache, parts, timestamp, is_train, shared):
        """The cache maps the whole union (``shared.union``; ``union[shared.mine]`` this rank's ids in
        its flat order); the batch keeps this rank's rows and, as ``inverse``, their positions among
        the union's distinct rows ``uniq``."""
        m = store.map_ids(cache, shared.union, timestamp)
        return _Mapping(m.rows[shared.mine], m.uniq, m.inverse[shared.mine], m.new_rows, m.new_ids, None)

    def apply(self, store, batch, grad):
        """This rank's sum per union row, summed over the ranks (and scaled like the dense
        gradients), then the same update on every rank (each union row is its own group)."""
        u = batch.uniq.size
        total = np.empty((0, store.dim), np.float32)
        if u:
            total = self.exchange.sum_rows(store.sum_gradients(batch.uniq, batch.inverse,
                                                               *batch.row_gradient(grad)))
        store.update_rows(batch.uniq, np.arange(u, dtype=np.int32), total)


class _RowWiseLayout(_LocalLayout):
    """Rank ``mix64(id) % world`` owns an id and alone counts, admits, evicts, stores and updates it;
    each step the rows come from their owners and the gradients go back to them (``exchange``).
    ``shared_capacity``: the table does not grow (and has no eviction policy), so its ``rows`` (for
    ids, every shard's together) bound the admissions of all shards, as in one process. Resharding a
    checkpoint across world sizes (:func:`_reshard_states`) follows this class."""
    sharding = "row_wise"

    def __init__(self, exchange, rank, world, shared_capacity, rows):
        self.exchange, self.shard = exchange, (int(rank), int(world))
        self.shared_capacity, self.table_rows = shared_capacity, rows

    def exchanges(self, training):
        """Every step shares its ids (evaluation too: the rows are at their owners)."""
        return True

    def prepare(self, store, cache, parts, timestamp, is_train, shared):
        """The union's distinct ids become the step's keys. This rank's cache maps (``lookup`` when
        training, else ``find``) only the ids it owns, in the union's order, so each id is counted,
        admitted and evicted by its owner as one process would; it is called on every step, owned
        ids or none, so the shards' clocks agree. The mapping indexes keys: ``rows`` are this rank's
        ids' keys, ``uniq`` the keys they use, ``inverse`` each id's place in ``uniq``; its
        ``keys`` (``_OwnedKeys``) serve :meth:`rows` and :meth:`apply`."""
        rank, size = self.shard
        keys, key_of = unique_ids(shared.union)
        owner = _owner_of(keys, size)
        owned = [np.flatnonzero(owner == r) for r in range(size)]
        seen = np.zeros((size, keys.size), np.bool_)             # which keys each rank's ids use
        seen[shared.rank_of, key_of] = True
        used = [np.flatnonzero(row) for row in seen]
        here = np.flatnonzero(owner[key_of] == rank)             # union positions whose id this rank owns
        mine_of = _places(owned[rank], keys.size)[key_of[here]]  # their places among this rank's keys
        if is_train:
            limit = self._admission_limit(cache, keys[owned[rank]], mine_of, here) if self.shared_capacity else -1
            m = store.map_ids(cache, shared.union[here], timestamp, limit)
            rows, new_rows, new_ids = m.rows, m.new_rows, m.new_ids
        else:
            rows = cache.find(shared.union[here])
            new_rows, new_ids = np.empty(0, np.int32), np.empty(0, np.int64)
        own_rows = np.zeros(owned[rank].size, np.int32)
        own_rows[mine_of] = rows
        my_keys = key_of[shared.mine].astype(np.int32)
        uniq = used[rank].astype(np.int32)
        return _Mapping(my_keys, uniq, _places(uniq, keys.size)[my_keys], new_rows, new_ids,
                        _OwnedKeys(keys.size, owned, own_rows, used))

    def _admission_limit(self, cache, keys, inverse, at):
        """How many ids this shard may admit when it looks up its ids of the step's union
        (``keys[inverse]``: its distinct ids, and each looked-up element's place among them; at the
        union positions ``at``): each shard finds the positions where its ids would be admitted
        (their count passing ``access_threshold``, as ``HashCache.lookup`` decides), and the shards
        agree (``_RankExchange.agree_admissions``). -1: no limit."""
        t = cache.access_threshold
        before, seen = cache.counts(keys), np.bincount(inverse, minlength=keys.size)
        want = np.flatnonzero((cache.find(keys) == HASH_DEFAULT_ROW) & (before + seen > t))
        order = np.argsort(inverse, kind="stable")                # each id's occurrences, in order
        first = np.cumsum(seen) - seen
        events = np.sort(at[order[first[want] + np.maximum(t - before[want], 0)]])
        return self.exchange.agree_admissions(len(cache), events, self.table_rows)

    def rows(self, store, batch):
        """Every key's row, from its owner (``_RankExchange.fetch_rows``): ``batch.keys.values`` and
        ``.default`` are set and the values returned."""
        keys = batch.keys
        keys.values, keys.default = self.exchange.fetch_rows(keys.owned, store.rows_float32(keys.rows),
                                                             keys.rows == HASH_DEFAULT_ROW, keys.size)
        return keys.values

    def apply(self, store, batch, grad):
        """This rank's gradient summed per key it uses, sent to the owners (``_RankExchange.
        send_gradients``: summed over the ranks in rank order, scaled like the dense gradients);
        the owner updates its own rows, every rank updates row 0 with the sum over the keys on row
        0 (the same on every rank)."""
        keys, rank = batch.keys, self.shard[0]
        sums = self.exchange.send_gradients(keys.used, store.sum_gradients(
            batch.uniq, batch.inverse, *batch.row_gradient(grad)), keys.size)
        rows, total = np.empty(0, np.int32), np.empty((0, store.dim), np.float32)
        if sums is not None:
            held = keys.rows != HASH_DEFAULT_ROW
            rows, total = keys.rows[held], sums[keys.owned[rank][held]]
            if keys.default.any():
                rows = np.concatenate([np.array([HASH_DEFAULT_ROW], np.int32), rows])
                total = np.concatenate([sums[keys.default].sum(axis=0, keepdims=True), total])
        store.update_rows(rows, np.arange(rows.size, dtype=np.int32), np.ascontiguousarray(total))


def _reshard_states(states, rank, world, store, cache):
    """Shard ``rank`` of ``world`` (the whole table when ``world`` is 1) of the table ``states``
    hold (checked states; each id in one of them), for a table with ``store``'s optimizer and row
    width and ``cache`` (at least its capacity; its growth). Each id it owns keeps its row's values,
    optimizer slots, count and last-seen time (candidates too); its rows are numbered from 2 in
    (state, old row) order. Row 0 (the shared default row), the scalars, the step and the clock come
    from the first state (they are the same in every shard); the statistics are totals: summed over
    the states, held by rank 0. An admission sketch is the counter-wise maximum of the states'
    (each id is counted in its owner's sketch, so no count is lost; ids of other shards raise a
    shard's counts as collisions do, until the sketch ages)."""
    first, dim = states[0], store.dim
    picks = []
    for st in states:
        c = st["cache"]
        keep = _owner_of(c["keys"], world) == rank
        picks.append({key: c[key][keep] for key in ("keys", "rows", "counts", "last_seen")})
    part_of = np.concatenate([np.full(p["keys"].size, i, np.int64) for i, p in enumerate(picks)])
    merged = {key: np.concatenate([p[key] for p in picks]) for key in picks[0]}
    held = np.flatnonzero(merged["rows"] >= 0)
    held = held[np.lexsort((merged["rows"][held], part_of[held]))]
    n = held.size
    capacity = max(cache.capacity, _HASH_RESERVED_ROWS + n)
    rows = np.full(part_of.size, -1, np.int32)
    rows[held] = np.arange(_HASH_RESERVED_ROWS, _HASH_RESERVED_ROWS + n, dtype=np.int32)
    table = _host_array((capacity, dim), first["table"].dtype)
    slots = store.optimizer.new_slots(capacity, dim)
    for dst, src in [(table, first["table"])] + [(slots[name], first["slots"][name]) for name in slots]:
        dst[:_HASH_RESERVED_ROWS] = src[:_HASH_RESERVED_ROWS]
    for i, st in enumerate(states):
        sel = held[part_of[held] == i]
        old = merged["rows"][sel]
        table[rows[sel]] = st["table"][old]
        for name in slots:
            slots[name][rows[sel]] = st["slots"][name][old]
    live = _host_array(capacity, np.bool_)
    live[:_HASH_RESERVED_ROWS + n] = True
    order = np.argsort(merged["keys"], kind="stable")
    out = dict(first["cache"], keys=merged["keys"][order], rows=rows[order], counts=merged["counts"][order],
               last_seen=merged["last_seen"][order], free_rows=np.empty(0, np.int32),
               next_row=_HASH_RESERVED_ROWS + n, capacity=capacity, grow=cache.grow)
    if out["admission_counter"] == "sketch":
        out["sketch"] = np.maximum.reduce([st["cache"]["sketch"] for st in states])
        out["sketch_pending"] = max(st["cache"]["sketch_pending"] for st in states)
    for name in _HASH_STAT_NAMES:
        out[name] = sum(int(st["cache"][name]) for st in states) if rank == 0 else 0
    return dict(first, cache=out, table=table, slots=slots, live=live)


class _RowStore:
    """A hash table's rows and optimizer state on the host (``HashEmbedding.store``): the rows
    (:attr:`weight`), the optimizer's slots and scalars, the bfloat16 codec and its rounding counter
    (:attr:`rounds`), which rows hold their id's content (:attr:`live`) and the table's
    :attr:`clock` (the lookups' side of the rows), the per-batch scratch, and the seed of the
    id-keyed initial rows. The layouts read and update rows only here.

    ``config``: the table's :class:`TableConfig`, the one home of its settings (the store reads its
    name for errors, ``embedding_size`` as :attr:`dim`, ``row_dtype``: "float32", or "bfloat16":
    uint16 bits in :attr:`weight`, updated in float32 and rounded back stochastically,
    ``init_stddev``, and ``max_unique``: rows the gradient scratch is first sized for); what is the
    store's own: ``capacity`` rows (a row-wise shard's are fewer than the table's), the ``seed``
    (default the config's: a loaded state brings its own) and the :attr:`optimizer` whose slots it
    holds (the config's until a train cell's replaces it, :meth:`use_optimizer`). Not settings of a
    table but of ``HashEmbeddingLookup`` (mindspore_rec's), False here until it sets them:
    :attr:`lookup_once`, :meth:`map_ids` looks a batch's distinct ids up once each;
    :attr:`zero_default`, row 0 stays zeros with fresh slots after each update."""

    def __init__(self, config, capacity, seed=None):
        self.config, self.optimizer = config, config.optimizer
        #: the seed of the id-keyed initial rows (and of the bfloat16 rounding); a state brings its own
        self.seed = config.seed if seed is None else seed
        self.lookup_once = self.zero_default = False
        #: the rows (capacity x dim): float32, or uint16 holding bfloat16 bits (:meth:`rows_float32`)
        self.weight = self.new_rows(capacity)
        self._slots = None                  # (slots: made at their first use)
        self.scalars = {n: np.float32(v) for n, v in self.optimizer.scalar_inits}
        #: updates of bfloat16 rows so far: the stochastic rounding's counter
        self.rounds = 0
        #: updates applied so far: the table's step (a learning rate schedule's, ``_SparseOptimizer.rate``)
        self.steps = 0
        #: None before the first training lookup, then "data" or "step" (``HashEmbedding.clock``)
        self.clock = None
        # prefetch-thread state: rows whose content belongs to their current id, scratch of unique_inverse
        self.live = _host_array(capacity, np.bool_)
        self.live[:_HASH_RESERVED_ROWS] = True
        self._mark = _host_array(capacity, np.int32, -1)
        # float32 scratch kept between steps (_scratch): the per-row gradient sums
        self._acc = np.zeros((config.max_unique or 0, self.dim), np.float32)
        self._largest = None                # (largest)
        #: None, or (after :meth:`track_changes`) a bool per row: its row or slots were written since
        self.changed = None

    #: the row width (the config's ``embedding_size``)
    dim = property(lambda self: self.config.embedding_size)

    def emptied(self, capacity):
        """A new empty store like this one (its config, seed, optimizer, ``lookup_once`` and
        ``zero_default``) of ``capacity`` rows."""
        store = _RowStore(self.config, capacity, self.seed)
        if self.optimizer is not store.optimizer:
            store.use_optimizer(self.optimizer)
        store.lookup_once, store.zero_default = self.lookup_once, self.zero_default
        return store

    @property
    def capacity(self):
        """Rows held now."""
        return int(self.weight.shape[0])

    @property
    def slots(self):
        """The optimizer's slots (name -> an array of a row each), made with their initial values at
        their first use (on the training thread, as every use of the rows): a store whose state a
        checkpoint replaces first (a job restarting) never writes them, nor holds them beside the
        checkpoint's (Adagrad's and FTRL's accumulators start non-zero: written when made)."""
        if self._slots is None:
            self._slots = self.optimizer.new_slots(self.capacity, self.dim)
        return self._slots

    @slots.setter
    def slots(self, slots):
        self._slots = slots

    def use_optimizer(self, optimizer):
        """Train with ``optimizer`` from now on: fresh slots and scalars for it (an untrained table)."""
        self.optimizer = optimizer
        self._slots = None
        self.scalars = {name: np.float32(v) for name, v in optimizer.scalar_inits}
        self.steps = 0
        self._largest = self.changed = None

    def serve(self, weight):
        """Hold ``weight`` (a bundle's rows) for serving: no optimizer slots."""
        self.weight, self.slots = weight, self.optimizer.new_slots(0, self.dim)
        self._largest = self.changed = None

    def new_rows(self, n):
        """``n`` zero rows in this storage (bfloat16 zero is the uint16 0), in ``_host_array``'s memory."""
        return _host_array((n, self.dim), np.uint16 if self.config.row_dtype == "bfloat16" else np.float32)

    def rows_float32(self, rows):
        """Rows ``rows`` (int row numbers) as a new float32 array ``[len(rows), dim]``: a copy, or for
        bfloat16 storage the exact float32 values."""
        rows = np.ascontiguousarray(rows, np.int32).reshape(-1)
        if self.weight.dtype != np.uint16:
            return self.weight[rows]
        return bf16_decode(self.weight, rows, np.empty((rows.size, self.dim), np.float32))

    def grow(self, capacity):
        """Grow the rows and slots to ``capacity`` rows; new rows are zeros until an id is admitted to
        them. Returns True when it grew."""
        if capacity <= self.capacity:
            return False
        self.weight = _host_grown(self.weight, capacity)
        for name, fill in self.optimizer.slot_fills if self._slots is not None else ():    # (else made at their use)
            self.slots[name] = _host_grown(self.slots[name], capacity, fill)
        if self.changed is not None:
            self.changed = _host_grown(self.changed, capacity, True)
        self._raise_largest_by_fills()
        return True

    def track_changes(self):
        """Record from now on which rows' content (row, slots) is written (:attr:`changed`, all
        False now): an incremental checkpoint's delta holds those rows only. Every writer of rows or
        slots marks them (:meth:`grow`, :meth:`reset_rows`, :meth:`update_rows`); a load or a new
        optimizer stops the record (None), so no delta is built on rows it did not see written."""
        self.changed = _host_array(self.capacity, np.bool_)

    def check_clock(self, timestamp, now, where="HashEmbedding.prepare", what="'timestamp'"):
        """Raise ValueError (naming ``what`` of ``where``) when a training lookup at ``timestamp``
        (None: no time) would switch the :attr:`clock` (``now``: the cache's time): a table that
        keeps data time gets every lookup's time, and one that counts steps gets none, so no id is
        evicted by the wrong clock. Changes nothing."""
        if self.clock == "data" and timestamp is None:
            _fail(where, what, "a data time: hash table %r keeps data time (its last lookup was at %d), and a "
                  "lookup without one would switch its clock to the step count" % (self.config.name, now), None)
        if self.clock == "step" and timestamp is not None:
            _fail(where, what, "absent: hash table %r counts steps (its lookups so far had no time), and a data "
                  "time would switch its clock" % self.config.name, timestamp)

    def map_ids(self, cache, flat, timestamp=None, max_admit=-1):
        """``cache.lookup`` of the flat int64 ids (the layouts' lookup; ``max_admit``: see
        ``HashCache.lookup``) as a ``_Mapping`` without keys; the new rows are marked live here
        (their initial rows come in :meth:`take`). Checks the :attr:`clock` first, then sets it. With
        :attr:`lookup_once` the distinct ids are looked up once each, in first-occurrence order
        (rows are handed out as they would be)."""
        self.check_clock(timestamp, cache.now)
        if self.lookup_once:
            ids, where = _first_occurrence_unique(flat)
            m = self._map_ids(cache, ids, timestamp, max_admit)
            return _Mapping(m.rows[where], m.uniq, m.inverse[where], m.new_rows, m.new_ids, None)
        return self._map_ids(cache, flat, timestamp, max_admit)

    def _map_ids(self, cache, flat, timestamp, max_admit):
        rows = cache.lookup(flat, timestamp, max_admit)
        self.clock = "step" if timestamp is None else "data"
        if cache.eviction_policy is not None:                     # a replaced id's row starts afresh
            _, replaced = cache.take_replaced()
            self.live[replaced] = False
        if cache.capacity > self.live.shape[0]:                   # the cache may have grown
            self.live = _host_grown(self.live, cache.capacity)
            self._mark = _host_grown(self._mark, cache.capacity, -1)
        uniq, inverse = unique_inverse(rows, self._mark)
        fresh = ~self.live[uniq]
        new_rows = uniq[fresh]
        if new_rows.size:
            ids_of_uniq = np.empty(uniq.size, np.int64)
            ids_of_uniq[inverse] = flat          # an owned row has one id: any occurrence will do
            new_ids = ids_of_uniq[fresh]
            self.live[new_rows] = True
        else:
            new_ids = np.empty(0, np.int64)
        return _Mapping(rows, uniq, inverse, new_rows, new_ids, None)

    def free(self, rows):
        """Rows ``rows`` no longer hold their id's content (evicted)."""
        self.live[rows] = False

    def take(self, batch):
        """Training thread, before the step: grow to the batch's capacity and give the ids it admitted
        their initial rows (and fresh optimizer slots)."""
        self.grow(batch.capacity)
        if batch.new_rows.size:
            self.reset_rows(batch.new_rows, batch.new_ids)

    def reset_rows(self, rows, ids):
        """Set rows ``rows`` to the initial rows of ``ids`` and reset their optimizer slots."""
        fresh = np.empty((len(rows), self.dim), np.float32)
        init_rows(np.ascontiguousarray(ids, np.int64), self.seed, float(self.config.init_stddev), fresh)
        if self.weight.dtype == np.uint16:                  # bfloat16: the initial row to nearest
            bf16_encode(fresh, np.ascontiguousarray(rows, np.int32), self.weight, 0, 0, False)
        else:
            self.weight[rows] = fresh
        for name, fill in self.optimizer.slot_fills:
            self.slots[name][rows] = fill
        if self.changed is not None:
            self.changed[rows] = True
        if "weight" in self.optimizer.grows and self._largest is not None:
            _raise_largest(self._largest, _LARGEST.index("weight"), fresh, True)
        self._raise_largest_by_fills()

    def largest(self):
        """Running upper bounds of the optimizer's growing states over every row (its ``grows``):
        float32 ``[3]`` in ``_LARGEST`` order, the largest accumulator entry, ``|linear|`` and
        ``|weight|`` (0 for a state the optimizer does not have). The update kernels raise them as
        they write (``sparse_*_update``'s ``largest``), new and initial rows raise them here, and one
        pass over the rows computes them after a load or a new optimizer. Upper bounds, not maxima:
        an entry that shrinks leaves them as they were (an accumulator never shrinks)."""
        if self._largest is None:
            self._largest = np.zeros(len(_LARGEST), np.float32)
            for i, name in enumerate(self.optimizer.grows):
                if name != "weight":
                    if name in self.slots:          # (an optimizer with weight decay but no such slot: 0)
                        _raise_largest(self._largest, i, self.slots[name], name != "accum")
                    continue
                for start in range(0, self.capacity, _LARGEST_CHUNK):     # (bfloat16 rows decoded a part at a time)
                    part = np.arange(start, min(start + _LARGEST_CHUNK, self.capacity), dtype=np.int32)
                    _raise_largest(self._largest, i, self.rows_float32(part), True)
        return self._largest

    def _raise_largest_by_fills(self):
        """Rows reset to the optimizer's slot fills: :meth:`largest` raised to them."""
        if self._largest is not None:
            fills = dict(self.optimizer.slot_fills)
            for i, name in enumerate(self.optimizer.grows):
                if name in fills:
                    _raise_largest(self._largest, i, np.float32([fills[name]]), name != "accum")

    def growth_bound(self):
        """The ``_GrowthBound`` of an update of any of the rows (``_SparseOptimizer.growth_bound``)
        from :meth:`largest`, each bound raised to a power of two at least as large
        (``_power_of_two_at_least``: so the bounds change seldom, and the train cell's copy of them is
        seldom set); the weights' of bfloat16 rows also by one step of their stochastic rounding
        (2^-7 relative: the kernels see the rows before they are rounded)."""
        if not self.optimizer.grows:
            return _NO_GROWTH
        bounds = self.largest().astype(np.float64)
        if self.weight.dtype == np.uint16:
            bounds[_LARGEST.index("weight")] *= 1.0 + 2.0 ** -7
        return self.optimizer.growth_bound(_power_of_two_at_least(bounds), **self.step_given())

    def check_rate(self):
        """Before a step (before the table's ``take``): the learning rate of the table's next update read
        (a schedule's evaluated once and kept for the update) and checked (``_SparseOptimizer.rate``): one
        that cannot train (a per-step array run out; a schedule's NaN, infinite or negative rate) is a
        ValueError naming the table and the step before anything of the step changes."""
        if self.optimizer.scheduled:
            self.optimizer.rate(self.steps, self.config.name)

    def step_given(self):
        """The keywords that hand a :attr:`scheduled <_SparseOptimizer.scheduled>` optimizer the table's
        step (``{"step": steps}``); none for a constant rate (which does not read it: an optimizer written
        before schedules keeps its signature)."""
        return {"step": self.steps} if self.optimizer.scheduled else {}

    def update_rows(self, uniq, inverse, grad, offsets=None, scale=None, weights=None, argmax=None):
        """The sparse optimizer's fused step (the layouts' update): rows ``uniq`` (int32, distinct)
        get the sum of the ``grad`` rows (float32) that ``inverse`` points at them (with bags, their
        weights and arg-max, as in ``sparse_*_update``). bfloat16 rows: each touched row is stepped in
        float32 (decoded exactly) with its slots, then rounded back stochastically, in the kernel (its
        random bits ``bf16_encode``'s, a function of the seed, this store's count of updates, the row and
        the column). With :attr:`zero_default`, row 0 then goes back to zeros with fresh slots."""
        acc = self._scratch(uniq.size)
        largest = (self.largest(),) if self.optimizer.grows else ()      # (only a growing optimizer takes it)
        given = dict(self.step_given(), **_bag_keywords(weights, argmax))
        if self.weight.dtype == np.uint16:
            given.update(seed=self.seed, counter=self.rounds)
        self.optimizer.update(self.weight, self.slots, self.scalars, uniq, inverse, grad, acc, offsets, scale,
                              *largest, **given)
        if self.weight.dtype == np.uint16:
            self.rounds += 1
        self.steps += 1
        if self.changed is not None:
            self.changed[uniq] = True
            self.changed[HASH_DEFAULT_ROW] |= self.zero_default
        if self.zero_default:
            self.weight[HASH_DEFAULT_ROW] = 0
            for name, fill in self.optimizer.slot_fills:
                self.slots[name][HASH_DEFAULT_ROW] = fill

    def sum_gradients(self, uniq, inverse, grad, offsets=None, scale=None, weights=None, argmax=None):
        """The gradient summed per distinct row, as :meth:`update_rows` would sum it (``sum_by_row``):
        float32 ``[uniq.size, dim]``, a view of scratch space valid until the next call."""
        return sum_by_row(uniq, inverse, grad, self._scratch(uniq.size), offsets, scale, weights, argmax)

    def _scratch(self, rows):
        """Float32 scratch ``[rows, dim]`` for the per-row gradient sums (C order), kept between steps and
        grown by doubling. A fresh array each step cost its page faults, more than the work done in it."""
        if self._acc.shape[0] < rows:
            self._acc = np.empty((max(rows, 2 * self._acc.shape[0]), self.dim), np.float32)
        return self._acc[:rows]

    def gather(self, batch, source, out=None):
        """The batch's rows from ``source`` (this store's :attr:`weight`, or a row-wise step's keys'
        rows), per id or pooled per bag, into ``out`` when it has the total shape ``(batch.outputs,
        dim)``: one array shaped ``shape + (dim,)`` per feature (``batch.shapes``), alone when one."""
        if out is None or out.shape != (batch.outputs, self.dim):
            out = np.empty((batch.outputs, self.dim), np.float32)
        rows = batch.rows
        if source.dtype == np.uint16:          # bfloat16: the batch's distinct rows in float32, by position
            source, rows = self.rows_float32(batch.uniq), batch.inverse
        bags = batch.bags
        if bags is None:
            gather_rows(source, rows, out)
        elif bags.maximum:
            batch.argmax = np.empty((batch.outputs, self.dim), np.int64)
            gather_max(source, rows, bags.offsets, bags.weights, out, batch.argmax)
        else:
            gather_pool(source, rows, bags.offsets, bags.scale, out, bags.weights)
        if len(batch.shapes) == 1:
            return out.reshape(batch.shapes[0] + (self.dim,))
        pieces, start = [], 0
        for shape in batch.shapes:
            stop = start + int(np.prod(shape))
            pieces.append(out[start:stop].reshape(shape + (self.dim,)))
            start = stop
        return pieces

    def bytes_per_row(self, eviction_policy):
        """Host memory one row costs, in bytes, from the arrays, for a cache with ``eviction_policy``:
        a dict with ``"row"`` (the row's values in :attr:`weight`), ``"slots"`` (the optimizer's
        slots of the row: a slot of ``row_slots`` is one float32, any other one per value),
        ``"cache"`` (the compiled hash cache's entry of the id holding the row: key, last-seen time,
        count, row; with an eviction policy also the row's id, time and count for choosing victims)
        and ``"total"``, their sum. Not counted: the map's empty entries (it doubles at 0.7 full;
        from 2^22 entries on it grows no larger than a full table needs: 1/3 entry more per row,
        0.48 per id at 90% of the rows), candidates (ids tracked without a row, one entry each), the
        free-row list and the per-batch buffers."""
        row = self.weight.itemsize * self.weight.shape[1]
        slots = sum(4 * self.optimizer.slot_width(name, self.dim) for name, _ in self.optimizer.slot_fills)  # float32
        cache = _HASH_ENTRY_BYTES + (_HASH_POLICY_ROW_BYTES if eviction_policy is not None else 0)
        return {"row": int(row), "slots": int(slots), "cache": cache, "total": int(row + slots + cache)}

    def state_dict(self, copy=True):
        """The rows' part of a table state: the rows, slots, scalars and live flags, the seed, the
        clock, the rounding counter and the step. ``copy``: the arrays are copies; else read-only
        views of the store's own arrays, valid until the next step changes them (a checkpoint streams
        them to its file: no whole-table copy). The copies are in ``_host_array``'s memory: a table
        loads them in place (``load_state_dict(copy=False)``)."""
        take = _host_held if copy else _read_only
        return {"table": take(self.weight), "slots": {name: take(a) for name, a in self.slots.items()},
                "scalars": {name: np.float32(v) for name, v in self.scalars.items()}, "live": take(self.live),
                "seed": self.seed, "clock": self.clock, "rounds": self.rounds, "steps": self.steps}

    def load_state_dict(self, state, copy=True):
        """Restore the rows' part of a checked table state (:meth:`state_dict`'s fields) exactly.
        ``copy``: the store holds copies of the state's arrays; else it takes them as they are
        where their dtype and memory allow (arrays nothing else uses: a checkpoint's, just read, in
        ``_host_array``'s memory; any other is copied there, as every array of a table is)."""
        take = functools.partial(_host_held, copy=copy)
        self._mark = self._largest = self.changed = None       # (the old marks and slots go before the new are made)
        self._slots = None
        self.seed, self.clock, self.rounds = state["seed"], state["clock"], state["rounds"]
        self.steps = state.get("steps", 0)         # (earlier checkpoints of a constant rate have none)
        self.weight = self.stored_rows(state["table"], copy)
        self.slots = {name: take(a, np.float32) for name, a in state["slots"].items()}
        self.scalars = dict(state["scalars"])
        self.live = take(state["live"], np.bool_)
        self._mark = _host_array(self.live.shape[0], np.int32, -1)

    def stored_rows(self, table, copy=True):
        """``table`` (a state's rows: float32, or uint16 bfloat16 bits) in this storage: float32 rows
        to bfloat16 to nearest, bfloat16 to float32 exactly (a state loaded with ``strict=False`` into
        a table of the other ``row_dtype``); in the same storage a copy, or with ``copy=False``
        ``table`` itself when it is in ``_host_array``'s memory (``_host_held``)."""
        table = np.asarray(table)
        if table.dtype == self.new_rows(0).dtype:
            return _host_held(table, table.dtype, copy)
        if table.dtype == np.uint16:
            return bf16_decode(table, np.arange(table.shape[0], dtype=np.int32),
                               _host_array(table.shape, np.float32))
        out = self.new_rows(table.shape[0])
        return bf16_encode(np.ascontiguousarray(table, np.float32), np.arange(table.shape[0], dtype=np.int32), out,
                           0, 0, False)


def _table_state_schema(dim, sparse):
    """The schema (``_validate``) of a ``HashEmbedding.state_dict`` that a table of rows ``dim`` wide
    trained by the sparse optimizer ``sparse`` can load. Its table may lag its cache by a growth not
    yet taken: at most the cache's capacity rows."""
    optimizer = type(sparse).__name__

    def rows_rule(got):
        rows = got["cache"]["capacity"]
        return _Rule("float32 or uint16 (bfloat16) of shape (<= %d, %d)" % (rows, dim), convert=np.asarray,
                     test=lambda v: (np.asarray(v).dtype in (np.float32, np.uint16) and np.ndim(v) == 2
                                     and np.shape(v)[1] == dim and _HASH_RESERVED_ROWS < np.shape(v)[0] <= rows))

    finite = _Rule("a finite number", test=lambda v: np.shape(v) == () and np.isfinite(v), convert=np.float32)
    return _Fields({
        "embedding_size": _Rule(repr(dim), test=lambda v: v == dim),
        "optimizer": _Rule("%r, this table's optimizer (one of the sparse optimizers %s)" % (
            optimizer, _optimizer_names()), test=lambda v: v == optimizer),
        "seed": _Int(0, 2 ** 63 - 1),
        "cache": _HASH_STATE,
        "table": rows_rule,
        "slots": lambda got: _Fields({name: _array_rule(np.float32, (got["table"].shape[0],
                                                                     sparse.slot_width(name, dim)))
                                      for name, _ in sparse.slot_fills}),
        "scalars": _Fields({name: finite for name, _ in sparse.scalar_inits}),
        "live": lambda got: _array_rule(np.bool_, (got["cache"]["capacity"],)),
        "clock": _Rule("None, 'data' or 'step'", test=lambda v: v in (None, "data", "step")).optional(None),
        "rounds": _Int(0, default=0),
        "steps": _Int(0, default=0),
    }, expected="a dict made by HashEmbedding.state_dict()")


def _embedding_width(where, name, value):
    """A row width given as the Rec SDK gives ``dim``: an int >= 1, or its ``TensorShape`` form, one int in
    a list or tuple (or any object whose ``as_list()`` gives one); anything else is an error naming ``name``."""
    given = value
    if hasattr(value, "as_list") and not isinstance(value, (np.ndarray, Tensor)):
        value = value.as_list()
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            _fail(where, "'%s'" % name, "an int >= 1 or a list of one (mx_rec's TensorShape([dim]))", given)
        value = value[0]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        _fail(where, "'%s'" % name, "an int >= 1 or a list of one (mx_rec's TensorShape([dim]))", given, TypeError)
    return _check_int(where, name, value, 1)


class WeightedIds:
    """The ids of one pooled feature with a weight per id (an id-score list: TensorFlow's ``sp_weights``,
    TorchRec's weighted KeyedJaggedTensor, MindSpore's ``MultiFieldEmbeddingLookup`` ``input_values``),
    for a :class:`HashEmbedding` with a combiner: ``WeightedIds(ids, weights)`` with padded ``[B, L]``
    (or ``[B, F, L]``) ids and weights of the same shape, or ``WeightedIds(values, weights, offsets)``
    for ragged bags (bag b is ``values[offsets[b]:offsets[b+1]]``, weights one per value). A record of
    its own, so it is never taken for the ragged pair ``(values, offsets)``.

    The combiners then pool ``sum``: Σ w·e, ``mean``: Σ w·e / Σ w, ``sqrtn``: Σ w·e / √(Σ w²) (as
    TensorFlow's ``embedding_lookup_sparse``; a bag whose divisor is 0, all weights 0 or no ids, gives
    zeros), ``max``: the element-wise max of w·e over the bag's ids of nonzero weight (as
    ``MultiFieldEmbeddingLookup``: weight 0 marks padding). Weights are finite floats; "mean" takes
    them >= 0 (a sum of mixed signs could be 0 or tiny). Ids equal to the table's ``padding_id`` are
    dropped with their weights. Each id's row gets the bag's gradient times its weight (max: at the
    values it gave). Unweighted ids pool as if every weight were 1, bit for bit.

    Attributes:
        ids: int ids, padded ``[..., L]`` or ragged values (1-D).
        weights: float weights, the shape of ``ids``.
        offsets: None (padded), or the ragged bags' int offsets (bags + 1, from 0 to ``len(ids)``).
    """
    __slots__ = ("ids", "weights", "offsets")

    def __init__(self, ids, weights, offsets=None):
        self.ids, self.weights, self.offsets = ids, weights, offsets

    def __repr__(self):
        return "WeightedIds(ids=%s, weights=%s, offsets=%s)" % (
            _short_shape(self.ids), _short_shape(self.weights), _short_shape(self.offsets))


def _short_shape(value):
    """A value as a message names it: an array by its shape, anything else by its repr."""
    shape = getattr(value, "shape", None)
    return "<array of shape %s>" % (tuple(shape),) if shape is not None else repr(value)


def _id_weights(where, name, combiner, weights, shape):
    """The weights of a :class:`WeightedIds` of table ``name`` as flat float32, checked: real numbers
    of ``shape`` (the ids'), finite, and >= 0 for "mean"."""
    given = weights.asnumpy() if isinstance(weights, Tensor) else weights
    try:
        arr = np.asarray(given)
    except ValueError:
        arr = np.asarray(None)
    what = "the weights of table %r" % name
    if arr.dtype.kind not in "fiu":
        _fail(where, what, "real numbers of the ids' shape %s" % (shape,), "%s" % _short_shape(given)
              if arr.dtype.kind == "O" else "dtype %s" % arr.dtype, TypeError)
    if arr.shape != tuple(shape):
        _fail(where, what, "the ids' shape %s" % (tuple(shape),), "shape %s" % (arr.shape,))
    arr = arr.astype(np.float32).reshape(-1)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        _fail(where, what, "finite numbers", "%r at position %d" % (float(arr[bad[0]]), int(bad[0])))
    if combiner == "mean" and arr.size and arr.min() < 0:
        _fail(where, what, ">= 0 for the combiner 'mean' (sum w*e / sum w)", "%r at position %d" % (
            float(arr.min()), int(np.argmin(arr))))
    return arr


def _table_feature(where, feature, name, combiner, padding_id, item=None):
    """One feature of ``HashEmbedding.check_features`` for the table ``name`` with ``combiner`` and
    ``padding_id``: a ``_Feature``; padding ids are dropped here, before the cache sees them (with
    their weights, for :class:`WeightedIds`). ``item``: what the feature is, for the errors (or None)."""
    weights = None
    if isinstance(feature, WeightedIds):
        if combiner is None:
            _fail(where, "weighted ids (WeightedIds) of table %r" % name,
                  "a table with a combiner ('sum', 'mean', 'sqrtn' or 'max')", "combiner=None")
        weights = feature.weights
        feature = feature.ids if feature.offsets is None else (feature.ids, feature.offsets)
    ragged = isinstance(feature, tuple) and len(feature) == 2
    if ragged:
        if combiner is None:
            _fail(where, "a ragged feature (values, offsets) of table %r" % name,
                  "a table with a combiner ('sum', 'mean', 'sqrtn' or 'max')", "combiner=None")
        values, offsets = _ragged_bags(where, *feature, what="a ragged feature of table %r%s" % (
            name, "" if item is None else " (%s)" % item))
        shape, counts = (offsets.size - 1,), np.diff(offsets)
        if weights is not None:
            weights = _id_weights(where, name, combiner, weights, values.shape)
    else:
        arr = _hash_ids(where, feature)
        if combiner is not None and arr.ndim < 2:
            _fail(where, "the ids of table %r (combiner %r)" % (name, combiner),
                  "[B, L] or [B, F, L] ids padded with padding_id, or a ragged (values, offsets)",
                  "ids of shape %s" % (arr.shape,))
        values = arr.reshape(-1)
        if weights is not None:
            weights = _id_weights(where, name, combiner, weights, arr.shape)
        if combiner is None and padding_id is None:
            return _Feature(values.astype(np.int64, copy=False), None, arr.shape)
        shape = arr.shape[:-1] if combiner is not None else arr.shape
        counts = np.full(int(np.prod(shape)), arr.shape[-1] if combiner is not None else 1, np.int64)
    values = values.astype(np.int64, copy=False)
    if padding_id is not None:
        keep = values != padding_id
        if not keep.all():
            bag_of = np.repeat(np.arange(counts.size), counts)
            counts = np.bincount(bag_of[keep], minlength=counts.size).astype(np.int64)
            values = values[keep]
            weights = None if weights is None else weights[keep]
    return _Feature(values, counts, shape, weights)


def _feature_bags(parts, combiner, padding_id):
    """The ``_Bags`` of checked features ``parts`` (``_Feature``s) of a table with ``combiner`` and
    ``padding_id`` (None without bags). When some feature is weighted, the others' ids weigh 1."""
    if combiner is None and padding_id is None:
        return None
    counts = np.concatenate([p.counts for p in parts])
    offsets = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    weights = None
    if any(p.weights is not None for p in parts):
        weights = np.concatenate([np.ones(p.ids.size, np.float32) if p.weights is None else p.weights
                                  for p in parts])
    scale, weights = _bag_scale(counts, combiner, weights)
    return _Bags(offsets, scale, weights, combiner == "max")


def _bag_scale(counts, combiner, weights=None):
    """``(scale, weights)``: each bag's float32 factor, 1 ("sum", "max", no combiner), 1/n ("mean"),
    1/sqrt(n) ("sqrtn"); with per-id ``weights`` (float32, one per id of the bags in order), 1/Σw
    ("mean") and 1/√(Σw²) ("sqrtn"), the sums in float64; 0 for an empty bag or a divisor of 0. The
    weights the kernels take: as given, but for "mean" and "sqrtn" each bag's scaled by the power of
    two that brings its largest |w| into [0.5, 1), which changes no bit where float32 holds Σw, Σw²
    and their reciprocal (scaling by 2^k is exact), and keeps them in float32's range for any finite
    weights (1e20, 1e-40: the float64 reference's result, not zeros or inf)."""
    if combiner in (None, "sum", "max"):
        return np.ones(counts.size, np.float32), weights
    n = counts.astype(np.float32)                  # Σw or Σw² (float64 sums, rounded once), else the count
    if weights is not None:
        bag_of, w = np.repeat(np.arange(counts.size), counts), weights.astype(np.float64)
        largest, filled = np.zeros(counts.size), counts > 0
        if w.size:
            largest[filled] = np.maximum.reduceat(np.abs(w), (np.cumsum(counts) - counts)[filled])
        w = np.ldexp(w, -np.frexp(largest)[1][bag_of])
        weights = w.astype(np.float32)              # (exact: w times a power of two, |w| < 1; but below 2^-126)
        n = np.bincount(bag_of, w if combiner == "mean" else w * w, minlength=counts.size).astype(np.float32)
    denominator = n if combiner == "mean" else np.sqrt(n)
    scale = np.zeros(n.size, np.float32)
    np.divide(np.float32(1.0), denominator, out=scale, where=n > 0)
    return scale, weights


def _table_memory(where, config):
    """A new table's ``(cache, row store)`` of ``config``; memory the process cannot allocate is an
    OSError of errno ENOMEM naming the table, its capacity and the bytes its rows need."""
    try:
        return config.new_cache(), _RowStore(config, config.capacity)
    except (MemoryError, OSError) as exc:
        import errno  # pylint: disable=import-outside-toplevel
        if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
            raise
        width = 2 if config.row_dtype == "bfloat16" else 4
        _fail(where, "the hash table %r of capacity %d" % (config.name, config.capacity), "a table this process can "
              "allocate: its rows alone take %d bytes (%d rows of %d %s values; made at construction, and doubled "
              "as the table grows)" % (config.capacity * config.embedding_size * width, config.capacity,
                                       config.embedding_size, config.row_dtype),
              "%s: %s" % (type(exc).__name__, exc), functools.partial(OSError, errno.ENOMEM))


def _table_field(default=None, *, setting=False, older=dataclasses.MISSING, record=None, option=None, rule=None,
                 flat=None):
    """A field of :class:`TableConfig` with its metadata: ``setting`` (:meth:`TableConfig.settings` records
    it), ``older`` (what a state saved before the setting existed trained with: ``_SETTINGS_ADDED``),
    ``record`` (``(key, convert)``: how the record holds it, when not as the field's name and value),
    ``option`` (``python -m recboost``'s option: argparse keywords, ``help`` at least;
    ``_table_option``, the command line's table options) and ``rule`` (a ``_Rule``: the field's check,
    which ``TableConfig.__post_init__`` applies first and a command-line option of the field reuses;
    a field without one is checked in ``__post_init__``'s code) and ``flat`` (a sub-config's: the flat
    keyword of its choice, which names its option; its ``rule`` is that keyword's, its record its flat settings)."""
    metadata = {"setting": setting or older is not dataclasses.MISSING}
    if older is not dataclasses.MISSING:
        metadata["older"] = older
    metadata.update((key, given) for key, given in (("record", record), ("option", option), ("rule", rule),
                                                    ("flat", flat)) if given is not None)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """Every setting of a hash table, checked once: what :class:`HashEmbedding`, :func:`create_table` and
    :class:`HashEmbeddingLookup` build a table from (``HashEmbedding(config)``), what a checkpoint
    records of it (:meth:`settings`) and compares, what makes its cache (:meth:`new_cache`) and what
    ``python -m recboost``'s table options are made from. Frozen: ``dataclasses.replace(config,
    capacity=...)`` makes a changed copy (checked again). The fields are :class:`HashEmbedding`'s
    arguments of the same names (those it takes positionally in its order); not here are ``input_index`` and
    ``create_table``'s ``feature_spec`` / ``key_dtype`` (where a table's ids come from, not what it
    does with them).

    Fields (the keyword form of :class:`HashEmbedding` takes them as its arguments):
        embedding_size (int): width of a row (``dim``, keyword-only, is the same, the Rec SDK's name;
            it may be given as mx_rec's ``TensorShape([dim])``, a list of one int).
        capacity (int): rows of the table (>= 3; two are reserved).
        access_threshold, eviction_threshold (int): see ``HashCache`` (-1 disables).
        use_dynamic_expansion (bool): let the table grow when full.
        eviction: what a full table (no free row, no ``use_dynamic_expansion``) does for a new id: None
            (default: it finds no row and uses the default row), ``LRU()`` or ``LFU(half_life=3600)``: it
            replaces the least recently seen or the least frequently seen (its count halving per
            ``half_life`` of data time, or steps, unseen) id of the new id's bucket of 32 rows, never one
            of the batch; the row gets the new id's initial row and fresh slots. The table then stays at
            ``capacity``. Flat spellings (the Rec SDK's): ``eviction_policy`` (None, "lru", "lfu") and
            ``lfu_half_life``. See ``HashCache`` and docs/tables.md.
        admission: where ids below ``access_threshold`` are counted: ``Count()`` (an exact entry each,
            memory that follows the stream) or ``Sketch(width=None, depth=4, window=None)`` (a count-min
            sketch of fixed size: counters per row, default ``max(1024, 4 * capacity)``; rows; the counts
            after which every counter halves, default ``width // 2``; the table then tracks only the ids
            it holds rows for). None (default): ``Sketch()`` when the table keeps a fixed budget and
            counts before admitting (an ``eviction`` and ``access_threshold >= 1``), else ``Count()``.
            Flat spellings: ``admission_counter`` (None, "exact", "sketch") and ``sketch_width``,
            ``sketch_depth``, ``sketch_window`` (a size alone chooses the sketch). A row-wise shard has
            a sketch of these sizes for its own ids. See ``HashCache`` and docs/tables.md.
        row_dtype (str): how the rows are stored: "float32" (default) or "bfloat16" (half the
            bytes: uint16 bits in ``HashEmbedding.weight``). bfloat16 rows are updated in float32 and rounded
            back stochastically (seeded: the bits are a function of ``seed``, the table's count of
            updates, row and column, the same on both backends); initial rows round to nearest. The
            network still receives float32 rows; slots stay float32; states and checkpoints hold the
            bfloat16 rows; exported bundles hold float32 rows (exact).
        optimizer: a sparse optimizer (one of :func:`sparse_optimizers`, e.g. ``SparseFtrl(0.05)``);
            default ``SparseAdam()``.
        max_unique (int): distinct ids per batch the gradient buffer is first sized for (it grows on
            demand); default: the ids of the first batch.
        seed (int): seed of the id-keyed initial rows (mean 0, stddev ``init_stddev``).
        init_stddev (float): standard deviation of the initial rows.
        name (str): the table's name (checkpoints and errors use it).
        combiner (str): None (one row per id) or "sum", "mean", "sqrtn", "max": multi-hot features
            pooled per bag. Ids ``[B, L]`` give ``[B, dim]``, ``[B, F, L]`` give ``[B, F, dim]`` (L: the
            most values of a feature, the rest padded with ``padding_id``); a ragged feature
            ``(values, offsets)`` (a tuple; bag b is ``values[offsets[b]:offsets[b+1]]``) gives
            ``[len(offsets) - 1, dim]``. "mean"/"sqrtn" scale the sum by 1/n / 1/sqrt(n), n the
            bag's non-padding ids; "max" takes the element-wise max of the bag's rows (ties: the
            first position), its gradient going to the row each value came from; an empty bag
            pools to zeros. The gradient of a sum/mean/sqrtn bag reaches its rows inside the fused
            optimizer kernel. A feature given as :class:`WeightedIds` carries a weight per id
            (weighted sum, mean Σw·e/Σw, sqrtn Σw·e/√Σw², max of w·e; see there).
        padding_id (int): an id that is never counted, admitted, given a row or trained: it adds
            nothing to a bag (without a combiner its output row is zeros). None: no padding id.
        sharding (str): None (default), "none", "data_parallel" or "row_wise": see "Hash tables
            across processes" in docs/distributed.md. "data_parallel": every rank holds the whole table;
            each step the ranks exchange their ids (AllGather) and apply the same cache operations
            to the union (in one process's order for the concatenated batch), so caches and rows
            stay identical on every rank; the row gradients are summed across ranks (AllReduce) and
            scaled like the dense gradients before the fused update. "row_wise": rank
            ``mix64(id) % world`` owns an id and alone counts, admits, evicts, stores and updates
            it (a shard of ``2 + ceil((capacity - 2) / world)`` rows); each step the rows come
            from their owners and the gradients go back to them (AllGather). None:
            "data_parallel" when RecModel builds its step under a data-parallel context of more
            than one device, else "none" (one process).

    The flat spellings are keyword-only arguments (not fields), made the sub-configs in one place
    (``_cache_choices``) and read back as attributes (``config.eviction_policy``; None where the choice has
    no such setting). A flat setting of another choice (``lfu_half_life`` without "lfu", a sketch size
    with ``admission_counter="exact"``) or one a sub-config given beside it contradicts is a ValueError
    naming both; ``dataclasses.replace`` changes a sub-config (``replace(config, eviction=LFU(60))``).

    A bad value is a ValueError or TypeError naming the field, the expected and the given value
    ("For 'TableConfig', ..."; "For 'HashEmbedding', ..." when the keyword form builds it: ``where``).
    The defaults are resolved when made: ``optimizer`` None is ``SparseAdam()``, ``admission`` None is
    ``Count()`` or ``Sketch()`` (see above) and a sketch's sizes get their defaults.
    Equal configs (optimizers compare by class and hyper-parameters) build tables that train alike.
    """
    embedding_size: int = _table_field()
    capacity: int = _table_field(rule=_HASH_CONFIG["capacity"], option={
        "help": "hash-table rows (the table grows when full, unless --eviction-policy is given)"})
    access_threshold: int = _table_field(-1, setting=True, rule=_HASH_CONFIG["access_threshold"], option={
        "help": "an id gets a row once seen more than this many times (-1: at once)"})
    eviction_threshold: int = _table_field(-1, setting=True, rule=_HASH_CONFIG["eviction_threshold"], option={
        "help": "evict ids unseen for more than this long (-1: never)"})
    use_dynamic_expansion: bool = _table_field(False, setting=True, rule=_HASH_CONFIG["grow"])
    optimizer: "_SparseOptimizer" = _table_field(record=("optimizer_settings", lambda opt: opt.settings()),
                                                 setting=True)
    max_unique: int = _table_field()
    seed: int = _table_field(0)
    init_stddev: float = _table_field(0.01, setting=True)
    name: str = _table_field("hash_embedding")
    combiner: str = _table_field(setting=True)
    padding_id: int = _table_field(setting=True)
    sharding: str = _table_field()
    row_dtype: str = _table_field("float32", older="float32")
    # the sub-configs: recorded as their flat settings (older: what training did before them), the command
    # line's options their flat spellings (``flat``, checked by ``rule``)
    eviction: "_EvictionPolicy" = _table_field(
        older=None, flat="eviction_policy", rule=_EvictionPolicy.flat_rule, option={
            "choices": tuple(_EvictionPolicy.registry), "help": "keep the table at --capacity rows: a full table "
            "replaces its least recently (lru) or least frequently (lfu) seen id for a new one"})
    admission: "_AdmissionCounter" = _table_field(
        older=Count(), flat="admission_counter", rule=_AdmissionCounter.flat_rule, option={
            "choices": tuple(_AdmissionCounter.registry), "help": "count the ids below --access-threshold exactly "
            "(memory follows the stream) or in a count-min sketch of fixed size (4 x 4 x --capacity bytes); "
            "default: the sketch with --eviction-policy, else exact"})
    where: dataclasses.InitVar[str] = "TableConfig"

    def __post_init__(self, where):
        value = functools.partial(object.__setattr__, self)
        value("sharding", _check_one_of(where, "sharding", self.sharding, _HASH_SHARDINGS))
        value("embedding_size", _check_int(where, "embedding_size", self.embedding_size, 1))
        ruled = {f.name: f.metadata["rule"] for f in dataclasses.fields(self)
                 if "rule" in f.metadata and "flat" not in f.metadata}
        for name, checked in _validate({name: getattr(self, name) for name in ruled}, _Fields(ruled),
                                       _Checking.arguments(where)).items():       # the fields' own rules
            value(name, checked)
        eviction, admission = _cache_choices(where, {"eviction": self.eviction, "admission": self.admission})
        if admission is None:       # the default: a table in a fixed budget that counts before admitting sketches
            admission = Sketch() if eviction is not None and self.access_threshold >= 1 else Count()
        value("eviction", eviction)
        value("admission", admission.resolved(self.capacity))
        # the cache's own checks (no growth with an eviction policy: _hash_config_relations), in the table's names
        _HashCacheConfig.checked(where, {"grow": "use_dynamic_expansion"}, capacity=self.capacity,
                                 grow=self.use_dynamic_expansion, access_threshold=self.access_threshold,
                                 eviction_threshold=self.eviction_threshold,
                                 **_cache_kernel_settings(self.eviction, self.admission))
        if self.optimizer is None:
            value("optimizer", SparseAdam())
        if not isinstance(self.optimizer, _SparseOptimizer):
            _fail(where, "'optimizer'", "a " + _optimizer_names(), self.optimizer, TypeError)
        if self.max_unique is not None:
            value("max_unique", _check_int(where, "max_unique", self.max_unique, 1))
        value("seed", _check_int(where, "seed", self.seed, 0, 2 ** 63 - 1))
        value("init_stddev", _check_number(where, "init_stddev", self.init_stddev, 0))
        if not isinstance(self.name, str) or not self.name:
            _fail(where, "'name'", "a non-empty str", self.name, TypeError)
        value("combiner", _check_one_of(where, "combiner", self.combiner, _HASH_COMBINERS))
        if self.padding_id is not None:
            value("padding_id", _check_int(where, "padding_id", self.padding_id, -2 ** 63, 2 ** 63 - 1))
        value("row_dtype", _check_one_of(where, "row_dtype", self.row_dtype, _HASH_ROW_DTYPES))

    def settings(self, optimizer=None):
        """What the table is made with that changes what training does, as JSON values (the fields with
        ``setting`` metadata; the optimizer as ``optimizer_settings``, its hyper-parameters, of ``optimizer``
        when given: the table's own, when a train cell's optimizer replaced it). Every checkpoint records
        them (``HashEmbedding.settings``); a resume compares them. Not settings: the row width and the
        optimizer's kind (part of the state), ``seed`` (a state brings its own), ``capacity`` (a state loads
        into a larger one), ``sharding`` (a layout that trains as one process does), ``max_unique`` (a
        buffer's first size) and ``name``."""
        out = {}
        for field in dataclasses.fields(self):
            if field.metadata["setting"]:
                value = optimizer if field.name == "optimizer" and optimizer is not None else getattr(self, field.name)
                out.update(_recorded(field, value))
        return out

    def new_cache(self, capacity=None, grow=None):
        """A new, empty ``HashCache`` of this table's admission, eviction and growth settings: ``capacity``
        rows (default :attr:`capacity`), growing with ``grow`` (default :attr:`use_dynamic_expansion`), its
        sub-configs this config's (a row-wise shard's sketch has the table's sizes). The one way a table
        makes its cache."""
        return HashCache(self.capacity if capacity is None else capacity, self.access_threshold,
                         self.eviction_threshold, self.use_dynamic_expansion if grow is None else grow,
                         eviction=self.eviction, admission=self.admission)


def _recorded(field, value):
    """How :meth:`TableConfig.settings` records ``value`` of ``field``: ``{name: value}``, or its ``record``
    metadata's ``{key: convert(value)}``, or a sub-config's flat settings (``flat``: ``kernel_of``)."""
    if "flat" in field.metadata:
        kind = next(kind for kind in _CACHE_KINDS if kind.key == field.metadata["flat"])
        return kind.kernel_of(value)
    key, convert = field.metadata.get("record", (field.name, None))
    return {key: value if convert is None else convert(value)}


#: The flat spellings of TableConfig's sub-configs: keywords of its constructor (not fields), read back as properties
_TABLE_FLAT = tuple(name for kind in _CACHE_KINDS for name in kind.flat_names())


def _table_init(init):
    """TableConfig's constructor: the dataclass's ``init``, which takes the flat spellings (``_TABLE_FLAT``)
    too, keyword-only: ``_cache_choices`` makes them the sub-configs ``eviction`` / ``admission`` (a
    contradiction is an error naming both), before the dataclass checks the rest."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        flat = {name: kwargs.pop(name) for name in _TABLE_FLAT if name in kwargs}
        bound = signature.bind(self, *args, **kwargs)
        if flat:
            given = dict(bound.arguments, **flat)
            eviction, admission = _cache_choices(given.get("where", "TableConfig"), given)
            bound.arguments.update(eviction=eviction, admission=admission)
        init(*bound.args, **bound.kwargs)
    __init__.__signature__ = signature.replace(parameters=list(signature.parameters.values()) + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in _TABLE_FLAT])
    return __init__


TableConfig.__init__ = _table_init(TableConfig.__init__)


def _flat_spelling(name):
    """TableConfig's read-only attribute of the flat spelling ``name``: of its sub-config, the choice (the
    kind's key: ``eviction_policy``) or the field of that flat name; None where the choice has none."""
    kind = next(kind for kind in _CACHE_KINDS if name in kind.flat_names())

    def read(config):
        choice = getattr(config, kind.kind)
        if name == kind.key:
            return choice and choice.choice
        field = next((f for f in dataclasses.fields(choice) if f.metadata["flat"] == name), None) if choice else None
        return field and getattr(choice, field.name)
    return property(read, doc="The flat spelling of the config's %r (None where its choice has no %r)." % (
        kind.kind, name))


for _name in _TABLE_FLAT:
    setattr(TableConfig, _name, _flat_spelling(_name))


#: The settings a TableConfig shares with its cache (``_HashCacheConfig``'s fields), by name (``check_state_dict``).
_TABLE_CACHE_FIELDS = tuple(f.name for f in dataclasses.fields(_HashCacheConfig)
                            if f.name not in ("capacity", "grow"))
#: HashEmbedding settings newer than some saved states: what training did before them (the TableConfig
#: fields' ``older``)
_SETTINGS_ADDED = {key: value for f in dataclasses.fields(TableConfig) if "older" in f.metadata
                   for key, value in _recorded(f, f.metadata["older"]).items()}
#: HashEmbedding's positional arguments, in order (the TableConfig fields and ``input_index``)
_HASH_POSITIONAL = ("embedding_size", "capacity", "access_threshold", "eviction_threshold", "use_dynamic_expansion",
                    "optimizer", "max_unique", "input_index", "seed", "init_stddev", "name", "combiner", "padding_id",
                    "sharding")
#: TableConfig's field names and flat spellings (the keyword form's settings)
_TABLE_FIELDS = tuple(f.name for f in dataclasses.fields(TableConfig)) + _TABLE_FLAT


def _table_config(where, args, settings, input_index=None, dim=None):
    """``(TableConfig, input_index)`` of HashEmbedding's keyword form: positional ``args`` in its order
    (``_HASH_POSITIONAL``: the config's fields with ``input_index`` among them), keyword ``settings``
    (TableConfig's fields) and the Rec SDK's ``dim`` (``embedding_size``: an int, or mx_rec's
    ``TensorShape([dim])``). Errors name ``where``."""
    if len(args) > len(_HASH_POSITIONAL):
        _fail(where, "the positional arguments", "at most %d (%s)" % (len(_HASH_POSITIONAL), ", ".join(
            _HASH_POSITIONAL)), len(args), TypeError)
    given = dict(zip(_HASH_POSITIONAL, args))
    _check_no_kwargs(where, settings, _TABLE_FIELDS + ("input_index",))
    if input_index is not None:
        settings = dict(settings, input_index=input_index)
    for name in settings:
        if name in given:
            _fail(where, "'%s'" % name, "given once (positionally or by keyword)", settings[name], TypeError)
    given.update(settings)
    input_index = given.pop("input_index", None)
    if dim is not None:                    # the Rec SDK's (and create_table's) name for embedding_size
        dim = _embedding_width(where, "dim", dim)
        if given.get("embedding_size") is not None and given["embedding_size"] != dim:
            _fail(where, "'dim'", "the same as 'embedding_size' (%r) when both are given" % (given["embedding_size"],),
                  dim)
        given["embedding_size"] = dim
    return TableConfig(**given, where=where), input_index


def _config_setting(name):
    """A table's read-only attribute that is its config's field ``name`` (one home for each setting)."""
    return property(lambda self: getattr(self.config, name), doc="The config's %r (TableConfig)." % name)


def _setting_differences(settings, state):
    """``[(setting, the state's value, the table's value)]`` for each of a table's ``settings``
    (``HashEmbedding.settings``) that ``state`` (from ``HashEmbedding.state_dict``) records otherwise.
    A state of an earlier version without ``settings`` is compared on the thresholds its cache holds."""
    saved = state.get("settings")
    if not isinstance(saved, dict):
        cache = state["cache"]
        saved = {key: cache[key] for key in ("access_threshold", "eviction_threshold") if key in cache}
    saved = dict(_SETTINGS_ADDED, **saved)       # a state older than a setting trained without it
    for kind in _CACHE_KINDS:                    # ... and a choice's field recorded with another choice, unused
        saved = kind.normalized(saved)
    return [(key, saved[key], mine) for key, mine in settings.items() if key in saved and saved[key] != mine]


def _state_settings(table):
    """A table's settings as its state records them: :meth:`HashEmbedding.settings`, a scheduled learning
    rate's values at the table's step (the checkpoint's) too."""
    return dict(table.settings(), optimizer_settings=table.optimizer.settings((table.store.steps,)))


def _rate_differences(table, state, where, strict):
    """A ``table``'s settings made comparable with what ``state`` recorded of a scheduled learning rate: the
    schedule evaluated at every step the state recorded (``_RATE_STEPS`` and the checkpoint's step; a state
    of an earlier version recorded none, so its class and arguments alone are compared). ``strict``: a rate
    that differs where the class and arguments agree (else the settings' difference names them) is a
    ValueError naming the first step that differs and both rates."""
    settings, optimizer = table.settings(), table.optimizer
    saved = state.get("settings")
    saved = saved.get("optimizer_settings") if isinstance(saved, dict) else None
    saved = saved.get("learning_rate") if isinstance(saved, dict) else None
    mine = settings.get("optimizer_settings", {}).get("learning_rate")
    if not (isinstance(mine, dict) and "values" in mine):
        return settings
    if not (isinstance(saved, dict) and isinstance(saved.get("values"), dict)):
        mine = {key: value for key, value in mine.items() if key != "values"}
        return dict(settings, optimizer_settings=dict(settings["optimizer_settings"], learning_rate=mine))
    steps = sorted(int(step) for step in saved["values"] if str(step).isdigit())
    mine = optimizer.settings(steps)["learning_rate"]
    same_kind = {k: v for k, v in saved.items() if k != "values"} == {k: v for k, v in mine.items() if k != "values"}
    first = next(((step, saved["values"][str(step)], mine["values"][str(step)]) for step in steps
                  if saved["values"][str(step)] != mine["values"][str(step)]), None) if same_kind else None
    if first is not None and strict:
        _fail(where, "the learning-rate schedule of hash table %r" % table.table_name, "the one the state was trained "
              "with, whose rate at step %d is %r (first differing step; to go on with this table's, load with "
              "strict=False)" % first[:2], "%r at step %d" % (first[2], first[0]))
    return dict(settings, optimizer_settings=dict(settings["optimizer_settings"], learning_rate=mine))


class HashEmbedding(nn.Cell):
    """An embedding table addressed by raw int64 ids through a ``HashCache``, held on the host and
    trained sparsely by fused host kernels.

    Rows (``capacity`` of them, ``embedding_size`` wide; :attr:`weight`, a float32 numpy array, or
    bfloat16 bits with ``row_dtype="bfloat16"``): row 0 is the shared default row of ids that have
    no row (not yet admitted, or table full without growth), starts at zeros and is trained like
    any row; row 1 is reserved; ids own rows 2.. (see
    ``HashCache`` for admission, eviction and growth). An id's initial row is a function of ``seed``
    and the id alone (``init_rows``): the same whatever row it lands on, and again after eviction
    and re-admission. A step (``RecModel`` drives it; see the section comment):

    1. host, in stream order: ``batch = emb.prepare(ids, timestamp)`` (no row changes);
    2. host, training thread: ``emb.take(batch)``, then ``rows = emb.gather(batch)``: float32,
       ``ids.shape + (embedding_size,)``;
    3. the network gets ``rows`` where it would get the ids; ``construct`` returns them as they are,
       and the train cell returns their gradient (``row_inputs``);
    4. ``emb.apply_gradients(batch, grad)`` runs the table's sparse optimizer on the touched rows.

    ``evict(now)`` frees the rows of stale ids. With ``use_dynamic_expansion`` the rows and slots
    double when the cache grows. ``state_dict()`` / ``load_state_dict()`` save and restore cache,
    rows and slots exactly.

    ``HashEmbedding(config, input_index=None)`` makes the table of a :class:`TableConfig` (every setting
    but ``input_index``, checked once, frozen: :attr:`config`; its docstring explains each). The keyword
    form ``HashEmbedding(embedding_size, capacity, ..., **settings)``, positional in the order of
    TableConfig's fields, makes the config from its arguments (errors name "HashEmbedding").

    Args:
        config (TableConfig): every setting of the table (see :class:`TableConfig` for each field);
            or, the keyword form, the first of those settings given as arguments.
        input_index (int): position of this table's ids among the batch items (RecModel uses it; several
            tables may read one item, see :attr:`column_start`).

    A table fed by several features (``create_table(feature_spec=[...])``) maps the ids of all
    of them in one pass per batch: they share rows and admission counts.
    """

    def __init__(self, config=None, *args, input_index=None, dim=None, **settings):
        super().__init__(auto_prefix=False)
        where = "HashEmbedding"
        if not isinstance(config, TableConfig):        # the keyword form: a thin front that makes the config
            positional = (config,) + args if config is not None or args else ()
            config, input_index = _table_config(where, positional, settings, input_index, dim)
        elif args or settings or dim is not None:
            _fail(where, "the arguments beside a TableConfig", "none but input_index (the config holds every "
                  "setting: dataclasses.replace(config, ...) changes one)",
                  list(args) + sorted(settings) + (["dim"] if dim is not None else []), TypeError)
        #: the table's settings (:class:`TableConfig`), as made; the settings below are read from it
        self.config = config
        #: the ids' dtype named at creation (``create_table(key_dtype=...)``; any integer ids are taken)
        self.key_dtype = None
        #: how RecModel laid the table out ("none", "data_parallel" or "row_wise"; :attr:`sharding` as asked)
        self.resolved_sharding = config.sharding
        #: the layout strategy (:meth:`set_layout`): one process until RecModel lays the table out
        self.layout = _LOCAL_LAYOUT
        self.embedding_size = config.embedding_size       # an attribute: construct (the graph) reads it
        self.input_index = None if input_index is None else _check_int(where, "input_index", input_index, 0)
        #: the FeatureSpecs whose ids this table maps (``create_table(feature_spec=...)``), in order
        self.feature_specs = []
        #: where this table's columns begin in an input several tables read (RecModel feeds their
        #: rows side by side, in table order; :meth:`construct` takes its own columns); 0 otherwise
        self.column_start = 0
        #: the id cache, and the rows and optimizer state (``_RowStore``): what the layouts read and update
        self.cache, self.store = _table_memory(where, config)

    def set_layout(self, sharding, rank=0, world=1, exchange=None, where="HashEmbedding.set_layout"):
        """Lay the table out as ``sharding`` ("none", "data_parallel" or "row_wise"; RecModel calls it
        once, when it builds its step, with :attr:`resolved_sharding`): :attr:`layout` becomes the
        strategy that prepares, gathers, applies and restores for that layout, through ``exchange``
        (the model's rank exchange; None in one process). "row_wise" makes this (unused) table rank
        ``rank``'s shard over ``world`` ranks (``_RowWiseLayout``; :meth:`_set_shard`). A table that
        has looked up ids already is a ValueError naming ``where``."""
        _check_one_of(where, "sharding", sharding, ("none", "data_parallel", "row_wise"))
        world = _check_int(where, "world", world, 1)
        rank = _check_int(where, "rank", rank, 0, world - 1)
        if sharding == "row_wise":
            shared = self._set_shard(rank, world, where)
            self.layout = _RowWiseLayout(exchange, rank, world, shared, self.config.capacity - _HASH_RESERVED_ROWS)
        elif sharding == "data_parallel":
            self.layout = _DataParallelLayout(exchange)
        else:
            self.layout = _LOCAL_LAYOUT
        self.resolved_sharding = sharding

    def _set_shard(self, rank, world, where):
        """Make this (unused) table rank ``rank``'s shard over ``world`` ranks: a cache and a store of
        ``2 + ceil((capacity - 2) / world)`` rows. A shard grows when it needs rows; when the table
        itself does not grow (and has no eviction policy), its ``capacity`` still bounds the ids all
        shards hold together, admission by admission as in one process (the ranks agree on each
        step's admissions): returns whether it does."""
        if self.cache.step or len(self.cache):
            _fail(where, "hash table %r for row-wise sharding" % self.table_name, "a table that has not "
                  "looked up ids yet", "%d lookups" % self.cache.step)
        rows = _HASH_RESERVED_ROWS + -(-(self.config.capacity - _HASH_RESERVED_ROWS) // world)
        policy = self.config.eviction
        shared = not self.cache.grow and policy is None      # the table's capacity bounds every shard's ids
        self.cache = self.config.new_cache(rows, grow=policy is None)
        self.store = self.store.emptied(rows)
        return shared

    # ---- the config's settings, read there (TableConfig's docstring explains each) ---------------------
    sharding = _config_setting("sharding")             # as asked (None: RecModel decides): see resolved_sharding
    use_dynamic_expansion = _config_setting("use_dynamic_expansion")   # a row-wise shard's cache always grows
    max_unique, table_name = _config_setting("max_unique"), _config_setting("name")
    combiner, padding_id = _config_setting("combiner"), _config_setting("padding_id")
    row_dtype = _config_setting("row_dtype")           # "bfloat16": uint16 bits in weight; gather gives float32

    # ---- sizes and the row store's arrays --------------------------------------------------------------
    #: rows of the table (of this rank's shard, for a row-wise table)
    capacity = property(lambda self: self.store.capacity)
    # The row store's, read-only here (see _RowStore): the rows (capacity x embedding_size: float32, or
    # uint16 bfloat16 bits, which rows_float32 reads), the optimizer's row slots (name -> float32 array)
    # and table-wide scalars, the sparse optimizer and the seed of the initial rows (a loaded state
    # brings its own seed; a train cell's optimizer may replace the config's); their spread, the config's.
    # The arrays are views that cannot be written through (the store bounds what it writes: _RowStore.largest).
    weight = property(lambda self: _read_only(self.store.weight))
    slots = property(lambda self: types.MappingProxyType({name: _read_only(a) for name, a in self.store.slots.items()}))
    scalars = property(lambda self: self.store.scalars)
    optimizer = property(lambda self: self.store.optimizer)
    seed = property(lambda self: self.store.seed)
    init_stddev = property(lambda self: self.config.init_stddev)

    @property
    def shard(self):
        """``(rank, world)``: this process's shard of a row-wise table (it owns the ids with ``mix64(id) %
        world == rank``); ``(0, 1)`` otherwise (the layout's)."""
        return self.layout.shard or (0, 1)

    #: host memory one row of this table costs, in bytes, from its arrays: a dict
    #: (``_RowStore.bytes_per_row``; docs/tables.md has the figures per optimizer)
    bytes_per_row = property(lambda self: self.store.bytes_per_row(self.cache.eviction_policy))
    #: rows of the whole table as made (``capacity`` of the constructor): a row-wise shard holds about
    #: ``1 / world`` of them, and when the table does not grow they bound the ids of all shards together
    table_capacity = property(lambda self: self.config.capacity)

    def rows_float32(self, rows):
        """Rows ``rows`` (int row numbers) of :attr:`weight` as a new float32 array ``[len(rows),
        embedding_size]``: a copy, or for bfloat16 storage the exact float32 values."""
        return self.store.rows_float32(rows)

    # ---- the step -------------------------------------------------------------------------------------
    def prepare(self, ids, timestamp=None, is_train=True):
        """Host side of a step, in stream order: a batch record for :meth:`take`, :meth:`gather` and
        :meth:`apply_gradients`. With ``is_train`` the ids go through ``cache.lookup`` (counts,
        admission, growth); otherwise through ``cache.find`` (no state changes). Rows are not touched.
        ``ids``: int ids of any shape; with a combiner ``[..., L]``, ragged ``(values, offsets)`` or WeightedIds."""
        return self.prepare_features([ids], timestamp, is_train)

    def prepare_features(self, features, timestamp=None, is_train=True, positions=()):
        """:meth:`prepare` for several features of this table at once (a list, each like ``ids`` of
        :meth:`prepare`): their ids are mapped and grouped together, in one pass, so features
        sharing the table share rows and admission counts. :meth:`gather` then returns one array
        per feature and :meth:`apply_gradients` takes one gradient per feature."""
        return self.prepare_step(self.check_features(features), timestamp, is_train, positions)

    def check_features(self, features, where="HashEmbedding.prepare", items=None):
        """Check and convert features (see :meth:`prepare_features`) without changing anything: a
        ``_Feature`` each (:func:`_table_feature`). Raises naming the problem, the table and, with
        ``items`` (what each feature is: e.g. "batch item 2 'history'"), the feature."""
        return [_table_feature(where, feature, self.table_name, self.combiner, self.padding_id,
                               None if items is None else items[k]) for k, feature in enumerate(features)]

    def prepare_step(self, parts, timestamp=None, is_train=True, positions=(), shared=None):
        """:meth:`prepare_features` on features ``parts`` from :meth:`check_features` (RecModel's call,
        once per table and step). ``positions``: the features' places among the step's inputs.
        ``shared``: None (a local lookup, whatever the layout), or the ``_SharedIds`` every rank gave
        this step (``_RankExchange.share_ids``; ``timestamp`` then the step's shared time), mapped by
        this table's :attr:`layout` (the union for a data-parallel table, the owned ids for a
        row-wise shard)."""
        layout = _LOCAL_LAYOUT if shared is None else self.layout
        bags = _feature_bags(parts, self.combiner, self.padding_id)
        m = layout.prepare(self.store, self.cache, parts, timestamp, is_train, shared)
        return _TableBatch(m, self.cache.capacity, bags, [p.shape for p in parts], positions, layout)

    def exchanges_ids(self, training=True):
        """Whether a step of this table shares its ids across ranks (its :attr:`layout`: a row-wise
        table's steps always do; a data-parallel table's training steps do)."""
        return self.layout.exchanges(training)

    @property
    def clock(self):
        """What this table's time is: None before its first training lookup, then "data" (its lookups
        carry a timestamp: eviction counts data time) or "step" (they do not: it counts lookups). A
        table keeps its clock (checkpoints too): a lookup that would switch it is refused
        (``_RowStore.check_clock``)."""
        return self.store.clock

    def take(self, batch):
        """Training thread, before the step: grow to the batch's capacity and give the ids it admitted
        their initial rows (and fresh optimizer slots): ``_RowStore.take``."""
        self.store.take(batch)

    def gather(self, batch, out=None):
        """The batch's rows, float32: ``ids.shape + (embedding_size,)`` per id, or per bag with a
        combiner (into ``out`` if given, of the total shape ``(batch.outputs, embedding_size)``).
        One array for a batch of :meth:`prepare`, a list (one per feature) for
        :meth:`prepare_features` of several."""
        return self.store.gather(batch, batch.layout.rows(self.store, batch), out)

    def apply_gradients(self, batch, grad):
        """The sparse optimizer step on the rows of ``batch`` with ``grad``, the gradient of what
        :meth:`gather` returned (same shapes: an array, or a list with one per feature; Tensors or
        arrays). With a combiner each bag's gradient reaches its rows: ``_TableBatch.row_gradient``."""
        grad = batch.gradient(grad, self.embedding_size, "HashEmbedding.apply_gradients")
        batch.layout.apply(self.store, batch, grad)

    def growth_bound(self):
        """Before a step (after its :meth:`take`): ``(M, L, W, q, lr, D, add)``, what the step's overflow
        check needs to prove that the update keeps the table's optimizer slots finite: bounds over
        every row (``_RowStore.growth_bound``; ``_NO_GROWTH`` for slots that do not grow)."""
        return self.store.growth_bound()

    def construct(self, rows):
        """The ready rows (the host gathered them): returned as they are, or, when the input holds
        the rows of several tables side by side (tables reading one batch item), this table's
        ``embedding_size`` columns from :attr:`column_start` on."""
        if rows.shape[-1] != self.embedding_size:
            return rows[..., self.column_start:self.column_start + self.embedding_size]
        return rows

    # ---- eviction -----------------------------------------------------------------------------------
    def evict(self, now=None):
        """Evict stale ids (``HashCache.evict``) and free their rows. Returns the freed ids (int64)."""
        ids, rows = self.cache.evict(now)
        self.store.free(rows)
        return ids

    # ---- checkpoint ---------------------------------------------------------------------------------
    def settings(self):
        """What this table is made with that changes what training does, as JSON values: its
        :meth:`TableConfig.settings` (the thresholds, eviction policy, admission counter, growth,
        combiner, padding id, initial rows' spread, row storage and the sparse optimizer's
        hyper-parameters, of :attr:`optimizer`). :meth:`state_dict` (and so every checkpoint) records
        them; :meth:`check_state_dict` compares them, setting by setting. The row width and the
        optimizer's kind are part of the state itself; ``seed``, ``capacity`` and ``sharding`` are not
        settings (see :meth:`TableConfig.settings`)."""
        return self.config.settings(self.optimizer)

    def state_dict(self, copy=True, entries=True):
        """Cache, rows, optimizer slots and scalars from one point (call it between steps), with :meth:`settings` and
        :attr:`clock`; ``copy=False``: read-only views until the next step; ``entries=False``: no cache entries."""
        state = dict(self.store.state_dict(copy), cache=self.cache.state_dict(entries), settings=_state_settings(self))
        return dict(state, embedding_size=self.embedding_size, optimizer=type(self.optimizer).__name__)

    def check_state_dict(self, state, where="HashEmbedding.load_state_dict", strict=True):
        """Validate ``state`` (from :meth:`state_dict`) against this table; returns it with arrays of
        the right dtypes. Raises ValueError/TypeError naming the field; changes nothing.

        ``strict``: a state whose :meth:`settings` differ from this table's is refused (ValueError
        naming the setting and both values). With ``strict=False`` it is accepted, each difference
        is logged, and training goes on with this table's settings (its thresholds and growth replace
        the state's; its combiner, padding id and optimizer apply from the next step; another
        admission counter: the state's candidates go into this table's sketch, or a sketch's counts
        are dropped, ``_hash_state_readmit``)."""
        got = _validate(state, _table_state_schema(self.embedding_size, self.optimizer), _Checking.state(where),
                        "state")
        cache = got["cache"]
        for key, saved, mine in _setting_differences(_rate_differences(self, state, where, strict), dict(state, cache=cache)):
            if strict:
                _fail(where, "the setting %r of hash table %r" % (key, self.table_name), "%r as the state was "
                      "trained with (to go on with this table's, load with strict=False)" % (saved,), mine)
            _log("%s: hash table %r goes on with %s=%r (the state was trained with %r; strict=False)"
                 % (where, self.table_name, key, mine, saved))
        admission = _AdmissionCounter.kernel_of(self.cache.admission)   # the cache's other settings: the table's
        cache.update(grow=self.cache.grow, **{name: getattr(self.cache, name) for name in _TABLE_CACHE_FIELDS
                                              if name not in admission})
        if any(cache[key] != (value or 0) for key, value in admission.items()):
            if cache["admission_counter"] == "sketch":
                _log("%s: hash table %r drops the state's admission sketch (the counts of ids without a row; "
                     "strict=False)" % (where, self.table_name))
            got["cache"] = cache = _hash_state_readmit(cache, admission)
        return dict(state, **got, settings=self.settings())

    def restore_states(self, states):
        """The state to load (:meth:`load_state_dict`) from checked ``states`` (:meth:`check_state_dict`)
        that together hold each id once: one whole table, or the shards of a row-wise checkpoint in
        rank order, laid out for this table's :attr:`layout` (the same layout as it is; any other
        re-laid out by :meth:`reshard_states`)."""
        return self.layout.restore(states, self.store, self.cache)

    def reshard_states(self, states, rank, world):
        """Shard ``rank`` of ``world`` (the whole table when ``world`` is 1) of the table checked
        ``states`` hold, for this table (:func:`_reshard_states`, beside the row-wise layout)."""
        return _reshard_states(states, rank, world, self.store, self.cache)

    def load_state_dict(self, state, strict=True, copy=True):
        """Restore ``state`` exactly, seed and clock included (checked by :meth:`check_state_dict`, ``strict``: a bad
        state changes nothing); ``copy=False``: it takes the state's arrays and reloads its cache in place (less memory)."""
        state = self.check_state_dict(state, strict=strict)
        cache = self.config.new_cache(self.cache.capacity, self.cache.grow) if copy else self.cache
        cache.load_state_dict(state["cache"])
        self.cache = cache
        self.store.load_state_dict(state, copy)


class HashEmbeddingLookup(HashEmbedding):
    """mindspore_rec's ``HashEmbeddingLookup`` (mindspore-lab/mindrec, ``mindspore_rec/ops/embedding.py``) on a
    recboost host table: ``HashEmbeddingLookup(embedding_size, key_dtype=mindspore.int32, param_init='normal',
    sparse=True, max_norm=None, permit_filter_value=1, evict_filter_value=sys.maxsize, vocab_cache_size=0)``,
    its arguments in its order with its defaults and meanings:

    - ``key_dtype``: int32 or int64 (recorded as :attr:`key_dtype`; any integer ids are hashed as int64).
    - ``param_init``: an id's initial row: 'normal' (MindSpore's ``Normal()``: mean 0, stddev 0.01, the
      default ``init_stddev``), ``Normal(sigma)`` with mean 0, or 'zeros' / ``Zero()`` / 0. The rows are
      seeded per id (``seed``), so other initializers are refused by name.
    - ``sparse``: True (mindspore_rec's default) looks the batch's distinct ids up once, so an id is counted
      once per batch; False looks every occurrence up, each counted. Gradients are sparse either way.
    - ``max_norm``: None, or the largest L2 norm of an output row: each looked-up row is scaled by
      ``max_norm / max(norm, max_norm)`` in the network (``ClipByNorm``'s formula over the embedding axis,
      as ``nn.EmbeddingLookup`` applies it); the gradient flows through the clip.
    - ``permit_filter_value``: admission, in lookups: an id gets its row at its ``permit_filter_value``-th
      lookup (values <= 1: at its first; MindSpore's GPU hash table admits an id when its lookup count
      reaches the value). Until then it reads zeros and trains nothing (the default row 0, which this
      class keeps at zeros), as in MindSpore's table.
    - ``evict_filter_value``: eviction, in steps: an id not looked up in training for more than this many
      steps is evicted when the table evicts (an ``EvictHook`` or :meth:`evict`); ``sys.maxsize`` or more
      never (MindSpore counts the table's updates, one per training step, and evicts an id whose last
      update is more than the value behind).
    - ``vocab_cache_size``: 0 only. mindspore_rec takes a larger value only in parameter-server training
      (an embedding cache in device memory) and refuses it otherwise; a recboost table is always held on
      the host, so there is nothing to cache.

    The table starts with 100000 rows for ids (MindSpore's first hash-table block; ``capacity``, keyword,
    sets the rows) and grows as they fill (``use_dynamic_expansion`` defaults to True, unless an
    ``eviction`` policy keeps the table at its size), as mindspore_rec's table does.
    :attr:`embedding_table` is an empty float32 Tensor ``(0, embedding_size)``: mindspore_rec's networks
    return it from ``construct`` (its Wide&Deep adds an L2 term of it only in dense mode); the rows are
    :attr:`weight`, on the host. Keyword-only beyond mindspore_rec's: ``capacity``, ``param_dtype``
    (float32 or bfloat16 row storage, ``row_dtype``) and every keyword of :class:`HashEmbedding` but
    ``embedding_size``, ``access_threshold`` and ``eviction_threshold`` (those are the filter values
    here). ``input_index`` defaults to 0: mindspore_rec's networks take the ids as their first input
    (``construct(id_hldr, wt_hldr)``); give it when the ids come elsewhere."""

    def __init__(self, embedding_size, key_dtype=mstype.int32, param_init="normal", sparse=True, max_norm=None,
                 permit_filter_value=1, evict_filter_value=sys.maxsize, vocab_cache_size=0, *, capacity=None,
                 param_dtype=mstype.float32, **kwargs):
        where = "HashEmbeddingLookup"
        for key, instead in (("access_threshold", "permit_filter_value"), ("eviction_threshold", "evict_filter_value")):
            if key in kwargs:
                _fail(where, "keyword %r" % key, "not given: mindspore_rec's name for it is %r (see the "
                      "HashEmbeddingLookup docs for its unit)" % instead, kwargs[key], TypeError)
        _check_no_kwargs(where, kwargs, _HASH_LOOKUP_KEYWORDS)
        _check_one_of(where, "key_dtype", key_dtype, (mstype.int32, mstype.int64))
        sparse = _check_bool(where, "sparse", sparse)
        if max_norm is not None:
            max_norm = float(_check_number(where, "max_norm", max_norm, 0, strict_min=True))
        permit = _check_int(where, "permit_filter_value", permit_filter_value, 0, 2 ** 63 - 1)
        evict = _check_int(where, "evict_filter_value", evict_filter_value, 0)
        if _check_int(where, "vocab_cache_size", vocab_cache_size, 0):
            _fail(where, "'vocab_cache_size'", "0 (mindspore_rec takes a larger value only in parameter-server "
                  "training, for a device cache of the table; a recboost table is held on the host)",
                  vocab_cache_size)
        _check_one_of(where, "param_dtype", param_dtype, (mstype.float32, mstype.bfloat16))
        row_dtype = "bfloat16" if param_dtype == mstype.bfloat16 else "float32"
        if kwargs.setdefault("row_dtype", row_dtype) != row_dtype:
            _fail(where, "'row_dtype'", "%r as 'param_dtype' (%s) says, or not given" % (row_dtype, param_dtype),
                  kwargs["row_dtype"])
        if not (isinstance(param_init, str) and param_init == "normal"):
            if "init_stddev" in kwargs:
                _fail(where, "'init_stddev'", "not given with param_init=%r (it sets the rows' spread)" % (
                    param_init,), kwargs["init_stddev"])
            kwargs["init_stddev"] = _initializer_stddev(where, param_init, "param_init")
        if capacity is None:
            capacity = _HASH_RESERVED_ROWS + _MS_HASH_TABLE_BLOCK
        kwargs.setdefault("use_dynamic_expansion", _cache_choices(where, kwargs)[0] is None)   # no eviction policy
        kwargs.setdefault("input_index", 0)
        kwargs.setdefault("name", "hash_embedding_lookup")
        config, input_index = _table_config(where, (embedding_size, capacity, permit - 1 if permit > 1 else -1,
                                                    -1 if evict >= sys.maxsize else evict), kwargs)
        super().__init__(config, input_index=input_index)
        self.key_dtype = key_dtype
        #: mindspore_rec's ``sparse``: True counts an id once per batch, False once per occurrence
        self.sparse = sparse
        self.store.zero_default = True                   # row 0 stays zeros: ids not yet permitted train nothing
        #: mindspore_rec's ``max_norm``: None, or the largest L2 norm of an output row (clipped in the network)
        self.max_norm = max_norm
        self.permit_filter_value, self.evict_filter_value = permit, evict
        self._max_norm = None if max_norm is None else Tensor(max_norm, mstype.float32)
        self._clip = None if max_norm is None else _ClipRows()
        #: the stand-in of mindspore_rec's table parameter (zeros, ``(1, embedding_size)``): the rows are
        #: :attr:`weight`, on the host. A train cell that puts it in one of its optimizers (mindrec's
        #: ``TrainStepWrap`` splits ``trainable_params()`` by name) has the rows trained as that optimizer
        #: would train them: see :class:`RecModel` (``optimizer=None``). It stays zeros.
        self.embedding_table = Parameter(Tensor(np.zeros((1, self.embedding_size), np.float32)),
                                         name="embedding_table")
        #: set by RecModel for a complete train cell: training steps add ``embedding_table``'s rows (zeros)
        #: to the ready rows, so the cell's gradient of it is the rows' gradient (see ``_CellRows``)
        self.rows_stand_in = False

    @property
    def sparse(self):
        """mindspore_rec's ``sparse``: True looks a batch's distinct ids up once each (in first-occurrence
        order, so rows are handed out as they would be), as mindspore_rec's sparse mode looks up the
        unique ids: an id's count and admission advance once per batch (the row store's
        ``lookup_once``)."""
        return self.store.lookup_once

    @sparse.setter
    def sparse(self, value):
        self.store.lookup_once = value

    def construct(self, rows):
        """The ready rows (see :meth:`HashEmbedding.construct`), each clipped to ``max_norm`` when it is set.
        With :attr:`rows_stand_in` (a complete train cell, in training) the rows of :attr:`embedding_table`
        (zeros, one per position) are added first: the value is the same, and the gradient of
        ``embedding_table`` is the rows' gradient, position by position. (Its first rows, sliced and
        reshaped: a ``gather`` of them by ``arange`` positions fails to compile in a cell that writes its
        sens as mindrec's ``TrainStepWrap`` does, ``ops.Fill()(ops.DType()(loss), ops.Shape()(loss), sens)``:
        MindSpore 2.10's "Illegal AnfNode for evaluating" on the stand-in.)"""
        out = super().construct(rows)
        if self.rows_stand_in and self.training:
            positions = 1
            for size in out.shape[:-1]:
                positions = positions * size
            out = out + self.embedding_table[:positions].reshape(out.shape)
        if self.max_norm is not None:
            out = self._clip(out, self._max_norm)
        return out

    def settings(self):
        """:meth:`HashEmbedding.settings` and mindspore_rec's ``sparse`` and ``max_norm``."""
        return dict(super().settings(), sparse=self.sparse, max_norm=self.max_norm)


class _ClipRows(nn.Cell):
    """Each row (the last axis) of ``x`` clipped to L2 norm ``clip_norm``: ``x * (clip_norm / max(||x||,
    clip_norm))``, MindSpore's ``ClipByNorm`` over the embedding axis as ``nn.EmbeddingLookup(max_norm=...)``
    applies it, and its gradient as MindSpore's bprop of ``ClipByNorm`` builds it (:meth:`bprop`). (MindSpore
    2.10's CPU ``ClipByNorm`` kernel takes row i's norm from the elements i .. i+dim-1 of the flattened
    input instead of row i's own, so it agrees with this, bit for bit, only for rows one wide:
    docs/coming-from-mindspore.md.)"""

    def __init__(self):
        super().__init__()
        self.square, self.sqrt, self.maximum = ops.Square(), ops.Sqrt(), ops.Maximum()
        self.reduce_sum = ops.ReduceSum(keep_dims=True)

    def norm_bound(self, x, clip_norm):
        """``max(||row||, clip_norm)`` per row, shape ``x.shape[:-1] + (1,)``."""
        return self.maximum(self.sqrt(self.reduce_sum(self.square(x), -1)), clip_norm)

    def construct(self, x, clip_norm):
        return x * (clip_norm / self.norm_bound(x, clip_norm))

    def bprop(self, x, clip_norm, out, dout):
        """MindSpore's gradient of ``ClipByNorm`` (its bprop builder), term for term: through ``x *
        clip_norm`` and through the norm (none for a zero row, whose norm has no gradient: MindSpore's
        builder divides 0 by 0 there); ``clip_norm`` (a constant) gets zeros."""
        norm = self.sqrt(self.reduce_sum(self.square(x), -1))
        bound = self.maximum(norm, clip_norm)
        d_scaled = dout / bound
        d_bound = self.reduce_sum(-(d_scaled * out), -1)
        d_norm = ops.select(norm >= clip_norm, d_bound, ops.zeros_like(d_bound))
        positive = norm > 0          # a zero row (the default row starts so) has no gradient through its norm
        d_sum = ops.select(positive, d_norm * 0.5 / ops.select(positive, norm, ops.ones_like(norm)), d_norm)
        return clip_norm * d_scaled + 2.0 * (d_sum * x), ops.zeros_like(clip_norm)


#: the rows of MindSpore's GPU hash table's first block (``kInitialCapacity``): HashEmbeddingLookup's default
_MS_HASH_TABLE_BLOCK = 100000
#: HashEmbedding's keywords HashEmbeddingLookup takes besides mindspore_rec's arguments
_HASH_LOOKUP_KEYWORDS = ("input_index",) + tuple(name for name in _TABLE_FIELDS if name not in (
    "embedding_size", "capacity", "access_threshold", "eviction_threshold"))


def _hash_tables(network):
    """Every HashEmbedding inside ``network`` (a Cell), in cells_and_names order."""
    return [cell for _, cell in network.cells_and_names() if isinstance(cell, HashEmbedding)]


def _table_keys(tables):
    """One distinct, readable key per table of ``tables`` (in order): its ``table_name``, and for the
    second and later tables of a name already taken, the name with ``#2``, ``#3``, ... (two default-named
    tables, e.g. mindrec's two ``HashEmbeddingLookup(embedding_size=...)``, are ``hash_embedding_lookup``
    and ``hash_embedding_lookup#2``). What keys a table's entry in a per-table record (an EvictHook's
    schedule, the ranks' configuration)."""
    keys, taken = [], set()
    for table in tables:
        key, k = table.table_name, 1
        while key in taken:
            k += 1
            key = "%s#%d" % (table.table_name, k)
        taken.add(key)
        keys.append(key)
    return keys


class FeatureSpec:
    """One sparse feature, as in the Rec SDK (mx_rec's ``FeatureSpec(name, table_name=None, index_key=None,
    access_threshold=None, eviction_threshold=None, is_timestamp=None, batch_size=None,
    faae_coefficient=1)``, in its positional order): its name, the table it looks up and that table's
    admission/eviction thresholds.

    ``table_name`` defaults to ``name``. ``index_key`` (default ``name``) is the feature's key in a dict
    batch and the name of the network's ``construct`` parameter that receives its rows (see
    :class:`RecModel`); mx_rec's int form (a position) is refused: features are matched by name here.
    ``access_threshold`` and ``eviction_threshold``: None (mx_rec's default) or -1 is off; otherwise
    mx_rec's rules (its ``FeatureAdmitAndEvict``): an id is admitted once its count reaches
    ``access_threshold`` (``count >= access_threshold``; 0 admits at once) and evicted when its last
    sighting is ``eviction_threshold`` or more behind the table's time (``now - last >=
    eviction_threshold``, >= 1). They are recorded as given (-1 for off); :attr:`table_settings` is what
    they make of the table: the :class:`TableConfig` fields of the same names in the table's rules
    (``HashCache``: ``count > t``, ``now - last > t``), one less, which :func:`create_table` builds the
    table with. Their ranges are the table's, one higher. A spec with ``is_timestamp=True`` names no table: it
    marks the column that carries the batch's data timestamp (``index_key``, "timestamp" by default) for
    the tables it is given to (``create_table(feature_spec=[...])``); None is False. ``batch_size`` is
    recorded (the Rec SDK's static batch size; batches here may vary). ``faae_coefficient`` (mx_rec's
    admission coefficient: each sighting adds it to an id's count): 1, or any value when the spec admits
    without counting (``access_threshold`` off); counting in steps of more than 1 is refused by name."""

    def __init__(self, name, table_name=None, index_key=None, access_threshold=None, eviction_threshold=None,
                 is_timestamp=None, batch_size=None, faae_coefficient=1, **kwargs):
        where = "FeatureSpec"
        _check_no_kwargs(where, kwargs, _FEATURE_SPEC_ARGS)
        if not isinstance(name, str) or not name:
            _fail(where, "'name'", "a non-empty str", name, TypeError)
        self.name = name
        self.is_timestamp = False if is_timestamp is None else _check_bool(where, "is_timestamp", is_timestamp)
        if self.is_timestamp and table_name is not None:
            _fail(where, "'table_name'", "None for a timestamp spec (is_timestamp=True)", table_name)
        if table_name is not None and (not isinstance(table_name, str) or not table_name):
            _fail(where, "'table_name'", "None or a non-empty str", table_name, TypeError)
        self.table_name = None if self.is_timestamp else (name if table_name is None else table_name)
        if index_key is not None and (not isinstance(index_key, str) or not index_key):
            _fail(where, "'index_key'", "None or a non-empty str (a feature reaches the network by name: the "
                  "construct parameter or dict key it feeds; mx_rec's int position is not taken)", index_key,
                  TypeError)
        self.index_key = index_key if index_key is not None else ("timestamp" if self.is_timestamp else name)
        for setting, value in _mx_rec_checked(where, access_threshold=access_threshold,
                                              eviction_threshold=eviction_threshold).items():
            setattr(self, setting, value)
        self.batch_size = None if batch_size is None else _check_int(where, "batch_size", batch_size, 1)
        self.faae_coefficient = _check_int(where, "faae_coefficient", faae_coefficient, 1)
        if self.faae_coefficient != 1 and self.access_threshold >= 1:
            _fail(where, "'faae_coefficient'", "1 with an access_threshold (a sighting adds 1 to an id's count "
                  "here; mx_rec's coefficient would add %d: scale access_threshold instead)" % self.faae_coefficient,
                  self.faae_coefficient)

    @property
    def table_settings(self):
        """The :class:`TableConfig` fields this spec sets, in the table's rules: ``{"access_threshold": ...,
        "eviction_threshold": ...}``, each mx_rec's one less (-1 off; 0 admits at once: -1)."""
        return _mx_rec_table_fields({setting: getattr(self, setting) for setting in _MX_REC_TABLE_SETTINGS})

    def __repr__(self):
        return "FeatureSpec(%s)" % ", ".join("%s=%r" % kv for kv in vars(self).items())


#: The table-level settings of a FeatureSpec (and create_table's arguments of these names), in mx_rec's
#: rules: each is the TableConfig field of its name (and HashCache rule, ``_HASH_CONFIG``), held one less
_MX_REC_TABLE_SETTINGS = ("access_threshold", "eviction_threshold")


def _mx_rec_checked(where, **given):
    """mx_rec's table-level settings ``given`` (``_MX_REC_TABLE_SETTINGS``: None or -1 off) as recorded:
    -1, or an int in the range of the table's rule of its name one higher (the table holds it one less).
    mx_rec's eviction_threshold 0 (evict every id, however recent) has no table form: a ValueError naming it."""
    out = {}
    for setting in _MX_REC_TABLE_SETTINGS:
        rule, value = _HASH_CONFIG[setting], given.get(setting)
        out[setting] = -1 if value is None else _check_int(where, setting, value, rule.minimum, rule.maximum + 1)
    if out["eviction_threshold"] == 0:
        _fail(where, "'eviction_threshold'", "-1 or None (off) or an int >= 1 (mx_rec evicts an id when now - "
              "last >= eviction_threshold; 0 would evict every id, the ones just seen too)", 0)
    return out


def _mx_rec_table_fields(settings):
    """The TableConfig fields of mx_rec's checked ``settings`` (``_mx_rec_checked``): mx_rec admits an id when
    ``count >= access_threshold`` and evicts it when ``now - last >= eviction_threshold`` (its
    ``FeatureAdmitAndEvict``); the table admits when ``count > t`` and evicts when ``now - last > t``, so
    each is one less (an access_threshold of 0 admits every id at once, as the table does with -1)."""
    return {setting: value - 1 if value >= 1 else -1 for setting, value in settings.items()}


#: FeatureSpec's arguments after ``name``, mx_rec's order
_FEATURE_SPEC_ARGS = ("table_name", "index_key", "access_threshold", "eviction_threshold", "is_timestamp",
                      "batch_size", "faae_coefficient")


def create_table(name=None, dim=None, capacity=None, emb_initializer=None, *, access_threshold=-1,
                 eviction_threshold=-1, feature_spec=None, embedding_size=None, key_dtype=None,
                 device_vocabulary_size=None, host_vocabulary_size=None, padding_keys=None, **settings):
    """A ``HashEmbedding`` named ``name`` (the Rec SDK's ``create_table``).

    ``feature_spec``: a FeatureSpec or a list of them: the features whose ids the table maps (each
    must name this table; several features share its rows and counts) and at most one timestamp
    spec (its column times this table's ids). The thresholds come from the specs, which must agree
    (an explicit different threshold is an error). ``access_threshold`` and ``eviction_threshold``, given
    here or by the specs, are mx_rec's (``count >= access_threshold`` admits, ``now - last >=
    eviction_threshold`` evicts; -1 off), as :class:`FeatureSpec` documents; the table holds them one
    less, in its own rules (``table.cache.access_threshold``). :class:`RecModel` feeds a table with specs from
    dict batches by feature name, without ``input_index``. ``eviction`` (or ``eviction_policy``, ``lfu_half_life``)
    is the table's (``HashEmbedding``): what a full table does for a new id; ``admission`` (or ``admission_counter``,
    the ``sketch_*`` sizes) too: where it counts the ids it holds no row for (all its features' ids in one
    counter); so is ``row_dtype`` ("float32" or "bfloat16": how the rows are stored). Every
    other keyword of ``settings`` is a :class:`TableConfig` field (``optimizer``, ``use_dynamic_expansion``,
    ``max_unique``, ``seed``, ``init_stddev``, ``combiner``, ``padding_id``, ``sharding``, ...): the table is
    ``HashEmbedding(config)``, its :attr:`HashEmbedding.config` made here (errors name ``create_table``).

    The Rec SDK's (mx_rec's) keyword names are accepted where they mean something here:
    ``embedding_size`` (HashEmbedding's name for ``dim``), ``key_dtype`` (an int32 or int64 MindSpore
    or numpy dtype: any integer ids are taken; recorded as :attr:`HashEmbedding.key_dtype`),
    ``emb_initializer`` (``mindspore.common.initializer.Normal(sigma)`` -> ``init_stddev=sigma``,
    ``Zero()`` -> 0; the rows are seeded per id), ``device_vocabulary_size`` + ``host_vocabulary_size``
    (the rows, when ``capacity`` is not given: one host table holds them all), ``padding_keys`` (one
    id, as ``padding_id``). Any other mx_rec keyword is a TypeError naming it.

    Positional arguments: ``create_table(name, dim, capacity, emb_initializer)``, or mx_rec's order
    ``create_table(key_dtype, dim, name, emb_initializer)``: a first argument that is not a str is
    mx_rec's ``key_dtype`` (an int32 or int64 dtype). Every other argument is keyword-only (mx_rec's
    fifth positional differs between its versions: ``optimizer_list`` or ``device_vocabulary_size``),
    so a fifth positional argument is a TypeError. ``dim`` may be mx_rec's ``TensorShape([dim])``, a
    list of one int."""
    where = "create_table"
    unknown = sorted(set(settings) - set(_TABLE_FIELDS))
    if unknown:
        key = unknown[0]
        _fail(where, "keyword %r" % key, "one of create_table's arguments (mx_rec's %s have no meaning for a "
              "host table here)" % sorted(_MX_REC_ONLY), "%s=%r" % (key, settings[key]), TypeError)
    if name is not None and not isinstance(name, str):        # mx_rec's order: key_dtype, dim, name, ...
        if not _is_key_dtype(name):
            _fail(where, "the first argument", "a str (the name: create_table(name, dim, capacity)) or an int32 or "
                  "int64 dtype (mx_rec's key_dtype: create_table(key_dtype, dim, name, emb_initializer))", name,
                  TypeError)
        if key_dtype is not None:
            _fail(where, "'key_dtype'", "given once (the first positional argument is mx_rec's key_dtype, %r)" % (
                name,), key_dtype, TypeError)
        key_dtype, name, capacity = name, capacity, None
    if dim is not None:
        dim = _embedding_width(where, "dim", dim)
    if embedding_size is not None:
        embedding_size = _embedding_width(where, "embedding_size", embedding_size)
        if dim is not None and dim != embedding_size:
            _fail(where, "'embedding_size'", "the same as 'dim' (%r) when both are given" % (dim,), embedding_size)
        dim = embedding_size
    if key_dtype is not None and not _is_key_dtype(key_dtype):
        _fail(where, "'key_dtype'", "int32 or int64 (a MindSpore or numpy dtype)", key_dtype, TypeError)
    if emb_initializer is not None:
        settings["init_stddev"] = _initializer_stddev(where, emb_initializer)
    if capacity is None and device_vocabulary_size is not None:
        capacity = _check_int(where, "device_vocabulary_size", device_vocabulary_size, 0) + \
            _check_int(where, "host_vocabulary_size", host_vocabulary_size or 0, 0)
    elif capacity is not None and (device_vocabulary_size is not None or host_vocabulary_size is not None):
        _fail(where, "'device_vocabulary_size'/'host_vocabulary_size'", "None when 'capacity' is given (they are "
              "the Rec SDK's name for it)", (device_vocabulary_size, host_vocabulary_size))
    if padding_keys is not None:
        keys = list(padding_keys) if isinstance(padding_keys, (list, tuple)) else [padding_keys]
        padding_id = settings.get("padding_id")
        if len(keys) != 1 or (padding_id is not None and padding_id != keys[0]):
            _fail(where, "'padding_keys'", "one id (a table has one padding id%s)" % (
                "" if padding_id is None else ", here 'padding_id' %r" % padding_id), padding_keys)
        settings["padding_id"] = keys[0]
    for arg, value in (("name", name), ("dim", dim), ("capacity", capacity)):
        if value is None:
            _fail(where, "'%s'" % arg, "given%s" % (" (or 'device_vocabulary_size')" if arg == "capacity" else
                                                     " (or 'embedding_size')" if arg == "dim" else ""), None, TypeError)
    specs = [] if feature_spec is None else list(feature_spec) if isinstance(feature_spec, (list, tuple)) \
        else [feature_spec]
    for spec in specs:
        if not isinstance(spec, FeatureSpec):
            _fail(where, "'feature_spec'", "a FeatureSpec or a list of them", spec, TypeError)
    features = [spec for spec in specs if not spec.is_timestamp]
    clocks = [spec for spec in specs if spec.is_timestamp]
    if specs and not features:
        _fail(where, "'feature_spec'", "at least one feature spec that is not a timestamp", specs)
    if len(clocks) > 1:
        _fail(where, "'feature_spec'", "at most one timestamp spec", [spec.name for spec in clocks])
    for spec in features:
        if spec.table_name != name:
            _fail(where, "the table_name of FeatureSpec %r" % spec.name, repr(name), spec.table_name)
    keys = [spec.index_key for spec in features]
    if len(set(keys)) != len(keys):
        _fail(where, "the index_keys of 'feature_spec'", "distinct", keys)
    given = _mx_rec_checked(where, access_threshold=access_threshold, eviction_threshold=eviction_threshold)
    for arg, value in given.items():
        spec_values = sorted({getattr(spec, arg) for spec in features})
        if len(spec_values) > 1:
            _fail(where, "the %s of the features of table %r" % (arg, name), "one value", spec_values)
        if spec_values and value != -1 and value != spec_values[0]:
            _fail(where, "'%s'" % arg, "-1 or the feature_spec's %d" % spec_values[0], value)
    table_settings = features[0].table_settings if features else _mx_rec_table_fields(given)
    table = HashEmbedding(TableConfig(dim, capacity, name=name, where=where, **table_settings, **settings))
    table.feature_specs = specs
    table.key_dtype = key_dtype
    return table


def _is_key_dtype(value):
    """Whether ``value`` is an int32 or int64 dtype (MindSpore's, numpy's, or any named so, as TensorFlow's)."""
    if isinstance(value, (np.ndarray, Tensor, str)):
        return False
    if value in (mstype.int32, mstype.int64):
        return True
    if isinstance(value, (type, np.dtype)):
        try:
            return np.dtype(value) in (np.int32, np.int64)
        except TypeError:
            return False
    return getattr(value, "name", None) in ("int32", "int64")


# mx_rec's create_table keywords with no meaning for a host table here (refused by name)
_MX_REC_ONLY = ("ssd_vocabulary_size", "ssd_data_path", "is_save", "is_dp", "init_param", "all2all_gradients_op",
                "enable_merge", "padding_keys_mask", "padding_keys_len", "value_dtype", "shard_num",
                "fusion_optimizer_var", "hashtable_threshold", "optimizer_list", "mode")


def _initializer_stddev(where, initializer, name="emb_initializer"):
    """The standard deviation of the per-id initial rows for a MindSpore initializer: ``Normal(sigma)``
    (mean 0) gives sigma, 'normal' MindSpore's default sigma 0.01, ``Zero``, 'zeros' or 0 give 0;
    anything else is an error naming ``name`` (ValueError for another name or number, else TypeError)."""
    from mindspore.common import initializer as inits
    if isinstance(initializer, str) and initializer in ("zeros", "zero", "normal"):
        return 0.0 if initializer != "normal" else 0.01
    if isinstance(initializer, inits.Zero) or (isinstance(initializer, (int, float)) and not
                                               isinstance(initializer, bool) and initializer == 0):
        return 0.0
    if isinstance(initializer, inits.Normal) and float(getattr(initializer, "mean", 0.0)) == 0.0:
        return float(initializer.sigma)
    return _fail(where, "'%s'" % name, "'normal', mindspore.common.initializer.Normal(sigma) with mean 0, 'zeros' "
                 "or Zero() (the rows are seeded per id: mean 0, stddev sigma)", initializer,
                 ValueError if isinstance(initializer, (str, int, float)) else TypeError)


def sparse_lookup(table, ids, *, timestamp=None, is_train=True):
    """Embeddings (Tensor, ``ids.shape + (dim,)``, pooled per bag with a combiner) of raw ids (or a
    :class:`WeightedIds`) through ``table``, eagerly: prepare, take, gather (with ``is_train`` the ids are counted and
    admitted), then the table's ``construct`` (a ``HashEmbeddingLookup`` clips to its ``max_norm``). Training steps use the calls separately (see ``HashEmbedding``). ``timestamp`` and
    ``is_train`` are keyword-only: mx_rec's ``sparse_lookup(table, ids, send_count, is_train)`` fails
    loudly instead of taking ``send_count`` for a timestamp."""
    if not isinstance(table, HashEmbedding):
        _fail("sparse_lookup", "'table'", "a HashEmbedding", table, TypeError)
    batch = table.prepare(ids, timestamp, is_train)
    table.take(batch)
    return table.construct(Tensor(table.gather(batch)))


# =====================================================================================================
# Gradient freeze
# =====================================================================================================
# MindSpore's gradient freezing, with the work really skipped on CPU: freeze index ``i`` trains only
# the parameter groups ``i..`` (the layers next to the loss); the frozen groups get no gradient (the
# backward pass stops early) and no optimizer update. Each group index has its own train graph.
# ``GradientFreeze`` regroups the optimizer with ``ParameterProcess``, in the Boost algorithms section.


def _freeze_layer_groups(params):
    """MindSpore's layer grouping: a new group starts after >= 3 params, never before a bn/bias."""
    groups, cur = [], []
    for param in params:
        if "bn" in param.name or "bias" in param.name or len(cur) < 3:
            cur.append(param)
        else:
            groups.append(cur)
            cur = [param]
    if cur:
        groups.append(cur)
    return groups


def _optimizer_factory(opt, where):
    """``(class, init kwargs, learning rate, LARS kwargs or None)`` to rebuild ``opt`` on new params."""
    if not isinstance(opt, nn.Optimizer):
        _fail(where, "'opt'", "a mindspore.nn.Optimizer", type(opt).__name__, TypeError)
    if isinstance(opt, nn.LARS):
        inner = opt.opt
        return type(inner), dict(inner.init_args), inner.init_learning_rate, dict(opt.init_args)
    return type(opt), dict(opt.init_args), opt.init_learning_rate, None


def _rebuild_optimizer(factory, params, prefix=None):
    cls, kwargs, lr, lars = factory
    kwargs = dict(kwargs)
    extra = kwargs.pop("kwargs", None) or {}
    kwargs.update(extra)
    opt = cls(params=params, learning_rate=lr, **kwargs)
    if prefix is not None:
        opt._update_local_parameters_name(prefix)  # pylint: disable=protected-access
    if lars is not None:
        lars = {k: v for k, v in lars.items() if k not in ("optimizer", "kwargs")}
        opt = nn.LARS(opt, **lars)
        if prefix is not None:
            opt._update_local_parameters_name(prefix)  # pylint: disable=protected-access
    return opt


def _share_optimizer_state(main, sub):
    """Make ``sub`` (an optimizer over a subset of ``main``'s parameters) use ``main``'s state.

    Per-parameter state (moments, accumulators: ParameterTuples as long as the parameter list) and
    scalar state (step counters, beta powers) become ``main``'s own Parameters, so every freeze group
    continues the one optimizer trajectory (MindSpore gives each group its own fresh moments).
    """
    if isinstance(main, nn.LARS):
        main, sub = main.opt, sub.opt
    index = {id(p): i for i, p in enumerate(main.parameters)}
    pick = [index[id(p)] for p in sub.parameters]
    weights = {id(p) for p in sub.parameters}
    for name, value in list(vars(sub).items()):
        if name in ("parameters", "_parameters") or not isinstance(value, ms.ParameterTuple):
            continue
        other = getattr(main, name, None)
        if isinstance(other, ms.ParameterTuple) and len(value) == len(pick) and \
                len(other) == len(index) and not any(id(p) in weights for p in value):
            setattr(sub, name, ms.ParameterTuple(other[i] for i in pick))
    for name, value in list(sub._params.items()):  # pylint: disable=protected-access
        other = main._params.get(name)  # pylint: disable=protected-access
        if "." not in name and name != "learning_rate" and id(value) not in weights and \
                isinstance(other, Parameter) and other.shape == value.shape:
            setattr(sub, name, other)


class FreezeOpt(nn.Cell):
    """Optimizer for gradient-freezing training: one optimizer per parameter group.

    Args:
        opt (nn.Optimizer): the non-freezing optimizer (e.g. Momentum, Adam; LARS-wrapped too). Its class,
            hyper-parameters and learning rate are reused for every group.
        train_parameter_groups (list/tuple of lists of Parameter, optional): group ``i`` holds the
            parameters trained when the freeze index is ``i`` (``None``: one group, all parameters).
        train_strategy (list/tuple of int, numpy array or int32 Tensor, optional): the freeze index of
            each step.

    Called directly with the gradients of all parameters it updates them all (group 0's optimizer).
    The group optimizers share one state (moments, step counters): a frozen step simply leaves the
    frozen parameters' state untouched, instead of MindSpore's separate fresh state per group.
    """

    def __init__(self, opt, train_parameter_groups=None, train_strategy=None):
        super().__init__(auto_prefix=False)
        factory = _optimizer_factory(opt, "FreezeOpt")
        if train_strategy is not None and train_parameter_groups is None:
            raise ValueError("For 'FreezeOpt', 'train_parameter_groups' must be given when 'train_strategy' is.")
        self.parameters = opt.parameters
        if train_parameter_groups is None:
            train_parameter_groups = [list(opt.parameters)]
        if not isinstance(train_parameter_groups, (list, tuple)) or not train_parameter_groups:
            _fail("FreezeOpt", "'train_parameter_groups'", "a non-empty list or tuple", train_parameter_groups,
                  TypeError)
        for group in train_parameter_groups:
            if not isinstance(group, (list, tuple)) or not group:
                _fail("FreezeOpt", "each of 'train_parameter_groups'", "a non-empty list or tuple", group,
                      TypeError)
        self.groups_num = len(train_parameter_groups)
        self.train_strategy = self._strategy_tensor(train_strategy)
        self.opts = nn.CellList([_rebuild_optimizer(factory, list(group), "boost_%d" % i)
                                 for i, group in enumerate(train_parameter_groups)], auto_prefix=False)
        for opt_k in list(self.opts)[1:]:
            _share_optimizer_state(self.opts[0], opt_k)
        self.learning_rate = factory[2]

    def _strategy_tensor(self, strategy):
        if strategy is None:
            return None
        if isinstance(strategy, Tensor):
            strategy = strategy.asnumpy()
        arr = np.asarray(strategy)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            _fail("FreezeOpt", "'train_strategy'", "a non-empty 1-D sequence of ints", strategy, TypeError)
        if arr.min() < 0 or arr.max() >= self.groups_num:
            _fail("FreezeOpt", "'train_strategy'", "indices in [0, %d)" % self.groups_num,
                  (int(arr.min()), int(arr.max())))
        return Tensor(arr.astype(np.int32))

    def construct(self, gradients):
        return self.opts[0](gradients)


class GradientFreeze:
    """Gradient freezing: each step trains only the layers after a randomly chosen freeze point.

    Args:
        param_groups (int): number of parameter groups (capped at the network's number of layer groups,
            where MindSpore's ``stride = 0`` silently froze nothing).
        freeze_type (int): 0 = MindSpore's repeated pattern ``0...0 1 2 .. n-1``; 1 = frozen steps spread
            evenly with random indices (small indices, i.e. few frozen layers, more likely).
        freeze_p (float): share of steps that train every layer (``[0, 1)``).
        total_steps (int): length of the schedule (it repeats after ``int(total_steps * 1.01)`` steps).
        seed (int): seed of strategy 1's draws (recboost addition; MindSpore used the global RNG).
    """

    def __init__(self, param_groups, freeze_type, freeze_p, total_steps, seed=0):
        self._param_groups = _check_int("GradientFreeze", "param_groups", param_groups, 1, 65535)
        self._freeze_type = _check_int("GradientFreeze", "freeze_type", freeze_type, 0, 1)
        self._freeze_p = _check_number("GradientFreeze", "freeze_p", freeze_p, 0, 1, strict_max=True)
        self._total_steps = _check_int("GradientFreeze", "total_steps", total_steps, 1, 2 ** 30)
        self._seed = _check_int("GradientFreeze", "seed", seed, 0, 2 ** 64 - 1)
        self.grad_reducer = nn.Identity()

    def split_parameters_groups(self, net, freeze_para_groups_number):
        """Group ``i`` holds the trainable parameters from freeze point ``i`` to the end (group 0: all).

        Freeze points are every ``len(layers) // n``-th layer group of MindSpore's rule; with fewer
        layer groups than ``n`` there is one point per layer group (MindSpore's stride 0 froze nothing).
        """
        layers = _freeze_layer_groups(net.trainable_params())
        n = _check_int("split_parameters_groups", "freeze_para_groups_number", freeze_para_groups_number, 1)
        stride = max(len(layers) // n, 1)       # MindSpore's stride; >= 1 so every point freezes something
        n = min(n, len(layers))
        return [sum(layers[i * stride:], []) for i in range(n)]

    def generate_freeze_index_sequence(self, parameter_groups_number, freeze_strategy, freeze_p, total_steps):
        """The freeze index of each step as an int32 numpy array (compiled kernel, explicit seed)."""
        groups = _check_int("generate_freeze_index_sequence", "parameter_groups_number",
                            parameter_groups_number, 0, 65535)
        strategy = _check_int("generate_freeze_index_sequence", "freeze_strategy", freeze_strategy, 0, 1)
        p = _check_number("generate_freeze_index_sequence", "freeze_p", freeze_p, 0, 1, strict_max=True)
        steps = _check_int("generate_freeze_index_sequence", "total_steps", total_steps, 1, 2 ** 30)
        return freeze_index_sequence(groups, strategy, p, steps, self._seed)

    def freeze_generate(self, network, optimizer):
        """Return ``(network, FreezeOpt)`` for gradient-freezing training of ``network``."""
        groups = self.split_parameters_groups(network, self._param_groups)
        origin = optimizer.init_params["params"]
        groups = [ParameterProcess.generate_group_params(group, origin) for group in groups]
        strategy = self.generate_freeze_index_sequence(len(groups), self._freeze_type, self._freeze_p,
                                                       self._total_steps)
        return network, FreezeOpt(optimizer, groups, strategy)


# =====================================================================================================
# PCA loading
# =====================================================================================================
# DimReduce's PCA matrix: computed once from saved checkpoints (seeded randomized SVD), saved once as
# ``.npy`` by an atomic rename (a visible file is a complete file), then each rank copies only its own
# rows out of a memory map through ``pca_rows_copy``. Rows are split with ceiling division, the last
# rank's block zero-padded, so no component is dropped (MindSpore's ``ceil(n // r)`` drops them).


def _pca_rows_per_rank(n_components, rank_size):
    return -(-n_components // rank_size)


def _checkpoint_matrix(weight_load_dir, network):
    """One row per ``.ckpt`` file (sorted by name): the network's trainable parameters, flattened."""
    names = [p.name for p in network.trainable_params()]
    files = sorted(f for f in os.listdir(weight_load_dir) if f.endswith(".ckpt"))
    if not files:
        _fail("DimReduce", "'weight_load_dir'", "a directory with .ckpt files", weight_load_dir)
    rows = []
    for name in files:
        params = ms.load_checkpoint(os.path.join(weight_load_dir, name))
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError("For 'DimReduce', the checkpoint %r lacks the parameter %r." % (name, missing[0]))
        rows.append(np.concatenate([params[n].asnumpy().reshape(-1).astype(np.float64) for n in names]))
    return np.stack(rows)


def compute_pca_mat(data, n_components, seed=0, n_oversample=10, n_iter=2):
    """The top ``n_components`` principal directions of the rows of ``data`` (k x n_features, float32).

    Randomized SVD (Halko et al.) with a ``numpy.random.Generator(seed)`` test matrix, QR-stabilised power
    iterations and a deterministic sign (the largest-magnitude entry of each component is positive).
    """
    data = np.asarray(data, dtype=np.float64)
    n_components = _check_int("compute_pca_mat", "n_components", n_components, 1)
    if data.ndim != 2 or data.shape[0] < n_components:
        _fail("compute_pca_mat", "'data'", "a 2-D array with at least n_components=%d rows" % n_components,
              data.shape)
    data = data - data.mean(axis=0)
    rng = np.random.default_rng(_check_int("compute_pca_mat", "seed", seed, 0))
    size = min(n_components + n_oversample, min(data.shape))
    q, _ = np.linalg.qr(data @ rng.standard_normal((data.shape[1], size)))
    for _ in range(n_iter):
        q, _ = np.linalg.qr(data.T @ q)
        q, _ = np.linalg.qr(data @ q)
    _, _, vt = np.linalg.svd(q.T @ data, full_matrices=False)
    comps = vt[:n_components]
    if comps.shape[0] < n_components:   # fewer directions than asked (rank-deficient): zero rows
        comps = np.vstack([comps, np.zeros((n_components - comps.shape[0], comps.shape[1]))])
    signs = np.sign(comps[np.arange(comps.shape[0]), np.abs(comps).argmax(axis=1)])
    signs[signs == 0] = 1
    return (comps * signs[:, None]).astype(np.float32)


def save_pca_mat(pca_mat, path):
    """Save ``pca_mat`` as float32 ``.npy`` atomically (``_atomic_write``: a temporary file beside
    ``path``, fsynced, then renamed onto it), so a visible file is complete. Returns ``path``."""
    path = os.fspath(path)
    if not path.endswith(".npy"):
        _fail("save_pca_mat", "'path'", "a path ending in .npy", path)
    mat = np.ascontiguousarray(pca_mat, dtype=np.float32)
    _atomic_write(path, lambda fh: np.save(fh, mat))
    return path


def _npy_is_complete(path):
    """True when ``path`` is a readable ``.npy`` whose size matches its header."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            shape, fortran, dtype = np.lib.format._read_array_header(fh, version)  # pylint: disable=protected-access
            return not fortran and os.fstat(fh.fileno()).st_size == fh.tell() + int(np.prod(shape)) * dtype.itemsize
    except (OSError, ValueError):
        return False


def load_pca_rows(path, rank, rank_size, n_components=None, chunk_bytes=1 << 18):
    """This rank's rows of the PCA matrix at ``path`` as float32 ``(ceil(k / rank_size), n)``.

    Only those rows are read: the file is memory-mapped and copied ``chunk_bytes`` (256 KB) at a time through
    ``pca_rows_copy``, each chunk's pages released right after (``MADV_DONTNEED``), so the peak memory
    is the rank's share plus one chunk. Rows past ``k`` (the last rank's padding) are zero. ``k`` is
    ``n_components`` (default: all rows of the file). The file must be complete (``save_pca_mat``
    renames it into place; in a distributed job ``network_auto_process_train`` has every rank wait,
    up to ``dim_reduce.timeout`` seconds, until rank 0 has renamed it), else ValueError.
    """
    import mmap
    rank_size = _check_int("load_pca_rows", "rank_size", rank_size, 1)
    rank = _check_int("load_pca_rows", "rank", rank, 0, rank_size - 1)
    step_bytes = _check_int("load_pca_rows", "chunk_bytes", chunk_bytes, 1)
    if not _npy_is_complete(path):
        _fail("load_pca_rows", "'path'", "a complete .npy file (written by save_pca_mat)", path)
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        shape, _, dtype = np.lib.format._read_array_header(fh, version)  # pylint: disable=protected-access
        offset = fh.tell()
        if len(shape) != 2 or dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            _fail("load_pca_rows", "the PCA matrix", "a 2-D native float32/float64 array", (shape, str(dtype)))
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if shape[0] * shape[1] else None
    rows, cols = shape
    k = rows if n_components is None else _check_int("load_pca_rows", "n_components", n_components, 1)
    if k > rows:
        _fail("load_pca_rows", "'n_components'", "<= the %d rows of %s" % (rows, path), k)
    local = _pca_rows_per_rank(k, rank_size)
    out = np.zeros((local, cols), dtype=np.float32)
    first, last = rank * local, min((rank + 1) * local, k)
    step = max(1, step_bytes // dtype.itemsize)
    page = mmap.PAGESIZE
    try:
        for row in range(first, last):
            base = offset + row * cols * dtype.itemsize
            for c0 in range(0, cols, step):
                c1 = min(cols, c0 + step)
                src = np.frombuffer(mapped, dtype, c1 - c0, base + c0 * dtype.itemsize).reshape(1, -1)
                pca_rows_copy(src, 0, out[row - first:row - first + 1, c0:c1])
                del src
                lo = (base + c0 * dtype.itemsize) // page * page
                if hasattr(mapped, "madvise"):
                    mapped.madvise(mmap.MADV_DONTNEED, lo, base + c1 * dtype.itemsize - lo)
    finally:
        if mapped is not None:
            mapped.close()
    return out


def _boost_parallel():
    """``(reducer_flag, rank, rank_size)`` of the current parallel context."""
    mode = ms.get_auto_parallel_context("parallel_mode")
    if mode in ("data_parallel", "hybrid_parallel"):
        from mindspore.communication import get_group_size, get_rank
        return True, get_rank(), get_group_size()
    return False, 0, 1


def _wait_for_pca_mat(path, timeout):
    """``path`` once it is a complete ``.npy`` (rank 0 writes it with an atomic rename), waiting up to
    ``timeout`` seconds (MindSpore's ``dim_reduce.timeout``); after that a RuntimeError naming both."""
    deadline = time.monotonic() + timeout
    while not _npy_is_complete(path):
        if time.monotonic() >= deadline:
            raise RuntimeError("For 'AutoBoost', the PCA matrix %r was not complete within 'dim_reduce.timeout' "
                               "= %s seconds (rank 0 computes and saves it; raise the timeout for a large "
                               "network)." % (path, timeout))
        time.sleep(0.05)
    return path


def _prepare_pca_mat(cfg, network):
    """Path of the full PCA matrix for the ``dim_reduce`` section ``cfg``: the given ``pca_mat_path``
    if complete, else computed from ``weight_load_dir`` by rank 0 and saved once; the other ranks wait
    for the file up to ``cfg.timeout`` seconds."""
    path = cfg.pca_mat_path
    if path is not None and path.endswith(".npy") and _npy_is_complete(path):
        return path
    load_dir = cfg.weight_load_dir
    if load_dir is None or not os.path.isdir(load_dir):
        _fail("AutoBoost", "the key 'dim_reduce.weight_load_dir'",
              "an existing directory of .ckpt files (no complete 'pca_mat_path' was found)", load_dir)
    if path is None:
        path = os.path.join(load_dir, "pca_mat.npy")
    if _boost_parallel()[1] == 0:
        save_pca_mat(compute_pca_mat(_checkpoint_matrix(load_dir, network), cfg.n_components, cfg.seed), path)
    return _wait_for_pca_mat(path, cfg.timeout)


# =====================================================================================================
# Loss scaling
# =====================================================================================================
# The update cells and managers are MindSpore's own (mindspore.nn / mindspore.amp), subclassed only to
# check their arguments with recboost's error form; their update rules are MindSpore's and run on CPU.
# The managers hand out the subclassed cells. Overflow detection lives in the train-step cells and is
# device-agnostic: a finite check on the gradients, so it works on CPU as on Ascend/GPU.


class DynamicLossScaleUpdateCell(nn.DynamicLossScaleUpdateCell):
    """``mindspore.nn.DynamicLossScaleUpdateCell`` with its arguments checked.

    Called as ``cell(loss_scale, overflow)`` by a train-step cell, it updates the ``loss_scale``
    Parameter in place and returns ``overflow``:

    - on overflow the scale is divided by ``scale_factor`` (never below 1) and the good-step counter
      restarts;
    - on the ``scale_window``-th consecutive step without overflow the scale is multiplied by
      ``scale_factor`` and the counter restarts.

    Example: ``DynamicLossScaleUpdateCell(2**12, 2, 3)`` fed F,F,F,T,F,F,F,F,T,T leaves the scale at
    4096, 4096, 8192, 4096, 4096, 4096, 8192, 8192, 4096, 2048.

    Args:
        loss_scale_value (float): initial loss scale, >= 1.
        scale_factor (int): growth/shrink factor, > 1.
        scale_window (int): consecutive good steps before the scale grows, >= 1.
    """

    def __init__(self, loss_scale_value, scale_factor, scale_window):
        where = "DynamicLossScaleUpdateCell"
        super().__init__(_check_number(where, "loss_scale_value", loss_scale_value, minimum=1),
                         _check_number(where, "scale_factor", scale_factor, minimum=1, strict_min=True),
                         _check_int(where, "scale_window", scale_window, minimum=1))


class FixedLossScaleUpdateCell(nn.FixedLossScaleUpdateCell):
    """``mindspore.nn.FixedLossScaleUpdateCell`` with its argument checked: the scale never changes,
    and a train-step cell given it skips the optimizer on overflow steps.

    Args:
        loss_scale_value (float): the loss scale, >= 1.
    """

    def __init__(self, loss_scale_value):
        super().__init__(_check_number("FixedLossScaleUpdateCell", "loss_scale_value", loss_scale_value,
                                       minimum=1))


class FixedLossScaleManager(ms.amp.FixedLossScaleManager):
    """``mindspore.amp.FixedLossScaleManager`` with its arguments checked.

    Args:
        loss_scale (float): the scale, >= 1. Default 128.0.
        drop_overflow_update (bool): skip the optimizer on overflow steps. Default True. When False
            there is no update cell (``get_update_cell()`` is None), the loss is scaled by
            ``loss_scale`` and the optimizer must divide by it itself (its ``loss_scale`` argument).
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        where = "FixedLossScaleManager"
        super().__init__(_check_number(where, "loss_scale", loss_scale, minimum=1),
                         _check_bool(where, "drop_overflow_update", drop_overflow_update))

    def get_update_cell(self):
        """A :class:`FixedLossScaleUpdateCell` when ``drop_overflow_update`` is True, else None."""
        return FixedLossScaleUpdateCell(self.get_loss_scale()) if self.get_drop_overflow_update() else None


class DynamicLossScaleManager(ms.amp.DynamicLossScaleManager):
    """``mindspore.amp.DynamicLossScaleManager`` with its arguments checked.

    Args:
        init_loss_scale (float): initial scale, >= 1. Default 2**24.
        scale_factor (int): growth/shrink factor, > 1. Default 2.
        scale_window (int): good steps before growth, >= 1. Default 2000.

    ``update_loss_scale(overflow)`` is MindSpore's host-side rule (the same schedule as
    :class:`DynamicLossScaleUpdateCell`; MindSpore raises after 1000 consecutive overflows);
    ``get_update_cell()`` returns a new device cell starting from the current scale. Overflow steps
    are always dropped.
    """

    def __init__(self, init_loss_scale=2 ** 24, scale_factor=2, scale_window=2000):
        where = "DynamicLossScaleManager"
        super().__init__(_check_number(where, "init_loss_scale", init_loss_scale, minimum=1),
                         _check_number(where, "scale_factor", scale_factor, minimum=1, strict_min=True),
                         _check_int(where, "scale_window", scale_window, minimum=1))

    def get_update_cell(self):
        """A :class:`DynamicLossScaleUpdateCell` with this manager's settings."""
        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)


# =====================================================================================================
# Mixed precision
# =====================================================================================================
# MindSpore's levels (``_AMP_LEVELS``, in Constants) with their keyword overrides become one frozen
# ``_AmpConfig``; ``_cast_network`` applies it. ``build_train_network`` lives after AutoBoost, whose
# boost cells it builds.


@dataclasses.dataclass(frozen=True)
class _AmpConfig:
    """A mixed precision level with its keyword overrides, resolved and validated once (``of``)."""
    level: str                  # the effective level ("auto" resolved by device)
    cast_model_type: object     # mstype.float16 or mstype.float32
    keep_batchnorm_fp32: bool
    loss_scale_manager: object  # a LossScaleManager or None

    @classmethod
    def of(cls, level, where="build_train_network", **kwargs):
        """The config of ``level`` plus ``kwargs`` (``_AMP_KWARGS``); a fresh manager every call."""
        if not isinstance(level, str):
            _fail(where, "'level'", "a str in %s" % list(_AMP_LEVELS), level, TypeError)
        _check_one_of(where, "level", level, _AMP_LEVELS)
        _check_no_kwargs(where, kwargs, _AMP_KWARGS)
        if level == "auto":
            level = {"GPU": "O2", "Ascend": "O3"}.get(ms.get_context("device_target"), "O0")
        cast, keep_bn, dynamic = _AMP_LEVELS[level]
        cast = _check_one_of(where, "cast_model_type", kwargs.get("cast_model_type", cast),
                             (mstype.float16, mstype.float32))
        keep_bn = _check_bool(where, "keep_batchnorm_fp32", kwargs.get("keep_batchnorm_fp32", keep_bn))
        manager = kwargs["loss_scale_manager"] if "loss_scale_manager" in kwargs \
            else DynamicLossScaleManager() if dynamic else None
        if manager is not None and not isinstance(manager, ms.amp.LossScaleManager) \
                and not hasattr(manager, "get_update_cell"):
            _fail(where, "'loss_scale_manager'", "a LossScaleManager or None", manager, TypeError)
        return cls(level, cast, keep_bn, manager)


def _cast_network(network, config, where="build_train_network"):
    """Cast ``network`` for the config: float16 cells, BatchNorm kept float32 if asked; at O1,
    MindSpore's ``auto_mixed_precision`` (its white-list of ops in float16, applied by MindSpore's
    source rewrite, which cannot parse every network: then a ValueError says so). Returns the network."""
    if config.level == "O1" and config.cast_model_type == mstype.float32:
        try:
            return ms.amp.auto_mixed_precision(network, "O1")
        except Exception as exc:  # pylint: disable=broad-except  (MindSpore's rewrite raises anything)
            raise ValueError("For '%s', amp level 'O1' applies MindSpore's auto_mixed_precision(network, "
                             "'O1'), whose source rewrite failed on this network (%s: %s); use 'O0', 'O2', "
                             "'O3' or 'auto'." % (where, type(exc).__name__, exc)) from exc
    if config.cast_model_type == mstype.float16:
        network.to_float(mstype.float16)
        if config.keep_batchnorm_fp32:
            for _, cell in network.cells_and_names():
                if isinstance(cell, nn.layer.normalization._BatchNorm):
                    cell.to_float(mstype.float32)
    return network


class _WithLossCell(nn.Cell):
    """``loss_fn(network(*inputs[:-1]), inputs[-1])`` for networks of any number of inputs; with
    ``cast_fp32`` the network output and a float label are cast to float32 first (mixed precision;
    int labels, e.g. of ``SparseSoftmaxCrossEntropyWithLogits``, pass unchanged)."""

    def __init__(self, backbone, loss_fn, cast_fp32=False):
        super().__init__(auto_prefix=False)
        self._backbone = backbone
        self._loss_fn = loss_fn
        self._cast_fp32 = cast_fp32

    def construct(self, *inputs):
        out = self._backbone(*inputs[:-1])
        label = inputs[-1]
        if self._cast_fp32:       # float labels only, as MindSpore's amp: int labels pass unchanged
            out = ops.cast(out, mstype.float32)
            if label.dtype in (mstype.float16, mstype.bfloat16, mstype.float64):
                label = ops.cast(label, mstype.float32)
        return self._loss_fn(out, label)

    @property
    def backbone_network(self):
        """The wrapped network."""
        return self._backbone


# =====================================================================================================
# Train-step cells
# =====================================================================================================
# One step, written once (``_TrainStep.construct``): forward, backward with the loss scale as sens,
# unscale, reduce across devices, overflow check, guarded apply. The public cells differ only in
# which gradients they take (the optimizer's weights, plus the inputs listed in ``row_inputs``: the
# hash-table rows, whose gradients the step returns for the host update) and in how gradients are
# applied (``_apply_gradients``: the optimizer; the boost cells add accumulation, AdaSum, DimReduce,
# gradient freezing and per-group loss scales).
_grad_unscale = ops.MultitypeFuncGraph("recboost_grad_unscale")


@_grad_unscale.register("Tensor", "Tensor")
def _grad_unscale_tensor(inv_scale, grad):
    return grad * ops.cast(inv_scale, ops.dtype(grad))


@_grad_unscale.register("Tensor", "RowTensor")
def _grad_unscale_row_tensor(inv_scale, grad):
    return RowTensorInner(grad.indices, grad.values * ops.cast(inv_scale, ops.dtype(grad.values)),
                          grad.dense_shape)


_grad_total = ops.MultitypeFuncGraph("recboost_grad_total")


def _float32_total(x):
    # The float32 sum of |x|, T: Inf or NaN when any entry is Inf or NaN. The step's check squares it
    # (_nonfinite_flag): T * T bounds the square of every entry and of every sum of entries (a table
    # row's gradient on the host is the sum of its ids' and bags' gradients, each bag reaching a row
    # at most _TableBatch.gradient_factor times: the step multiplies T of the rows by it), so when T * T
    # is finite no optimizer squares an Inf (see _nonfinite_flag). One read of the
    # gradient and one elementwise pass. Column sums first: MindSpore's CPU ReduceSum over every axis
    # of a matrix is ~10x slower than over its first axis (13 ms against 1 ms for a 200K x 17
    # embedding gradient). (The branch is on the static rank; no branch on the dtype: AddN cannot type
    # a branch's result; the cast of a float32 gradient is removed.)
    x = ops.abs(ops.cast(x, mstype.float32))
    if x.ndim > 1:
        x = x.sum(0)
    return x.sum()


@_grad_total.register("Tensor")
def _grad_total_tensor(grad):
    return _float32_total(grad)


@_grad_total.register("RowTensor")
def _grad_total_row_tensor(grad):
    return _float32_total(grad.values)


#: Weights of at most this many entries have their gradients' T taken together (``_nonfinite_flag``'s
#: ``small``): one concatenation and one sum for all of them, not a few small ops each.
_SMALL_GRADIENT = 1 << 14


#: The optimizer states that can grow without bound, per MindSpore optimizer class: ``(class,
#: accumulator, linear)``, the names of the optimizer's ParameterTuples (one state per parameter, in the
#: parameters' order; None: none). An accumulator grows by ``g * g`` per step (Adagrad's and
#: ProximalAdagrad's ``accum``, FTRL's ``moments``); FTRL's ``linear`` by ``g - sigma * w``, ``sigma =
#: (accum_new^q - accum^q) / lr``, ``q = -lr_power``. Every other state of MindSpore's optimizers stays
#: within a bounded multiple of the gradients, their squares or their running maxima (Adam's,
#: LazyAdam's, AdaMax's, RMSProp's, Adadelta's moments are convex combinations or maxima, Momentum's and
#: SGD's a decaying sum): ``_nonfinite_flag``'s T * T covers them. Any other optimizer class: none.
_GROWING_STATES = ((nn.Adagrad, "accum", None), (nn.ProximalAdagrad, "accum", None),
                   (nn.FTRL, "moments", "linear"))
#: D without FTRL: no division (the smallest D of tables sharing a gradient is then FTRL's).
_NO_DIVISOR = float("inf")
#: What the host tells a step's overflow check about the growing optimizer states of the table rows it
#: updates (``_SparseOptimizer.growth_bound``; ``_update_bound`` reads it in the graph as a row of
#: ``_TrainStep.row_bounds``, in this order): the largest accumulator entry, the largest ``|linear|``
#: and ``|weight|`` (FTRL), FTRL's ``q = -lr_power`` and learning rate, D, a lower bound of FTRL's
#: new-weight divisor, and ``add``, a bound of what the optimizer adds to each entry of a row's gradient
#: before its rule (L2 weight decay's ``wd * |w|max``, ``_decay_add``; 0: nothing), which ``_update_bound``
#: adds to the gradient's T. Tables sharing a gradient combine field by field (``_combined_bounds``).
#: A field not given is its value for rows with no growing state and no decay (``_NO_GROWTH``).
_GrowthBound = collections.namedtuple("_GrowthBound", "accum linear weight q lr divisor add",
                                      defaults=(0.0, 0.0, 0.0, 0.0, 1.0, _NO_DIVISOR, 0.0))
#: The bound of rows with no growing state (Adam's moments and SGD stay bounded by the gradients).
_NO_GROWTH = _GrowthBound()
#: The fields a row input's overflow check reads of its ``_GrowthBound`` (``_TrainStep.row_growth``): a
#: prefix, the growing states (``_LARGEST``'s) and, when a table reading it has L2 decay, ``add``.
_BOUND_FIELDS = _LARGEST + ("add",)
#: The ``_GrowthBound`` fields combined by their smallest value (the others by their largest).
_SMALLEST_FIELDS = [4, 5]          # (lr, divisor)


def _combined_bounds(stacked):
    """``_GrowthBound`` rows combined over the first axis of ``stacked`` (float32 ``[k, ..., 7]``): the
    largest M, L, W, q and ``add``, the smallest learning rate and divisor D, so ``_update_bound`` of the
    result bounds the update of each (tables sharing a gradient, ranks sharing a row-wise table)."""
    out = stacked.max(axis=0)
    out[..., _SMALLEST_FIELDS] = stacked[..., _SMALLEST_FIELDS].min(axis=0)
    return out
#: The name of the train cell's Parameter holding the rows' bounds (``_TrainStep.set_row_bounds``).
_ROW_BOUNDS = "recboost_row_bounds"
#: The name of the train cell's Parameter holding the rows' gradient factors (``_TrainStep.set_row_bounds``).
_ROW_FACTORS = "recboost_row_factors"
#: Below 1 by more than a few float32 rounding errors: a lower bound of FTRL's divisor computed in another
#: order than the kernel's (a ``pow`` may round up by an ulp) is lowered by this factor to stay below it.
_DIVISOR_MARGIN = 1.0 - 2.0 ** -16


#: MindSpore's primitives whose gradient is sparse (a ``RowTensor``: their bprops)
_SPARSE_GRADIENT_PRIMITIVES = (ops.SparseGatherV2, ops.EmbeddingLookup)


def _sparse_gradients_possible(network):
    """Whether a cell of ``network`` holds a primitive whose gradient is sparse
    (``_SPARSE_GRADIENT_PRIMITIVES``, e.g. in ``nn.EmbeddingLookup``)."""
    for _, cell in network.cells_and_names():
        for value in list(vars(cell).values()) + list(getattr(cell, "_primitives", {}).values()):
            if isinstance(value, _SPARSE_GRADIENT_PRIMITIVES):
                return True
    return False


def _check_row_pooled(where, row_pooled, n):
    """``row_pooled`` of a train cell with ``n`` row inputs, checked: a tuple of ``n`` bools (None: every
    entry True)."""
    if row_pooled is None:
        return (True,) * n
    if not isinstance(row_pooled, (list, tuple)) or len(row_pooled) != n or \
            not all(isinstance(p, (bool, np.bool_)) for p in row_pooled):
        _fail(where, "'row_pooled'", "None or a bool per row input (%d)" % n, row_pooled)
    return tuple(bool(p) for p in row_pooled)


def _check_row_growth(where, row_growth, n):
    """``row_growth`` of a train cell with ``n`` row inputs, checked: a tuple of ``n`` prefixes of
    ``_BOUND_FIELDS`` (None: every entry the whole of it)."""
    if row_growth is None:
        return (_BOUND_FIELDS,) * n
    prefixes = [_BOUND_FIELDS[:k] for k in range(len(_BOUND_FIELDS) + 1)]
    if not isinstance(row_growth, (list, tuple)) or len(row_growth) != n or \
            any(tuple(g) not in prefixes if isinstance(g, (list, tuple)) else True for g in row_growth):
        _fail(where, "'row_growth'", "None or one of %s per row input (%d)" % (prefixes, n), row_growth)
    return tuple(tuple(g) for g in row_growth)


#: A dense optimizer's growing states (``_growing_states``): the names of its ParameterTuples (``linear``
#: None but for FTRL), FTRL's ``q = -lr_power``, ``lr`` and ``l2`` (else 0, 1 and 0).
_DenseGrowth = collections.namedtuple("_DenseGrowth", "accum linear q lr l2")


def _growing_states(optimizer):
    """The ``_DenseGrowth`` of ``optimizer`` per ``_GROWING_STATES``; None when its states do not grow."""
    for cls, accum, linear in _GROWING_STATES:
        if isinstance(optimizer, cls):
            if linear is None:
                return _DenseGrowth(accum, None, 0.0, 1.0, 0.0)
            return _DenseGrowth(accum, linear, -float(optimizer.lr_power), float(optimizer.lr), float(optimizer.l2))
    return None


def _ftrl_divisor(accum, q, lr, l2):
    """A float32 lower bound of FTRL's new-weight divisor ``accum_new^q / lr + 2 l2`` for every
    accumulator entry that is at least ``accum`` (FTRL's accumulators never decrease): computed in
    float64 and lowered by ``_DIVISOR_MARGIN``, so it stays below the kernel's float32 value. 0 when
    ``accum`` and ``l2`` are 0 (and q > 0): no static bound."""
    return float(np.float32((float(accum) ** q / lr + 2.0 * l2) * _DIVISOR_MARGIN))


def _update_bound(total, state):
    """The scalars whose finiteness proves an update finite, for a gradient whose float32 sum of
    absolute values is ``total`` (T) and whose growing states are summarised by ``state``: ``(M, L, W,
    q, lr, D)``, float32 scalars: M the largest accumulator entry (0: none), L the largest ``|linear|``,
    W the largest ``|weight|`` (both 0 without FTRL's linear), FTRL's ``q = -lr_power`` and ``lr`` (0,
    1 without) and D a lower bound of FTRL's new-weight divisor ``accum_new^q / lr + 2 l2`` (+Inf
    without); ``(M, L, W, q, lr, D, add)`` when the optimizer adds at most ``add`` to each entry of the
    gradient before its rule (a table's L2 weight decay, ``_GrowthBound``): T is then ``T + add``
    everywhere below (each entry of the applied gradient is at most it); or ``(M,)`` for an accumulator
    alone (Adagrad, ProximalAdagrad). The bounds are of every
    ``g * g`` and sum of gradient entries squared (T * T), of every accumulator after the step (``A + g
    * g <= M + T * T``, and ``A + g * g >= A``, finite), of every ``|linear|`` after FTRL's step (``L'
    = L + T + max(M + T * T, 1)^q / lr * W``: ``sigma <= accum_new^q / lr``), and of every new FTRL
    weight (``|l1 sign(linear) - linear| / divisor <= L' / D``: the kernel sets the weight to 0 unless
    ``|linear| > l1``); float32 rounding is monotone, so each bound rounded is at least the value it
    bounds rounded. Returned, as the fewest scalars whose finiteness implies all of them: ``(M + T *
    T,)`` (M finite and >= 0: finite exactly when T * T is) or ``(M + T * T, L' / D)`` (L' / D is Inf or
    NaN when L' is not finite, D > 0 or +Inf): fewer small ops per step."""
    if len(state) == 7:                 # (static: no op without an add)
        total = total + state[6]
    grown = state[0] + total * total
    if len(state) == 1:
        return (grown,)
    power = ops.pow(ops.maximum(grown, 1.0), state[3]) / state[4]
    return grown, (state[1] + total + power * state[2]) / state[5]


def _stacked_bound_flag(totals, states):
    """0.0 when every ``_update_bound`` term of the gradients with ``totals`` (T) and ``states`` (each
    ``(M,)``, each six or each seven) is finite, else NaN: the terms of all of them at once, each state's field
    stacked into a vector and T the sum of them (every term grows with T, so each gradient's is
    bounded; a sum, not a maximum, so a NaN T stays NaN): a few small ops for all, not a few per
    gradient (``totals`` not empty)."""
    fields = ()
    for k in range(len(states[0])):
        column = ()
        for state in states:
            column += (_float32_scalar(state[k]),)
        fields += (ops.stack(column),)
    flag = 0.0
    for term in _update_bound(_scalar_sum(totals), fields):
        flag = flag + (term * 0.0).sum()
    return flag


def _scalar_sum(values):
    """The sum of the scalar Tensors ``values`` (not empty), in their order: one Add each."""
    summed = values[0]
    for value in values[1:]:
        summed = summed + value
    return summed


def _flat_total(pieces):
    """T of the gradients whose flattened float32 entries are ``pieces`` (not empty): one
    concatenation, one pass of absolute values, one sum."""
    flat = pieces[0] if len(pieces) == 1 else ops.concat(pieces)
    return ops.abs(flat).sum()


def _float32_scalar(x):
    """``x`` (a Python number or a scalar Tensor) as a float32 scalar Tensor."""
    if isinstance(x, (int, float)):
        return ops.scalar_to_tensor(x, mstype.float32)
    return ops.cast(x, mstype.float32)


def _prepared_total(total, prep):
    """T of the gradient an optimizer applies, from T of the step's gradient: ``prep`` None (the same
    gradient) or ``(add, factor)``: ``(T + add) * factor`` (``_TrainStep._grad_preps``: weight decay's
    ``wd * max|w|``, a boost's accumulated mean, gradient centralization's 2, the optimizer's loss
    scale, the ranks a row gradient is summed over)."""
    if prep is None:
        return total
    add, factor = prep
    if not (isinstance(add, (int, float)) and add == 0):         # (static: no op for a constant 0 or 1)
        total = total + add
    if not (isinstance(factor, (int, float)) and factor == 1):
        total = total * factor
    return total


_ftrl_entry_bound = ops.MultitypeFuncGraph("recboost_ftrl_entry_bound")


def _ftrl_entry_largest(grad, accum, linear, weight, q, lr):
    # |new weight| <= |linear_new| * lr / accum_new^q and |linear_new| <= |linear| + |g| + sigma |w| with
    # sigma <= accum_new^q / lr: so <= (|linear| + |g|) * lr / accum_new^q + |w|; an entry with linear and g
    # 0 keeps its weight 0 (the kernel's |linear| > l1 test), one with accum_new 0 and not both 0 is Inf.
    grad = ops.cast(grad, mstype.float32)
    head = ops.abs(ops.cast(linear, mstype.float32)) + ops.abs(grad)
    power = ops.pow(ops.cast(accum, mstype.float32) + grad * grad, q)
    ratio = ops.select(head > 0.0, head * lr / power, ops.zeros_like(head))
    return (ratio + ops.abs(ops.cast(weight, mstype.float32))).max()


@_ftrl_entry_bound.register("Tensor", "Tensor", "Tensor", "Tensor", "Number", "Number")
def _ftrl_entry_bound_tensor(grad, accum, linear, weight, q, lr):
    return _ftrl_entry_largest(grad, accum, linear, weight, q, lr)


@_ftrl_entry_bound.register("RowTensor", "Tensor", "Tensor", "Tensor", "Number", "Number")
def _ftrl_entry_bound_rows(grad, accum, linear, weight, q, lr):
    take = grad.indices
    return _ftrl_entry_largest(grad.values, ops.gather(accum, take, 0), ops.gather(linear, take, 0),
                               ops.gather(weight, take, 0), q, lr)


_grad_entries = ops.MultitypeFuncGraph("recboost_grad_entries")


@_grad_entries.register("Tensor")
def _grad_entries_tensor(grad):
    return 1.0


@_grad_entries.register("RowTensor")
def _grad_entries_rows(grad):
    # weight decay adds wd * w to each of a sparse gradient's rows; a row listed k times gets it k times
    # (the count as a Tensor: a sparse gradient's shape is dynamic)
    return (ops.cast(grad.indices, mstype.float32) * 0.0 + 1.0).sum()


def _nonfinite_flag(grads, states=(), preps=(), extra=(), small=(), small_state=None):
    """True (a bool scalar) when the step must be skipped: when a gradient of ``grads`` holds an
    Inf or a NaN, or is so large that the update could put one into the model. With T the float32
    sum of a gradient's absolute values, taken to the gradient the optimizer applies (``preps``: one
    None or ``(add, factor)`` per leading gradient, ``_prepared_total``: ``(T + add) * factor``, see
    ``_TrainStep._grad_preps``), the step is skipped when for some gradient T * T is not finite (T >
    1.8e19; for the gradients without growing states, the square of the sum of their T: one square for
    all of them, and stricter than each by at most their count), or when a bound of its growing
    optimizer states after the update is not (``states``: one
    ``(M, L, W, q, lr, D)``, with a seventh ``add``, ``(M,)`` or None per leading gradient, see
    ``_update_bound``; a table's L2 decay adds ``add`` to its T): the largest
    accumulator entry plus T * T (Adagrad, ProximalAdagrad, FTRL: ``_GROWING_STATES``; and the host
    tables' SparseAdagrad, SparseRowWiseAdagrad, SparseFtrl, whose rows' states the host sets before
    the step, ``_TrainStep.set_row_bounds``, so the whole step is skipped or applied), for FTRL the
    largest ``|linear|`` plus T plus ``max(accum + T * T, 1)^q / lr`` times the largest ``|weight|``
    (L'), and L' over a lower bound D of FTRL's new-weight divisor ``accum^q / lr + 2 l2``, or when
    one of the ``extra`` scalars is not finite (``_TrainStep._entry_bounds``).

    What that guarantees: every ``g * g`` an optimizer computes is finite (T * T bounds the square
    of every entry and of every per-row sum of a table's gradient); Adam/LazyAdam/SparseAdam's moments
    stay convex combinations of finite values and their step is bounded by the learning rate times a
    bounded factor; SGD/Momentum's step by the learning rate times T; every Adagrad/ProximalAdagrad/
    FTRL accumulator stays finite (so ``g / sqrt(accum)`` is at most 1 in size), and FTRL's
    ``accum^q / lr``, ``linear`` and new weight. The gradient an optimizer applies is bounded, not
    only the step's: MindSpore's weight decay (``+ wd * w``, ``wd`` a float or this step's schedule
    value; a sparse gradient's row listed k times gets it k times), gradient centralization (``|g -
    mean| <= 2 max|g|``), the optimizer's ``loss_scale`` (``* 1 / loss_scale``), a boost's gradient
    accumulation (the mean applied is at most T of the step's gradient plus T of the sum held), and
    table rows summed over ranks (``gradients_mean=False``: times the ranks; with it, the mean is at
    most the largest rank's T). A row-wise table's row, updated by its owner with every rank's
    gradient, is bounded by every rank against the largest row state of any rank
    (``_RankExchange.share_row_bounds``); the flag is summed over the ranks, so all skip together.
    FTRL's divisor: SparseFtrl's rows start at ``initial_accum`` > 0 and never decrease, a static D;
    dense FTRL's D comes from its smallest accumulator entry, and when its accumulators started at 0
    with ``l2 = 0`` (no such D) each entry's new weight is bounded on its own (``_ftrl_entry_bound``:
    ``(|linear| + |g|) * lr / (accum + g * g)^q + |w|``, Inf where that divisor is 0 and ``linear`` or
    ``g`` is not; exact but for the rounding of ``pow``).
    Not bounded: a complete train cell's own update (as under Model), AdaSum's and DimReduce's
    combination of the updates, optimizers other than MindSpore's and recboost's (their growing
    states are not known: only T * T is checked), and a weight whose optimizer applies its decay
    outside the gradient (AdamWeightDecay's ``w * (1 - lr * wd)``). The flag is the OR of each bound's own test
    (each bound times 0, summed: NaN when one is not finite), so bounds that are each finite never
    add up to a false Inf. On normal data every bound is finite: the same steps run, bit for bit. (A
    loop, not ``AddN(hyper_map(...))``: MindSpore cannot type that tuple when it holds RowTensors.)

    ``small`` (static indices into ``grads``, ``_TrainStep._small``): gradients of small weights,
    checked together: ``small_state`` is one state for all of them (None: no growing states; their
    entries of ``states`` are not read), and the T of those without a prep is taken at once, their
    flat entries concatenated and summed (``_flat_total``). T only ever enters a sum (of the gradients
    without growing states, or ``_stacked_bound_flag``'s, where each state is bounded with the sum of
    its group's T), so this bounds what checking them one by one does, in a few ops for all of them,
    not a few each (``small`` empty: each gradient on its own)."""
    plain = ()                                      # T of the gradients without growing states
    accumulated, grown = ((), ()), ((), ())         # (T, state) of those with (M,) and with six
    added = ((), ())                                # (T, state) of those with seven (an add: row inputs only)
    flat = ((), (), ())                             # per group, the flat pieces of the small gradients
    for i, grad in enumerate(grads):
        prep = preps[i] if i < len(preps) else None
        state = small_state if i in small else states[i] if i < len(states) else None
        group = 0 if state is None else len(state) // 6 + len(state) // 7 + 1     # (0 plain, 1 (M,), 2 six, 3 seven)
        taken = i in small and prep is None
        if taken:
            flat = flat[:group] + (flat[group] + (ops.cast(grad, mstype.float32).reshape((-1,)),),) + flat[group + 1:]
        bounds = () if taken else (_prepared_total(_grad_total(grad), prep),)
        held = () if i in small else (state,)       # (small_state is added once, below)
        if group == 0:
            plain += bounds
        elif group == 1:
            accumulated = (accumulated[0] + bounds, accumulated[1] + held)
        elif group == 2:
            grown = (grown[0] + bounds, grown[1] + held)
        else:
            added = (added[0] + bounds, added[1] + held)
    if len(small) > 0 and small_state is not None:
        if len(small_state) == 1:
            accumulated = (accumulated[0], accumulated[1] + (small_state,))
        else:
            grown = (grown[0], grown[1] + (small_state,))
    plain += (_flat_total(flat[0]),) if len(flat[0]) > 0 else ()
    terms = ()                                      # each finite exactly when its bounds are
    if len(plain) > 0:
        summed = _scalar_sum(plain)
        terms += (summed * summed,)
    if len(accumulated[1]) > 0:                     # (static: no op for a network without growing states)
        terms += (_stacked_bound_flag(accumulated[0] + ((_flat_total(flat[1]),) if len(flat[1]) > 0 else ()),
                                      accumulated[1]),)
    if len(grown[1]) > 0:
        terms += (_stacked_bound_flag(grown[0] + ((_flat_total(flat[2]),) if len(flat[2]) > 0 else ()),
                                      grown[1]),)
    if len(added[1]) > 0:
        terms += (_stacked_bound_flag(added[0], added[1]),)
    for term in extra:
        terms += (term * 0.0,)
    return ops.logical_not(ops.isfinite(_scalar_sum(terms)))


class _TrainStep(nn.TrainOneStepCell):
    """The train step shared by every recboost train cell (see the section comment).

    Subclasses call ``nn.TrainOneStepCell.__init__`` and then :meth:`_init_step`; they change only
    :meth:`_apply_gradients` (how gradients update the weights) or, for whole-step variants,
    set ``freeze`` / ``enable_enhanced_amp`` and provide those steps.
    """

    def _init_step(self, where, scale_sense=_UNSCALED, row_inputs=(), row_growth=None, row_pooled=None):
        """``scale_sense``: ``_UNSCALED`` for an unscaled step (backward scale ``self.sens``, returns the loss);
        a Cell or Tensor for loss scaling; ``None`` for a fixed scale of exactly 1 (no scaling pass,
        the overflow check still guards the update)."""
        self.hyper_map = ops.HyperMap()
        self.loss_scaling_manager = None
        self._scaled = scale_sense is not _UNSCALED
        self._unit_scale = scale_sense is None
        if self._unit_scale:
            self.scale_sense = Parameter(Tensor(np.float32(1.0)), name="scale_sense", requires_grad=False)
        elif isinstance(scale_sense, nn.Cell):
            if not hasattr(scale_sense, "get_loss_scale"):
                _fail(where, "'scale_sense'", "a loss scale update cell with get_loss_scale()",
                      type(scale_sense).__name__, TypeError)
            _check_sparse_scale(where, self.network, scale_sense)
            self.loss_scaling_manager = scale_sense
            self.scale_sense = Parameter(Tensor(scale_sense.get_loss_scale(), mstype.float32),
                                         name="scale_sense")
        elif isinstance(scale_sense, Tensor):
            if scale_sense.shape not in ((), (1,)):
                _fail(where, "the shape of 'scale_sense'", "(1,) or ()", scale_sense.shape)
            self.scale_sense = Parameter(scale_sense, name="scale_sense")
        elif self._scaled:
            _fail(where, "'scale_sense'", "a Cell, a Tensor or None", type(scale_sense).__name__, TypeError)
        if not isinstance(row_inputs, (list, tuple)) or \
                not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in row_inputs):
            _fail(where, "'row_inputs'", "a tuple of input positions (ints >= 0)", row_inputs, TypeError)
        if row_inputs and not self._scaled:
            _fail(where, "'row_inputs'", "empty for a step without loss scaling (table rows need the "
                  "overflow guard)", row_inputs)
        self.row_inputs = tuple(row_inputs)
        #: per row input, its rows' growing states (``_LARGEST``'s prefix: what the check reads of its bounds)
        self.row_growth = _check_row_growth(where, row_growth, len(self.row_inputs))
        self._row_widths = tuple(len(g) for g in self.row_growth)         # (the graph reads ints)
        #: per row input, whether a row of its gradient can reach one table row more than once (bags)
        self.row_pooled = _check_row_pooled(where, row_pooled, len(self.row_inputs))
        if self.row_inputs:
            self.grad_all = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)
        self.is_distributed = self.parallel_mode not in (ms.ParallelMode.STAND_ALONE,)
        self.allreduce = ops.AllReduce() if self.is_distributed else None
        self.freeze = False
        self.enable_enhanced_amp = False
        #: the optimizer's growing states (``_growing_states``), read by the overflow check
        self._growth = _growing_states(self.optimizer)
        self._init_bounds()
        #: the rows' growing states, one ``_GrowthBound`` per ``row_inputs`` entry (float32
        #: ``[len(row_inputs), 7]``), set by the host before each step (:meth:`set_row_bounds`); None
        #: when no entry's rows grow
        self.row_bounds = Parameter(Tensor(np.tile(np.float32(_NO_GROWTH), (len(self.row_inputs), 1))),
                                    name=_ROW_BOUNDS, requires_grad=False) if any(self.row_growth) else None
        self._row_bounds_set = None         # the bounds last set (set_row_bounds)
        #: per row input, at most how many times one of its gradient's rows reaches one table row
        #: (``_TableBatch.gradient_factor``), set by the host before each step (:meth:`set_row_bounds`)
        self.row_factors = Parameter(Tensor(np.ones(len(self.row_inputs), np.float32)), name=_ROW_FACTORS,
                                     requires_grad=False) if any(self.row_pooled) else None
        self._row_factors_set = None

    def _init_bounds(self):
        """The static facts the overflow check needs about how the optimizer changes a gradient
        before applying it (``_grad_preps``) and about FTRL's divisor (``_growth_states``)."""
        opt = self.optimizer
        #: per weight: whether the optimizer adds weight decay to its gradient (``decay_weight``)
        self._decayed = tuple(bool(getattr(opt, "exec_weight_decay", False)) and bool(opt.decay_flags[i])
                              for i in range(len(self.weights)))
        self._any_decay = any(self._decayed)
        recip = float(opt.reciprocal_scale.asnumpy()) if getattr(opt, "need_scale", False) else 1.0
        centralized = getattr(opt, "grad_centralization_flags", ()) if getattr(opt, "is_group", False) else ()
        #: per weight: the factor of gradient centralization (2: ``|g - mean| <= 2 max|g|``) times the
        #: optimizer's ``1 / loss_scale``
        self._grad_factor = tuple(recip * (2.0 if i < len(centralized) and centralized[i] and len(w.shape) > 1
                                           and w.shape[1] % 16 == 0 else 1.0)
                                  for i, w in enumerate(self.weights))
        #: the factor of the row gradients: the ranks' count when they are summed over ranks
        self._row_factor = float(getattr(self, "degree", 1)) if getattr(self, "reducer_flag", False) and \
            not _reducer_mean(self) else 1.0
        #: the weights of at most ``_SMALL_GRADIENT`` entries, whose T the check takes together
        #: (``_nonfinite_flag``'s ``small``); none when a gradient may be sparse: MindSpore cannot type a
        #: concatenation of the gradients of a network that has sparse ones
        self._small = () if _sparse_gradients_possible(self.network) else \
            tuple(i for i, w in enumerate(self.weights) if int(np.prod(w.shape)) <= _SMALL_GRADIENT)
        #: dense FTRL: per weight a lower bound of the new-weight divisor (``_ftrl_divisor``) from the
        #: smallest accumulator entry, or with accumulators starting at 0 and ``l2 = 0`` (no such bound)
        #: the per-entry bound ``_ftrl_entry_bound`` (``_entry_bounds``)
        self._ftrl_entries = self._growth is not None and self._growth.linear is not None and \
            self._growth.q > 0 and self._growth.l2 == 0 and \
            min(float(a.asnumpy().min()) for a in getattr(opt, self._growth.accum)) == 0.0

    def set_row_bounds(self, bounds, factors=None):
        """Set the growing optimizer states of the next step's table rows (recboost's host tables, see
        :class:`HashEmbedding`): float32 ``[len(row_inputs), 7]``, per ``row_inputs`` entry the
        ``(largest accumulator, largest |linear|, largest |weight|, q, lr, D, add)`` of the rows the step
        updates (``_StepPipeline.row_bounds``, D a lower bound of FTRL's divisor, ``add`` a bound of what
        L2 decay adds to each gradient entry, read when :attr:`row_growth` names it); the overflow check
        then skips a step whose update would make one of them non-finite (see ``_nonfinite_flag``).
        Nothing to set when ``bounds`` is None or no entry of :attr:`row_growth` grows. ``factors``
        (float32 ``[len(row_inputs)]``, None: unchanged, initially ones): per row input, at most how
        many times one row of its gradient reaches one table row (bags: ``_TableBatch.gradient_factor``,
        e.g. an id repeated in a "sum" bag); the check bounds the rows' gradient by it."""
        if factors is not None and self.row_factors is not None:
            factors = np.ascontiguousarray(factors, np.float32)
            if self._row_factors_set is None or not np.array_equal(factors, self._row_factors_set):
                self.row_factors.set_data(Tensor(factors))
                self._row_factors_set = factors
        if bounds is None or self.row_bounds is None:
            return
        bounds = np.ascontiguousarray(bounds, np.float32)
        if self._row_bounds_set is None or not np.array_equal(bounds, self._row_bounds_set):
            self.row_bounds.set_data(Tensor(bounds))       # (bounds are powers of two: seldom changed)
            self._row_bounds_set = bounds

    def _growth_states(self, small=()):
        """``(states, small_state)``: per weight, the ``_update_bound`` state of its growing optimizer
        states (None when its optimizer has none), then per row input its row of :attr:`row_bounds`;
        the weights of ``small`` (``_nonfinite_flag``'s) get None there and one state for all of them,
        ``small_state``, from their states' entries concatenated (the largest accumulator entry,
        ``|linear|`` and ``|weight|``, the smallest divisor: it bounds each of theirs), a few ops for
        all of them (None when ``small`` is empty or the optimizer has no growing states)."""
        states, small_state = (), None
        if self._growth is not None:
            accums = getattr(self.optimizer, self._growth.accum)
            linears = accums if self._growth.linear is None else getattr(self.optimizer, self._growth.linear)
            pieces = ((), (), ())
            for i in range(len(self.weights)):
                if i in small:
                    states += (None,)
                    pieces = (pieces[0] + (accums[i].reshape((-1,)),), pieces[1] + (linears[i].reshape((-1,)),),
                              pieces[2] + (self.weights[i].reshape((-1,)),))
                else:
                    states += (self._growth_state(accums[i], linears[i], self.weights[i]),)
            if len(small) > 0:
                joined = ()
                for piece in pieces:
                    joined += (piece[0] if len(piece) == 1 else ops.concat(piece),)
                small_state = self._growth_state(joined[0], joined[1], joined[2])
        elif self.row_inputs:
            for i in range(len(self.weights)):
                states += (None,)
        if self.row_bounds is None:
            return states + (None,) * len(self.row_inputs), small_state
        bounds = self.row_bounds * 1.0
        for i in range(len(self.row_inputs)):
            if self._row_widths[i] == 0:
                states += (None,)
            elif self._row_widths[i] == 1:
                states += ((bounds[i][0],),)
            elif self._row_widths[i] < len(_BOUND_FIELDS):
                states += ((bounds[i][0], bounds[i][1], bounds[i][2], bounds[i][3], bounds[i][4], bounds[i][5]),)
            else:                       # (a table with L2 decay reads it: its add too)
                states += ((bounds[i][0], bounds[i][1], bounds[i][2], bounds[i][3], bounds[i][4], bounds[i][5],
                            bounds[i][6]),)
        return states, small_state

    def _growth_state(self, accum, linear, weight):
        """The ``_update_bound`` state of a weight with the growing optimizer states ``accum`` and
        ``linear`` (``(M,)``, or FTRL's six)."""
        m = ops.cast(accum.max(), mstype.float32)
        if self._growth.linear is None:
            return (m,)
        return (m, ops.cast(ops.abs(linear).max(), mstype.float32), ops.cast(ops.abs(weight).max(), mstype.float32),
                self._growth.q, self._growth.lr, self._ftrl_divisor(accum))

    def _ftrl_divisor(self, accum):
        """Dense FTRL: a lower bound of the new-weight divisor of a weight whose accumulator is
        ``accum`` (``_ftrl_divisor`` in the graph: its smallest entry, lowered by ``_DIVISOR_MARGIN``);
        +Inf (no bound here) when ``_entry_bounds`` bounds the new weights instead."""
        if self._ftrl_entries:
            return _NO_DIVISOR
        q, lr, l2 = self._growth.q, self._growth.lr, self._growth.l2
        smallest = ops.cast(accum.min(), mstype.float32)
        return (ops.pow(smallest, q) / lr + 2.0 * l2) * _DIVISOR_MARGIN

    def _grad_preps(self, grads):
        """Per gradient of ``grads`` (the weights', then the row inputs'), how the gradient the
        optimizer applies relates to it, for ``_prepared_total``: None (the same) or ``(add,
        factor)``. The optimizer's weight decay adds ``|wd| * max|w|`` per entry (``decay_weight``,
        its ``get_weight_decay()`` of this step, a float or a schedule); gradient centralization and
        the optimizer's loss scale multiply (``_grad_factor``); a boost's accumulation adds the
        accumulated mean (:meth:`_held_total`); row gradients multiply by their factor (how many times
        a gradient row reaches a table row, :attr:`row_factors`) and, summed over ranks, by the ranks
        (``_row_factor``)."""
        preps = ()
        decay = self.optimizer.get_weight_decay() if self._any_decay else 0.0
        holds = self._holds()
        for i in range(len(self.weights)):
            if self._decayed[i] or holds:                # (static: no test of a Tensor against None)
                add = self._held_total(i)
                if self._decayed[i]:
                    rate = decay[i] if isinstance(decay, tuple) else decay
                    term = ops.abs(ops.cast(rate, mstype.float32)) * ops.cast(ops.abs(self.weights[i]).max(),
                                                                               mstype.float32)
                    add = add + term * _grad_entries(grads[i])
                preps += ((add, self._grad_factor[i]),)
            elif self._grad_factor[i] == 1.0:
                preps += (None,)
            else:
                preps += ((0.0, self._grad_factor[i]),)
        for k in range(len(self.row_inputs)):
            if self.row_pooled[k]:                      # (static: no factor for rows no bag reaches twice)
                factor = self.row_factors[k]
                preps += ((0.0, factor if self._row_factor == 1.0 else factor * self._row_factor),)
            elif self._row_factor != 1.0:
                preps += ((0.0, self._row_factor),)
            else:
                preps += (None,)
        return preps

    def _holds(self):
        """Whether the step adds something held to the gradients before applying them (the boost
        cells' accumulation overrides this and :meth:`_held_total`)."""
        return False

    def _held_total(self, i):
        """T of what the step adds to weight ``i``'s gradient before applying it (0: nothing)."""
        return 0.0

    def _entry_bounds(self, grads):
        """Dense FTRL with accumulators starting at 0 and ``l2 = 0``: per weight the largest bound of
        its new weights, entry by entry (``_ftrl_entry_bound``); else none."""
        bounds = ()
        if self._ftrl_entries:
            accums = getattr(self.optimizer, self._growth.accum)
            linears = getattr(self.optimizer, self._growth.linear)
            for i in range(len(self.weights)):
                bounds += (_ftrl_entry_bound(grads[i], accums[i], linears[i], self.weights[i],
                                             self._growth.q, self._growth.lr),)
        return bounds

    # ---- the step ----------------------------------------------------------------------------------
    def construct(self, *inputs):
        if self.freeze:
            return self.gradient_freeze_process(*inputs)
        if self.enable_enhanced_amp:
            return self._enhanced_amp_step(*inputs)
        loss = self.network(*inputs)
        if not self._scaled:
            sens = ops.fill(loss.dtype, loss.shape, self.sens)
            grads, _ = self._gradients(inputs, sens)
            return self._apply_gradients(loss, self.grad_reducer(grads), sens, *inputs)
        if self._unit_scale:
            sens = ops.ones_like(loss)
        else:
            sens = ops.ones_like(loss) * ops.cast(self.scale_sense, ops.dtype(loss))
        grads, rows = self._gradients(inputs, sens)
        grads = self.grad_reducer(grads)
        status, grads = self.start_overflow_check(loss, grads)
        overflow = self.process_loss_scale(self.get_overflow_status(status, grads + rows))
        if not overflow:
            loss = self._apply_gradients(loss, grads, ops.ones_like(loss), *inputs)
        return (loss, overflow, ops.depend(self.scale_sense, overflow) * 1.0) + rows

    def _gradients(self, inputs, sens):
        """``(weight gradients, gradients of the row_inputs)``, unscaled."""
        rows = ()
        if self.row_inputs:
            input_grads, grads = self.grad_all(self.network, self.weights)(*inputs, sens)
            for i in self.row_inputs:
                rows += (input_grads[i],)
        else:
            grads = self.grad(self.network, self.weights)(*inputs, sens)
        if self._scaled and not self._unit_scale:
            inv_scale = ops.reciprocal(self.scale_sense)
            grads = self.hyper_map(ops.partial(_grad_unscale, inv_scale), grads)
            if self.row_inputs:
                rows = self.hyper_map(ops.partial(_grad_unscale, inv_scale), rows)
        return grads, rows

    def _apply_gradients(self, loss, grads, sens, *inputs):
        """Update the weights with ``grads`` (reduced and unscaled); returns the loss."""
        return ops.depend(loss, self.optimizer(grads))

    # ---- MindSpore's overridable pieces (same names and signatures) --------------------------------
    def start_overflow_check(self, pre_cond, compute_input):
        """Start the overflow check after ``pre_cond``; returns ``(status, compute_input)``. The check
        here is a finite test of the gradients, so ``status`` carries no device state."""
        status = Tensor([0] * 8, mstype.int32)
        return ops.depend(status, pre_cond), compute_input

    def get_overflow_status(self, status, compute_output):
        """True when a gradient of ``compute_output`` (on any device) holds an Inf or a NaN."""
        states, small_state = self._growth_states(self._small)
        flag = _nonfinite_flag(compute_output, states, self._grad_preps(compute_output),
                               self._entry_bounds(compute_output), self._small, small_state)
        if self.is_distributed:
            flag = self.allreduce(ops.cast(flag, mstype.float32)) > 0
        return flag

    def process_loss_scale(self, overflow):
        """Let the update cell (if any) update the scale; returns ``overflow``."""
        if self.loss_scaling_manager is not None:
            return self.loss_scaling_manager(self.scale_sense, overflow)
        return overflow

    def set_sense_scale(self, sens):
        """Set the loss scale (a Tensor of the same shape and type as the current one)."""
        where = type(self).__name__
        if not self._scaled or self._unit_scale:
            _fail(where, "the cell", "made with a scale Tensor or update cell to set its scale", "no scale")
        if not isinstance(sens, Tensor):
            _fail(where, "'sens'", "a Tensor", type(sens).__name__, TypeError)
        self.scale_sense.set_data(sens)


class TrainOneStepWithLossScaleCell(_TrainStep):
    """One training step with loss scaling that works on every device, CPU included.

    Same name, arguments and outputs as ``mindspore.nn.TrainOneStepWithLossScaleCell``, whose
    overflow check calls an Ascend-only op; here the check is a finite test of the unscaled
    gradients (summed over devices in data-parallel mode), so the result is the same everywhere. It
    also flags a finite gradient so large that the update could put an Inf or a NaN into a
    parameter, an optimizer state or a table row (the square of the sum of its absolute values is not
    finite, or an accumulator of Adagrad, ProximalAdagrad or FTRL, or of the rows, plus that square is
    not: see ``_nonfinite_flag``), e.g. from features of magnitude 1e30.
    Sparse gradients (``RowTensor``, e.g. of ``nn.EmbeddingLookup(sparse=True)``) are unscaled and
    checked too. Subclasses may override ``start_overflow_check(pre_cond, compute_input)``,
    ``get_overflow_status(status, compute_output)`` and ``process_loss_scale(overflow)`` as in MindSpore.

    Args:
        network (Cell): the network with its loss (single output).
        optimizer (Cell): the optimizer.
        scale_sense (Union[Cell, Tensor, None]): an update cell (:class:`DynamicLossScaleUpdateCell`,
            :class:`FixedLossScaleUpdateCell`, or MindSpore's) that updates the scale on the device; a
            Tensor of shape () or (1,) holding a scale the host sets with :meth:`set_sense_scale`; or
            None (recboost): the scale is exactly 1, no scaling pass runs, and the overflow check still
            guards the update.
        row_inputs (tuple[int]): positions of network inputs whose gradients the step also returns
            (recboost; the ready rows of host hash tables, see :class:`HashEmbedding`). They are
            unscaled and part of the overflow check, with the optimizer states of their rows that the
            host sets before each step (:meth:`set_row_bounds`; RecModel does).
        row_growth (tuple, optional): per ``row_inputs`` entry, the growing optimizer states of its
            rows (recboost: a sparse optimizer's ``grows``): ``()`` when they do not grow (Adam's, SGD's:
            the check then reads no bounds for them), ``("accum",)`` for an accumulator alone
            (Adagrad's), ``("accum", "linear", "weight")`` for FTRL's, and ``("accum", "linear", "weight",
            "add")`` when a table reading it has L2 ``weight_decay`` (the check then adds the bounds' ``add``
            to the gradient's T). None (default): every entry may grow as FTRL's with a decay, and the host
            sets each one's bounds.
        row_pooled (tuple, optional): per ``row_inputs`` entry, whether one row of its gradient can
            reach one table row more than once (recboost: a table with a combiner reads it, pooling
            bags). False: the check takes that gradient as it is and reads no factor for it; None
            (default): every entry may, and the host sets each one's factor (:meth:`set_row_bounds`).

    Outputs:
        (loss, overflow, scale, \\*row_gradients): the loss of this step, a bool scalar that is True when
        a gradient was not finite or too large (above), the loss scale after this step's update (the
        one the next step uses), and one gradient per ``row_inputs`` entry. On an overflow step the optimizer does not
        run: every parameter and optimizer state is left untouched.
    """

    def __init__(self, network, optimizer, scale_sense, row_inputs=(), row_growth=None, row_pooled=None):
        super().__init__(network, optimizer, sens=None)
        self._init_step("TrainOneStepWithLossScaleCell", scale_sense, row_inputs, row_growth, row_pooled)


class _OptimizerUnscaledStep(TrainOneStepWithLossScaleCell):
    """``FixedLossScaleManager(scale, drop_overflow_update=False)`` with hash tables: MindSpore's
    ``TrainOneStepCell(network, optimizer, sens=scale)`` (what ``build_train_network`` builds for that
    manager), whose optimizer divides the dense gradients by its ``loss_scale`` (``RecModel`` checks it
    is ``scale``), with the tables' row gradients (``row_inputs``) multiplied by the same float32
    ``1 / loss_scale`` the optimizer multiplies by, and recboost's overflow guard (a step that would put
    a non-finite value into the model changes nothing). Outputs as :class:`TrainOneStepWithLossScaleCell`'s."""

    def __init__(self, network, optimizer, scale, row_inputs, row_growth, row_pooled):
        super().__init__(network, optimizer, Tensor(np.float32(scale)), row_inputs, row_growth, row_pooled)
        #: MindSpore's ``Optimizer.reciprocal_scale``: ``Tensor(1.0 / loss_scale, float32)``
        self.row_unscale = Tensor(1.0 / float(getattr(optimizer, "loss_scale", 1.0)), mstype.float32)

    def _gradients(self, inputs, sens):
        """``(weight gradients scaled, as the optimizer expects them; row gradients unscaled)``."""
        input_grads, grads = self.grad_all(self.network, self.weights)(*inputs, sens)
        rows = ()
        for i in self.row_inputs:
            rows += (input_grads[i],)
        return grads, self.hyper_map(ops.partial(_grad_unscale, self.row_unscale), rows)


# =====================================================================================================
# Boost algorithms
# =====================================================================================================
# Same names and arguments as ``mindspore.boost``; everything runs on CPU in GRAPH mode. Cells read
# their configuration from the AutoBoost that processed the optimizer (``optimizer._recboost_boost``)
# or from an explicit ``boost=`` argument: there is no process-wide state.
# The boost train cells check for an ``AutoBoost`` (the next section), which in turn builds these
# algorithms.
_boost_accumulate = ops.MultitypeFuncGraph("recboost_boost_accumulate")


@_boost_accumulate.register("Number", "Tensor", "Tensor")
def _boost_accumulate_tensor(steps, acc, grad):
    return ops.assign_add(acc, grad / steps)


_boost_zero = ops.MultitypeFuncGraph("recboost_boost_zero")


@_boost_zero.register("Tensor")
def _boost_zero_tensor(acc):
    return ops.assign(acc, ops.zeros_like(acc))


_boost_assign = ops.MultitypeFuncGraph("recboost_boost_assign")


@_boost_assign.register("Tensor", "Tensor")
def _boost_assign_tensor(dst, src):
    return ops.assign(dst, src)


_boost_sub = ops.MultitypeFuncGraph("recboost_boost_sub")


@_boost_sub.register("Tensor", "Tensor")
def _boost_sub_tensor(a, b):
    return a - b


_boost_gc = ops.MultitypeFuncGraph("recboost_boost_gc")


@_boost_gc.register("Bool", "Tensor")
def _boost_gc_tensor(flag, grad):
    """Gradient centralization, MindSpore's rule (``_tensor_apply_grad_centralization``): subtract the
    mean over every axis but the first from a gradient of ndim >= 2 whose ``shape[1]`` is a multiple
    of 16; any other gradient (an ``[N, 1]`` table, a ``[k, 8]`` weight) is left as it is."""
    if flag and grad.ndim >= 2 and grad.shape[1] % 16 == 0:
        return grad - grad.mean(axis=tuple(range(1, grad.ndim)), keep_dims=True)
    return grad


class _CPUGradCentralization:
    """Mixin replacing MindSpore's Ascend-only Centralization op in ``Optimizer.gradients_centralization``."""

    def gradients_centralization(self, gradients):
        if self.is_group:
            return self.map_(ops.partial(_boost_gc), self.grad_centralization_flags, gradients)
        return gradients


def _with_cpu_grad_centralization(cls):
    if issubclass(cls, _CPUGradCentralization):
        return cls
    return type("GC" + cls.__name__, (_CPUGradCentralization, cls), {"__module__": __name__})


class _CommonHeadLastFN(nn.Cell):
    """LessBN's full-normalization head: ``multiplier * (norm(x) @ norm(W).T + b)`` (reuses W and b)."""

    def __init__(self, dense):
        super().__init__(auto_prefix=False)
        self.weight = dense.weight
        self.has_bias = dense.has_bias
        if self.has_bias:
            self.bias = dense.bias
        self.multiplier = Parameter(Tensor(np.ones([1], np.float32)), name=dense.weight.name + "_fn_multiplier")
        self.matmul = ops.MatMul(transpose_b=True)

    @staticmethod
    def _inverse_norms(x):
        # 1 / max(||row||, 1e-6), as L2Normalize(axis=1) divides (its backward takes seconds per step on CPU)
        return ops.rsqrt(ops.maximum((x * x).sum(axis=1, keepdims=True), 1e-12))

    def construct(self, x):
        # computed in float32 (the norms overflow and the 1e-12 floor vanishes in float16), returned
        # in the precision of the layer it replaces (float16 under amp). norm(x) @ norm(W).T is
        # computed as (x @ norm(W).T) / ||x||: the same numbers without a normalized copy of x, whose
        # forward and backward passes cost ~10% of a Wide&Deep step with two heads on CPU.
        dtype = ops.dtype(x)
        x = ops.cast(x, mstype.float32)
        x = self.matmul(x, self.weight * self._inverse_norms(self.weight)) * self._inverse_norms(x)
        if self.has_bias:
            x = x + self.bias
        return ops.cast(self.multiplier * x, dtype)


class LessBN(nn.Cell):
    """LessBN: marks the network for MindSpore's less-BN pass and, with ``fn_flag``, replaces the last
    ``nn.Dense`` of each cell that holds Dense layers by a full-normalization head (its weight and bias
    are kept; MindSpore drops the bias and misses ``SequentialCell`` members).

    Args:
        network (Cell): the network. fn_flag (bool): replace the last FC by FN. Default False.
    """

    def __init__(self, network, fn_flag=False):
        super().__init__(auto_prefix=False)
        if not isinstance(network, nn.Cell):
            _fail("LessBN", "'network'", "a Cell", type(network).__name__, TypeError)
        fn_flag = _check_bool("LessBN", "fn_flag", fn_flag)
        self.network = network
        if "less_bn" not in network.get_flags():
            network.add_flags(less_bn=True)
            if fn_flag:
                self._convert(network)

    @staticmethod
    def _convert(net):
        cells = net.name_cells()
        dense = [name for name, cell in cells.items() if isinstance(cell, nn.Dense)]
        for name, cell in cells.items():
            if cell is not net and not isinstance(cell, nn.Dense):
                LessBN._convert(cell)
        if dense:
            net.insert_child_to_cell(dense[-1], _CommonHeadLastFN(cells[dense[-1]]))
            if isinstance(net, nn.SequentialCell):
                net.cell_list = list(net.cells())

    def construct(self, *inputs):
        return self.network(*inputs)


class GradientAccumulation(nn.Cell):
    """Accumulate ``grads / max_accumulation_step`` and run ``optimizer`` on every k-th call.

    Inputs ``(loss, grads)``; returns ``loss``. k calls on k equal batches give the update of one call
    on their concatenation (for a mean loss).
    """

    def __init__(self, max_accumulation_step, optimizer):
        super().__init__(auto_prefix=False)
        self._max_accumulation_step = _check_int("GradientAccumulation", "max_accumulation_step",
                                                 max_accumulation_step, 1)
        if not isinstance(optimizer, nn.Cell) or not hasattr(optimizer, "parameters"):
            _fail("GradientAccumulation", "'optimizer'", "an optimizer Cell", type(optimizer).__name__, TypeError)
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.hyper_map = ops.HyperMap()
        self._steps = float(self._max_accumulation_step)
        self._grad_accumulation = self.weights.clone(prefix="grad_accumulation", init="zeros")
        self._accumulation_step = Parameter(Tensor(0, mstype.int32), name="accumulation_step")

    def construct(self, loss, grads):
        loss = ops.depend(loss, self.hyper_map(ops.partial(_boost_accumulate, self._steps),
                                               self._grad_accumulation, grads))
        loss = ops.depend(loss, ops.assign_add(self._accumulation_step, Tensor(1, mstype.int32)))
        if self._accumulation_step >= self._max_accumulation_step:
            loss = ops.depend(loss, self.optimizer(self._grad_accumulation))
            loss = ops.depend(loss, self.hyper_map(_boost_zero, self._grad_accumulation))
            loss = ops.depend(loss, ops.assign(self._accumulation_step, Tensor(0, mstype.int32)))
        return loss


class OptimizerProcess:
    """Rebuild an optimizer for boost: grouped parameters and gradient centralization (GC).

    GC runs on CPU (MindSpore's Centralization op is Ascend-only) and selects what MindSpore's does: only
    an optimizer given parameter groups gets it (a flat parameter list gets nothing, with MindSpore's
    warning); in each group the weights that are not bias/beta/gamma, grouped convolutions or the FN
    head; and of those, each gradient of ndim >= 2 whose ``shape[1]`` is a multiple of 16 loses its
    mean over all axes but the first (``_boost_gc_tensor``).
    """

    def __init__(self, opt):
        self._factory = _optimizer_factory(opt, "OptimizerProcess")
        self.is_lars = self._factory[3] is not None
        self.opt_class, self.opt_init_args, self.learning_rate = self._factory[:3]
        self.origin_params = opt.init_params["params"]
        self._gc = False

    @staticmethod
    def build_params_dict(network):
        """``id(parameter) -> the cell that owns it``."""
        return {id(par): cell for _, cell in network.cells_and_names()
                for par in cell.get_parameters(expand=False)}

    @staticmethod
    def build_gc_params_group(params_dict, parameters):
        """Split each group into a GC part (``grad_centralization: True``) and the rest."""
        out = []
        for group in parameters:
            if "order_params" in group:
                out.append(group)
                continue
            gc_params, other = [], []
            for param in group["params"]:
                cell = params_dict.get(id(param))
                skip = any(tag in param.name for tag in ("beta", "gamma", "bias")) or isinstance(
                    cell, _CommonHeadLastFN) or (isinstance(cell, nn.Conv2d) and cell.group > 1)
                (other if skip else gc_params).append(param)
            for params, gc in ((gc_params, True), (other, False)):
                if params:
                    new = {k: v for k, v in group.items() if k != "params"}
                    new["params"] = params
                    if gc:
                        new["grad_centralization"] = True
                    out.append(new)
        return out

    def add_grad_centralization(self, network):
        """Turn GC on for the network's weights in each parameter group. As in MindSpore, an optimizer
        given a flat parameter list gets no GC (logged once)."""
        params = list(self.origin_params) if self.origin_params is not None else []
        if not params:
            raise ValueError("For 'OptimizerProcess', the optimizer has an empty parameter list.")
        if isinstance(params[0], Parameter):
            _log("OptimizerProcess: only group parameters support gradient centralization (as in MindSpore); "
                 "the optimizer was given a flat parameter list, so none is applied")
            return
        if not isinstance(params[0], dict):
            _fail("OptimizerProcess", "the optimizer parameters", "Parameters or dicts", type(params[0]).__name__,
                  TypeError)
        self.origin_params = OptimizerProcess.build_gc_params_group(self.build_params_dict(network), params)
        self._gc = True

    def generate_new_optimizer(self):
        """A new optimizer of the same class and hyper-parameters over ``origin_params``."""
        cls, kwargs, lr, lars = self._factory
        if self._gc:
            cls = _with_cpu_grad_centralization(cls)
        return _rebuild_optimizer((cls, kwargs, lr, lars), self.origin_params)


class ParameterProcess:
    """Parameter helpers for boost: regrouping new parameters like the optimizer's groups, and
    gradient split points (``comm_fusion``)."""

    def __init__(self):
        self._parameter_indices = 1

    @staticmethod
    def generate_group_params(parameters, origin_params):
        """Group ``parameters`` (matched by name) like the optimizer's ``origin_params`` groups."""
        origin = list(origin_params) if origin_params is not None else []
        if not origin:
            raise ValueError("For 'ParameterProcess', the optimizer has an empty parameter list.")
        if isinstance(origin[0], Parameter):
            return [{"params": list(parameters)}]
        if not isinstance(origin[0], dict):
            _fail("ParameterProcess", "'origin_params'", "Parameters or dicts", type(origin[0]).__name__, TypeError)
        by_name = {param.name: param for param in parameters}
        left = [param.name for param in parameters]
        out, richest = [], None
        for group in origin:
            new = {k: v for k, v in group.items() if k not in ("params", "order_params")}
            if "order_params" in group:
                new["order_params"] = list(parameters)
                out.append(new)
                continue
            new["params"] = [by_name[p.name] for p in group["params"] if p.name in by_name]
            for p in new["params"]:
                left.remove(p.name)
            if new["params"]:
                out.append(new)
            if richest is None or len(group) > len(richest):
                richest = group
        if left:
            extra = {k: v for k, v in (richest or {}).items() if k not in ("params", "order_params")}
            extra["params"] = [by_name[name] for name in left]
            out.append(extra)
        return out

    def assign_parameter_group(self, parameters, split_point=None):
        """Set ``comm_fusion`` so gradients are fused between the split points (default: the middle)."""
        if not isinstance(parameters, (list, tuple)) or not parameters:
            return parameters
        points = set(split_point) if split_point else {len(parameters) // 2}
        for i, param in enumerate(parameters):
            if i in points:
                self._parameter_indices += 1
            param.comm_fusion = self._parameter_indices
        return parameters


class _ScaleBackward(nn.Cell):
    """Identity forward; the backward gradient is multiplied by ``scale``."""

    def construct(self, x, scale):
        return x

    def bprop(self, x, scale, out, dout):
        return dout * ops.cast(scale, dout.dtype), ops.zeros_like(scale)


class GroupLossScaleManager(nn.Cell):
    """Per-layer-group dynamic loss scales (enhanced mixed precision).

    Place ``manager(x, layer1, layer2)`` between layer groups in the forward pass: the gradient
    flowing back through it is multiplied by ``scale[layer1] / scale[layer2]``, so group ``g``'s
    gradients carry ``scale[g]``. ``BoostTrainOneStepWithLossScaleCell`` checks overflow per group,
    updates each scale (x 2**-0.5 on overflow, else x 2**(1/1000)) and unscales per group.

    Args:
        init_loss_scale (Number or list): initial scale (per group when a list).
        loss_scale_groups (list of lists of Parameter): the groups, in forward order.
    """

    def __init__(self, init_loss_scale, loss_scale_groups):
        super().__init__()
        self._loss_scale = init_loss_scale
        self.loss_scale_groups = loss_scale_groups
        self.loss_scale_number = 0
        self.dynamic_loss_scale = None
        self._scale_backward = _ScaleBackward()

    def set_loss_scale_status(self, loss_scale_number, init_loss_scale):
        """Create ``loss_scale_number + 2`` scales: 1.0 at both ends, ``init_loss_scale`` between."""
        self.loss_scale_number = _check_int("GroupLossScaleManager", "loss_scale_number", loss_scale_number, 0)
        values = [1.0] * (self.loss_scale_number + 2)
        inits = init_loss_scale if isinstance(init_loss_scale, (list, tuple)) else \
            [init_loss_scale] * self.loss_scale_number
        for i, value in enumerate(inits[:self.loss_scale_number]):
            values[i + 1] = _check_number("GroupLossScaleManager", "init_loss_scale", value, 0.0, strict_min=True)
        self.dynamic_loss_scale = ms.ParameterTuple(
            Parameter(Tensor(v, mstype.float32), name="layer_loss_scale_%d" % i, requires_grad=False)
            for i, v in enumerate(values))

    def update_loss_scale_status(self, layer, update_ratio):
        """Multiply layer ``layer``'s scale by ``update_ratio``; returns the new scale."""
        scale = self.dynamic_loss_scale[layer + 1]
        new = scale * update_ratio
        return ops.depend(new, ops.assign(scale, new))

    def construct(self, x, layer1, layer2):
        return self._scale_backward(x, self.dynamic_loss_scale[layer1] / self.dynamic_loss_scale[layer2])

    def get_loss_scale(self):
        """The initial loss scale."""
        return self._loss_scale

    def get_update_cell(self):
        """This manager (it is its own update cell)."""
        return self


class AdaSum(nn.Cell):
    """Adaptive summation of the ranks' weight updates across ``group_number`` servers.

    Rank ``r``'s update ``delta = old - new`` is combined with the other servers' (ranks with the same
    ``r % device_number``) by recursive pairwise AdaSum,
    ``a + b - (a.b / 2|a|^2) a - (a.b / 2|b|^2) b``, and the parameters become ``old - combined``. It
    uses one AllGather per parameter (works on CPU; MindSpore's Send/Receive version needs Ascend).

    Args:
        rank (int): this rank. device_number (int): ranks per server. group_number (int): servers, a
        power of two. parameter_tuple (tuple of Parameter): the parameters (their shapes).

    Inputs ``(delta_weights, parameters, old_parameters)``; returns the assigned parameters.
    """

    def __init__(self, rank, device_number, group_number, parameter_tuple):
        super().__init__()
        self.rank = _check_int("AdaSum", "rank", rank, 0)
        self.device_number = _check_int("AdaSum", "device_number", device_number, 1)
        self.group_number = _check_int("AdaSum", "group_number", group_number, 1)
        if self.group_number & (self.group_number - 1):
            _fail("AdaSum", "'group_number'", "a power of 2", group_number)
        self.calc_times = int(np.log2(self.group_number))
        self.parameter_tuple = parameter_tuple
        self.eps = 1e-12
        self.allgather = None
        if self.group_number > 1:
            if self.device_number == 1:
                self.allgather = ops.AllGather()
            else:
                from mindspore.communication import create_group
                local = self.rank % self.device_number
                name = "recboost_adasum_%d" % local
                create_group(name, [local + g * self.device_number for g in range(self.group_number)])
                self.allgather = ops.AllGather(group=name)

    def _combine(self, rows):
        """rows: (2m, n) -> (m, n), AdaSum of rows 2i and 2i+1."""
        pairs = rows.reshape((-1, 2, rows.shape[-1]))
        a, b = pairs[:, 0], pairs[:, 1]
        dot = (a * b).sum(axis=1, keepdims=True) + self.eps
        aa = (a * a).sum(axis=1, keepdims=True) + self.eps
        bb = (b * b).sum(axis=1, keepdims=True) + self.eps
        return (1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b

    def construct(self, delta_weights, parameters, old_parameters):
        out = ()
        for delta, param, old in zip(delta_weights, parameters, old_parameters):
            rows = delta.reshape((1, -1))
            if self.group_number > 1:
                rows = self.allgather(rows)
                for _ in range(self.calc_times):
                    rows = self._combine(rows)
            out += (ops.assign(param, old - rows.reshape(delta.shape)),)
        return out


class DimReduce(nn.Cell):
    """Dimension-reduced quasi-Newton training (the seed's equations).

    With ``P`` the PCA matrix (k x n, this rank holds rows ``rank*ceil(k/r)`` onwards, zero-padded) and
    ``g`` the gradient: ``gk = P g``, ``dk = -Bk gk``, ``dn = P^T dk``; line search over
    ``rho^m`` (m = 0, 1, else 0) for ``new_loss < old_loss + sigma rho^m gk.dk`` (``sk = rho^m dk``, BFGS
    update of ``Bk`` from ``yk = gk - gk_last``); then ``m = gamma m + g - P^T gk`` and the optimizer
    (SGD, lr 1) applies ``alpha m - rho^m dn``. Multi-rank: ``gk`` by AllGather, back-projections
    by AllReduce, losses averaged (MindSpore floor-divides them).

    Args: network, optimizer, weight (tuple of Parameter), pca_mat_local (numpy k_local x n),
        n_components, rho, gamma, alpha, sigma, rank, rank_size.
    Inputs ``(loss, old_grad, loss_scale, weight, weight_clone, *inputs)``; returns ``loss``.
    """

    def __init__(self, network, optimizer, weight, pca_mat_local, n_components, rho, gamma, alpha, sigma, rank,
                 rank_size):
        super().__init__(auto_prefix=False)
        self.network = network
        self.optimizer = optimizer
        self.rank = _check_int("DimReduce", "rank", rank, 0)
        self.rank_size = _check_int("DimReduce", "rank_size", rank_size, 1)
        self.n_components = _check_int("DimReduce", "n_components", n_components, 1)
        self.rho = _check_number("DimReduce", "rho", rho, 0.0, 1.0, strict_min=True)
        self.gamma = _check_number("DimReduce", "gamma", gamma, 0.0, 1.0)
        self.alpha = _check_number("DimReduce", "alpha", alpha, 0.0)
        self.sigma = _check_number("DimReduce", "sigma", sigma, 0.0)
        weight = tuple(weight)
        sizes = [int(np.prod(p.shape)) for p in weight]
        local = _pca_rows_per_rank(self.n_components, self.rank_size)
        pca = np.asarray(pca_mat_local, dtype=np.float32)
        if pca.ndim != 2 or pca.shape != (local, sum(sizes)):
            _fail("DimReduce", "the shape of 'pca_mat_local'", "(%d, %d)" % (local, sum(sizes)), pca.shape)
        self.local_dim = local
        self.start_index = self.rank * local
        bounds = np.cumsum([0] + sizes)
        self.pca_list_local = tuple(Tensor(np.ascontiguousarray(pca[:, bounds[i]:bounds[i + 1]]))
                                    for i in range(len(sizes)))
        self.pad = self.rank_size * local - self.n_components
        k = self.n_components
        self.eye = Tensor(np.eye(k, dtype=np.float32))
        self.gk_last = Parameter(Tensor(np.zeros((k, 1), np.float32)), name="gk_last", requires_grad=False)
        self.bk = Parameter(Tensor(np.eye(k, dtype=np.float32)), name="bk", requires_grad=False)
        self.sk = Parameter(Tensor(np.zeros((k, 1), np.float32)), name="sk", requires_grad=False)
        self.grad_res_momentum = ms.ParameterTuple(weight).clone(prefix="grad_res_momentum", init="zeros")
        self.hyper_map = ops.HyperMap()
        if self.rank_size > 1:
            self.allgather = ops.AllGather()
            self.allreduce = ops.AllReduce()

    def _mean_loss(self, loss):
        if self.rank_size > 1:
            return self.allreduce(loss) / self.rank_size
        return loss

    def _back_project(self, vec_local, shapes_like):
        out = ()
        for pca, g in zip(self.pca_list_local, shapes_like):
            part = ops.matmul(pca.T, vec_local).reshape(g.shape)
            if self.rank_size > 1:
                part = self.allreduce(part)
            out += (part,)
        return out

    def _trial_loss(self, rho, dn, weight, weight_clone, *inputs):
        moved = ()
        for w, c, d in zip(weight, weight_clone, dn):
            moved += (ops.assign(w, c + rho * d),)
        new_loss = self._mean_loss(ops.depend(self.network(*inputs), moved))
        restored = self.hyper_map(_boost_assign, weight, weight_clone)
        return ops.depend(new_loss, restored)

    def construct(self, loss, old_grad, loss_scale, weight, weight_clone, *inputs):
        grads = ()
        for g in old_grad:
            grads += (ops.cast(g, mstype.float32) / loss_scale,)
        old_loss = self._mean_loss(loss)
        gk_local = ops.zeros((self.local_dim, 1), mstype.float32)
        for pca, g in zip(self.pca_list_local, grads):
            gk_local = gk_local + ops.matmul(pca, g.reshape((-1, 1)))
        gk_all = self.allgather(gk_local) if self.rank_size > 1 else gk_local
        gk = gk_all.reshape((-1, 1))[:self.n_components]
        # BFGS update of Bk from the last accepted step (sk = 0 before the first one)
        bk_old, gk_last_old = self.bk * 1, self.gk_last * 1
        yk = gk - gk_last_old
        ys = ops.matmul(yk.T, self.sk).reshape(())
        ok = ops.cast(ys > 1e-20, mstype.float32)
        pk = ok / (ys + (1 - ok))
        t1 = self.eye - ops.matmul(pk * yk, self.sk.T)
        bk_new = ok * (ops.matmul(ops.matmul(t1.T, bk_old), t1) + ops.matmul(pk * self.sk, self.sk.T)) \
            + (1 - ok) * bk_old
        dk = -ops.matmul(bk_new, gk)
        if self.pad > 0:
            dk_pad = ops.concat((dk, ops.zeros((self.pad, 1), mstype.float32)))
        else:
            dk_pad = dk
        dk_local = dk_pad[self.start_index:self.start_index + self.local_dim]
        dn = self._back_project(dk_local, grads)
        grad_proj = self._back_project(gk_local, grads)
        gd = ops.matmul(gk.T, dk).reshape(())
        loss0 = self._trial_loss(1.0, dn, weight, weight_clone, *inputs)
        loss1 = self._trial_loss(self.rho, dn, ops.depend(weight, loss0), weight_clone, *inputs)
        f0 = ops.cast(old_loss + self.sigma * gd > loss0, mstype.float32)
        f1 = ops.cast(old_loss + self.sigma * self.rho * gd > loss1, mstype.float32)
        found = f0 + (1 - f0) * f1
        rho = f0 + (1 - f0) * f1 * self.rho
        state = (ops.assign(self.sk, found * rho * dk + (1 - found) * self.sk),
                 ops.assign(self.bk, found * bk_new + (1 - found) * bk_old),
                 ops.assign(self.gk_last, found * gk + (1 - found) * gk_last_old))
        delta = ()
        for m, g, gp, d in zip(self.grad_res_momentum, grads, grad_proj, dn):
            m_new = self.gamma * m + g - gp
            delta += (ops.depend(self.alpha * m_new - rho * d, ops.assign(m, m_new)),)
        update = self.optimizer(ops.depend(delta, state))
        clone = self.hyper_map(_boost_assign, weight_clone, ops.depend(weight, update))
        return ops.depend(loss, clone)


class _FreezeStepCell(_TrainStep):
    """One freeze index's train step without loss scaling: gradients for its group only, its
    optimizer, optional accumulation (the step itself is ``_TrainStep``'s)."""

    def __init__(self, network, sens, grad_reducer, use_grad_accumulation, optimizer, max_accumulation_step=1):
        nn.TrainOneStepCell.__init__(self, network, optimizer, float(sens))
        self._init_step("freeze_cell")
        self.grad_reducer = grad_reducer
        self.use_grad_accumulation = use_grad_accumulation
        if use_grad_accumulation:
            self.grad_accumulation = GradientAccumulation(max_accumulation_step, optimizer)

    def _apply_gradients(self, loss, grads, sens, *inputs):
        if self.use_grad_accumulation:
            return self.grad_accumulation(loss, grads)
        return ops.depend(loss, self.optimizer(grads))


def freeze_cell(reducer_flag, network, optimizer, sens, grad, use_grad_accumulation, mean=None, degree=None,
                max_accumulation_step=1):
    """The per-freeze-index train cells of a ``FreezeOpt`` (one per group, as a tuple).

    Args:
        reducer_flag (bool): data-parallel training (gradients are averaged over ranks per group).
        network (Cell): the network with loss. optimizer (FreezeOpt). sens (Number): backward scale.
        grad (GradOperation): accepted for MindSpore compatibility (each cell differentiates with
            respect to its own group).
        use_grad_accumulation (bool), mean (bool), degree (int), max_accumulation_step (int).
    """
    if not isinstance(optimizer, FreezeOpt):
        _fail("freeze_cell", "'optimizer'", "a FreezeOpt", type(optimizer).__name__, TypeError)
    cells = []
    for opt in optimizer.opts:
        reducer = nn.Identity()
        if reducer_flag:
            reducer = nn.DistributedGradReducer(opt.parameters, mean, degree)
        cells.append(_FreezeStepCell(network, sens, reducer, use_grad_accumulation, opt, max_accumulation_step))
    return tuple(cells)


class BoostTrainOneStepCell(_TrainStep):
    """Train step with the boost algorithms (gradient freeze, accumulation, AdaSum, DimReduce).

    The step is recboost's one train step; the boost decides how the gradients are applied. Which
    algorithm runs follows MindSpore's precedence: DimReduce (an optimizer made for it), else
    gradient freezing (a ``FreezeOpt``), else accumulation, then AdaSum or the plain optimizer.

    Args:
        network (Cell): the network with loss (single output).
        optimizer (Cell): the optimizer, as returned by ``AutoBoost.network_auto_process_train`` (a
            ``FreezeOpt`` turns freezing on).
        sens (Number): backward scale. Default 1.0.
        boost (AutoBoost, optional): where the settings come from; default: the AutoBoost that
            processed ``optimizer``, else none (accumulation 1, no AdaSum/DimReduce).

    Returns the loss.
    """

    def __init__(self, network, optimizer, sens=1.0, boost=None):
        sens = _check_number("BoostTrainOneStepCell", "sens", 1.0 if sens is None else sens)
        nn.TrainOneStepCell.__init__(self, network, optimizer, sens)
        self._init_step("BoostTrainOneStepCell")
        self._boost_setup("BoostTrainOneStepCell", optimizer, boost)

    def _boost_setup(self, where, optimizer, boost):
        """The boost machinery, after ``_init_step`` (which says whether the step is loss-scaled)."""
        self.boost = boost if boost is not None else getattr(optimizer, "_recboost_boost", None)
        if self.boost is not None and not isinstance(self.boost, AutoBoost):
            _fail(where, "'boost'", "an AutoBoost", type(self.boost).__name__, TypeError)
        self._config = self.boost.config if self.boost is not None else _resolve_boost_config("O0", "")
        self.weights = optimizer.parameters
        self.train_strategy = getattr(optimizer, "train_strategy", None)
        steps = self._config.grad_accumulation.grad_accumulation_step \
            if self._config.enabled("grad_accumulation") else 1
        self.max_accumulation_step = steps
        self.use_grad_accumulation = steps > 1 and self.parallel_mode in ("stand_alone", "data_parallel")
        self._acc_steps = float(steps)
        self.accumulation_step = Parameter(Tensor(0, mstype.int32), name="accumulation_step")
        if self.use_grad_accumulation:
            self.grad_accumulation = self.weights.clone(prefix="grad_accumulation", init="zeros")
        self.enable_dim_reduce = self.check_dim_reduce_enable()
        if self.enable_dim_reduce:
            self._init_dim_reduce()
        self.freeze = isinstance(optimizer, FreezeOpt) and not self.enable_dim_reduce
        self.step = Parameter(Tensor(0, mstype.int32), name="freeze_step")
        self.freeze_nets = None
        if self.freeze:
            self._init_freeze(where, steps)
        self.enable_adasum = self.check_adasum_enable()
        if self.enable_adasum:
            self._init_adasum()

    def _init_freeze(self, where, steps):
        if not self._scaled:
            mean = degree = None
            if self.reducer_flag:
                mean, degree = ms.get_auto_parallel_context("gradients_mean"), _boost_parallel()[2]
            nets = freeze_cell(self.reducer_flag, self.network, self.optimizer, self.sens, self.grad,
                               self.use_grad_accumulation, mean, degree, max(steps, 1))
        else:
            if self.use_grad_accumulation:
                raise ValueError("For '%s', gradient freezing with loss scaling does not support "
                                 "gradient accumulation." % where)
            nets = []
            for opt in self.optimizer.opts:       # one scale and one update cell for all groups
                cell = TrainOneStepWithLossScaleCell(self.network, opt, None if self._unit_scale
                                                     else Tensor(np.float32(1.0)), self.row_inputs, self.row_growth,
                                                     self.row_pooled)
                cell.scale_sense = self.scale_sense
                if self.row_bounds is not None:
                    cell.row_bounds = self.row_bounds
                if self.row_factors is not None:
                    cell.row_factors = self.row_factors
                cell.loss_scaling_manager = self.loss_scaling_manager
                nets.append(cell)
        self.freeze_nets = tuple(nets)
        self._freeze_cells = nn.CellList(list(self.freeze_nets), auto_prefix=False)
        self._freeze_len = len(self.freeze_nets) if self.train_strategy is None \
            else int(self.train_strategy.shape[0])

    def _apply_gradients(self, loss, grads, sens, *inputs):
        if self.use_grad_accumulation:
            return self.gradient_accumulation_process(loss, grads, sens, *inputs)
        return self._boost_apply(loss, grads, sens, *inputs)

    def _holds(self):
        return self.use_grad_accumulation

    def _held_total(self, i):
        """With accumulation, T of weight ``i``'s accumulated gradient: the mean the optimizer applies
        after this step's gradient is added is bounded by T of the step's plus T of the sum held
        (``_prepared_total``), so a step is skipped when the mean it would complete could overflow."""
        if self.use_grad_accumulation:
            return _grad_total(self.grad_accumulation[i])
        return 0.0

    def _boost_apply(self, loss, grads, sens, *inputs):
        """Apply reduced, unscaled gradients with DimReduce, AdaSum or the optimizer; returns the loss."""
        if self.enable_dim_reduce:
            return ops.depend(loss, self.dim_reduce(loss, grads, sens, self.weights, self.weights_clone, *inputs))
        if self.enable_adasum:
            return self.adasum_process(loss, grads)
        return ops.depend(loss, self.optimizer(grads))

    def gradient_freeze_process(self, *inputs):
        """Run the train cell of this step's freeze index; returns its outputs."""
        if self.train_strategy is None:
            index = self.step
        else:
            index = self.train_strategy[self.step]
        out = self.freeze_nets[index](*inputs)
        nxt = ops.depend(self.step + 1, out)
        return ops.depend(out, ops.assign(self.step, nxt % self._freeze_len))

    def gradient_accumulation_process(self, loss, grads, sens, *inputs):
        """Accumulate ``grads / k``; every k-th step apply the mean and clear; returns the loss."""
        loss = ops.depend(loss, self.hyper_map(ops.partial(_boost_accumulate, self._acc_steps),
                                               self.grad_accumulation, grads))
        loss = ops.depend(loss, ops.assign_add(self.accumulation_step, Tensor(1, mstype.int32)))
        if self.accumulation_step >= self.max_accumulation_step:
            loss = self._boost_apply(loss, self.grad_accumulation, sens, *inputs)
            loss = ops.depend(loss, self.hyper_map(_boost_zero, self.grad_accumulation))
            loss = ops.depend(loss, ops.assign(self.accumulation_step, Tensor(0, mstype.int32)))
        return loss

    def adasum_process(self, loss, grads):
        """Local optimizer step, then AdaSum of the weight deltas across servers; returns the loss."""
        loss = ops.depend(loss, self.optimizer(grads))
        delta = self.hyper_map(_boost_sub, self.adasum_old, ops.depend(self.weights, loss))
        new = self.adasum(delta, self.weights, self.adasum_old)
        return ops.depend(loss, self.hyper_map(_boost_assign, self.adasum_old, new))

    def check_adasum_enable(self):
        """AdaSum runs when asked for, data parallel, and ``ranks // device_number`` is a power of 2 > 1."""
        if not getattr(self.optimizer, "adasum", False) or not self.reducer_flag:
            return False
        groups = _boost_parallel()[2] // self._config.common.device_number
        return bool(groups > 1 and groups & (groups - 1) == 0)

    def check_dim_reduce_enable(self):
        """DimReduce runs when the optimizer was made for it (``optimizer.dim_reduce``)."""
        return bool(getattr(self.optimizer, "dim_reduce", False))

    def _init_dim_reduce(self):
        cfg = self._config.dim_reduce
        _, rank, rank_size = _boost_parallel()
        path = getattr(self.optimizer, "_recboost_pca_path", None) or cfg.pca_mat_path
        if path is None:
            raise ValueError("For 'BoostTrainOneStepCell', DimReduce needs a PCA matrix: set "
                             "'dim_reduce.pca_mat_path' or process the network with AutoBoost first.")
        pca = load_pca_rows(_wait_for_pca_mat(path, cfg.timeout), rank, rank_size, cfg.n_components)
        self.weights_clone = self.weights.clone(prefix="weights_clone", init="same")
        self.dim_reduce = DimReduce(self.network, self.optimizer, self.weights, pca, cfg.n_components,
                                    cfg.rho, cfg.gamma, cfg.alpha, cfg.sigma, rank, rank_size)

    def _init_adasum(self):
        _, rank, rank_size = _boost_parallel()
        device_number = self._config.common.device_number
        groups = rank_size // device_number
        self.adasum_old = self.weights.clone(prefix="adasum_old", init="same")
        self.adasum = AdaSum(rank, device_number, groups, self.weights)
        if device_number == 1:
            self.grad_reducer = nn.Identity()
        else:
            from mindspore.communication import create_group
            server = rank // device_number
            name = "recboost_server_%d" % server
            create_group(name, list(range(server * device_number, (server + 1) * device_number)))
            self.grad_reducer = nn.DistributedGradReducer(self.weights, True, device_number, group=name)


class BoostTrainOneStepWithLossScaleCell(BoostTrainOneStepCell):
    """Boost train step with loss scaling: recboost's one loss-scaled step (its finite-gradient
    overflow check and scale update work on CPU) with the boost's way of applying gradients.

    Args:
        network (Cell), optimizer (Cell): as for :class:`BoostTrainOneStepCell`.
        scale_sense (Cell, Tensor or None): a loss-scale update cell, a scale Tensor of shape () or
            (1,), or None (a scale of exactly 1, see :class:`TrainOneStepWithLossScaleCell`); with
            ``loss_scale_group`` on, a :class:`GroupLossScaleManager` (per-group scales).
        boost (AutoBoost, optional): as for :class:`BoostTrainOneStepCell`.
        row_inputs (tuple[int]), row_growth (tuple, optional), row_pooled (tuple, optional): as for
            :class:`TrainOneStepWithLossScaleCell` (hash-table rows).

    Outputs ``(loss, overflow, scale, *row_gradients)``; an overflow step changes no parameter and no
    optimizer state.
    """

    def __init__(self, network, optimizer, scale_sense, boost=None, row_inputs=(), row_growth=None,
                 row_pooled=None):
        where = "BoostTrainOneStepWithLossScaleCell"
        owner = boost if boost is not None else getattr(optimizer, "_recboost_boost", None)
        group_flag = isinstance(owner, AutoBoost) and owner.config.enabled("loss_scale_group")
        nn.TrainOneStepCell.__init__(self, network, optimizer, sens=None)
        if group_flag:
            if not isinstance(scale_sense, GroupLossScaleManager):
                _fail(where, "'scale_sense'", "a GroupLossScaleManager when loss_scale_group is on",
                      type(scale_sense).__name__, TypeError)
            if row_inputs:
                _fail(where, "'row_inputs'", "empty when loss_scale_group is on", row_inputs)
            self._init_step(where, Tensor(np.float32(1.0)))
            self.loss_scaling_manager = scale_sense
        else:
            self._init_step(where, scale_sense, row_inputs, row_growth, row_pooled)
        self._boost_setup(where, optimizer, boost)
        if self.freeze and group_flag:
            raise ValueError("For '%s', gradient freezing does not support loss_scale_group." % where)
        self.enable_enhanced_amp = group_flag
        if group_flag:
            self._init_enhanced_amp(scale_sense)

    def _init_enhanced_amp(self, manager):
        index = {id(p): i for i, p in enumerate(self.weights)}
        groups = []
        for group in manager.loss_scale_groups:
            ids = tuple(index[id(p)] for p in group if id(p) in index)
            if ids:
                groups.append(ids)
        rest = tuple(sorted(set(range(len(self.weights))) - {i for g in groups for i in g}))
        if rest:
            groups.append(rest)
        if manager.dynamic_loss_scale is None:
            manager.set_loss_scale_status(len(groups), manager.get_loss_scale())
        self._amp_groups = tuple(groups)
        self._param_group = tuple(next(g for g, ids in enumerate(groups) if i in ids)
                                  for i in range(len(self.weights)))
        self.reduce_ratio = float(2 ** -0.5)
        self.growth_ratio = float(2 ** (1.0 / 1000.0))

    def _enhanced_amp_step(self, *inputs):
        """Per-group scales: the manager's cells put group g's scale into its gradients."""
        loss = self.network(*inputs)
        grads = self.grad(self.network, self.weights)(*inputs, ops.ones_like(loss))
        grads = self.grad_reducer(grads)
        manager = self.loss_scaling_manager
        used = ()
        for g in range(len(self._amp_groups)):
            used += (manager.dynamic_loss_scale[g + 1] * 1.0,)
        unscaled = ()
        for i in range(len(self._param_group)):
            unscaled += (grads[i] / ops.cast(used[self._param_group[i]], ops.dtype(grads[i])),)
        states, _ = self._growth_states()
        preps = self._grad_preps(unscaled)
        entries = self._entry_bounds(unscaled)
        total = Tensor(0.0, mstype.float32)
        updates = ()
        for g, ids in enumerate(self._amp_groups):
            part, part_states, part_preps, part_entries = (), (), (), ()
            for i in ids:
                part += (unscaled[i],)
                part_preps += (preps[i],)
                if len(states) > 0:
                    part_states += (states[i],)
                if len(entries) > 0:
                    part_entries += (entries[i],)
            flag = ops.cast(_nonfinite_flag(part, part_states, part_preps, part_entries), mstype.float32)
            if self.is_distributed:
                flag = self.allreduce(flag)
            ratio = ops.select(flag > 0, Tensor(self.reduce_ratio, mstype.float32),
                               Tensor(self.growth_ratio, mstype.float32))
            updates += (manager.update_loss_scale_status(g, ratio),)
            total = total + flag
        overflow = ops.depend(total, updates) > 0
        if not overflow:
            loss = ops.depend(loss, self.optimizer(unscaled))
        return loss, overflow, used[0]


# =====================================================================================================
# AutoBoost
# =====================================================================================================
# AutoBoost's configuration (one frozen dataclass per section, every key validated once by the
# ``_check_*`` family), the class, and the two builders of a boost train cell: ``_boost_train_cell``
# and MindSpore's ``build_train_network`` (amp level + boost level).


def _setting(default, check, **bounds):
    """A field of a boost config section: its default and its validator (one of the ``_check_*``)."""
    return dataclasses.field(default=default, metadata={"check": functools.partial(check, **bounds)})


@dataclasses.dataclass(frozen=True)
class _BoostSection:
    """Base of the frozen boost config sections: every field is validated once, at construction,
    by the validator its ``_setting`` names; ``from_dict`` refuses unknown keys."""
    def __post_init__(self):
        for field in dataclasses.fields(self):
            name = "%s.%s" % (self.section, field.name)
            value = field.metadata["check"]("AutoBoost", name, getattr(self, field.name))
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_dict(cls, body):
        """The section from a user's dict (unset keys take the defaults)."""
        known = [field.name for field in dataclasses.fields(cls)]
        for key in body:
            if key not in known:
                _fail("AutoBoost", "the key of section '%s'" % cls.section, "one of %s" % known, key)
        return cls(**body)

    def as_dict(self):
        """A fresh ``key -> value`` dict (lists for sequences), MindSpore's view of the section."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {key: list(v) if isinstance(v, tuple) else v for key, v in values.items()}


@dataclasses.dataclass(frozen=True)
class _CommonConfig(_BoostSection):
    section = "common"
    gradient_split_groups: tuple = _setting((50, 100), _check_int_list)
    device_number: int = _setting(8, _check_int, minimum=1)


@dataclasses.dataclass(frozen=True)
class _LessBNConfig(_BoostSection):
    section = "less_bn"
    fn_flag: bool = _setting(True, _check_bool)
    gc_flag: bool = _setting(True, _check_bool)


@dataclasses.dataclass(frozen=True)
class _GradFreezeConfig(_BoostSection):
    section = "grad_freeze"
    param_groups: int = _setting(10, _check_int, minimum=1, maximum=65535)
    freeze_type: int = _setting(1, _check_int, minimum=0, maximum=1)
    freeze_p: float = _setting(0.7, _check_number, minimum=0, maximum=1, strict_max=True)
    total_steps: int = _setting(65536, _check_int, minimum=1, maximum=2 ** 30)
    seed: int = _setting(0, _check_int, minimum=0, maximum=2 ** 64 - 1)      # recboost's explicit seed


@dataclasses.dataclass(frozen=True)
class _GradAccumulationConfig(_BoostSection):
    section = "grad_accumulation"
    grad_accumulation_step: int = _setting(1, _check_int, minimum=1)


@dataclasses.dataclass(frozen=True)
class _DimReduceConfig(_BoostSection):
    section = "dim_reduce"
    rho: float = _setting(0.55, _check_number, minimum=0, maximum=1, strict_min=True)
    gamma: float = _setting(0.9, _check_number, minimum=0, maximum=1)
    alpha: float = _setting(0.001, _check_number, minimum=0)
    sigma: float = _setting(0.4, _check_number, minimum=0)
    n_components: int = _setting(32, _check_int, minimum=1)
    pca_mat_path: str = _setting(None, _check_path)
    weight_load_dir: str = _setting(None, _check_path)
    timeout: float = _setting(1800, _check_number, minimum=0, strict_min=True)  # seconds to wait for the PCA file
    seed: int = _setting(0, _check_int, minimum=0, maximum=2 ** 32 - 1)      # recboost's explicit seed


#: The sections after "boost", in MindSpore's order.
_BOOST_SECTIONS = (_CommonConfig, _LessBNConfig, _GradFreezeConfig, _GradAccumulationConfig, _DimReduceConfig)


@dataclasses.dataclass(frozen=True)
class _BoostConfig:
    """One AutoBoost's resolved configuration, frozen and validated once.

    ``flags`` (algorithm -> enabled, in ``_BOOST_ALGORITHMS`` order) says what the level and the mode
    enable, as MindSpore's ``boost_config`` shows it (which one runs is the train step's precedence:
    dim_reduce, then grad_freeze, then the rest); one attribute per section holds its settings.
    """
    level: str
    flags: tuple                 # ((algorithm, enabled), ...)
    common: _CommonConfig
    less_bn: _LessBNConfig
    grad_freeze: _GradFreezeConfig
    grad_accumulation: _GradAccumulationConfig
    dim_reduce: _DimReduceConfig

    def enabled(self, algorithm):
        """Whether ``algorithm`` is on."""
        return dict(self.flags)[algorithm]


def _read_boost_config_dict(boost_config_dict):
    """``boost_config_dict`` as a dict: '' / None -> {}, a path -> the JSON file's object."""
    if boost_config_dict is None or (isinstance(boost_config_dict, str) and not boost_config_dict):
        return {}
    if isinstance(boost_config_dict, (str, os.PathLike)):
        path = os.fspath(boost_config_dict)
        if not os.path.isfile(path):
            _fail("AutoBoost", "'boost_config_dict'", "a dict or the path of an existing JSON file", path)
        with open(path, encoding="utf-8") as fh:
            try:
                boost_config_dict = json.load(fh)
            except ValueError as exc:
                raise ValueError("For 'AutoBoost', the JSON file %r cannot be parsed: %s" % (path, exc)) from None
    if not isinstance(boost_config_dict, dict):
        _fail("AutoBoost", "'boost_config_dict'", "a dict or the path of a JSON file", boost_config_dict,
              TypeError)
    return boost_config_dict


def _resolve_boost_config(level, boost_config_dict):
    """The ``_BoostConfig`` of a level and a user config (a dict or a JSON path), validated once."""
    _check_one_of("AutoBoost", "level", level, _BOOST_LEVELS)
    user = _read_boost_config_dict(boost_config_dict)
    sections = {cls.section: cls for cls in _BOOST_SECTIONS}
    for section, body in user.items():
        if section != "boost" and section not in sections:
            _fail("AutoBoost", "the section of 'boost_config_dict'", "one of %s" % (["boost"] + list(sections)),
                  section)
        if not isinstance(body, dict):
            _fail("AutoBoost", "the section '%s'" % section, "a dict", body, TypeError)
    boost = user.get("boost", {})
    for key in boost:
        if key not in ("mode",) + _BOOST_ALGORITHMS:
            _fail("AutoBoost", "the key of section 'boost'", "one of %s" % (["mode"] + list(_BOOST_ALGORITHMS)),
                  key)
    mode = _check_one_of("AutoBoost", "boost.mode", boost.get("mode", "auto"), _BOOST_MODES)
    chosen = {key: _check_bool("AutoBoost", "boost." + key, boost[key]) for key in _BOOST_ALGORITHMS if key in boost}
    flags = {key: key in _BOOST_LEVELS[level] for key in _BOOST_ALGORITHMS}
    if mode == "manual":
        flags.update(chosen)
    elif mode in ("enable_all", "disable_all"):
        flags = dict.fromkeys(_BOOST_ALGORITHMS, mode == "enable_all")
    return _BoostConfig(level, tuple(flags.items()),
                        **{section: cls.from_dict(user.get(section, {})) for section, cls in sections.items()})


class AutoBoost:
    """Boost configuration for one model: level presets, modes and settings (not a singleton).

    Args:
        level (str): "O0" (nothing), "O1" (less_bn + grad_freeze) or "O2" (+ adasum), MindSpore's presets.
        boost_config_dict (dict or str): the config (see the seed / docs/boost.md), or the path of a JSON file
            holding it. Unset keys take the seed's defaults; an unknown level, mode, section or key is a
            ValueError naming it.

    Attributes: ``level``; ``boost_config`` (algorithm -> enabled by the level and the mode, as
    MindSpore shows it: O1 enables less_bn and grad_freeze, O2 adds adasum; which one runs is the
    train step's precedence, see :class:`BoostTrainOneStepCell`); ``settings``
    (section -> key -> value, complete). Each instance owns copies; two instances never interact.
    """

    def __init__(self, level="O0", boost_config_dict=""):
        #: The resolved configuration (a frozen ``_BoostConfig``), validated once here.
        self.config = _resolve_boost_config(level, boost_config_dict)
        self.level = level
        self.boost_config_dict = boost_config_dict
        self._param_processer = ParameterProcess()

    @property
    def boost_config(self):
        """algorithm -> enabled, as MindSpore shows it (a fresh dict each time)."""
        return dict(self.config.flags)

    @property
    def settings(self):
        """section -> key -> value, complete (a fresh dict each time)."""
        return {cls.section: getattr(self.config, cls.section).as_dict() for cls in _BOOST_SECTIONS}

    def __repr__(self):
        on = [k for k, v in self.config.flags if v]
        return "AutoBoost(level=%r, enabled=%s)" % (self.level, on)

    def network_auto_process_train(self, network, optimizer):
        """Apply the enabled algorithms; returns ``(network, optimizer)`` for ``BoostTrainOneStepCell``.

        dim_reduce: prepares the PCA matrix and returns ``SGD(lr=1)`` over the network's parameters;
        less_bn: LessBN + regrouped optimizer with gradient centralization (``gc_flag``);
        grad_freeze: a ``FreezeOpt``; adasum: marks the optimizer. The returned optimizer remembers this
        AutoBoost (``optimizer._recboost_boost``), so the train cell gets these settings.
        """
        if not isinstance(network, nn.Cell):
            _fail("AutoBoost.network_auto_process_train", "'network'", "a Cell", type(network).__name__, TypeError)
        if not isinstance(optimizer, nn.Optimizer):
            _fail("AutoBoost.network_auto_process_train", "'optimizer'", "a mindspore.nn.Optimizer",
                  type(optimizer).__name__, TypeError)
        cfg = self.config
        if cfg.enabled("dim_reduce"):           # MindSpore's precedence: DimReduce replaces everything else
            pca_path = _prepare_pca_mat(cfg.dim_reduce, network)
            optimizer = nn.SGD(network.trainable_params(), learning_rate=1.0)
            optimizer.dim_reduce = True
            optimizer._recboost_pca_path = pca_path  # pylint: disable=protected-access
            optimizer._recboost_boost = self  # pylint: disable=protected-access
            return network, optimizer
        if cfg.enabled("less_bn"):
            network = LessBN(network, fn_flag=cfg.less_bn.fn_flag)
            process = OptimizerProcess(optimizer)
            groups = self._param_processer.assign_parameter_group(network.trainable_params(),
                                                                  cfg.common.gradient_split_groups)
            process.origin_params = ParameterProcess.generate_group_params(groups, process.origin_params)
            if cfg.less_bn.gc_flag:
                process.add_grad_centralization(network)
            optimizer = process.generate_new_optimizer()
        if cfg.enabled("grad_freeze"):
            freeze = cfg.grad_freeze
            network, optimizer = GradientFreeze(freeze.param_groups, freeze.freeze_type, freeze.freeze_p,
                                                freeze.total_steps, freeze.seed).freeze_generate(network, optimizer)
        if cfg.enabled("adasum"):
            optimizer.adasum = True
        optimizer._recboost_boost = self  # pylint: disable=protected-access
        return network, optimizer

    def network_auto_process_eval(self, network):
        """The evaluation network (LessBN-wrapped when less_bn is on)."""
        if self.config.enabled("less_bn") and not self.config.enabled("dim_reduce"):
            return LessBN(network, fn_flag=False)
        return network


def _boost_train_cell(network, optimizer, level="O0", config="", scale_sense=_UNSCALED, sens=1.0, row_inputs=(),
                      row_growth=None, row_pooled=None):
    """Process ``(network with loss, optimizer)`` with ``AutoBoost(level, config)`` and build its train cell.

    Returns a ``BoostTrainOneStepCell`` (loss; ``sens`` is the fixed backward scale) when
    ``scale_sense`` is ``_UNSCALED``, else a ``BoostTrainOneStepWithLossScaleCell`` (loss, overflow,
    scale, row gradients) with ``scale_sense`` (an update cell, a scale Tensor, or None for a scale
    of exactly 1), ``row_inputs`` (hash-table rows), ``row_growth`` and ``row_pooled``.
    """
    boost = config if isinstance(config, AutoBoost) else AutoBoost(level, config)
    network, optimizer = boost.network_auto_process_train(network, optimizer)
    if scale_sense is _UNSCALED:
        return BoostTrainOneStepCell(network, optimizer, sens, boost=boost)
    return BoostTrainOneStepWithLossScaleCell(network, optimizer, scale_sense, boost=boost, row_inputs=row_inputs,
                                              row_growth=row_growth, row_pooled=row_pooled)


def build_train_network(network, optimizer, loss_fn=None, level="O0", boost_level="O0", **kwargs):
    """Build a mixed precision train-step cell (``mindspore.amp.build_train_network`` semantics)
    that also works on CPU with dynamic loss scaling.

    Args:
        network (Cell): the network (with the loss inside when ``loss_fn`` is None).
        optimizer (Cell): the optimizer.
        loss_fn (Cell): the loss; the network output and label are cast to float32 before it.
        level (str): "O0" (float32), "O1" (MindSpore's white-list of ops in float16), "O2" (float16,
            BatchNorm float32, dynamic loss scaling), "O3" (float16, no loss scaling) or "auto" (O2 on
            GPU, O3 on Ascend, float32 elsewhere).
        boost_level (str): "O0", "O1" or "O2" (see :class:`AutoBoost`).
        **kwargs: ``cast_model_type``, ``keep_batchnorm_fp32``, ``loss_scale_manager`` override the
            level; ``boost_config_dict`` is passed to AutoBoost. Anything else is a TypeError.

    Returns:
        Cell: a :class:`TrainOneStepWithLossScaleCell` when a loss scale manager with an update cell
        is in use, else a ``TrainOneStepCell`` with the fixed scale as ``sens``; boost levels O1/O2
        give the boost cells instead.
    """
    where = "build_train_network"
    boost_config = kwargs.pop("boost_config_dict", "")
    _check_one_of(where, "boost_level", boost_level, ("O0", "O1", "O2"))
    config = _AmpConfig.of(level, where, **kwargs)
    network = _cast_network(network, config)
    if loss_fn is not None:
        network = _WithLossCell(network, loss_fn, config.cast_model_type == mstype.float16)
    manager = config.loss_scale_manager
    update_cell = manager.get_update_cell() if manager is not None else None
    sens = manager.get_loss_scale() if manager is not None else 1.0
    if boost_level != "O0":
        return _boost_train_cell(network, optimizer, boost_level, boost_config,
                                 _UNSCALED if update_cell is None else update_cell, sens).set_train()
    if update_cell is not None:
        return TrainOneStepWithLossScaleCell(network, optimizer, scale_sense=update_cell).set_train()
    return nn.TrainOneStepCell(network, optimizer, sens=float(sens)).set_train()


# =====================================================================================================
# Metrics
# =====================================================================================================
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


def _sigmoid(x):
    """The logistic function of a numpy array, in float64."""
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


class _PairMetric(ms.train.Metric):
    """Base of the streaming binary metrics: ``update(predictions, labels)`` checked in one place."""

    _inputs_form = "(probs, labels)"

    def _pair(self, inputs):
        where = type(self).__name__ + ".update"
        if len(inputs) != 2:
            _fail(where, "the inputs", self._inputs_form, "%d inputs" % len(inputs))
        return _metric_arrays(where, inputs[0], inputs[1])

    def _need_samples(self, count):
        if count == 0:
            raise RuntimeError("%s.eval needs at least one sample; call update() first." % type(self).__name__)


class AUC(_PairMetric):
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

    _inputs_form = "(scores, labels)"

    @ms.train.rearrange_inputs
    def update(self, *inputs):
        """Add a batch: ``update(scores, labels)``."""
        scores, labels = self._pair(inputs)
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
        self._need_samples(self._values.size)
        return _auc_from_counts(self._pos, self._neg)


class _MeanMetric(_PairMetric):
    """Base of the streaming means of a per-sample quantity of ``(probs, labels)``: ``from_logits``
    applies the sigmoid first; a subclass gives the batch's sum (``_batch_sum``)."""

    def clear(self):
        """Forget all samples."""
        self._sum, self._count = 0.0, 0

    @ms.train.rearrange_inputs
    def update(self, *inputs):
        """Add a batch: ``update(probs, labels)``."""
        p, labels = self._pair(inputs)
        if self.from_logits:
            p = _sigmoid(p)
        self._sum += self._batch_sum(p, labels)
        self._count += p.size

    def eval(self):
        """The mean since ``clear``; RuntimeError when there is no sample."""
        self._need_samples(self._count)
        return self._sum / self._count


class LogLoss(_MeanMetric):
    """Streaming mean binary cross-entropy (``update(probs, labels)``, probabilities clipped to
    ``[eps, 1 - eps]``); ``from_logits=True`` takes logits instead."""

    def __init__(self, eps=1e-7, from_logits=False):
        super().__init__()
        self.eps = _check_number("LogLoss", "eps", eps, 0.0, 0.5, strict_min=True)
        self.from_logits = _check_bool("LogLoss", "from_logits", from_logits)
        self.clear()

    def _batch_sum(self, p, labels):
        p = np.clip(p, self.eps, 1.0 - self.eps)
        return float(-np.sum(np.where(labels, np.log(p), np.log1p(-p))))


class Accuracy(_MeanMetric):
    """Streaming binary accuracy (``update(probs, labels)``): a sample is predicted positive when its
    probability is >= ``threshold`` (0.5); ``from_logits=True`` applies the sigmoid first. ``eval``
    is the fraction of correct predictions."""

    def __init__(self, threshold=0.5, from_logits=False):
        super().__init__()
        self.threshold = _check_number("Accuracy", "threshold", threshold, 0.0, 1.0)
        self.from_logits = _check_bool("Accuracy", "from_logits", from_logits)
        self.clear()

    def _batch_sum(self, p, labels):
        return int(np.sum((p >= self.threshold) == labels))


# =====================================================================================================
# Data: Criteo-format reader and synthetic click stream
# =====================================================================================================
# Both sources yield the same batch: ``(dense float32 [B, num_dense], ids int64 [B, num_sparse],
# label float32 [B, 1])``. Categorical values become raw 64-bit ids through one explicit hash of
# (field index, value), so all fields can share one hash table; dense integers go through
# ``sign(x) * log1p(|x|)`` with a missing value read as 0.


_DATA_LOG = logging.getLogger("recboost")


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
        self.ctr = _check_number(where, "ctr", ctr, 0, 1, strict_min=True, strict_max=True)
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


def criteo_split(path, last_lines, chunk_bytes=1 << 22):
    """Where the last ``last_lines`` lines of the text file ``path`` (``.gz`` decompressed) begin:
    ``(byte offset of that line's start, lines in the file)``; offset 0 when the file has no more
    lines. One streaming pass counts the newlines chunk by chunk (memory does not grow with the
    file), then the chunk holding the split is read again. ``CriteoReader(path, stop=offset)`` reads
    the lines before the split, ``CriteoReader(path, start=offset)`` the held-out lines."""
    where = "criteo_split"
    _check_path(where, "path", path)
    _check_int(where, "last_lines", last_lines, 0)
    _check_int(where, "chunk_bytes", chunk_bytes, 1)
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    chunks, offset, last = [], 0, b"\n"               # (offset, newlines) of each chunk
    with opener(path, "rb") as fh:
        while True:
            data = fh.read(chunk_bytes)
            if not data:
                break
            chunks.append((offset, data.count(b"\n")))
            offset, last = offset + len(data), data[-1:]
        total = sum(n for _, n in chunks) + (last != b"\n")     # a last line without its newline
        first = total - last_lines                              # lines before the split
        if first <= 0:
            return 0, total
        seen = 0
        for start, n in chunks:
            if seen + n >= first:                               # the split follows this chunk's newline
                fh.seek(start)
                data, at = fh.read(chunk_bytes), -1
                for _ in range(first - seen):
                    at = data.index(b"\n", at + 1)
                return start + at + 1, total
            seen += n
    return offset, total


class CriteoReader:
    """Stream batches from a file in the Criteo display-advertising text format.

    Each line is ``label<TAB>I1..I13<TAB>C1..C26`` (counts configurable): label ``0``/``1``, integer
    dense features, categorical features as hex strings; any feature may be empty. ``source`` is a
    path (``.gz`` is decompressed) or a binary file object. The file is read ``chunk_bytes`` at a
    time (at most: from a pipe, what has arrived, so ``tail -f`` rows train as they come) and parsed
    by the ``parse_criteo`` kernel; batches are the tuple of ``SyntheticClickStream``:
    dense float32 ``[B, num_dense]`` = ``sign(x) * log1p(|x|)`` with empty -> 0, ids int64
    ``[B, num_sparse]`` = ``_hash_feature(field, hex value)`` or the field's missing id when empty,
    label float32 ``[B, 1]``. The last batch is short unless ``drop_remainder``.

    Malformed lines (wrong field count, bad label, a dense field that is not an int64 integer, a
    categorical field that is not 1-16 hex digits, a line longer than ``max_line_bytes``) are
    skipped and counted by reason in ``stats()``; the first ``max_warnings`` are logged with their
    line number. They never reach a batch. A compressed stream cut short yields its intact rows,
    then raises an EOFError naming the file and the decompressed byte offset of the cut.

    ``timestamp_column`` (None, or k in ``1 .. num_dense + 1``): each line carries one more integer
    column, at tab-separated position k (the label is column 0), holding the row's data time (an
    int64, e.g. seconds; empty reads as 0); it is taken out of the dense features and batches gain a
    fourth item: the rows' times, int64 ``[B]``.

    ``position()`` after a batch gives ``{"offset", "lines", "rows"}``: the byte offset just past the
    last row yielded, the lines and rows up to it. ``CriteoReader(path, start=that_dict)`` continues
    right after it (``start`` may also be a plain byte offset at a line start). ``stop`` (a byte
    offset at a line start, decompressed for ``.gz``; None: the end) ends the stream there: the
    lines before it, and nothing of the file after it, are read (``criteo_split`` finds one).

    ``digest`` (None, or a :mod:`hashlib` object such as ``hashlib.blake2b()``) is fed every byte the
    reader reads from the source, in order, from ``start`` on (decompressed for ``.gz``; the reader
    reads up to a chunk ahead of the rows it has yielded); :meth:`read_digest` gives it with the
    byte count. ``recboost train`` proves a resume's input with it (:class:`_InputCheckpoint`).
    """

    def __init__(self, source, batch_size=2048, drop_remainder=False, num_dense=13, num_sparse=26,
                 start=None, chunk_bytes=1 << 22, max_line_bytes=1 << 20, max_warnings=5, stop=None,
                 timestamp_column=None, digest=None):
        where = "CriteoReader"
        self.batch_size = _check_int(where, "batch_size", batch_size, 1)
        self.drop_remainder = _check_bool(where, "drop_remainder", drop_remainder)
        self.num_dense = _check_int(where, "num_dense", num_dense, 0)
        self.timestamp_column = None if timestamp_column is None else \
            _check_int(where, "timestamp_column", timestamp_column, 1, self.num_dense + 1)
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
            path = os.fspath(source)
            self._fh = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
            self._owned = True
        elif hasattr(source, "read"):
            self._fh, self._owned = source, False
        else:
            _fail(where, "'source'", "a path or a binary file object", source, TypeError)
        self.stop = None if stop is None else _check_int(where, "stop", stop, int(start["offset"]))
        self._read_at = int(start["offset"])  # bytes of the file consumed so far (for ``stop``)
        if digest is not None and not callable(getattr(digest, "update", None)):
            _fail(where, "'digest'", "None or a hashlib object", digest, TypeError)
        self._digest = digest                 # fed every byte read (read_digest)
        if start["offset"]:
            self._fh.seek(start["offset"])
        self._base = int(start["offset"])     # byte offset of the next unparsed byte's line start
        self._lines = int(start["lines"])     # lines parsed so far
        self._carry = b""                     # an incomplete last line, waiting for more bytes
        self._skipping = False                # inside a line longer than max_line_bytes
        self._eof = False
        self._truncated = None                # (offset, EOFError) of a compressed stream cut short
        self._name = getattr(self._fh, "name", None) or repr(source)
        self._pending = []                    # parsed, not yet yielded: [labels, dense, ids, end, line]
        self._pending_rows = 0
        self._parsed_rows = 0
        self._malformed = np.zeros(len(_CRITEO_REASONS), dtype=np.int64)
        self._warned = 0
        self._batches = 0
        self._position = dict(start)

    # ---- reading and parsing -------------------------------------------------------------------------
    def _read(self):
        """The next chunk of bytes. A compressed stream cut short (EOFError) gives the bytes it could
        still decompress; the error is kept and raised once the intact rows before it are yielded."""
        want = self.chunk_bytes if self.stop is None else min(self.chunk_bytes, self.stop - self._read_at)
        if self._truncated is not None or want <= 0:
            return b""
        read = getattr(self._fh, "read1", None) if isinstance(self._fh, gzip.GzipFile) else None
        try:
            if read is None:           # read1: the bytes a pipe has now (at least one), not a wait for all
                data = getattr(self._fh, "read1", self._fh.read)(want)
            else:                      # piece by piece, so a cut stream loses no decompressed byte
                parts, size = [], 0
                while size < want:
                    piece = read(want - size)
                    if not piece:
                        break
                    parts.append(piece)
                    size += len(piece)
                data = b"".join(parts)
        except EOFError as exc:
            data = b"".join(parts) if read is not None else b""
            self._truncated = (self._base + len(self._carry) + len(data), exc)
        if not isinstance(data, (bytes, bytearray)):
            _fail("CriteoReader", "the file", "opened in binary mode ('rb')", type(data).__name__, TypeError)
        self._read_at += len(data)
        if self._digest is not None:
            self._digest.update(data)
        return bytes(data)

    def _fill(self):
        """Read one chunk and parse its complete lines (at end of file, the last partial line too)."""
        data = self._read()
        if not data:
            self._eof = True
            if self._truncated is not None:
                self._carry = b""              # the line the cut went through is not intact
            elif self._skipping:
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
            _DATA_LOG.warning("CriteoReader: line %d skipped (%s) in %s%s", line, _CRITEO_REASONS[code], self._name,
                              "; further malformed lines are only counted in stats()"
                              if self._warned == self.max_warnings else "")

    def _parse(self, buf):
        num_int = self.num_dense + (self.timestamp_column is not None)      # the time is one more integer
        labels, dense, ids, status, line_end = parse_criteo(buf, num_int, self.num_sparse)
        if line_end.size:          # a line longer than max_line_bytes that fit in one chunk
            ends = line_end - (np.frombuffer(buf, np.uint8)[line_end - 1] == 10)
            too_long = ends - np.concatenate([[0], line_end[:-1]]) > self.max_line_bytes
            if too_long.any():
                keep = ~too_long[status == _CRITEO_OK]
                labels, dense, ids = labels[keep], dense[keep], ids[keep]
                status = np.where(too_long, _CRITEO_TOO_LONG, status).astype(status.dtype)
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
            if self._truncated is not None:
                offset, exc = self._truncated
                _fail("CriteoReader", "the file %r" % self._name, "a complete compressed stream",
                      "one cut short at decompressed byte offset %d, after %d intact rows (%s)" % (
                          offset, self._position["rows"] + take, exc), EOFError)
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
        if self.timestamp_column is None:
            return _dense_transform(raw), np.ascontiguousarray(ids), labels.reshape(take, 1)
        at = self.timestamp_column - 1
        return (_dense_transform(np.delete(raw, at, axis=1)), np.ascontiguousarray(ids), labels.reshape(take, 1),
                np.ascontiguousarray(raw[:, at]))

    def position(self):
        """Where the rows yielded so far end: ``{"offset": bytes, "lines": n, "rows": n}``; pass it as
        ``start`` to a new reader to continue right after the last yielded row."""
        return dict(self._position)

    def read_digest(self):
        """``(bytes, hexdigest)``: the byte offset the reader has read the source up to (the start
        offset included; decompressed for ``.gz``) and the hex digest of its ``digest`` (None without
        one), which holds every byte it read."""
        return self._read_at, None if self._digest is None else self._digest.hexdigest()

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


def _input_hasher():
    """A new hasher of the digest ``recboost train`` records of its input's bytes (its positions,
    :class:`_CriteoInput` ``digests``): BLAKE2b with a 32-byte digest."""
    return hashlib.blake2b(digest_size=32)


def _source_facts(source):
    """``{"name", "size"}`` of a source path (its base name; its size in bytes, None when it cannot be
    stat'ed)."""
    try:
        size = os.stat(source).st_size
    except (OSError, TypeError, ValueError):
        size = None
    return {"name": os.path.basename(os.fspath(source)), "size": size}


def _data_sources(where, data):
    """The sources of ``data``, in reading order: ``"-"``: ``[standard input]`` (its binary stream); a
    directory: its regular files, in name order (names starting with "." are left out: temporary
    files); else the file ``data`` itself. A missing path or an empty directory is a ValueError
    naming it."""
    if data == "-":
        return [sys.stdin.buffer]
    if not isinstance(data, (str, os.PathLike)):
        _fail(where, "'data'", "a path or '-' (standard input)", data, TypeError)
    data = os.fspath(data)
    if os.path.isdir(data):
        files = [os.path.join(data, name) for name in sorted(os.listdir(data))
                 if not name.startswith(".") and os.path.isfile(os.path.join(data, name))]
        if not files:
            _fail(where, "the directory 'data'", "one file or more", "%r, which holds none" % data)
        return files
    if not os.path.exists(data):
        _fail(where, "'data'", "a file, a directory or '-' (standard input)", "%r, which does not exist" % data)
    return [data]


class _CriteoInput:
    """Batches of ``batch_size`` rows from Criteo-format ``sources`` read one after the other (paths,
    ``.gz`` too, or binary file objects such as standard input): one :class:`CriteoReader` per
    source, opened when reached, and a batch may span the end of one source and the start of the
    next (only the very last batch is short). ``stops`` (per source: a byte offset, or None: its
    end) ends a source early; ``starts`` (per source: as ``CriteoReader``'s ``start``) begins one
    late. Memory does not grow with the input. :meth:`stats` sums the readers' counts; a source
    that cannot be read is an OSError naming it and the lines read before the failure.

    ``timestamp_column``: see :class:`CriteoReader`; with ``as_dicts`` the batches are then dicts
    ``{"dense", "ids", "label", "timestamp"}`` with the batch's time (its rows' latest), as
    :class:`RecModel` takes a data time; without, 4-tuples.

    Every batch ends exactly at the end of a reader batch (the first read of a source takes only
    the rows the pending batch still needs), so the input's position after each batch is exact:
    :meth:`position_after` gives it for the last ``_POSITIONS`` batches read, as ``{"batches",
    "source", "offset", "lines", "rows"}`` (batches from the start of the input; the source's index;
    :meth:`CriteoReader.position` within it), and :meth:`seek` to such a position starts the input
    there: the sources before it are not opened, nothing of the source before the offset is parsed
    (a ``.gz`` source is still decompressed up to it).

    RecModel resumes through :meth:`skip_batches`: the first batches are dropped (their rows were
    trained before the checkpoint), so a resumed run sees exactly the batches that follow; after
    :meth:`seek` the batches before the position are not read at all, only those after it are read
    and dropped.

    ``digests`` (sources that are paths): every source's bytes are hashed as they are read
    (:func:`_input_hasher`, ``CriteoReader(digest=...)``) and a position also holds ``read`` and
    ``digest`` (the bytes of its source read when it was taken, and their digest) and ``done``: for
    each source before it, its facts when it was read to its end (:func:`_source_facts` with ``read``,
    ``digest``, ``lines``, ``rows``). :class:`_InputCheckpoint` records them, and a resume proves its
    input with them (:func:`_input_resume_position`)."""

    _POSITIONS = 1024           # positions kept: the prefetcher is a few batches ahead of a checkpoint

    def __init__(self, sources, batch_size, stops=None, starts=None, timestamp_column=None, as_dicts=False,
                 digests=False):
        self.sources = list(sources)
        self.digests = bool(digests)
        self._done = []             # digests: the facts of the sources read to their end, from source 0
        self._seek_digest = None    # digests: the hasher of the sought source, holding its bytes before the offset
        self.batch_size = batch_size
        self.timestamp_column, self.as_dicts = timestamp_column, as_dicts
        self.stops = list(stops) if stops is not None else [None] * len(self.sources)
        self.starts = list(starts) if starts is not None else [None] * len(self.sources)
        self._readers = []          # (reader, its start: lines and rows before it)
        self._skip = 0
        self._iterator = None
        self._first_source = 0      # sources before it are not read (seek)
        self._first_batch = 0       # batches of the input before the first one read (seek)
        self._positions = collections.deque(maxlen=self._POSITIONS)
        self._positions_lock = threading.Lock()

    def _name(self, source):
        return getattr(source, "name", None) or str(source)

    def seek(self, position):
        """Start the input at ``position`` (from :meth:`position_after` of the same input): its
        source ``position["source"]`` at ``offset``/``lines``/``rows``, as batch ``position["batches"]``.
        Only before iteration starts. With ``digests`` the position also gives ``done`` (the facts of
        the sources before it, as recorded) and ``hasher`` (a hasher holding the bytes of its source
        before the offset), both verified against the files (:func:`_input_resume_position`)."""
        where = "_CriteoInput.seek"
        if self._iterator is not None:
            _fail(where, "the input", "not yet iterated", "one already being read", RuntimeError)
        if not isinstance(position, dict) or not {"batches", "source", "offset", "lines", "rows"} <= set(position):
            _fail(where, "'position'", "a dict from position_after()", position, TypeError)
        source = _check_int(where, "position['source']", position["source"], 0, len(self.sources) - 1)
        self._first_batch = _check_int(where, "position['batches']", position["batches"], 0)
        start = {key: _check_int(where, "position['%s']" % key, position[key], 0) for key in ("offset", "lines", "rows")}
        self._first_source = source
        self.starts[source] = start
        if self.digests:
            if len(position.get("done", ())) != source or position.get("hasher") is None:
                _fail(where, "'position'", "with digests, 'done' (the facts of the %d sources before it) and "
                      "'hasher'" % source, {k: v for k, v in position.items() if k != "hasher"}, TypeError)
            self._done = [dict(facts) for facts in position["done"]]
            self._seek_digest = position["hasher"]
        with self._positions_lock:
            self._positions.clear()

    def _record(self, batches, source, reader):
        found = dict(reader.position(), batches=batches, source=source)
        if self.digests:
            found["read"], found["digest"] = reader.read_digest()
        with self._positions_lock:
            self._positions.append(found)

    def position_after(self, batches):
        """Where the input is after its first ``batches`` batches (counted from the start of the
        input, the batches before a :meth:`seek` position included): ``{"batches", "source",
        "offset", "lines", "rows"}``, or None when that batch is not among the last ones read (or
        the input has not reached it). With ``digests`` it also holds ``read``, ``digest`` and
        ``done`` (see the class)."""
        with self._positions_lock:
            if batches == self._first_batch:
                start = self.starts[self._first_source] or {"offset": 0, "lines": 0, "rows": 0}
                found = dict(start, batches=batches, source=self._first_source)
                if self.digests:
                    hasher = self._seek_digest or _input_hasher()
                    found.update(read=found["offset"], digest=hasher.hexdigest())
            else:
                found = next((dict(f) for f in self._positions if f["batches"] == batches), None)
            if found is not None and self.digests:
                found["done"] = [dict(facts) for facts in self._done[:found["source"]]]
        return found

    def _batches(self):
        bs, parts, have, count = self.batch_size, [], 0, self._first_batch
        first = self._first_source
        for k, (source, start, stop) in enumerate(zip(self.sources[first:], self.starts[first:],
                                                      self.stops[first:]), first):
            reader = None
            try:
                digest = None
                if self.digests:
                    digest = self._seek_digest.copy() if k == first and self._seek_digest else _input_hasher()
                reader = CriteoReader(source, batch_size=bs, start=start, stop=stop,
                                      timestamp_column=self.timestamp_column, digest=digest)
                self._readers.append((reader, start if isinstance(start, dict) else {"lines": 0, "rows": 0}))
                with reader:
                    while True:
                        reader.batch_size = bs - have      # a pending batch takes only the rows it needs
                        try:
                            batch = next(reader)
                        except StopIteration:
                            break
                        if parts or len(batch[2]) < bs:
                            parts.append(batch)
                            have += len(batch[2])
                            if have < bs:
                                continue
                            batch = tuple(np.concatenate(c) for c in zip(*parts))
                            parts, have = [], 0
                        count += 1
                        self._record(count, k, reader)
                        yield batch
                if self.digests:                           # read to its end: its facts, for the positions after it
                    read, hexdigest = reader.read_digest()
                    facts = dict(_source_facts(source), read=read, digest=hexdigest,
                                 lines=reader.stats()["lines"], rows=reader.position()["rows"])
                    with self._positions_lock:
                        self._done.append(facts)
            except OSError as exc:
                line = reader.stats()["lines"] if reader is not None else 0
                raise OSError("For 'recboost train', the file %r must be readable, but reading it failed after "
                              "line %d: %s" % (self._name(source), line, exc)) from exc
        if have:
            count += 1
            self._record(count, k, reader)
            yield tuple(np.concatenate(c) if len(parts) > 1 else c[0] for c in zip(*parts))

    def _dicts(self, batches):
        for dense, ids, label, times in batches:
            yield {"dense": dense, "ids": ids, "label": label, "timestamp": int(times.max())}

    def __iter__(self):
        if self._iterator is None:
            self._iterator = self._batches()
            if self.as_dicts and self.timestamp_column is not None:
                self._iterator = self._dicts(self._iterator)
            for _ in itertools.islice(self._iterator, self._skip):
                pass
        return self._iterator

    def skip_batches(self, count):
        """Drop the first ``count`` batches of the input (read when iteration starts); after a
        :meth:`seek` to batch k, the k before it are not read at all, and ``count`` must be k or more."""
        if count < self._first_batch:
            _fail("_CriteoInput.skip_batches", "'count'", "at least the %d batches before the position the input "
                  "was sought to" % self._first_batch, count)
        self._skip = count - self._first_batch

    def stats(self):
        """``CriteoReader.stats`` summed over the sources read so far, with ``files``: how many. Counts
        of this input only: the ``lines`` and ``rows_yielded`` before a reader's ``start`` (a
        :meth:`seek`, a held-out part) are not counted."""
        total = {"lines": 0, "rows": 0, "rows_yielded": 0, "malformed": dict.fromkeys(_CRITEO_REASONS[1:], 0),
                 "files": len(self._readers)}
        for reader, start in list(self._readers):
            stats = reader.stats()
            total["lines"] += stats["lines"] - start["lines"]
            total["rows"] += stats["rows"]
            total["rows_yielded"] += stats["rows_yielded"] - start["rows"]
            for key, count in stats["malformed"].items():
                total["malformed"][key] += count
        return total


# =====================================================================================================
# Callbacks
# =====================================================================================================
# Every callback: ``EvictHook`` (RecModel runs it itself), ``ProgressMonitor``, and
# ``OnlineCheckpoint`` with the directory lock (it decides when a checkpoint is written; the file, its
# names and its reader are the next section's, "Checkpoints"); last the demo's ``_StopAfter``.


class EvictHook(_Callback):
    """Evict every HashEmbedding of the train network on a time or step interval (Rec SDK EvictHook).

    Fires in ``on_train_step_end``. Time is the tables' own clock (the data timestamp of their last
    lookup, or their step when batches carry no timestamp), so a replayed stream evicts the same way:
    a table is evicted when its clock has advanced ``evict_time_interval`` since its last eviction (or
    its first sight), or when ``evict_step_interval`` global steps have passed. ``None`` disables an
    interval. The tables are ``tables`` when given, else every HashEmbedding found in
    ``run_context.original_args().train_network``.

    Under :class:`RecModel` the hook is not called as a callback: RecModel applies it in stream order
    on its prefetch thread, right after each batch's ids are looked up (so the schedule counts
    stream batches), and checkpoints its schedule. Several hooks may be given (e.g. one per table,
    or a time and a step schedule): each runs on its own schedule and tables, in the order of the
    callbacks; ``tables`` must then be tables of the network (else a ValueError naming the table)."""

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
        tables = self._tables_of(run_context)
        for table, due in zip(tables, self.due(int(run_context.original_args().cur_step_num), tables)):
            if due:
                table.evict(table.cache.now)

    def due(self, step, tables):
        """Which of ``tables`` are due for eviction after global step ``step`` (updates the schedule).
        Used by :meth:`on_train_step_end` and by RecModel, which evicts in stream order on its
        prefetch thread and re-initialises the freed rows on the training thread."""
        by_step = self.evict_step_interval is not None and step - self._last_step >= self.evict_step_interval
        if by_step:
            self._last_step = step
        due = []
        for table, key in zip(tables, _table_keys(tables)):        # same-named tables keep their own times
            now = table.cache.now
            last = self._last_time.setdefault(key, now)
            by_time = self.evict_time_interval is not None and now - last >= self.evict_time_interval
            if by_step or by_time:
                self._last_time[key] = now
                self.evictions += 1
            due.append(by_step or by_time)
        return due

    def state_dict(self):
        """The schedule (for checkpoints): last eviction step and per-table last eviction time (by table
        name; the second table of a name already taken is ``name#2``, and so on, in the hook's table order)."""
        return {"last_step": self._last_step, "last_time": dict(self._last_time), "evictions": self.evictions}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`."""
        self._last_step = int(state["last_step"])
        self._last_time = {str(k): int(v) for k, v in state["last_time"].items()}
        self.evictions = int(state["evictions"])


def _callback_list(callbacks):
    """``callbacks`` (None, one Callback or a list) as a list; _Hooks checks the types."""
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _is_evict_hook(callback):
    """Whether ``callback`` is an :class:`EvictHook` (RecModel runs those itself)."""
    return isinstance(callback, EvictHook)


class ProgressMonitor(_Callback):
    """One progress line every ``every_steps`` steps or ``every_seconds`` seconds of training.

    The line has the step, samples/s since the last line, the mean loss since the last line, a
    running AUC, and for every hash table its occupancy, admissions and evictions. The running AUC is
    progressive validation: every ``eval_every`` steps the batch about to be trained on is first
    predicted (an extra forward pass on 1/``eval_every`` of the batches), and the AUC is computed
    over the last ``window`` such predictions. ``eval_every=0`` turns it off. Over every scored
    row since training began it also keeps the log loss (exact) and the AUC of the scores rounded to
    ``2**-16`` in probability (memory stays bounded: :class:`AUC` over at most 65537 distinct
    scores): :meth:`total_auc`, :meth:`total_log_loss`, and :meth:`window_log_loss` for the window.
    Log loss needs a binary cross-entropy loss (``BCEWithLogitsLoss``: the scores are logits, or
    ``BCELoss``: probabilities); with another loss it is None. ``status`` (a callable returning a
    str, or None) adds its text to every line (e.g. a reader's malformed-line counts).

    Works with :class:`RecModel` (``train``/``online_train``); with other trainers it prints the
    step and loss only.
    """

    def __init__(self, every_steps=None, every_seconds=10.0, eval_every=10, window=200000, printer=None,
                 status=None):
        where = "ProgressMonitor"
        if status is not None and not callable(status):
            _fail(where, "'status'", "None or a callable returning a str", status, TypeError)
        self.status = status
        self.every_steps = None if every_steps is None else _check_int(where, "every_steps", every_steps, minimum=1)
        self.every_seconds = None if every_seconds is None else \
            _check_number(where, "every_seconds", every_seconds, minimum=0, strict_min=True)
        self.eval_every = _check_int(where, "eval_every", eval_every, minimum=0)
        self.window = _check_int(where, "window", window, minimum=2)
        self.printer = printer or _log
        self.lines = []
        #: one dict per printed line: ``step``, ``samples_per_second``, ``auc`` (None before any)
        self.history = []
        self._scores, self._labels = [], []
        self._total_auc, self._total_loss, self._scored = AUC(), LogLoss(), 0
        self._rec = None

    def on_train_begin(self, run_context):
        """Start the clocks (fires once, before the first step)."""
        self._time = time.perf_counter()
        self._last_step = run_context.original_args().cur_step_num
        self._samples = self._start_samples = self._samples_now(run_context)
        self._losses = []
        self._scores, self._labels = [], []
        self._total_auc, self._total_loss, self._scored = AUC(), LogLoss(), 0
        self._rec = run_context.original_args().get("recboost")

    @staticmethod
    def _samples_now(run_context):
        rec = run_context.original_args().get("recboost")
        return rec.samples if rec is not None else 0

    def on_train_step_begin(self, run_context):
        """Progressive validation: predict the batch about to be trained on (every eval_every steps)."""
        cb_params = run_context.original_args()
        rec = cb_params.get("recboost")
        if not self.eval_every or rec is None or rec.loss_fn is None or \
                (cb_params.cur_step_num + 1) % self.eval_every:
            return
        inputs = cb_params.train_dataset_element
        label = inputs[-1].asnumpy().reshape(-1)
        score = rec.predict_step_inputs(inputs).asnumpy().reshape(-1)
        self._scores.append(score.astype(np.float64))
        self._labels.append(label.astype(np.float64))
        self._scored += score.size
        probs = self._probabilities(rec, self._scores[-1])
        if probs is not None:
            self._total_loss.update(probs, label)
            self._total_auc.update(np.round(probs * 65536.0) / 65536.0, label)
        else:
            self._total_auc.update(self._scores[-1], label)
        while sum(len(s) for s in self._scores) > self.window and len(self._scores) > 1:
            self._scores.pop(0)
            self._labels.pop(0)

    def on_train_step_end(self, run_context):
        """Collect the loss; print a line when one is due."""
        cb_params = run_context.original_args()
        out = cb_params.net_outputs
        loss = out[0] if isinstance(out, (tuple, list)) else out
        self._losses.append(float(np.asarray(loss.asnumpy()).mean()))
        now = time.perf_counter()
        steps = cb_params.cur_step_num - self._last_step
        if (self.every_steps and steps >= self.every_steps) or \
                (self.every_seconds and now - self._time >= self.every_seconds):
            self._emit(run_context, now)

    def on_train_end(self, run_context):
        """Print a last line for the steps since the previous one."""
        if self._losses:
            self._emit(run_context, time.perf_counter())

    def running_auc(self):
        """AUC over the progressive-validation window, or None before both classes were seen."""
        if not self._scores:
            return None
        labels, scores = np.concatenate(self._labels), np.concatenate(self._scores)
        if labels.min() == labels.max():
            return None
        return roc_auc(labels, scores)

    @staticmethod
    def _probabilities(rec, scores):
        """``scores`` (the network's outputs) as probabilities, or None when the loss does not say."""
        if isinstance(rec.loss_fn, nn.BCEWithLogitsLoss):
            return _sigmoid(scores)
        if isinstance(rec.loss_fn, nn.BCELoss):
            return scores
        return None

    def window_log_loss(self):
        """Log loss over the progressive-validation window, or None (no scored row, or a loss that is
        not a binary cross-entropy)."""
        rec = self._rec
        if not self._scores or rec is None:
            return None
        probs = self._probabilities(rec, np.concatenate(self._scores))
        return None if probs is None else log_loss(np.concatenate(self._labels), probs)

    def total_auc(self):
        """AUC over every row scored since training began (probabilities rounded to ``2**-16``), or
        None before both classes were seen."""
        try:
            return self._total_auc.eval()
        except (RuntimeError, ValueError):              # no row yet, or one class only
            return None

    def total_log_loss(self):
        """Log loss over every row scored since training began, or None (see :meth:`window_log_loss`)."""
        try:
            return self._total_loss.eval()
        except RuntimeError:                            # no row yet
            return None

    def scored_rows(self):
        """Rows scored before they trained, since training began."""
        return self._scored

    def _emit(self, run_context, now):
        cb_params = run_context.original_args()
        rec = cb_params.get("recboost")
        samples = self._samples_now(run_context)
        rate = (samples - self._samples) / max(now - self._time, 1e-9)
        parts = ["step %d" % cb_params.cur_step_num]
        if rec is not None:
            parts.append("%.1fK samples/s" % (rate / 1e3))
        parts.append("loss %.5f" % float(np.mean(self._losses)))
        auc = self.running_auc()
        if auc is not None:
            parts.append("auc %.4f" % auc)
        total, loss, total_loss = self.total_auc(), self.window_log_loss(), self.total_log_loss()
        if total is not None:
            parts.append("auc (all) %.4f" % total)
        if loss is not None:
            parts.append("log loss %.4f (all %.4f)" % (loss, total_loss))
        for table in (rec.tables if rec is not None else ()):
            stats = table.cache.stats()
            parts.append("%s %d/%d rows, admitted %d, evicted %d" % (
                table.table_name, len(table.cache), table.cache.capacity, stats.get("admitted", 0),
                stats.get("evicted", 0)))
        if rec is not None and rec.overflow_steps:
            parts.append("skipped %d" % rec.overflow_steps)
        if self.status is not None:
            parts.append(str(self.status()))
        line = " | ".join(parts)
        self.lines.append(line)
        self.history.append({"step": cb_params.cur_step_num, "samples_per_second": rate, "auc": auc,
                             "total_auc": total, "log_loss": loss, "total_log_loss": total_loss})
        self.printer(line)
        self._time, self._samples, self._losses = now, samples, []
        self._last_step = cb_params.cur_step_num


def _pid_alive(pid):
    """True when process ``pid`` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_directory(where, directory, create=False):
    """Fail early, naming ``directory``, when checkpoints cannot be written there: it is a file, it
    (or the folder that would hold it) is not writable. With ``create`` the directory is made."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        _fail(where, "'directory'", "a directory", "%s, which is a file" % directory)
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            _fail(where, "'directory'", "a directory that can be created", "%s (%s)" % (directory, exc.strerror))
    probe_dir = os.path.abspath(directory)
    while not os.path.exists(probe_dir):       # the folder that would hold the new directory
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        _fail(where, "'directory'", "a path whose existing part is a directory",
              "%s (%s is a file)" % (directory, probe_dir))
    probe = os.path.join(probe_dir, ".recboost-probe-%d-%d" % (os.getpid(), threading.get_ident()))
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as exc:
        _fail(where, "'directory'", "a writable directory", "%s (%s: %s)" % (
            directory, type(exc).__name__, exc.strerror))


class _DirectoryLock:
    """An exclusive OS advisory lock (``fcntl.flock``) on ``<directory>/.recboost.lock``.

    The file holds the pid of the holder. The kernel drops the lock when the holder dies, however
    it dies, so the lock of a dead process is simply taken over. ``release`` removes the file; an
    acquirer that locked a file removed meanwhile retries on the new one."""

    def __init__(self, directory):
        self.path = os.path.join(directory, _LOCK_NAME)
        self.fd = None

    def acquire(self, where):
        import fcntl
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RuntimeError(
                    "For '%s', the checkpoint directory %r must be used by one trainer at a time, but "
                    "it is locked by the running process pid %s (its lock file: %s)."
                    % (where, os.path.dirname(self.path), holder, self.path)) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)                          # a releasing holder removed it: lock the new one
        if self.fd is not None:                   # the file this lock held was removed: drop it
            os.close(self.fd)
        previous = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if previous and previous != str(os.getpid()):
            _log("OnlineCheckpoint: took over the lock of %s from pid %s, which no longer holds it"
                 % (os.path.dirname(self.path), previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        self.fd = fd

    def held(self):
        """True while this lock holds the directory's lock file: the file at :attr:`path` is the one
        locked (not removed with its directory, nor replaced)."""
        if self.fd is None:
            return False
        try:
            now, mine = os.stat(self.path), os.fstat(self.fd)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self):
        """Remove the lock file (only the one this lock holds: never another trainer's) and unlock."""
        if self.fd is None:
            return
        if self.held():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)                          # closing drops the flock
        self.fd = None


def _temporary_is_stale(pid, path):
    """A temporary checkpoint file is stale when the process that writes it is gone (or it is this
    process's and not being written)."""
    if pid == os.getpid():
        return path not in _WRITING
    return not _pid_alive(pid)


class OnlineCheckpoint(_Callback):
    """Periodic, atomic checkpoints of a :class:`RecModel` run, keeping the last ``keep``.

    Every ``every_steps`` steps and/or ``every_seconds`` seconds (and at the end of training when
    ``save_on_end``) it writes ``<directory>/<prefix>-<step>.npz`` with
    :meth:`RecModel.save_checkpoint`: dense parameters, optimizer state, loss-scale state, hash
    tables with their caches and slots, and the stream position. A file appears only complete
    (write to a temporary file, fsync, rename), so a crash never leaves a partial checkpoint that
    :func:`latest_checkpoint` would pick up. Resume with ``online_train(..., resume_from=directory)``.

    One trainer per directory: from train start to train end the callback holds an exclusive OS
    lock (``fcntl.flock``) on ``<directory>/.recboost.lock``; a second trainer gets a RuntimeError
    naming the directory and the holder's pid. Every save first checks that the lock file is still
    the one it locked: if the directory was deleted or replaced meanwhile, the save locks it again
    (logged), or raises a RuntimeError when another trainer holds it or it holds another run's
    checkpoints. The kernel releases the lock of a process that dies,
    so a killed run's lock is taken over. Temporary files are named ``.tmp-<pid>-*.npz``; at train
    start the ones of processes no longer running are removed, never another live writer's. Every
    checkpoint records its run (a RecModel keeps one run id, carried through its checkpoints and
    resumes): pruning to ``keep`` removes only this run's files, and training does not start in a
    directory holding checkpoints of another run (resume from it, or use another directory), nor
    holding this run's checkpoints after the model's step (a resume from an older checkpoint:
    :meth:`later_checkpoints`), so one directory never holds two branches of a run.

    The directory is checked at construction and again at train start (created if missing): a
    path that is a file, or a directory that cannot be written, is a ValueError naming it. A save
    that fails with an OSError (a full disk, a lost mount; its message names the path and the bytes
    being written) does not end training: the last good checkpoint is kept, the failure is logged
    with the path, counted in ``failed_saves``, and the save is tried again at the next interval;
    ``max_failed_saves`` failures in a row stop training with a RuntimeError naming the path and the
    last good checkpoint.

    Args:
        directory (str): the checkpoint directory.
        every_steps (int): save every this many steps.
        every_seconds (float): save when this many seconds passed since the last save.
        keep (int): checkpoints of this run to keep (the newest).
        prefix (str): file name prefix: a plain file name (no folder part, not starting with ".");
            resume with ``online_train(..., resume_from=directory, resume_prefix=prefix)``.
        save_on_end (bool): save at train end too.
        max_failed_saves (int): consecutive failed saves after which training stops (>= 1).
        full_every (int): None (every checkpoint full), or incremental checkpoints: every
            ``full_every``-th checkpoint of a training (the first included) is a full base, the ones
            between are deltas holding only what changed since the checkpoint before
            (``RecModel.save_checkpoint(chain=...)``). Resume and :meth:`RecModel.load_checkpoint`
            follow a delta's chain back to its base, refusing a damaged, missing or foreign link by
            name; pruning to ``keep`` keeps every file a kept checkpoint's chain needs. Not with a
            row-wise hash table, nor on two OnlineCheckpoints of one training (a model keeps one chain).
    """

    def __init__(self, directory, every_steps=None, every_seconds=None, keep=3, prefix="recboost",
                 save_on_end=True, max_failed_saves=3, full_every=None):
        where = "OnlineCheckpoint"
        if not isinstance(directory, (str, os.PathLike)):
            _fail(where, "'directory'", "a path", directory, TypeError)
        if every_steps is None and every_seconds is None:
            _fail(where, "'every_steps' or 'every_seconds'", "set", None)
        self.directory = os.fspath(directory)
        self.every_steps = None if every_steps is None else _check_int(where, "every_steps", every_steps, minimum=1)
        self.every_seconds = None if every_seconds is None else \
            _check_number(where, "every_seconds", every_seconds, minimum=0, strict_min=True)
        self.keep = _check_int(where, "keep", keep, minimum=1)
        self.prefix = _check_prefix(where, prefix)
        self.save_on_end = _check_bool(where, "save_on_end", save_on_end)
        self.max_failed_saves = _check_int(where, "max_failed_saves", max_failed_saves, minimum=1)
        self.full_every = None if full_every is None else _check_int(where, "full_every", full_every, minimum=1)
        self._in_chain = None       # checkpoints of this training since its last base (None: none yet)
        _check_directory(where, self.directory)
        self.saved = []
        #: saves that failed (an OSError), over the life of the callback
        self.failed_saves = 0
        self._failures_in_a_row = 0
        self._lock = _DirectoryLock(self.directory)
        self._rank = 0              # this process's rank when the checkpoints are written in parts
        self._runs = {}             # file name -> (mtime_ns, run id): metadata read once per file

    def on_train_begin(self, run_context):
        """Check and lock the directory, remove stale temporary files, start the clock (fires once,
        before the first step)."""
        where = "OnlineCheckpoint"
        rec = self._model(run_context)
        _check_directory(where, self.directory, create=True)
        shard = rec.checkpoint_shard
        if shard is not None and self.every_seconds:
            _fail(where, "'every_seconds'", "None when a hash table is row-wise (every rank must save at the "
                  "same steps: use every_steps)", self.every_seconds)
        if shard is not None and self.full_every is not None:
            _fail(where, "'full_every'", "None when a hash table is row-wise (its checkpoints are written in parts "
                  "per rank; incremental checkpoints are not)", self.full_every)
        chained = [cb for cb in run_context.original_args().get("list_callback") or ()
                   if isinstance(cb, OnlineCheckpoint) and cb.full_every is not None]
        if self.full_every is not None and len(chained) > 1:
            _fail(where, "'full_every'", "None on all but one OnlineCheckpoint of a training (a model keeps one chain "
                  "of incremental checkpoints: each delta builds on its last base or delta, in one folder)",
                  "full_every in %s" % sorted(cb.directory for cb in chained))
        self._in_chain = None
        self._rank = 0 if shard is None else shard[0]
        self._time = time.monotonic()
        if self._rank:
            return             # rank 0 holds the directory and prunes; the other ranks write their parts
        self._lock.acquire(where)
        try:
            for name in os.listdir(self.directory):
                match = _TMP_PATTERN.match(name)
                if match and _temporary_is_stale(int(match.group(1)),
                                                 os.path.abspath(os.path.join(self.directory, name))):
                    os.unlink(os.path.join(self.directory, name))
            self._check_no_other_run(rec)
            later = [name for name, run, _ in self._checkpoint_runs()
                     if run == rec.run_id and _checkpoint_step(name, self.prefix) > rec.step]
            if later:
                self.later_checkpoints(later, rec.step)
        except BaseException:
            self._lock.release()
            raise

    def _check_no_other_run(self, rec):
        foreign = [name for name, run, _ in self._checkpoint_runs() if run != rec.run_id]
        if foreign:
            _fail("OnlineCheckpoint", "the checkpoint directory %r" % self.directory, "free of other runs' "
                  "checkpoints (resume from it with online_train(resume_from=...), or use another "
                  "directory)", "%s of another run" % foreign[-1])

    def later_checkpoints(self, names, step):
        """At train start (the directory locked), when the directory holds checkpoints of this run after
        the model's ``step`` (file ``names``, by step): the run resumed from an older checkpoint, and
        training on here would mix a second branch with the first one's later files (a resume of the
        directory would load the abandoned newest, ``keep`` would prune the new branch's own). Here: a
        ValueError naming them, nothing changed (a subclass may remove them: :meth:`_remove`)."""
        _fail("OnlineCheckpoint", "the checkpoint directory %r" % self.directory, "free of checkpoints of "
              "this run after step %d, the step it trains on from (they are of the branch a resume from an "
              "older checkpoint abandons: a resume of the directory would load them; move them away, or "
              "checkpoint into another directory)" % step, names)

    def _relock(self, rec):
        """Before a save on rank 0: when the directory's lock file is no longer the one this run
        locked (the directory was deleted or replaced during training), lock it again, and only if no
        other trainer holds it and it holds no other run's checkpoints; else raise RuntimeError, so
        no two trainers ever prune each other's files. Logged loudly either way."""
        if self._lock.held():
            return
        _log("OnlineCheckpoint: THE LOCK OF %s IS GONE (the directory was deleted or replaced during "
             "training); locking it again before saving" % self.directory)
        try:
            _check_directory("OnlineCheckpoint", self.directory, create=True)
            self._lock.acquire("OnlineCheckpoint")
            self._check_no_other_run(rec)
        except (RuntimeError, ValueError) as exc:
            self._lock.release()
            raise RuntimeError("For 'OnlineCheckpoint', this run must hold its checkpoint directory %r to save "
                               "there, but the directory was replaced during training and cannot be taken "
                               "back: %s" % (self.directory, exc)) from exc

    def __exit__(self, *exc):
        """Release the directory lock (the trainer leaves the callback's context when training ends,
        whether it ended well or not)."""
        self._lock.release()

    def on_train_step_end(self, run_context):
        """Save when a checkpoint is due (after the step, before the next one)."""
        step = run_context.original_args().cur_step_num
        if (self.every_steps and step % self.every_steps == 0) or \
                (self.every_seconds and time.monotonic() - self._time >= self.every_seconds):
            self._save(run_context)
            self._time = time.monotonic()

    def on_train_end(self, run_context):
        """Save the final state (unless the last step was just saved)."""
        cb_params = run_context.original_args()
        if self.save_on_end and (not self.saved or self.saved[-1] != self._path(cb_params.cur_step_num)):
            self._save(run_context)

    @staticmethod
    def _model(run_context):
        cb_params = run_context.original_args()
        rec = cb_params.get("recboost")
        if rec is None:
            _fail("OnlineCheckpoint", "the trainer", "a RecModel", type(cb_params.get("network")).__name__,
                  TypeError)
        return rec

    def checkpoint_extra(self, head):
        """The JSON object (a dict) each checkpoint carries as its ``extra`` field, or None (here: none;
        a subclass may give one): called while the checkpoint is written, with the manifest's counters
        ``head`` (:meth:`RecModel.save_checkpoint`'s ``extra``)."""
        return None

    def _path(self, step):
        """The path of the checkpoint of step ``step``."""
        return os.path.join(self.directory, _checkpoint_name(self.prefix, step))

    def _checkpoint_runs(self):
        """``[(file name, run id, predecessor)]`` of the checkpoints with our prefix, by step (the
        predecessor: a delta's, :func:`_checkpoint_link`; else None)."""
        found = []
        for name in os.listdir(self.directory):
            step = _checkpoint_step(name, self.prefix)
            if step is not None:
                path = os.path.join(self.directory, name)
                try:
                    mtime = os.stat(path).st_mtime_ns
                except FileNotFoundError:
                    continue
                if self._runs.get(name, (None,))[0] != mtime:
                    self._runs[name] = (mtime,) + _checkpoint_link(path)
                found.append((step, name) + self._runs[name][1:])
        return [entry[1:] for entry in sorted(found)]

    def _save(self, run_context):
        cb_params = run_context.original_args()
        rec = self._model(run_context)
        path = self._path(cb_params.cur_step_num)
        if not self._rank:
            self._relock(rec)
        chain = None if self.full_every is None else "delta" if self._in_chain is not None and \
            self._in_chain < self.full_every and os.path.isfile(self.saved[-1]) else "base"   # (a base when it is gone)
        try:
            rec.save_checkpoint(path, extra=self.checkpoint_extra, chain=chain)
        except OSError as exc:
            self.failed_saves += 1
            self._failures_in_a_row += 1
            last = self.saved[-1] if self.saved else None
            _log("OnlineCheckpoint: SAVING %s FAILED (%s: %s); the last good checkpoint %s is kept; "
                 "%d failed save(s) in a row, training stops at %d" % (
                     path, type(exc).__name__, exc, last or "(none yet)", self._failures_in_a_row,
                     self.max_failed_saves))
            if self._failures_in_a_row >= self.max_failed_saves:
                raise _TrainingStopped("For 'OnlineCheckpoint', saving a checkpoint must succeed within %d "
                                   "tries in a row, but %d failed, the last to %r (%s: %s); the last "
                                   "good checkpoint is %r." % (self.max_failed_saves, self._failures_in_a_row,
                                                              path, type(exc).__name__, exc, last)) from exc
            return
        self._failures_in_a_row = 0
        self._in_chain = 1 if chain == "base" else None if chain is None else self._in_chain + 1
        cb_params.latest_ckpt_file = path
        cb_params.last_save_ckpt_step = cb_params.cur_step_num
        self.saved.append(path)
        if self._rank:
            return
        ours = [(name, before) for name, run, before in self._checkpoint_runs() if run == rec.run_id]
        links, needed = dict(ours), set()
        for name, _ in ours[-self.keep:]:           # the kept checkpoints and every file their chains need
            while name is not None and name not in needed:
                needed.add(name)
                name = links.get(name)
        for name in [name for name, _ in ours if name not in needed]:
            self._remove(name)

    def _remove(self, name):
        """Remove the checkpoint file ``name`` of the directory: the checkpoint first, then its parts."""
        _unlink_beside(os.path.join(self.directory, name))
        self._runs.pop(name, None)
        parts = re.compile(r"%s\.part-\d+-of-\d+\.npz" % re.escape(name[:-4]))
        for other in os.listdir(self.directory):
            if parts.fullmatch(other):
                _unlink_beside(os.path.join(self.directory, other))


class _StopAfter(_Callback):
    """Request a stop once ``steps`` steps have run."""

    def __init__(self, steps):
        self.steps = steps

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.steps:
            run_context.request_stop()


# =====================================================================================================
# Checkpoints
# =====================================================================================================
# A checkpoint's files, written and read back here and nowhere else. Who owns what:
#   _write_checkpoint_file, _read_checkpoint_file    the file: stored .npy members digested as written and a
#                                                    self-checksummed manifest listing them; read whole and strict
#   _checkpoint_file_manifest, _checkpoint_link      the manifest alone (its checksum verified), its run id and
#                                                    a delta's predecessor
#   _CheckpointChain, _read_checkpoint_chain,        incremental checkpoints: a delta against the chain's last
#   _patch_arrays                                    checkpoint; a delta's chain read back to its base, applied
#   _checkpoint_schema, _CHECKPOINT_PARTS            the manifest's fields (_validate): one file, or a row-wise
#                                                    checkpoint's list of parts (_checkpoint_part names them)
#   _checkpoint_name, _checkpoint_step,              the names of a directory's checkpoints
#   latest_checkpoint, _check_prefix
#   _CheckpointStore                                 a model's state to its file(s) and back (RecModel's
#                                                    save_checkpoint and load_checkpoint)
#   _checkpoint_extra                                the caller's JSON object a checkpoint carries (manifest
#                                                    field "extra", save_checkpoint(extra=...)), by its schema
#   _input_position_schema, _input_position_record   the extra of recboost train: its input position
#   _input_position_path                             (the side file of versions before: only named, never read)
# OnlineCheckpoint (section Callbacks) decides when to write; _InputCheckpoint and the resume's proof of
# the input (section Command line) write and check the position.


# ---- the checkpoint file: every member checked on read ------------------------------------------
# A checkpoint (format 4) is a zip of stored .npy members (what np.savez writes, so np.load still
# opens it): the arrays, then the member "manifest", whose JSON is a checked record
# (_json_checked_bytes: it holds the sha256 of its own canonical form) and lists every other member
# with its size and sha256 ("members"). Reading (_read_checkpoint_file) does not use np.load: the
# zip's entries are checked against the file (stored, not encrypted, inside it), each .npy header is
# parsed strictly and its declared size compared with the member's real size before anything is
# allocated, the bytes are read straight into the new array, each member's sha256 is computed on two
# threads beside the reading of the next members (_DigestsBeside) and compared with the manifest's (the
# zip's CRC-32 of the same bytes is then not computed; zipfile only lists the entries); any
# other error on the way is caught there too, so a damaged file is always one ValueError. Format 3 (recboost 0.2.0 before the checksums: the same layout, a plain JSON
# manifest, no "members") is read through the same path, its members checked by the zip's CRC-32.
_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 1 << 16
_NPY_KINDS = "biufcSU"        # bool, ints, floats, complex, bytes, str: the only dtypes a checkpoint holds
_SHA256_HEX = _Rule("a sha256 hex digest", str, test=lambda v: re.fullmatch(r"[0-9a-f]{64}", v) is not None)
_CHECKPOINT_MEMBERS = _Map(_Fields({"bytes": _COUNT, "sha256": _SHA256_HEX}))


class _Unreadable(ValueError):
    """A checkpoint file that cannot be read whole and verified. Its text says what failed, as the end
    of a sentence about the file ("cannot be read (...)", "has format 5, ..."); the callers name the file."""


def _npy_member(fh, info, total, beside=None, hold=None):
    """The array held by the stored ``.npy`` member ``info`` (a ``zipfile.ZipInfo`` of the central
    directory) of the open zip file ``fh`` (of ``total`` bytes), and the sha256 hex digest of the
    member's bytes. The entry is checked against the file, and its local header against the entry
    (its signature and name, as zipfile checks them); the .npy header is parsed strictly
    (:func:`_npy_header`) and the data size it declares compared with the member's size before the
    array is allocated.
    The data is then read straight into the array, ``_IO_CHUNK`` at a time (no bytes object, no
    copy).

    Without ``beside``, each chunk's sha256 is computed on a thread (:class:`_Sha256Beside`) while the
    next is read and the zip's CRC-32 computed, which is compared with the entry's at the end; returns
    ``(array, sha256 hex)``. With ``beside`` (a :class:`_DigestsBeside`, for a member whose sha256 a
    checked manifest lists), the member's sha256 is computed there from its bytes once read, while the
    caller reads the next members, and the CRC-32 of its data is not computed: the sha256 the caller
    compares checks the same bytes (a member of at most ``_NPY_MAX_HEADER`` bytes still has its CRC-32
    checked before its header is parsed); returns ``(array, a future of the sha256 hex)``. With
    ``hold`` (a callable of the dtype and shape) the data is not read: the member's headers are
    checked and ``(hold(dtype, shape), None)`` returned (:class:`_UnreadMembers`). Any problem
    raises :class:`_Unreadable` naming the member."""
    name = info.filename

    def bad(problem):
        raise _Unreadable("cannot be read (its member %r %s)" % (name, problem))
    if info.flag_bits & 0x1:
        bad("is marked encrypted (zip flag bits 0x%x); recboost writes plain members" % info.flag_bits)
    if info.compress_type != zipfile.ZIP_STORED:
        bad("uses zip compression method %d; recboost writes stored members (method 0)" % info.compress_type)
    if info.compress_size != info.file_size or info.header_offset + info.compress_size > total:
        bad("declares %d bytes (%d stored) at offset %d, which do not fit the file of %d bytes"
            % (info.file_size, info.compress_size, info.header_offset, total))
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        bad("is damaged (its local zip header at offset %d is %s)" % (
            info.header_offset, "truncated" if len(local) != 30 else "not a zip header (%r)" % local[:4]))
    flags, name_length, extra_length = int.from_bytes(local[6:8], "little"), \
        int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    stored_name = fh.read(name_length)
    try:
        stored_name = stored_name.decode("utf-8" if flags & 0x800 else "cp437")
    except UnicodeDecodeError:
        pass
    if stored_name != info.orig_filename:
        bad("is damaged (its local zip header names %r)" % (stored_name,))
    begin = info.header_offset + 30 + name_length + extra_length
    if begin + info.file_size > total:
        bad("declares %d bytes at offset %d, which do not fit the file of %d bytes" % (info.file_size, begin, total))
    fh.seek(begin)
    source = fh
    if info.file_size <= _NPY_MAX_HEADER:      # a small member is read whole and its CRC-32 checked first
        source = io.BytesIO(fh.read(info.file_size))
        if zlib.crc32(source.getbuffer()) != info.CRC:
            bad("is damaged (Bad CRC-32 for file %r)" % name)
    sha, crc, left, pieces = None if beside else _Sha256Beside(), 0, info.file_size, []
    try:
        def take(n, part):
            nonlocal crc, left
            data = source.read(min(n, left))
            if len(data) != n:
                bad("ends inside its %s (%d of %d bytes)" % (part, len(data), n))
            left -= n
            if sha is None:
                pieces.append(data)
            else:
                sha.update(data)
                crc = zlib.crc32(data, crc)
            return data
        dtype, shape, fortran_order, _ = _npy_layout(take, info.file_size, "member", bad)
        count = math.prod(shape)
        if hold is not None:
            return hold(dtype, shape), None
        flat = _host_array(count, dtype)       # (a table's rows and slots are taken as read: their memory)
        view, done = memoryview(flat.view(np.uint8)), 0
        with _FaultInBeside(flat):           # (its pages faulted in ahead of the reading, on a helper thread)
            while done < len(view):          # read into the array; hashed on the thread while the next is read
                got = source.readinto(view[done:done + _IO_CHUNK])
                if not got:
                    bad("ends inside its data (%d of %d bytes)" % (done, len(view)))
                if sha is not None:
                    sha.update(view[done:done + got])
                    crc = zlib.crc32(view[done:done + got], crc)
                done += got
    finally:
        if sha is not None:
            sha.close()
    array = flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)
    if sha is None:
        return array, beside.submit(pieces + [view])
    if crc != info.CRC:
        bad("is damaged (Bad CRC-32 for file %r: its bytes have %08x, the zip lists %08x)" % (name, crc, info.CRC))
    return array, sha.hexdigest()


def _npy_layout(take, size, what, bad):
    """``(dtype, shape, fortran_order, start)`` of a .npy array of ``size`` bytes in all, a file or a
    ``what`` ("member", "file") of one, whose leading bytes ``take(n, part)`` gives in order (it raises
    when they end early): the magic and version, the header's length, the header itself, parsed
    strictly (:func:`_npy_header`). The data, from byte ``start`` on, must be exactly the bytes the
    header declares. Anything else is ``bad(problem)`` (it raises)."""
    lead = take(8, "npy magic")
    if lead[:6] != _NPY_MAGIC or lead[6:8] not in (b"\x01\x00", b"\x02\x00", b"\x03\x00"):
        bad("is not a .npy array (it starts %r)" % lead)
    width = 2 if lead[6] == 1 else 4
    length = int.from_bytes(take(width, "npy header length"), "little")
    start = 8 + width + length
    if length > _NPY_MAX_HEADER or start > size:
        bad("declares a .npy header of %d bytes in a %s of %d bytes" % (length, what, size))
    try:
        text = take(length, "npy header").decode("utf-8" if lead[6] == 3 else "latin1")
    except UnicodeDecodeError as exc:
        bad("has a .npy header that is not UTF-8 (%s)" % exc)
    dtype, shape, fortran_order = _npy_header(text, bad)
    if math.prod(shape) * dtype.itemsize != size - start:
        bad("declares shape %s of %s (%d bytes of data), but holds %d bytes of data"
            % (shape, dtype, math.prod(shape) * dtype.itemsize, size - start))
    return dtype, shape, fortran_order, start


def _npy_header(text, bad):
    """``(dtype, shape, fortran_order)`` of the .npy header dict ``text``, parsed strictly:
    ``ast.literal_eval`` of a dict with exactly numpy's three keys, a plain dtype of numbers or
    strings, a shape of ints >= 0; anything else is ``bad(problem)`` (it raises)."""
    try:
        header = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        bad("has a .npy header that is not a dict literal (%s: %r)" % (type(exc).__name__, text[:120]))
    shape = header.get("shape") if isinstance(header, dict) else None
    if not isinstance(header, dict) or sorted(header) != ["descr", "fortran_order", "shape"] \
            or not isinstance(header["descr"], str) or not isinstance(header["fortran_order"], bool) \
            or not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        bad("has a bad .npy header %r" % text[:200])
    try:
        dtype = np.dtype(header["descr"])
    except (TypeError, ValueError, SyntaxError) as exc:
        bad("has a .npy header of an unknown dtype %r (%s)" % (header["descr"], exc))
    if dtype.kind not in _NPY_KINDS or dtype.fields is not None or dtype.subdtype is not None or not dtype.itemsize:
        bad("holds dtype %r; recboost writes arrays of numbers and strings only" % header["descr"])
    return dtype, shape, header["fortran_order"]


def _read_checkpoint_file(path, manifest_only=False, later=None):
    """The checkpoint file ``path`` read whole and verified: ``(manifest, arrays)`` (member name ->
    array, the manifest's member excluded; empty with ``manifest_only``, which checks the manifest
    only: its own digest, or for format 3 the zip's CRC-32). Every problem, whatever raised it
    (zipfile, numpy, json, the OS, memory), is one :class:`_Unreadable` saying what failed: the
    file is not a zip, a member is damaged, missing, not listed, or differs from its listed size or
    sha256, the manifest is not checked JSON, the format is not 3 or 4. ``later``: an
    :class:`_UnreadMembers` of ``path``; in a full checkpoint of format 4 the members it names
    are left unread, each a placeholder among the arrays, read and verified by ``later.read``."""
    with _as_unreadable():
        return _read_checkpoint_members(path, manifest_only, later)


@contextlib.contextmanager
def _as_unreadable():
    """Reading a checkpoint file: any exception but :class:`_Unreadable` (zipfile's, numpy's, the OS's,
    memory's: whatever a damaged file makes them raise) becomes one, saying what failed."""
    try:
        yield
    except _Unreadable:
        raise
    except Exception as exc:
        raise _Unreadable("cannot be read (%s: %s)" % (type(exc).__name__, str(exc)[:300])) from exc


class _UnreadMembers:
    """Members of a checkpoint file that :func:`_read_checkpoint_file` leaves unread: the hash tables'
    rows, slots and live flags, read by :meth:`read` once the tables' caches are built from the file,
    so that a restart never holds a cache's state beside its rows (``_CheckpointStore.read``). Until
    then each stands among the arrays as a placeholder of its dtype and shape that holds no memory
    (zero strides, read-only): the manifest's and the tables' checks see its dtype and shape, and
    its values are not the member's (nothing reads them: :meth:`read` replaces it). A member is
    verified against its size and sha256 in the manifest, in the file first opened: when read, or
    with :attr:`beside` (a :class:`_DigestsBeside`) by :meth:`check_read`, its sha256 computed
    there while the next members are read."""

    def __init__(self, path):
        self.path, self.file, self.held, self.beside = path, None, {}, None

    @staticmethod
    def identity(stat):
        """What tells one file from another at a path (``os.stat_result``): :attr:`file` of the first."""
        return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns

    @staticmethod
    def names(manifest):
        """The members to leave unread: those the manifest's hash tables name as rows, live flags and
        slots (names only; the manifest is checked afterwards, against the placeholders)."""
        tables = manifest.get("tables")
        names = set()
        for table in tables if isinstance(tables, list) else ():
            if isinstance(table, dict):
                slots = table.get("slots")
                names.update(name for name in [table.get("table"), table.get("live")] + list(
                    slots.values() if isinstance(slots, dict) else ()) if isinstance(name, str))
        return names

    def hold(self, info, sha256, dtype, shape):
        """The placeholder of the member ``info`` (listed with ``sha256``) of ``dtype`` and ``shape``."""
        placeholder = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape), writeable=False)
        self.held[id(placeholder)] = types.SimpleNamespace(placeholder=placeholder, info=info, sha256=sha256,
                                                           array=None, digest=None)   # (held: its id stays its own)
        return placeholder

    def read(self, array):
        """``array``, or when it is one of the placeholders, its member, read at the first call (and
        verified, without :attr:`beside`), the same array at any other. :class:`_Unreadable` names the
        member, or the file when it is no longer the one first opened."""
        held = self.held.get(id(array))
        if held is None or held.placeholder is not array:
            return array
        if held.array is None:
            with _as_unreadable(), open(self.path, "rb") as fh:
                stat = os.fstat(fh.fileno())
                if self.identity(stat) != self.file:
                    raise _Unreadable("changed while it was read (another file is at its path now, or it was written)")
                held.array, held.digest = _npy_member(fh, held.info, stat.st_size, self.beside)
            if self.beside is None:
                _check_member_digest(held.info.filename[:-4], held.digest, held.sha256)
        return held.array

    def check_read(self):
        """Every placeholder was read (:meth:`read`; else RuntimeError naming the members left unread)
        and its sha256 computed beside is the manifest's (else :class:`_Unreadable`); call it while
        :attr:`beside` is open."""
        unread = sorted(held.info.filename for held in self.held.values() if held.array is None)
        if unread:
            raise RuntimeError("recboost: the checkpoint %r's members %s were left unread" % (self.path, unread))
        for held in self.held.values():
            if not isinstance(held.digest, str):        # (a future of the digest computed beside)
                _check_member_digest(held.info.filename[:-4], held.digest.result(), held.sha256)


def _check_member_digest(name, digest, listed):
    """:class:`_Unreadable` unless the member ``name``'s sha256 ``digest`` is the one its manifest lists."""
    if digest != listed:
        raise _Unreadable("cannot be read (its member %r has sha256 %s, its manifest lists %s: the file is damaged)"
                          % (name, digest, listed))


def _read_checkpoint_members(path, manifest_only, later):
    """:func:`_read_checkpoint_file`'s body (its raw exceptions are wrapped there)."""
    def bad(problem):
        raise _Unreadable("cannot be read (%s)" % problem)
    with open(path, "rb") as fh:
        stat = os.fstat(fh.fileno())
        total = stat.st_size
        with zipfile.ZipFile(fh) as zf:
            infos = {}
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    bad("it holds the member %r, not an array (.npy)" % info.filename)
                if info.filename[:-4] in infos:
                    bad("it holds the member %r twice" % info.filename)
                infos[info.filename[:-4]] = info
            if _CHECKPOINT_MANIFEST not in infos:
                bad("it has no member %r%s" % (_CHECKPOINT_MANIFEST, "; it has format 2's 'meta': a checkpoint of "
                                               "recboost before 0.2.0, which this version does not read"
                                               if "meta" in infos else ""))
            data, _ = _npy_member(fh, infos.pop(_CHECKPOINT_MANIFEST), total)
            if data.dtype != np.uint8 or data.ndim != 1:
                bad("its manifest is %s of shape %s, not JSON bytes (uint8)" % (data.dtype, data.shape))
            manifest = _checkpoint_manifest(data.tobytes())
            listed = None
            if manifest["format"] in (_CHECKPOINT_FORMAT, _CHECKPOINT_DELTA_FORMAT):
                listed = _validate(manifest, _Fields({"members": _CHECKPOINT_MEMBERS}), _checkpoint_checking(
                    lambda problem: bad("its manifest %s" % problem)))["members"]
                if sorted(listed) != sorted(infos):
                    bad("its members %s differ from those its manifest lists %s"
                        % (sorted(infos)[:8], sorted(listed)[:8]))
            arrays, digests = {}, {}
            unread = set()
            if later is not None and manifest["format"] == _CHECKPOINT_FORMAT:
                later.file, unread = later.identity(stat), later.names(manifest)
            with _DigestsBeside() as beside:     # (format 3: no digests listed, each member's CRC-32 checked)
                for name, info in () if manifest_only else infos.items():
                    if listed is not None and info.file_size != listed[name]["bytes"]:
                        bad("its member %r has %d bytes, its manifest lists %d" % (name, info.file_size,
                                                                                  listed[name]["bytes"]))
                    hold = functools.partial(later.hold, info, listed[name]["sha256"]) if name in unread else None
                    arrays[name], digests[name] = _npy_member(fh, info, total, None if listed is None else beside, hold)
                for name, digest in digests.items() if listed is not None else ():
                    if digest is not None:
                        _check_member_digest(name, digest.result(), listed[name]["sha256"])
    return manifest, arrays


def _checkpoint_manifest(data):
    """The manifest of a checkpoint from its member's bytes ``data``: format 4's checked JSON
    (:func:`_parse_json_checked`: its digest verified), or format 3's plain JSON; else
    :class:`_Unreadable` (another format is named: "has format 5, but ...")."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Unreadable("cannot be read (its manifest is not UTF-8 JSON: %s: %s)"
                          % (type(exc).__name__, str(exc)[:200])) from None
    if not isinstance(record, dict):
        raise _Unreadable("cannot be read (its manifest holds a JSON %s, not an object)" % type(record).__name__)
    if _JSON_CHECKSUM in record or record.get("format") in (_CHECKPOINT_FORMAT, _CHECKPOINT_DELTA_FORMAT):
        try:
            record = _parse_json_checked(data, "its manifest")
        except ValueError as exc:
            raise _Unreadable("cannot be read (%s)" % str(exc).rstrip(".")) from None
    elif record.get("format") == 3:
        return record                     # format 3: no digest of its own; the zip's CRC-32 checked it
    if record.get("format") not in (_CHECKPOINT_FORMAT, _CHECKPOINT_DELTA_FORMAT):
        raise _Unreadable("has format %r, but this recboost reads format %d, its deltas' %d (and format 3 as "
                          "recboost 0.2.0 wrote it)" % (record.get("format"), _CHECKPOINT_FORMAT,
                                                        _CHECKPOINT_DELTA_FORMAT))
    return record


def _checkpoint_file_manifest(path):
    """The manifest of the checkpoint file ``path`` (a dict), its own checksum verified
    (:func:`_read_checkpoint_file` with ``manifest_only``: the arrays are not read). Any problem is
    one ValueError naming the file and what failed."""
    try:
        return _read_checkpoint_file(path, manifest_only=True)[0]
    except _Unreadable as exc:
        raise ValueError("The checkpoint %r %s." % (path, exc)) from None


def _checkpoint_link(path):
    """``(run id, predecessor)`` of a checkpoint from its manifest: the run id stored there, and for a
    delta the file name of the checkpoint it builds on (None for a full one); ``(None, None)`` for
    unreadable files."""
    try:
        manifest = _checkpoint_file_manifest(path)
    except ValueError:
        return None, None
    run, link = manifest.get("run"), manifest.get("delta")
    return (run if isinstance(run, str) else None,
            link.get("file") if isinstance(link, dict) and isinstance(link.get("file"), str) else None)


def _write_checkpoint_file(fh, manifest, arrays):
    """Write a checkpoint (format 4) into the open binary file ``fh``: each of ``arrays`` (member name
    -> array) as a stored ``.npy`` member, digested as it is written, then the member ``manifest``:
    the record ``manifest`` (its ``format`` set by the caller) with ``members`` (per member its
    ``bytes`` and ``sha256``), as checked JSON (:func:`_json_checked_bytes`). Returns the manifest's
    own sha256 (:func:`_checkpoint_content_id`: it covers every member's digest)."""
    members = {}
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                if isinstance(value, _NpyChunks):   # where its data goes (stored: right after the header)
                    value.written = (fh, fh.tell() + len(_npy_header_bytes(value)))
                out = _HashingWriter(member)        # sha256 on a thread beside zipfile's CRC-32 and write
                try:
                    _write_npy(out, value)
                finally:
                    out.sha.close()
            members[name] = {"bytes": out.size, "sha256": out.sha.hexdigest()}
        content = _json_checked_bytes(dict(manifest, members=members))
        with zf.open(_CHECKPOINT_MANIFEST + ".npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.frombuffer(content, np.uint8), allow_pickle=False)
    return json.loads(content)[_JSON_CHECKSUM]


class _NpyChunks:
    """An array :func:`_write_npy` writes piece by piece, never whole in memory: its ``shape``,
    ``dtype`` and ``nbytes``, and ``pieces()``, an iterator of arrays whose rows, in order, are the
    array's (C order)."""

    __slots__ = ("shape", "dtype", "pieces", "written")

    def __init__(self, shape, dtype, pieces):
        self.shape, self.dtype, self.pieces = tuple(int(d) for d in shape), np.dtype(dtype), pieces
        self.written = None     # once written into a checkpoint: (its file, where its data starts)

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


def _npy_header_bytes(array):
    """The header numpy writes before the data of ``array`` (an array, or an ``_NpyChunks``: C order)
    in a ``.npy`` file: version 1.0 unless it needs 2.0 (a header over 64 KB)."""
    fields = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": array.shape} \
        if isinstance(array, _NpyChunks) else np.lib.format.header_data_from_array_1_0(array)
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, fields)
    except ValueError:
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, fields)
    return out.getvalue()


def _write_npy(out, array):
    """Write ``array`` into the binary file ``out`` as ``np.lib.format.write_array(out, array,
    allow_pickle=False)`` does, byte for byte (the same header, version 1.0 unless it needs 2.0; C
    order, or a Fortran-ordered array's transpose), but from the array's own memory: numpy copies the
    data to bytes 16 MB at a time (``tobytes``: a fresh buffer and its page faults for every piece)
    when ``out`` is not a real file. A contiguous array is written as one view (``out`` splits it);
    any other, ``_IO_CHUNK`` of rows copied at a time; an ``_NpyChunks``, piece by piece (a
    RuntimeError if its pieces do not hold its bytes)."""
    chunks = isinstance(array, _NpyChunks)
    array = array if chunks else np.asarray(array)
    if not chunks and array.dtype.hasobject:   # refused by numpy (allow_pickle=False) with its ValueError
        np.lib.format.write_array(out, array, allow_pickle=False)
        return
    out.write(_npy_header_bytes(array))
    if chunks:
        written = 0
        for piece in array.pieces():
            piece = np.ascontiguousarray(piece, array.dtype)
            if piece.nbytes:
                out.write(piece.reshape(-1).view(np.uint8))
                written += piece.nbytes
        if written != array.nbytes:
            raise RuntimeError("recboost: an array of shape %s of %s (%d bytes) got %d bytes of data from its "
                               "pieces" % (array.shape, array.dtype, array.nbytes, written))
        return
    data = array.T if array.flags.fnc else array       # Fortran order (not C), as the header says
    if data.flags.c_contiguous:
        out.write(data.reshape(-1).view(np.uint8))
        return
    rows = max(1, _IO_CHUNK // max(1, data[0].nbytes))
    for start in range(0, len(data), rows):
        out.write(np.ascontiguousarray(data[start:start + rows]).reshape(-1).view(np.uint8))


def _checkpoint_content_id(manifest):
    """The content id of a checkpoint of format 4 or 5 from its read manifest: the sha256 of the
    manifest's canonical form (the digest it carries), which lists every member's sha256."""
    return hashlib.sha256(_json_canonical(manifest)).hexdigest()


_ENTRY_CHUNK = 1 << 16      # cache entries a checkpoint or an export looks up at a time (1.4 MB of fields)
_KEYS_HELD = 1 << 24        # a cache's ids a checkpoint sorts at once (128 MB; it writes them a range at a time)
_KEYS_SAMPLE = 1 << 16      # ids sampled to split a cache's ids into ranges of about equal size


def _entry_field_chunks(cache, key_chunks, field):
    """``field`` 1, 2 or 3 of :meth:`HashCache.entries` (rows, counts or last-seen times) of the ids
    ``key_chunks`` (arrays of ids the HashCache ``cache`` tracks, increasing from one to the next), an array
    per chunk (a tuple of such fields: a tuple of arrays per chunk). The lookups run on two helper threads,
    two chunks ahead of the one given: each is a random read of the map that waits on memory, so two at a
    time take about half as long (the kernel releases the GIL; the cache does not change between steps). A
    RuntimeError if an id is no longer tracked (the cache changed while its state was read) or the ids do
    not increase (they were read back damaged: :func:`_written_pieces`)."""
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    ahead, last = collections.deque(), None
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="recboost-entries") as pool:
        try:
            for keys in itertools.chain(key_chunks, [None]):
                if keys is not None:
                    if keys.size and ((last is not None and keys[0] <= last) or not np.all(keys[1:] > keys[:-1])):
                        raise RuntimeError("recboost: a hash table's ids, read back to look up their entries, are "
                                           "not increasing: the checkpoint or bundle being written is damaged")
                    last = keys[-1] if keys.size else last
                    ahead.append(_submitted(pool, cache.entries, keys))
                while ahead and (len(ahead) > 2 or keys is None):
                    got = ahead.popleft().result()
                    if not got[0].all():
                        raise RuntimeError("recboost: an id whose entry a checkpoint or an export looks up is not "
                                           "tracked: the hash table's cache changed while its state was read "
                                           "(between steps only), or the ids read back from the file being written "
                                           "are damaged")
                    yield got[field] if isinstance(field, int) else tuple(got[f] for f in field)
        finally:
            for future in ahead:
                future.cancel()


def _sorted_key_ranges(cache, size):
    """The ids of the ``size`` entries of the HashCache ``cache``, sorted, as arrays of about
    ``_KEYS_HELD`` ids or fewer: the ids split into ranges at the quantiles of a sample of them
    (``sample_keys``), each range's ids taken by one pass over the map (``keys_between``) and sorted.
    Up to ``_KEYS_HELD`` ids, one range: a pass and a sort, as ``keys()``. Above, a pass a range (at
    2^27 rows, 8 passes over a 5 GB map) instead of all the ids held at once (8 bytes an entry)."""
    parts = max(1, -(-size // _KEYS_HELD))
    sample = np.sort(cache.sample_keys(_KEYS_SAMPLE)) if parts > 1 else np.empty(0, np.int64)
    cuts = [int(c) for c in np.unique(sample[np.arange(1, parts) * sample.size // parts]) if c > -2 ** 63]
    lows, highs = [-2 ** 63] + cuts, [c - 1 for c in cuts] + [2 ** 63 - 1]
    for low, high in zip(lows, highs):
        if sample.size:             # the range's share of the sample, and a margin
            share = (np.searchsorted(sample, high, "right") - np.searchsorted(sample, low)) / sample.size
            expect = min(size, int(size * share * 1.25) + _ENTRY_CHUNK)
        else:
            expect = size
        keys = np.empty(expect, np.int64)
        n = cache.keys_between(low, high, keys)
        if n > keys.size:           # more than the sample said: again, with room for them all
            keys = None             # (freed before the larger one is made)
            keys = np.empty(n, np.int64)
            if cache.keys_between(low, high, keys) != n:
                raise RuntimeError("recboost: a hash table's cache changed while its state was read (between "
                                   "steps only)")
        # written _IO_CHUNK at a time, the last piece a copy: when the next range is taken, the writer
        # (and its sha256 thread) holds that copy, not this range's array
        step = _IO_CHUNK // 8
        last = max(0, n - 1) // step * step         # where the last piece starts
        for start in range(0, last, step):
            yield keys[start:start + step]
        tail, keys = keys[last:n].copy(), None
        yield tail


def _written_pieces(array):
    """The data of the ``_NpyChunks`` ``array`` read back from the checkpoint's file it was just
    written into (``array.written``: the file, and where its data starts, set by
    :func:`_write_checkpoint_file`), ``_ENTRY_CHUNK`` items at a time (:func:`_pieces_read_back` on the
    file's descriptor: :func:`_atomic_write`'s temporary file is open for reading and writing; the
    bytes come from the page cache). A RuntimeError if it is not written yet or reads short."""
    if array.written is None:
        raise RuntimeError("recboost: an array read back from a checkpoint before it was written into it")
    fh, offset = array.written
    fh.flush()
    return _pieces_read_back(fh.fileno(), offset, array, _ENTRY_CHUNK)


def _pieces_read_back(fd, offset, array, count):
    """The data of ``array`` (its shape and dtype: an ``_NpyChunks``) as written at ``offset`` of the
    file open as ``fd``, read back ``count`` items at a time (``os.pread``: the file's position is
    left alone). A RuntimeError names a short read."""
    step = count * array.dtype.itemsize
    for start in range(0, array.nbytes, step):
        want = min(step, array.nbytes - start)
        data = os.pread(fd, want, offset + start)
        if len(data) != want:
            raise RuntimeError("recboost: %d bytes read back at offset %d of a file being written, expected %d"
                               % (len(data), offset + start, want))
        yield np.frombuffer(data, array.dtype)


def _cache_entry_count(cache):
    """The entries of the HashCache ``cache``: ids with a row and candidates (ids counted, without one)."""
    stats = cache.stats()
    return stats["size"] + stats["candidates"]


def _cache_entries_chunked(cache, folder):
    """The four entry arrays of ``cache.state_dict()`` (``keys``, ``rows``, ``counts``, ``last_seen``)
    for a checkpoint written in ``folder``, each an ``_NpyChunks``: the ids sorted a range at a time as
    they are written (:func:`_sorted_key_ranges`), the other three looked up once, a chunk at a time,
    from the ids read back from the file (:class:`_EntriesLookedUpOnce`). A save holds one range of
    ids at a time (and 4 MB of the one before), never the state's 28 bytes an entry, nor its ids' 8."""
    size = _cache_entry_count(cache)
    keys = _NpyChunks((size,), np.int64, lambda: _sorted_key_ranges(cache, size))
    fields = _EntriesLookedUpOnce(cache, keys, folder)

    def field(k):
        return _NpyChunks((size,), _EntriesLookedUpOnce.DTYPES[k], lambda: fields.pieces(k))
    return {"keys": keys, "rows": field(1), "counts": field(2), "last_seen": field(3)}


class _EntriesLookedUpOnce:
    """The rows, counts and last-seen times (fields 1, 2, 3 of :meth:`HashCache.entries`) of the ids of
    a checkpoint's ``keys`` (an ``_NpyChunks`` written before them), for three members written one
    after the other. The first of them asked for (:meth:`pieces`) looks each id up once
    (:func:`_entry_field_chunks`, from the ids read back from the file: :func:`_written_pieces`) and
    meanwhile writes the other two fields to unnamed temporary files in ``folder`` (the checkpoint's:
    its disk, not memory; 12 or 16 bytes an entry while the save runs), each with its CRC-32; they
    are read back from there, checked, when their members are written. Each lookup is a random read
    of the map; the files are read in order: one lookup pass instead of three. A field read back
    damaged, or asked for twice, is a RuntimeError (the save then leaves no file)."""

    DTYPES = {1: np.dtype(np.int32), 2: np.dtype(np.int64), 3: np.dtype(np.int64)}

    def __init__(self, cache, keys, folder):
        self.cache, self.keys, self.folder, self.kept = cache, keys, folder, None

    def pieces(self, field):
        """An iterator of the arrays of ``field``, in order, ``_ENTRY_CHUNK`` entries at most each."""
        if self.kept is None:
            self.kept = {}
            return self._looked_up(field)
        if field not in self.kept:
            raise RuntimeError("recboost: a cache's entry field %d asked for twice, or before the one looked up "
                               "first was written, in a checkpoint being written in %r" % (field, self.folder))
        return self._read_back(field, *self.kept.pop(field))

    def _looked_up(self, field):
        others, files = [f for f in (1, 2, 3) if f != field], {}
        try:
            for f in others:
                files[f] = tempfile.TemporaryFile(dir=self.folder, prefix=".tmp-%d-entries-" % os.getpid())
            crcs = dict.fromkeys(others, 0)
            for got in _entry_field_chunks(self.cache, _written_pieces(self.keys), (field, *others)):
                for f, values in zip(others, got[1:]):
                    files[f].write(values)
                    crcs[f] = zlib.crc32(values, crcs[f])
                yield got[0]
            self.kept = {f: (files.pop(f), crcs[f]) for f in others}
        finally:
            for fh in files.values():
                fh.close()

    def _read_back(self, field, fh, crc):
        dtype, got = self.DTYPES[field], 0
        with fh:
            fh.seek(0)
            while True:
                data = fh.read(_ENTRY_CHUNK * dtype.itemsize)
                if not data:
                    break
                got = zlib.crc32(data, got)
                if len(data) % dtype.itemsize:
                    break
                yield np.frombuffer(data, dtype)
        if got != crc:
            raise RuntimeError("recboost: a cache's entry field a checkpoint kept in a temporary file in %r read "
                               "back damaged (CRC-32 %08x, written %08x): no checkpoint written" % (self.folder, got,
                                                                                                    crc))


def _checkpoint_bytes(arrays):
    """The bytes of data of ``arrays`` (a checkpoint's file is a little larger: headers, manifest)."""
    return sum(a.nbytes if isinstance(a, _NpyChunks) else np.asarray(a).nbytes for a in arrays.values())


# ---- incremental checkpoints: deltas and their chains -------------------------------------------
# A delta (format 5) is a checkpoint file whose manifest is the full checkpoint's (format 4's fields,
# the same array names) plus "delta": its predecessor (the checkpoint it builds on, base or delta: its
# file name in the same directory, content id, run and step) and, for every array the checkpoint
# names, its patch against the predecessor's array of that name:
#   whole     the array itself, a member of the same name (the dense part, scalars, the admission
#             sketch, the free rows, the replayed batches: small or fixed-size);
#   rows      a table's rows or slots (the store's changed rows, _RowStore.track_changes: a bool per
#             row, scanned once by flatnonzero) or its live flags (a row's flag changes only with its
#             id, so only the rows of the cache's changed entries, then and now, are compared with a
#             copy kept from the predecessor): "rows" (int64 row positions, increasing) and "values",
#             and "shape" (grown rows are all listed);
#   entries   a cache state's entries (keys, rows, counts, last_seen: sorted by id), from the cache's
#             change record (HashCache.record_changes: the ids looked up, evicted or replaced since the
#             predecessor, as they were then, against HashCache.entries now): "values" of the entries
#             new or changed, "keys" names the group's key array, whose patch also lists the ids
#             "removed". A delta's write passes over no whole table but the changed-row bitmaps.
# Reading a delta (_read_checkpoint_chain) reads its chain back to its base, every file read once
# and verified, each link checked (present, the content id, the run, the step), then applies the
# patches in order, in place where the shapes allow (the entries of new or removed ids merged, not
# sorted again): the result is the (manifest, arrays) of the full checkpoint of that step, read by
# the ordinary path.
_DELTA_ENTRY_FIELDS = ("keys", "rows", "counts", "last_seen")     # a HashCache state's entries, by id
_DELTA_TRACKED = re.compile(r"tables\.(\d+)\.(?:table|slots\..+)")
_DELTA_COMPARED = re.compile(r"tables\.\d+\.live")
_DELTA_ENTRIES = re.compile(r"(tables\.\d+\.cache\.)(%s)" % "|".join(_DELTA_ENTRY_FIELDS))
_DELTA_KINDS = ("whole", "rows", "entries")
_DELTA_LINK = _Fields({
    "file": _FILE_NAME, "sha256": _SHA256_HEX, "run": _TEXT.or_none(), "step": _COUNT,
    "patches": _Map(_Fields({"kind": _Rule("one of %s" % list(_DELTA_KINDS), str, test=lambda v: v in _DELTA_KINDS),
                             "shape": _List(_COUNT).optional(None), "rows": _TEXT.optional(None),
                             "values": _TEXT.optional(None), "keys": _TEXT.optional(None),
                             "removed": _TEXT.optional(None)}))})


def _sorted_at(values, among):
    """``(at, hit)``: where each of ``values`` is or would go in ``among`` (both 1-d, ``among`` sorted
    increasing), and whether it is there."""
    at = np.searchsorted(among, values)
    hit = at < among.size
    hit[hit] = among[at[hit]] == values[hit]
    return at, hit


def _sorted_in(values, among):
    """Which of ``values`` are in ``among`` (both 1-d, ``among`` sorted increasing)."""
    return _sorted_at(values, among)[1]


def _increasing(ids):
    """Whether the 1-d ``ids`` are strictly increasing (sorted and distinct)."""
    return not np.any(ids[1:] <= ids[:-1])


class _CheckpointChain:
    """The last checkpoint of a chain a model wrote (``RecModel.save_checkpoint(chain=...)``), what the
    next delta is built against: its file, content id, run and step, each array's shape and dtype, a
    copy of the live flags, the row stores whose changed rows it records from then on
    (:meth:`_RowStore.track_changes`) and the caches whose changed entries it records
    (``HashCache.record_changes``), both started here. ``previous``: ``(chain, members)`` when this
    checkpoint is a delta of ``chain`` with ``members``: its copies of the live flags are taken over
    and patched in place (no whole copy)."""

    def __init__(self, path, digest, head, arrays, stores, caches, previous=None):
        self.path, self.digest, self.run, self.step = os.path.abspath(path), digest, head["run"], head["step"]
        self.files = (previous[0].files if previous is not None else ()) + (self.path,)    # the chain's, base first
        self.shapes = {name: (a.shape, a.dtype) for name, a in arrays.items()}
        self.kept = {}
        for name, value in arrays.items():
            if _DELTA_COMPARED.fullmatch(name):
                self.kept[name] = np.array(value) if previous is None else \
                    _CheckpointChain._patched(previous[0].kept[name], name, value, previous[1])
        self.stores, self.caches, self.changes, self.written = list(stores), list(caches), None, {}
        for store in self.stores:
            store.track_changes()
        for cache in self.caches:
            cache.record_changes()

    @staticmethod
    def _patched(kept, name, value, members):
        """The copy ``kept`` of the array ``name`` brought to ``value`` by the delta's ``members``."""
        if name in members:                     # a whole patch: the array itself
            return np.array(value)
        rows = members["delta.rows." + name]
        if kept.shape != value.shape:           # (grown: the new rows are all in the patch)
            kept = np.concatenate([kept, np.empty((value.shape[0] - kept.shape[0],) + kept.shape[1:], kept.dtype)])
        kept[rows] = members["delta.values." + name]
        return kept

    def check(self, path, stores, caches):
        """Raise a ValueError when no delta at ``path`` can be built on this checkpoint (another folder,
        the file gone, tables loaded or replaced since); else keep each cache's record
        (``HashCache.changes``) for :meth:`delta`."""
        where = "RecModel.save_checkpoint"
        if os.path.dirname(os.path.abspath(path)) != os.path.dirname(self.path):
            _fail(where, "'path' of a delta (chain='delta')", "in the folder of its predecessor %r" % self.path, path)
        if any(os.path.abspath(path) == file or os.path.exists(path) and os.path.exists(file)
               and os.path.samefile(path, file) for file in self.files):
            _fail(where, "'path' of a delta (chain='delta')", "another file than those of its chain %s (it would "
                  "overwrite a checkpoint it needs)" % [os.path.basename(file) for file in self.files], path)
        if not os.path.isfile(self.path):
            _fail(where, "'chain'", "'base' (a full checkpoint): the last checkpoint of the chain, %r, is gone"
                  % self.path, "delta")
        changes = [cache.changes() for cache in caches]
        if len(stores) != len(self.stores) or any(a is not b or a.changed is None for a, b in zip(stores, self.stores)) \
                or len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches)) \
                or any(c is None for c in changes):
            _fail(where, "'chain'", "'base' (a full checkpoint): the hash tables were loaded or replaced since the "
                  "last checkpoint of the chain %r" % self.path, "delta")
        self.changes = changes

    def delta(self, manifest, arrays):
        """``(manifest, members)`` of the delta of the checkpoint ``manifest`` and ``arrays`` (its
        caches' entry arrays empty: ``HashEmbedding.state_dict(entries=False)``) against this
        one, after :meth:`check`."""
        members, patches, self.written = {}, {}, {}
        entries = [self._entries_changed(k) for k in range(len(self.caches))]
        for name, value in arrays.items():
            patches[name] = self._patch(name, value, members, entries)
        link = {"file": os.path.basename(self.path), "sha256": self.digest, "run": self.run, "step": self.step,
                "patches": patches}
        return dict(manifest, format=_CHECKPOINT_DELTA_FORMAT, delta=link), members

    def _patch(self, name, value, members, entries):
        """The patch of the array ``name`` (its new ``value``), its members put in ``members``."""
        shape, dtype = self.shapes.get(name, (None, None))
        rows, group = None, _DELTA_ENTRIES.fullmatch(name)
        if group:                   # (the four arrays of a cache's entries)
            return self._entries_patch(group.group(1), group.group(2), members, entries)
        if shape is not None and dtype == value.dtype and value.ndim and value.shape[1:] == shape[1:] \
                and value.shape[0] >= shape[0]:
            tracked = _DELTA_TRACKED.fullmatch(name)
            if tracked:             # (the rows written: one scan per table, for its rows and slots)
                changed, key = self.stores[int(tracked.group(1))].changed, (tracked.group(1), shape[0], value.shape[0])
                if key not in self.written:
                    self.written[key] = np.flatnonzero(changed[:value.shape[0]]) if changed.size >= value.shape[0] \
                        and changed[shape[0]:value.shape[0]].all() else None
                rows = self.written[key]
            elif name in self.kept:             # the live flags: only the rows whose id changed
                maybe = entries[int(name.split(".")[1])][2]
                maybe = maybe[maybe < shape[0]]
                rows = np.concatenate([maybe[value[maybe] != self.kept[name][maybe]],
                                       np.arange(shape[0], value.shape[0])])
        if rows is None or rows.size * (8 + value[:1].nbytes) >= value.nbytes:
            return self._whole(name, value, members)
        members["delta.rows." + name] = rows.astype(np.int64)
        members["delta.values." + name] = value[rows]
        return {"kind": "rows", "shape": list(value.shape), "rows": "delta.rows." + name,
                "values": "delta.values." + name}

    @staticmethod
    def _whole(name, value, members):
        members[name] = value
        return {"kind": "whole"}

    @staticmethod
    def _entries_patch(prefix, field, members, entries):
        """The patch of a cache state's entry array ``prefix + field``: the entries new or changed since
        the predecessor (and with the keys, the ids removed)."""
        new, removed, _ = entries[int(prefix.split(".")[1])]
        members["delta.values." + prefix + field] = new[field]
        patch = {"kind": "entries", "keys": prefix + "keys", "values": "delta.values." + prefix + field}
        if field == "keys":
            members["delta.removed." + prefix + field] = removed
            patch["removed"] = "delta.removed." + prefix + field
        return patch

    def _entries_changed(self, k):
        """The entries of table ``k``'s cache new or changed since the predecessor (a dict by field of
        ``_DELTA_ENTRY_FIELDS``, sorted by id), the ids it tracked then and not now (sorted), and the
        rows those entries held, then or now (sorted, distinct: the rows whose live flag may have
        changed), from its change record (:meth:`check`): the ids looked up, evicted or replaced since,
        as they were then, against ``HashCache.entries`` now."""
        before = self.changes[k]
        tracked, rows, counts, last = self.caches[k].entries(before["keys"])
        now = {"keys": before["keys"], "rows": rows, "counts": counts, "last_seen": last}
        same = before["existed"] & tracked
        for field in _DELTA_ENTRY_FIELDS[1:]:
            same &= before[field] == now[field]
        new = tracked & ~same
        held = np.union1d(before["rows"][before["existed"] & (before["rows"] >= 0)], rows[tracked & (rows >= 0)])
        return {f: now[f][new] for f in _DELTA_ENTRY_FIELDS}, before["keys"][before["existed"] & ~tracked], \
            held.astype(np.int64)


def _read_checkpoint_chain(path, later=None):
    """The checkpoint file ``path`` read whole and verified (:func:`_read_checkpoint_file`), and for a
    delta its chain back to its base, every member read whole and verified, each link checked (the
    predecessor present in the delta's folder, of the content id, run and step the delta names), the
    patches applied in order: ``(manifest, arrays)`` of the full checkpoint of that step. Any problem
    is one :class:`_Unreadable` naming the file of the chain that failed and what. ``later``: see
    :func:`_read_checkpoint_file` (a full checkpoint's members only; a delta's chain is read whole)."""
    manifest, arrays = _read_checkpoint_file(path, later=later)
    chain, here = [], path
    while manifest.get("format") == _CHECKPOINT_DELTA_FORMAT:
        def bad(problem, at=here):
            raise _Unreadable("%s%s" % ("" if at == path else "needs the delta %r of its chain, which " % at, problem))
        link = _validate(manifest.get("delta"), _DELTA_LINK, _checkpoint_checking(bad), at="delta")
        chain.append((here, manifest, arrays, link))
        before = os.path.join(os.path.dirname(here), link["file"])
        if not os.path.isfile(before):
            bad("names its predecessor %r (field 'delta.file'), which is missing" % before)
        try:
            manifest, arrays = _read_checkpoint_file(before)
        except _Unreadable as exc:
            bad("names its predecessor %r, which %s" % (before, exc))
        if manifest.get("format") == 3 or _checkpoint_content_id(manifest) != link["sha256"] \
                or manifest.get("run") != link["run"] or chain[-1][1].get("run") != link["run"] \
                or manifest.get("step") != link["step"]:
            bad("names its predecessor %r of run %r, step %r and content id %s, but that file is of run %r, step %r "
                "and content id %s (another run's or another chain's checkpoint)" % (
                    before, link["run"], link["step"], link["sha256"], manifest.get("run"), manifest.get("step"),
                    None if manifest.get("format") == 3 else _checkpoint_content_id(manifest)))
        here = before
    for at, delta, members, link in reversed(chain):
        try:
            arrays = _patch_arrays(arrays, link["patches"], members)
        except _Unreadable as exc:
            raise _Unreadable("%s%s" % ("" if at == path else "needs the delta %r of its chain, which " % at,
                                        exc)) from None
        except Exception as exc:            # numpy's, on patches that do not fit: a damaged chain
            raise _Unreadable("%shas patches that do not fit its predecessor (%s: %s)" % (
                "" if at == path else "needs the delta %r of its chain, which " % at, type(exc).__name__,
                str(exc)[:200])) from None
        manifest = delta
    if chain:
        manifest = {key: value for key, value in manifest.items() if key != "delta"}
        manifest["format"] = _CHECKPOINT_FORMAT
    return manifest, arrays


def _patch_arrays(arrays, patches, members):
    """The arrays of a delta's checkpoint: its ``patches`` (checked ``delta.patches``) with its
    ``members`` applied to its predecessor's ``arrays`` (whose arrays it may change in place)."""
    def bad(name, problem):
        raise _Unreadable("has a patch of the array %r that does not fit its predecessor: %s" % (name, problem))

    def member(name, key, patch):
        if patch[key] not in members:
            bad(name, "its member %r is missing" % patch[key])
        return members[patch[key]]
    out, groups = {}, {}
    for name, patch in patches.items():
        if patch["kind"] == "whole":
            if name not in members:
                bad(name, "the array is missing")
            out[name] = members[name]
        elif patch["kind"] == "entries":
            groups.setdefault(patch["keys"], []).append(name)
        else:
            old, rows, values = arrays.get(name), member(name, "rows", patch), member(name, "values", patch)
            shape = tuple(patch["shape"] or ())
            if old is None or not old.ndim or len(shape) != old.ndim or shape[1:] != old.shape[1:] \
                    or shape[0] < old.shape[0] or rows.dtype != np.int64 or rows.ndim != 1 \
                    or values.dtype != old.dtype or values.shape != rows.shape + shape[1:] \
                    or (rows.size and (rows[0] < 0 or rows[-1] >= shape[0] or np.any(rows[1:] <= rows[:-1]))) \
                    or np.count_nonzero(rows >= old.shape[0]) != shape[0] - old.shape[0]:
                bad(name, "rows %s of %s %s onto %s" % (rows.shape, values.dtype, shape, None if old is None else
                                                         "%s of shape %s" % (old.dtype, old.shape)))
            new = old if shape == old.shape else _host_array(shape, old.dtype)     # (a table's: its memory)
            if new is not old:
                new[:old.shape[0]] = old
            new[rows] = values
            out[name] = new
    for keys_name, names in groups.items():
        old_keys = arrays.get(keys_name)
        key_patch = patches.get(keys_name, {})
        if old_keys is None or key_patch.get("kind") != "entries" or key_patch.get("removed") is None:
            bad(keys_name, "its entries' key array or its removed ids are missing")
        new_keys, removed = member(keys_name, "values", key_patch), member(keys_name, "removed", key_patch)
        # (the predecessor's keys are not compared whole here: the state read at the end checks them)
        if old_keys.ndim != 1 or any(a.ndim != 1 or a.dtype != old_keys.dtype or not _increasing(a)
                                     for a in (new_keys, removed)):
            bad(keys_name, "the ids it gives are not sorted and distinct")
        # the entries changed in place; with ids new or removed, the others merged with the new ones
        at_new, hit_new = _sorted_at(new_keys, old_keys)
        at_gone, hit_gone = _sorted_at(removed, old_keys)
        in_place = hit_new.all() and not hit_gone.any()
        if not in_place:
            keep = np.ones(old_keys.size, np.bool_)
            keep[at_new[hit_new]] = keep[at_gone[hit_gone]] = False
            dest = np.searchsorted(old_keys[keep], new_keys) + np.arange(new_keys.size)
            slot = np.ones(np.count_nonzero(keep) + new_keys.size, np.bool_)
            slot[dest] = False
        for name in names:
            old = arrays.get(name)
            values = member(name, "values", patches[name])
            if old is None or old.shape != old_keys.shape or values.shape != new_keys.shape \
                    or values.dtype != old.dtype:
                bad(name, "its entries do not match the keys %r" % keys_name)
            if in_place:
                old[at_new] = values
                out[name] = old
            else:
                out[name] = np.empty(slot.size, old.dtype)
                out[name][slot] = old[keep]
                out[name][dest] = values
    return out


def _checkpoint_part(path, rank, world):
    """The file of rank ``rank``'s part of the row-wise checkpoint ``path``:
    ``<stem>.part-<rank>-of-<world>.npz`` next to it (not a name :func:`latest_checkpoint` picks)."""
    stem = path[:-4] if path.endswith(".npz") else path
    return "%s.part-%d-of-%d.npz" % (stem, rank, world)


def _check_prefix(where, prefix):
    """``prefix`` of checkpoint file names: a plain file name (no folder part, not "." or "..", not
    starting with "."), so every checkpoint stays in its directory, under its lock and its ``keep``."""
    if not isinstance(prefix, str) or not prefix:
        _fail(where, "'prefix'", "a non-empty str", prefix, TypeError)
    if prefix != os.path.basename(prefix) or "/" in prefix or "\\" in prefix or "\0" in prefix \
            or prefix.startswith("."):
        _fail(where, "'prefix'", "a plain file name (no folder part, not starting with '.'): the checkpoints "
              "stay in their directory", prefix)
    return prefix


def _checkpoint_name(prefix, step):
    """The file name of the checkpoint of step ``step``: ``<prefix>-<step>.npz``."""
    return "%s-%d.npz" % (prefix, step)


def _checkpoint_step(name, prefix):
    """The step of the checkpoint file name ``name`` (as made by :func:`_checkpoint_name` with
    ``prefix``), or None when it is not one."""
    match = re.fullmatch(r"%s-(\d+)\.npz" % re.escape(prefix), name)
    return int(match.group(1)) if match else None


def latest_checkpoint(directory, prefix="recboost"):
    """The newest complete checkpoint ``<prefix>-<step>.npz`` in ``directory`` (the highest step), or
    None. Checkpoints are written atomically, so every such file is complete. ``prefix`` is the
    :class:`OnlineCheckpoint` prefix that wrote them (a plain file name). The newest may be a delta
    (``OnlineCheckpoint(full_every=...)``): loading it reads its chain back to its base."""
    _check_prefix("latest_checkpoint", prefix)
    found = []
    for name in os.listdir(directory):
        step = _checkpoint_step(name, prefix)
        if step is not None:
            found.append((step, os.path.join(directory, name)))
    return max(found)[1] if found else None


def _checkpoint_checking(bad):
    """``_validate``'s errors for a checkpoint's manifest, worded for ``bad(problem)``, which raises."""
    def fail(at, expected, got, exc):
        bad("lacks the field %r" % at if got is _ABSENT else
            "has a bad field %r: it must be %s, but got %r" % (at, expected, got))
    return _Checking.manifest(fail)


def _parts_in_rank_order(got, at, checking):
    ranks = [part["rank"] for part in got["parts"]]
    if ranks != list(range(got["world"])):
        checking.fail("parts", "one part per rank 0..%d, in rank order" % (got["world"] - 1), ranks, ValueError)
    return got


# The manifest of a row-wise checkpoint: the world that wrote it and each rank's part file.
_CHECKPOINT_PARTS = _Fields({
    "world": _Int(1),
    "parts": _List(_Fields({"rank": _COUNT, "file": _FILE_NAME, "size": _COUNT, "sha256": _TEXT})),
    "extra": _Rule("an object", dict).or_none().optional(None),
}, relate=_parts_in_rank_order)


def _checkpoint_schema(array, value, rows, row_value):
    """The schema (``_validate``) of a checkpoint's manifest (format 4 or 3, one process or one part of a
    row-wise checkpoint); ``array`` and ``value`` resolve a member's name to the array it names, or
    (``value``) to a Python scalar for a 0-d one; ``rows`` and ``row_value`` the same for a hash
    table's rows, live flags and slots (which may be left unread until the tables' caches are built:
    :class:`_UnreadMembers`). The fields a model compares with itself (the tables' settings, names
    and shapes) are checked by the model."""
    skip_reason = _Rule("one of %s" % list(_SKIP_REASONS), str, test=lambda v: v in _SKIP_REASONS)
    hook_state = _Rule("an EvictHook state", dict, test=lambda v: EvictHook().load_state_dict(v) or True)
    table = _Fields({"name": _ANY, "shard": _ANY.optional(None), "seed": _ANY, "embedding_size": _ANY,
                     "optimizer": _ANY, "settings": _ANY.optional(), "clock": _ANY.optional(),
                     "rounds": _ANY.optional(), "steps": _ANY.optional(),
                     "table": rows, "live": rows, "slots": _Map(row_value), "scalars": _Map(value),
                     "cache": _Map(value)})
    replay_table = _Fields({"capacity": _COUNT, "rows": array, "new_rows": array, "new_ids": array,
                            "offsets": array.or_none().optional(None), "scale": array.or_none().optional(None),
                            "weights": array.or_none().optional(None), "shapes": _List(_List(_COUNT)),
                            "positions": _List(_ANY)})
    skipped = _ANY.optional(None)          # the inputs and tables of a batch replayed as a skip
    return _Fields({
        "version": _TEXT, "network": _TEXT, "step": _COUNT, "taken": _COUNT, "overflow_steps": _COUNT,
        "samples": _COUNT, "run": _TEXT.or_none(), "stream_start": _Int(0, default=0),
        "skipped_batches": _Map(_COUNT, key=skip_reason, expected="an object with keys among %s"
                                % list(_SKIP_REASONS)),
        "evict_hooks": _List(hook_state), "settings": _Rule("an object", dict).optional(None),
        "extra": _Rule("an object", dict).or_none().optional(None),        # the caller's (save_checkpoint)
        "tables": _List(table), "parameters": _Map(array),
        "replay": _List(_Fields({
            "taken": _COUNT, "samples": _COUNT, "skip": skip_reason.or_none(),
            "inputs": lambda got: skipped if got["skip"] else _List(array.or_none()),
            "tables": lambda got: skipped if got["skip"] else _List(replay_table)})),
    })


@dataclasses.dataclass(frozen=True)
class _CheckpointCounters:
    """A model's training counters a checkpoint carries and gives back (``RecModel``'s attributes of the
    same names; ``batches_consumed`` is the manifest's ``taken``, ``run_id`` its ``run``), and the
    EvictHook schedules (``evict_hooks``, their ``state_dict()``s)."""
    step: int
    batches_consumed: int
    overflow_steps: int
    skipped_batches: dict
    samples: int
    run_id: object
    stream_start: int
    evict_hooks: list

    def manifest_fields(self, network, settings):
        """The manifest's fields of a checkpoint written with these counters by a model whose network's
        class is named ``network`` and whose :meth:`RecModel.settings` are ``settings``, in the
        manifest's order."""
        return {"network": network, "run": self.run_id, "step": self.step, "taken": self.batches_consumed,
                "overflow_steps": self.overflow_steps, "skipped_batches": self.skipped_batches,
                "stream_start": self.stream_start, "samples": self.samples, "settings": settings,
                "evict_hooks": self.evict_hooks}

    @classmethod
    def of_manifest(cls, got):
        """The counters of a checked manifest ``got`` (a skip reason it lacks counts 0)."""
        return cls(step=got["step"], batches_consumed=got["taken"], overflow_steps=got["overflow_steps"],
                   skipped_batches=dict(dict.fromkeys(_SKIP_REASONS, 0), **got["skipped_batches"]),
                   samples=got["samples"], run_id=got["run"], stream_start=got["stream_start"],
                   evict_hooks=got["evict_hooks"])


class _CheckpointRead(collections.namedtuple(
        "_CheckpointRead", "path bad parameters settings exchange strict shard")):
    """One :meth:`_CheckpointStore.read` of the checkpoint file ``path`` against a model: ``bad(problem)``
    raises the ValueError naming the file; the model's dense ``parameters()`` (a function), its
    ``settings``, its rank ``exchange`` (or None), ``strict`` and ``shard`` (``(rank, world)`` when
    reading one part of a row-wise checkpoint, else None): see :meth:`_CheckpointStore.read`."""


class _CheckpointStore:
    """The checkpoint files of a model's training state (:meth:`RecModel.save_checkpoint` and
    :meth:`RecModel.load_checkpoint`): :meth:`write` one file, or one part per rank and a manifest
    naming them; :meth:`read` one back, checked whole (``_checkpoint_schema``) against the model,
    each hash table's state laid out for the model's sharding (split or merged by owner)."""

    def __init__(self, tables, positions):
        self.tables, self.positions = tables, positions       # the model's hash tables; their batch items
        self.chain = None           # the last checkpoint of a chain written (_CheckpointChain): a delta's predecessor
        self.written = None         # the file this process wrote last (its part of a row-wise one): the next
        #                             write takes its cached pages (_atomic_write's recycle)

    def write(self, path, head, parameters, pending, shard, exchange, extra=None, chain=None):
        """Write a checkpoint to ``path`` atomically (the format: :meth:`RecModel.save_checkpoint`):
        the manifest's fields ``head`` (counters, settings, run, EvictHook schedules), the dense
        ``parameters``, every table's state and the ``pending`` prepared batches (replayed on
        resume). ``shard``: ``(rank, world)`` when this rank writes its part of a row-wise
        checkpoint through ``exchange``, else None. ``extra(head)``: the caller's JSON object the
        manifest carries as its field ``extra`` (None: no field). ``chain``: None, "base" or
        "delta" (``RecModel.save_checkpoint``)."""
        where = "RecModel.save_checkpoint"
        _check_one_of(where, "chain", chain, (None, "base", "delta"))
        if chain is not None and shard is not None:
            _fail(where, "'chain'", "None when a hash table is row-wise (its checkpoints are written in parts; "
                  "incremental checkpoints are not)", chain)
        if chain == "delta" and self.chain is None:
            _fail(where, "'chain'", "'base' first: a delta builds on the last checkpoint this model saved with "
                  "chain='base' or 'delta', and it has none (none saved, or a checkpoint loaded since)", chain)
        record = None if extra is None else extra(dict(head))
        if record is not None:
            if not isinstance(record, dict):
                _fail("RecModel.save_checkpoint", "the value of 'extra'", "a dict (a JSON object) or None", record,
                      TypeError)
            head = dict(head, extra=record)
        arrays = {}

        def put(name, value):
            arrays[name] = value if isinstance(value, _NpyChunks) else np.asarray(value)
            return name

        parameters = {p.name: put("parameters.%d" % k, p.asnumpy()) for k, p in enumerate(parameters)}
        stores, caches = [table.store for table in self.tables], [table.cache for table in self.tables]
        if chain == "delta":
            self.chain.check(path, stores, caches)
        tables = []
        for i, table in enumerate(self.tables):
            # written as they are, between steps: no copy; a full checkpoint's cache entries looked up a
            # chunk at a time as they are written, a delta's from the change record
            state = table.state_dict(copy=False, entries=False)
            if chain != "delta":
                state["cache"].update(_cache_entries_chunked(table.cache, os.path.dirname(os.path.abspath(path))))
            entry = {"name": table.table_name, "seed": state["seed"], "embedding_size": state["embedding_size"],
                     "optimizer": state["optimizer"], "settings": state["settings"], "clock": state["clock"],
                     "rounds": state["rounds"],
                     "table": put("tables.%d.table" % i, state["table"]),
                     "live": put("tables.%d.live" % i, state["live"]),
                     "shard": None if table.layout.shard is None else list(table.layout.shard)}
            entry["steps"] = state["steps"]         # (earlier files hold it for a schedule only: a constant rate loads 0)
            for group in ("slots", "scalars", "cache"):
                entry[group] = {key: put("tables.%d.%s.%s" % (i, group, key), value)
                                for key, value in state[group].items()}
            tables.append(entry)
        replay = []
        for k, feed in enumerate(pending):
            replay.append({"taken": feed.taken, "samples": feed.samples, "skip": feed.skip,
                           "inputs": [None if a is None else put("replay.%d.inputs.%d" % (k, j), a)
                                      for j, a in enumerate(feed.inputs or ())],
                           "tables": [self._replay_entry(put, "replay.%d.tables.%d." % (k, i), b)
                                      for i, b in enumerate(feed.tables or ())]})
        manifest = dict({"format": _CHECKPOINT_FORMAT, "version": __version__}, **head, parameters=parameters,
                        tables=tables, replay=replay)
        if shard is not None:
            manifest["part"] = {"rank": shard[0], "world": shard[1]}
        whole, digest = arrays, []
        if chain == "delta":
            manifest, arrays = self.chain.delta(manifest, arrays)

        def write(fh):
            digest.append(_write_checkpoint_file(fh, manifest, arrays))
        if shard is None:
            _atomic_write(path, write, size=_checkpoint_bytes(arrays), recycle=self.written)
            self.written = path
        else:
            self.written = self._write_parts(path, write, _checkpoint_bytes(arrays), head, exchange, self.written)
        if chain is not None:                  # written: the next delta builds on it
            self.chain = _CheckpointChain(path, digest[-1], head, whole, stores, caches,
                                          (self.chain, arrays) if chain == "delta" else None)

    @staticmethod
    def _write_parts(path, write, content, head, ex, recycle):
        """A row-wise checkpoint: every rank writes its part (``<stem>.part-<r>-of-<n>.npz``, atomically:
        ``write(fh)``, ``content`` bytes of arrays, taking the cached pages of the file ``recycle``)
        next to ``path``; then the ranks exchange each part's size and sha256 (the AllGather returns
        only once every part is complete), and rank 0 writes ``path`` (atomically): a manifest naming
        the parts, their sizes and digests. ``path`` exists only when every part it names does. Every
        rank must call it with the same ``path`` (a folder every rank can reach); ``ex`` is the rank
        exchange. Returns the part's path."""
        part = _checkpoint_part(path, ex.rank, ex.size)
        size = digest = failure = None
        try:
            _atomic_write(part, write, size=content, recycle=recycle)
            size, digest = _file_digest(part)
        except OSError as exc:                 # raised below, after the other ranks heard of it
            failure = exc
        sizes, digests, same_path = ex.share_part_record(path, size, digest)
        if failure is not None:
            raise failure
        if (sizes < 0).any():                  # an OSError on every rank: OnlineCheckpoint retries later
            raise OSError("rank %d could not write its part of the checkpoint %r (its log says why)"
                          % (int(np.flatnonzero(sizes < 0)[0]), path))
        if not same_path:
            _fail("RecModel.save_checkpoint", "'path'", "the same path on every rank (rank 0 writes the "
                  "manifest there, naming every rank's part next to it)", "%r on rank %d and others elsewhere"
                  % (path, ex.rank))
        if ex.rank == 0:
            parts = [{"rank": r, "file": os.path.basename(_checkpoint_part(path, r, ex.size)), "size": int(sizes[r]),
                      "sha256": digests[r]} for r in range(ex.size)]
            manifest = {"format": _CHECKPOINT_FORMAT, "version": __version__, "run": head["run"], "step": head["step"],
                        "world": ex.size, "parts": parts}
            if head.get("extra") is not None:
                manifest["extra"] = head["extra"]
            _atomic_write(path, functools.partial(_write_checkpoint_file, manifest=manifest, arrays={}))
        return part

    @staticmethod
    def _replay_entry(put, prefix, batch):
        """The manifest entry of one table's share of a prepared batch (``put`` stores an array)."""
        entry = {"capacity": int(batch.capacity), "shapes": [list(shape) for shape in batch.shapes],
                 "positions": list(batch.positions)}
        for key in ("rows", "new_rows", "new_ids", "offsets", "scale", "weights"):
            value = getattr(batch, key)
            entry[key] = None if value is None else put(prefix + key, value)
        return entry

    @staticmethod
    def _replay_batch(table, positions, info):
        """The ``_TableBatch`` of ``table`` (read at ``positions``) from its checked replay entry ``info``
        (:meth:`_replay_entry`), or None when its arrays do not fit together."""
        capacity, rows, offsets, scale = info["capacity"], info["rows"], info["offsets"], info["scale"]
        new_rows, new_ids, weights = info["new_rows"], info["new_ids"], info["weights"]
        shapes = [tuple(shape) for shape in info["shapes"]]
        if rows.dtype != np.int32 or rows.size and (rows.min() < 0 or rows.max() >= capacity) \
                or new_rows.dtype != np.int32 or new_ids.dtype != np.int64 or new_rows.shape != new_ids.shape \
                or tuple(info["positions"]) != positions or (offsets is None) != (scale is None):
            return None
        rows = rows.reshape(-1)
        outputs = rows.size if offsets is None else offsets.size - 1
        if sum(int(np.prod(shape)) for shape in shapes) != outputs or (offsets is not None and (
                offsets.dtype != np.int64 or scale.dtype != np.float32 or scale.shape != (outputs,)
                or offsets[0] != 0 or offsets[-1] != rows.size or np.any(np.diff(offsets) < 0))) or (
                weights is not None and (offsets is None or weights.dtype != np.float32
                                         or weights.shape != rows.shape or not np.isfinite(weights).all())):
            return None
        uniq, inverse = unique_inverse(rows, np.full(capacity, -1, np.int32))
        bags = None if offsets is None else _Bags(offsets, scale, weights, table.combiner == "max")
        return _TableBatch(_Mapping(rows, uniq, inverse, new_rows, new_ids, None), capacity, bags, shapes,
                           positions)

    def read(self, path, parameters, settings, exchange, strict=True, prefix="recboost", shard=None):
        """Read and check the checkpoint at ``path`` (a file, or a directory: its latest checkpoint
        with ``prefix``) against a model with the dense parameters ``parameters()`` (called once the
        file's settings have been compared: it may build the train cell), the ``settings`` and the
        tables of this store (``strict``: see :meth:`RecModel.load_checkpoint`), changing nothing:
        a dict of the new values for ``load_checkpoint``, each hash table's state already laid out
        for its sharding. ``exchange``: the model's rank exchange (None in one process).
        ``shard``: ``(rank, world)`` when reading one part of a row-wise checkpoint (:meth:`_read_parts`).

        A model whose hash tables are empty and whole here (a job restarting) gets them in new
        objects, built in this order: each table's cache from the file, then its rows, slots and live
        flags (:class:`_UnreadMembers`: read and verified only then), so a cache's state (28 bytes an
        entry) is never held beside the rows; ``"caches"`` in the dict, None for a table whose cache
        ``load_checkpoint`` loads from its state in place (the other models: their own cache is the
        memory to reuse)."""
        where = "RecModel.load_checkpoint"
        if os.path.isdir(path):
            found = latest_checkpoint(path, prefix)
            if found is None:
                others = sorted({m.group(1) for m in map(re.compile(r"(.+)-\d+\.npz").fullmatch, os.listdir(path))
                                 if m})
                _fail(where, "'path'", "a checkpoint file or a directory holding one named %s-<step>.npz "
                      "(prefix=%r)%s" % (prefix, prefix, "; it holds checkpoints with the prefix %s" %
                                         ", ".join(map(repr, others)) if others else ""), path)
            path = found

        def bad(problem):
            raise ValueError("For '%s', the checkpoint %r %s." % (where, path, problem.rstrip(".")))

        later = _UnreadMembers(path) if shard is None and all(
            table.layout.shard is None and not len(table.cache) for table in self.tables) else None
        try:
            manifest, arrays = _read_checkpoint_chain(path, later)     # every byte checked; format 4, 3, or a chain
        except _Unreadable as exc:
            bad(str(exc))
        if "parts" in manifest and shard is None:
            return self._read_parts(_CheckpointRead(path, bad, parameters, settings, exchange, strict, None),
                                    manifest)
        request = _CheckpointRead(path, bad, parameters, settings, exchange, strict, shard)
        new = self._checked(request, manifest, arrays, later)
        del manifest, arrays        # (a cache's state: held from here by new["tables"] alone)
        if shard is None:
            new["caches"] = [None] * len(self.tables) if later is None else self._caches_first(new["tables"], later, bad)
            new["tables"] = [table.restore_states([state]) for table, state in zip(self.tables, new["tables"])]
        return new

    def swap_in(self, loaded):
        """The tables' part of ``RecModel.load_checkpoint``'s swap: each takes its state :meth:`read`
        gave (its arrays as they are), with the cache built there, or reloading its own in place."""
        for table, state, cache in zip(self.tables, loaded["tables"], loaded["caches"]):
            if cache is None:
                table.load_state_dict(state, copy=False)
            else:
                table.cache = cache
                table.store.load_state_dict(state, copy=False)

    def _caches_first(self, states, later, bad):
        """New caches built from the checked table ``states`` (whole here, one per table), in order: each
        cache's state is dropped once its cache holds it (``states`` changed in place), then the
        rows, slots and live flags ``later`` left unread are read into ``states``."""
        caches = []
        for k, table in enumerate(self.tables):
            caches.append(table.config.new_cache(table.cache.capacity, table.cache.grow))
            caches[-1].load_state_dict(states[k]["cache"])
            states[k] = dict(states[k], cache=None)
        try:
            with _DigestsBeside() as beside:        # (each member's sha256 while the next is read)
                later.beside = beside
                for state in states:
                    state["table"], state["live"] = later.read(state["table"]), later.read(state["live"])
                    state["slots"] = {name: later.read(array) for name, array in state["slots"].items()}
                later.check_read()
        except _Unreadable as exc:
            bad(str(exc))
        return caches

    def _checked(self, request, manifest, arrays, later):
        """:meth:`read`'s checks of the checkpoint ``request.path``'s ``manifest`` and ``arrays`` against
        the model (``request``: a :class:`_CheckpointRead`): the dict of new values (``"counters"``, a
        :class:`_CheckpointCounters`; each hash table's state as checked, not yet laid out). A
        member ``later`` (an :class:`_UnreadMembers`, or None) left unread stays a placeholder as a
        table's rows, live flags or slots only: named anywhere else, it is read there."""
        where = "RecModel.load_checkpoint"
        path, bad, parameters, settings, exchange, strict, shard = request
        if shard is None and "part" in manifest:
            bad("is the part %r of a row-wise checkpoint: load the checkpoint that names it" % (manifest["part"],))
        if shard is not None and manifest.get("part") != {"rank": shard[0], "world": shard[1]}:
            bad("is the part %r, expected rank %d's part of %d" % ((manifest.get("part"),) + tuple(shard)))

        used = set()

        def fetch(name, at, now=True):
            if name not in arrays:
                bad("lacks the array %r (the manifest's %s)" % (name, at))
            used.add(name)
            if later is None or not now:
                return arrays[name]
            try:
                return later.read(arrays[name])
            except _Unreadable as exc:
                bad(str(exc))

        def fetch_value(name, at, now=True):
            found = fetch(name, at, now)
            return found if found.ndim else fetch(name, at).item()

        # -- read and check everything into new objects; nothing of the model changes here
        def ref(function, now):
            return _Ref(functools.partial(function, now=now), "an array's name (str)")
        schema = _checkpoint_schema(ref(fetch, True), ref(fetch_value, True), ref(fetch, False), ref(fetch_value, False))
        got = _validate(manifest, schema, _checkpoint_checking(bad))
        new = {"counters": _CheckpointCounters.of_manifest(got)}
        saved_settings = got["settings"]         # absent in files of earlier versions
        for key, mine in settings.items() if saved_settings is not None else ():
            if key in saved_settings and saved_settings[key] != mine:
                if strict:
                    bad("was written by a model with %s=%r, but this model has %r (to go on with this model's, "
                        "load with strict=False)" % (key, saved_settings[key], mine))
                _log("%s: goes on with %s=%r (the checkpoint %r was written with %r; strict=False)"
                     % (where, key, mine, path, saved_settings[key]))
        if len(got["tables"]) != len(self.tables):
            bad("holds %d hash tables, the model has %d" % (len(got["tables"]), len(self.tables)))
        new["tables"], new["shards"] = [], []
        for i, (table, state) in enumerate(zip(self.tables, got["tables"])):
            if state["shard"] not in (None, None if shard is None else list(shard)):
                bad("has hash table %r as shard %r, expected %s" % (table.table_name, state["shard"],
                                                                    "a whole table or %r" % (list(shard),)))
            new["shards"].append(state["shard"])
            if state["name"] != table.table_name:
                bad("has hash table %d named %r, the model %r" % (i, state["name"], table.table_name))
            try:
                new["tables"].append(table.check_state_dict(state, where, strict))
            except (ValueError, TypeError) as exc:
                bad("has a bad state for hash table %d %r (field 'tables[%d]'): %s" % (i, table.table_name, i, exc))
        params = {p.name: p for p in parameters()}
        saved_params = got["parameters"]
        if set(saved_params) != set(params):
            bad("does not match this model: parameters missing from the file %s, unknown to the model %s"
                % (sorted(set(params) - set(saved_params))[:5], sorted(set(saved_params) - set(params))[:5]))
        new["parameters"] = []
        for name, param in params.items():
            saved = saved_params[name]
            if saved.shape != tuple(param.shape) or saved.dtype != ms.dtype_to_nptype(param.dtype):
                bad("has parameter %r of shape %s and dtype %s, the model %s and %s"
                    % (name, saved.shape, saved.dtype, tuple(param.shape), param.dtype))
            new["parameters"].append((param, saved))
        new["replay"] = []
        for k, entry in enumerate(got["replay"]):
            if entry["skip"] is not None:
                new["replay"].append(_StepFeed(None, None, entry["taken"], entry["samples"], entry["skip"]))
                continue
            if len(entry["tables"]) != len(self.tables):
                bad("holds %d hash tables in replayed batch %d, the model has %d" % (
                    len(entry["tables"]), k, len(self.tables)))
            batches = []
            for table, positions, info in zip(self.tables, self.positions, entry["tables"]):
                batch = self._replay_batch(table, positions, info)
                if batch is None:
                    bad("has bad rows in replayed batch %d for hash table %r" % (k, table.table_name))
                batches.append(batch)
            new["replay"].append(_StepFeed(tuple(entry["inputs"]), batches, entry["taken"], entry["samples"]))
        unlisted = sorted(set(arrays) - used)
        if unlisted:
            bad("holds arrays its manifest does not name: %s" % unlisted[:5])
        if new["replay"] and exchange is not None:
            bad("holds %d prepared batches to replay (a one-process run's prefetch); a model whose hash tables "
                "span ranks cannot replay them: resume it in one process" % len(new["replay"]))
        return new

    def _read_parts(self, request, manifest):
        """:meth:`read` of a row-wise checkpoint: the manifest at ``request.path`` names one part per
        rank of the world that wrote it; each must exist with the size and sha256 listed, and is read
        and checked in full before anything is used. Dense state from part 0 (every rank's is the
        same); each hash table's state from its shards (row-wise when written; any part holds a
        whole data-parallel table), laid out for this model (``HashEmbedding.restore_states``)."""
        path, bad, parameters, settings, exchange, strict, _ = request
        got = _validate(manifest, _CHECKPOINT_PARTS, _checkpoint_checking(bad))
        world, parts = got["world"], got["parts"]
        folder = os.path.dirname(os.path.abspath(path))
        for entry in parts:
            file = os.path.join(folder, entry["file"])
            if not os.path.isfile(file):
                bad("names rank %d's part %r, which is missing" % (entry["rank"], file))
            size, digest = _file_digest(file)
            if (size, digest) != (entry["size"], entry["sha256"]):
                bad("names rank %d's part %r of %s bytes and sha256 %s, but the file has %d bytes and sha256 %s"
                    % (entry["rank"], file, entry["size"], entry["sha256"], size, digest))
        reads = [self.read(os.path.join(folder, entry["file"]), parameters, settings, exchange, strict,
                           shard=(entry["rank"], world)) for entry in parts]
        new = reads[0]
        new["tables"] = [table.restore_states([rd["tables"][k] for rd in reads] if new["shards"][k] else
                                              [new["tables"][k]])
                         for k, table in enumerate(self.tables)]
        new["caches"] = [None] * len(self.tables)
        return new


_INPUT_POSITION_FORMAT = 3        # 2: a side file <prefix>-<step>.input.json; 3: the checkpoint's member "extra"
_INPUT_DIGEST_NAME = "blake2b-256"        # the digest of the input's bytes a position records (_input_hasher)


def _input_position_path(checkpoint):
    """The side file in which recboost before format 3 of the position recorded the input position of
    the checkpoint ``checkpoint`` (``<prefix>-<step>.input.json`` next to it). Never read: only named
    when a checkpoint without its position has one beside it."""
    return (checkpoint[:-4] if checkpoint.endswith(".npz") else checkpoint) + ".input.json"


def _input_position_relate(got, at, checking, consumed):
    """The fields of an input position against each other and its checkpoint: one ``files`` entry
    per source up to the position's, the last one the position's own (its ``lines``/``rows``, read
    at least up to the offset), rows within lines, ``batches`` = ``consumed`` (the checkpoint's
    ``taken - stream_start``), and the rows of the files before the position plus ``rows`` those of
    ``batches`` batches of ``batch_size`` (the last one may be short: the input's end)."""
    files, bs, batches = got["files"], got["batch_size"], got["batches"]
    field = lambda name: checking.field(at, name)        # noqa: E731
    if len(files) != got["source"] + 1:
        checking.fail(field("files"), "one entry per file up to the position's (source + 1 = %d)"
                      % (got["source"] + 1), _Given("%d entries" % len(files)), ValueError)
    last = files[-1]
    for key in ("lines", "rows"):
        if last[key] != got[key]:
            checking.fail(field("files[%d].%s" % (len(files) - 1, key)), "the position's %s, %d" % (key, got[key]),
                          last[key], ValueError)
    if got["offset"] > last["read"]:
        checking.fail(field("offset"), "at most the bytes read of its file, %d" % last["read"], got["offset"],
                      ValueError)
    for k, facts in enumerate(files):
        if facts["rows"] > facts["lines"]:
            checking.fail(field("files[%d].rows" % k), "at most its lines, %d" % facts["lines"], facts["rows"],
                          ValueError)
    if batches != consumed:
        checking.fail(field("batches"), "the checkpoint's taken - stream_start = %d" % consumed, batches, ValueError)
    rows = sum(f["rows"] for f in files[:-1]) + got["rows"]
    if not (batches - 1) * bs < rows <= batches * bs and not batches == rows == 0:
        checking.fail(field("rows"), "such that the rows up to the position (those of the files before it plus "
                      "'rows') fill its %d batches of %d (the last may be short)" % (batches, bs),
                      _Given("%d rows in all" % rows), ValueError)
    return got


_INPUT_FILE_FACTS = _Fields({"name": _FILE_NAME, "size": _COUNT.or_none(), "read": _COUNT,
                             "digest": _Rule("a hex digest of 64 digits", str,
                                             test=lambda v: re.fullmatch(r"[0-9a-f]{64}", v) is not None),
                             "lines": _COUNT, "rows": _COUNT})


def _input_position_schema(manifest):
    """The schema (``_validate``) of the input position a checkpoint of ``recboost train`` carries as
    its extra member (:class:`_InputCheckpoint`), for the checkpoint's ``manifest``: ``format``,
    ``digest`` (the digest's name), ``batch_size``, ``batches`` (the checkpoint's ``taken -
    stream_start``: the batches of the input before the position), ``source`` (the index of the
    source in reading order), ``offset``, ``lines``, ``rows`` (:meth:`CriteoReader.position` in that
    source) and ``files``: for each source up to and including the position's, ``name``, ``size``
    (bytes on disk), ``read`` (the bytes read from it: all of a file before the position,
    decompressed for ``.gz``; of the position's file, at least up to the offset), ``digest``
    (BLAKE2b-256 of those bytes), ``lines`` and ``rows``."""
    consumed = manifest["taken"] - manifest.get("stream_start", 0)
    return _Fields({
        "format": _Rule("%d (the format this version writes)" % _INPUT_POSITION_FORMAT, int,
                        test=lambda v: v == _INPUT_POSITION_FORMAT),
        "digest": _Rule(repr(_INPUT_DIGEST_NAME), str, test=lambda v: v == _INPUT_DIGEST_NAME),
        "batch_size": _Int(1), "batches": _COUNT, "source": _COUNT, "offset": _COUNT, "lines": _COUNT,
        "rows": _COUNT, "files": _List(_INPUT_FILE_FACTS)},
        relate=functools.partial(_input_position_relate, consumed=consumed))


def _input_position_record(train_input, batches):
    """The input position (``_input_position_schema``) where the first ``batches`` batches of
    ``train_input`` (a :class:`_CriteoInput` of files with ``digests``) end, or None when it cannot
    be found (batch ``batches`` is not among the last ones read)."""
    position = train_input.position_after(batches)
    if position is None:
        return None
    here = dict(_source_facts(train_input.sources[position["source"]]), read=position["read"],
                digest=position["digest"], lines=position["lines"], rows=position["rows"])
    return {"format": _INPUT_POSITION_FORMAT, "digest": _INPUT_DIGEST_NAME, "batch_size": train_input.batch_size,
            "batches": batches, "source": position["source"], "offset": position["offset"],
            "lines": position["lines"], "rows": position["rows"], "files": position["done"] + [here]}


def _checkpoint_extra(where, path, manifest, schema):
    """The caller's extra member of the checkpoint ``path`` (its ``manifest``, read by
    :func:`_checkpoint_file_manifest`: covered by its checksum), checked by ``schema(manifest)``
    (``_validate``); None when the checkpoint carries none. A bad field, of any kind, is one
    ValueError of ``where`` naming the field (``extra.<name>``) and the file."""
    extra = manifest.get("extra")
    if extra is None:
        return None
    return _validate(extra, schema(manifest), _Checking.manifest(
        lambda at, expected, got, exc: _fail(where, "the field %r of the checkpoint %r" % (at, path), expected, got,
                                             ValueError)), at="extra")


# =====================================================================================================
# Rank exchange
# =====================================================================================================
# Every collective of a step whose hash tables span ranks (data-parallel and row-wise tables), in the
# step's terms; MindSpore's AllGather and AllReduce over msrun's world group. Who owns what:
#   _RankExchange                      the collectives: share_config (before the first step),
#                                      share_headers (each rank's batch: train, skip, failed, ended),
#                                      share_ids, share_row_bounds (the finite check's row bounds),
#                                      agree_admissions, fetch_rows and send_gradients (row-wise),
#                                      sum_rows (data-parallel), share_part_record (checkpoint parts);
#                                      the messages' packing (int64 as int32 pairs) is its alone
#   _StepHeaders                       what the ranks told each other about a step
#   _exchange_timeout,                 how long a rank waits for the others before naming the
#   _govern_collective_timeout         collective it waits in (RECBOOST_EXCHANGE_TIMEOUT, and
#                                      MindSpore's MS_CPU_COMM_OP_TIMEOUT kept above it)
# _StepPipeline (next section) calls it; RecModel makes it when it lays the tables out across ranks.


class _StepHeaders:
    """What the ranks told each other about a step (:meth:`_RankExchange.share_headers`), one entry
    per rank: ``codes`` (0: it trains; 1 + a skip reason's index; -1: its batch failed a check;
    ``_RANK_ENDED``: its stream ended); per exchanged table ``j``: ``given[j]`` (whether the rank
    gave a time), ``times[j]`` (the time, 0 when none); ``counts``: each rank's id count of every
    exchanged table's features, table by table (int64 ``[ranks, features]``)."""
    __slots__ = ("codes", "given", "times", "counts", "widths")

    def __init__(self, codes, given, times, counts, widths):
        self.codes, self.given, self.times, self.counts, self.widths = codes, given, times, counts, widths


class _RankExchange:
    """Every collective of a step whose hash tables span ranks, in the step's terms: share the
    step's headers (:meth:`share_headers`) and ids (:meth:`share_ids`); for row-wise tables agree
    on the admissions (:meth:`agree_admissions`), fetch the keys' rows from their owners
    (:meth:`fetch_rows`) and send the keys' gradients to them (:meth:`send_gradients`); for
    data-parallel tables sum the union rows' gradients (:meth:`sum_rows`); before the first step
    agree on the configuration (:meth:`share_config`); for a checkpoint in parts, share each rank's
    part record (:meth:`share_part_record`). The packing, padding and dtypes of the messages are
    this class's alone: an AllToAll path (Ascend/GPU) changes only it.

    The collectives are MindSpore's AllGather and AllReduce over the world group (msrun's), issued on
    the training thread (``_SyncFeeder``) so that every rank issues them in the same order.
    MindSpore 2.10's CPU AllGather does not move int64 correctly (only half the bytes arrive), so
    int64 arrays travel as pairs of int32 words (a view of the same bytes) and are viewed back.
    ``bytes_sent``: the bytes this rank has put into collectives (its AllGather parts, its AllReduce
    buffers), and ``seconds``: the time spent in them, for benchmarks. ``mean``: whether the dense
    gradients are averaged over the ranks (RecModel sets it from the train cell's reducer); the row
    gradients are scaled the same way."""

    def __init__(self, rank, size):
        self.rank, self.size = int(rank), int(size)
        self.mean = True
        self.bytes_sent = 0
        self.seconds = 0.0
        self._all_gather = ops.AllGather()
        self._all_reduce = ops.AllReduce()
        #: seconds a wait for the other ranks may last (``RECBOOST_EXCHANGE_TIMEOUT``; 0: no limit)
        self.timeout = _exchange_timeout()
        self._waiting = None            # (what, since) while this rank waits for the others
        self._watchdog = None

    @contextlib.contextmanager
    def waiting(self, what):
        """Mark a wait for the other ranks (``what``: a collective, or the step that holds the dense
        gradients' AllReduce). If one lasts longer than :attr:`timeout`, a watchdog thread writes
        which wait, on which rank, and ends the process (exit code 75): a rank that died or
        stalled then ends the job (msrun stops the others) instead of hanging it."""
        if self._watchdog is None and self.timeout:
            self._watchdog = threading.Thread(target=self._watch, name="recboost-exchange-watchdog", daemon=True)
            self._watchdog.start()
        self._waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self._waiting = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            waiting = self._waiting
            if waiting is not None and time.monotonic() - waiting[1] > self.timeout:
                sys.stderr.write(
                    "[recboost] rank %d of %d: %s has waited more than %g s for the other ranks (%s=%g): a rank "
                    "has died or stalled. This process exits (code 75) so the job does not hang; the last "
                    "complete checkpoint stays loadable.\n" % (self.rank, self.size, waiting[0], self.timeout,
                                                               _EXCHANGE_TIMEOUT_ENV, self.timeout))
                sys.stderr.flush()
                os._exit(75)

    # ---- the collectives (the only calls into MindSpore's communication) ---------------------------
    def _collective(self, op, array, what):
        self.bytes_sent += array.nbytes
        start = time.perf_counter()
        with self.waiting(what):
            out = op(Tensor.from_numpy(array)).asnumpy()
        self.seconds += time.perf_counter() - start
        return out

    def _gather_int64(self, values):
        """Every rank's ``values`` (1-D int64 of one length on every rank) as an int64 [size, n]."""
        words = np.ascontiguousarray(values, np.int64).view(np.int32)
        out = self._collective(self._all_gather, words, "an AllGather of the hash tables' exchange")
        return np.ascontiguousarray(out, np.int32).view(np.int64).reshape(self.size, -1)

    def _gather_float32(self, part):
        """Every rank's ``part`` (float32 ``[n, ...]``, one shape on every rank) as ``[size, n, ...]``."""
        part = np.ascontiguousarray(part, np.float32)
        out = self._collective(self._all_gather, part, "an AllGather of the hash tables' rows or gradients")
        return np.ascontiguousarray(out, np.float32).reshape((self.size,) + part.shape)

    # ---- the messages of a job and its steps ----------------------------------------------------------
    def share_config(self, config):
        """Every rank's ``config`` (a JSON value), in rank order (two AllGathers: the lengths, then the
        UTF-8 texts padded to the longest)."""
        blob = json.dumps(config, sort_keys=True).encode()
        lengths = self._gather_int64(np.array([len(blob)], np.int64))[:, 0]
        words = np.zeros(-(-int(lengths.max()) // 8) * 8, np.uint8)
        words[:len(blob)] = np.frombuffer(blob, np.uint8)
        blobs = self._gather_int64(words.view(np.int64)).view(np.uint8)
        return [json.loads(blobs[r, :int(lengths[r])].tobytes().decode()) for r in range(self.size)]

    def share_headers(self, code, widths, entries):
        """Every rank's header of a step (one AllGather), as :class:`_StepHeaders`. ``code``: this
        rank's (see ``_StepHeaders``); ``widths``: the features of each exchanged table (the same on
        every rank); ``entries``: None when ``code`` is not 0, else per exchanged table a
        ``_TableIds`` (its time or None, the flat ids of each of its features)."""
        at = np.cumsum([1] + [2 + n for n in widths])                # each table's place in the header
        header = np.zeros(int(at[-1]), np.int64)
        header[0] = code
        for j, entry in enumerate(entries or ()):
            t = entry.time
            header[at[j]:at[j + 1]] = [t is not None, 0 if t is None else t] + [f.size for f in entry.ids]
        heads = self._gather_int64(header)
        counts = np.concatenate([heads[:, at[j] + 2:at[j + 1]] for j in range(len(widths))] or
                                [np.zeros((self.size, 0), np.int64)], axis=1)
        return _StepHeaders(heads[:, 0], [heads[:, at[j]] != 0 for j in range(len(widths))],
                            [heads[:, at[j] + 1] for j in range(len(widths))], counts, list(widths))

    def share_row_bounds(self, bounds):
        """The rows' bounds of a step combined over the ranks (one AllGather; ``bounds``: this rank's
        ``_StepPipeline.row_bounds``, float32 ``[n, 7]``, one shape on every rank): per entry the
        largest M, L, W, q and add and the smallest learning rate and divisor D of any rank
        (``_combined_bounds``). A row-wise
        table's row is updated by its owner with every rank's gradient of it, so each rank bounds its
        gradient against the largest state any owner updates; the step's flag is then combined over
        the ranks (``_TrainStep.get_overflow_status``), so the rank whose gradient is largest skips
        the step for all."""
        return _combined_bounds(self._gather_float32(bounds))

    def share_ids(self, headers, entries):
        """Every rank's ids of the step (one AllGather, each rank's padded to the longest), after
        :meth:`share_headers` gave ``headers`` and no rank failed or skipped. Per exchanged table a
        ``_SharedIds`` ``(union, mine, rank_of, time)``: the ids of every rank in the order one process would see
        the concatenated batch (rank 0's rows first): feature by feature, each feature's ids rank by
        rank; this rank's positions in it (int64, in its own flat order); the rank of each id; the
        latest time any rank gave (None when none gave one)."""
        counts = headers.counts
        totals = counts.sum(axis=1)
        width = int(totals.max()) if totals.size else 0
        if width:
            part = np.zeros(width, np.int64)
            np.concatenate([f for entry in entries for f in entry.ids], out=part[:int(totals[self.rank])])
            ids = self._gather_int64(part)
        starts = np.cumsum(counts, axis=1) - counts                # each feature's ids within a rank's part
        out, f = [], 0
        for j, n in enumerate(headers.widths):
            pieces, mine, rank_of, offset = [], [], [], 0
            for _ in range(n):
                for r in range(self.size):
                    if r == self.rank:
                        mine.append(np.arange(offset, offset + counts[r, f], dtype=np.int64))
                    pieces.append(ids[r, starts[r, f]:starts[r, f] + counts[r, f]] if width else
                                  np.zeros(0, np.int64))
                    rank_of.append(np.full(counts[r, f], r, np.int64))
                    offset += int(counts[r, f])
                f += 1
            given = headers.given[j]
            out.append(_SharedIds(np.concatenate(pieces), np.concatenate(mine), np.concatenate(rank_of),
                                  int(headers.times[j][given].max()) if given.any() else None))
        return out

    def agree_admissions(self, held, events, rows):
        """How many of its admissions a row-wise shard may make this step so that the shards together
        admit what one process would: the first admissions of the step's union, in its order, that
        the table's ``rows`` (for ids, every shard's together) allow. ``held``: the ids this shard
        holds; ``events``: the union positions where it would admit an id (ascending). The shards
        share ``held`` and how many admissions they want (AllGather), and only when the table lacks
        rows for all of them, the positions (AllGather, padded). -1: no limit."""
        heads = self._gather_int64(np.array([held, events.size], np.int64))
        free = rows - int(heads[:, 0].sum())
        if int(heads[:, 1].sum()) <= free:
            return -1
        if free <= 0:
            return 0
        part = np.full(int(heads[:, 1].max()), np.iinfo(np.int64).max, np.int64)
        part[:events.size] = events
        last = np.sort(self._gather_int64(part).ravel())[free - 1]     # the last admission the table allows
        return int(np.count_nonzero(events <= last))

    def fetch_rows(self, owned, values, default, size):
        """Every key's row from its owner (one AllGather of each rank's owned rows, each with a flag):
        ``(rows float32 [size, dim], flags bool [size])``. ``owned[r]``: the keys rank r owns;
        ``values``/``default``: this rank's rows of its owned keys and their flags. No collective
        when the step has no keys (the same on every rank)."""
        dim = values.shape[1]
        rows, flags = np.empty((size, dim), np.float32), np.zeros(size, np.bool_)
        if size == 0:
            return rows, flags
        part = np.zeros((max(k.size for k in owned), dim + 1), np.float32)
        n = values.shape[0]
        part[:n, :dim] = values
        part[:n, dim] = default
        got = self._gather_float32(part)
        for r, k in enumerate(owned):
            rows[k] = got[r, :k.size, :dim]
            flags[k] = got[r, :k.size, dim] != 0
        return rows, flags

    def send_gradients(self, used, sums, size):
        """Every key's gradient, summed over the ranks (``sums``: this rank's, one row per key it uses,
        ``used[r]`` the keys rank r uses): every rank's sums are gathered (one AllGather, each padded to
        the most keys a rank uses) and added up per key in rank order, times 1/ranks when the dense
        gradients are averaged. float32 ``[size, dim]``; None when no rank uses a key."""
        width = max(k.size for k in used)
        if not width:
            return None
        part = np.zeros((width, sums.shape[1]), np.float32)
        part[:sums.shape[0]] = sums
        got = self._gather_float32(part)
        total = np.zeros((size, sums.shape[1]), np.float32)
        for r, k in enumerate(used):
            total[k] += got[r, :k.size]
        if self.mean:
            total *= np.float32(1.0 / self.size)
        return total

    def sum_rows(self, part):
        """The union rows' gradients summed over the ranks (``part``: float32 [u, dim], the same u on
        every rank; one AllReduce), times 1/size when the dense gradients are averaged."""
        part = np.ascontiguousarray(part, np.float32)
        total = self._collective(self._all_reduce, part, "the AllReduce of the hash tables' row gradients")
        if self.mean:
            total = total * np.float32(1.0 / self.size)
        return np.ascontiguousarray(total, np.float32)

    def share_part_record(self, path, size, digest):
        """Every rank's record of its checkpoint part (one AllGather, returned once every rank's part is
        complete): ``(sizes, digests, same_path)``: each part's size (-1: that rank could not write
        it) and sha256 (hex), and whether every rank named the checkpoint ``path``. ``size`` None:
        this rank's part failed."""
        info = np.zeros(6, np.int64)
        info[5] = np.frombuffer(hashlib.sha256(os.path.abspath(path).encode()).digest()[:8], np.int64)[0]
        if size is None:
            info[0] = -1
        else:
            info[0], info[1:5] = size, np.frombuffer(bytes.fromhex(digest), np.int64)
        heads = self._gather_int64(info)
        digests = [heads[r, 1:5].tobytes().hex() for r in range(self.size)]
        return heads[:, 0], digests, bool((heads[:, 5] == info[5]).all())


_EXCHANGE_TIMEOUT_ENV = "RECBOOST_EXCHANGE_TIMEOUT"


def _exchange_timeout():
    """``RECBOOST_EXCHANGE_TIMEOUT`` in seconds (default 600; 0 turns the watchdog off)."""
    text = os.environ.get(_EXCHANGE_TIMEOUT_ENV, "600")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        _fail("recboost", "the environment variable %s" % _EXCHANGE_TIMEOUT_ENV, "a number of seconds >= 0 "
              "(0: no limit)", text)
    return value


_MS_COLLECTIVE_TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"


def _govern_collective_timeout():
    """MindSpore's CPU collectives give up after their own timeout (``MS_CPU_COMM_OP_TIMEOUT``, in
    seconds: 30 by default in 2.10) with a raw "Launch kernel failed" RuntimeError, long before
    recboost's exchange watchdog (``RECBOOST_EXCHANGE_TIMEOUT``, 600 s) would act. Unless the user
    set it, it is set here, when recboost is imported, to recboost's timeout plus a minute (a year
    when that is 0: no limit), so the watchdog governs: a rank stalled for less than
    ``RECBOOST_EXCHANGE_TIMEOUT`` does not end the job. A bad ``RECBOOST_EXCHANGE_TIMEOUT`` is left
    for the exchange to name."""
    if _MS_COLLECTIVE_TIMEOUT_ENV in os.environ:
        return
    try:
        timeout = _exchange_timeout()
    except ValueError:
        return
    os.environ[_MS_COLLECTIVE_TIMEOUT_ENV] = str(int(timeout) + 60 if timeout else 365 * 24 * 3600)


_govern_collective_timeout()


# =====================================================================================================
# Step pipeline
# =====================================================================================================
# The host side of a step, stage by stage: a raw batch checked, its ids mapped (prepare: on the
# prefetch thread, in stream order), its rows taken and gathered (inputs), the graph step (RecModel),
# the rows' sparse updates (apply). Who owns what:
#   _StepPipeline                      the stages over a network's hash tables: prepare (batch checks,
#                                      each table's layout, the rank exchange, EvictHooks) -> inputs
#                                      (take and gather) -> row_bounds (the finite check's) -> apply
#   _StepFeed                          one step's host side: the batch items and one _TableBatch a table
#   _CheckedBatch                      a raw batch that passed the checks (prepare's first stage), by name
#   _construct_names                   the network's construct parameters (a dict batch meets them by name)
#   _Prefetcher, _SyncFeeder           prepare run ahead on a background thread, or on the training
#                                      thread (multi-rank: collectives in one order on every rank)
#   _table_layout                      which batch items feed which table (by construct's names)
#   _to_numpy_batch, _check_batch,     a raw batch as numpy items, checked against the run's first
#   _batch_rows, _item_name,           batch's schema before anything changes
#   _time_column, _batch_iterator      a dict batch's data time; a dataset's batches per epoch
# The tables' own work (mapping, rows, updates) is theirs (section Hash embedding).


class _StepFeed:
    """Host side of one training step, made in stream order (``_StepPipeline.prepare``).

    ``inputs``: the batch items (numpy); None where a hash table's features go (the
    ``_TableBatch.positions``), filled with the gathered rows on the training thread just before
    the step. ``tables``: one ``_TableBatch`` per table (growth, new ids' initial rows, the
    gradient's grouping). ``taken`` counts the raw stream batches consumed so far; ``skip`` says
    why a batch is not trained (None: it is).
    """
    __slots__ = ("inputs", "tables", "taken", "samples", "skip")

    def __init__(self, inputs, tables, taken, samples, skip=None):
        self.inputs, self.tables = inputs, tables
        self.taken, self.samples, self.skip = taken, samples, skip


class _Prefetcher:
    """Run ``produce(raw_batch)`` in a background thread up to ``depth`` batches ahead, in order.

    The host work (id translation, parsing) then overlaps the device step. ``pause()`` waits until
    the producer is idle and returns the produced-but-unconsumed items, so a checkpoint sees one
    consistent point; ``resume()`` lets it go on. Within :meth:`held` (the callbacks of a step) a
    ``resume()`` waits for the hold's end, so every callback of one step (two checkpoints, an export)
    sees the same point. An exception in the producer is raised in the
    consumer at the position where it happened; items produced before it are delivered first, and
    the producer stops there (it never runs ahead past a failure).

    Not a ``queue.Queue``: ``pause`` must see every produced item, including one the producer holds
    while a full queue blocks its ``put``, and read the queue without consuming it. A condition over a
    deque, with the producer waiting for room *before* it produces, gives both.
    """

    _END = object()

    def __init__(self, iterator, produce, depth=2, replay=()):
        self._iterator, self._produce, self._depth = iterator, produce, depth
        self._items = collections.deque(replay)
        self._cv = threading.Condition()
        self._paused = self._closed = self._busy = False
        self._finished = self._holding = False
        self._thread = threading.Thread(target=self._run, name="recboost-prefetch", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            with self._cv:
                while not self._closed and (self._paused or len(self._items) >= self._depth):
                    self._cv.wait()
                if self._closed:
                    return
                self._busy = True
            try:
                item = self._produce(next(self._iterator))
            except StopIteration:
                item = self._END
            except BaseException as exc:          # delivered to the consumer, in order
                item = exc
            with self._cv:
                self._items.append(item)
                self._busy = False
                self._cv.notify_all()
            if item is self._END or isinstance(item, BaseException):
                return

    def __iter__(self):
        return self

    def __next__(self):
        with self._cv:
            while not self._items:
                self._cv.wait()
            item = self._items.popleft()
            self._cv.notify_all()
        if item is self._END:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        return item

    def pause(self):
        """Stop producing and return the queued items (they stay queued)."""
        with self._cv:
            self._paused = True
            while self._busy:
                self._cv.wait()
            return [i for i in self._items if isinstance(i, _StepFeed)]

    def resume(self):
        with self._cv:
            if not self._holding:
                self._paused = False
                self._cv.notify_all()

    @contextlib.contextmanager
    def held(self):
        """A pause taken inside (:meth:`pause`) lasts until the end: what the producer had made when it
        was first paused is what every pause inside sees."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self.resume()

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)


#: what ``_SyncFeeder`` produces when its stream ends: the exchange tells the other ranks (code
#: ``_RANK_ENDED`` in the step's header), and every rank stops at that step (uneven streams)
_STREAM_END = object()
_RANK_ENDED = -2


class _StreamEnded(Exception):
    """Raised by the exchange of a step at which some rank's stream has ended."""


class _SyncFeeder:
    """``_Prefetcher``'s interface without a thread: each batch is produced when the training thread
    asks for it. RecModel uses it when a hash table is data-parallel or row-wise: producing a batch then issues
    collectives (the id exchange), which must reach every rank in the same order relative to the
    step's own (the dense gradients' AllReduce); on one thread per rank that order is the program's.
    When its stream ends it still takes part in that step's exchange, so every rank stops there
    (PyTorch DDP's ``Join`` answers uneven inputs the same way: no rank waits for a peer that left)."""

    def __init__(self, iterator, produce, replay=()):
        self._iterator, self._produce = iterator, produce
        self._items = collections.deque(replay)
        self._finished = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._items:
            return self._items.popleft()
        if self._finished:
            raise StopIteration
        try:
            raw = next(self._iterator)
        except StopIteration:         # the other ranks hear of it in the exchange, and stop at this step too
            self._finished, raw = True, _STREAM_END
        try:
            return self._produce(raw)
        except _StreamEnded:
            self._finished = True
            raise StopIteration from None

    def pause(self):
        """The replayed items not trained yet (nothing is produced ahead)."""
        return [i for i in self._items if isinstance(i, _StepFeed)]

    def resume(self):
        pass

    @contextlib.contextmanager
    def held(self):
        """(Nothing is produced ahead: every pause sees the same point.)"""
        yield

    def close(self):
        pass


def _table_layout(network, tables, where):
    """Where each hash table's ids are among a batch's items: ``(input names, positions, time keys)``.

    A table made with feature specs (``create_table(feature_spec=...)``) is fed by name: each of
    its features goes to the ``construct`` parameter of ``network`` named like the feature's
    ``index_key`` (input names: those parameters, in order; None when no table has specs). Any
    other table reads the item at its ``input_index``. Time key of a table: the ``index_key`` of
    its timestamp spec, else of the only timestamp spec of the network, else "timestamp".

    Several tables may read one item (the canonical Wide&Deep: a wide and a deep table on the
    same ids, each with its own optimizer, admission and eviction). The step then feeds that item
    as one rows array holding the tables' rows side by side, in table order; each table's
    :attr:`HashEmbedding.column_start` says where its columns begin (set here). Such tables must
    shape their rows alike (a combiner on all or on none, the same ``padding_id``), so the ids
    are checked once; a table reading several shared items must start at the same column in each."""
    names = _construct_names(network) if any(table.feature_specs for table in tables) else None
    clocks = {spec.index_key for table in tables for spec in table.feature_specs if spec.is_timestamp}
    default_clock = clocks.pop() if len(clocks) == 1 else "timestamp"
    positions, time_keys, readers = [], [], {}
    for table in tables:
        features = [spec for spec in table.feature_specs if not spec.is_timestamp]
        if features and table.input_index is not None:
            _fail(where, "the 'input_index' of hash table %r" % table.table_name, "None for a table fed by "
                  "feature specs %s" % [spec.name for spec in features], table.input_index)
        if not features and table.input_index is None:
            _fail(where, "the 'input_index' of hash table %r" % table.table_name, "the position of its ids "
                  "in the batch (or create the table with feature_spec=...)", None)
        mine = []
        for spec in features:
            if spec.index_key not in names:
                _fail(where, "feature %r of hash table %r" % (spec.name, table.table_name), "an index_key "
                      "among the parameters of %s.construct %s" % (type(network).__name__, names), spec.index_key)
            p = names.index(spec.index_key)
            if p in mine:
                _fail(where, "feature %r of hash table %r" % (spec.name, table.table_name), "an index_key no "
                      "other feature of the table uses", spec.index_key)
            mine.append(p)
        positions.append(tuple(mine or [table.input_index]))
        for p in positions[-1]:
            readers.setdefault(p, []).append(table)
        own = [spec.index_key for spec in table.feature_specs if spec.is_timestamp]
        time_keys.append(own[0] if own else default_clock)
    starts = {}
    for p, group in readers.items():
        first, start = group[0], 0
        for table in group:
            if (table.combiner is None) != (first.combiner is None) or table.padding_id != first.padding_id:
                pair = "hash tables %r and %r, which read batch item %d" % (first.table_name, table.table_name, p)
                _fail(where, pair, "rows shaped alike (a combiner on both or on neither, the same padding_id)",
                      "combiners %r and %r, padding ids %r and %r" % (first.combiner, table.combiner,
                                                                     first.padding_id, table.padding_id))
            if len(group) > 1 and starts.setdefault(id(table), start) != start:
                _fail(where, "the columns of hash table %r in the shared batch item %d" % (table.table_name, p),
                      "column %d, where it starts in the other item it shares" % starts[id(table)], start)
            start += table.embedding_size
    for table in tables:
        table.column_start = starts.get(id(table), 0)
    return names, positions, time_keys


def _to_numpy_batch(batch, where, id_items=()):
    """A batch as a tuple of numpy arrays (accepts tuples/lists of arrays or Tensors, or dicts).

    Float items become float32 (float64 and float16 alike), except the hash ids at ``id_items``,
    which keep their dtype so that a wrong one is reported as it was given; ids given as a tuple
    ``(values, offsets)`` (a ragged feature) stay a tuple of two arrays, and :class:`WeightedIds` stay
    one (of arrays: the weights are checked with the table's features)."""
    if isinstance(batch, dict):
        batch = tuple(batch.values())
    if isinstance(batch, (Tensor, np.ndarray)):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)) or not batch:
        _fail(where, "each batch", "a non-empty tuple of arrays", type(batch).__name__, TypeError)

    def array(k, item):
        if isinstance(item, Tensor):
            return item.asnumpy()
        try:
            return np.asarray(item)
        except ValueError:                 # numpy: "inhomogeneous shape"
            _fail(where, "batch item %d" % k, "a rectangular array (ragged ids go as a tuple (values, offsets) "
                  "to a table with a combiner)", "rows of different lengths")

    out = []
    for k, item in enumerate(batch):
        if k in id_items and isinstance(item, tuple) and len(item) == 2:
            out.append(tuple(array(k, part) for part in item))
            continue
        if k in id_items and isinstance(item, WeightedIds):
            out.append(WeightedIds(array(k, item.ids), array(k, item.weights),
                                   None if item.offsets is None else array(k, item.offsets)))
            continue
        arr = array(k, item)
        if arr.dtype.kind == "f" and arr.dtype != np.float32 and k not in id_items:
            arr = arr.astype(np.float32)
        if arr.dtype.kind not in "biuf":
            _fail(where, "batch item %d" % k, "a numeric array", arr.dtype, TypeError)
        out.append(arr)
    rows = {_batch_rows(a) for a in out}
    if len(rows) != 1 or None in rows:
        _fail(where, "the batch items", "arrays with the same number of rows",
              [("ragged", a[1].size - 1) if isinstance(a, tuple) else a if isinstance(a, WeightedIds) else a.shape
               for a in out])
    return tuple(out)


def _batch_rows(item):
    """Rows of a batch item (an array, a ragged ``(values, offsets)``: its bags, or :class:`WeightedIds`:
    its ids' or bags'); None for a scalar."""
    if isinstance(item, WeightedIds):
        return _batch_rows(item.ids if item.offsets is None else (item.ids, item.offsets))
    if isinstance(item, tuple):
        return item[1].size - 1 if item[1].ndim == 1 else None
    return item.shape[0] if item.ndim else None


def _item_name(k, n_items, has_label):
    return "batch item %d%s" % (k, " (the label)" if has_label and k == n_items - 1 else "")


def _item_schema(item):
    """``(shape after the batch dimension, dtype)`` of a batch item: ``("ragged",)`` for ragged ids, and
    ``("weighted", ...)`` in front for :class:`WeightedIds`."""
    if isinstance(item, WeightedIds):
        shape, dtype = _item_schema(item.ids if item.offsets is None else (item.ids, item.offsets))
        return ("weighted",) + shape, dtype
    return (("ragged",), item[0].dtype) if isinstance(item, tuple) else (item.shape[1:], item.dtype)


def _schema_text(shape):
    """A batch item's shape (``_item_schema``) as a message gives it: "[B, 5]", "WeightedIds of [B, 5]"."""
    if shape[:1] == ("weighted",):
        return "WeightedIds of %s" % _schema_text(shape[1:])
    return "[B%s]" % "".join(", %s" % d for d in shape)


def _check_batch(batch, schema, where, id_items=(), has_label=False):
    """Check a training batch (numpy arrays from _to_numpy_batch) against ``schema``, the schema of
    the run's first batch: the number of items, and per item the shape after the batch dimension
    and the dtype (the dtype kind for hash ids, which any integer dtype may carry). Raises a
    ValueError (count, shape) or TypeError (dtype) naming the item, the expected and the given.
    Returns the batch's schema (the new one when ``schema`` is None)."""
    mine = tuple(_item_schema(a) for a in batch)
    if schema is None:
        return mine
    if len(batch) != len(schema):
        _fail(where, "the batch", "%d items like the first batch" % len(schema), "%d items" % len(batch))
    for k, ((shape, dtype), (want_shape, want_dtype)) in enumerate(zip(mine, schema)):
        name = _item_name(k, len(batch), has_label)
        if shape != want_shape:
            _fail(where, name, "of shape %s like the first batch" % _schema_text(want_shape), "shape %s" % (
                _schema_text(shape) if isinstance(batch[k], WeightedIds) else
                ("ragged",) if isinstance(batch[k], tuple) else batch[k].shape,))
        same = (dtype.kind in "iu" and want_dtype.kind in "iu") if k in id_items else dtype == want_dtype
        if not same:
            _fail(where, name, "of dtype %s like the first batch" % (
                "integer" if k in id_items else want_dtype), "dtype %s" % dtype, TypeError)
    return schema


def _time_column(where, key, value):
    """A dict batch's time column ``key``: a data time for the whole batch (a scalar or a 1-element
    array), or one per row (``[B]`` or ``[B, 1]``; the batch's time is then its latest row's: every
    id of the batch counts as seen then). An int64 array: 0-d, or 1-d with one time per row."""
    column = np.asarray(value)
    if column.dtype.kind not in "iu":
        _fail(where, "the time column %r" % key, "integers (data time)", value if column.ndim == 0 else
              "%s of dtype %s" % (type(value).__name__, column.dtype), TypeError)
    if column.size == 1:
        return column.reshape(()).astype(np.int64)
    if column.ndim > 2 or (column.ndim == 2 and column.shape[1] != 1):
        _fail(where, "the time column %r" % key, "one time for the batch, or one per row ([B] or [B, 1])",
              "shape %s" % (column.shape,))
    return column.reshape(-1).astype(np.int64)


def _join_feature_columns(where, raw, id_keys=None):
    """Join a dict batch's (a MindSpore dataset's) feature columns, in place: a column "<name>:offsets"
    (``OFFSETS_SUFFIX``) makes the column "<name>" the values of the ragged feature ``(values,
    offsets)``; then a column "<name>:weights" (``WEIGHTS_SUFFIX``) makes it a :class:`WeightedIds`
    (padded: weights of the ids' shape; ragged: one weight per value). A column without its ids column,
    beside a column no hash table reads (``id_keys``: the keys of the tables' features, when the batch's
    keys meet them by name; None: not known), or weights of another shape, is an error naming the column."""
    for suffix, kind in ((OFFSETS_SUFFIX, "offsets"), (WEIGHTS_SUFFIX, "weights")):
        for key in [k for k in raw if isinstance(k, str) and k.endswith(suffix)]:
            name = key[:-len(suffix)]
            if name not in raw:
                _fail(where, "the %s column %r of a dict batch" % (kind, key), "beside its ids column %r" % name,
                      "the keys %s" % sorted(raw))
            if id_keys is not None and name not in id_keys:
                _fail(where, "the %s column %r of a dict batch" % (kind, key), "beside the ids column of a hash "
                      "table's feature (one of %s)" % sorted(id_keys), "beside %r, which no hash table reads" % name)
            ids, column = raw[name], raw.pop(key)
            if suffix == OFFSETS_SUFFIX:
                raw[name] = (ids, column)
                continue
            ragged = isinstance(ids, tuple) and len(ids) == 2
            values = ids[0] if ragged else ids
            if np.shape(column) != np.shape(values):
                given = "shape %s" % (np.shape(column),)
                if ragged:
                    _fail(where, "the weights column %r" % key, "%d weights, one per value of the ragged feature "
                          "%r" % (np.size(values), name), "%d weights" % len(column) if np.ndim(column) == 1
                          else given)
                _fail(where, "the weights column %r" % key, "of the shape %s of its ids column %r" % (
                    np.shape(values), name), given)
            raw[name] = WeightedIds(values, column, ids[1] if ragged else None)


def _batch_iterator(dataset, where, num_epochs=1):
    """Iterate a MindSpore dataset (as dict batches keyed by column name, so a ``timestamp`` column is
    the data time and columns meet ``construct``'s parameters by name; over ``num_epochs`` passes, -1:
    without end, each pass ending in StopIteration) or any Python iterable of batches (one pass)."""
    if isinstance(dataset, ms.dataset.Dataset):
        return dataset.create_dict_iterator(num_epochs=num_epochs, output_numpy=True)
    try:
        return iter(dataset)
    except TypeError:
        _fail(where, "'train_dataset'", "a MindSpore dataset or an iterable of batches",
              type(dataset).__name__, TypeError)


@dataclasses.dataclass(frozen=True)
class _CheckedBatch:
    """A raw batch that passed ``_StepPipeline``'s checks, read by name: ``items`` (the batch items, a
    list, numpy), ``features`` (each table's checked features, ``_Feature``s), ``times`` ({time key:
    time}) and ``samples`` (the batch's rows)."""
    items: list
    features: list
    times: dict
    samples: int


def _construct_names(network):
    """The names of ``network.construct``'s leading positional parameters (up to ``*args``)."""
    import inspect
    names = []
    for param in inspect.signature(network.construct).parameters.values():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        names.append(param.name)
    return names


class _StepPipeline:
    """The host side of RecModel's steps over a network's hash tables, stage by stage: :meth:`prepare`
    (a raw batch checked, its ids mapped by each table's layout, with the rank exchange when a table
    spans ranks, EvictHooks applied: a ``_StepFeed``), :meth:`inputs` (take and gather: the step's
    input Tensors) and :meth:`apply` (the tables' sparse updates from the step's row gradients).
    RecModel runs the step itself between :meth:`inputs` and :meth:`apply`.

    ``network``/``tables``/``labelled`` (the batches end with a label)/``binary_labels`` (a binary
    cross-entropy loss: labels must be 0/1); ``current_step``: the model's step count (a callable,
    for the log of uneven streams); ``exchange``: the ``_RankExchange`` when the tables span ranks
    (None in one process; RecModel builds its pipeline again once it lays the tables out across ranks)."""

    def __init__(self, network, tables, labelled, binary_labels, current_step, where, exchange=None):
        self.tables, self.labelled, self.binary_labels = tables, labelled, binary_labels
        self.current_step = current_step
        self.input_names, self.positions, self.time_keys = _table_layout(network, tables, where)
        #: the batch items that become table rows (the train cell's ``row_inputs``), each once, in the
        #: order the tables read them
        self.row_positions = tuple(dict.fromkeys(p for positions in self.positions for p in positions))
        self._row_index = {p: k for k, p in enumerate(self.row_positions)}
        self.construct_names = _construct_names(network)      # dict batches meet them by name
        self.exchange = exchange

    def prepare(self, raw, state, where, training=True):
        """Raw stream batch -> _StepFeed (runs in the prefetch thread for training; on the training
        thread when a table spans ranks, see :meth:`_prepare_exchanged`).

        Only host state changes here (caches, the eviction schedule); everything that touches a
        device table becomes an event for the training thread."""
        if self.exchange is not None and (training or self._exchanged_tables(False)):
            return self._prepare_exchanged(raw, state, where, training)
        checked = self._check_raw(raw, state, where, training)
        if isinstance(checked, _StepFeed):
            return checked
        batch, features, times, samples = checked.items, checked.features, checked.times, checked.samples
        tables = []
        for table, parts, positions, time_key in zip(self.tables, features, self.positions, self.time_keys):
            tables.append(table.prepare_step(parts, times.get(time_key), training, positions))
            for p in positions:
                batch[p] = None               # gathered on the training thread, just before the step
        if training:
            self._evict_due(state)
        return _StepFeed(tuple(batch), tables, state["taken"], samples)

    def _exchanged_tables(self, training):
        """Positions of the tables whose ids the ranks exchange: the row-wise ones, and when training
        the data-parallel ones too (they map the union; evaluation looks up locally)."""
        return [k for k, table in enumerate(self.tables) if table.exchanges_ids(training)]

    def _prepare_exchanged(self, raw, state, where, training=True):
        """:meth:`prepare` of a batch when hash tables are data-parallel or row-wise (every rank calls it
        for its own part of the global batch, on its training thread; for evaluation and prediction
        too when a table is row-wise: the ranks then look up their ids together).

        Each rank checks its batch, then the ranks share their headers (``_RankExchange.share_headers``:
        0 to train, 1 + the skip reason, or -1 when its batch failed a check; per exchanged table
        (:meth:`_exchanged_tables`) the time and the id count of each feature), then the ids of every
        exchanged table (``share_ids``, padding ids dropped). If a rank failed, every rank raises; if a
        rank skips, every rank skips the step, counted under the first skipping rank's reason.
        Otherwise each exchanged table prepares its part of the union (in the order one process would
        see the concatenated batch, rank 0's rows first; at the latest time any rank gave, None when
        none gave one) through its layout (``HashEmbedding.prepare_step``): a data-parallel table maps
        the whole union, identically on every rank (caches, rows and the eviction schedule stay
        identical), and each rank keeps its own ids' rows; a row-wise table's owners map their own ids."""
        ex = self.exchange
        dp = self._exchanged_tables(training)
        widths = [len(self.positions[k]) for k in dp]        # features of each exchanged table
        code, entries, checked, failure = 0, None, None, None
        try:
            if raw is _STREAM_END:
                code = _RANK_ENDED
                raise _StreamEnded
            checked = self._check_raw(raw, state, where, training)
            if isinstance(checked, _StepFeed):
                code = 1 + _SKIP_REASONS.index(checked.skip)
            else:
                entries = [_TableIds(checked.times.get(self.time_keys[k]), [p.ids for p in checked.features[k]])
                           for k in dp]
        except _StreamEnded:
            pass
        except Exception as exc:              # noqa: BLE001 -- raised below, after the peers heard of it
            failure, code, entries = exc, -1, None
        heads = ex.share_headers(code, widths, entries)
        codes = heads.codes
        if (codes == _RANK_ENDED).any() and not (codes == -1).any():
            ended = np.flatnonzero(codes == _RANK_ENDED).tolist()
            if raw is not _STREAM_END:
                state["taken"] -= 1           # this rank's batch is not trained: not consumed
            _log("%s: the stream of rank(s) %s ended: every rank stops at step %d (uneven streams end "
                 "together)%s" % (where, ended, self.current_step(), "" if raw is _STREAM_END else
                                  "; this rank's stream batch %d was read and not trained" % (state["taken"] + 1)))
            raise _StreamEnded
        if (codes == -1).any():
            if failure is not None:
                raise failure
            raise RuntimeError("%s: rank %d could not prepare its part of this step's batch (its log says why); "
                               "every rank stops here" % (where, int(np.flatnonzero(codes == -1)[0])))
        if (codes > 0).any():
            reason = _SKIP_REASONS[int(codes[np.flatnonzero(codes > 0)[0]]) - 1]
            if isinstance(checked, _StepFeed):
                checked.skip = reason
                return checked
            return _StepFeed(None, None, state["taken"], checked.samples, reason)
        batch, features, times, samples = checked.items, checked.features, checked.times, checked.samples
        for j, k in enumerate(dp):
            given = heads.given[j]
            if given.any() and not given.all():      # every rank raises: the table's clock must be one
                _fail(where, "the time column %r of stream batch %d" % (self.time_keys[k], state["taken"]),
                      "given on every rank or on none (hash table %r keeps one clock for all ranks)"
                      % self.tables[k].table_name, "given on ranks %s only" % np.flatnonzero(given).tolist())
        unions = dict(zip(dp, ex.share_ids(heads, entries)))
        tables = []
        for k, (table, parts, positions, time_key) in enumerate(zip(self.tables, features, self.positions,
                                                                     self.time_keys)):
            if k in unions:
                tables.append(table.prepare_step(parts, unions[k].time, training, positions, unions[k]))
            else:
                tables.append(table.prepare_step(parts, times.get(time_key), training, positions))
            for p in positions:
                batch[p] = None
        if training:
            self._evict_due(state)
        return _StepFeed(tuple(batch), tables, state["taken"], samples)

    def _evict_due(self, state):
        """Every EvictHook of the run, in callback order, on its own schedule (after a batch's lookups)."""
        for hook in state.get("evict_hooks", ()):
            if not hook.evict_enable:
                continue
            hook_tables = self.tables if hook.tables is None else hook.tables
            for table, due in zip(hook_tables, hook.due(state["taken"], hook_tables)):
                if due:
                    table.evict(table.cache.now)

    def _check_raw(self, raw, state, where, training):
        """The checks of :meth:`prepare`: a _StepFeed for a skipped batch, else a ``_CheckedBatch``;
        only ``state`` changes."""
        items, times, keys = self._batch_items(raw, where)
        id_items = {p for positions in self.positions for p in positions}
        batch = list(_to_numpy_batch(items, where, id_items))
        if id_items and len(batch) <= max(id_items):
            _fail(where, "the batch", "at least %d items (a table reads item %d)" % (max(id_items) + 1, max(id_items)),
                  "%d items" % len(batch))
        if training:       # everything checked before any state (counter, cache) changes
            state["schema"] = _check_batch(batch, state.get("schema"), where, id_items,
                                           self.labelled)
        state["taken"] += 1
        samples = _batch_rows(batch[0])
        if samples == 0:
            return _StepFeed(None, None, state["taken"], 0, "empty")
        if training:
            if self.binary_labels and not np.all((batch[-1] == 0) | (batch[-1] == 1)):
                return _StepFeed(None, None, state["taken"], samples, "bad_label")
            if not all(np.isfinite(a).all() for k, a in enumerate(batch) if k not in id_items and a.dtype.kind == "f"):
                return _StepFeed(None, None, state["taken"], samples, "nonfinite")
        for key, column in list(times.items()):
            if column.ndim and column.shape[0] != samples:
                _fail(where, "the time column %r of stream batch %d" % (key, state["taken"]),
                      "one time per row (%d)" % samples, "%d times" % column.shape[0])
            times[key] = _hash_time(where, key, int(column.max()))        # a row's time, or the latest
        if training:
            for table, key in zip(self.tables, self.time_keys):
                table.store.check_clock(times.get(key), table.cache.now, where,
                                        "stream batch %d's time column %r" % (state["taken"], key))
        checked = {}           # each item's ids checked once, whichever tables read it; all before any cache changes
        for table, positions in zip(self.tables, self.positions):
            for p in positions:
                if p not in checked:
                    item = "batch item %d%s" % (p, "" if keys is None or p >= len(keys) else " %r" % (keys[p],))
                    checked[p] = table.check_features([batch[p]], where, items=[item])[0]
        features = [[checked[p] for p in positions] for positions in self.positions]
        return _CheckedBatch(batch, features, times, samples)

    def _batch_items(self, raw, where):
        """A raw batch -> (its items in the network's input order (label last), {time key: int}, the
        items' keys of a dict batch in that order, or None).

        A dict's time columns (the key "timestamp" and the ``index_key`` of each timestamp
        FeatureSpec) are taken out, as int64 arrays (:func:`_time_column`). A dict is then matched by
        name: the network's ``construct`` parameters in order, then the one key left (the label), if
        any. With FeatureSpec-driven tables every parameter must be a key; otherwise, when some
        parameter is not a key (or ``construct`` takes ``*inputs``), its values are taken in order.
        Before that, the columns "<name>:offsets" and "<name>:weights" join the column "<name>"
        (:func:`_join_feature_columns`: a MindSpore dataset's ragged and weighted features)."""
        if not isinstance(raw, dict):
            return raw, {}, None
        raw, times = dict(raw), {}
        for key in set(self.time_keys) | {"timestamp"}:
            if key in raw:
                times[key] = _time_column(where, key, raw.pop(key))
        names = self.construct_names if self.input_names is None else self.input_names
        id_keys = {names[p] for p in self.row_positions if p < len(names)}
        _join_feature_columns(where, raw, id_keys if len(id_keys) == len(self.row_positions)
                              and all(key in raw for key in id_keys) else None)
        if self.input_names is None:
            names = self.construct_names
            if not names or any(name not in raw for name in names) or \
                    len(raw) - len(names) > (self.labelled):
                return tuple(raw.values()), times, tuple(raw)
            keys = tuple(names) + tuple(k for k in raw if k not in names)
            return tuple(raw[name] for name in keys), times, keys
        missing = [name for name in self.input_names if name not in raw]
        if missing:
            _fail(where, "the keys of a dict batch", "the network's inputs %s (each feature by its "
                  "index_key)" % self.input_names, "no key %r among %s" % (missing[0], sorted(raw)))
        rest = [key for key in raw if key not in self.input_names]
        if len(rest) > (self.labelled):
            _fail(where, "the keys of a dict batch", "the network's inputs %s%s and time columns" % (
                self.input_names, ", the label" if self.labelled else ""), "also %s" % rest)
        return tuple(raw[name] for name in self.input_names + rest), times, tuple(self.input_names + rest)

    def check_rates(self):
        """Training thread, before a step: each table's learning rate for its update checked
        (:meth:`_RowStore.check_rate`), so a rate that cannot train fails the step before its dense
        update, its rows taken, or any table's update."""
        for table in self.tables:
            table.store.check_rate()

    def inputs(self, feed):
        """Training thread: the step's input Tensors, with each table's rows taken and gathered (the
        rows of tables reading one item side by side, in table order: see :func:`_table_layout`)."""
        inputs = list(feed.inputs)
        for table, batch in zip(self.tables, feed.tables):
            table.take(batch)
            rows = table.gather(batch)
            for p, features_rows in zip(batch.positions, rows if isinstance(rows, list) else [rows]):
                inputs[p] = features_rows if inputs[p] is None else np.concatenate([inputs[p], features_rows], -1)
        return tuple(Tensor.from_numpy(np.ascontiguousarray(a)) for a in inputs)

    def row_growth(self):
        """Per :attr:`row_positions` entry, the fields of its rows' bounds the step's check reads (the
        longest ``grows`` of the tables reading it, and all of ``_BOUND_FIELDS``, ``add`` too, when one
        has L2 ``weight_decay``): the train cell's ``row_growth``."""
        growth = dict.fromkeys(self.row_positions, ())
        for table, positions in zip(self.tables, self.positions):
            reads = _BOUND_FIELDS if table.optimizer.weight_decay else table.optimizer.grows
            for p in positions:
                growth[p] = max(growth[p], reads, key=len)
        return tuple(growth.values())

    def row_pooled(self):
        """Per :attr:`row_positions` entry, whether a row of its gradient can reach one table row more
        than once (a table reading it pools bags: it has a combiner, see
        ``_TableBatch.gradient_factor``): the train cell's ``row_pooled``."""
        pooled = dict.fromkeys(self.row_positions, False)
        for table, positions in zip(self.tables, self.positions):
            for p in positions:
                pooled[p] = pooled[p] or table.combiner is not None
        return tuple(pooled.values())

    def row_bounds(self, feed):
        """After :meth:`inputs`: ``(bounds, factors)`` for ``_TrainStep.set_row_bounds``, per
        :attr:`row_positions` entry (the train cell's ``row_inputs``). ``factors``: the largest
        ``gradient_factor`` of the batches of the tables with a combiner reading it, else 1 (float32
        ``[len]``). ``bounds``: the
        growing optimizer slots of the tables ``feed``'s step updates, float32 ``[len, 7]``, or None
        when no table's slots grow: each table's ``HashEmbedding.growth_bound``; tables reading one
        item side by side share its gradient, so their bounds are combined (``_combined_bounds``:
        largest M, L, W, q and add, smallest learning rate and divisor D: ``_update_bound`` then bounds
        each table's update).
        With a row-wise table the bounds are combined over the ranks
        (``_RankExchange.share_row_bounds``: a row's owner updates it with every rank's gradient)."""
        factors = np.ones(len(self.row_positions), np.float32)
        for table, batch in zip(self.tables, feed.tables):
            if table.combiner is not None:              # (else each output row is one id's: 1)
                factor = batch.gradient_factor()
                for p in batch.positions:
                    k = self._row_index[p]
                    factors[k] = max(factors[k], factor)
        growing = [(table, batch) for table, batch in zip(self.tables, feed.tables) if table.optimizer.grows]
        if not growing:
            return None, factors
        bounds = np.tile(np.float32(_NO_GROWTH), (len(self.row_positions), 1))
        given = np.zeros(len(self.row_positions), np.bool_)
        for table, batch in growing:
            bound = np.float32(table.growth_bound())
            for p in batch.positions:
                k = self._row_index[p]
                if given[k]:
                    bounds[k] = _combined_bounds(np.stack([bounds[k], bound]))
                else:
                    bounds[k], given[k] = bound, True
        if self.exchange is not None and any(t.resolved_sharding == "row_wise" for t, _ in growing):
            bounds = self.exchange.share_row_bounds(bounds)
        return bounds, factors

    def apply(self, feed, row_grads):
        """After a step that did not overflow: each table's fused update of the rows of its share of
        ``feed`` with ``row_grads`` (the gradients of the step's ``row_inputs``, Tensors, in
        :attr:`row_positions` order; a table reads its own columns of an item it shares)."""
        grads = {p: g.asnumpy() for p, g in zip(self.row_positions, row_grads)}
        for table, batch in zip(self.tables, feed.tables):
            a = table.column_start          # a table's own columns (all of them when it reads the item alone)
            table.apply_gradients(batch, [grads[p][..., a:a + table.embedding_size] for p in batch.positions])


# =====================================================================================================
# RecModel
# =====================================================================================================
# The model: WideDeep (the bench/demo network), RecModel and what it alone uses. Who owns what:
#   RecModel                           train / online_train / eval / predict / export / checkpoints,
#                                      MindSpore Model's arguments; one training step (_train_step)
#   _RunLoop                           the run loop (as Lightning's Loops): the callbacks' protocol, the
#                                      prefetcher, skipped batches, and between_steps(), the one point
#                                      where checkpoints and exports pause the prefetcher
#   _Overflows                         the steps skipped as not finite, their flags read lazily
#   _Hooks, _Forward, _CallbackParams  the graph hooks, the forward cell, the callbacks' run context
#   _CellRows, _RowGradTap             the hash tables of a user's complete train cell (mindrec's
#                                      TrainStepWrap), trained by its own optimizers' host twins
#   _ModelCheckpointTables             MindSpore ModelCheckpoint's companion table files
# The step's host side is the Step pipeline's, its collectives the Rank exchange's, its files the
# Checkpoints'.


class WideDeep(nn.Cell):
    """Wide&Deep CTR network (Cheng et al., 2016): ``construct(dense, ids) -> logits [B, 1]``.

    One embedding table serves every categorical field: each row holds ``dim`` deep columns and
    one wide column (the per-id linear weight), so a hash table needs one lookup per id.

    Args:
        num_dense (int): dense features per row (13 for Criteo).
        num_fields (int): categorical fields per row (26 for Criteo).
        dim (int): deep embedding size.
        hidden (tuple[int]): MLP sizes (the output layer of size 1 is added).
        vocab_size (int): rows of a plain ``nn.Embedding`` table (``ids`` are then row numbers).
        embedding (Cell): a table to use instead, called as ``embedding(ids) -> [B, F, dim + 1]``
            (e.g. a :class:`HashEmbedding` of size ``dim + 1``).
        deepfm (bool): add the factorisation-machine pair term of DeepFM (Guo et al., 2017).

    A serving bundle of it (:meth:`RecModel.export`) records these settings ("model" is "widedeep" or
    "deepfm"), and :class:`Predictor` refuses a network built with others.
    """

    def __init__(self, num_dense=13, num_fields=26, dim=16, hidden=(400, 400), vocab_size=None,
                 embedding=None, deepfm=False):
        super().__init__()
        where = "WideDeep"
        self.num_dense = _check_int(where, "num_dense", num_dense, minimum=0)
        self.num_fields = _check_int(where, "num_fields", num_fields, minimum=1)
        self.dim = _check_int(where, "dim", dim, minimum=1)
        if (vocab_size is None) == (embedding is None):
            _fail(where, "exactly one of 'vocab_size' and 'embedding'", "given", (vocab_size, embedding))
        if embedding is None:
            embedding = nn.Embedding(_check_int(where, "vocab_size", vocab_size, minimum=1), dim + 1,
                                     embedding_table=ms.common.initializer.Normal(0.01))
        self.embedding = embedding
        self.deepfm = _check_bool(where, "deepfm", deepfm)
        layers, width, sizes = [], num_dense + num_fields * dim, []
        for size in hidden:
            layers += [nn.Dense(width, _check_int(where, "hidden", size, minimum=1)), nn.ReLU()]
            width = size
            sizes.append(int(size))
        layers.append(nn.Dense(width, 1))
        self.mlp = nn.SequentialCell(layers)
        self.wide_dense = nn.Dense(num_dense, 1) if num_dense else None
        # what it was built with, recorded in a serving bundle (RecModel.export) and checked by Predictor:
        # "model" tells Wide&Deep from DeepFM, whose parameters are the same
        self._build_settings = {"model": "deepfm" if self.deepfm else "widedeep", "num_dense": self.num_dense,
                                "num_fields": self.num_fields, "dim": self.dim,
                                "hidden": sizes,
                                "vocab_size": None if vocab_size is None else int(vocab_size)}

    def construct(self, dense, ids):
        emb = self.embedding(ids)                                    # [B, F, dim + 1]
        deep = emb[:, :, :self.dim]
        logit = self.mlp(ops.concat((dense, deep.reshape((deep.shape[0], -1))), 1))
        logit = logit + emb[:, :, self.dim:].sum(1)                 # wide: per-id weights
        if self.wide_dense is not None:
            logit = logit + self.wide_dense(dense)
        if self.deepfm:
            square_of_sum = deep.sum(1) ** 2
            sum_of_square = (deep ** 2).sum(1)
            logit = logit + 0.5 * (square_of_sum - sum_of_square).sum(1, keepdims=True)
        return logit


def _first_difference(a, b, path=""):
    """``(path, a's value, b's value)`` of the first place (keys in order) where the JSON values ``a``
    and ``b`` differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key, "(missing)"), b.get(key, "(missing)"),
                                      "%s.%s" % (path, key) if path else key)
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _reducer_mean(cell):
    """Whether the train cell averages (True) or sums (False) the dense gradients over the devices, as
    its DistributedGradReducer was set up (``nn.TrainOneStepCell``: ``mean``)."""
    mean = getattr(cell, "mean", None)
    if mean is None:
        mean = getattr(getattr(cell, "grad_reducer", None), "mean", None)
    if mean is None:
        mean = ms.get_auto_parallel_context("gradients_mean")
    return bool(mean)


class _Hooks:
    """MindSpore's callback protocol, calling only the hooks each callback really overrides.

    ``phase`` "train" gives ``on_train_begin`` ... ``on_train_end``, "eval" ``on_eval_begin`` ...
    ``on_eval_end``; a callback that overrides only the old name of a stage (``begin``,
    ``epoch_begin``, ``step_begin``, ``step_end``, ``epoch_end``, ``end``) is called too, as
    MindSpore's ``Callback.on_<phase>_<stage>`` calls it in both phases. ``overridden``: the hook
    names some callback overrides."""

    _STAGES = ("begin", "epoch_begin", "step_begin", "step_end", "epoch_end", "end")

    def __init__(self, callbacks, where, phase="train"):
        from mindspore.train.callback import Callback
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        elif not isinstance(callbacks, (list, tuple)) or \
                not all(isinstance(cb, Callback) for cb in callbacks):
            _fail(where, "'callbacks'", "a Callback or a list of Callback", callbacks, TypeError)
        self.callbacks = list(callbacks)
        self.overridden = set()
        for stage in self._STAGES:
            name = "on_%s_%s" % (phase, stage)
            bound = [getattr(cb, name) for cb in self.callbacks
                     if getattr(type(cb), name) is not getattr(Callback, name)
                     or getattr(type(cb), stage) is not getattr(Callback, stage)]
            if bound:
                self.overridden.add(name)
            setattr(self, name, self._caller(bound))

    @staticmethod
    def _caller(bound):
        if not bound:
            return lambda run_context: None

        def call(run_context):
            for hook in bound:
                hook(run_context)
        return call

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for cb in self.callbacks:
            self._stack.enter_context(cb)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


class _Forward(nn.Cell):
    """RecModel's forward cell: the eval network on ready inputs (its own cell, so it can be compiled)."""

    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, *inputs):
        return self.network(*inputs)


def _assign_parameters(pairs):
    """Set each ``(Parameter, numpy value)`` of ``pairs`` in place (``ops.assign``). A cell already
    compiled (GRAPH mode, or ``mindspore.jit`` in PyNative: ``_graph_step``) keeps reading the
    Parameter's own memory, so it sees the new values; ``set_data`` / ``load_param_into_net`` swap
    the memory and a compiled cell would go on with the old values."""
    for param, value in pairs:
        ops.assign(param, Tensor(value))


def _update_metric(where, name, metric, outputs, indexes, source="'eval_network'"):
    """Give ``metric`` the eval network's ``outputs`` as ``mindspore.train.Model`` does: with
    ``indexes`` (loss, prediction, label) a ``Loss`` metric the loss and any other ``(prediction,
    label)``; without, ``update(*outputs)``. Outputs the metric cannot take are a ValueError naming
    ``source`` (the eval network)/``eval_indexes``, the metric, and the outputs' shapes."""
    if indexes is None:
        args, how = outputs, "eval_indexes None: update(*outputs) with every output of 'eval_network'"
    elif isinstance(metric, ms.train.Loss):
        args, how = (outputs[indexes[0]],), "eval_indexes %s: update(output %d)" % (indexes, indexes[0])
    else:
        args, how = (outputs[indexes[1]], outputs[indexes[2]]), \
            "eval_indexes %s: update(output %d, output %d)" % (indexes, indexes[1], indexes[2])
    try:
        metric.update(*args)
    except (TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        shapes = ", ".join("%s %s" % (type(o).__name__, tuple(getattr(o, "shape", ()))) for o in outputs)
        raise ValueError("For '%s', the outputs of %s must be what metric %r (%s) takes (%s), but got "
                         "%d output(s): %s; the metric raised %s: %s" % (
                             where, source, name, type(metric).__name__, how, len(outputs), shapes,
                             type(exc).__name__, exc)) from exc


def _check_no_optimizer(where, amp_level, boost_level, kwargs):
    """``optimizer`` None (``network`` is a complete train cell): ``mindspore.train.Model``'s rules
    (training a network with hash tables needs an optimizer: checked when training starts)."""
    if amp_level != "O0":
        _fail(where, "'amp_level'", "'O0' when 'optimizer' is None (mixed precision casts the network inside "
              "the train cell recboost builds; with 'optimizer' None the network is the train cell)", amp_level)
    if kwargs.get("loss_scale_manager") is not None:
        _fail(where, "'loss_scale_manager'", "None when 'optimizer' is None (the network is then a complete "
              "train cell with its own loss scaling)", kwargs["loss_scale_manager"])
    if boost_level != "O0":
        _log("%s: boost_level %s is not applied: 'optimizer' is None (as in mindspore.train.Model, which "
             "warns 'In boost mode, the optimizer must be defined.')" % (where, boost_level))


def _check_optimizer_scale(where, manager, optimizer, table_boost="O0"):
    """Before anything runs: the optimizer's ``loss_scale`` divides the gradients exactly once, as
    MindSpore's rules have it. A manager with an update cell (dynamic, or fixed with
    ``drop_overflow_update``) unscales the gradients in the train cell, so the optimizer's ``loss_scale``
    must be 1 (else they are divided twice); a fixed manager without one (``drop_overflow_update=False``)
    only scales the loss (``TrainOneStepCell``'s ``sens``), so the optimizer's ``loss_scale`` must be the
    manager's (else they are not unscaled, or divided by something else). A ValueError names both.
    ``table_boost``: the boost level of a network with hash tables ("O0" without), where only a manager
    with an update cell trains at O1/O2."""
    if manager is None or optimizer is None:
        return
    if table_boost != "O0" and manager.get_update_cell() is None:
        _fail(where, "'loss_scale_manager'", "FixedLossScaleManager(%r, drop_overflow_update=True) with the "
              "optimizer's loss_scale 1 at boost_level %s when the network has hash tables" % (
                  manager.get_loss_scale(), table_boost),
              "%s(%r, drop_overflow_update=False)" % (type(manager).__name__, manager.get_loss_scale()))
    scale = float(getattr(optimizer, "loss_scale", 1.0))
    managed = float(manager.get_loss_scale())
    if manager.get_update_cell() is not None:
        if scale != 1.0:
            _fail(where, "the optimizer's 'loss_scale'", "1 with %s(%r) (its train cell unscales the gradients: "
                  "the optimizer would divide them again)" % (type(manager).__name__, managed), scale)
    elif scale != managed:
        _fail(where, "the optimizer's 'loss_scale'", "the loss scale of FixedLossScaleManager(%r, "
              "drop_overflow_update=False), %r (the loss is scaled by it and only the optimizer divides the "
              "gradients by its loss_scale): give the optimizer loss_scale=%r, or use FixedLossScaleManager(%r, "
              "drop_overflow_update=True) with the optimizer's loss_scale 1" % (managed, managed, managed, managed),
              scale)


def _check_sparse_scale(where, network, scale_sense):
    """Before anything runs: a dynamic loss scale cannot train sparse gradients (an
    ``nn.EmbeddingLookup(sparse=True)``, the only kind on CPU): compiled, MindSpore 2.10's graph
    compiler crashes the interpreter on the combination (its conditional scale update with RowTensor
    gradients); op by op, the first step that updates fails in Adam on the gradient's shape. A
    ValueError names the cells and what works instead."""
    if not isinstance(scale_sense, nn.DynamicLossScaleUpdateCell):
        return
    sparse = ["%s (%s)" % (name, type(cell).__name__) for name, cell in network.cells_and_names()
              if type(cell).__module__ == nn.EmbeddingLookup.__module__ and getattr(cell, "sparse", None) is True]
    if sparse:
        _fail(where, "the loss scale", "a fixed one (FixedLossScaleManager, with or without drop_overflow_update) "
              "when the network has sparse gradients (%s): MindSpore 2.10 cannot train them with a dynamic scale "
              "(compiled, its graph compiler crashes; op by op, Adam fails on the gradient's shape); a fixed "
              "scale or recboost's HashEmbedding train" % sparse,
              "a DynamicLossScaleManager (amp levels O2/O3 use one by default)")


def _graph_step(cell):
    """``cell`` with its ``construct`` compiled (``mindspore.jit``) when the context is PyNative.

    Run op by op, MindSpore 2.10's PyNative mode keeps about 13 KB of native memory per train step
    of a plain ``nn.TrainOneStepCell`` (about 23 KB per RecModel step), without bound; the same step
    compiled keeps none. RecModel compiles its own cells (train step, forward) in every mode, so a
    user who does not set GRAPH_MODE gets flat memory too. The user's cells are left as they are."""
    if ms.get_context("mode") == ms.PYNATIVE_MODE:
        cell.construct = ms.jit(cell.construct)
    return cell


class _CallbackParams(dict):
    """What ``run_context.original_args()`` returns while a RecModel trains: a dict whose keys are
    also attributes (``cb_params.cur_step_num``, ``cb_params.net_outputs = ...``).

    MindSpore's callbacks (``LossMonitor``, ``TimeMonitor``, ``ModelCheckpoint``, ``SummaryCollector``,
    ...) only need a dict with attribute access (``RunContext`` itself requires a dict); this class
    stands in for MindSpore's private ``InternalCallbackParam``. A missing key is an AttributeError,
    so ``hasattr``/``getattr(cb_params, name, default)`` work as they do on any object.

    RecModel fills MindSpore's training keys: ``train_network``, ``network``, ``optimizer``,
    ``loss_fn``, ``epoch_num``, ``batch_num`` (steps of a callback epoch), ``cur_epoch_num``,
    ``cur_step_num``, ``dataset_sink_mode``, ``sink_size``, ``train_dataset``,
    ``train_dataset_element`` (the step's input Tensors), ``net_outputs``, ``mode`` ("train"),
    ``list_callback``, ``parallel_mode``, ``device_number``, ``last_save_ckpt_step``,
    ``latest_ckpt_file``; and ``recboost``, the RecModel itself. While it evaluates
    (:meth:`RecModel.eval`) it fills MindSpore's evaluation keys: ``eval_network``, ``network``,
    ``valid_dataset``, ``batch_num``, ``mode`` ("eval"), ``cur_step_num``, ``dataset_sink_mode``,
    ``list_callback``, ``eval_dataset_element``, ``net_outputs``, ``metrics``; and ``recboost``.
    """

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError("the callback parameters have no %r" % key) from None

    def __setattr__(self, key, value):
        self[key] = value

    def __delattr__(self, key):
        try:
            del self[key]
        except KeyError:
            raise AttributeError("the callback parameters have no %r" % key) from None


def _skip_batches(dataset, count):
    """``dataset`` with its first ``count`` batches skipped (used on resume)."""
    if count == 0:
        return dataset
    if hasattr(dataset, "skip_batches"):
        dataset.skip_batches(count)
        return dataset
    if isinstance(dataset, ms.dataset.Dataset):
        return dataset.skip(count)
    iterator = iter(dataset)
    for _ in itertools.islice(iterator, count):
        pass
    return iterator


def _passes(dataset, count, where):
    """The passes over ``dataset`` (``count`` of them; None: without end), each an iterator of its
    batches, made when the pass begins. A MindSpore dataset is read as ``mindspore.train.Model`` reads
    it: by one iterator over all the passes (``num_epochs``), whose pipeline begins a new epoch at each
    pass, so a shuffled dataset is shuffled again (an iterator per pass would repeat the first pass's
    order). A Python iterable is iterated again for each pass."""
    mindspore_data, iterator = isinstance(dataset, ms.dataset.Dataset), None
    for _ in (itertools.count() if count is None else range(count)):
        if not mindspore_data or iterator is None:
            iterator = _batch_iterator(dataset, where, -1 if count is None else count)
        yield iterator


def _repeated_batches(dataset, where):
    """The batches of ``dataset``, pass after pass without end (:func:`_passes`): ``train`` in sink
    mode with ``sink_size`` k > 0 takes k of them per epoch, each epoch going on where the last one
    stopped (MindSpore's sink semantics). A pass that yields no batch is a ValueError (e.g. a
    generator, which one pass uses up), raised where it happens: the steps before it stay trained."""
    for batches in _passes(dataset, None, where):
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            _fail(where, "'train_dataset'", "a dataset that can be iterated again (sink mode with sink_size > 0 "
                  "starts it again at its end)", "a pass without batches")


def _dataset_size(dataset):
    """The number of batches in one pass of ``dataset`` when it is known without iterating a Python
    iterable (a MindSpore dataset's ``get_dataset_size()``, ``len()`` of a sequence), else None."""
    if isinstance(dataset, ms.dataset.Dataset):
        return dataset.get_dataset_size()
    try:
        return len(dataset)
    except TypeError:
        return None


def _make_metrics(metrics, where):
    """Metric names or objects -> dict name -> Metric."""
    from mindspore.train import Metric
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        items = metrics.items()
    elif isinstance(metrics, (set, list, tuple)):
        items = ((m if isinstance(m, str) else type(m).__name__, m) for m in metrics)
    else:
        _fail(where, "'metrics'", "a dict or a set of metric names or Metric objects", metrics, TypeError)
    known = {"auc": AUC, "log_loss": LogLoss, "accuracy": Accuracy}
    out = {}
    for name, metric in sorted(items, key=lambda kv: str(kv[0])):
        if isinstance(metric, str):
            _check_one_of(where, "metric name", metric, sorted(known))
            metric = known[metric]()
        if not isinstance(metric, Metric):
            _fail(where, "metric %r" % name, "a mindspore.train.Metric", metric, TypeError)
        out[name] = metric
    return out


class _RowGradTap(nn.Cell):
    """A train cell's optimizer with hash-table stand-ins among its parameters (see :class:`_CellRows`): it
    copies the stand-ins' gradients (the tables' rows' gradients, as the cell computed them: loss scale
    included) into ``buffers`` and runs ``optimizer`` with zeros in their place (the stand-ins stay zeros;
    every other parameter gets exactly what the cell gave)."""

    def __init__(self, optimizer, slots, buffers):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.slots = tuple(slots)
        self.buffers = ms.ParameterTuple(buffers)
        self.count = len(optimizer.parameters)

    def construct(self, gradients):
        for j in range(len(self.slots)):
            ops.assign(self.buffers[j], gradients[self.slots[j]])
        kept = ()
        for i in range(self.count):
            if i in self.slots:
                kept = kept + (ops.zeros_like(gradients[i]),)
            else:
                kept = kept + (gradients[i],)
        return self.optimizer(kept)


def _optimizer_state_tuples(optimizer):
    """The per-parameter state of a MindSpore optimizer: its ParameterTuples as long as its parameter list
    (moments, accumulators), by attribute name."""
    weights = {id(p) for p in optimizer.parameters}
    return {name: value for name, value in vars(optimizer).items()
            if name not in ("parameters", "_parameters") and isinstance(value, ms.ParameterTuple)
            and len(value) == len(optimizer.parameters) and not any(id(p) in weights for p in value)}


def _sparse_optimizer_like(optimizer, slot, where, table):
    """The sparse table optimizer that trains rows as ``optimizer`` (a MindSpore optimizer) trains its
    parameter ``slot``: FTRL -> :class:`SparseFtrl`, LazyAdam or Adam(use_lazy=True) -> :class:`SparseAdam`
    (lazy: the touched rows), SGD without momentum -> :class:`SparseSGD`, Adagrad -> :class:`SparseAdagrad`,
    with its hyper-parameters, its learning rate in any of MindSpore's forms (a schedule, or a per-step
    Tensor or list: the table's step follows the optimizer's ``global_step``) and its weight decay, the
    optimizer's or the parameter's group's (``_dropin_weight_decay``); anything else (a learning rate per
    group, grad centralization, a decay that cannot be mapped, another class) is a ValueError naming the table
    and what to change."""
    name = type(optimizer).__name__
    what = "the optimizer of hash table %r's stand-in in the train cell (%s)" % (table.table_name, name)

    def scalar(value):
        return float((value.asnumpy() if isinstance(value, Tensor) else np.asarray(value)).reshape(-1)[0])

    def refuse(expected, got):
        _fail(where, what, expected + "; or give RecModel the loss network and a dense optimizer, the table "
              "its own sparse optimizer (HashEmbeddingLookup(..., optimizer=SparseFtrl(...)))", got)
    if optimizer.is_group_lr:
        refuse("one without a learning rate per parameter group", "parameter groups with 'lr'")
    if optimizer.is_group and optimizer.grad_centralization_flags[slot]:
        refuse("one without grad_centralization in the table's parameter group", "grad_centralization=True")
    decay = _dropin_weight_decay(optimizer, slot, table, refuse)
    lr = optimizer.learning_rate
    if not optimizer.dynamic_lr:
        lr = scalar(lr)
    elif isinstance(lr, _IteratorLearningRate):         # a per-step Tensor or list: its values
        lr = lr.learning_rate.asnumpy()
    state = {key: scalar(value[slot]) for key, value in _optimizer_state_tuples(optimizer).items()}
    if type(optimizer) is nn.FTRL:
        return SparseFtrl(float(optimizer.lr), state["moments"], float(optimizer.lr_power), float(optimizer.l1),
                          float(optimizer.l2), weight_decay=decay)
    lazy = type(optimizer) is nn.Adam and optimizer.use_lazy and not optimizer.use_amsgrad
    if type(optimizer) is nn.LazyAdam or lazy:          # nn.Adam(use_lazy=True): the same FusedSparseLazyAdam
        if optimizer.use_nesterov:
            refuse("LazyAdam without use_nesterov", "use_nesterov=True")
        return SparseAdam(lr, scalar(optimizer.beta1), scalar(optimizer.beta2), scalar(optimizer.eps),
                          weight_decay=decay)
    if type(optimizer) is nn.SGD:
        if scalar(optimizer.momentum) != 0 or optimizer.nesterov:
            refuse("SGD without momentum", "momentum %s" % scalar(optimizer.momentum))
        return SparseSGD(lr, weight_decay=decay)
    if type(optimizer) is nn.Adagrad:
        return SparseAdagrad(lr, state["accum"], weight_decay=decay)
    return refuse("FTRL, LazyAdam, SGD or Adagrad (the ones a table's rows train with on the host: Adam moves "
                  "every row each step, LazyAdam or Adam(use_lazy=True) only the batch's)", name)


def _dropin_weight_decay(optimizer, slot, table, refuse):
    """The L2 ``weight_decay`` of the sparse optimizer that trains rows as ``optimizer`` trains its parameter
    ``slot`` (``_sparse_optimizer_like``), 0.0 for none. MindSpore's ``decay_weight`` adds ``gather(w, ids) *
    wd`` to a sparse gradient's values before ``scale_grad`` multiplies them by ``1 / loss_scale``, with ``wd``
    the optimizer's (or the parameter's group's) float32 ``weight_decay * loss_scale``, for a parameter its
    ``decay_flags`` mark (no 'beta' or 'gamma' in its name; a group's decay > 0). A ``HashEmbeddingLookup``
    with ``sparse=True`` hands it the batch's distinct ids (mindspore_rec's unique lookup), so each touched
    row gets ``(g*ls + w*(wd*ls)) / ls`` once: with a power-of-two loss scale that is ``g + wd*w`` in float32
    bit for bit, the table's L2 decay. Refused, naming them: a weight decay Cell (a schedule of the decay),
    a ``sparse=False`` table (MindSpore decays each occurrence of an id) and a loss scale not a power of two."""
    flagged = optimizer.exec_weight_decay and optimizer.decay_flags[slot]
    decay = optimizer.weight_decay[slot] if optimizer.is_group else optimizer.weight_decay
    if not flagged:
        return 0.0
    if not isinstance(decay, Tensor):
        refuse("one whose weight_decay is a float (a weight decay Cell is not mapped onto a table)",
               "weight_decay %s" % type(getattr(decay, "weight_decay", decay)).__name__)
    scaled, scale = float(decay.asnumpy().reshape(-1)[0]), float(optimizer.loss_scale)
    if scaled and not table.sparse:
        refuse("one without weight_decay for a table with sparse=False (MindSpore decays each occurrence of an id)",
               "weight_decay %r" % (scaled / scale))
    if scaled and np.frexp(scale)[0] != 0.5:
        refuse("one with a loss_scale that is a power of two when it has a weight_decay (so that the decay "
               "unscaled is the table's in float32)", "loss_scale %r" % scale)
    return scaled / scale


class _CellRows:
    """The hash tables of a complete train cell (``RecModel(train_cell)``, ``optimizer`` None), trained
    as mindspore_rec trains them under ``mindspore.train.Model``: by the cell's own optimizers, from the
    gradients the cell computes.

    In mindspore_rec a ``HashEmbeddingLookup``'s table is a parameter (``embedding_table``): the cell
    puts it in one of its optimizers (mindrec's ``TrainStepWrap``: the names with "wide" in FTRL, the rest
    in LazyAdam) and takes its gradient with that optimizer's weights, from that loss, with that loss
    scale. Here ``embedding_table`` is a zero stand-in the cell handles the same way. Before the first
    step (:meth:`ready`) each stand-in gets a row per position of its table's input, and the rows the
    table hands the network get the stand-in's rows added (zeros: values unchanged), so the cell's
    gradient of the stand-in is the rows' gradient, from the loss and with the weights the cell pairs it
    with. The optimizer holding it is wrapped (:class:`_RowGradTap`) to keep that gradient and give the
    optimizer zeros in its place; after the step (:meth:`apply`) the table applies it, divided by the
    optimizer's loss scale as the optimizer would, with the sparse optimizer that does what the cell's
    optimizer does (:func:`_sparse_optimizer_like`). Every dense parameter gets exactly what the cell gives
    it. Refused (a ValueError naming the table and what to change): a table that is not a
    ``HashEmbeddingLookup`` or reads more than one batch item, a stand-in in no optimizer of the cell or in
    several, an optimizer with no host twin, ranks (a data-parallel context). A model resumes
    (:meth:`RecModel.load_checkpoint` builds this before reading the tables' state); checkpoints leave out
    what only stands in for the tables (:meth:`derived`). Wrapping an optimizer keeps every parameter's name."""

    def __init__(self, cell, tables, positions, where, step):
        self.tables, self.positions, self.where = list(tables), [tuple(p) for p in positions], where
        if step != 0:
            _fail(where, "the RecModel", "at step 0 when it first trains a complete train cell with hash tables "
                  "(a resumed model: not supported yet)", "step %d" % step)
        for table, pos in zip(self.tables, self.positions):
            if not isinstance(table, HashEmbeddingLookup) or len(pos) != 1:
                _fail(where, "hash table %r of the train cell" % table.table_name, "a HashEmbeddingLookup reading "
                      "one batch item (mindspore_rec's table, whose embedding_table the cell's optimizers train) "
                      "when 'optimizer' is None; else give RecModel the loss network and a dense optimizer",
                      type(table).__name__)
        self.taps = []           # (parent cell, attribute, optimizer, [(slot, table index)])
        found = {}
        seen = set()
        for _, parent in cell.cells_and_names():
            for attr, child in parent.name_cells().items():
                if not isinstance(child, nn.Optimizer) or id(child) in seen:
                    continue
                if isinstance(parent, _RowGradTap):
                    _fail(where, "'network'", "a train cell no other RecModel trains (its optimizers are wrapped "
                          "by the first: train it with that RecModel, or build a new train cell)", type(cell).__name__)
                seen.add(id(child))
                slots = [(i, k) for i, p in enumerate(child.parameters) for k, t in enumerate(self.tables)
                         if p is t.embedding_table]
                for _, k in slots:
                    found.setdefault(k, []).append("%s.%s (%s)" % (type(parent).__name__, attr, type(child).__name__))
                if slots:
                    self.taps.append((parent, attr, child, slots))
        for k, table in enumerate(self.tables):
            if len(found.get(k, ())) != 1:
                _fail(where, "the optimizers of the train cell holding the embedding_table of hash table %r"
                      % table.table_name, "exactly one (the optimizer that trains the table's rows, as in "
                      "mindspore_rec; or give RecModel the loss network and a dense optimizer)", found.get(k, []))
        self.optimizers, self.scales = [None] * len(self.tables), [None] * len(self.tables)
        for _, _, opt, slots in self.taps:
            for slot, k in slots:
                self.optimizers[k] = _sparse_optimizer_like(opt, slot, where, self.tables[k])
                self.scales[k] = np.float32(1.0 / float(opt.loss_scale))      # MindSpore's reciprocal_scale
        for table, sparse in zip(self.tables, self.optimizers):    # untrained: fresh slots of the sparse twin
            table.store.use_optimizer(sparse)                      # (before the prefetch thread maps any id)
        self.buffers = [None] * len(self.tables)
        self.positions_per_table = None

    def ready(self, inputs):
        """Before each step: on the first, size the stand-ins, their optimizer states and the gradient
        buffers to the positions of each table's input and wrap the optimizers; after it, check a batch's
        positions fit."""
        counts = [int(np.prod(inputs[pos[0]].shape[:-1])) for pos in self.positions]
        for table in self.tables:
            if not table.training:          # an evaluation in between (op by op the flag is read every step)
                table.set_train(True)
        if self.positions_per_table is not None:
            for table, n, most in zip(self.tables, counts, self.positions_per_table):
                if n > most:
                    _fail(self.where, "the ids of hash table %r in a batch" % table.table_name, "at most %d (the first "
                          "batch's: the train cell's stand-in of the table was sized by it)" % most, n)
            return
        for table, n in zip(self.tables, counts):
            table.embedding_table.set_data(Tensor(np.zeros((n, table.embedding_size), np.float32)))
            table.rows_stand_in = True
        for parent, attr, opt, slots in self.taps:
            for state in _optimizer_state_tuples(opt).values():
                for slot, k in slots:
                    fill = state[slot].asnumpy().reshape(-1)[0]
                    state[slot].set_data(Tensor(np.full(self.tables[k].embedding_table.shape, fill, np.float32)))
            names = [(p, p.name) for p in parent.get_parameters()]
            buffers = []
            for slot, k in slots:
                self.buffers[k] = Parameter(Tensor(np.zeros(self.tables[k].embedding_table.shape, np.float32)),
                                            name="recboost_rows_gradient.%d" % k, requires_grad=False)
                buffers.append(self.buffers[k])
            setattr(parent, attr, _RowGradTap(opt, [slot for slot, _ in slots], buffers))
            for param, name in names:         # MindSpore's setattr prefixes them with ``attr``: the cell's names kept
                param.name = name
        self.positions_per_table = counts

    @staticmethod
    def derived(cell, tables):
        """The ids of the Parameters of ``cell`` that only stand in for its hash tables ``tables``: each
        table's ``embedding_table`` (zeros), the optimizers' states of it (unchanged: their gradient is zeros)
        and the gradient buffers (:class:`_RowGradTap`). Checkpoints leave them out: they are sized by the
        first batch, and rebuilt as they were by the first step after a resume."""
        stand_ins = {id(t.embedding_table) for t in tables if isinstance(t, HashEmbeddingLookup)}
        out = set(stand_ins)
        for _, child in cell.cells_and_names():
            if isinstance(child, _RowGradTap):
                out.update(id(p) for p in child.buffers)
            elif isinstance(child, nn.Optimizer):
                slots = [i for i, p in enumerate(child.parameters) if id(p) in stand_ins]
                for state in _optimizer_state_tuples(child).values():
                    out.update(id(state[i]) for i in slots)
        return out

    def apply(self, feed):
        """After a step: each table's sparse update of its rows in ``feed`` with the gradient the cell
        computed (unscaled as its optimizer unscales it)."""
        for table, batch, buffer, scale in zip(self.tables, feed.tables, self.buffers, self.scales):
            grad = buffer.asnumpy()[:batch.outputs] * scale
            table.apply_gradients(batch, grad)


def _resume_path(where, path):
    """The recboost checkpoint to load for ``path``: the companion (:func:`_companion_checkpoint`) of a
    ModelCheckpoint file (``.ckpt``/``.safetensors``), which must exist (a ValueError naming both files
    otherwise); any other path as it is."""
    if isinstance(path, (str, os.PathLike)) and os.path.splitext(os.fspath(path))[1] in (".ckpt", ".safetensors"):
        path = os.fspath(path)
        if not os.path.isfile(path):
            _fail(where, "'path'", "an existing checkpoint file", path)
        companion = _companion_checkpoint(path)
        if not os.path.isfile(companion):
            _fail(where, "the companion of the ModelCheckpoint file %r ('path')" % path, "the file %r, holding the "
                  "hash tables and the rest of the training state (RecModel writes it beside each .ckpt)"
                  % companion, "no such file")
        return companion
    return path


def _companion_checkpoint(ckpt):
    """The recboost checkpoint written beside a ModelCheckpoint's ``ckpt`` file under a RecModel with hash
    tables: ``<dir>/<name>.recboost.npz`` for ``<dir>/<name>.ckpt``."""
    return os.path.splitext(ckpt)[0] + ".recboost.npz"


class _ModelCheckpointTables(_Callback):
    """Runs right after a MindSpore ``ModelCheckpoint`` (``checkpoint``) under a RecModel (``model``) with hash
    tables: whenever it has saved a ``.ckpt`` (of the dense part, as under ``Model``), the model's complete
    state, tables included, is saved beside it by :meth:`RecModel.save_checkpoint`
    (:func:`_companion_checkpoint`, atomic), and the companions whose ``.ckpt`` ModelCheckpoint removed
    (``keep_checkpoint_max``, ``keep_checkpoint_per_n_minutes``) are removed with them.
    :meth:`RecModel.load_checkpoint` of the ``.ckpt`` resumes from the pair."""

    def __init__(self, checkpoint, model):
        super().__init__()
        self.checkpoint, self.model = checkpoint, model
        self.seen = self._saved()

    def _saved(self):
        """ModelCheckpoint's latest save: (file, step it was taken at)."""
        return self.checkpoint.latest_ckpt_file_name, getattr(self.checkpoint, "_last_triggered_step", None)

    def _after(self):
        now = self._saved()
        if now == self.seen or not now[0]:
            return
        self.seen = now
        ckpt = os.path.abspath(now[0])
        self.model.save_checkpoint(_companion_checkpoint(ckpt))
        directory, prefix = os.path.dirname(ckpt), getattr(self.checkpoint, "_prefix", None)
        for name in os.listdir(directory):                     # companions of removed .ckpt files
            stem = name[:-len(".recboost.npz")]
            if name.endswith(".recboost.npz") and prefix is not None and stem.startswith(prefix + "-") \
                    and os.path.join(directory, name) != _companion_checkpoint(ckpt) \
                    and not any(os.path.exists(os.path.join(directory, stem + ext))
                                for ext in (".ckpt", ".safetensors")):
                os.remove(os.path.join(directory, name))

    def on_train_begin(self, run_context):
        """Refuses ranks: each rank's ModelCheckpoint has a directory of its own, but a checkpoint of
        tables across ranks is written by all of them to one path (:class:`OnlineCheckpoint`)."""
        if self.model.exchange_stats() is not None:
            _fail("RecModel", "MindSpore's ModelCheckpoint with hash tables", "used in one process (across "
                  "ranks, checkpoint the tables with rb.OnlineCheckpoint, whose path every rank shares)",
                  "a run of %d ranks" % self.model.exchange_stats()["world"])

    def on_train_step_end(self, run_context):
        self._after()

    def on_train_end(self, run_context):
        self._after()


class _Overflows:
    """The steps skipped because their update was not finite (``RecModel.overflow_steps``: ``count``),
    their flags read lazily (``pending``: (overflow flag, scale, stream batch) of the steps not read
    yet), so plain networks never wait for the device between steps; and ``run``, the skipped steps
    in a row (count, first batch, last batch). ``manager()``: the train cell's loss-scale update cell
    (None without); ``limit``: the skipped steps in a row that stop training."""

    def __init__(self, manager, limit):
        self.manager, self.limit = manager, limit
        self.reset(0)

    def reset(self, count):
        """Start again at ``count`` skipped steps, none pending, no run."""
        self.pending, self.run, self.count = [], (0, 0, 0), int(count)

    def read(self):
        """Count the ``pending`` steps (in step order) that were skipped, and the run of them the loss
        scale could not absorb: a skipped step at a dynamic loss scale still above 1 is the scale's own
        search (the scale drops and the step is retried on the next batch) and ends a run; any other
        skipped step extends it, and a step that is not skipped ends it."""
        pending, self.pending = self.pending, []
        dynamic = isinstance(self.manager(), nn.DynamicLossScaleUpdateCell)
        count, first, last = self.run
        for flag, scale, taken in pending:
            if not bool(flag.asnumpy()):
                count = 0
                continue
            self.count += 1
            if dynamic and float(np.max(scale.asnumpy())) > 1.0:
                count = 0
                continue
            count, first, last = count + 1, (first if count else taken), taken
        self.run = (count, first, last)

    def check_run(self, where):
        """After a step: a RuntimeError naming the stream batches when ``limit`` steps in a row were
        skipped. A plain network's flags are read when the run could have reached it (every ``limit``
        steps, and every step of a run already read). The skipped steps changed nothing: the model is
        as it was before the run."""
        if self.run[0] + len(self.pending) >= self.limit:
            self.read()
        count, first, last = self.run
        if count >= self.limit:
            self.run = (0, 0, 0)
            _fail(where, "the update of at least one of %d steps in a row" % self.limit,
                  "finite (each step whose gradient holds an Inf or a NaN, or is large enough (a sum of "
                  "absolute values above 1.8e19) to put one into a parameter, an optimizer state or a table "
                  "row, is skipped and changes nothing; so many in a row mean broken input or settings, such "
                  "as features of huge magnitude or a learning rate far too high)",
                  "%d skipped steps in a row, on stream batches %d to %d (the model is as it was before "
                  "stream batch %d)" % (count, first, last, first), _TrainingStopped)


class _RunLoop:
    """The run loop of :meth:`RecModel.train` and :meth:`RecModel.online_train`, as Lightning's Loops
    are the Trainer's: the callbacks' protocol around the steps, the prefetcher that prepares the
    batches ahead (``_Prefetcher``, or ``_SyncFeeder`` when the tables span ranks), the batches skipped
    before their step, and :meth:`between_steps`, the one point where a checkpoint or an export pauses
    the prefetcher. It owns the run's host state: the ``prefetcher`` of the running epoch, the prepared
    batches a stopped or failed run left (``unconsumed``, trained first by the next run), the stream
    state the pipeline's prepare keeps (``feed_state``) and ``stream_start``.

    Its collaborators, given at construction: ``model`` (the RecModel: its public counters and
    networks, the callbacks' ``cb_params.recboost``), ``pipeline()`` (the model's ``_StepPipeline``),
    ``step(feed, begin)`` (one training step on a prepared feed: ``begin(inputs)`` runs the callbacks'
    step begin; returns the callbacks' ``net_outputs``), ``after_step(where)`` (the model's checks
    after a step's counters moved) and ``depth`` (the prepared batches the prefetcher keeps ahead)."""

    def __init__(self, model, pipeline, step, after_step, depth):
        self.model, self.pipeline, self.step, self.after_step = model, pipeline, step, after_step
        self.depth = depth
        self.prefetcher = None              # the running epoch's, else None
        self.unconsumed = []                # prepared batches a failed or stopped step left
        self.feed_state = {"taken": 0, "evict_hooks": []}     # raw batches taken, the run's EvictHooks
        self.stream_start = 0               # batches consumed before this call's stream began

    @contextlib.contextmanager
    def between_steps(self):
        """The one point between steps where a checkpoint or an export sees the model whole: the
        prefetcher (while a run runs) paused, resumed after; yields the prepared batches not trained
        yet, in stream order (the prefetcher's, or those a stopped or failed run left)."""
        prefetcher = self.prefetcher
        pending = prefetcher.pause() if prefetcher is not None else list(self.unconsumed)
        try:
            yield pending
        finally:
            if prefetcher is not None:
                prefetcher.resume()

    def callbacks(self, callbacks, where):
        """``callbacks`` checked: (_Hooks of every callback but the EvictHooks, [EvictHook, ...]).

        RecModel applies the EvictHooks itself, in stream order (``_StepPipeline.prepare``); their ``tables``
        must be hash tables of this network."""
        tables = self.model.tables
        callbacks = _callback_list(callbacks)
        if tables:            # each ModelCheckpoint's .ckpt gets its companion with the tables, right after it
            callbacks = [c for cb in callbacks for c in ((cb, _ModelCheckpointTables(cb, self.model))
                                                        if isinstance(cb, ms.train.ModelCheckpoint) else (cb,))]
        evict_hooks = [cb for cb in callbacks if _is_evict_hook(cb)]
        hooks = _Hooks([cb for cb in callbacks if not _is_evict_hook(cb)], where)
        for k, hook in enumerate(evict_hooks):
            for table in hook.tables or ():
                if not any(table is mine for mine in tables):
                    _fail(where, "the 'tables' of EvictHook %d of 'callbacks'" % k, "hash tables of the network "
                          "%s" % [mine.table_name for mine in tables], table.table_name)
        return hooks, evict_hooks

    def fit(self, epochs, hooks, evict_hooks, where, replay, epoch_steps=None, stream_skip=0, **cb_values):
        """Train over ``epochs`` (iterators of raw batches) with the callback protocol, the batches
        ``replay`` first (after those a run left unconsumed).

        ``epoch_steps``: the steps of each callback epoch within one iterator (None: each iterator
        is one epoch). ``stream_skip``: the batches of the stream skipped on resume (the stream
        began that many batches before the checkpoint's position). ``cb_values``: the callback
        parameters that depend on the call (``train_network`` and ``optimizer``, then
        ``train_dataset``, ``dataset_sink_mode``, ``sink_size``, ``batch_num`` (None: unknown),
        ``epoch_num``)."""
        from mindspore.train.callback import RunContext
        model = self.model
        replay = self.unconsumed = list(self.unconsumed) + list(replay)   # kept until a prefetcher has them
        state = self.feed_state
        state.update(taken=replay[-1].taken if replay else model.batches_consumed, evict_hooks=evict_hooks)
        self.stream_start = state["taken"] - stream_skip
        cb_params = _CallbackParams(
            train_network=cb_values.pop("train_network"), network=model.network,
            optimizer=cb_values.pop("optimizer"), loss_fn=model.loss_fn,
            epoch_num=sys.maxsize, cur_epoch_num=0, cur_step_num=model.step, mode="train",
            list_callback=hooks.callbacks, net_outputs=None, train_dataset_element=None,
            parallel_mode=ms.get_auto_parallel_context("parallel_mode"),
            device_number=ms.get_auto_parallel_context("device_num"),
            last_save_ckpt_step=None, latest_ckpt_file=None, recboost=model)
        cb_params.update(cb_values)
        cb_params.batch_num = cb_params.get("batch_num") or 1       # LossMonitor/ModelCheckpoint divide by it
        run_context = RunContext(cb_params)
        with hooks:
            hooks.on_train_begin(run_context)
            stopped = False
            for iterator in epochs:
                stopped = self._run_epoch(iterator, state, hooks, run_context, epoch_steps, where, replay)
                replay = []
                if epoch_steps is None:
                    hooks.on_train_epoch_end(run_context)
                if stopped:
                    break
            hooks.on_train_end(run_context)

    def _skip(self, feed):
        """Count a batch skipped before the step; the first few of each kind are logged."""
        model = self.model
        model.skipped_batches[feed.skip] += 1
        model.batches_consumed = feed.taken
        if model.skipped_batches[feed.skip] <= 3:
            _log("skipped stream batch %d (%s); %d such batches so far" % (
                feed.taken, {"empty": "no rows", "bad_label": "a label other than 0 or 1",
                             "nonfinite": "a NaN or Inf feature or label"}[feed.skip],
                model.skipped_batches[feed.skip]))

    def _run_epoch(self, iterator, state, hooks, run_context, epoch_steps, where, replay):
        """Train on the batches of ``iterator`` (after ``replay``); True when a callback asked to stop.
        With ``epoch_steps`` a callback epoch begins at the first step of each ``epoch_steps``; without,
        the iterator is one epoch, begun here (ended by the caller)."""
        cb_params = run_context.original_args()
        if epoch_steps is None:
            cb_params.cur_epoch_num += 1
            hooks.on_train_epoch_begin(run_context)
        pipeline = self.pipeline()
        if pipeline.exchange is not None:        # the id exchange's collectives: on this thread, in step order
            prefetcher = _SyncFeeder(iterator, lambda raw: pipeline.prepare(raw, state, where), replay)
        else:
            prefetcher = _Prefetcher(iterator, lambda raw: pipeline.prepare(raw, state, where), self.depth,
                                     replay)
        self.prefetcher, self.unconsumed = prefetcher, []

        def begin(inputs):
            cb_params.train_dataset_element = inputs
            hooks.on_train_step_begin(run_context)
        in_epoch, feed, done = 0, None, True
        try:
            for feed in prefetcher:
                done = False
                if feed.inputs is None:
                    self._skip(feed)
                    continue
                if in_epoch == 0 and epoch_steps is not None:
                    cb_params.cur_epoch_num += 1
                    hooks.on_train_epoch_begin(run_context)
                cb_params.train_network = self.model.train_network
                net_outputs = self.step(feed, begin)
                cb_params.cur_step_num = self.model.step
                cb_params.net_outputs = net_outputs
                done = True
                self.after_step(where)
                in_epoch += 1
                with prefetcher.held():        # the step's callbacks (checkpoints, exports) see one point
                    hooks.on_train_step_end(run_context)
                    if in_epoch == epoch_steps:
                        hooks.on_train_epoch_end(run_context)
                        in_epoch = 0
                if run_context.get_stop_requested():
                    self.unconsumed = prefetcher.pause()      # prepared, not trained: kept for later
                    return True
        except BaseException:
            # The prefetcher stops at a failure of its own (a bad batch changes nothing). After a
            # failed step, the batches it had prepared (their ids already counted) are kept, with
            # the failed one, and trained first by the next train call, as a resume would.
            self.unconsumed = ([] if done or feed is None or feed.inputs is None else [feed]) + \
                prefetcher.pause()
            if self.model.step == 0:               # no step ran: the first batch's schema is unproven
                state.pop("schema", None)
            raise
        finally:
            self.prefetcher = None
            prefetcher.close()
        return False


class RecModel:
    """High-level training for recommendation models (``mindspore_rec.RecModel`` API), CPU first.

    Args:
        network (Cell): the network; with ``loss_fn`` None it must compute the loss itself.
        loss_fn (Cell): the loss; batches are then ``(*inputs, label)``.
        optimizer (Cell): the optimizer of the dense parameters (hash tables carry their own sparse
            optimizers). None, as in ``mindspore.train.Model``: ``network`` is a complete train cell
            (e.g. a ``TrainOneStepCell`` subclass with its own optimizers and loss scale), called on
            each batch as it is, its outputs passed to the callbacks as ``net_outputs``; with
            ``loss_fn`` it is wrapped in ``nn.WithLossCell`` (which computes the loss and trains
            nothing, as Model does). amp levels and a ``loss_scale_manager`` then raise a ValueError
            and boost levels are ignored with a warning (Model's rules). Its hash tables train as the
            cell says when they are ``HashEmbeddingLookup`` tables whose ``embedding_table`` the cell puts
            in one of its optimizers (mindrec's ``TrainStepWrap``: see ``_CellRows``); other hash tables
            raise a ValueError naming what to change.
        metrics (Union[dict, set]): metric names ("auc", "log_loss", "accuracy") or Metric objects
            for :meth:`eval`.
        eval_network (Cell): the network for :meth:`eval`, called on whole batches (label included),
            as ``mindspore.train.Model`` calls it. Without one, :meth:`eval` runs ``network`` on the
            inputs and gives recboost's metrics ``(output, label)`` (``sigmoid(output)`` with
            ``BCEWithLogitsLoss``) and other metrics what Model's ``WithEvalCell`` gives them (see
            :meth:`eval`). :meth:`predict` always runs ``network``, as Model's does.
        eval_indexes (list): MindSpore's meaning: with ``eval_network``, the positions of the loss, the
            prediction and the label in the eval network's outputs: a ``mindspore.train.Loss``
            metric gets the loss and every other metric ``(prediction, label)``, as the eval network
            returns them. None (default) with ``eval_network``: every metric gets
            ``update(*outputs)``, MindSpore's Metric protocol. Three ints >= 0; set without
            ``eval_network`` it is a ValueError.
        amp_level (str): "O0", "O2", "O3" or "auto" (see :func:`build_train_network`).
        boost_level (str): "O0", "O1" or "O2" (see :class:`AutoBoost`).
        **kwargs: ``loss_scale_manager``, ``boost_config_dict``, ``keep_batchnorm_fp32``; anything
            else is a TypeError naming it.

    Batches are tuples of arrays (numpy or Tensor), or dicts whose values are taken in order; a
    dict key ``"timestamp"`` (a scalar data time) is taken out and used by hash tables. Hash tables
    (:class:`HashEmbedding`) in the network are driven for the user: their ids (the batch item at
    the table's ``input_index``) are translated on the host in a background thread, a bounded
    prefetch ahead of the device step; when a table is data-parallel (``HashEmbedding(sharding=...)``,
    the default under a data-parallel context of more than one device) or row-wise, the ranks exchange
    their ids each step instead, on the training thread: every rank's data-parallel tables stay
    identical, and each rank's row-wise shard holds the ids it owns.

    Every training batch is checked on the prefetch thread before it changes anything: against the
    first batch's schema (number of items; per item the shape after the batch dimension and the
    dtype, any integer dtype for hash ids), a TypeError/ValueError naming the item otherwise. Batches
    with no rows, a label other than 0/1 (binary cross-entropy) or a NaN/Inf float feature or label
    are skipped before their ids reach a table and counted in ``skipped_batches``. Steps whose
    update is not finite (an overflow: a gradient holds an Inf or a NaN, or is so large that the
    update could put one into a parameter, an optimizer state or a table row, e.g. from features of
    magnitude 1e30) are skipped, leaving every parameter, optimizer state and table row untouched,
    and counted in ``overflow_steps``; 100 such steps in a row (at a loss scale that cannot drop
    further) stop training with a RuntimeError naming their stream batches. When a step fails, the
    batches already prepared after it are kept and trained first by the next
    ``train``/``online_train`` call (their ids were counted).
    In PyNative mode the step cells are compiled (``mindspore.jit``): memory stays flat.
    """

    _KWARGS = ("loss_scale_manager", "boost_config_dict", "keep_batchnorm_fp32")

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None, eval_network=None,
                 eval_indexes=None, amp_level="O0", boost_level="O0", **kwargs):
        where = "RecModel"
        _check_no_kwargs(where, kwargs, self._KWARGS)
        if not isinstance(network, nn.Cell):
            _fail(where, "'network'", "a Cell", type(network).__name__, TypeError)
        if loss_fn is not None and not isinstance(loss_fn, nn.Cell):
            _fail(where, "'loss_fn'", "a Cell or None", type(loss_fn).__name__, TypeError)
        if optimizer is not None and not isinstance(optimizer, nn.Cell):
            _fail(where, "'optimizer'", "an optimizer Cell or None", type(optimizer).__name__, TypeError)
        if eval_indexes is not None:
            if not isinstance(eval_indexes, (list, tuple)) or len(eval_indexes) != 3 or not all(
                    isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) and i >= 0
                    for i in eval_indexes):
                _fail(where, "'eval_indexes'", "None or a list of three ints >= 0 (the positions of loss, "
                      "prediction and label in the eval network's outputs)", eval_indexes)
            if eval_network is None:
                _fail(where, "'eval_indexes'", "None when 'eval_network' is None (they are positions in "
                      "the eval network's outputs)", eval_indexes)
            eval_indexes = [int(i) for i in eval_indexes]
        if eval_network is not None and not isinstance(eval_network, nn.Cell):
            _fail(where, "'eval_network'", "a Cell or None", type(eval_network).__name__, TypeError)
        _check_one_of(where, "boost_level", boost_level, ("O0", "O1", "O2"))
        self._network = network
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._eval_network = eval_network
        self._eval_indexes = eval_indexes
        self._metrics = metrics
        self._amp_level = amp_level
        self._boost_level = boost_level
        self._boost_config = kwargs.pop("boost_config_dict", "")
        self._amp = _AmpConfig.of(amp_level, where, **kwargs)
        if optimizer is None:
            _check_no_optimizer(where, amp_level, boost_level, kwargs)
        manager = self._amp.loss_scale_manager         # (get_update_cell() builds a new cell per call)
        #: whether MindSpore's train cell would return (loss, overflow, scale): see _net_outputs
        self._scale_in_outputs = manager is not None and manager.get_update_cell() is not None
        self._tables = _hash_tables(network)
        _check_optimizer_scale(where, manager, optimizer, boost_level if self._tables else "O0")
        self._pipeline = self._new_pipeline(where)         # built again with the rank exchange, if any
        self._train_cell = None
        self._cell_rows = None              # a complete train cell's hash tables (_CellRows), set when training starts
        self._forward_cell = None
        self._eval_cell = None
        self._evict_hook_states = None      # EvictHook schedules read from a checkpoint, not applied yet
        #: the steps skipped as not finite (overflow_steps), their flags read lazily
        self._overflows = _Overflows(lambda: getattr(self._train_cell, "loss_scaling_manager", None),
                                     self._OVERFLOW_RUN)
        self._prefetch_depth = 2
        self._store = _CheckpointStore(self._tables, self._pipeline.positions)
        self._sharding_resolved = False
        #: the run loop of train and online_train (the prefetcher, the callbacks, between_steps)
        self._loop = _RunLoop(self, lambda: self._pipeline, self._train_step, self._overflows.check_run,
                              self._prefetch_depth)
        self._feed_state = self._loop.feed_state    # the run's stream state (raw batches taken, EvictHooks)
        #: steps run (including skipped overflow steps)
        self.step = 0
        #: raw stream batches consumed by training
        self.batches_consumed = 0
        #: batches of its stream the last resumed ``online_train`` skipped (see ``resume_skip``)
        self.resume_skipped = 0
        #: batches skipped before the step (before their ids reach a hash table), by reason:
        #: "empty" (no rows), "bad_label" (a label other than 0 or 1, NaN included, with a binary
        #: cross-entropy loss), "nonfinite" (a NaN or Inf in a float feature or label)
        self.skipped_batches = dict.fromkeys(_SKIP_REASONS, 0)
        #: identity of this training run, carried through checkpoints and resumes (set when training
        #: first starts; OnlineCheckpoint prunes only files of its run)
        self.run_id = None
        self.samples = 0

    # ---- the pieces ----------------------------------------------------------------------------
    @property
    def network(self):
        """The network the model was made with (as ``mindspore.train.Model`` keeps it)."""
        return self._network

    @property
    def loss_fn(self):
        """The loss function the model was made with (None: ``network`` computes its own loss)."""
        return self._loss_fn

    @property
    def tables(self):
        """The network's hash tables (``HashEmbedding``), in the order the model feeds them (a tuple)."""
        return tuple(self._tables)

    @property
    def table_positions(self):
        """Where each hash table's ids are among a batch's items (one tuple per table, in :attr:`tables`
        order; a table fed by several features reads several items, and tables may share one)."""
        return list(self._pipeline.positions)

    @property
    def _exchange(self):
        """The ``_RankExchange`` when a hash table spans ranks (set when the step is built), else None."""
        return self._pipeline.exchange

    @property
    def _unconsumed(self):
        """The prepared batches a failed or stopped step left, trained first by the next train call."""
        return self._loop.unconsumed

    @property
    def _prefetcher(self):
        """The running epoch's prefetcher (the run loop's), else None."""
        return self._loop.prefetcher

    def between_steps(self):
        """A context at one point between training steps (``with model.between_steps() as pending:``),
        where checkpoints and exports see the model whole: a running prefetcher paused until the end;
        ``pending``: the prepared batches not trained yet, in stream order."""
        return self._loop.between_steps()

    def _new_pipeline(self, where, exchange=None):
        """The host side of each step (prepare, take and gather, apply), over the rank ``exchange``."""
        binary = isinstance(self._loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss))
        return _StepPipeline(self._network, self._tables, self._loss_fn is not None, binary, lambda: self.step,
                             where, exchange)

    def exchange_stats(self):
        """What the hash tables' exchange between ranks has done, or None when no table spans ranks
        (one process, or before the first step builds the model's step): a dict with ``rank`` and
        ``world``, ``bytes_sent`` (the bytes this rank has put into the exchange's collectives) and
        ``seconds`` (the time it spent in them) since the step was built, and ``mean`` (whether the
        row gradients are averaged over the ranks, as the dense ones are)."""
        ex = self._exchange
        if ex is None:
            return None
        return {"rank": ex.rank, "world": ex.size, "bytes_sent": int(ex.bytes_sent), "seconds": float(ex.seconds),
                "mean": bool(ex.mean)}

    @property
    def checkpoint_shard(self):
        """``(rank, world)`` when this model's checkpoints are written in parts (a hash table is
        row-wise: each rank holds only its shard), else None."""
        for table in self._tables:
            if table.layout.shard is not None:
                return table.layout.shard
        return None

    def predict_step_inputs(self, inputs):
        """The forward pass of :attr:`predict_network` on the input Tensors of a training step
        (``cb_params.train_dataset_element``: tables' rows already gathered), the label left out when
        the model has a ``loss_fn``: what a callback uses to score the batch about to be trained on."""
        return self.predict_network(*(inputs[:-1] if self._loss_fn is not None else inputs))

    @property
    def train_network(self):
        """The train-step cell (built on first use)."""
        if self._train_cell is None:
            self._train_cell = self._build_train_cell()
        return self._train_cell

    @property
    def predict_network(self):
        """The network used by :meth:`predict` (and by :meth:`eval` without ``eval_network``):
        ``network``, as in ``mindspore.train.Model`` (hash tables get ready rows)."""
        if self._forward_cell is None:
            self._forward_cell = _graph_step(_Forward(self._network))
            self._forward_cell.set_train(False)
        return self._forward_cell

    @property
    def eval_network(self):
        """The eval network on whole batches (label included), used by :meth:`eval`; None when the
        model has no ``eval_network``."""
        if self._eval_network is None:
            return None
        if self._eval_cell is None:
            self._eval_cell = _graph_step(_Forward(self._eval_network))
            self._eval_cell.set_train(False)
        return self._eval_cell

    @property
    def overflow_steps(self):
        """Steps skipped because their update was not finite: a gradient held an Inf or a NaN, or was
        so large that the update could have put one into a parameter, an optimizer state or a table
        row (see :class:`TrainOneStepWithLossScaleCell`). Their flags are read lazily, so plain
        networks never wait for the device between steps."""
        self._overflows.read()
        return self._overflows.count

    @overflow_steps.setter
    def overflow_steps(self, value):
        self._overflows.reset(value)

    #: skipped steps in a row (at a loss scale that cannot drop further) after which training stops
    #: with a RuntimeError naming the stream batches
    _OVERFLOW_RUN = 100

    def _build_train_cell(self):
        """The train cell, compiled in PyNative mode too (``_graph_step``); a user's own train cell
        (``optimizer`` None) is left as it is."""
        self._resolve_sharding("RecModel")
        if self._optimizer is None:
            network = self._network if self._loss_fn is None else nn.WithLossCell(self._network, self._loss_fn)
            return network.set_train()
        cell = _graph_step(self._make_train_cell())
        if self._exchange is not None:         # the row gradients are reduced like the dense ones
            self._exchange.mean = _reducer_mean(cell)
        return cell

    def _resolve_sharding(self, where):
        """Decide, once, each hash table's ``resolved_sharding``: its ``sharding``, or when None
        "data_parallel" under a data-parallel context of more than one device, else "none"; make
        each row-wise table this rank's shard; then set up the rank exchange if a table spans ranks."""
        if self._sharding_resolved:
            return
        parallel, rank, size = _boost_parallel()
        parallel = parallel and size > 1
        modes = []
        for table in self._tables:
            mode = table.sharding or ("data_parallel" if parallel else "none")
            if mode != "none" and not parallel:
                _fail(where, "the 'sharding' of hash table %r" % table.table_name, "'none' or None without a "
                      "data-parallel context of more than one device (msrun, mindspore.communication.init() and "
                      "parallel_mode DATA_PARALLEL)", mode)
            modes.append(mode)
        exchange = _RankExchange(rank, size) if any(mode != "none" for mode in modes) else None
        for table, mode in zip(self._tables, modes):
            table.set_layout(mode, rank, size, exchange, where)
        if exchange is not None:
            self._pipeline = self._new_pipeline(where, exchange)
            self._check_ranks_agree(where)
        self._sharding_resolved = True

    def _rank_config(self):
        """What every rank of a job must agree on (JSON values): the model's :meth:`settings`, the
        network's class and trainable parameters (name, shape, dtype), and each hash table's
        settings, seed, capacity, row width, optimizer and sharding, by table name."""
        tables = {}
        for table, key in zip(self._tables, _table_keys(self._tables)):
            tables[key] = dict(table.settings(), seed=table.seed, capacity=table.table_capacity,
                                            embedding_size=table.embedding_size, sharding=table.resolved_sharding,
                                            optimizer=type(table.optimizer).__name__)
        params = {p.name: [list(p.shape), str(p.dtype)] for p in self._network.trainable_params()}
        return {"model": dict(self.settings(), network=type(self._network).__name__), "parameters": params,
                "tables": tables}

    def _check_ranks_agree(self, where):
        """Before the first exchange: the ranks exchange :meth:`_rank_config` (AllGather) and every rank
        raises a ValueError naming the first setting where a rank differs from rank 0, and both
        values, so misconfigured ranks fail at once, not by diverging or in a kernel error."""
        configs = self._exchange.share_config(self._rank_config())
        for r in range(1, len(configs)):
            found = _first_difference(configs[0], configs[r])
            if found is not None:
                path, theirs, mine = found
                _fail(where, "the configuration of every rank (%s)" % path, "rank 0's %r" % (theirs,),
                      "%r on rank %d" % (mine, r))

    def _make_train_cell(self):
        """recboost's one loss-scaled step (scale exactly 1 without a loss-scale manager, so a
        non-finite step still changes nothing), boosted at boost levels O1/O2, with each hash
        table's ready rows as a ``row_inputs`` entry."""
        where = "RecModel"
        network = _cast_network(self._network, self._amp, where)
        if self._loss_fn is not None:
            network = _WithLossCell(network, self._loss_fn, self._amp.cast_model_type == mstype.float16)
        manager = self._amp.loss_scale_manager
        rows, growth, pooled = self._pipeline.row_positions, self._pipeline.row_growth(), self._pipeline.row_pooled()
        if manager is not None and manager.get_update_cell() is None:
            if self._tables:
                return _OptimizerUnscaledStep(network, self._optimizer, manager.get_loss_scale(), rows, growth,
                                              pooled).set_train()
            return build_train_network(network, self._optimizer, level="O0", boost_level=self._boost_level,
                                       boost_config_dict=self._boost_config, loss_scale_manager=manager)
        scale = manager.get_update_cell() if manager is not None else None
        if self._boost_level != "O0":
            return _boost_train_cell(network, self._optimizer, self._boost_level, self._boost_config,
                                     scale, row_inputs=rows, row_growth=growth, row_pooled=pooled).set_train()
        return TrainOneStepWithLossScaleCell(network, self._optimizer, scale, rows, growth, pooled).set_train()

    def _train_step(self, feed, begin):
        """One training step on the prepared ``feed`` (the run loop's ``step``): its rows taken and
        gathered, ``begin(inputs)`` (the callbacks' step begin), the train cell, the tables' updates and
        the counters; returns the callbacks' ``net_outputs``."""
        self._pipeline.check_rates()           # (a rate that cannot train: nothing of the step done)
        inputs = self._pipeline.inputs(feed)
        if self._tables and self._cell_rows is None:     # (a user's complete cell: its own update)
            self._train_cell.set_row_bounds(*self._pipeline.row_bounds(feed))
        begin(inputs)
        if self._cell_rows is not None:
            self._cell_rows.ready(inputs)
        if self._exchange is None:
            outputs = self._train_cell(*inputs)
        else:
            with self._exchange.waiting("the step (its dense gradients' AllReduce)"):
                outputs = self._train_cell(*inputs)
        self._finish_step(feed, outputs)
        self.step, self.batches_consumed, self.samples = self.step + 1, feed.taken, self.samples + feed.samples
        return self._net_outputs(outputs)

    def _finish_step(self, feed, outputs):
        """After the step: the tables' fused updates (unless the step overflowed); the overflow flag
        of a plain network is kept to be read later (``_Overflows.read``), so the host never waits for
        the device. A user's own train cell (``optimizer`` None) returns what it returns: its hash tables
        (``_CellRows``) apply the rows' gradients it computed."""
        if self._cell_rows is not None:
            self._cell_rows.apply(feed)
            return
        if self._optimizer is None or not (isinstance(outputs, tuple) and len(outputs) >= 3):
            return
        self._overflows.pending.append((outputs[1], outputs[2], feed.taken))
        if not self._tables:
            return
        self._overflows.read()
        if bool(outputs[1].asnumpy()):         # global: the step's overflow flag is summed over the ranks
            return
        self._pipeline.apply(feed, outputs[3:])                # the row_inputs' gradients

    def _net_outputs(self, outputs):
        """The step's outputs as the callbacks see them (``cb_params.net_outputs``): what MindSpore's
        train cell returns for the same settings. A loss-scale manager with an update cell (dynamic,
        or fixed with ``drop_overflow_update``; amp O2/O3's default) gives MindSpore's ``(loss,
        overflow, scale)``; otherwise its ``TrainOneStepCell``/``BoostTrainOneStepCell`` returns the
        loss alone. recboost's step also returns the rows' gradients: never passed on. A user's own
        train cell (``optimizer`` None) returns what it returns."""
        if self._optimizer is None or not (isinstance(outputs, tuple) and len(outputs) >= 3):
            return outputs
        return outputs[:3] if self._scale_in_outputs else outputs[0]

    # ---- training ------------------------------------------------------------------------------
    def online_train(self, train_dataset, callbacks=None, dataset_sink_mode=True, sink_size=1,
                     resume_from=None, resume_prefix="recboost", resume_strict=True, resume_skip=None):
        """Train on an unbounded stream until it ends or a callback calls ``request_stop()``.

        Args:
            train_dataset: a MindSpore dataset (e.g. ``GeneratorDataset`` over an endless generator) or
                any Python iterable of batches.
            callbacks (Union[Callback, list[Callback]]): MindSpore callbacks. Each :class:`EvictHook`
                evicts hash-table rows in stream order (see :meth:`train`).
            dataset_sink_mode (bool): sink data to the device. On CPU training feeds instead (one
                log line says so).
            sink_size (int): the steps of each "epoch" of the callback protocol (a positive int; the
                stream has no end, so there is no whole-dataset epoch). Used with or without sink mode.
            resume_from (str): a checkpoint file (or a directory: its latest checkpoint) written by
                :class:`OnlineCheckpoint`; training continues exactly where it stopped. The
                checkpoint is read and checked whole before anything of the model changes.
            resume_prefix (str): the :class:`OnlineCheckpoint` ``prefix`` of the checkpoints when
                ``resume_from`` is a directory.
            resume_strict (bool): see ``strict`` of :meth:`load_checkpoint`: False resumes into
                other settings (each difference logged).
            resume_skip (int): the batches of ``train_dataset`` to skip on resume. None (default):
                ``train_dataset`` is the stream of the checkpointed training call, given again from
                its start, and the batches that call had consumed are skipped (only that call's: a
                run of one call per pass resumes its pass). 0: ``train_dataset`` starts where the
                checkpoint stopped (e.g. the next pass, after a checkpoint at the end of one). The
                number skipped is logged and kept in :attr:`resume_skipped`.

        Returns:
            RecModel: self.
        """
        where = "RecModel.online_train"
        _check_bool(where, "dataset_sink_mode", dataset_sink_mode)
        _check_int(where, "sink_size", sink_size, minimum=1)
        hooks, evict_hooks = self._loop.callbacks(callbacks, where)       # checked before a checkpoint loads
        if dataset_sink_mode and ms.get_context("device_target") == "CPU":
            _log("online_train: dataset sink mode is not supported on CPU; feeding step by step.")
        replay, skip = [], 0
        if resume_from is not None:
            skip = None if resume_skip is None else _check_int(where, "resume_skip", resume_skip, 0)
            replay = self.load_checkpoint(resume_from, _check_bool(where, "resume_strict", resume_strict),
                                          resume_prefix)
            taken = replay[-1].taken if replay else self.batches_consumed
            skip = taken - self._loop.stream_start if skip is None else skip
            _log("online_train: resumed at step %d (%d stream batches consumed in all); skipping the first %d "
                 "batches of this stream%s" % (self.step, taken, skip, " (the checkpointed call had consumed "
                                                "them; resume_skip=0 if this stream starts afresh)" if skip else ""))
            train_dataset = _skip_batches(train_dataset, skip)
        self.resume_skipped = skip
        iterator = _batch_iterator(train_dataset, where)
        self._fit([iterator], hooks, evict_hooks, where, replay, epoch_steps=sink_size, stream_skip=skip,
                  train_dataset=train_dataset, dataset_sink_mode=dataset_sink_mode, sink_size=sink_size,
                  batch_num=sink_size)
        return self

    def train(self, epoch, train_dataset, callbacks=None, dataset_sink_mode=False, sink_size=-1):
        """Train ``epoch`` epochs over a finite dataset (``mindspore.train.Model.train`` semantics).

        Args:
            epoch (int): the number of epochs (>= 1).
            train_dataset: a MindSpore dataset or a Python iterable of batches that can be iterated
                again for every epoch (a list, a dataset; a generator is used up by its first pass).
                A MindSpore dataset is read as ``Model`` reads it, by one iterator over every epoch:
                a shuffled dataset is shuffled again at each epoch, in ``Model``'s order.
            callbacks (Union[Callback, list[Callback]]): MindSpore callbacks. Every :class:`EvictHook`
                among them runs, in the order given, each on its own schedule and on its own
                ``tables`` (default: every hash table of the network); they evict in stream order on
                the prefetch thread, and their schedules are checkpointed.
            dataset_sink_mode (bool): sink data to the device. On CPU the batches are fed step by
                step either way (one log line says so), but the epochs follow ``sink_size``.
            sink_size (int): MindSpore's meaning, in sink mode: the steps (batches) of each epoch.
                -1 (default): the whole dataset; k > 0: the next k batches, continuing where the
                previous epoch stopped and starting the dataset again at its end (``epoch * k``
                batches in all). Without sink mode it must be -1 (MindSpore ignores it there).

        Returns:
            RecModel: self.
        """
        where = "RecModel.train"
        _check_int(where, "epoch", epoch, minimum=1)
        _check_bool(where, "dataset_sink_mode", dataset_sink_mode)
        _check_int(where, "sink_size", sink_size, minimum=-1)
        if sink_size == 0:
            _fail(where, "'sink_size'", "-1 or an int >= 1", sink_size)
        if sink_size != -1 and not dataset_sink_mode:
            _fail(where, "'sink_size'", "-1 when 'dataset_sink_mode' is False (it sets the steps of an "
                  "epoch in sink mode)", sink_size)
        hooks, evict_hooks = self._loop.callbacks(callbacks, where)
        if dataset_sink_mode and ms.get_context("device_target") == "CPU":
            _log("train: dataset sink mode is not supported on CPU; feeding step by step.")
        if sink_size == -1:
            epochs = _passes(train_dataset, epoch, where)
            batch_num = _dataset_size(train_dataset)
        else:
            batches = _repeated_batches(train_dataset, where)
            epochs = (itertools.islice(batches, sink_size) for _ in range(epoch))
            batch_num = sink_size
        self._fit(epochs, hooks, evict_hooks, where, [], train_dataset=train_dataset, epoch_num=epoch,
                  dataset_sink_mode=dataset_sink_mode, sink_size=sink_size, batch_num=batch_num)
        return self

    def _fit(self, epochs, hooks, evict_hooks, where, replay, **values):
        """Ready the model for a run (its sharding, a complete cell's hash tables, its run id, the
        EvictHook schedules a checkpoint held), then run it: :meth:`_RunLoop.fit` (``values``: see there)."""
        self._resolve_sharding(where)
        if self._optimizer is None and self._tables and self._cell_rows is None:
            if self._exchange is not None or self._loss_fn is not None:
                _fail(where, "the RecModel's 'optimizer'", "an optimizer to train a network with hash tables (%s) %s"
                      % (", ".join(repr(t.table_name) for t in self._tables), "across ranks" if self._loss_fn is None
                         else "with a 'loss_fn'"), None)
            self._cell_rows = _CellRows(self._network, self._tables, self._pipeline.positions, where, self.step)
        if self.run_id is None:
            import uuid
            self.run_id = uuid.uuid4().hex
        saved = self._evict_hook_states            # schedules from a checkpoint: restored in order
        if saved is not None and len(saved) != len(evict_hooks):
            _log("%s: the checkpoint holds the schedules of %d EvictHook(s) and 'callbacks' has %d; restored "
                 "in order, %s" % (where, len(saved), len(evict_hooks), "the others start afresh"
                                   if len(evict_hooks) > len(saved) else "the rest are dropped"))
        for hook, hook_state in zip(evict_hooks, saved or ()):
            hook.load_state_dict(hook_state)
        self._evict_hook_states = None
        self._loop.fit(epochs, hooks, evict_hooks, where, replay, train_network=self._train_cell,
                       optimizer=self._optimizer, **values)

    # ---- inference -----------------------------------------------------------------------------
    def predict(self, *predict_data):
        """Run the eval network on one batch of inputs (arrays or Tensors, or one dict batch without
        the label; raw hash ids are looked up without admitting new ids). Returns the network output
        as a Tensor."""
        return self.predict_network(*self._predict_inputs("RecModel.predict", predict_data))

    def _predict_inputs(self, where, predict_data):
        """The input Tensors :meth:`predict` runs :attr:`predict_network` on (ids looked up, not admitted)."""
        one_dict = len(predict_data) == 1 and isinstance(predict_data[0], dict)
        feed = self._pipeline.prepare(predict_data[0] if one_dict else tuple(predict_data), {"taken": 0},
                                      where, training=False)
        if feed.inputs is None:
            _fail(where, "the inputs", "a non-empty batch", "0 rows")
        return self._pipeline.inputs(feed)

    def eval(self, valid_dataset, callbacks=None, dataset_sink_mode=False):
        """Evaluate the metrics over a finite dataset of ``(*inputs, label)`` batches, running
        ``callbacks`` as ``mindspore.train.Model.eval`` does.

        With an ``eval_network`` it runs on whole batches (label included) and its outputs go to
        the metrics as MindSpore's ``Model.eval`` passes them: with ``eval_indexes`` (loss,
        prediction, label) a ``mindspore.train.Loss`` metric gets the loss and every other metric
        ``(prediction, label)``; without, every metric gets ``update(*outputs)``. Outputs a metric
        cannot take are a ValueError naming ``eval_network``/``eval_indexes``, the metric and the
        outputs. Without an ``eval_network``, ``network`` runs on the inputs; recboost's metrics
        (``"auc"``, ``"log_loss"``, ``"accuracy"``: :class:`AUC`, :class:`LogLoss`,
        :class:`Accuracy`) get ``(output, label)`` as float64 arrays, ``sigmoid(output)`` with
        ``BCEWithLogitsLoss``, and every other metric what Model's ``WithEvalCell(network, loss_fn)``
        gives it: a ``mindspore.train.Loss`` the loss, the others ``(output, label)`` Tensors.
        ``dataset_sink_mode`` feeds batch by batch on every device (as Model does on CPU).

        Callbacks (a Callback or a list of them) get Model's evaluation hooks in Model's order:
        ``on_eval_begin``, ``on_eval_epoch_begin``, per batch ``on_eval_step_begin`` and
        ``on_eval_step_end``, then ``on_eval_epoch_end`` and ``on_eval_end`` (a callback overriding
        only the old names ``begin``, ``epoch_begin``, ... gets those). ``run_context.original_args()``
        holds Model's fields: ``eval_network`` (the ``eval_network`` given, else :attr:`predict_network`),
        ``network``, ``valid_dataset``, ``batch_num`` (the dataset's batches when known, else None),
        ``mode`` ("eval"), ``cur_step_num`` (0, then the batch's number from 1),
        ``dataset_sink_mode`` (False), ``list_callback``, ``eval_dataset_element`` (the batch's input
        Tensors), ``net_outputs`` (the eval network's outputs; without ``eval_network``, Model's
        ``WithEvalCell`` outputs ``(loss, output, label)`` when the model has a ``loss_fn`` and a
        callback overrides an eval hook, else the output: no loss is computed for no one), from
        ``on_eval_end`` ``metrics`` (the dict returned); and ``recboost``, the RecModel.
        ``run_context.request_stop()`` ends the evaluation after the current batch: the epoch-end and
        end hooks still run and the metrics cover the batches seen.

        Returns:
            dict: metric name -> value.
        """
        from mindspore.train.callback import RunContext
        where = "RecModel.eval"
        _check_bool(where, "dataset_sink_mode", dataset_sink_mode)
        metrics = _make_metrics(self._metrics, where)
        if not metrics:
            _fail(where, "'metrics' of the RecModel", "at least one metric", self._metrics)
        hooks = _Hooks(callbacks, where, phase="eval")
        for metric in metrics.values():
            metric.clear()
        logits = isinstance(self._loss_fn, nn.BCEWithLogitsLoss)
        indexes = self._eval_indexes
        with_loss = self._eval_network is None and self._loss_fn is not None and bool(hooks.overridden)
        wants_loss = any(isinstance(metric, ms.train.Loss) for metric in metrics.values())
        cb_params = _CallbackParams(
            eval_network=self._eval_network if self._eval_network is not None else self.predict_network,
            valid_dataset=valid_dataset, batch_num=_dataset_size(valid_dataset), mode="eval", cur_step_num=0,
            list_callback=hooks.callbacks, network=self._network, dataset_sink_mode=False, recboost=self)
        run_context = RunContext(cb_params)
        with hooks:
            hooks.on_eval_begin(run_context)
            hooks.on_eval_epoch_begin(run_context)
            for raw in _batch_iterator(valid_dataset, where):
                feed = self._pipeline.prepare(raw, {"taken": 0}, where, training=False)
                if feed.inputs is None:
                    continue
                cb_params.cur_step_num += 1
                inputs = cb_params.eval_dataset_element = self._pipeline.inputs(feed)
                hooks.on_eval_step_begin(run_context)
                if self._eval_network is not None:
                    outputs = self.eval_network(*inputs)
                    cb_params.net_outputs = outputs
                    hooks.on_eval_step_end(run_context)
                    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
                    if indexes is not None and len(outputs) <= max(indexes):
                        _fail(where, "'eval_indexes' of the RecModel", "positions among the %d outputs of "
                              "'eval_network'" % len(outputs), indexes)
                    for name, metric in metrics.items():
                        _update_metric(where, name, metric, outputs, indexes)
                else:
                    out = self.predict_step_inputs(inputs)
                    loss = self._loss_fn(out, inputs[-1]) if self._loss_fn is not None and (
                        with_loss or wants_loss) else None
                    cb_params.net_outputs = (loss, out, inputs[-1]) if with_loss else out
                    hooks.on_eval_step_end(run_context)
                    label, prob = feed.inputs[-1], None
                    for name, metric in metrics.items():
                        if isinstance(metric, (AUC, LogLoss, Accuracy)):     # recboost's: probabilities
                            if prob is None:
                                prob = out.asnumpy().astype(np.float64).reshape(label.shape)
                                prob = _sigmoid(prob) if logits else prob
                            metric.update(prob, label)
                        else:                           # as Model's WithEvalCell gives them
                            _update_metric(where, name, metric, (loss, out, inputs[-1]), [0, 1, 2],
                                           "the eval network (Model's WithEvalCell(network, loss_fn): loss, "
                                           "output, label)")
                if run_context.get_stop_requested():
                    break
            hooks.on_eval_epoch_end(run_context)
            result = cb_params.metrics = {name: metric.eval() for name, metric in metrics.items()}
            hooks.on_eval_end(run_context)
        return result

    # ---- checkpoints ---------------------------------------------------------------------------
    def settings(self):
        """What this model is made with that changes what training does, beyond its parameters and
        tables, as JSON values: the mixed precision level and its overrides, the loss scale
        manager's kind, the boost level, and the kinds of the loss and the optimizer. Checkpoints
        record it; :meth:`load_checkpoint` compares it."""
        amp = self._amp
        return {"amp_level": amp.level, "cast_model_type": str(amp.cast_model_type),
                "keep_batchnorm_fp32": amp.keep_batchnorm_fp32,
                "loss_scale_manager": None if amp.loss_scale_manager is None else type(amp.loss_scale_manager).__name__,
                "boost_level": self._boost_level,
                "loss_fn": None if self._loss_fn is None else type(self._loss_fn).__name__,
                "optimizer": None if self._optimizer is None else type(self._optimizer).__name__}

    def save_checkpoint(self, path, extra=None, chain=None):
        """Write every piece of training state to ``path`` atomically (:func:`_atomic_write`): one
        ``.npz`` file, complete or absent, with the JSON object ``extra(counters)`` gives (called paused) as ``extra``.
        ``chain``: None (a full checkpoint), "base" (full; deltas may follow) or "delta" (format 5: what changed since
        the last "base"/"delta" save, in its folder, which it names; docs/training.md, "Incremental checkpoints").

        Saved from one consistent point: all parameters of the train cell (network, optimizer state, loss-scale state),
        each hash table (cache, rows, optimizer slots, initial rows' seed), the eviction schedules, the step counters,
        the stream position and the batches the prefetcher has prepared (replayed on resume: the run goes on bit for bit).

        The file's member ``manifest`` (JSON, ``format`` 4) describes the checkpoint and names the
        array member of each piece; nothing is encoded in the array names:

        - ``format``, ``version`` (recboost's), ``network`` (class name), ``run`` (the run id);
          ``step``, ``taken`` (stream batches consumed), ``overflow_steps``, ``samples``,
          ``skipped_batches`` (by reason); ``stream_start`` (batches consumed before the stream of
          the ``online_train`` call began); ``settings`` (:meth:`settings`);
        - ``parameters``: parameter name -> array;
        - ``tables``: per hash table, in network order, ``name``, ``seed``, ``embedding_size``,
          ``optimizer``, ``settings`` (:meth:`HashEmbedding.settings`), ``clock``
          (:attr:`HashEmbedding.clock`), ``rounds`` (bfloat16 rows: the stochastic rounding's count
          of updates) and the arrays ``table`` (rows: float32, or uint16 bfloat16 bits), ``live``, and
          ``slots``, ``scalars``, ``cache`` (key -> array, as in :meth:`HashEmbedding.state_dict`; 0-d scalars);
        - ``evict_hooks``: the schedule of each EvictHook of the run, in callback order;
        - ``replay``: per prepared batch ``taken``, ``samples``, ``skip`` (why it is not trained, or
          null), ``inputs`` (arrays) and per table ``new_rows``, ``new_ids`` (arrays), ``capacity``;
        - ``members``: every other member's ``bytes`` and ``sha256``, and ``sha256``: the digest of
          the manifest's own canonical content (:func:`_write_checkpoint_file`). Reading checks them
          all (:func:`_read_checkpoint_file`): any damage is one ValueError naming the file.

        With a row-wise hash table the checkpoint is written in parts: every rank must call this with the same ``path``;
        each writes its own state (its shards; manifest field ``part``: rank and world; each table's ``shard``) to
        ``<stem>.part-<rank>-of-<world>.npz``, and rank 0 then writes ``path``: a manifest (``format``, ``version``,
        ``run``, ``step``, ``world``, and per part ``rank``, ``file``, ``size``, ``sha256``), once every part is complete.

        A write that fails with an OSError (a full disk, an I/O error, no permission) raises an
        OSError of the same errno naming ``path`` and the bytes (:func:`_atomic_write`); the file at
        ``path`` is then the one before, or none.

        Returns:
            str: ``path``.
        """
        with self.between_steps() as pending:
            if self._evict_hook_states is not None:        # read from a checkpoint, not applied yet
                hook_states = list(self._evict_hook_states)
            else:
                hook_states = [hook.state_dict() for hook in self._feed_state.get("evict_hooks", ())]
            counters = _CheckpointCounters(
                step=self.step, batches_consumed=pending[-1].taken if pending else self.batches_consumed,
                overflow_steps=self.overflow_steps, skipped_batches=self.skipped_batches,
                samples=self.samples, run_id=self.run_id, stream_start=self._loop.stream_start,
                evict_hooks=hook_states)
            head = counters.manifest_fields(type(self._network).__name__, self.settings())
            self._store.write(path, head, self.state_parameters(), pending, self.checkpoint_shard, self._exchange,
                              extra, chain)
        return path

    def _complete_cell(self):
        """Whether this model trains a complete train cell with hash tables (see :class:`_CellRows`)."""
        return bool(self._tables) and self._optimizer is None and self._loss_fn is None and self._exchange is None

    def state_parameters(self):
        """The dense state a checkpoint holds: the parameters of the train cell (network, optimizer,
        loss scale), unique by name, in its order. Hash tables hold no Parameters (their state is
        saved on its own); a complete train cell's stand-ins of them are left out (:meth:`_CellRows.derived`)."""
        seen, params = set(), []
        derived = _CellRows.derived(self._network, self._tables) if self._complete_cell() else set()
        for param in self.train_network.get_parameters():
            # (the row bounds and factors are set before each step: no state)
            if param.name not in seen and param.name not in (_ROW_BOUNDS, _ROW_FACTORS) and id(param) not in derived:
                seen.add(param.name)
                params.append(param)
        return params

    def load_checkpoint(self, path, strict=True, prefix="recboost"):
        """Restore the state written by :meth:`save_checkpoint` (``path`` may be a directory: its
        latest checkpoint named ``<prefix>-<step>.npz``, as :class:`OnlineCheckpoint` writes with its
        ``prefix``). All or nothing: the manifest and every array it names are read and
        checked into new objects first (metadata, parameters, each table's state through
        :meth:`HashEmbedding.check_state_dict`, the batches to replay), then swapped in. A truncated,
        corrupt or mismatched file, a missing or mistyped field, or an array the manifest names but
        the file lacks raises a ValueError naming the file and the part, and the model is unchanged.
        Every byte is verified first (:func:`_read_checkpoint_file`: each member against the size and
        sha256 its manifest lists, the manifest against its own sha256); whatever the damage, it is
        that one ValueError, never a raw error of zipfile, numpy or json.
        The manifest is checked against one schema (every field, its type and range). Files of
        format 3 (recboost 0.2.0 before the checksums) load, checked by the zip's CRC-32; files of
        recboost before 0.2.0 (format 2) are refused, saying so; other formats too, naming theirs.
        A checkpoint written in parts (row-wise tables) is read whole: every part the manifest names,
        checked against its size and sha256. Each hash table's state is laid out for this model's
        sharding and number of ranks (``HashEmbedding.restore_states``): the same layout loads as it
        is, any other is split or merged by owner.

        A checkpoint loads only into the configuration that wrote it: the model's :meth:`settings` and
        each table's :meth:`HashEmbedding.settings` are compared with those recorded, and a difference
        is a ValueError naming the setting, both values and the file. ``strict=False`` accepts the
        differences (each is logged) and training goes on with this model's and its tables' settings,
        as ``torch.nn.Module.load_state_dict(strict=False)`` lets a model differ from its state.

        ``path`` may also be a ``.ckpt`` file MindSpore's ``ModelCheckpoint`` wrote while this model, with hash
        tables, trained: the state is read from its companion ``<name>.recboost.npz``, written beside it at the
        same step (:class:`_ModelCheckpointTables`); a missing companion is a ValueError naming it.

        A complete train cell with hash tables (``optimizer`` None, :class:`_CellRows`) resumes too: the tables'
        sparse optimizers are set here, before their state is read; the stand-ins are rebuilt by the next step.

        Returns:
            list: the prepared batches to replay before the stream goes on (used by online_train).
        """
        where = "RecModel.load_checkpoint"
        _check_bool(where, "strict", strict)
        self._resolve_sharding(where)
        path = _resume_path(where, path)
        if self._complete_cell() and self._cell_rows is None:      # the tables' sparse twins, before their state
            self._cell_rows = _CellRows(self._network, self._tables, self._pipeline.positions, where, self.step)
        loaded = self._store.read(path, self.state_parameters, self.settings(), self._exchange, strict=strict,
                                  prefix=_check_prefix(where, prefix))
        self._store.swap_in(loaded)     # every check passed (table states were checked: loading them cannot fail)
        _assign_parameters(loaded["parameters"])
        c = loaded["counters"]           # a _CheckpointCounters
        self.step, self.batches_consumed, self.overflow_steps = c.step, c.batches_consumed, c.overflow_steps
        self.skipped_batches, self.samples, self.run_id = c.skipped_batches, c.samples, c.run_id
        self._loop.stream_start, self._evict_hook_states = c.stream_start, c.evict_hooks
        self._loop.unconsumed = []
        return loaded["replay"]

    # ---- export to serving ---------------------------------------------------------------------
    def export(self, directory, base=None, mindir=None):
        """Write a serving bundle (read by :class:`Predictor`) to ``directory``, all at once: the files
        go into a sibling temporary directory, each fsynced, which is then renamed to ``directory``.
        ``directory`` must not exist or be empty (a bundle is never overwritten; nothing is written
        otherwise). Between steps, or from a callback: the prefetcher is paused meanwhile.

        The bundle (format ``_BUNDLE_FORMAT``; docs/serving.md lists every file and manifest field):
        ``dense.ckpt``, the network's parameters (``mindspore.save_checkpoint``; no optimizer state);
        per hash table ``i``, in network order, ``table-<i>-ids.npy`` (the ids that own a row, sorted
        int64), ``table-<i>-rows.npy`` (their rows, float32 ``[n, dim]``) and ``table-<i>-default.npy``
        (the default row); ``manifest.json``, which records the network and names every file with its
        size and sha256, and carries its own checksum.

        With ``mindir`` (a sample batch of the inputs :meth:`predict` takes: a tuple such as ``(dense,
        ids)``, or a dict) the network is also written as MindIR, ``dense.mindir``
        (``mindspore.export``, in eval mode; load it with ``mindspore.load`` + ``nn.GraphCell``, or
        :func:`load_mindir`). It takes the inputs :meth:`predict` runs the network on: each hash
        table's ids replaced by their rows (pooled per bag with a combiner), other items as given;
        shapes after the batch dimension and dtypes from the sample, any batch size. The manifest's
        ``mindir.inputs`` says which tables' rows each input holds. A network MindSpore cannot export
        is a ValueError naming it; nothing is written.

        With ``base`` (a bundle this model exported, full or delta) the bundle is a delta on it: per
        table only the rows that changed since (compared bit for bit) or are new, the ids evicted
        since (``table-<i>-evicted.npy``), the default row, and the whole dense part; base and deltas
        applied in order (:meth:`Predictor.apply`) predict bit for bit as a full export at the step.
        A model whose hash tables are row-wise must be exported from one process (load its checkpoint
        there, which merges the shards), else ValueError. An OSError while writing names the path
        and the bytes being written; nothing of the bundle is left (:class:`OnlineExport` logs it).

        Returns:
            str: ``directory``.
        """
        sample = _mindir_sample("RecModel.export", mindir)     # looked up once the prefetcher is paused
        ready = None if sample is None else functools.partial(self._predict_inputs, "RecModel.export", sample)
        return _export_bundle(self, directory, base, ready)


# =====================================================================================================
# Serving
# =====================================================================================================
# What a server reads: bundles written by RecModel.export and OnlineExport, read by Predictor. Who owns what:
#   _write_bundle, _bundle_file, _bundle_npy,     a bundle written all at once (a sibling temporary
#   _bundle_dense, _HashingWriter                 directory, every file fsynced and digested, then renamed)
#   _export_bundle, _table_owned, _owned_rows,    RecModel.export's body: a full bundle or a delta, the
#   _NpyChunks, _table_snapshot                   rows gathered and written a chunk at a time
#   _read_bundle, _bundle_schema,                 one bundle read whole and checked (its manifest's own
#   _resolve_bundle, _apply_delta                 sha256, every file's), a delta's chain, a delta applied
#   _network_record, _check_network               the network a bundle records, compared with a server's
#   _ServingMap, _Bundle, _BundleTable,           a table's id -> row map for serving; a loaded bundle
#   _ServingState
#   _bundle_mindir, _mindir_inputs, load_mindir   the network as MindIR (export's mindir=), its inputs, read back
#   Predictor, OnlineExport                       serving a bundle chain; exporting from a training run
#   _Sha256Beside, _DigestsBeside, _file_digest   sha256 on threads beside the I/O (bundles, checkpoints)
#   _bundle_files_checked, _file_read_hashed,     a bundle's files read once, hashed as read, the arrays views
#   _npy_view, _load_copy                         of the checked bytes; MindSpore's loaders given a copy of them
#   _BundleFollower, _Batcher, _serve_app, ...    the serving process (python -m recboost serve): its sub-section
# A serving bundle (``RecModel.export``) is a directory written all at once: the files go into a
# sibling temporary directory, each is fsynced, then the directory is renamed into place
# (``_write_bundle``). It holds ``dense.ckpt`` (the user's network's parameters, through
# ``mindspore.save_checkpoint``; with export's ``mindir=`` also ``dense.mindir``, the network as MindIR
# on its ready inputs), per hash table ``.npy`` files of the ids that own a row (sorted
# int64), their rows and the default row (a delta: only the rows changed since its base, and the ids
# evicted since it), and ``manifest.json`` (carrying its own sha256), which names every file with its
# size and sha256 and records the network (``_network_record``: class, settings, parameters), checked
# against a Predictor's network (``_check_network``) and along a chain of deltas.
# ``_read_bundle`` reads and checks one bundle whole; ``_resolve_bundle`` follows a delta's chain of
# bases; ``_apply_delta`` is the one way a delta is applied (``Predictor.apply`` and the base of a
# delta export); ``_ServingMap`` stands in for a table's HashCache in a ``Predictor``.


def _table_spec(table):
    """A hash table as a bundle's manifest describes it (name, row width, combiner, padding id)."""
    return {"name": table.table_name, "embedding_size": int(table.embedding_size), "combiner": table.combiner,
            "padding_id": table.padding_id}


def _network_record(network):
    """The network as a bundle's manifest records it: ``class`` (``module:qualname``; recboost's own
    classes as ``recboost:<name>`` under whatever name this module was imported or run), ``settings``
    (what recboost built it with, e.g. :class:`WideDeep`'s model name, sizes and layers; None for a
    network recboost did not build) and ``parameters`` (every parameter ``dense.ckpt`` holds: its
    ``name``, ``shape`` and ``dtype``, by name)."""
    cls = type(network)
    settings = getattr(network, "_build_settings", None)
    return {"class": "%s:%s" % ("recboost" if cls.__module__ == __name__ else cls.__module__, cls.__qualname__),
            "settings": copy.deepcopy(settings) if isinstance(settings, dict) else None,
            "parameters": _parameter_records(network.parameters_dict())}


def _parameter_records(params):
    """``{"name", "shape", "dtype"}`` of each of ``params`` (name -> Parameter), by name."""
    return [{"name": name, "shape": [int(d) for d in param.shape], "dtype": str(param.dtype)}
            for name, param in sorted(params.items())]


def _same_class(want, got):
    """Whether two recorded classes (``module:qualname``) are the same: equal, or of equal qualnames
    where one was defined in a script run as ``__main__`` (the same class, imported by its module's
    name in another process)."""
    (want_module, _, want_name), (got_module, _, got_name) = want.partition(":"), got.partition(":")
    return want == got or want_name == got_name and "__main__" in (want_module, got_module)


def _check_network(where, what, want, got, against):
    """The network recorded as ``got`` (of ``what``, e.g. "'network'") must be the one recorded as
    ``want`` (of ``against``, e.g. "the bundle '/srv/full' ('directory')"): the same class, the same
    parameters (names, shapes, dtypes) and the same settings. Raises a ValueError naming the first
    difference, in that order; changes nothing."""
    if not _same_class(want["class"], got["class"]):
        _fail(where, "the class of %s" % what, "%s like %s" % (want["class"], against), got["class"])
    theirs = {p["name"]: p for p in want["parameters"]}
    mine = {p["name"]: p for p in got["parameters"]}
    for pname in sorted(set(theirs) - set(mine)):
        _fail(where, what, "a network with the parameter %r of %s" % (pname, against), "a network without it")
    for pname in sorted(set(mine) - set(theirs)):
        _fail(where, "the parameter %r of %s" % (pname, what), "a parameter of %s" % against, "a parameter it lacks")
    for pname in sorted(mine):
        for key in ("shape", "dtype"):
            if mine[pname][key] != theirs[pname][key]:
                show = tuple if key == "shape" else str
                _fail(where, "the %s of the parameter %r of %s" % (key, pname, what),
                      "%s like %s" % (show(theirs[pname][key]), against), show(mine[pname][key]))
    if (want["settings"] is None) != (got["settings"] is None):
        _fail(where, "the settings of %s" % what, "%s like %s" % (
            "none (a network recboost did not build)" if want["settings"] is None else want["settings"], against),
              "none (a network recboost did not build)" if got["settings"] is None else got["settings"])
    for key in sorted(set(want["settings"] or {}) | set(got["settings"] or {})):
        if key not in got["settings"] or key not in want["settings"] or got["settings"][key] != want["settings"][key]:
            _fail(where, "the setting %r of %s" % (key, what), "%s like %s" % (
                repr(want["settings"][key]) if key in want["settings"] else "absent", against),
                  got["settings"].get(key, "absent"))


def _sorted_find(keys, ids):
    """``(pos, hit)``: where each of ``ids`` is (or would go) in the sorted int64 array ``keys``, and
    whether it is there."""
    pos = np.searchsorted(keys, ids)
    hit = np.zeros(ids.size, np.bool_)
    if keys.size:
        inside = pos < keys.size
        hit[inside] = keys[pos[inside]] == ids[inside]
    return pos, hit


class _ServingMap:
    """A hash table's id -> row map for serving, in place of its ``HashCache`` (``Predictor``).

    ``ids``: the ids that own a row, sorted (int64); ``weight``: float32 ``[len(ids) + 2, dim]``, row
    0 the default row, row 1 zeros (reserved, as in HashEmbedding), then the rows of ``ids`` in their
    order. :meth:`find` maps raw ids to rows of ``weight``, any id without a row (unknown, evicted,
    never admitted) to the default row; nothing is counted or admitted. ``capacity`` is the rows of
    ``weight``. Never changed in place: a delta makes a new map (:meth:`merged`)."""

    __slots__ = ("ids", "weight")

    def __init__(self, ids, weight):
        self.ids, self.weight = ids, weight

    @classmethod
    def of(cls, ids, rows, default, weight=None):
        """The map of ``ids`` and their ``rows`` with the default row ``default``. ``weight``, when given,
        is the float32 array the map takes as its own, rows ``_HASH_RESERVED_ROWS`` on already ``rows``
        (``_BundleTable.weight``): the rows are not copied."""
        if weight is None:
            weight = np.empty((ids.size + _HASH_RESERVED_ROWS, default.shape[0]), np.float32)
            weight[_HASH_RESERVED_ROWS:] = rows
        weight[HASH_DEFAULT_ROW] = default
        weight[HASH_SCRATCH_ROW] = 0.0
        return cls(ids, weight)

    @property
    def capacity(self):
        """Rows of ``weight``."""
        return int(self.weight.shape[0])

    @property
    def rows(self):
        """The rows of ``ids`` (a view)."""
        return self.weight[_HASH_RESERVED_ROWS:]

    def __len__(self):
        return int(self.ids.size)

    def find(self, ids):
        """Rows (int32, the shape of ``ids``) of raw ids: their own rows, 0 (the default row) for the rest."""
        arr = _hash_ids("_ServingMap.find", ids)
        flat = arr.reshape(-1)
        out = np.zeros(flat.size, np.int32)
        if self.ids.size and flat.size:
            pos = np.minimum(np.searchsorted(self.ids, flat), self.ids.size - 1)
            hit = self.ids[pos] == flat
            out[hit] = pos[hit] + _HASH_RESERVED_ROWS
        return out.reshape(arr.shape)

    def merged(self, changed_ids, changed_rows, evicted_ids, default):
        """A new map: ``evicted_ids`` (all in this map) gone, ``changed_ids`` set to ``changed_rows`` (new
        or replaced), the default row ``default``. Both id arrays sorted and disjoint."""
        drop = np.zeros(self.ids.size, np.bool_)
        for ids in (evicted_ids, changed_ids):
            pos, hit = _sorted_find(self.ids, ids)
            drop[pos[hit]] = True
        keep = np.flatnonzero(~drop)
        kept = self.ids[keep]
        n = kept.size + changed_ids.size
        at = np.searchsorted(kept, changed_ids) + np.arange(changed_ids.size)   # both sorted, disjoint
        from_base = np.ones(n, np.bool_)
        from_base[at] = False
        ids = np.empty(n, np.int64)
        ids[at] = changed_ids
        ids[from_base] = kept
        weight = np.empty((n + _HASH_RESERVED_ROWS, self.weight.shape[1]), np.float32)
        weight[HASH_DEFAULT_ROW] = default
        weight[HASH_SCRATCH_ROW] = 0.0
        rows = weight[_HASH_RESERVED_ROWS:]
        rows[at] = changed_rows
        rows[from_base] = self.rows[keep]
        return _ServingMap(ids, weight)


_EXPORT_CHUNK_BYTES = 1 << 22       # an export gathers rows 4 MB at a time (a fixed buffer, whatever the table's size)


def _export_chunk_rows(table):
    """Rows of ``table`` an export gathers at a time: ``_EXPORT_CHUNK_BYTES`` of float32 rows."""
    return max(1, _EXPORT_CHUNK_BYTES // (4 * table.embedding_size))


def _table_owned(table):
    """``(ids, at)`` of a HashEmbedding: the ids that own a row (sorted int64) and their row numbers."""
    keys = table.cache.keys()                   # 12 bytes an entry, not the whole state's 28
    rows = np.empty(keys.size, np.int32)
    chunks = (keys[start:start + _ENTRY_CHUNK] for start in range(0, keys.size, _ENTRY_CHUNK))
    for start, values in zip(range(0, keys.size, _ENTRY_CHUNK), _entry_field_chunks(table.cache, chunks, 1)):
        rows[start:start + values.size] = values
    owned = rows >= 0
    if owned.all():               # no candidates (ids counted without a row): no copy
        return keys, rows
    return keys[owned], rows[owned]


def _owned_ids_chunked(table):
    """The ids that own a row of a HashEmbedding, sorted, for a full export: an ``_NpyChunks`` (int64,
    ``len(table.cache)`` of them) taken a range at a time (:func:`_sorted_key_ranges`). Where the cache
    holds candidates (ids counted, without a row), each piece's rows are looked up to drop them."""
    cache = table.cache
    owned, entries = len(cache), _cache_entry_count(cache)

    def pieces():
        if entries == owned:    # no candidates
            yield from _sorted_key_ranges(cache, entries)
            return
        taken = collections.deque()

        def copied():           # (copies: the lookups ahead hold them, never a view of the range before)
            for piece in _sorted_key_ranges(cache, entries):
                taken.append(piece.copy())
                yield taken[-1]
        for rows in _entry_field_chunks(cache, copied(), 1):
            piece = taken.popleft()
            yield piece[rows >= 0]
    return _NpyChunks((owned,), np.int64, pieces)


def _owned_rows_read_back(table, path, ids):
    """The rows of the ids a full export has just written to the ``.npy`` file ``path`` (``ids``, an
    ``_NpyChunks``), for :func:`_bundle_npy`: an ``_NpyChunks`` gathered a chunk at a time
    (:func:`_export_chunk_rows`, at most ``_ENTRY_CHUNK`` ids) from the ids read back from the file,
    their rows looked up (:func:`_entry_field_chunks`). A RuntimeError if one of them owns no row."""
    step = min(_ENTRY_CHUNK, _export_chunk_rows(table))

    def pieces():
        with open(path, "rb") as fh:
            back = _pieces_read_back(fh.fileno(), len(_npy_header_bytes(ids)), ids, step)
            for at in _entry_field_chunks(table.cache, back, 1):
                if at.size and at.min() < 0:
                    raise RuntimeError("recboost: an id an export wrote to %r owns no row (the table changed while "
                                       "it was exported)" % path)
                yield _owned_rows(table, at)
    return _NpyChunks((ids.shape[0], table.embedding_size), np.float32, pieces)


def _owned_rows(table, at):
    """The rows ``at`` (row numbers) of a HashEmbedding as :meth:`RecModel.predict` sees them: float32
    ``[len(at), dim]``, a copy. A row the cache handed out before the table grew to hold it (a
    prepared batch not yet taken) reads as zeros, as growth would make it."""
    at = np.asarray(at, np.int32)
    inside = at < table.weight.shape[0]
    if inside.all():
        return table.rows_float32(at)
    rows = np.zeros((at.size, table.embedding_size), np.float32)
    rows[inside] = table.rows_float32(at[inside])
    return rows


def _owned_rows_chunked(table, at):
    """:func:`_owned_rows` of ``at`` for :func:`_bundle_npy`, gathered a chunk at a time as they are
    written (an ``_NpyChunks``; :func:`_export_chunk_rows`): no copy of the whole table's rows."""
    step = _export_chunk_rows(table)
    return _NpyChunks((at.size, table.embedding_size), np.float32,
                      lambda: (_owned_rows(table, at[k:k + step]) for k in range(0, at.size, step)))


def _table_snapshot(table):
    """``(ids, rows, default)`` of a HashEmbedding as :meth:`RecModel.predict` sees it: the ids that own
    a row (sorted int64), their rows (float32 ``[n, dim]``, a copy: :func:`_owned_rows`) and the default
    row (a copy)."""
    ids, at = _table_owned(table)
    return ids, _owned_rows(table, at), table.rows_float32([HASH_DEFAULT_ROW])[0]


class _BundleTable:
    """One table of a bundle as read: its spec (``_table_spec``), ``ids`` (sorted int64), ``rows``
    (float32 ``[len(ids), dim]``), ``default`` (float32 ``[dim]``), in a delta ``evicted`` (sorted
    int64, disjoint from ``ids``; None in a full bundle), and ``weight``: None, or float32
    ``[_HASH_RESERVED_ROWS + len(ids), dim]`` whose rows from ``_HASH_RESERVED_ROWS`` on are ``rows``
    and whose first rows are free to write (the rows file read with room in front, ``_rows_with_room``)."""

    __slots__ = ("spec", "ids", "rows", "default", "evicted", "weight")

    def __init__(self, spec, ids, rows, default, evicted, weight=None):
        self.spec, self.ids, self.rows, self.default, self.evicted = spec, ids, rows, default, evicted
        self.weight = weight


class _Bundle:
    """A bundle read and checked whole by ``_read_bundle``: ``directory`` (absolute), ``manifest`` (the
    parsed JSON), ``network`` (its record, ``_network_record``), ``id``, ``kind`` ("full" or "delta"),
    ``base_id`` and ``base_directory`` (deltas; None otherwise), ``tables`` (``_BundleTable``, in network
    order), ``dense`` (parameter name -> Parameter, from ``mindspore.load_checkpoint``; None when not
    asked for) and ``mindir`` (the checked bytes of its MindIR, a uint8 array; None when not asked for)."""

    __slots__ = ("directory", "manifest", "network", "id", "kind", "base_id", "base_directory", "tables", "dense",
                 "mindir")

    def __init__(self, directory, manifest, network, tables, dense, mindir=None):
        self.directory, self.manifest, self.tables, self.dense, self.mindir = directory, manifest, tables, dense, mindir
        self.network = network
        self.id, self.kind = manifest["id"], manifest["kind"]
        base = manifest["base"]
        self.base_id = None if base is None else base["id"]
        self.base_directory = None if base is None else os.path.normpath(os.path.join(directory, base["path"]))


class _ServingState:
    """The state a chain of bundles gives: the last bundle's ``id``, ``directory``, ``manifest``,
    ``network`` (the record every bundle of the chain holds) and ``dense`` (None when not loaded), and
    per table its ``spec`` and ``_ServingMap``."""

    __slots__ = ("id", "directory", "manifest", "network", "specs", "maps", "dense")

    def __init__(self, bundle, specs, maps):
        self.id, self.directory, self.manifest = bundle.id, bundle.directory, bundle.manifest
        self.network, self.dense, self.specs, self.maps = bundle.network, bundle.dense, specs, maps


def _file_digest(path):
    """``(size in bytes, sha256 hex digest)`` of the file at ``path``."""
    sha, size = _Sha256Beside(), 0
    try:
        with open(path, "rb", buffering=0) as fh:
            chunk = min(_IO_CHUNK, max(1 << 16, os.fstat(fh.fileno()).st_size))
            views = [memoryview(bytearray(chunk)), memoryview(bytearray(chunk))]     # one read, one hashed
            while True:
                view = views[0]
                n = fh.readinto(view)
                if not n:
                    break
                sha.update(view[:n])
                size += n
                views.reverse()
    finally:
        sha.close()
    return size, sha.hexdigest()


def _file_read_hashed(path, size, room=0):
    """``(bytes read, sha256 hex digest, data)``: the file at ``path`` read once, from byte ``room`` on,
    into a new uint8 array ``data`` (:func:`_host_array`, its pages faulted in beside the reading; its
    first ``room`` bytes left for the caller) and hashed beside the reading, when it holds ``size``
    bytes. A file of another size is not read: ``(its size, None, None)``; one that ends early gives
    the bytes it held (``data`` is then shorter). What is returned is what was hashed: a reader that
    checks the digest and then uses ``data`` never reads the file again, so a file changed in between
    cannot be used unchecked."""
    with open(path, "rb", buffering=0) as fh:
        found = os.fstat(fh.fileno()).st_size
        if found != size:
            return found, None, None
        data, done, sha = _host_array(room + size, np.uint8), 0, _Sha256Beside()
        view = memoryview(data)[room:]
        try:
            with _FaultInBeside(data):
                while done < size:
                    got = fh.readinto(view[done:done + _IO_CHUNK])
                    if not got:
                        break
                    sha.update(view[done:done + got])
                    done += got
        finally:
            sha.close()
    return done, sha.hexdigest(), data[:room + done]


def _load_copy(data, name, load):
    """``load(path)`` of a private temporary copy of ``data``, the checked bytes of the bundle file
    ``name`` (MindSpore reads its checkpoints and MindIR files by path; the bundle's own file may have
    changed since it was checked). The copy, named ``...-<name>`` so its suffix stays, is removed after.
    Failing to write it is an OSError naming the folder and the bytes; ``load``'s errors are its own."""
    path = None
    try:
        fd, path = tempfile.mkstemp(prefix="recboost-", suffix="-" + name)
        with os.fdopen(fd, "wb") as fh:
            fh.write(memoryview(data))
    except OSError as exc:
        if path is not None:
            os.unlink(path)
        raise _io_failed(exc, "writing a copy of the checked bytes of %r (%d bytes) into %r, for MindSpore to "
                         "load" % (name, data.size, tempfile.gettempdir())) from exc
    try:
        return load(path)
    finally:
        os.unlink(path)


_IO_CHUNK = 1 << 22          # checkpoint and bundle files are written, read and digested 4 MB at a time
_HASH_BESIDE_BYTES = 1 << 16  # a piece this large or larger is hashed on _Sha256Beside's thread; smaller ones in line


class _Sha256Beside:
    """A sha256 fed piece by piece (:meth:`update`, then :meth:`hexdigest`) whose large pieces are
    hashed on a helper thread while the caller goes on: writes the piece, reads or gathers the next.
    hashlib releases the GIL on large buffers, so on two cores the digest runs beside the I/O instead
    of after it. Pieces are hashed in order, and the memory of a piece must stay unchanged until the
    next :meth:`update` or :meth:`close` returns (the thread reads it; no copy is made). :meth:`close`
    (also called by :meth:`hexdigest`) waits for the last piece and ends the thread; call it on every
    path (``try``/``finally``)."""

    def __init__(self):
        self.sha, self._pool, self._pending = hashlib.sha256(), None, None

    def update(self, data):
        """Hash ``data`` (bytes-like) after the pieces before it."""
        view = memoryview(data).cast("B")
        self._wait()
        if view.nbytes < _HASH_BESIDE_BYTES:
            self.sha.update(view)
            return
        if self._pool is None:
            import concurrent.futures  # pylint: disable=import-outside-toplevel
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recboost-sha256")
        try:
            self._pending = self._pool.submit(self.sha.update, view)
        except RuntimeError:        # no new threads while the interpreter exits (a save from atexit): in line
            self.sha.update(view)

    def _wait(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self):
        """Wait for the piece being hashed and end the helper thread."""
        try:
            self._wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def hexdigest(self):
        """The sha256 hex digest of every piece (:meth:`close` first)."""
        self.close()
        return self.sha.hexdigest()


def _sha256_hex(pieces):
    """The sha256 hex digest of the bytes-like ``pieces`` one after the other."""
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    return sha.hexdigest()


def _submitted(pool, fn, *args):
    """``pool.submit(fn, *args)``, or, where the pool takes no new work (no new threads while the
    interpreter exits: a save or a load from atexit), a future of ``fn(*args)`` run in line."""
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done = concurrent.futures.Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:            # pylint: disable=broad-except  (raised by result(), as from a thread)
            done.set_exception(exc)
        return done


class _DigestsBeside:
    """sha256 digests of bytes already whole in memory, each computed on one of two helper threads
    while the caller goes on: a checkpoint's load reads the next members meanwhile, so on two cores
    the reading and the digests of two members share them (one digest beside the reading,
    :class:`_Sha256Beside`'s way, runs at one core's sha256 rate, below the disk's read rate).
    :meth:`submit` gives a future of the hex digest; the pieces must stay unchanged until it is done.
    A context manager: leaving it drops the digests not yet started and waits for the others."""

    def __init__(self):
        import concurrent.futures  # pylint: disable=import-outside-toplevel
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="recboost-sha256")

    def submit(self, pieces):
        """A future of the sha256 hex digest of the bytes-like ``pieces`` one after the other."""
        return _submitted(self._pool, _sha256_hex, pieces)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._pool.shutdown(wait=True, cancel_futures=True)


class _HashingWriter:
    """A binary file that also counts and hashes (sha256, beside the write: :class:`_Sha256Beside`) the
    bytes written to it, ``_IO_CHUNK`` at a time (each chunk hashed while it is written, so both read
    it from the cache). ``sha.hexdigest()`` gives the digest; ``sha.close()`` on every path."""

    def __init__(self, fh):
        self.fh, self.sha, self.size = fh, _Sha256Beside(), 0

    def write(self, data):
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _IO_CHUNK):
            piece = view[start:start + _IO_CHUNK]
            self.sha.update(piece)
            self.fh.write(piece)
            self.size += piece.nbytes
        return view.nbytes


def _bundle_file(folder, name, nbytes, write):
    """Write the bundle file ``name`` into ``folder``: ``write(path)`` writes and fsyncs it. An OSError
    is raised naming the path and the bytes being written (``nbytes``, or a function giving them)."""
    path = os.path.join(folder, name)
    try:
        write(path)
    except OSError as exc:
        raise _io_failed(exc, "writing %d bytes to %r" % (nbytes() if callable(nbytes) else nbytes, path)) from exc
    return name


def _bundle_npy(folder, name, array, files):
    """Write ``array`` (an array, or an ``_NpyChunks`` written piece by piece) as the ``.npy`` file
    ``name`` in ``folder`` (fsynced) and list its size and sha256 in ``files``; returns ``name``."""
    if not isinstance(array, _NpyChunks):
        array = np.ascontiguousarray(array)

    def write(path):
        with open(path, "xb") as fh:
            out = _HashingWriter(fh)
            try:
                with _WritebackBeside(fh):
                    _write_npy(out, array)      # hashed beside the write (and the gather of the next piece)
            finally:
                out.sha.close()
        files[name] = {"bytes": out.size, "sha256": out.sha.hexdigest()}

    return _bundle_file(folder, name, len(_npy_header_bytes(array)) + array.nbytes, write)


def _bundle_dense(folder, network, files):
    """Write the parameters of ``network`` as ``dense.ckpt`` in ``folder`` (``mindspore.save_checkpoint``,
    fsynced) and list its size and sha256 in ``files``."""
    def write(path):
        ms.save_checkpoint(network, path)
        _fsync_path(path)
        size, digest = _file_digest(path)
        files[_BUNDLE_DENSE] = {"bytes": size, "sha256": digest}

    values = sum(int(np.prod(p.shape)) * p.itemsize for p in network.get_parameters())
    return _bundle_file(folder, _BUNDLE_DENSE, values, write)


#: What ``mindspore.export`` raises for a network it cannot compile or write (a construct graph mode
#: cannot compile, an unsupported operator or input): ``_bundle_mindir`` names the network with it.
_EXPORT_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError, IndexError, KeyError,
                  NameError)


def _mindir_inputs(model, inputs):
    """The ``mindir`` field's ``inputs`` of a bundle: per input of the network, as ``RecModel.predict``
    feeds it (``inputs``: its ready Tensors on a sample batch), its ``name`` (``construct``'s
    parameter; None past them), ``shape`` (-1 for the batch dimension: any batch size), ``dtype``
    (numpy's name) and ``tables``: the hash tables (their positions in the manifest's ``tables``)
    whose rows it holds, side by side in that order (empty: the batch item as given)."""
    names, positions = _construct_names(model.network), model.table_positions
    return [{"name": names[k] if k < len(names) else None, "shape": [-1] + [int(d) for d in tensor.shape[1:]],
             "dtype": tensor.asnumpy().dtype.name,
             "tables": [i for i, items in enumerate(positions) if k in items]} for k, tensor in enumerate(inputs)]


def _bundle_mindir(where, folder, network, inputs, files):
    """Write ``network`` as MindIR, ``dense.mindir`` in ``folder`` (``mindspore.export`` in eval mode on
    placeholders of the shapes and dtypes of ``inputs``, its ready Tensors on a sample batch, the
    batch dimension dynamic; fsynced) and list its size and sha256 in ``files``. The cells' train
    flags and the context's ``jit_syntax_level`` (which ``mindspore.export`` sets) are restored
    after. A network MindSpore cannot export is a ValueError naming its class and MindSpore's error."""
    placeholders = [Tensor(shape=[None] + list(t.shape[1:]), dtype=t.dtype) for t in inputs]
    cls = type(network)
    shapes = ", ".join("[B%s] %s" % ("".join(", %d" % d for d in t.shape[1:]), t.dtype) for t in inputs)

    def write(path):
        flags = [(cell, cell.training) for _, cell in network.cells_and_names()]
        syntax = ms.get_context("jit_syntax_level")
        before = set(os.listdir(folder))
        network.set_train(False)
        try:
            ms.export(network, *placeholders, file_name=path, file_format="MINDIR")
        except _EXPORT_ERRORS as exc:
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            _fail(where, "the network %s.%s ('mindir')" % (cls.__module__, cls.__qualname__),
                  "a network mindspore.export writes as MindIR on its inputs (%s)" % shapes,
                  "%s: %s" % (type(exc).__name__, first[:400]))
        finally:
            ms.set_context(jit_syntax_level=syntax)
            for cell, flag in flags:
                cell.set_train(flag)
        extra = sorted(set(os.listdir(folder)) - before - {_BUNDLE_MINDIR})
        if extra:
            _fail(where, "the MindIR of the network %s.%s ('mindir')" % (cls.__module__, cls.__qualname__),
                  "one file %s (parameters mindspore.export saves with the graph)" % _BUNDLE_MINDIR,
                  "also %s" % extra)
        _fsync_path(path)
        files[_BUNDLE_MINDIR] = dict(zip(("bytes", "sha256"), _file_digest(path)))

    values = sum(int(np.prod(p.shape)) * p.itemsize for p in network.get_parameters())
    return _bundle_file(folder, _BUNDLE_MINDIR, values, write)


def _check_new_directory(where, name, directory):
    """``directory`` (a path) must not exist or be an empty directory: a bundle is never overwritten."""
    if not isinstance(directory, (str, os.PathLike)):
        _fail(where, "'%s'" % name, "a directory path", directory, TypeError)
    directory = os.fspath(directory)
    if os.path.lexists(directory):
        if not os.path.isdir(directory):
            _fail(where, "'%s'" % name, "a new or empty directory", "%r, which is a file" % directory)
        if os.listdir(directory):
            _fail(where, "'%s'" % name, "a new or empty directory (a bundle is never overwritten)",
                  "%r, which is not empty" % directory)
    return directory


def _write_bundle(where, name, directory, fill):
    """Write the bundle directory ``directory`` all at once: ``fill(folder)`` writes and fsyncs every
    file into a sibling temporary directory ``.tmp-<pid>-<random>.bundle``, which is fsynced and
    renamed onto ``directory`` (absent or empty), then the parent is fsynced. ``directory`` is absent
    (or empty) or the complete bundle, never a part; on any failure the temporary directory is
    removed and the exception raised; an OSError (a full disk, an I/O error, a permission) names the
    path and the bytes being written (``_bundle_file``) and the bundle that was not written. A failure
    to sync the parent after the rename is logged: the bundle is then whole and in place."""
    target = os.path.abspath(directory)
    parent = os.path.dirname(target)
    tmp = os.path.join(parent, ".tmp-%d-%s.bundle" % (os.getpid(), uuid.uuid4().hex[:12]))
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as exc:
        raise _io_failed(exc, "making the directory %r for the bundle %r (nothing was written)" % (tmp, target)) \
            from exc
    try:
        fill(tmp)
        try:
            _fsync_path(tmp)
        except OSError as exc:
            raise _io_failed(exc, "syncing the directory %r" % tmp) from exc
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if os.path.isdir(target) and os.listdir(target):       # created meanwhile by someone else
                _fail(where, "'%s'" % name, "a new or empty directory (a bundle is never overwritten)",
                      "%r (%s)" % (directory, exc.strerror))
            raise _io_failed(exc, "renaming %r to %r" % (tmp, target)) from exc
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _io_failed(exc, "the bundle %r was not written (nothing of it is left)" % target) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _fsync_path(parent)
    except OSError as exc:      # the bundle is whole and in place (readers may be using it): not undone
        _log("%s: the bundle %s is written whole, but syncing its folder failed (%s): a crash of the machine "
             "may lose it" % (where, target, exc))


def _bundle_schema():
    """The schema (``_validate``) of a bundle's manifest.json: a full bundle, or a delta naming its base;
    the network (``_network_record``); every file listed with its size and sha256, each table's files
    among them."""
    text = _Rule("a str", str, test=bool)
    bundle_id = _Rule("a bundle id (str)", str, test=bool)

    def listed(got):
        return _Rule("a file listed in 'files'", str, test=lambda v: _FILE_NAME.test(v) and v in got["files"])

    def table_files(got):
        parts = ("ids", "rows", "default") + (("evicted",) if got["kind"] == "delta" else ())
        return _Fields({part: listed(got) for part in parts})

    def distinct_names(got, at, checking):
        names = [p["name"] for p in got["parameters"]]
        if len(set(names)) != len(names):
            checking.fail(checking.field(at, "parameters"), "parameters of distinct names", _Given(names), ValueError)
        return got

    network = _Fields({
        "class": _Rule("a class (module:qualname)", str, test=lambda v: ":" in v),
        "settings": _Map(_ANY, expected="an object of settings").or_none(),
        "parameters": _List(_Fields({"name": text, "shape": _List(_Int(0)), "dtype": text},
                                    expected="an object with 'name', 'shape' and 'dtype'")),
    }, expected="an object with 'class', 'settings' and 'parameters'", relate=distinct_names)
    return _Fields({
        "kind": _Rule("'full' or 'delta'", test=lambda v: v in ("full", "delta")),
        "id": bundle_id, "version": text, "network": network, "step": _COUNT,
        "base": lambda got: _Rule("null (a full bundle has no base)", test=lambda v: v is None)
        if got["kind"] == "full" else _Fields({"id": bundle_id, "path": _Rule("a path (str)", str, test=bool)},
                                              expected="an object with 'id' and 'path'"),
        "files": _Map(_Fields({"bytes": _COUNT, "sha256": _Rule("a hex digest (str)", str, test=bool)}),
                      key=_FILE_NAME, expected="an object of file names"),
        "dense": listed,
        "tables": lambda got: _List(_Fields({
            "name": text, "embedding_size": _Int(1), "combiner": text.or_none(), "padding_id": _Int().or_none(),
            "rows": _COUNT, "files": table_files(got)})),
        "mindir": lambda got: _Fields({
            "file": listed(got),
            "inputs": _List(_Fields({
                "name": text.or_none(), "shape": _List(_Int(-1)), "dtype": text,
                "tables": _List(_Rule("a position in 'tables' (an int >= 0 and < %d)" % len(got["tables"]), int,
                                      test=lambda v: 0 <= v < len(got["tables"])))},
                expected="an object with 'name', 'shape', 'dtype' and 'tables'"))},
            expected="an object with 'file' and 'inputs'").or_none().optional(None),
    })


_BUNDLE_SCHEMA = _bundle_schema()


def _bundle_format_of(data):
    """The ``format`` (an int) a bundle's manifest content ``data`` states, read without any check (to
    name another format when it fails this one's checks); None when it states none."""
    try:
        found = json.loads(data.decode("utf-8")).get("format")
    except (ValueError, AttributeError, RecursionError):
        return None
    return found if type(found) is int else None


def _bundle_format_expected(found):
    """How the bundle format this recboost reads is asked for, given the format ``found``."""
    return "%d (the bundle format this recboost reads%s)" % (_BUNDLE_FORMAT, "; a format-1 bundle, written by "
                                                                  "an earlier recboost, has no checksum on its "
                                                                  "manifest and no record of its network: export "
                                                                  "it again" if found == 1 else "")


def _bundle_files_checked(directory, files, used, bad):
    """Every file ``files`` lists (the manifest's field: name -> ``bytes``, ``sha256``) checked in name
    order: present, of its size, of its sha256, else ``bad(what, expected, got)`` (it raises). Returns
    name -> the checked bytes (a uint8 array) of each file in ``used`` (name -> bytes of room left in
    front of them, :func:`_file_read_hashed`), each read once; the others are only digested."""
    data = {}
    for fname, info in sorted(files.items()):
        path = os.path.join(directory, fname)
        expected = "%d bytes with sha256 %s" % (info["bytes"], info["sha256"])
        if not os.path.isfile(path):
            bad("the file %r" % fname, expected, "missing")
        try:
            size, digest, data[fname] = _file_read_hashed(path, info["bytes"], used[fname]) if fname in used \
                else _file_digest(path) + (None,)
        except OSError as exc:
            bad("the file %r" % fname, expected, "unreadable (%s: %s)" % (type(exc).__name__, exc))
        if size != info["bytes"]:
            bad("the file %r" % fname, expected, "%d bytes (truncated or altered)" % size)
        if digest != info["sha256"]:
            bad("the file %r" % fname, expected, "sha256 %s (altered)" % digest)
    return data


def _rows_with_room(data, rows, room):
    """``rows`` (float32 ``[n, dim]``, a view of the uint8 array ``data``) as rows ``room`` on of a
    float32 ``[room + n, dim]`` view of ``data`` whose first ``room`` rows lie in ``data`` in front of
    them (their bytes free to write); None when ``data`` has no such room (or n is 0)."""
    front = rows.ctypes.data - data.ctypes.data - room * rows.shape[1] * 4
    if not rows.size or front < 0 or front % 4 or not rows.flags.c_contiguous or rows.dtype != np.float32:
        return None
    weight = data[front:front + (room + rows.shape[0]) * rows.shape[1] * 4].view(np.float32).reshape(-1, rows.shape[1])
    same = weight.shape[0] == room + rows.shape[0] and weight[room:].ctypes.data == rows.ctypes.data
    return weight if same else None         # (rows not a view of data: a copy, e.g.)


def _npy_view(raw, bad):
    """The array the bytes ``raw`` (a uint8 array) of a .npy file hold, as a view of them (no copy);
    the header parsed strictly (:func:`_npy_layout`); ``bad(problem)`` raises."""
    at = 0

    def take(n, _):
        nonlocal at
        at += n
        if at > raw.size:
            bad("it ends inside its .npy header")
        return raw[at - n:at].tobytes()
    dtype, shape, fortran_order, start = _npy_layout(take, raw.size, "file", bad)
    array = raw[start:].view(dtype)
    return array.reshape(shape[::-1]).transpose() if fortran_order else array.reshape(shape)


def _read_bundle(where, label, directory, dense=True, mindir=False):
    """Read the bundle at ``directory`` (``label`` says what it is to the caller of ``where``, e.g.
    ``"'directory'"`` or ``"the base of the delta '...'"``) and check it whole,
    changing nothing: the manifest and its format, every file's size and sha256 (a truncated, altered
    or missing file is caught), every array's dtype and shape. Each file used is read once, and what
    is used is what was checked. With ``dense`` the dense parameters are loaded too; with ``mindir``
    the MindIR's checked bytes are kept (``_Bundle.mindir``). Returns a ``_Bundle``; a bad bundle
    raises a ValueError (TypeError for a bad argument type) naming the argument, the bundle, the
    expected and the given."""
    if not isinstance(directory, (str, os.PathLike)):
        _fail(where, label, "a bundle directory path", directory, TypeError)
    directory = os.path.abspath(os.fspath(directory))
    manifest_path = os.path.join(directory, _BUNDLE_MANIFEST)
    if not os.path.isfile(manifest_path):
        _fail(where, label, "a bundle directory written by RecModel.export (holding %s)"
              % _BUNDLE_MANIFEST, directory if os.path.exists(directory) else "%s (missing)" % directory)
    of = "of the bundle %r (%s)" % (directory, label)

    def bad(what, expected, got):
        _fail(where, "%s %s" % (what, of), expected, got)

    try:
        with open(manifest_path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        bad("the %s" % _BUNDLE_MANIFEST, "a readable file", "unreadable (%s: %s)" % (type(exc).__name__, exc))
    try:
        manifest = _parse_json_checked(data, "the %s %s" % (_BUNDLE_MANIFEST, of))
    except ValueError as exc:
        found = _bundle_format_of(data)          # another format, e.g. 1 (no checksum): refused by its name
        if found is not None and found != _BUNDLE_FORMAT:
            bad("the format", _bundle_format_expected(found), found)
        raise ValueError("For '%s', %s" % (where, exc)) from None
    found = manifest.get("format")
    if type(found) is not int or found != _BUNDLE_FORMAT:
        bad("the format", _bundle_format_expected(found), found)

    def fail(at, expected, got, exc):
        bad("the manifest field %r" % at, expected, "missing" if got is _ABSENT else got)

    got = _validate(manifest, _BUNDLE_SCHEMA, _Checking.manifest(fail))
    kind, files, tables, dense_file = got["kind"], got["files"], got["tables"], got["dense"]
    # -- every file: present, of its size, of its sha256; what is used after is what was checked (read once)
    used = {name: 0 for info in tables for name in info["files"].values()}
    for info in tables:     # room for the reserved rows in front of the rows: _ServingMap.of takes them in place
        used[info["files"]["rows"]] = _HASH_RESERVED_ROWS * info["embedding_size"] * 4
    used.update({dense_file: 0} if dense else {})
    used.update({got["mindir"]["file"]: 0} if mindir and got["mindir"] is not None else {})
    data = _bundle_files_checked(directory, files, used, bad)
    # -- every array
    read = []
    for i, info in enumerate(tables):
        dim = info["embedding_size"]

        def load(part, dtype, shape):
            fname = info["files"][part]
            arr = _npy_view(data[fname][used[fname]:], lambda problem: bad("the file %r" % fname, "a .npy array",
                                                                           "unreadable (%s)" % problem))
            wrong = lambda at, expected, got, exc: bad(                                   # noqa: E731
                "the file %r (hash table %d %r)" % (fname, i, info["name"]), expected, got)
            return _validate(arr, _array_rule(dtype, shape), _Checking.manifest(wrong))

        def increasing(arr, part):
            if arr.size > 1 and not np.all(arr[1:] > arr[:-1]):
                bad("the file %r (hash table %d %r)" % (info["files"][part], i, info["name"]),
                    "strictly increasing ids", "unsorted or repeated ids")
            return arr

        ids = increasing(load("ids", np.int64, (None,)), "ids")
        if ids.size != info["rows"]:
            bad("the file %r (hash table %d %r)" % (info["files"]["ids"], i, info["name"]),
                "%d ids (the manifest field 'tables[%d].rows')" % (info["rows"], i), "%d ids" % ids.size)
        rows = load("rows", np.float32, (ids.size, dim))
        default = load("default", np.float32, (dim,))
        evicted = None
        if kind == "delta":
            evicted = increasing(load("evicted", np.int64, (None,)), "evicted")
            if np.intersect1d(ids, evicted, assume_unique=True).size:
                bad("the file %r (hash table %d %r)" % (info["files"]["evicted"], i, info["name"]),
                    "ids disjoint from the changed ids", "ids in both")
        spec = {key: info[key] for key in ("name", "embedding_size", "combiner", "padding_id")}
        weight = _rows_with_room(data[info["files"]["rows"]], rows, _HASH_RESERVED_ROWS)
        read.append(_BundleTable(spec, ids, rows, default, evicted, weight))

    def load_checkpoint(path):
        try:
            return ms.load_checkpoint(path)
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            return bad("the file %r" % dense_file, "a MindSpore checkpoint", "unreadable (%s)" % exc)
    params = None
    if dense:
        params = _load_copy(data[dense_file], dense_file, load_checkpoint)
        listed = sorted(got["network"]["parameters"], key=lambda p: p["name"])
        held = _parameter_records(params)
        if held != listed:
            first = next((h, w) for h, w in itertools.zip_longest(held, listed, fillvalue=None) if h != w)
            bad("the file %r" % dense_file, "the parameters the manifest lists (network.parameters: %d, the first "
                "differing %s)" % (len(listed), first[1]), "%d parameters, the first differing %s" % (
                    len(held), first[0]))
    graph = data[got["mindir"]["file"]] if mindir and got["mindir"] is not None else None
    return _Bundle(directory, manifest, got["network"], read, params, graph)


def _check_specs(where, what, want, got, against):
    """The table specs ``got`` (of ``what``) must equal ``want`` (those of ``against``), table by table."""
    if [s["name"] for s in got] != [s["name"] for s in want]:
        _fail(where, "the hash tables of %s" % what, "the tables %s of %s" % ([s["name"] for s in want], against),
              [s["name"] for s in got])
    for i, (mine, theirs) in enumerate(zip(got, want)):
        for key in ("embedding_size", "combiner", "padding_id"):
            if mine[key] != theirs[key]:
                _fail(where, "the %s of hash table %d %r of %s" % (key, i, mine["name"], what),
                      "%r like %s" % (theirs[key], against), mine[key])


def _resolve_bundle(where, name, directory, dense=False):
    """The serving state bundle ``directory`` gives: a full bundle as read; a delta applied to the state
    of its base, resolved in turn through the base paths the manifests name (``_apply_delta``, the
    code ``Predictor.apply`` runs). Reads and checks every bundle of the chain; changes nothing. With
    ``dense`` the dense parameters of ``directory`` itself are loaded."""
    bundle = _read_bundle(where, "'%s'" % name, directory, dense)
    chain, seen = [], {bundle.id}
    while bundle.kind == "delta":
        chain.append(bundle)
        base = _read_bundle(where, "the base of the delta %r (its manifest's base.path)" % bundle.directory,
                            bundle.base_directory, dense=False)
        if base.id != bundle.base_id:
            _fail(where, "the base of the delta %r ('%s')" % (bundle.directory, name),
                  "the bundle %s (its manifest's base.id)" % bundle.base_id,
                  "the bundle %s at %r" % (base.id, base.directory))
        if base.id in seen:
            _fail(where, "the chain of bases of %r ('%s')" % (directory, name), "a chain ending at a full bundle",
                  "a loop through the bundle %s" % base.id)
        seen.add(base.id)
        bundle = base
    state = _ServingState(bundle, [t.spec for t in bundle.tables],
                          [_ServingMap.of(t.ids, t.rows, t.default, t.weight) for t in bundle.tables])
    for delta in reversed(chain):
        state = _apply_delta(where, name, state, delta)
    return state


def _apply_delta(where, name, state, delta):
    """``state`` (a ``_ServingState``) with the delta bundle ``delta`` (given as the argument ``name``)
    applied, as a new state; ``state`` is unchanged. The delta's base must be the state's bundle and
    its tables the state's; every evicted id must own a row in the state."""
    if delta.kind != "delta":
        _fail(where, "'%s'" % name, "a delta bundle (written by RecModel.export with 'base')",
              "the full bundle %r (id %s)" % (delta.directory, delta.id))
    if delta.base_id != state.id:
        _fail(where, "'%s'" % name, "a delta on the current bundle %r (id %s)" % (state.directory, state.id),
              "the delta %r (id %s) on the bundle %r (id %s)" % (delta.directory, delta.id, delta.base_directory,
                                                                 delta.base_id))
    _check_specs(where, "the delta %r ('%s')" % (delta.directory, name), state.specs,
                 [t.spec for t in delta.tables], "its base %r" % state.directory)
    _check_network(where, "the network of the delta %r ('%s')" % (delta.directory, name), state.network,
                   delta.network, "its base %r" % state.directory)
    maps = []
    for i, (old, table) in enumerate(zip(state.maps, delta.tables)):
        _, hit = _sorted_find(old.ids, table.evicted)
        if not hit.all():
            _fail(where, "the evicted ids of hash table %d %r of the delta %r ('%s')" % (
                i, table.spec["name"], delta.directory, name), "ids of its base %r" % state.directory,
                  "%d ids the base does not hold" % int(np.count_nonzero(~hit)))
        maps.append(old.merged(table.ids, table.rows, table.evicted, table.default))
    return _ServingState(delta, list(state.specs), maps)


def _mindir_sample(where, mindir, first_batch=False):
    """``RecModel.export``'s ``mindir`` (or with ``first_batch`` ``OnlineExport``'s, where True stands for
    the first training batch and False for none) as the arguments of ``RecModel.predict`` (a tuple);
    None for None (and False), True for True."""
    if mindir is None or first_batch and isinstance(mindir, bool):
        return mindir or None
    if isinstance(mindir, (tuple, list)):
        return tuple(mindir)
    if isinstance(mindir, dict):
        return (mindir,)
    return _fail(where, "'mindir'", "%sNone or a sample batch of the inputs RecModel.predict takes (a tuple such "
                 "as (dense, ids), or a dict): the MindIR's inputs get their shapes after the batch dimension and "
                 "their dtypes from it" % ("True (the first training batch), False, " if first_batch else ""),
                 mindir, TypeError)


def _export_bundle(model, directory, base, ready):
    """``RecModel.export``: see there. ``ready``: None (no MindIR), or a function giving the network's
    input Tensors on the sample batch of ``mindir`` (``RecModel.predict``'s lookup)."""
    where = "RecModel.export"
    if model.checkpoint_shard is not None:
        _fail(where, "the hash tables", "whole tables (a row-wise model holds one shard per rank: load its "
              "checkpoint in one process and export there)", "row-wise shards")
    directory = _check_new_directory(where, "directory", directory)
    if base is not None and not isinstance(base, (str, os.PathLike)):
        _fail(where, "'base'", "None or a bundle directory path", base, TypeError)
    between = contextlib.ExitStack()
    between.enter_context(model.between_steps())        # one consistent point between steps
    try:
        ready = None if ready is None else ready()
        specs = [_table_spec(table) for table in model.tables]
        network = _network_record(model.network)
        previous = None
        if base is not None:
            previous = _resolve_bundle(where, "base", base)
            _check_specs(where, "this model", previous.specs, specs, "the base %r ('base')" % previous.directory)
            _check_network(where, "this model's network", previous.network, network,
                           "the base %r ('base')" % previous.directory)
        bundle_id = uuid.uuid4().hex
        target = os.path.abspath(directory)
        manifest = {"format": _BUNDLE_FORMAT, "kind": "full" if previous is None else "delta", "id": bundle_id,
                    "base": None if previous is None else {
                        "id": previous.id, "path": os.path.relpath(previous.directory, target)},
                    "version": __version__, "network": network, "step": int(model.step),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

        def fill(folder):
            files, tables = {}, []
            _bundle_dense(folder, model.network, files)
            if ready is not None:
                manifest["mindir"] = {"file": _bundle_mindir(where, folder, model.network, ready, files),
                                      "inputs": _mindir_inputs(model, ready)}
            for i, (table, spec) in enumerate(zip(model.tables, specs)):
                names = {}
                if previous is None:    # the ids sorted a range at a time, the rows gathered from them as read back
                    ids = _owned_ids_chunked(table)
                    names["ids"] = _bundle_npy(folder, "table-%d-ids.npy" % i, ids, files)
                    rows = _owned_rows_read_back(table, os.path.join(folder, names["ids"]), ids)
                else:                   # the rows gathered chunk by chunk, never whole
                    ids, at = _table_owned(table)
                    old = previous.maps[i]
                    pos, hit = _sorted_find(old.ids, ids)
                    changed, step = ~hit, _export_chunk_rows(table)
                    for k in range(0, ids.size, step):
                        both = np.flatnonzero(hit[k:k + step]) + k
                        if both.size:
                            changed[both] = np.any(_owned_rows(table, at[both]).view(np.uint32) !=
                                                   old.rows[pos[both]].view(np.uint32), axis=1)
                    _, kept = _sorted_find(ids, old.ids)
                    names["evicted"] = _bundle_npy(folder, "table-%d-evicted.npy" % i, old.ids[~kept], files)
                    ids, at = ids[changed], at[changed]
                    names["ids"] = _bundle_npy(folder, "table-%d-ids.npy" % i, ids, files)
                    rows = _owned_rows_chunked(table, at)
                names["rows"] = _bundle_npy(folder, "table-%d-rows.npy" % i, rows, files)
                names["default"] = _bundle_npy(folder, "table-%d-default.npy" % i,
                                               table.rows_float32([HASH_DEFAULT_ROW])[0], files)
                tables.append(dict(spec, rows=int(ids.shape[0]), files=names))
            manifest.update(dense=_BUNDLE_DENSE, tables=tables, files=files)
            _bundle_file(folder, _BUNDLE_MANIFEST, lambda: len(_json_checked_bytes(manifest)),
                         lambda path: _write_json_checked(path, manifest))

        _write_bundle(where, "directory", directory, fill)
    finally:
        between.close()
    return directory


class Predictor:
    """Serve a bundle written by :meth:`RecModel.export`: predictions from raw ids, nothing trained.

    ``Predictor(network, directory)``: ``network`` is a freshly built copy of the exported network
    (same class and arguments; its hash tables with the same names, row widths, combiners and
    padding ids, and empty: a table holding ids is refused, so a trained network is never taken
    over), ``directory`` a full bundle or a delta (its chain of bases is followed through the
    paths the manifests name). The dense parameters are loaded from the bundle's ``dense.ckpt``
    (``mindspore.load_checkpoint`` / ``load_param_into_net``); each hash table gets the bundle's id ->
    row map in place of its HashCache and the bundle's rows as its ``weight``. :meth:`predict` runs
    the network as :meth:`RecModel.predict` does (a RecModel wraps it): raw ids are mapped, ids
    without a row (never admitted, evicted, unknown) read the default row, nothing is admitted,
    counted or changed. A fresh process gives the same output as ``RecModel.predict`` at the export,
    bit for bit.

    Everything is read and checked before anything of ``network`` changes: the format, the
    manifest's checksum, every file's size and sha256, the tables, and the network the bundle records
    (``_check_network``): the same class, the same parameters (a missing, extra or differently shaped
    one), the same settings recboost built it with (a :class:`WideDeep` with ``deepfm`` for a Wide&Deep
    bundle); the first difference is a ValueError naming it. :meth:`apply` moves to the next delta the
    same way (a delta must record its base's network).

    Threads: a Predictor may be called from any number of threads. MindSpore's compiled cells are
    not safe to run concurrently (they crash the process), so :meth:`predict` runs one call at a
    time (a lock; throughput is that of one thread, see bench/bench_export.py). :meth:`apply`
    builds the new state aside (reads, checks and merges the delta while predictions go on) and
    swaps it in under the same lock: every prediction is the model before or after a delta, never
    a mix. Concurrent :meth:`apply` calls run one after the other.

    Attributes:
        bundle_id (str): the id of the bundle served (after :meth:`apply`, the delta's).
        directory (str): its directory.
        step (int): the ``RecModel.step`` it was exported at.
        network (Cell): the network.
    """

    def __init__(self, network, directory):
        where = "Predictor"
        if not isinstance(network, nn.Cell):
            _fail(where, "'network'", "a Cell (a freshly built copy of the exported network)",
                  type(network).__name__, TypeError)
        model = RecModel(network)               # checks the tables' input_index; changes nothing
        for table in model.tables:             # never the trained network itself: its tables would be lost
            if isinstance(table.cache, _ServingMap) or len(table.cache):
                _fail(where, "the hash table %r of 'network'" % table.table_name, "a fresh table (a Predictor "
                      "replaces its map and rows: pass a freshly built copy of the network)",
                      "a table holding %d ids" % len(table.cache))
        state = _resolve_bundle(where, "directory", directory, dense=True)
        self._check(where, "directory", state, model)
        self._model, self._state = model, None
        self._serving = threading.Lock()        # one prediction or one swap at a time
        self._applying = threading.Lock()       # one apply at a time (its reading and merging take long)
        self._install(state)

    @staticmethod
    def _check(where, name, state, model):
        _check_specs(where, "'network'", state.specs, [_table_spec(t) for t in model.tables],
                     "the bundle %r ('%s')" % (state.directory, name))
        _check_network(where, "'network'", state.network, _network_record(model.network),
                       "the bundle %r ('%s')" % (state.directory, name))

    def _install(self, state):
        """Swap in a checked state: the dense parameters, then each table's map and rows."""
        params = self._model.network.parameters_dict()             # names and shapes: checked by _check_network
        _assign_parameters((params[name], value.asnumpy()) for name, value in state.dense.items())
        for table, serving in zip(self._model.tables, state.maps):
            table.cache = serving
            table.store.serve(serving.weight)
        state.dense = None                                # loaded: not kept twice
        self._state = state

    @property
    def bundle_id(self):
        return self._state.id

    @property
    def directory(self):
        return self._state.directory

    @property
    def step(self):
        return int(self._state.manifest["step"])

    @property
    def network(self):
        return self._model.network

    def predict(self, *inputs):
        """The network's output (numpy) on one batch of inputs (raw hash ids; arrays or Tensors), as
        :meth:`RecModel.predict` gives it. Safe from any thread (one call runs at a time)."""
        with self._serving:
            return self._model.predict(*inputs).asnumpy()

    def apply(self, delta_directory):
        """Move to the delta bundle at ``delta_directory``: its base must be the bundle served now
        (else a ValueError naming both bundles, their directories and ids). The delta is read and
        checked whole (format, sizes, sha256, tables, parameters) before anything changes, then
        swapped in atomically (see the class docstring on threads).

        Returns:
            Predictor: self.
        """
        where = "Predictor.apply"
        with self._applying:                    # built aside while predictions go on, then swapped in whole
            delta = _read_bundle(where, "'delta_directory'", delta_directory, dense=True)
            state = _apply_delta(where, "delta_directory", self._state, delta)
            self._check(where, "delta_directory", state, self._model)
            with self._serving:
                self._install(state)
        return self


def load_mindir(directory):
    """The dense network of the bundle at ``directory`` as MindSpore serves it: ``mindspore.load`` of
    its ``dense.mindir`` in a ``mindspore.nn.GraphCell``, after the bundle is read and checked whole
    as :class:`Predictor` checks it (the manifest's checksum, every file's size and sha256: a damaged
    ``dense.mindir`` is refused by name). A bundle exported without ``mindir`` is a ValueError.

    The cell takes the inputs the manifest's ``mindir.inputs`` lists: each hash table's rows looked
    up from the bundle's files (docs/serving.md, "Serving without recboost"), the other items as
    given. A process without recboost loads the file with ``mindspore.load`` alone; this is that
    load with the bundle's checks.

    Returns:
        mindspore.nn.GraphCell: the network, in eval mode.
    """
    where = "load_mindir"
    bundle = _read_bundle(where, "'directory'", directory, dense=False, mindir=True)
    record = bundle.manifest.get("mindir")
    if record is None:
        _fail(where, "the manifest field 'mindir' of the bundle %r ('directory')" % bundle.directory,
              "a MindIR of the network (export with RecModel.export(..., mindir=<a sample batch>))",
              "none: the bundle was exported without it")

    def load(path):
        try:
            return ms.load(path)
        except (OSError, RuntimeError, ValueError, TypeError) as exc:
            return _fail(where, "the file %r of the bundle %r ('directory')" % (record["file"], bundle.directory),
                         "a MindIR mindspore.load reads", "unreadable (%s: %s)" % (type(exc).__name__, str(exc)[:300]))
    return nn.GraphCell(_load_copy(bundle.mindir, record["file"], load))


def _export_bundles(directory):
    """The bundles ``bundle-<step>`` of the export directory ``directory`` (:class:`OnlineExport`,
    ``recboost train --export``), by step: a list of ``(step, path)`` (empty when it holds none or
    does not exist)."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        match = re.fullmatch(r"bundle-(\d+)", name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


class OnlineExport(_Callback):
    """Serving bundles from a long :class:`RecModel` run: every ``every_steps`` steps (and at train end
    when ``export_on_end``) the bundle ``<directory>/bundle-<step>`` (:meth:`RecModel.export`, step
    zero-padded to 9 digits): the first a full bundle, each later one a delta on the one before, so a
    :class:`Predictor` follows the run with :meth:`Predictor.apply`. At train start the base is the
    newest bundle of the directory at or before the model's step (a resumed run continues its chain);
    a bundle of a step that exists already is kept as it is and becomes the base of the next: a
    resumed run redoes, bit for bit, steps the interrupted run may have exported.

    With ``mindir`` every bundle, full or delta, also holds the network as MindIR, ``dense.mindir``
    (as ``RecModel.export(..., mindir=)`` writes it): the MindIR carries the dense weights, which
    change from one export to the next, so each bundle carries its own and is served by MindSpore
    and numpy alone (docs/serving.md, "Serving without recboost": a delta's tables through its chain,
    its own MindIR). ``mindir=True`` takes the inputs' shapes (after the batch dimension, which stays
    dynamic) and dtypes from the first batch the callback sees, its label left out; a sample batch
    (``RecModel.export``'s ``mindir``) takes them from it, and is checked at train start by
    :meth:`RecModel.predict` (a batch the model does not take is a ValueError naming ``'mindir'``).
    Either way the first step checks, before it trains, that MindSpore exports the network (a trial
    export on the first batch's shapes in a temporary directory of ``directory``, removed): a network
    it cannot export is a ValueError naming its class, and nothing is trained.

    A bundle that cannot be written (an OSError: a full disk, an I/O error, a permission; the MindIR's
    too) does not stop training: nothing of it is left (a bundle is written all at once), the failure
    is logged loudly with the bundle's path and the error (which names the file and the bytes being
    written), counted in ``failed_exports``, and the next export point tries again, with a delta on
    the last bundle written: the chain never holds a broken or missing link, and a Predictor
    following it goes from the last good bundle to the next. Any other error (e.g. the base bundle
    damaged on disk: a ValueError naming it) stops training. At train start, the temporary
    directories of bundles that processes no longer running were writing (killed meanwhile) are
    removed.

    Args:
        directory (str): the export directory (created when missing).
        every_steps (int): export every this many steps (>= 1).
        export_on_end (bool): export at train end too (unless that step was just exported).
        mindir (bool, tuple or dict): False (default) or None: no MindIR; True: the MindIR, its inputs'
            shapes from the first training batch; a sample batch of the inputs :meth:`RecModel.predict`
            takes (a tuple such as ``(dense, ids)``, or a dict): the MindIR, its inputs' shapes from it.

    Attributes:
        paths (list[str]): the bundles of this run's chain, oldest first (from train start: its base).
        failed_exports (int): exports that failed with an OSError, over the life of the callback.
        failures (list[dict]): one per failed export: ``step``, ``path`` (the bundle not written),
            ``error`` (its message).
    """

    def __init__(self, directory, every_steps=1000, export_on_end=True, mindir=False):
        where = "OnlineExport"
        if not isinstance(directory, (str, os.PathLike)):
            _fail(where, "'directory'", "a directory path", directory, TypeError)
        self.directory = os.fspath(directory)
        self.every = _check_int(where, "every_steps", every_steps, 1)
        self.export_on_end = _check_bool(where, "export_on_end", export_on_end)
        self._sample = _mindir_sample(where, mindir, first_batch=True)    # None, True or predict's arguments
        self._ready = None          # with mindir=True: the first batch's input Tensors (one row each)
        self._tried = True          # the trial MindIR export done (or none needed)
        self.paths = []
        self.failed_exports = 0
        self.failures = []

    def on_train_begin(self, run_context):
        """The base: the newest bundle of a step at or before the model's (a resumed run's). Temporary
        bundle directories of processes no longer running (killed while exporting) are removed. With
        a sample batch as ``mindir``, the model must predict on it."""
        cb_params = run_context.original_args()
        step = cb_params.cur_step_num
        self.paths = [path for s, path in _export_bundles(self.directory) if s <= step][-1:]
        for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
            match = _TMP_BUNDLE_PATTERN.match(name)
            if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._tried = self._sample is None
        if isinstance(self._sample, tuple):
            try:
                cb_params.recboost.predict(*self._sample)
            except (ValueError, TypeError, RuntimeError, IndexError, KeyError) as exc:   # (too few items: IndexError)
                first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                _fail("OnlineExport", "'mindir'", "a sample batch this model predicts on (the inputs "
                      "RecModel.predict takes)", "a batch it refuses (%s: %s)" % (type(exc).__name__, first[:400]))

    def on_train_step_begin(self, run_context):
        """With ``mindir``, at a run's first step, before it trains: the first batch's input shapes (for
        ``mindir=True``), and a trial MindIR export of the network on them (a ValueError naming the
        network when MindSpore cannot export it; an OSError writing the trial is logged)."""
        if self._tried:
            return
        self._tried = True
        cb_params = run_context.original_args()
        model, inputs = cb_params.recboost, cb_params.train_dataset_element
        inputs = inputs[:-1] if model.loss_fn is not None else inputs      # the label left out, as predict takes
        first = tuple(Tensor.from_numpy(np.ascontiguousarray(t.asnumpy()[:1])) for t in inputs)
        if self._sample is True:
            self._ready = first
        trial = os.path.join(self.directory, ".tmp-%d-%s.bundle" % (os.getpid(), uuid.uuid4().hex[:12]))
        try:
            os.makedirs(trial)
            _bundle_mindir("OnlineExport", trial, model.network, first, {})
        except OSError as exc:
            _log("OnlineExport: the trial MindIR export in %s failed (%s: %s): whether MindSpore exports the "
                 "network is not checked before training; the exports will tell" % (trial, type(exc).__name__, exc))
        finally:
            shutil.rmtree(trial, ignore_errors=True)

    def _export(self, run_context):
        cb_params = run_context.original_args()
        step, model = cb_params.cur_step_num, cb_params.recboost
        path = os.path.join(self.directory, "bundle-%09d" % step)
        if self.paths and self.paths[-1] == path:
            return
        if not os.path.isdir(path):
            base = self.paths[-1] if self.paths else None
            try:
                if self._sample is not True:
                    model.export(path, base=base, mindir=self._sample)
                elif self._ready is not None:
                    _export_bundle(model, path, base, lambda: self._ready)
                else:                                       # a run of no step: no batch seen
                    return self._failed(step, path, base, "ValueError: no batch was seen in this run, so the "
                                        "MindIR's input shapes are unknown (mindir=True)")
            except OSError as exc:
                return self._failed(step, path, base, "%s: %s" % (type(exc).__name__, exc))
        self.paths.append(path)
        return None

    def _failed(self, step, path, base, error):
        """Count and log loudly the export of ``path`` that failed with ``error``; training goes on."""
        self.failed_exports += 1
        self.failures.append({"step": step, "path": path, "error": error.split(": ", 1)[1]})
        _log("OnlineExport: EXPORTING THE BUNDLE %s FAILED at step %d (%s); nothing of it is left, training goes "
             "on, the next export point tries again (a %s); %d failed export(s) so far"
             % (path, step, error, "delta on %s" % base if base else "full bundle", self.failed_exports))

    def on_train_step_end(self, run_context):
        """Export when ``every_steps`` steps have passed."""
        if run_context.original_args().cur_step_num % self.every == 0:
            self._export(run_context)

    def on_train_end(self, run_context):
        """Export the final model (unless its step was just exported)."""
        if self.export_on_end and run_context.original_args().cur_step_num:
            self._export(run_context)



# ---- the serving process: python -m recboost serve ------------------------------------------------
# An export directory served over the Open Inference Protocol (KServe v2, HTTP/REST; the binary tensor
# data extension too), by Starlette on uvicorn (the optional extra 'serve'). Who owns what:
#   _require_serve                 the extra's modules, or an ImportError saying how to install them
#   _ServeInput, _serve_inputs     the named input tensors a bundle's network takes, from its manifest
#   _served_network                a fresh network for a bundle: rebuilt from its record, or --network's
#   _BundleFollower                the bundle served (one Predictor): the newest complete one, then each
#                                  newer one read and checked aside and swapped in; refusals logged, counted
#   _Batcher                       the one thread that predicts: requests merged, run, split back
#   _InferError, _infer_request,   an infer request decoded and checked (JSON or binary tensor data); a
#   _infer_response                refusal is a 4xx naming the input; the response (JSON or binary)
#   _ServeMetrics, _serve_log      Prometheus metrics (/metrics); structured log lines (JSON, stderr)
#   _serve_app                     the endpoints (a Starlette application)
#   _ServeSettings, serve          the options (declared once) and the job

_SERVE_OUTPUT = "probability"      # the one output: the click probability, FP32 [rows, 1]
_SERVE_DATATYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}


def _require_serve(where):
    """The optional extra 'serve' (starlette, uvicorn, prometheus_client), imported: a namespace of the
    modules used; one missing is an ImportError saying how to install it."""
    # pylint: disable=import-outside-toplevel
    try:
        import prometheus_client
        import uvicorn
        from starlette import applications, exceptions, responses, routing
    except ImportError as exc:
        raise ImportError("For '%s', serving needs the optional extra 'serve' (starlette, uvicorn, "
                          "prometheus_client): pip install 'recboost[serve]' (missing: %s)." % (where, exc.name)) from exc
    return types.SimpleNamespace(prometheus_client=prometheus_client, uvicorn=uvicorn, applications=applications,
                                 exceptions=exceptions, responses=responses, routing=routing)


def _serve_log(event, **fields):
    """One structured log line: a JSON object (``time``, ``event``, ``fields``) on stderr, flushed."""
    print(json.dumps(dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), event=event, **fields),
                     default=str), file=sys.stderr, flush=True)


#: One input tensor of the served network: ``name``, ``datatype`` (the protocol's, e.g. "FP32") and
#: ``shape`` (a list; -1: any size, the first the batch's rows).
_ServeInput = collections.namedtuple("_ServeInput", "name datatype shape")


def _serve_inputs(where, manifest, directory):
    """The input tensors (``_ServeInput``s, in the network's order) of the network a bundle's manifest
    records: a recboost :class:`WideDeep`'s ``dense`` (FP32 ``[-1, num_dense]``) and ``ids`` (INT64
    ``[-1, num_fields]``) from its settings; another network's from the manifest's ``mindir.inputs``
    (a table's input as its ids, INT64, without the row width). A bundle of neither is a ValueError."""
    record, mindir = manifest["network"], manifest.get("mindir")
    if record["class"] == "recboost:WideDeep" and record["settings"] is not None:
        return [_ServeInput("dense", "FP32", [-1, record["settings"]["num_dense"]]),
                _ServeInput("ids", "INT64", [-1, record["settings"]["num_fields"]])]
    if mindir is None:
        _fail(where, "the network of the bundle %r" % directory, "a recboost WideDeep, or a bundle exported with "
              "mindir= (its manifest lists the network's inputs)", record["class"])
    inputs = []
    for i, item in enumerate(mindir["inputs"]):
        combined = [manifest["tables"][t]["combiner"] for t in item["tables"] if manifest["tables"][t]["combiner"]]
        if combined:
            _fail(where, "the input %d of the network of the bundle %r" % (i, directory), "ids or dense values "
                  "(ragged and pooled features are not served yet)", "ids pooled by %r" % combined[0])
        name = item["name"] if item["name"] is not None else "input_%d" % i
        if item["tables"]:
            inputs.append(_ServeInput(name, "INT64", item["shape"][:-1]))
        else:
            datatype = {np.dtype(v).name: k for k, v in _SERVE_DATATYPES.items()}.get(item["dtype"])
            if datatype is None:
                _fail(where, "the dtype of the input %r of the network of the bundle %r" % (name, directory),
                      "one of %s" % sorted(np.dtype(v).name for v in _SERVE_DATATYPES.values()), item["dtype"])
            inputs.append(_ServeInput(name, datatype, item["shape"]))
    return inputs


def _served_network(where, manifest, directory, network=None):
    """A fresh network for the bundle of ``manifest`` at ``directory``: ``network`` ("module:callable")
    called with no arguments, else a recboost :class:`WideDeep` rebuilt from the settings the bundle
    records (its hash table with the recorded name, width, combiner and padding id). The bundle's
    record is checked against it by :class:`Predictor`."""
    if network is not None:
        import importlib  # pylint: disable=import-outside-toplevel
        if __name__ == "__main__":       # python -m recboost: the module's "import recboost" is this module, whose
            sys.modules.setdefault("recboost", sys.modules[__name__])     # classes RecModel knows, not a copy
        module_name, _, attr = network.partition(":")
        try:
            made = functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))()
        except (ImportError, AttributeError) as exc:
            _fail(where, "'network'", "module:callable, a callable building the network", "%s (%s: %s)" % (
                network, type(exc).__name__, exc))
        if not isinstance(made, nn.Cell):
            _fail(where, "the result of 'network' %r" % network, "a Cell", type(made).__name__, TypeError)
        return made
    record = manifest["network"]
    settings = record["settings"]
    if record["class"] != "recboost:WideDeep" or settings is None:
        _fail(where, "the network of the bundle %r" % directory, "one recboost rebuilds (recboost:WideDeep), or "
              "one given as --network module:callable", record["class"])
    embedding = None
    if settings["vocab_size"] is None:
        if len(manifest["tables"]) != 1:
            _fail(where, "the hash tables of the bundle %r" % directory, "one table (a WideDeep's)",
                  [t["name"] for t in manifest["tables"]])
        spec = manifest["tables"][0]
        embedding = HashEmbedding(spec["embedding_size"], _HASH_RESERVED_ROWS + 1, input_index=1, name=spec["name"],
                                  combiner=spec["combiner"], padding_id=spec["padding_id"])
    return WideDeep(settings["num_dense"], settings["num_fields"], settings["dim"], tuple(settings["hidden"]),
                    vocab_size=settings["vocab_size"], embedding=embedding, deepfm=settings["model"] == "deepfm")


class _BundleFollower:
    """The bundle served from ``directory`` (an export directory, or one bundle), by one
    :class:`Predictor`. At start the newest bundle that passes its checks (with its chain of bases;
    an older one when the newest is refused; none is a ValueError). Then, every ``poll_interval``
    seconds on a thread of its own (:meth:`start`), each bundle newer than the one served, in step
    order: a delta on the bundle served is applied (``Predictor.apply``: read and checked aside,
    swapped in at once), a full bundle gets a fresh network and Predictor, built aside, which then
    replaces the one served (one reference). A bundle refused (damaged, foreign, half-written, of
    other inputs, a delta on another bundle) is logged by name and counted, and tried again only
    when its manifest changes; the bundle served goes on. :meth:`predict` runs on the batcher's
    thread only."""

    def __init__(self, where, directory, network, poll_interval, metrics):
        self._where, self._directory, self._network = where, directory, network
        self._poll, self._metrics, self._refused = poll_interval, metrics, {}
        self._stop = threading.Event()
        self._thread = None
        self.inputs = self._predictor = None
        found = _export_bundles(directory) or [(None, directory)]
        for _, path in reversed(found):
            if self._take(path):
                return
        _fail(where, "'directory'", "an export directory or a bundle holding a bundle that passes its checks",
              "%r, whose bundles were all refused (see the log)" % directory)

    @property
    def step(self):
        """The step of the bundle served."""
        return self._predictor.step

    @property
    def bundle(self):
        """The directory of the bundle served."""
        return self._predictor.directory

    def predict(self, inputs):
        """``(output, step)``: the network's output on ``inputs`` and the step of the one bundle that
        gave it (a delta swapped in meanwhile: predicted again)."""
        predictor = self._predictor
        while True:
            bundle, step = predictor.bundle_id, predictor.step
            out = predictor.predict(*inputs)
            if predictor.bundle_id == bundle:          # ids are never reused: no swap in between
                return out, step

    def _take(self, path):
        """Serve the bundle at ``path`` (applied, or a fresh Predictor); True when it is served, False
        when it is refused (logged, counted)."""
        import calendar  # pylint: disable=import-outside-toplevel
        manifest_path = os.path.join(path, _BUNDLE_MANIFEST)
        try:
            key = os.stat(manifest_path)
            key = (key.st_ino, key.st_mtime_ns, key.st_size)
        except OSError:
            key = None
        if self._refused.get(path, ()) == key:
            return False
        try:
            if key is None:
                _fail(self._where, "the bundle %r" % path, "a complete bundle (holding %s)" % _BUNDLE_MANIFEST,
                      "a directory without it (half-written, or not a bundle)")
            manifest = _read_json_checked(manifest_path, "the manifest of the bundle")
            inputs = _serve_inputs(self._where, manifest, path)
            if self.inputs is not None and inputs != self.inputs:
                _fail(self._where, "the inputs of the bundle %r" % path, "those served %s" % self.inputs, inputs)
            created = calendar.timegm(time.strptime(manifest["created"], "%Y-%m-%dT%H:%M:%SZ"))
            if manifest.get("kind") == "delta" and self._predictor is not None:
                self._predictor.apply(path)
            else:
                self._predictor = Predictor(_served_network(self._where, manifest, path, self._network), path)
        except (ValueError, TypeError, KeyError, OSError, RuntimeError) as exc:
            self._refused[path] = key
            self._metrics.refused.inc()
            _serve_log("bundle_refused", bundle=path, error="%s%s" % ("" if isinstance(exc, (
                ValueError, TypeError, OSError)) else type(exc).__name__ + ": ", exc))
            return False
        self.inputs = inputs
        self._metrics.served(self._predictor.step, created)
        _serve_log("bundle_served", bundle=path, step=self._predictor.step, id=self._predictor.bundle_id,
                   kind=manifest["kind"])
        return True

    def poll(self):
        """One look at the directory: each bundle newer than the one served, in step order."""
        for step, path in _export_bundles(self._directory):
            if step > self._predictor.step:
                self._take(path)

    def start(self):
        """Follow the directory on a thread of its own until :meth:`close`."""
        def run():
            while not self._stop.wait(self._poll):
                try:
                    self.poll()
                except OSError as exc:                      # the directory unreadable: served on, tried again
                    _serve_log("poll_failed", directory=self._directory, error=str(exc))
        self._thread = threading.Thread(target=run, name="recboost-serve-follower", daemon=True)
        self._thread.start()

    def close(self):
        """Stop following (a swap under way finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Batcher:
    """The one thread that predicts (MindSpore's cells crash when run on several threads at once).
    :meth:`submit` queues a request's input arrays; each predict call takes the queued requests in
    order, up to ``max_rows`` rows (a larger request runs alone), waiting up to ``max_delay`` seconds
    after the first for more, runs ``predict`` (``(output, step)``) once on them merged, and splits the
    click probabilities back: each request's future gets ``(probabilities [rows, 1] float32, step)``.
    :meth:`close` lets the queued requests finish, then stops."""

    _STOP = object()

    def __init__(self, predict, max_rows, max_delay, metrics):
        import queue  # pylint: disable=import-outside-toplevel
        self._predict, self._max_rows, self._max_delay, self._metrics = predict, max_rows, max_delay, metrics
        self._queue, self._empty = queue.Queue(), queue.Empty
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="recboost-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, arrays, rows):
        """A ``concurrent.futures.Future`` of the request's ``(probabilities, step)``; RuntimeError once closed."""
        import concurrent.futures  # pylint: disable=import-outside-toplevel
        if self._closed:
            raise RuntimeError("the server is shutting down")
        future = concurrent.futures.Future()
        self._queue.put((arrays, rows, future))
        return future

    def close(self):
        """Finish the queued requests, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(self._STOP)
            self._thread.join()

    def _run(self):
        pending = None
        while pending is not self._STOP:
            first = pending if pending is not None else self._queue.get()
            if first is self._STOP:
                return
            batch, rows, pending = [first], first[1], None
            deadline = time.monotonic() + self._max_delay
            while rows < self._max_rows:
                try:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except self._empty:
                    break
                if job is self._STOP or rows + job[1] > self._max_rows:
                    pending = job
                    break
                batch.append(job)
                rows += job[1]
            self._run_batch([job for job in batch if job[2].set_running_or_notify_cancel()])

    def _run_batch(self, batch):
        if not batch:
            return
        try:
            merged = [np.concatenate([job[0][k] for job in batch]) for k in range(len(batch[0][0]))]
            out, step = self._predict(merged)
            probs = _sigmoid(out).astype(np.float32).reshape(merged[0].shape[0], -1)
        except Exception as exc:  # pylint: disable=broad-except  a bug: its requests get it (a 500), serving goes on
            for job in batch:
                job[2].set_exception(exc)
            return
        self._metrics.batch_rows.observe(probs.shape[0])
        at = 0
        for arrays, rows, future in batch:
            future.set_result((probs[at:at + rows], step))
            at += rows


class _InferError(ValueError):
    """A refused request: its HTTP ``status`` (4xx), the ``kind`` of error counted in the metrics, the message."""

    def __init__(self, kind, message, status=400):
        super().__init__(message)
        self.kind, self.status = kind, status


def _refuse(kind, name, expected, got, status=400):
    """Refuse a request (``_InferError``) in recboost's error form."""
    _fail("infer", name, expected, got, functools.partial(_InferError, kind, status=status))


#: An infer request checked: its ``id`` (None when absent), ``arrays`` (one per input, in the
#: network's order), ``rows`` and ``binary`` (whether the output goes as binary tensor data).
_InferRequest = collections.namedtuple("_InferRequest", "id arrays rows binary")


def _infer_tensor(spec, tensor, binary, at):
    """``(array, bytes of binary data used)`` of the request's input ``tensor`` (a dict) for ``spec``:
    its datatype, shape and values checked (binary tensor data from ``binary[at:]``)."""
    name = spec.name
    if tensor.get("datatype") != spec.datatype:
        _refuse("dtype", "the datatype of the input %r" % name, spec.datatype, tensor.get("datatype"))
    shape = tensor.get("shape")
    expected = "%s (-1: any size; at least one row)" % spec.shape
    if not isinstance(shape, list) or not all(type(d) is int for d in shape) or len(shape) != len(spec.shape) or \
            shape[0] < 1 or any(d < 0 or w not in (-1, d) for w, d in zip(spec.shape, shape)):
        _refuse("shape", "the shape of the input %r" % name, expected, shape)
    count, dtype = math.prod(shape), np.dtype(_SERVE_DATATYPES[spec.datatype]).newbyteorder("<")
    parameters = tensor.get("parameters")
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if type(size) is not int or size != count * dtype.itemsize:
            _refuse("shape", "the parameter 'binary_data_size' of the input %r" % name, "%d (the bytes of %s %s)"
                    % (count * dtype.itemsize, spec.datatype, shape), size)
        if at + size > len(binary):
            _refuse("malformed", "the binary data of the input %r" % name, "%d bytes" % size, "%d bytes left in the "
                    "body" % (len(binary) - at))
        return np.frombuffer(binary[at:at + size], dtype).reshape(shape), size
    if "data" not in tensor:
        _refuse("malformed", "the input %r" % name, "given by 'data' or by parameters.binary_data_size", "neither")
    try:
        values = np.asarray(tensor["data"])
    except (ValueError, TypeError, RecursionError) as exc:
        _refuse("malformed", "the data of the input %r" % name, "a list of %d numbers (flat or nested)" % count,
                "%s" % str(exc)[:200])
    kinds = "i" if spec.datatype.startswith("INT") else "iuf"
    if values.dtype.kind not in kinds or values.size and values.dtype.kind == "u":
        what = {"b": "booleans", "f": "numbers with a fraction or exponent", "U": "strings", "O": "mixed values "
                "or integers out of range"}.get(values.dtype.kind, "integers >= 2**63")
        _refuse("dtype", "the data of the input %r" % name, "%s values (%s)" % (
            spec.datatype, "integers" if kinds == "i" else "numbers"), what)
    if values.size != count:
        _refuse("shape", "the data of the input %r" % name, "%d values (shape %s)" % (count, shape),
                "%d values" % values.size)
    if kinds == "i" and values.size and (values.min() < np.iinfo(dtype).min or values.max() > np.iinfo(dtype).max):
        _refuse("dtype", "the data of the input %r" % name, "%s values" % spec.datatype, "integers out of its range")
    return values.astype(dtype).reshape(shape), 0


def _infer_request(body, header_length, inputs):
    """The infer request ``body`` (bytes; with the binary tensor data extension its JSON part is the
    first ``header_length`` bytes, the header ``Inference-Header-Content-Length``, and the inputs'
    binary data follows in their order) checked against the served ``inputs`` (``_ServeInput``s):
    an ``_InferRequest``; a bad request is an ``_InferError`` naming what is wrong."""
    binary = memoryview(b"")
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            _refuse("malformed", "the header 'Inference-Header-Content-Length'", "the bytes of the body's JSON part "
                    "(0 to %d)" % len(body), header_length)
        body, binary = body[:int(header_length)], memoryview(body)[int(header_length):]
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as exc:
        _refuse("malformed", "the request body", "an inference request (a JSON object)", "malformed JSON (%s)" % exc)
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        _refuse("malformed", "the request", "a JSON object with a list 'inputs'", type(request).__name__
                if not isinstance(request, dict) else "an object with the keys %s" % sorted(request))
    specs, given, at = {spec.name: spec for spec in inputs}, {}, 0
    for i, tensor in enumerate(request["inputs"]):
        name = tensor.get("name") if isinstance(tensor, dict) else None
        if name not in specs:
            _refuse("name", "the name of inputs[%d]" % i, "one of %s (the model's inputs)" % list(specs), name)
        if name in given:
            _refuse("name", "the input %r" % name, "given once", "given twice")
        given[name], used = _infer_tensor(specs[name], tensor, binary, at)
        at += used
    for spec in inputs:
        if spec.name not in given:
            _refuse("missing", "the input %r" % spec.name, "given (%s %s)" % (spec.datatype, spec.shape),
                    "a request without it")
    if at != len(binary):
        _refuse("malformed", "the binary data of the request", "%d bytes (the inputs' binary_data_size)" % at,
                "%d bytes" % len(binary))
    rows = {spec.name: given[spec.name].shape[0] for spec in inputs}
    for spec in inputs:
        if rows[spec.name] != rows[inputs[0].name]:
            _refuse("shape", "the rows of the input %r" % spec.name, "%d like the input %r" % (
                rows[inputs[0].name], inputs[0].name), rows[spec.name])
    for spec in inputs:
        values = given[spec.name]
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            _refuse("non_finite", "the values of the input %r" % spec.name, "finite numbers",
                    "%d non-finite values" % int(np.count_nonzero(~np.isfinite(values))))
    binary_out = request.get("parameters", {}).get("binary_data_output") is True \
        if isinstance(request.get("parameters"), dict) else False
    outputs = request.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            _refuse("malformed", "the outputs of the request", "a list", type(outputs).__name__)
        for i, output in enumerate(outputs):
            name = output.get("name") if isinstance(output, dict) else None
            if name != _SERVE_OUTPUT:
                _refuse("name", "the name of outputs[%d]" % i, "%r (the model's output)" % _SERVE_OUTPUT, name)
            parameters = output.get("parameters")
            binary_out = isinstance(parameters, dict) and parameters.get("binary_data") is True
    request_id = request.get("id")
    return _InferRequest(request_id if isinstance(request_id, str) else None, [given[s.name] for s in inputs],
                         rows[inputs[0].name], binary_out)


def _infer_response(responses, model_name, request, probs, step):
    """The response to ``request`` (``_InferRequest``): the click probabilities ``probs`` (float32
    ``[rows, 1]``) of the bundle of ``step``, as JSON or as binary tensor data (a JSON part, its
    length in the header ``Inference-Header-Content-Length``, then the little-endian float32s)."""
    output = {"name": _SERVE_OUTPUT, "datatype": "FP32", "shape": list(probs.shape)}
    head = {"model_name": model_name, "model_version": str(step), "outputs": [output]}
    if request.id is not None:
        head["id"] = request.id
    if not request.binary:
        output["data"] = probs.ravel().tolist()        # float32 -> float -> JSON -> float32: the same bits
        return responses.JSONResponse(head)
    data = probs.astype("<f4").tobytes()
    output["parameters"] = {"binary_data_size": len(data)}
    header = json.dumps(head).encode("utf-8")
    return responses.Response(header + data, media_type="application/octet-stream",
                              headers={"Inference-Header-Content-Length": str(len(header))})


class _ServeMetrics:
    """The server's Prometheus metrics, in a registry of their own (``registry``, served at /metrics)."""

    def __init__(self, prometheus):
        registry = self.registry = prometheus.CollectorRegistry()
        self.requests = prometheus.Counter("recboost_serve_requests", "Inference requests received", registry=registry)
        self.errors = prometheus.Counter("recboost_serve_errors", "Inference requests refused (4xx) or failed (5xx), "
                                         "by kind", ["kind"], registry=registry)
        self.latency = prometheus.Histogram("recboost_serve_request_seconds", "Inference requests' time, from the "
                                            "request read to the response made", registry=registry, buckets=(
                                                .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
        self.batch_rows = prometheus.Histogram("recboost_serve_batch_rows", "Rows of each predict call (requests "
                                               "merged)", registry=registry, buckets=[2 ** k for k in range(14)])
        self.step = prometheus.Gauge("recboost_serve_bundle_step", "The step of the bundle served", registry=registry)
        self.age = prometheus.Gauge("recboost_serve_bundle_age_seconds", "Seconds since the bundle served was "
                                    "created (its manifest's 'created')", registry=registry)
        self.refused = prometheus.Counter("recboost_serve_refused_bundles", "Bundles refused (damaged, foreign, "
                                          "half-written, a delta on another bundle)", registry=registry)
        self.swaps = prometheus.Counter("recboost_serve_bundle_swaps", "Bundles swapped in after the first",
                                        registry=registry)
        self._created = None
        self.age.set_function(lambda: time.time() - self._created if self._created is not None else float("nan"))

    def served(self, step, created):
        """A bundle of ``step`` created at ``created`` (seconds since the epoch) is served now."""
        if self._created is not None:
            self.swaps.inc()
        self._created = created
        self.step.set(step)


def _serve_app(mods, model_name, follower, batcher, metrics, max_body_bytes, ready):
    """The Starlette application of the Open Inference Protocol's endpoints for the model ``model_name``
    and /metrics. ``ready()``: whether the server takes requests (False once it shuts down)."""
    responses, Route = mods.responses, mods.routing.Route      # pylint: disable=invalid-name

    def error(message, status):
        return responses.JSONResponse({"error": message}, status_code=status)

    def model_route(handler):
        async def endpoint(request):
            name = request.path_params["name"]
            if name != model_name:
                return error("For 'recboost serve', the model name must be %r, but got %r." % (model_name, name), 404)
            return await handler(request)
        return endpoint

    async def live(_):
        return responses.JSONResponse({"live": True})

    async def server_ready(_):
        return responses.JSONResponse({"ready": ready()}, status_code=200 if ready() else 503)

    async def server_metadata(_):
        return responses.JSONResponse({"name": "recboost", "version": __version__,
                                       "extensions": ["binary_tensor_data"]})

    async def metadata(_):
        return responses.JSONResponse({
            "name": model_name, "versions": [str(follower.step)], "platform": "recboost",
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": s.shape} for s in follower.inputs],
            "outputs": [{"name": _SERVE_OUTPUT, "datatype": "FP32", "shape": [-1, 1]}]})

    async def model_ready(_):
        return responses.JSONResponse({"name": model_name, "ready": ready()}, status_code=200 if ready() else 503)

    async def read_body(request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            _refuse("too_large", "the request body", "at most %d bytes (--max-body-bytes)" % max_body_bytes,
                    "%s bytes" % declared, 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                _refuse("too_large", "the request body", "at most %d bytes (--max-body-bytes)" % max_body_bytes,
                        "more", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(request):
        import asyncio  # pylint: disable=import-outside-toplevel
        started = time.perf_counter()
        metrics.requests.inc()
        try:
            checked = _infer_request(await read_body(request), request.headers.get("inference-header-content-length"),
                                     follower.inputs)
            try:
                future = batcher.submit(checked.arrays, checked.rows)
            except RuntimeError as exc:
                raise _InferError("shutting_down", "For 'infer', %s." % exc, 503) from None
            probs, step = await asyncio.wrap_future(future)
            response = _infer_response(responses, model_name, checked, probs, step)
        except _InferError as exc:
            metrics.errors.labels(exc.kind).inc()
            response = error(str(exc), exc.status)
        except Exception as exc:  # pylint: disable=broad-except  a bug: a 500 naming it, logged
            metrics.errors.labels("internal").inc()
            _serve_log("internal_error", error="%s: %s" % (type(exc).__name__, exc))
            response = error("internal error (a bug in recboost serve): %s: %s" % (type(exc).__name__, exc), 500)
        metrics.latency.observe(time.perf_counter() - started)
        return response

    async def prometheus(_):
        return responses.Response(mods.prometheus_client.generate_latest(metrics.registry),
                                  media_type=mods.prometheus_client.CONTENT_TYPE_LATEST)

    async def http_error(request, exc):
        return error("For 'recboost serve', the request must be one of the endpoints served here (GET /v2/health/"
                     "live, /v2/health/ready, /v2, /v2/models/%s, /v2/models/%s/ready, /metrics; POST /v2/models/%s/"
                     "infer), but got '%s %s' (%s)." % (model_name, model_name, model_name, request.method,
                                                        request.url.path, exc.detail), exc.status_code)

    routes = [Route("/v2/health/live", live), Route("/v2/health/ready", server_ready), Route("/v2", server_metadata),
              Route("/v2/models/{name}", model_route(metadata)), Route("/v2/models/{name}/ready",
                                                                       model_route(model_ready)),
              Route("/v2/models/{name}/infer", model_route(infer), methods=["POST"]), Route("/metrics", prometheus)]
    return mods.applications.Starlette(routes=routes, exception_handlers={mods.exceptions.HTTPException: http_error})


# =====================================================================================================
# Command line
# =====================================================================================================
# python -m recboost demo | train | serve-check | serve: the jobs a user runs without writing Python. Who owns what:
#   _JobSettings, _option, _table_option          every option, declared once: train_job's keywords, the
#                                                 argparse options (_job_parser), train-config.json
#                                                 (recorded(), _JOB_CONFIG_SCHEMA; _job_config_*)
#   train_job, _job_input, _job_callbacks,        the train job: its input (files, a directory, stdin,
#   _job_result, _job_summary, _job_network       the held-out split), checkpoints, exports, summary
#   _JobRun                                       the run's pieces train_job hands _job_result
#   _InputCheckpoint, _read_input_prefix,         the input position a checkpoint carries and the resume's
#   _input_resume_position, _job_resume*          proof of the input
#   serve_check, demo, main                       the other two jobs and the entry point
#   _ServeSettings, serve                         python -m recboost serve (its machinery: Serving, the last part)


def _timestamped(stream):
    """``(dense, ids, label, timestamp)`` tuples -> dict batches whose "timestamp" RecModel uses."""
    for dense, ids, label, timestamp in stream:
        yield {"dense": dense, "ids": ids, "label": label, "timestamp": timestamp}


def _require_matplotlib(where):
    """matplotlib is an optional extra; say how to get it when it is missing."""
    try:
        import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError as exc:
        raise ImportError("For '%s', plotting needs matplotlib, the optional extra 'bench': "
                          "pip install 'recboost[bench]' (or pip install matplotlib)." % where) from exc


def _plot_learning_curve(history, result, path):
    """Progressive AUC (with the oracle's) and samples/s against the step, as a PNG at ``path``."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    steps = [h["step"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot([h["step"] for h in history if h["auc"] is not None],
             [h["auc"] for h in history if h["auc"] is not None], label="progressive AUC", color="#1f77b4")
    if "oracle_auc" in result:
        top.axhline(result["oracle_auc"], color="#2ca02c", linestyle="--",
                    label="oracle AUC %.4f" % result["oracle_auc"])
    if result.get("auc") is not None:
        top.axhline(result["auc"], color="#ff7f0e", linestyle=":", label="held-out AUC %.4f" % result["auc"])
    top.set_ylabel("AUC")
    top.legend(loc="lower right", fontsize=8)
    top.set_title("recboost: online training, %d steps" % result["steps"])
    bottom.plot(steps, [h["samples_per_second"] / 1e3 for h in history], color="#7f7f7f")
    bottom.set_ylabel("samples/s (thousands)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _job_network(model, seed, learning_rate, table, where="recboost train"):
    """The main job's network: Wide&Deep (or DeepFM) over one hash table "ids" of 16 + 1 columns
    (13 dense features, 26 fields, MLP 400-400), its rows trained by SparseAdam(``learning_rate``).
    ``table``: the job's hash-table options by name (:meth:`_JobSettings.table_options`): the
    :class:`TableConfig` fields of those names (absent ones: the config's defaults), and ``growth``
    (default True): the table grows when full, unless an ``eviction_policy`` keeps it at its
    capacity. The table is made from that config, checked there (a bad setting is an error naming
    ``where``, the job). Returns (network, table)."""
    ms.set_seed(seed)
    dim, fields = 16, 26
    settings = dict(table)
    grow = bool(settings.pop("growth", True)) and _cache_choices(where, settings)[0] is None
    config = TableConfig(dim + 1, use_dynamic_expansion=grow, optimizer=SparseAdam(learning_rate), seed=seed,
                         name="ids", where=where, **settings)
    table = HashEmbedding(config, input_index=1)
    return WideDeep(13, fields, dim, (400, 400), embedding=table, deepfm=model == "deepfm"), table


def _split_input(where, data, holdout, batch_size, timestamp_column=None):
    """``data`` as training input and held-out input, split before training (nothing held out is
    trained on): ``holdout`` 0: nothing held out; n > 0: the last ``n * batch_size`` lines (of the
    file, or of a directory's last file: :func:`criteo_split`); "file": a directory's last file.
    Standard input cannot be split (its end is unknown until it ends): refused. ``timestamp_column``:
    see :class:`CriteoReader` (the training batches are then dicts with their data time).

    Returns:
        tuple: (train :class:`_CriteoInput`, held-out :class:`_CriteoInput` or None, lines held out or
        None when not counted, lines of the split file or None).
    """
    sources = _data_sources(where, data)
    if holdout == "file":
        if data == "-" or len(sources) < 2:
            _fail(where, "'holdout'", "'file' only with a directory of two files or more (its last file is held "
                  "out)", "'file' with %s" % ("standard input" if data == "-" else "%d file(s)" % len(sources)))
        return (_CriteoInput(sources[:-1], batch_size, timestamp_column=timestamp_column, as_dicts=True,
                             digests=True),
                _CriteoInput(sources[-1:], batch_size, timestamp_column=timestamp_column), None, None)
    if not holdout:
        return (_CriteoInput(sources, batch_size, timestamp_column=timestamp_column, as_dicts=True,
                             digests=data != "-"), None, 0, None)
    if data == "-":
        _fail(where, "'holdout'", "0 with standard input (a pipe cannot be split before training: its end is "
              "unknown until it ends; hold out a file of its own and score it with serve-check)", holdout)
    last = sources[-1]
    split, lines = criteo_split(last, holdout * batch_size)
    kept = max(lines - holdout * batch_size, 0)
    train = _CriteoInput(sources, batch_size, stops=[None] * (len(sources) - 1) + [split],
                         timestamp_column=timestamp_column, as_dicts=True, digests=True)
    held = _CriteoInput([last], batch_size, starts=[{"offset": split, "lines": kept, "rows": 0}],
                        timestamp_column=timestamp_column)
    return train, held, lines - kept, lines


def _score_input(predict, batches):
    """Score every batch of ``batches`` (``(dense, ids, label, ...)``) with ``predict(dense, ids)``
    (outputs: logits) and return
    ``{"rows", "auc", "log_loss"}`` (exact :class:`AUC`, :class:`LogLoss`; AUC None with one class).
    Streams: one batch at a time."""
    auc, loss, rows = AUC(), LogLoss(from_logits=True), 0
    for batch in batches:
        dense, ids, label = batch[:3]
        scores = np.asarray(predict(dense, ids)).reshape(-1)
        auc.update(scores, label)
        loss.update(scores, label)
        rows += label.shape[0]
    if not rows:
        return {"rows": 0, "auc": None, "log_loss": None}
    try:
        value = auc.eval()
    except ValueError:
        value = None
    return {"rows": rows, "auc": value, "log_loss": loss.eval()}


def _malformed_text(stats):
    bad = {k: v for k, v in stats["malformed"].items() if v}
    return "malformed %d%s" % (sum(bad.values()), " %s" % bad if bad else "")


_JOB_CONFIG = "train-config.json"


def _holdout_arg(value):
    if value == "file":
        return value
    try:
        return int(value)
    except ValueError:
        import argparse
        raise argparse.ArgumentTypeError("expected a number of batches or 'file', got %r" % value) from None


_PATH_OR_NONE = _Rule("a path (str)", (str, os.PathLike)).or_none()


def _option(default, rule, text=None, record=False, table=False, commands=("train",), flag=None, variants=None,
            **argparse_kwargs):
    """A field of :class:`_JobSettings`, the one declaration of an option: its ``default``; its
    ``rule`` (``_validate``), which checks :func:`train_job`'s keyword and, with ``record``, the field
    of ``train-config.json``; its command-line option in ``commands`` (``flag``, default
    ``--<name-with-dashes>``; ``text`` its help; ``argparse_kwargs`` more of ``add_argument``'s
    keywords, ``variants`` per command those that differ). ``table``: an option of the hash table,
    added as its own group (:meth:`_JobSettings.add_options`)."""
    return dataclasses.field(default=default, metadata={
        "rule": rule, "record": record, "table": table, "commands": commands, "flag": flag,
        "argparse": dict(argparse_kwargs, help=text), "variants": variants or {}})


def _table_config_field(name):
    """:class:`TableConfig`'s field ``name`` (a ``dataclasses.Field``; its metadata: ``_table_field``), or the
    sub-config whose flat spelling ``name`` is (``eviction_policy``: the field ``eviction``)."""
    return next(f for f in dataclasses.fields(TableConfig) if name in (f.name, f.metadata.get("flat")))


def _table_rule(name):
    """The rule of :class:`TableConfig`'s field ``name`` (its ``rule`` metadata: the check TableConfig
    itself applies, written once there), for a job's option of the table: required (in
    train-config.json too)."""
    return _table_config_field(name).metadata["rule"].optional(_ABSENT)


def _table_option(name, default, text=None, **argparse):
    """The :class:`_JobSettings` field of the hash table's option for :class:`TableConfig`'s field
    ``name``: recorded, of ``train`` and ``demo``, its rule the field's (:func:`_table_rule`), its
    argparse keywords (help, choices) and type those of the field's ``option`` metadata (``text``,
    ``argparse`` instead where the job words it otherwise), its default the job's (``default``)."""
    field = _table_config_field(name)
    keywords = dict(field.metadata["option"])
    if field.type in (int, float):
        keywords["type"] = field.type
    keywords.update(argparse)
    return _option(default, _table_rule(name), text or keywords.pop("help"), record=True, table=True,
                   commands=("train", "demo"), **{k: v for k, v in keywords.items() if k != "help"})


@dataclasses.dataclass(frozen=True)
class _JobSettings:
    """The options of ``python -m recboost train`` (and those ``demo`` and ``serve-check`` share),
    each declared once as a field (:func:`_option`): its name is :func:`train_job`'s keyword and
    the option's dest, its default both, its rule checks the keyword (:meth:`checked`) and the
    recorded setting, its metadata builds the option (:meth:`add_options`). ``train-config.json`` is
    :meth:`recorded`: the fields with ``record`` (what a resumed run must share), checked by
    ``_JOB_CONFIG_SCHEMA``. The hash table's options are the group marked below (``table=True``)."""

    data: str = _option(dataclasses.MISSING, _Rule("a path or '-'", (str, os.PathLike),
                                                    test=lambda v: bool(os.fspath(v))),
                        "a file (.gz is decompressed), a directory (its files in name order, one stream) or - "
                        "(standard input)", record=True, commands=("train", "demo", "serve-check"),
                        metavar="PATH|DIR|-", required=True, variants={"demo": dict(
                            required=False, default=None, metavar=None,
                            help="a Criteo-format file instead of the synthetic stream")})
    model: str = _option("widedeep", _one_of("widedeep", "deepfm"), record=True,
                         commands=("train", "demo", "serve-check"), choices=("widedeep", "deepfm"),
                         variants={"serve-check": dict(default=None, help="the network (default: the one the "
                                                       "export directory's train-config.json names)")})
    batch_size: int = _option(2048, _Int(1), record=True, commands=("train", "demo", "serve-check"), type=int)
    seed: int = _option(0, _Int(), record=True, commands=("train", "demo"), type=int)
    steps: int = _option(None, _Int(1).or_none(), "stop at this step (default: when the input ends)",
                         commands=("train", "demo"), type=int,
                         variants={"demo": dict(default=3000, help="training steps (default 3000)")})
    # -- the hash table's options: one group (the one call site is add_options(..., table=True)); their rules,
    # help and choices are TableConfig's fields' (_table_option), their defaults the job's
    capacity: int = _table_option("capacity", 1 << 20)
    access_threshold: int = _table_option("access_threshold", 1, "an id gets a row once seen more than "
                                          "this many times (default 1: at its second sighting; -1: at once)")
    eviction_threshold: int = _table_option("eviction_threshold", -1, "evict ids unseen for this many "
                                            "steps (checked every 60 steps), or with --timestamp-column this much "
                                            "data time; default -1: no eviction", variants={"demo": dict(
                                                default=6 * 3600, help=(
                                                    "evict ids unseen for this many seconds of data time (default "
                                                    "6 hours); with --data, which has no time column, this many "
                                                    "steps"))})
    eviction_policy: str = _table_option("eviction_policy", None)
    admission_counter: str = _table_option("admission_counter", None)
    growth: bool = _option(True, _table_rule("use_dynamic_expansion"), "keep the table at --capacity rows (new ids "
                           "of a full table read the default row)", record=True, table=True, flag="--no-growth",
                           action="store_false")
    # -- the training
    learning_rate: float = _option(1e-3, _Rule("a finite number", (int, float), test=math.isfinite),
                                   "learning rate of the dense and sparse Adam (1e-3)", record=True, flag="--lr",
                                   type=float)
    boost_level: str = _option("O0", _one_of(*_BOOST_LEVELS), record=True, choices=tuple(_BOOST_LEVELS))
    amp_level: str = _option("O0", _one_of(*_AMP_LEVELS), "mixed precision (see build_train_network; on CPU "
                             "float32 is the fast one)", record=True, choices=tuple(_AMP_LEVELS))
    holdout: object = _option(0, _Rule("an int >= 0 or 'file'", (int, str),
                                       test=lambda v: v == "file" or type(v) is int and v >= 0),
                              "split off before training, never trained on, scored at the end: the last N batches "
                              "(of the file, or of a directory's last file), or 'file': a directory's last file",
                              record=True, type=_holdout_arg, metavar="N|file")
    timestamp_column: int = _option(None, _Int(1, 14).or_none(), "the lines carry an integer data time at "
                                    "tab-separated column K (the label is column 0; 1 <= K <= 14): it is the "
                                    "tables' clock, and --eviction-threshold counts its units", record=True,
                                    type=int, metavar="K")
    # -- the run: what may differ from one resume to the next
    window: int = _option(200000, _Int(1), "rows of the windowed AUC and log loss", type=int)
    checkpoint_dir: str = _option(None, _PATH_OR_NONE, "write checkpoints there; the same command run again resumes "
                                  "from the latest one", commands=("train", "demo"),
                                  variants={"demo": dict(help=None)})
    checkpoint_every: int = _option(1000, _Int(1), type=int, metavar="STEPS")
    checkpoint_full_every: int = _option(None, _Int(1).or_none(), "incremental checkpoints: every K-th one a full "
                                         "base, those between deltas of what changed (OnlineCheckpoint's full_every)",
                                         type=int, metavar="K")
    resume_by_count: bool = _option(False, _Rule("a bool", bool), "resume from a checkpoint that has no input "
                                    "position (an older version's) by reading the input again and skipping the "
                                    "checkpoint's count of batches: only when you know the input is unchanged (it "
                                    "cannot be proven)", action="store_true")
    export: str = _option(None, _PATH_OR_NONE, "write serving bundles there: a full one, then deltas (read by "
                          "serve-check, Predictor)", metavar="DIR")
    export_every: int = _option(1000, _Int(1), type=int, metavar="STEPS")
    export_mindir: bool = _option(False, _Rule("a bool", bool), "with --export: every bundle also holds the "
                                  "network as MindIR (dense.mindir, its inputs' shapes from the first batch), "
                                  "served by MindSpore and numpy without recboost", action="store_true")
    progress_seconds: float = _option(10.0, _Rule("a number > 0", (int, float), test=lambda v: v > 0), type=float)
    plot: str = _option(None, _PATH_OR_NONE, "write the learning curve (progressive AUC, samples/s) as a PNG "
                        "(needs matplotlib: pip install 'recboost[bench]')", commands=("train", "demo"),
                        metavar="PATH")

    @classmethod
    def checked(cls, where, options):
        """The settings of the keywords ``options`` (a dict; absent ones take their default), each
        checked by its rule: an unknown keyword or a bad value is a ``_fail`` error naming it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in options:
            if name not in fields:
                _fail(where, "the keyword %r" % name, "one of %s" % sorted(fields), name, TypeError)
        rules = _Fields({name: f.metadata["rule"] if f.default is dataclasses.MISSING else
                         f.metadata["rule"].optional(f.default) for name, f in fields.items()})
        return cls(**_validate(options, rules, _Checking.arguments(where)))

    def table_options(self):
        """The hash table's options (the group marked ``table``) by name: the table :func:`_job_network`
        makes (TableConfig's fields of those names, and ``growth``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["table"]}

    def recorded(self):
        """The settings a resumed run must share: ``train-config.json`` (``_JOB_CONFIG_SCHEMA``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["record"]}

    @classmethod
    def add_options(cls, parser, command, table):
        """Add to ``parser`` (an argparse parser or group) the options of ``command`` ("train", "demo",
        "serve-check"): the hash table's (``table``) or the others."""
        for f in dataclasses.fields(cls):
            if command not in f.metadata["commands"] or f.metadata["table"] != table:
                continue
            kwargs = dict(f.metadata["argparse"], **f.metadata["variants"].get(command, {}))
            if f.default is not dataclasses.MISSING:
                kwargs.setdefault("default", f.default)
            parser.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), dest=f.name, **kwargs)

    @classmethod
    def parsed(cls, args, command):
        """The options of ``command`` in the parsed ``args``, as keywords (field name -> value)."""
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if command in f.metadata["commands"]}


# The schema (``_validate``) of ``train-config.json``: the recorded fields of _JobSettings, by their rules.
_JOB_CONFIG_SCHEMA = _Fields({f.name: f.metadata["rule"] for f in dataclasses.fields(_JobSettings)
                              if f.metadata["record"]}, expected="an object of the job's settings")


def _job_config_read(where, directory, hint=""):
    """The job settings recorded in ``directory``'s ``train-config.json`` (:func:`_job_config_write`),
    None when there is none. The file's checksum is verified, then its fields (``_JOB_CONFIG_SCHEMA``):
    damage, an edit, ``null``, ``[]``, a wrong type are each one ValueError naming the file, ending
    with ``hint`` (what the user may do)."""
    path = os.path.join(directory, _JOB_CONFIG)
    try:
        recorded = _read_json_checked(path, "the job settings")
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError("For '%s', %s%s" % (where, exc, hint and " " + hint)) from None

    def fail(at, expected, got, exc):
        _fail(where, "the field %r of the job settings %r" % (at, path), expected, "missing" if got is _ABSENT else got)

    try:
        _validate(recorded, _JOB_CONFIG_SCHEMA, _Checking.manifest(fail))
    except ValueError as exc:
        raise ValueError("%s%s" % (exc, hint and " " + hint)) from None
    return recorded


def _job_config_check(where, directory, config):
    """Compare the job ``config`` with the one recorded in ``directory`` (by an earlier run of the
    same job; :func:`_job_config_read`); a difference is a ValueError naming each setting, both values
    and the file."""
    path = os.path.join(directory, _JOB_CONFIG)
    recorded = _job_config_read(where, directory, "To change a setting, start afresh with another "
                                                  "--checkpoint-dir.")
    if recorded is None:
        return
    changed = ["%s: %r recorded, %r now" % (key, recorded.get(key), config.get(key))
               for key in sorted(set(recorded) | set(config)) if recorded.get(key) != config.get(key)]
    if changed:
        _fail(where, "the settings of a run resuming from %r" % directory, "those it was started with (%s; use "
              "another --checkpoint-dir to start afresh)" % path, "; ".join(changed))


def _job_config_write(directory, config):
    """Record the job ``config`` as ``directory``'s ``train-config.json``, with its checksum, all at
    once (``_write_json_checked``)."""
    os.makedirs(directory, exist_ok=True)
    _write_json_checked(os.path.join(directory, _JOB_CONFIG), config)


class _InputCheckpoint(OnlineCheckpoint):
    """:class:`OnlineCheckpoint` of ``recboost train`` on a file or a directory: every checkpoint
    carries, as its ``extra`` field (covered by its manifest's checksum, written with it at once), the
    input position where the batches it has consumed end (:func:`_input_position_record`; its fields:
    ``_input_position_schema``). :func:`_input_resume_position` proves a resume's input with it. A
    position that cannot be found is logged and the checkpoint written without one: a resume from it
    is refused unless told to re-read the input by count (:func:`_job_resume`)."""

    def __init__(self, directory, every_steps, train_input, full_every=None):
        super().__init__(directory, every_steps=every_steps, full_every=full_every)
        self.train_input = train_input

    def later_checkpoints(self, names, step):
        """The checkpoints after the one the job resumed from are those that carry no input position
        (:func:`_job_resume_checkpoint` passed over them: their steps are trained again): removed,
        logged, so that no resume loads them and ``keep`` prunes none of the new ones. Any other is
        refused (:meth:`OnlineCheckpoint.later_checkpoints`)."""
        def unproven(name):
            try:
                return _checkpoint_file_manifest(os.path.join(self.directory, name)).get("extra") is None
            except ValueError:
                return False
        if not all(unproven(name) for name in names):
            super().later_checkpoints(names, step)
        _log("recboost train: removing the checkpoints after step %d, which carry no input position (their steps "
             "are trained again): %s" % (step, ", ".join(names)))
        for name in names:
            self._remove(name)

    def checkpoint_extra(self, head):
        """The input position after the batches the checkpoint consumed (``taken - stream_start``)."""
        batches = head["taken"] - head["stream_start"]
        record = _input_position_record(self.train_input, batches)
        if record is None:
            _log("recboost train: no input position for the checkpoint of step %d (batch %d of the input is not "
                 "among the last ones read); a resume from it is refused unless --resume-by-count"
                 % (head["step"], batches))
        return record


def _read_input_prefix(path, read, mark):
    """Read the first ``read`` bytes of the source ``path`` (decompressed for ``.gz``) once, as the
    training run read them. Returns ``{"read": the bytes there were (fewer when the file is shorter),
    "digest": their hex digest (:func:`_input_hasher`), "newlines": the newlines among the first
    ``mark`` of them, "ends_line": whether byte ``mark - 1`` is a newline (True for 0), "hasher": a
    hasher holding the first ``mark`` bytes, "more": whether the file holds a byte past ``read``,
    "tail": the bytes from ``mark`` to ``read`` (at most a chunk or so: what was read past a position)}``.
    A file that cannot be read (an OSError, a ``.gz`` stream cut short or damaged) is a ValueError
    naming it."""
    import zlib  # pylint: disable=import-outside-toplevel
    hasher, at_mark, done, newlines, last, tail = _input_hasher(), None, 0, 0, b"\n", []
    try:
        with (gzip.open(path, "rb") if os.fspath(path).endswith(".gz") else open(path, "rb")) as fh:
            while done < read:
                if done == mark:
                    at_mark = hasher.copy()
                want = min(1 << 22, read - done, mark - done if done < mark else read - done)
                data = fh.read(want)
                if not data:
                    break
                hasher.update(data)
                if done < mark:
                    newlines += data.count(b"\n")
                    last = data[-1:]
                else:
                    tail.append(data)
                done += len(data)
            if done == mark and at_mark is None:
                at_mark = hasher.copy()
            more = bool(fh.read(1))
    except (OSError, EOFError, zlib.error) as exc:
        _fail("recboost train", "the input file %r, read again to prove the resume's input" % os.fspath(path),
              "readable", "%s: %s" % (type(exc).__name__, exc))
    return {"read": done, "digest": hasher.hexdigest(), "newlines": newlines, "ends_line": last == b"\n",
            "hasher": at_mark, "more": more, "tail": b"".join(tail)}


def _input_resume_position(checkpoint, train_input, manifest=None):
    """The input position the checkpoint ``checkpoint`` carries (:class:`_InputCheckpoint`; its
    ``manifest``, read when not given), proven against the checkpoint and against ``train_input`` (a
    :class:`_CriteoInput` of files with ``digests``, as the resumed run reads them). Returns
    ``(position, None)``, the position to :meth:`_CriteoInput.seek` to (with ``done`` and
    ``hasher``), or ``(None, reason)`` when the checkpoint carries no position.

    Anything else is a ValueError naming the checkpoint and what differs, and nothing is trained: a
    damaged checkpoint (its manifest's checksum), a position of bad fields (its schema, its fields
    against each other and the checkpoint: ``offset``/``lines``/``rows`` against ``read``, the
    files' rows against ``batches``, ``batches`` against the checkpoint's ``taken - stream_start``),
    and an input that is not the one trained up to the position: a file
    inserted before it, removed or renamed, one whose size changed, one whose bytes read (all of a
    file before the position, the position's file up to what was read of it) have another digest,
    a line count that is not the newlines before the offset, an offset that is not a line start or is
    past the held-out split, a position's file that is not a regular file. Proving reads every
    byte before the position once (and up to a chunk past it)."""
    where = "recboost train"
    manifest = _checkpoint_file_manifest(checkpoint) if manifest is None else manifest
    record = _checkpoint_extra(where, checkpoint, manifest, _input_position_schema)
    if record is None:
        side = _input_position_path(checkpoint)
        return None, "the checkpoint has no recorded input position (%s)" % (
            "it was written by an older recboost, whose position file %s beside it this version does not read"
            % os.path.basename(side) if os.path.exists(side) else "none could be found when it was written")
    if record["batch_size"] != train_input.batch_size:
        _fail(where, "the field 'extra.batch_size' of the checkpoint %r" % checkpoint, "the run's batch size, %d"
              % train_input.batch_size, record["batch_size"])

    def changed(name, how):
        _fail(where, "the input of a run resuming from %r" % checkpoint,
              "the input that checkpoint was trained on, unchanged up to its position (restore the input, or "
              "start afresh with another --checkpoint-dir)", "the file %s %s" % (name, how))
    k, sources, files = record["source"], train_input.sources, record["files"]
    now = [os.path.basename(os.fspath(s)) for s in sources]
    for i, facts in enumerate(files):
        if i >= len(now):
            changed(facts["name"], "read before the position, was removed (the input has %d file(s) now)" % len(now))
        if now[i] != facts["name"]:
            if now[i] not in [f["name"] for f in files]:
                changed(now[i], "was added before the position (it comes before %s, which had been read)"
                        % facts["name"])
            if facts["name"] in now:
                changed(facts["name"], "read before the position, is now file %d in reading order, not %d (the "
                        "files before the position were renamed)" % (now.index(facts["name"]) + 1, i + 1))
            changed(facts["name"], "read before the position, was removed or renamed (%s is in its place now)"
                    % now[i])
    for i, facts in enumerate(files):
        source, name, here = sources[i], facts["name"], i == k
        if here and not os.path.isfile(source):
            changed(name, "holding the position is not a regular file now (its bytes cannot be read again to "
                          "prove them, nor sought in)")
        size = _source_facts(source)["size"]
        if not here and size != facts["size"]:
            changed(name, "changed size: %s bytes when it was read, %s now" % (facts["size"], size))
        got = _read_input_prefix(source, facts["read"], record["offset"] if here else facts["read"])
        compressed = " (decompressed)" if os.fspath(source).endswith(".gz") else ""
        if got["read"] < facts["read"]:
            changed(name, "is shorter than when it was read: %d bytes%s were read, it holds %d now" % (
                facts["read"], compressed, got["read"]))
        if got["digest"] != facts["digest"]:
            changed(name, "was edited: its first %d bytes%s have the %s digest %s now, %s when they were read" % (
                facts["read"], compressed, _INPUT_DIGEST_NAME, got["digest"], facts["digest"]))
        if not here and got["more"]:
            changed(name, "grew after it was read to its end (%d bytes%s then)" % (facts["read"], compressed))
        # the digest matches: the bytes are the ones read; the counts must be theirs
        want = record["lines"] if here else facts["lines"]
        at_end = got["read"] == (record["offset"] if here else facts["read"]) and not got["more"]
        lines = got["newlines"] + (0 if got["ends_line"] else 1)     # a file's last line, without a newline
        if lines == want and not got["ends_line"] and not at_end:  # the last line was read cut, and goes on now
            changed(name, "ended inside its last line when it was read (at byte %d, no newline), and that line goes "
                    "on now: the row trained from its cut part is not the line the file holds"
                    % (record["offset"] if here else facts["read"]))
        if lines != want or not got["ends_line"] and not at_end:
            _fail(where, "the field 'extra.lines' (and 'extra.offset') of the checkpoint %r" % checkpoint,
                  "%d, the lines of %s's bytes before the offset %d, at a line start"
                  % (lines, name, record["offset"] if here else facts["read"]), want)
    rows = sum(f["rows"] for f in files[:-1]) + record["rows"]
    if rows < record["batches"] * record["batch_size"]:     # a short last batch: the input ended at the position
        import io  # pylint: disable=import-outside-toplevel
        after = sum(len(batch[2]) for batch in CriteoReader(
            io.BytesIO(got["tail"]), batch_size=1 << 16, max_warnings=0, timestamp_column=train_input.timestamp_column))
        if after:
            _fail(where, "the field 'extra.rows' of the checkpoint %r" % checkpoint, "such that the rows up to the "
                  "position fill its %d batches of %d (a short last batch only where the input ended: %s holds %d "
                  "row(s) after the offset among the bytes that had been read)"
                  % (record["batches"], record["batch_size"], files[k]["name"], after), _Given("%d rows in all" % rows))
    stop = train_input.stops[k]
    if stop is not None and record["offset"] > stop:
        changed(files[k]["name"], "is cut by the held-out split at byte %d, before the position (byte %d): it "
                "changed" % (stop, record["offset"]))
    position = {key: record[key] for key in ("batches", "source", "offset", "lines", "rows")}
    return dict(position, done=files[:k], hasher=got["hasher"]), None


def _job_resume_checkpoint(directory, stdin, printer):
    """The checkpoint of ``directory`` a resumed :func:`train_job` starts from, with its manifest
    (read once, its checksum verified: :func:`_checkpoint_file_manifest`): ``(path, manifest)``, the
    latest (:func:`latest_checkpoint`; ``(None, None)`` when there is none); on a file or a
    directory, when the latest carries no input position (none could be found when it was written),
    the newest one that carries one, said in the log: its input can be proven, the newer one's
    cannot, and the steps after it are trained again as they were."""
    latest = latest_checkpoint(directory)
    if latest is None:
        return None, None
    manifest = _checkpoint_file_manifest(latest)
    if stdin or manifest.get("extra") is not None:
        return latest, manifest
    found = []
    for name in os.listdir(directory):
        step, path = _checkpoint_step(name, "recboost"), os.path.join(directory, name)
        if step is not None and path != latest:
            try:
                other = _checkpoint_file_manifest(path)
            except ValueError:           # a damaged older checkpoint: not one to resume from
                continue
            if other.get("extra") is not None:
                found.append((step, path, other))
    if not found:
        return latest, manifest
    _, older, other = max(found, key=lambda entry: entry[0])
    printer("the newest checkpoint %s carries no input position (none could be found when it was written), so its "
            "input cannot be proven: resuming from %s, the newest one with its position (the steps after it are "
            "trained again)" % (latest, older))
    return older, other


def _job_resume(resume, manifest, train, stdin, printer, resume_by_count=False):
    """How :func:`train_job` resumes from the checkpoint ``resume`` (its ``manifest``:
    :func:`_job_resume_checkpoint`) on its input ``train`` (a :class:`_CriteoInput`; ``stdin``: it
    reads standard input): proves the input and seeks to the position the checkpoint carries
    (:func:`_input_resume_position`; an input that differs is a ValueError naming the file), and says
    how the run resumes. A checkpoint without a position cannot prove its input: refused, unless
    ``resume_by_count`` (the input is then read again from its start and the checkpoint's count of
    batches skipped, logged). Returns ``(resume_skip, samples)``: ``resume_skip`` for
    :meth:`RecModel.online_train` (0 for standard input, which holds only the rows that follow;
    None: the checkpoint's count) and the rows the checkpoint had trained."""
    if stdin:       # the batches it consumed (trained, or kept to replay): all full but an input's last
        batches = manifest["taken"] - manifest.get("stream_start", 0)
        printer("resuming from %s: standard input is taken as the rows that follow the %d batches of %d rows (%d "
                "rows) the checkpoint consumed from its run's standard input, trained or kept to replay (fewer "
                "rows only if that input had ended in a short batch): feed only the rest (a pipe cannot seek; "
                "nothing can prove what is fed)" % (resume, batches, train.batch_size, batches * train.batch_size))
    else:
        position, why = _input_resume_position(resume, train, manifest)
        if position is not None:
            train.seek(position)
            printer("resuming from %s: the input up to the position is the one trained (%d file(s), %s digests "
                    "match); seeking to file %d of %d (%s), byte %d (line %d): the %d batches already trained are "
                    "not read again" % (resume, position["source"] + 1, _INPUT_DIGEST_NAME, position["source"] + 1,
                                        len(train.sources), train.sources[position["source"]],
                                        position["offset"], position["lines"], position["batches"]))
        elif resume_by_count:
            printer("resuming from %s: the batches already trained are read again and skipped by their count, "
                    "UNPROVEN (--resume-by-count), because %s" % (resume, why))
        else:
            _fail("recboost train", "the resume from %r" % resume, "proven to continue the input it was trained on, "
                  "by the input position it carries; if you know the input is unchanged, run again with "
                  "--resume-by-count to read it again from its start and skip the checkpoint's count of batches "
                  "(resume_by_count=True); or start afresh with another --checkpoint-dir",
                  "none (nor has any checkpoint of the directory): %s" % why)
    return (0 if stdin else None), int(manifest["samples"])


def _job_summary(result, window, printer):
    """:func:`train_job`'s closing lines from its ``result``: the run's steps, rows and speed, the
    progressive validation (all rows, and the last ``window``), the lines read, and the held-out
    figures when rows were held out."""
    prog, reader, held = result["progressive"], result["reader"], result["held_out"]
    fmt = lambda v: "n/a" if v is None else "%.4f" % v      # noqa: E731
    printer("done: step %d, %d rows trained in this run, %.1fK rows/s; progressive validation (each batch scored "
            "before it trained) on %d rows: AUC %s, log loss %s (last %d rows: AUC %s, log loss %s); read %d lines, "
            "%s" % (result["steps"], result["rows"], result["samples_per_second"] / 1e3, prog["rows"],
                    fmt(prog["auc"]), fmt(prog["log_loss"]), window, fmt(prog["window_auc"]),
                    fmt(prog["window_log_loss"]), reader["lines"], _malformed_text(reader)))
    if held is not None:
        printer("held out (never trained on): %d rows, AUC %s, log loss %s" % (
            held["rows"], fmt(held["auc"]), fmt(held["log_loss"])))


def _job_input(where, s):
    """:func:`train_job`'s input ``s.data`` split (:func:`_split_input`), with its held-out rows
    refused when they would leave nothing of the split file to train."""
    train, held, held_lines, lines = _split_input(where, s.data, s.holdout, s.batch_size, s.timestamp_column)
    if lines is not None and s.holdout * s.batch_size >= lines:         # nothing of the split file left to train
        most = (lines - 1) // s.batch_size
        _fail(where, "'holdout' (--holdout, batches of --batch-size %d)" % s.batch_size,
              "fewer lines than %s holds, %d (%s)" % (
                  "the file %s" % held.sources[0] if len(train.sources) == 1 else
                  "the directory's last file %s, which it is split from," % held.sources[0], lines,
                  "at most %d batch(es)" % most if most else "too few to hold a batch out: hold out a file of its "
                  "own and score it with serve-check") + ("; or --holdout file to hold out that whole file"
                                                          if len(train.sources) > 1 else ""),
              "%d (%d lines)" % (s.holdout, s.holdout * s.batch_size))
    return train, held, held_lines, lines


def _job_callbacks(s, monitor, train, config, resume):
    """:func:`train_job`'s callbacks for the settings ``s``: ``monitor``, a stop, the EvictHook, the
    exporter and the checkpoints (each directory's ``train-config.json`` written as ``config`` when
    the run starts afresh). Returns ``(callbacks, exporter or None)``."""
    callbacks = [monitor]
    if s.steps is not None:
        callbacks.append(_StopAfter(s.steps))
    if s.eviction_threshold >= 0:
        if s.timestamp_column is None:
            callbacks.append(EvictHook(evict_time_interval=None,
                                       evict_step_interval=max(1, min(60, s.eviction_threshold))))
        else:
            callbacks.append(EvictHook(evict_time_interval=max(1, min(3600, s.eviction_threshold))))
    exporter = None
    if s.export is not None:
        exporter = OnlineExport(os.fspath(s.export), s.export_every, mindir=s.export_mindir)
        callbacks.append(exporter)
        _job_config_write(os.fspath(s.export), config)
    if s.checkpoint_dir is not None:
        callbacks.append(OnlineCheckpoint(s.checkpoint_dir, every_steps=s.checkpoint_every,
                                          full_every=s.checkpoint_full_every) if s.data == "-" else
                         _InputCheckpoint(s.checkpoint_dir, s.checkpoint_every, train, s.checkpoint_full_every))
        if resume is None:
            _job_config_write(s.checkpoint_dir, config)
    return callbacks, exporter


@dataclasses.dataclass(frozen=True)
class _JobRun:
    """What :func:`train_job` hands :func:`_job_result` besides the trained model: its ProgressMonitor
    ``monitor``, its OnlineExport ``exporter`` (or None), the ``held`` out input (or None), the
    ``train`` reader, the hash ``table``, the checkpoint it resumed from (``resume``, or None), the rows
    trained before it (``samples0``) and its ``elapsed`` seconds."""
    monitor: object
    exporter: object
    held: object
    train: object
    table: object
    resume: object
    samples0: int
    elapsed: float


def _job_result(s, rec, run, printer):
    """:func:`train_job`'s result from the trained ``rec`` and the ``run``'s pieces (a :class:`_JobRun`),
    with its closing lines and the learning curve (``s.plot``)."""
    monitor, exporter, held, samples0 = run.monitor, run.exporter, run.held, run.samples0
    rows = rec.samples - samples0
    result = {"steps": rec.step, "rows": rows, "samples_per_second": rows / max(run.elapsed, 1e-9),
              "table": run.table.cache.stats(), "reader": run.train.stats(), "resumed_from": run.resume,
              "exports": list(exporter.paths) if exporter else [],
              "export_failures": list(exporter.failures) if exporter else [], "model": rec,
              "progressive": {"auc": monitor.total_auc(), "log_loss": monitor.total_log_loss(),
                              "window_auc": monitor.running_auc(), "window_log_loss": monitor.window_log_loss(),
                              "rows": monitor.scored_rows()}}
    if s.data == "-" and run.resume is not None:
        printer("resumed run on standard input: %d rows had been trained before it (before this run's input)"
                % samples0)
    result["held_out"] = None if held is None else _score_input(lambda d, i: rec.predict(d, i).asnumpy(), held)
    _job_summary(result, s.window, printer)
    if result["export_failures"]:
        printer("%d EXPORT(S) FAILED, at step(s) %s (logged above; each retried at the next export point); the "
                "newest bundle is %s" % (len(result["export_failures"]), [f["step"] for f in result["export_failures"]],
                                         result["exports"][-1] if result["exports"] else "none"))
    result["history"] = monitor.history
    if s.plot is not None:
        printer("learning curve written to %s" % _plot_learning_curve(
            monitor.history, {"steps": rec.step, **({} if held is None or result["held_out"]["auc"] is None
                                                     else {"auc": result["held_out"]["auc"]})}, s.plot))
    return result


def train_job(data, printer=None, **options):
    """``python -m recboost train``: online training of Wide&Deep (or DeepFM) with a hash embedding on
    Criteo-format data: ``data`` is a file (``.gz`` too), a directory (its files in name order, one
    stream: batches span the files) or ``"-"`` (standard input). The input streams: memory does not
    grow with it. Training runs until the input ends, or ``steps`` (the model's step count).

    Evaluation is progressive validation: each batch is scored before it trains
    (:class:`ProgressMonitor` with ``eval_every=1``): the progress lines and the summary give the
    AUC and log loss over the last ``window`` rows and over every row. ``holdout`` (n batches, or
    "file" for a directory's last file) splits rows off *before* training (:func:`_split_input`;
    refused for standard input; n batches must be fewer lines than the file they are split from),
    never trained on, scored at the end. Without a time column the
    table's clock is the step: ``eviction_threshold`` (>= 0) evicts ids unseen for that many steps,
    checked every 60 steps (every ``eviction_threshold`` steps when that is fewer) by an
    :class:`EvictHook`; -1 (default): no eviction. With ``timestamp_column`` (k: the lines carry an
    integer time at tab-separated column k, see :class:`CriteoReader`) the clock is the data time
    (each batch's latest): ``eviction_threshold`` counts its units (e.g. seconds), checked every
    3600 of them (or every ``eviction_threshold`` when that is fewer).

    ``checkpoint_dir``: :class:`OnlineCheckpoint` every ``checkpoint_every`` steps and at the end
    (with ``checkpoint_full_every`` K: every K-th a full base, the others deltas, its ``full_every``);
    the job's settings are recorded there (``train-config.json``). Run again with the same
    directory, the job resumes from its latest checkpoint: for a file or a directory it proves the
    input is the one trained up to the position recorded with that checkpoint (:class:`_InputCheckpoint`:
    the files' names, sizes and BLAKE2b digests of the bytes read, the file and the byte where the
    batches it consumed end; :func:`_input_resume_position`) and seeks there, so nothing trained is
    parsed again; an input that differs (a file inserted, removed, replaced or edited before the
    position) or a damaged position file is a ValueError naming the file, before anything trains. A
    latest checkpoint without a position file is passed over for the newest one with one
    (:func:`_job_resume_checkpoint`); with none, the resume is refused unless ``resume_by_count``: the
    input is then read again from its start and the batches already trained skipped by their count,
    unproven (logged).
    The result is bit for bit that of an uninterrupted run. For standard input it takes the input as
    the rows that follow those the checkpoint consumed (the caller feeds the rest; the log says how
    many: the batches trained and those kept to replay). Settings that
    differ from those recorded are refused, naming each (:func:`_job_config_check`), and the
    checkpoint's own model and table settings are compared too (:meth:`RecModel.load_checkpoint`).

    ``export``: a directory of serving bundles ``bundle-<step>``, the first full, then deltas, every
    ``export_every`` steps and at the end (:class:`OnlineExport`; see :func:`serve_check`; with
    ``export_mindir`` each also holds the network as MindIR, ``OnlineExport(mindir=True)``): a bundle
    that fails to be written (a full disk...) is logged and tried again at the next export point
    while training goes on; the summary names the failures. ``plot``: the learning curve as
    a PNG (needs matplotlib). The other arguments are those of :func:`demo` and :class:`RecModel`.

    Returns:
        dict: ``steps``, ``rows`` (trained in this run), ``samples_per_second``, ``progressive``
        (``auc``, ``log_loss``, ``window_auc``, ``window_log_loss``, ``rows``), ``held_out`` (``rows``,
        ``auc``, ``log_loss``; or None), ``reader`` (input counts), ``table`` (cache stats),
        ``resumed_from`` (a checkpoint path or None), ``exports`` (bundle paths), ``export_failures``
        (:attr:`OnlineExport.failures`), ``model`` (the RecModel).
    """
    printer = printer or _log
    where = "recboost train"
    s = _JobSettings.checked(where, dict(options, data=data))
    if s.plot is not None:
        _require_matplotlib(where)
    stdin = s.data == "-"
    train, held, held_lines, lines = _job_input(where, s)
    config = dict(s.recorded(), data=s.data if stdin else os.path.abspath(os.fspath(s.data)))
    resume = manifest = None
    if s.checkpoint_dir is not None and os.path.isdir(s.checkpoint_dir) \
            and latest_checkpoint(s.checkpoint_dir) is not None:
        _job_config_check(where, s.checkpoint_dir, config)
        resume, manifest = _job_resume_checkpoint(s.checkpoint_dir, stdin, printer)
    if s.export_mindir and s.export is None:
        _fail(where, "'export_mindir'", "False without 'export' (the MindIR goes into the exported bundles)", True)
    for name, off in (("checkpoint_full_every", None), ("resume_by_count", False)):
        if s.checkpoint_dir is None and getattr(s, name) != off:
            _fail(where, "'%s'" % name, "%s without 'checkpoint_dir' (it acts on the checkpoints of that directory)"
                  % off, getattr(s, name))
    if s.export is not None and resume is None and os.path.isdir(s.export) and os.listdir(s.export):
        _fail(where, "'export'", "a new or empty directory when the run starts afresh (bundles of another run "
              "would mix with this one's)", "%r, which is not empty" % s.export)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    net, table = _job_network(s.model, s.seed, s.learning_rate, s.table_options(), where)
    rec = RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), s.learning_rate),
                   amp_level=s.amp_level, boost_level=s.boost_level)
    monitor = ProgressMonitor(every_seconds=s.progress_seconds, eval_every=1, window=s.window, printer=printer,
                              status=lambda: _malformed_text(train.stats()))
    callbacks, exporter = _job_callbacks(s, monitor, train, config, resume)
    printer("training %s online on %s in batches of %d rows%s%s" % (
        s.model, "standard input" if stdin else s.data, s.batch_size,
        "" if s.steps is None else ", up to step %d" % s.steps,
        "" if held is None else "; held out before training, never trained on: %s" % (
            "its last file %s" % held.sources[0] if held_lines is None else
            "the last %d of %d lines of %s" % (held_lines, lines, held.sources[0]))))
    skip, samples0 = _job_resume(resume, manifest, train, stdin, printer, s.resume_by_count) \
        if resume is not None else (None, 0)
    t0 = time.perf_counter()
    rec.online_train(train, callbacks=callbacks, dataset_sink_mode=False, resume_from=resume, resume_skip=skip)
    run = _JobRun(monitor=monitor, exporter=exporter, held=held, train=train, table=table, resume=resume,
                  samples0=samples0, elapsed=time.perf_counter() - t0)
    return _job_result(s, rec, run, printer)


train_job.__signature__ = inspect.Signature(
    [inspect.Parameter("data", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
       for f in dataclasses.fields(_JobSettings) if f.name != "data"]
    + [inspect.Parameter("printer", inspect.Parameter.KEYWORD_ONLY, default=None)])


def serve_check(directory, data, batch_size=2048, model=None, printer=None):
    """``python -m recboost serve-check DIR --data FILE``: load the newest serving bundle of ``DIR``
    (a ``recboost train --export`` directory: its chain of full bundle and deltas) with
    :class:`Predictor` into a freshly built network, as a server would, and score the Criteo-format
    ``data`` (a file, a directory or "-"). ``DIR`` may also be one bundle. The network is built from
    the ``train-config.json`` the export directory holds (checked: damaged, edited or of bad fields, a
    ValueError naming it; ``model`` overrides it; needed for a bundle without one), and must be the
    network the bundle records (:class:`Predictor`: a Wide&Deep bundle scored as DeepFM is refused,
    naming the setting); ``data`` is read in the format of the training data (its
    ``timestamp_column``, if it had one).

    Returns:
        dict: ``bundle`` (its path), ``step``, ``rows``, ``auc``, ``log_loss``.
    """
    printer = printer or _log
    where = "recboost serve-check"
    _check_path(where, "directory", directory)
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        _fail(where, "'directory'", "an export directory or a bundle", "%r, which is not a directory" % directory)
    bundles = _export_bundles(directory)
    bundle = bundles[-1][1] if bundles else directory
    config = {}
    for folder in (directory, os.path.dirname(os.path.abspath(directory))):
        if os.path.isfile(os.path.join(folder, _JOB_CONFIG)):
            config = _job_config_read(where, folder)
            break
    model = model or config.get("model")
    if model is None:
        _fail(where, "'model'", "given (no %s beside the bundle names it)" % _JOB_CONFIG, None)
    _check_one_of(where, "model", model, ("widedeep", "deepfm"))
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    table = {"capacity": config.get("capacity", 1 << 20), "eviction_policy": config.get("eviction_policy"),
             "growth": config.get("growth", True)}
    net, _ = _job_network(model, config.get("seed", 0), 1e-3, table, where)
    predictor = Predictor(net, bundle)
    result = _score_input(predictor.predict, _CriteoInput(_data_sources(where, data), batch_size,
                                                          timestamp_column=config.get("timestamp_column")))
    result.update(bundle=bundle, step=predictor.step)
    printer("serve-check: bundle %s (step %d): %d rows, AUC %s, log loss %s" % (
        bundle, predictor.step, result["rows"], "n/a" if result["auc"] is None else "%.4f" % result["auc"],
        "n/a" if result["log_loss"] is None else "%.4f" % result["log_loss"]))
    return result


def demo(steps=3000, batch_size=2048, model="widedeep", data=None, seed=0, capacity=1 << 20,
         access_threshold=1, eviction_threshold=6 * 3600, eval_batches=32, progress_seconds=10.0,
         checkpoint_dir=None, printer=None, learning_rate=1e-3, plot=None, eviction_policy=None,
         admission_counter=None):
    """The main job: online training of Wide&Deep (or DeepFM) with a hash embedding on a stream.

    On the built-in synthetic stream (default; one batch is a minute of data time) the ids drift
    over time, so admission (``access_threshold``) and eviction (``eviction_threshold`` seconds of
    data time without a sighting, checked every data hour by an :class:`EvictHook`) matter; the run ends with the AUC and log loss on the
    next ``eval_batches`` batches of the stream, next to the oracle AUC (the AUC of the true click
    probabilities on the same rows), and the training samples/s. With ``data`` (a Criteo-format
    file, ``.gz`` too) it streams that file instead: its last ``eval_batches * batch_size`` lines are
    held out before training starts and never trained on (:func:`criteo_split`), every line before
    them is trained on in order (memory does not grow with the file), and the model is evaluated
    on the held-out lines; the file has no time column, so the table's clock is the step count
    (``eviction_threshold`` then counts steps, and the EvictHook checks every 60 steps). Both report
    the progressive AUC as well: each batch scored before it trains (``ProgressMonitor``).
    ``learning_rate`` is the dense and sparse Adam's. ``plot`` (a path) writes the learning curve:
    progressive AUC against the oracle AUC, and samples/s, over the steps (needs matplotlib, the
    ``bench`` extra; checked before training starts). ``eviction_policy`` (None, "lru", "lfu"): the
    table keeps ``capacity`` rows and a full table replaces ids by that policy (``HashEmbedding``);
    None: the table grows when full. ``admission_counter`` (None, "exact" or "sketch", default
    sizes): where the table counts the ids it holds no row for (``HashEmbedding``; None: a sketch
    with an eviction policy).

    Returns:
        dict: ``auc``, ``oracle_auc`` (synthetic only), ``log_loss``, ``samples_per_second``,
        ``steps``, ``table`` (cache stats).
    """
    printer = printer or _log
    where = "recboost demo"
    _check_one_of(where, "model", model, ("widedeep", "deepfm"))
    if plot is not None:
        _require_matplotlib(where)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    net, table = _job_network(model, seed, learning_rate, dict(
        capacity=capacity, access_threshold=access_threshold, eviction_threshold=eviction_threshold,
        eviction_policy=eviction_policy, admission_counter=admission_counter), where)
    rec = RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), learning_rate))
    monitor = ProgressMonitor(every_seconds=progress_seconds, printer=printer)
    callbacks = [monitor, _StopAfter(steps)]
    if data is None:
        stream = SyntheticClickStream(seed=seed, batch_size=batch_size, with_timestamp=True,
                                      rows_per_second=batch_size / 60.0)
        train = _timestamped(stream)
        callbacks.append(EvictHook(evict_time_interval=3600))
        printer("training %s online on the synthetic stream: %d steps of %d rows" % (model, steps, batch_size))
    else:
        train, held_input, held_lines, lines = _split_input(where, data, eval_batches, batch_size)
        trained_lines = lines - held_lines
        callbacks.append(EvictHook(evict_step_interval=60))
        printer("training %s online on %s: its first %d of %d lines (up to %d steps of %d rows); its last %d lines "
                "are held out, never trained on" % (model, data, trained_lines, lines, steps, batch_size,
                                                    lines - trained_lines))
    if checkpoint_dir is not None:
        callbacks.append(OnlineCheckpoint(checkpoint_dir, every_seconds=60))
    t0 = time.perf_counter()
    rec.online_train(train, callbacks=callbacks, dataset_sink_mode=False)
    elapsed = time.perf_counter() - t0
    result = {"steps": rec.step, "samples_per_second": rec.samples / elapsed, "table": table.cache.stats()}
    result["progressive_auc"] = monitor.running_auc()
    if data is None:
        stream.with_probability = True
        held_out = stream.take(eval_batches)
        labels = np.concatenate([b[2] for b in held_out]).ravel()
        result["oracle_auc"] = roc_auc(labels, np.concatenate([b[3] for b in held_out]).ravel())
    else:
        result["reader"] = train.stats()
        held_out = list(held_input)
        result["held_out_reader"] = held_input.stats()
        if not held_out:
            _fail(where, "the held-out lines of %s" % data, "at least one row", "none")
        labels = np.concatenate([b[2] for b in held_out]).ravel()
        bad = sum(result["reader"]["malformed"].values())
        printer("read %d lines of %s: %d malformed lines skipped %s" % (
            result["reader"]["lines"], data, bad, {k: v for k, v in result["reader"]["malformed"].items() if v}))
    logits = np.concatenate([rec.predict(b[0], b[1]).asnumpy().ravel() for b in held_out])
    probs = _sigmoid(logits)
    result["auc"] = roc_auc(labels, probs)
    result["log_loss"] = log_loss(labels, probs)
    line = "done: %d steps, %.1fK samples/s, AUC %.4f" % (rec.step, result["samples_per_second"] / 1e3, result["auc"])
    if "oracle_auc" in result:
        line += " (oracle %.4f, gap %.4f)" % (result["oracle_auc"], result["oracle_auc"] - result["auc"])
    printer(line + ", log loss %.4f on %d held-out rows; progressive AUC %s (each batch scored before it trained)"
            % (result["log_loss"], labels.size, "n/a" if result["progressive_auc"] is None
               else "%.4f" % result["progressive_auc"]))
    result["history"] = monitor.history
    if plot is not None:
        printer("learning curve written to %s" % _plot_learning_curve(monitor.history, result, plot))
    return result



# ---- python -m recboost serve: the options and the job ---------------------------------------------


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class _ServeSettings:
    """The options of ``python -m recboost serve`` (:func:`serve`'s keywords), each declared once as a
    field (:func:`_option`), as :class:`_JobSettings` declares the other jobs'."""

    host: str = _option("127.0.0.1", _Rule("a host name or address", str, test=bool), "the address to listen on "
                        "(default 127.0.0.1: this machine only; 0.0.0.0: every interface)", commands=("serve",))
    port: int = _option(8000, _Int(0, 65535), "the TCP port (default 8000; 0: a free one, logged in the "
                        "'listening' line)", commands=("serve",), type=int)
    model_name: str = _option("recboost", _Rule("a name of letters, digits, '_', '-' and '.'", str,
                                                test=lambda v: _MODEL_NAME.fullmatch(v) is not None),
                              "the model's name in the endpoints' paths (/v2/models/NAME/infer; default recboost)",
                              commands=("serve",), metavar="NAME")
    max_batch_size: int = _option(512, _Int(1), "merge concurrent requests into one predict call of at most this "
                                  "many rows (default 512; a larger request runs alone)", commands=("serve",),
                                  type=int, metavar="ROWS")
    max_delay_ms: float = _option(2.0, _Rule("a finite number >= 0", (int, float),
                                             test=lambda v: math.isfinite(v) and v >= 0),
                                  "wait at most this long after a request for others to merge with it (default 2 "
                                  "ms; 0: merge only the requests already queued)", commands=("serve",), type=float,
                                  metavar="MS")
    poll_interval: float = _option(1.0, _Rule("a finite number > 0", (int, float),
                                              test=lambda v: math.isfinite(v) and v > 0),
                                   "look for new bundles in DIR this often (default 1 s)", commands=("serve",),
                                   type=float, metavar="S")
    network: str = _option(None, _Rule("module:callable", str, test=lambda v: re.fullmatch(
        r"[\w.]+:[\w.]+", v) is not None).or_none(), "build the network with this callable (no arguments), imported "
        "from its module; its bundle's recorded network is checked against it (default: rebuilt from the settings "
        "a bundle of recboost's WideDeep records)", commands=("serve",), metavar="MODULE:CALLABLE")
    max_body_bytes: int = _option(64 << 20, _Int(1), "refuse a request body larger than this, with 413 (default "
                                  "64 MiB)", commands=("serve",), type=int, metavar="BYTES")

    checked = classmethod(_JobSettings.checked.__func__)
    add_options = classmethod(_JobSettings.add_options.__func__)
    parsed = classmethod(_JobSettings.parsed.__func__)


def serve(directory, **options):
    """``python -m recboost serve DIR``: serve the bundles of ``DIR`` (a ``recboost train --export`` or
    :class:`OnlineExport` directory, or one bundle) over the Open Inference Protocol (KServe v2,
    HTTP/REST, JSON and binary tensor data) until SIGTERM or SIGINT. The options are
    :class:`_ServeSettings`' fields (``host``, ``port``, ``model_name``, ``max_batch_size``,
    ``max_delay_ms``, ``poll_interval``, ``network``, ``max_body_bytes``).

    The newest bundle that passes :class:`Predictor`'s checks is served (with its chain of deltas),
    then each newer one as it appears (``_BundleFollower``): checked aside and swapped in at once, or
    refused (logged by name, counted) while the one served goes on. Every response comes from one
    bundle, its step the response's ``model_version``. Predictions run on one thread
    (``_Batcher``), concurrent requests merged. The endpoints: ``GET /v2/health/live``,
    ``/v2/health/ready``, ``/v2``, ``/v2/models/<name>`` (metadata), ``/v2/models/<name>/ready``,
    ``/metrics`` (Prometheus); ``POST /v2/models/<name>/infer``. A bad request is a 4xx with a JSON
    ``error`` naming the input. Logs are JSON lines on stderr (``listening`` names the port). On
    SIGTERM the requests in flight are answered, then it returns. Needs the extra 'serve'.

    Returns:
        int: 0, once stopped.
    """
    where = "recboost serve"
    s = _ServeSettings.checked(where, options)
    _check_path(where, "directory", directory)
    if not os.path.isdir(directory):
        _fail(where, "'directory'", "an export directory or a bundle", "%r, which is not a directory" % directory)
    mods = _require_serve(where)
    import signal  # pylint: disable=import-outside-toplevel
    import socket  # pylint: disable=import-outside-toplevel
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    metrics = _ServeMetrics(mods.prometheus_client)
    follower = _BundleFollower(where, os.fspath(directory), s.network, s.poll_interval, metrics)
    batcher = _Batcher(follower.predict, s.max_batch_size, s.max_delay_ms / 1e3, metrics)
    try:
        warm = [np.zeros([1 if d == -1 else d for d in spec.shape], _SERVE_DATATYPES[spec.datatype])
                for spec in follower.inputs]
        batcher.submit(warm, 1).result()                  # the graph compiled before the first request
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        try:
            sock = socket.create_server((s.host, s.port), family=family)
        except OSError as exc:
            raise _io_failed(exc, "listening on %s port %d" % (s.host, s.port)) from exc
        config = mods.uvicorn.Config(None, log_level="warning", access_log=False, lifespan="off")
        server = mods.uvicorn.Server(config)
        config.app = _serve_app(mods, s.model_name, follower, batcher, metrics, s.max_body_bytes,
                                lambda: not server.should_exit)
        for sig in (signal.SIGINT, signal.SIGTERM):      # uvicorn raises the signal again once it has drained:
            signal.signal(sig, lambda *_: None)          # then it ends nothing, and serve returns
        follower.start()
        _serve_log("listening", host=s.host, port=sock.getsockname()[1], model=s.model_name,
                   bundle=follower.bundle, step=follower.step)
        server.run(sockets=[sock])
    finally:
        follower.close()
        batcher.close()
    _serve_log("stopped", step=follower.step)
    return 0


def _job_parser(sub, command, **kwargs):
    """The parser of ``command`` (a sub-command of ``sub``) with its options from :class:`_JobSettings`:
    the hash table's as their own group (the one place they enter the command line)."""
    parser = sub.add_parser(command, **kwargs)
    _JobSettings.add_options(parser, command, table=False)
    _JobSettings.add_options(parser.add_argument_group("hash table"), command, table=True)
    return parser


def main(argv=None):
    """Entry point of ``python -m recboost``: ``demo`` runs the main job (see :func:`demo`), ``train``
    trains on Criteo-format files, directories or standard input (:func:`train_job`), ``serve-check``
    scores a file with an exported bundle chain (:func:`serve_check`), ``serve`` serves an export
    directory over the Open Inference Protocol (:func:`serve`). The options are
    :class:`_JobSettings`' fields. Bad input (a missing file, a
    wrong option value, a changed configuration on resume) ends with exit code 2 and its message,
    no traceback; training stopped on purpose (checkpoints that keep failing to save, a run of skipped
    steps), with exit code 3 and its message."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m recboost", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version="recboost %s (%s backend)"
                        % (__version__, "compiled" if FAST_BACKEND else "numpy"))
    sub = parser.add_subparsers(dest="command", required=True)
    _job_parser(sub, "demo", help="online training of Wide&Deep with hash embeddings (the main job)")
    _job_parser(sub, "train", help="online training on Criteo-format data: a file (.gz too), a directory or "
                                   "standard input", description=(
                    "Online training of Wide&Deep (or DeepFM) with a hash embedding on Criteo-format data "
                    "(label, 13 integer and 26 hex fields, tab-separated). Each batch is scored before "
                    "it trains (progressive validation); the progress lines give rows/s, the AUC and "
                    "log loss of the last --window rows and of all, the table's rows and the malformed "
                    "lines skipped by kind. Re-running the same command with --checkpoint-dir resumes "
                    "from the latest checkpoint. See docs/training.md."))
    s = _job_parser(sub, "serve-check", help="score Criteo-format data with the newest bundle of an --export "
                                             "directory, loaded by Predictor as a server would")
    s.add_argument("directory", help="a train --export directory (or one bundle)")
    s = sub.add_parser("serve", help="serve an --export directory over the Open Inference Protocol (KServe v2, "
                                     "HTTP): its newest bundle, then each new one as it appears", description=(
                           "Serve the bundles of DIR over the Open Inference Protocol (KServe v2, HTTP/REST; JSON "
                           "and binary tensor data): the newest bundle that passes its checks, then each newer one "
                           "(checked aside and swapped in; a damaged one is refused and logged). Endpoints: "
                           "/v2/health/live, /v2/health/ready, /v2/models/NAME (metadata), /v2/models/NAME/ready, "
                           "/v2/models/NAME/infer (POST), /metrics (Prometheus). SIGTERM drains the requests in "
                           "flight. Needs pip install 'recboost[serve]'. See docs/serving.md."))
    s.add_argument("directory", metavar="DIR", help="a train --export (OnlineExport) directory, or one bundle")
    _ServeSettings.add_options(s, "serve", table=False)
    args = parser.parse_args(argv)
    options = (_ServeSettings if args.command == "serve" else _JobSettings).parsed(args, args.command)
    try:
        if args.command == "demo":
            demo(**options)
        elif args.command == "train":
            train_job(**options)
        elif args.command == "serve":
            serve(args.directory, **options)
        else:
            serve_check(args.directory, **options)
    except (ImportError, ValueError, TypeError, OSError, EOFError) as exc:   # bad input: its message, no traceback
        parser.exit(2, "python -m recboost %s: %s\n" % (args.command, exc))
    except _TrainingStopped as exc:        # failed checkpoints or a run of skipped steps: the last good one kept
        parser.exit(3, "python -m recboost %s: training stopped: %s\n" % (args.command, exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
