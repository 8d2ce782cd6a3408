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
# ---- boost configuration (AutoBoost) ------------------------------------------------------------
# Immutable tables; every AutoBoost builds its own dicts from them (no shared mutable preset).
#: Boost algorithms, in the order of MindSpore's "boost" section.
_BOOST_ALGORITHMS = ("less_bn", "grad_freeze", "adasum", "grad_accumulation", "dim_reduce",
                     "loss_scale_group")
#: Algorithms each level turns on (MindSpore's presets).
_BOOST_LEVELS = {"O0": (), "O1": ("less_bn", "grad_freeze"), "O2": ("less_bn", "grad_freeze", "adasum")}
_BOOST_MODES = ("auto", "manual", "enable_all", "disable_all")


def _cfg_bool(v):
    return v if isinstance(v, (bool, np.bool_)) else ValueError("a bool")


def _cfg_int(lo, hi=None):
    def check(v):
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        if not ok or v < lo or (hi is not None and v > hi):
            return ValueError("an int in [%s, %s]" % (lo, "inf" if hi is None else hi))
        return int(v)
    return check


def _cfg_num(lo, hi, lo_open=False, hi_open=False):
    def check(v):
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        if ok:
            v = float(v)
            ok = np.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            return ValueError("a number in %s%s, %s%s" % ("(" if lo_open else "[", lo, hi, ")" if hi_open else "]"))
        return v
    return check


def _cfg_path(v):
    return v if v is None or isinstance(v, str) else ValueError("None or a path string")


def _cfg_split_groups(v):
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        v = [v]                         # MindSpore's list(int) raises here; one split point is meant
    if not isinstance(v, (list, tuple)) or any(
            isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0 for x in v):
        return ValueError("a list of ints >= 0")
    return [int(x) for x in v]


#: section -> ((key, default, checker), ...): the seed's defaults, plus recboost's explicit seeds.
_BOOST_SETTINGS = (
    ("common", (("gradient_split_groups", (50, 100), _cfg_split_groups),
                ("device_number", 8, _cfg_int(1)))),
    ("less_bn", (("fn_flag", True, _cfg_bool), ("gc_flag", True, _cfg_bool))),
    ("grad_freeze", (("param_groups", 10, _cfg_int(1, 65535)), ("freeze_type", 1, _cfg_int(0, 1)),
                     ("freeze_p", 0.7, _cfg_num(0.0, 1.0, hi_open=True)),
                     ("total_steps", 65536, _cfg_int(1, 2 ** 30)), ("seed", 0, _cfg_int(0, 2 ** 64 - 1)))),
    ("grad_accumulation", (("grad_accumulation_step", 1, _cfg_int(1)),)),
    ("dim_reduce", (("rho", 0.55, _cfg_num(0.0, 1.0, lo_open=True)), ("gamma", 0.9, _cfg_num(0.0, 1.0)),
                    ("alpha", 0.001, _cfg_num(0.0, np.inf)), ("sigma", 0.4, _cfg_num(0.0, np.inf)),
                    ("n_components", 32, _cfg_int(1)), ("pca_mat_path", None, _cfg_path),
                    ("weight_load_dir", None, _cfg_path), ("timeout", 1800, _cfg_num(0.0, np.inf, True)),
                    ("seed", 0, _cfg_int(0, 2 ** 32 - 1)))),
)


def _boost_config_key(section, key, value):
    """Validate one ``section.key`` of a boost config; returns the normalised value."""
    for sec, items in _BOOST_SETTINGS:
        if sec == section:
            for name, _, check in items:
                if name == key:
                    out = check(value)
                    if isinstance(out, ValueError):
                        _fail("AutoBoost", "the key '%s.%s'" % (section, key), out.args[0], value)
                    return out
            _fail("AutoBoost", "the key of section '%s'" % section, "one of %s" % [n for n, _, _ in items], key)
    raise AssertionError(section)


def _read_boost_config_dict(boost_config_dict):
    """``boost_config_dict`` as a dict: '' / None -> {}, a path -> the JSON file's object."""
    if boost_config_dict is None or (isinstance(boost_config_dict, str) and not boost_config_dict):
        return {}
    if isinstance(boost_config_dict, (str, os.PathLike)):
        path = os.fspath(boost_config_dict)
        if not os.path.isfile(path):
            _fail("AutoBoost", "'boost_config_dict'", "a dict or the path of an existing JSON file", path)
        import json
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
    """Return ``(flags, settings)`` for a level and a user config, validated once.

    ``flags`` maps each algorithm to whether it runs, after the mode and the seed's precedence rules
    (dim_reduce on -> every other algorithm off; else grad_freeze on -> every other one off);
    ``settings`` maps each section to its complete key -> value dict (defaults for unset keys).
    """
    if not isinstance(level, str) or level not in _BOOST_LEVELS:
        _fail("AutoBoost", "'level'", "one of %s" % list(_BOOST_LEVELS), level)
    user = _read_boost_config_dict(boost_config_dict)
    sections = ["boost"] + [sec for sec, _ in _BOOST_SETTINGS]
    for section, body in user.items():
        if section not in sections:
            _fail("AutoBoost", "the section of 'boost_config_dict'", "one of %s" % sections, section)
        if not isinstance(body, dict):
            _fail("AutoBoost", "the section '%s'" % section, "a dict", body, TypeError)
    boost = user.get("boost", {})
    for key in boost:
        if key not in ("mode",) + _BOOST_ALGORITHMS:
            _fail("AutoBoost", "the key of section 'boost'", "one of %s" % (["mode"] + list(_BOOST_ALGORITHMS)),
                  key)
    mode = boost.get("mode", "auto")
    if not isinstance(mode, str) or mode not in _BOOST_MODES:
        _fail("AutoBoost", "the key 'boost.mode'", "one of %s" % list(_BOOST_MODES), mode)
    for key in _BOOST_ALGORITHMS:
        if key in boost and not isinstance(boost[key], (bool, np.bool_)):
            _fail("AutoBoost", "the key 'boost.%s'" % key, "a bool", boost[key], TypeError)
    flags = {key: key in _BOOST_LEVELS[level] for key in _BOOST_ALGORITHMS}
    if mode == "manual":
        flags.update({key: bool(boost[key]) for key in _BOOST_ALGORITHMS if key in boost})
    elif mode in ("enable_all", "disable_all"):
        flags = dict.fromkeys(_BOOST_ALGORITHMS, mode == "enable_all")
    for winner in ("dim_reduce", "grad_freeze"):
        if flags[winner]:
            flags = {key: key == winner for key in _BOOST_ALGORITHMS}
            break
    settings = {sec: {name: (list(default) if isinstance(default, tuple) else default)
                      for name, default, _ in items} for sec, items in _BOOST_SETTINGS}
    for section, body in user.items():
        if section != "boost":
            for key, value in body.items():
                settings[section][key] = _boost_config_key(section, key, value)
    return flags, settings


# =====================================================================================================
# Host kernels: pure-numpy twins of _fast.pyx
# =====================================================================================================
# Every compiled kernel ``_recboost_fast.NAME`` has a twin ``_py_NAME`` here with bit-identical
# results. The block at the end of this section binds the public names once.

# ---- gradient freeze and PCA twins (boost) ----------------------------------------------------------
_U64 = np.uint64


def _py_splitmix64(x):
    """splitmix64 of a uint64 array (wrapping arithmetic, as in _fast.pyx)."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


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
    draws = np.arange(1, freeze_cnt + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        u = ((_py_splitmix64(_U64(seed) + draws * _U64(0x9E3779B97F4A7C15)) >> _U64(32)) * tri[-1]) >> _U64(32)
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


# ---- backend binding -------------------------------------------------------------------------------
#: Names of the kernels that exist in both backends (one per line, each issue adds its own).
_KERNEL_NAMES = (
    "freeze_index_sequence",
    "pca_rows_copy",
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
# MindSpore's gradient freezing, with the work really skipped on CPU: freeze index ``i`` trains only
# the parameter groups ``i..`` (the layers next to the loss); the frozen groups get no gradient (the
# backward pass stops early) and no optimizer update. Each group index has its own train graph.


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


class _FreezeStepCell(nn.Cell):
    """One freeze index's train step: grads for its group only, its optimizer, optional accumulation."""

    def __init__(self, network, sens, grad, grad_reducer, use_grad_accumulation, optimizer,
                 max_accumulation_step=1):
        super().__init__(auto_prefix=False)
        self.network = network
        self.grad = grad
        self.grad_reducer = grad_reducer
        self.opt = optimizer
        self.parameters = optimizer.parameters
        self.sens = float(sens)
        self.use_grad_accumulation = use_grad_accumulation
        if use_grad_accumulation:
            self.grad_accumulation = GradientAccumulation(max_accumulation_step, optimizer)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.parameters)(*inputs, sens)
        grads = self.grad_reducer(grads)
        if self.use_grad_accumulation:
            return self.grad_accumulation(loss, grads)
        return ops.depend(loss, self.opt(grads))


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
        self._freeze_p = _check_number("GradientFreeze", "freeze_p", freeze_p, 0.0)
        if self._freeze_p >= 1.0:
            _fail("GradientFreeze", "'freeze_p'", "a number in [0, 1)", freeze_p)
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
        p = _check_number("generate_freeze_index_sequence", "freeze_p", freeze_p, 0.0)
        if p >= 1.0:
            _fail("generate_freeze_index_sequence", "'freeze_p'", "a number in [0, 1)", freeze_p)
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


def freeze_cell(reducer_flag, network, optimizer, sens, grad, use_grad_accumulation, mean=None, degree=None,
                max_accumulation_step=1):
    """The per-freeze-index train cells of a ``FreezeOpt`` (one per group, as a tuple).

    Args:
        reducer_flag (bool): data-parallel training (gradients are averaged over ranks per group).
        network (Cell): the network with loss. optimizer (FreezeOpt). sens (Number): backward scale.
        grad (GradOperation): with ``get_by_list=True, sens_param=True``.
        use_grad_accumulation (bool), mean (bool), degree (int), max_accumulation_step (int).
    """
    if not isinstance(optimizer, FreezeOpt):
        _fail("freeze_cell", "'optimizer'", "a FreezeOpt", type(optimizer).__name__, TypeError)
    cells = []
    for opt in optimizer.opts:
        reducer = nn.Identity()
        if reducer_flag:
            reducer = nn.DistributedGradReducer(opt.parameters, mean, degree)
        cells.append(_FreezeStepCell(network, sens, grad, reducer, use_grad_accumulation, opt,
                                     max_accumulation_step))
    return tuple(cells)


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
    """Save ``pca_mat`` as ``.npy`` atomically (written beside ``path``, then renamed onto it)."""
    path = os.fspath(path)
    if not path.endswith(".npy"):
        _fail("save_pca_mat", "'path'", "a path ending in .npy", path)
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(pca_mat, dtype=np.float32))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
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


def load_pca_rows(path, rank, rank_size, n_components=None, timeout=1800):
    """This rank's rows of the PCA matrix at ``path`` as float32 ``(ceil(k / rank_size), n)``.

    Only those rows are read (memory map + ``pca_rows_copy``); rows past ``k`` are zero. ``k`` is
    ``n_components`` (default: all rows of the file). The file must be complete: in a distributed job
    call it after the saving rank's rename (``network_auto_process_train`` puts a barrier there).
    """
    rank_size = _check_int("load_pca_rows", "rank_size", rank_size, 1)
    rank = _check_int("load_pca_rows", "rank", rank, 0, rank_size - 1)
    if not _npy_is_complete(path):
        _fail("load_pca_rows", "'path'", "a complete .npy file (written by save_pca_mat)", path)
    src = np.load(path, mmap_mode="r")
    if src.ndim != 2 or src.dtype not in (np.float32, np.float64):
        _fail("load_pca_rows", "the PCA matrix", "a 2-D float32/float64 array", (src.shape, str(src.dtype)))
    k = src.shape[0] if n_components is None else _check_int("load_pca_rows", "n_components", n_components, 1)
    if k > src.shape[0]:
        _fail("load_pca_rows", "'n_components'", "<= the %d rows of %s" % (src.shape[0], path), k)
    local = _pca_rows_per_rank(k, rank_size)
    out = np.empty((local, src.shape[1]), dtype=np.float32)
    pca_rows_copy(src[:k], rank * local, out)
    del src
    return out


def _prepare_pca_mat(settings, network):
    """Path of the full PCA matrix: the given ``pca_mat_path`` if complete, else computed from
    ``weight_load_dir`` by rank 0 and saved once; all ranks meet at a barrier after the save."""
    cfg = settings["dim_reduce"]
    path = cfg["pca_mat_path"]
    reducer_flag, rank, _ = _boost_parallel()
    if path is not None and path.endswith(".npy") and _npy_is_complete(path):
        return path
    load_dir = cfg["weight_load_dir"]
    if load_dir is None or not os.path.isdir(load_dir):
        _fail("AutoBoost", "the key 'dim_reduce.weight_load_dir'",
              "an existing directory of .ckpt files (no complete 'pca_mat_path' was found)", load_dir)
    if path is None:
        path = os.path.join(load_dir, "pca_mat.npy")
    if rank == 0:
        data = _checkpoint_matrix(load_dir, network)
        save_pca_mat(compute_pca_mat(data, cfg["n_components"], cfg["seed"]), path)
    if reducer_flag:
        from mindspore.communication.comm_func import barrier
        barrier()
    if not _npy_is_complete(path):
        raise RuntimeError("For 'AutoBoost', the PCA matrix %r is missing or incomplete after rank 0 saved it."
                           % path)
    return path


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
# Same names and arguments as ``mindspore.boost``; everything runs on CPU in GRAPH mode. Cells read
# their configuration from the AutoBoost that processed the optimizer (``optimizer._recboost_boost``)
# or from an explicit ``boost=`` argument: there is no process-wide state.
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
    """Gradient centralization: subtract the mean over every axis but the first (ndim >= 2)."""
    if flag and grad.ndim >= 2:
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
        self.x_norm = ops.L2Normalize(axis=1)
        self.w_norm = ops.L2Normalize(axis=1)
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        x = self.matmul(self.x_norm(x), self.w_norm(self.weight))
        if self.has_bias:
            x = x + self.bias
        return self.multiplier * x


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

    GC runs on CPU (MindSpore's Centralization op is Ascend-only): the new optimizer subtracts the mean
    over all axes but the first from the gradient of every >= 2-D weight (not bias/beta/gamma, not
    grouped convolutions, not the FN head).
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
        """Turn GC on for the network's weights (a flat parameter list becomes one group first)."""
        params = list(self.origin_params) if self.origin_params is not None else []
        if not params:
            raise ValueError("For 'OptimizerProcess', the optimizer has an empty parameter list.")
        if isinstance(params[0], Parameter):
            params = [{"params": params}]
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


def _boost_parallel():
    """``(reducer_flag, rank, rank_size)`` of the current parallel context."""
    mode = ms.get_auto_parallel_context("parallel_mode")
    if mode in ("data_parallel", "hybrid_parallel"):
        from mindspore.communication import get_group_size, get_rank
        return True, get_rank(), get_group_size()
    return False, 0, 1


class BoostTrainOneStepCell(nn.TrainOneStepCell):
    """Train step with the boost algorithms (gradient freeze, accumulation, AdaSum, DimReduce).

    Args:
        network (Cell): the network with loss (single output). optimizer (Cell): the optimizer, as
            returned by ``AutoBoost.network_auto_process_train`` (a ``FreezeOpt`` turns freezing on).
        sens (Number): backward scale. Default 1.0.
        boost (AutoBoost, optional): where the settings come from; default: the AutoBoost that
            processed ``optimizer``, else none (accumulation 1, no AdaSum/DimReduce).

    Returns the loss.
    """

    def __init__(self, network, optimizer, sens=1.0, boost=None):
        if sens is None:
            sens = 1.0
        sens = _check_number("BoostTrainOneStepCell", "sens", sens)
        super().__init__(network, optimizer, sens)
        self.boost = boost if boost is not None else getattr(optimizer, "_recboost_boost", None)
        if self.boost is not None and not isinstance(self.boost, AutoBoost):
            _fail("BoostTrainOneStepCell", "'boost'", "an AutoBoost", type(self.boost).__name__, TypeError)
        flags, settings = (self.boost.boost_config, self.boost.settings) if self.boost is not None \
            else _resolve_boost_config("O0", "")
        self.hyper_map = ops.HyperMap()
        self.freeze = isinstance(optimizer, FreezeOpt)
        self.weights = optimizer.parameters
        self.train_strategy = getattr(optimizer, "train_strategy", None)
        steps = settings["grad_accumulation"]["grad_accumulation_step"] if flags["grad_accumulation"] else 1
        self.max_accumulation_step = steps
        self.use_grad_accumulation = steps > 1 and self.parallel_mode in ("stand_alone", "data_parallel")
        self._acc_steps = float(steps)
        self.accumulation_step = Parameter(Tensor(0, mstype.int32), name="accumulation_step")
        if self.use_grad_accumulation:
            self.grad_accumulation = self.weights.clone(prefix="grad_accumulation", init="zeros")
        self._settings = settings
        self.enable_dim_reduce = self.check_dim_reduce_enable()
        if self.enable_dim_reduce:
            self._init_dim_reduce()
        self.step = Parameter(Tensor(0, mstype.int32), name="freeze_step")
        self.freeze_nets = None
        if self.freeze:
            mean = degree = None
            if self.reducer_flag:
                mean, degree = ms.get_auto_parallel_context("gradients_mean"), _boost_parallel()[2]
            self.freeze_nets = freeze_cell(self.reducer_flag, self.network, self.optimizer, sens, self.grad,
                                           self.use_grad_accumulation, mean, degree, max(steps, 1))
            self._freeze_cells = nn.CellList(list(self.freeze_nets), auto_prefix=False)
            self._freeze_len = len(self.freeze_nets) if self.train_strategy is None \
                else int(self.train_strategy.shape[0])
        self.enable_adasum = self.check_adasum_enable()
        if self.enable_adasum:
            self._init_adasum()

    def construct(self, *inputs):
        if self.freeze:
            return self.gradient_freeze_process(*inputs)
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.grad_reducer(grads)
        if self.use_grad_accumulation:
            return self.gradient_accumulation_process(loss, grads, sens, *inputs)
        return self._boost_apply(loss, grads, sens, *inputs)

    def _boost_apply(self, loss, grads, sens, *inputs):
        """Apply (already reduced, unscaled-by-sens for DimReduce) gradients with the enabled algorithm."""
        if self.enable_dim_reduce:
            return ops.depend(loss, self.dim_reduce(loss, grads, sens, self.weights, self.weights_clone, *inputs))
        if self.enable_adasum:
            return self.adasum_process(loss, grads)
        return ops.depend(loss, self.optimizer(grads))

    def gradient_freeze_process(self, *inputs):
        """Run the train cell of this step's freeze index; returns the loss."""
        if self.train_strategy is None:
            index = self.step
        else:
            index = self.train_strategy[self.step]
        loss = self.freeze_nets[index](*inputs)
        nxt = ops.depend(self.step + 1, loss)
        return ops.depend(loss, ops.assign(self.step, nxt % self._freeze_len))

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
        groups = _boost_parallel()[2] // self._settings["common"]["device_number"]
        return bool(groups > 1 and groups & (groups - 1) == 0)

    def check_dim_reduce_enable(self):
        """DimReduce runs when the optimizer was made for it (``optimizer.dim_reduce``)."""
        return bool(getattr(self.optimizer, "dim_reduce", False))

    def _init_dim_reduce(self):
        cfg = self._settings["dim_reduce"]
        _, rank, rank_size = _boost_parallel()
        path = getattr(self.optimizer, "_recboost_pca_path", None) or cfg["pca_mat_path"]
        if path is None:
            raise ValueError("For 'BoostTrainOneStepCell', DimReduce needs a PCA matrix: set "
                             "'dim_reduce.pca_mat_path' or process the network with AutoBoost first.")
        pca = load_pca_rows(path, rank, rank_size, cfg["n_components"], cfg["timeout"])
        self.weights_clone = self.weights.clone(prefix="weights_clone", init="same")
        self.dim_reduce = DimReduce(self.network, self.optimizer, self.weights, pca, cfg["n_components"],
                                    cfg["rho"], cfg["gamma"], cfg["alpha"], cfg["sigma"], rank, rank_size)

    def _init_adasum(self):
        _, rank, rank_size = _boost_parallel()
        device_number = self._settings["common"]["device_number"]
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


# =====================================================================================================
# AutoBoost
# =====================================================================================================
class AutoBoost:
    """Boost configuration for one model: level presets, modes and settings (not a singleton).

    Args:
        level (str): "O0" (nothing), "O1" (less_bn + grad_freeze) or "O2" (+ adasum), MindSpore's presets.
        boost_config_dict (dict or str): the config (see the seed / README), or the path of a JSON file
            holding it. Unset keys take the seed's defaults; an unknown level, mode, section or key is a
            ValueError naming it.

    Attributes: ``level``; ``boost_config`` (algorithm -> enabled, after the mode and the precedence
    rules: dim_reduce on disables the others, else grad_freeze on disables the others); ``settings``
    (section -> key -> value, complete). Each instance owns copies; two instances never interact.
    """

    def __init__(self, level="O0", boost_config_dict=""):
        self.boost_config, self.settings = _resolve_boost_config(level, boost_config_dict)
        self.level = level
        self.boost_config_dict = boost_config_dict
        self._param_processer = ParameterProcess()

    def __repr__(self):
        on = [k for k, v in self.boost_config.items() if v]
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
        flags, settings = self.boost_config, self.settings
        if flags["dim_reduce"]:
            pca_path = _prepare_pca_mat(settings, network)
            optimizer = nn.SGD(network.trainable_params(), learning_rate=1.0)
            optimizer.dim_reduce = True
            optimizer._recboost_pca_path = pca_path  # pylint: disable=protected-access
        if flags["less_bn"]:
            network = LessBN(network, fn_flag=settings["less_bn"]["fn_flag"])
            process = OptimizerProcess(optimizer)
            groups = self._param_processer.assign_parameter_group(network.trainable_params(),
                                                                  settings["common"]["gradient_split_groups"])
            process.origin_params = ParameterProcess.generate_group_params(groups, process.origin_params)
            if settings["less_bn"]["gc_flag"]:
                process.add_grad_centralization(network)
            optimizer = process.generate_new_optimizer()
        if flags["grad_freeze"]:
            cfg = settings["grad_freeze"]
            network, optimizer = GradientFreeze(cfg["param_groups"], cfg["freeze_type"], cfg["freeze_p"],
                                                cfg["total_steps"], cfg["seed"]).freeze_generate(network, optimizer)
        if flags["adasum"]:
            optimizer.adasum = True
        optimizer._recboost_boost = self  # pylint: disable=protected-access
        return network, optimizer

    def network_auto_process_eval(self, network):
        """The evaluation network (LessBN-wrapped when less_bn is on)."""
        if self.boost_config["less_bn"] and not self.boost_config["dim_reduce"]:
            return LessBN(network, fn_flag=False)
        return network


def _boost_train_cell(network, optimizer, level="O0", config="", loss_scale_update_cell=None):
    """Process ``(network with loss, optimizer)`` with ``AutoBoost(level, config)`` and build its train cell.

    Returns a ``BoostTrainOneStepCell`` (loss), or a ``BoostTrainOneStepWithLossScaleCell`` (loss,
    overflow, scale) when ``loss_scale_update_cell`` (a Cell or a scale Tensor) is given.
    """
    boost = config if isinstance(config, AutoBoost) else AutoBoost(level, config)
    network, optimizer = boost.network_auto_process_train(network, optimizer)
    if loss_scale_update_cell is None:
        return BoostTrainOneStepCell(network, optimizer, boost=boost)
    return BoostTrainOneStepWithLossScaleCell(network, optimizer, loss_scale_update_cell, boost=boost)


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
    # AutoBoost and the boost algorithms
    "AutoBoost",
    "BoostTrainOneStepCell",
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
