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

# ---- backend binding -------------------------------------------------------------------------------
#: Names of the kernels that exist in both backends (one per line, each issue adds its own).
_KERNEL_NAMES = (
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
