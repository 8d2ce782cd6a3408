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
# The update cells and managers keep MindSpore's names, arguments and semantics (mindspore.nn /
# mindspore.amp), with their arguments checked. Overflow detection lives in the train-step cells and
# is device-agnostic: a finite check on the gradients, so it works on CPU as on Ascend/GPU.


class DynamicLossScaleUpdateCell(nn.Cell):
    """Dynamic loss scale update cell (``mindspore.nn.DynamicLossScaleUpdateCell`` semantics).

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
        super().__init__()
        where = "DynamicLossScaleUpdateCell"
        self.loss_scale_value = _check_number(where, "loss_scale_value", loss_scale_value, minimum=1)
        _check_number(where, "scale_factor", scale_factor, minimum=1, strict_min=True)
        _check_int(where, "scale_window", scale_window, minimum=1)
        self.scale_window = Tensor(scale_window, mstype.int32)
        self.scale_factor = Tensor(scale_factor, mstype.float32)
        self.minimum_loss_scale = Tensor(1.0, mstype.float32)
        # Step counters live in Parameters so they travel with checkpoints.
        self.cur_iter = Parameter(Tensor(1, mstype.int32), name="current_iterator_step")
        self.last_overflow_iter = Parameter(Tensor(0, mstype.int32), name="last_overflow_iterator_step")

    def get_loss_scale(self):
        """The initial loss scale value."""
        return self.loss_scale_value

    def construct(self, loss_scale, overflow):
        shrunk = ops.maximum(loss_scale / self.scale_factor, self.minimum_loss_scale)
        scale = ops.select(overflow, shrunk, loss_scale)
        should_grow = self.scale_window <= self.cur_iter - self.last_overflow_iter
        restart = ops.logical_or(overflow, should_grow)
        last = ops.assign(self.last_overflow_iter,
                          ops.select(restart, self.cur_iter, self.last_overflow_iter))
        grow = ops.logical_and(should_grow, ops.logical_not(overflow))
        ops.assign(loss_scale, ops.select(grow, scale * self.scale_factor, scale))
        ops.assign(self.cur_iter, ops.depend(self.cur_iter + 1, last))
        return overflow


class FixedLossScaleUpdateCell(nn.Cell):
    """Fixed loss scale update cell (``mindspore.nn.FixedLossScaleUpdateCell`` semantics): the scale
    never changes, and a train-step cell given it skips the optimizer on overflow steps.

    Args:
        loss_scale_value (float): the loss scale, >= 1.
    """

    def __init__(self, loss_scale_value):
        super().__init__()
        self.loss_scale_value = _check_number("FixedLossScaleUpdateCell", "loss_scale_value",
                                              loss_scale_value, minimum=1)

    def get_loss_scale(self):
        """The loss scale value."""
        return self.loss_scale_value

    def construct(self, _, overflow):
        return overflow


class FixedLossScaleManager(ms.amp.LossScaleManager):
    """Fixed loss scale manager (``mindspore.amp.FixedLossScaleManager`` semantics).

    Args:
        loss_scale (float): the scale, >= 1. Default 128.0.
        drop_overflow_update (bool): skip the optimizer on overflow steps. Default True. When False
            there is no update cell (``get_update_cell()`` is None), the loss is scaled by
            ``loss_scale`` and the optimizer must divide by it itself (its ``loss_scale`` argument).
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        where = "FixedLossScaleManager"
        self._loss_scale = _check_number(where, "loss_scale", loss_scale, minimum=1)
        self._drop_overflow_update = _check_bool(where, "drop_overflow_update", drop_overflow_update)

    def get_loss_scale(self):
        """The loss scale."""
        return self._loss_scale

    def get_drop_overflow_update(self):
        """Whether overflow steps skip the optimizer."""
        return self._drop_overflow_update

    def update_loss_scale(self, overflow):
        """Does nothing: the scale is fixed."""

    def get_update_cell(self):
        """A :class:`FixedLossScaleUpdateCell` when ``drop_overflow_update`` is True, else None."""
        return FixedLossScaleUpdateCell(self._loss_scale) if self._drop_overflow_update else None


class DynamicLossScaleManager(ms.amp.LossScaleManager):
    """Dynamic loss scale manager (``mindspore.amp.DynamicLossScaleManager`` semantics).

    Args:
        init_loss_scale (float): initial scale, >= 1. Default 2**24.
        scale_factor (int): growth/shrink factor, > 1. Default 2.
        scale_window (int): good steps before growth, >= 1. Default 2000.

    ``update_loss_scale(overflow)`` applies the same rule on the host as
    :class:`DynamicLossScaleUpdateCell` does on the device; ``get_update_cell()`` returns a new
    device cell starting from ``init_loss_scale``. Overflow steps are always dropped.
    """

    def __init__(self, init_loss_scale=2 ** 24, scale_factor=2, scale_window=2000):
        where = "DynamicLossScaleManager"
        self.loss_scale = _check_number(where, "init_loss_scale", init_loss_scale, minimum=1)
        self.init_loss_scale = self.loss_scale
        self.scale_factor = _check_number(where, "scale_factor", scale_factor, minimum=1, strict_min=True)
        self.scale_window = _check_int(where, "scale_window", scale_window, minimum=1)
        self.cur_iter = 1
        self.last_overflow_iter = 0

    def get_loss_scale(self):
        """The current (host-side) loss scale."""
        return self.loss_scale

    def get_drop_overflow_update(self):
        """Always True: overflow steps skip the optimizer."""
        return True

    def update_loss_scale(self, overflow):
        """Update the host-side scale for one step with overflow flag ``overflow``."""
        if overflow:
            self.loss_scale = max(self.loss_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
        elif self.cur_iter - self.last_overflow_iter >= self.scale_window:
            self.loss_scale *= self.scale_factor
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1

    def get_update_cell(self):
        """A :class:`DynamicLossScaleUpdateCell` with this manager's settings."""
        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)


# =====================================================================================================
# Mixed precision
# =====================================================================================================
#: MindSpore's mixed precision levels; each maps to (cast_model_type, keep_batchnorm_fp32, dynamic
#: loss scaling). "auto" keeps float32 on CPU (MindSpore picks O2 on GPU and O3 on Ascend).
_AMP_LEVELS = {
    "O0": (mstype.float32, False, False),
    "O1": (mstype.float32, False, False),
    "O2": (mstype.float16, True, True),
    "O3": (mstype.float16, False, False),
    "auto": (mstype.float32, False, False),
}
_AMP_KWARGS = ("cast_model_type", "keep_batchnorm_fp32", "loss_scale_manager")


def _amp_config(level, where="build_train_network", **kwargs):
    """Resolve an amp level plus keyword overrides into a config dict (a fresh copy every call)."""
    if not isinstance(level, str):
        _fail(where, "'level'", "a str in %s" % list(_AMP_LEVELS), level, TypeError)
    _check_one_of(where, "level", level, _AMP_LEVELS)
    _check_no_kwargs(where, kwargs, _AMP_KWARGS)
    if level == "auto":
        target = ms.get_context("device_target")
        level = {"GPU": "O2", "Ascend": "O3"}.get(target, "O0")
    cast, keep_bn, dynamic = _AMP_LEVELS[level]
    config = {"level": level, "cast_model_type": cast, "keep_batchnorm_fp32": keep_bn,
              "loss_scale_manager": DynamicLossScaleManager() if dynamic else None}
    if "cast_model_type" in kwargs:
        _check_one_of(where, "cast_model_type", kwargs["cast_model_type"], (mstype.float16, mstype.float32))
    if "keep_batchnorm_fp32" in kwargs:
        _check_bool(where, "keep_batchnorm_fp32", kwargs["keep_batchnorm_fp32"])
    manager = kwargs.get("loss_scale_manager")
    if manager is not None and not isinstance(manager, ms.amp.LossScaleManager) \
            and not hasattr(manager, "get_update_cell"):
        _fail(where, "'loss_scale_manager'", "a LossScaleManager or None", manager, TypeError)
    config.update(kwargs)
    return config


def _cast_network(network, config):
    """Cast ``network`` in place for the config: float16 cells, BatchNorm kept float32 if asked."""
    if config["cast_model_type"] == mstype.float16:
        network.to_float(mstype.float16)
        if config["keep_batchnorm_fp32"]:
            for _, cell in network.cells_and_names():
                if isinstance(cell, nn.layer.normalization._BatchNorm):
                    cell.to_float(mstype.float32)
    return network


class _AmpWithLossCell(nn.Cell):
    """Network + loss where the network output and label are cast to float32 before the loss."""

    def __init__(self, backbone, loss_fn):
        super().__init__(auto_prefix=False)
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, *inputs):
        out = self._backbone(*inputs[:-1])
        return self._loss_fn(ops.cast(out, mstype.float32), ops.cast(inputs[-1], mstype.float32))

    @property
    def backbone_network(self):
        """The wrapped network."""
        return self._backbone


def build_train_network(network, optimizer, loss_fn=None, level="O0", boost_level="O0", **kwargs):
    """Build a mixed precision train-step cell (``mindspore.amp.build_train_network`` semantics)
    that also works on CPU with dynamic loss scaling.

    Args:
        network (Cell): the network (with the loss inside when ``loss_fn`` is None).
        optimizer (Cell): the optimizer.
        loss_fn (Cell): the loss; the network output and label are cast to float32 before it.
        level (str): "O0" (float32), "O1" (float32 here), "O2" (float16, BatchNorm float32, dynamic
            loss scaling), "O3" (float16, no loss scaling) or "auto" (O2 on GPU, O3 on Ascend, O0
            elsewhere).
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
    config = _amp_config(level, where, **kwargs)
    network = _cast_network(network, config)
    if loss_fn is not None:
        network = _AmpWithLossCell(network, loss_fn) \
            if config["cast_model_type"] == mstype.float16 else nn.WithLossCell(network, loss_fn)
    manager = config["loss_scale_manager"]
    update_cell = manager.get_update_cell() if manager is not None else None
    sens = manager.get_loss_scale() if manager is not None else 1.0
    boost_cell = globals().get("_boost_train_cell")
    if boost_level != "O0" and boost_cell is not None:
        return boost_cell(network, optimizer, boost_level, boost_config, update_cell, sens).set_train()
    if update_cell is not None:
        return TrainOneStepWithLossScaleCell(network, optimizer, scale_sense=update_cell).set_train()
    return nn.TrainOneStepCell(network, optimizer, sens=float(sens)).set_train()


# =====================================================================================================
# Train-step cells
# =====================================================================================================
_grad_unscale = ops.MultitypeFuncGraph("_grad_unscale")


@_grad_unscale.register("Tensor", "Tensor")
def _grad_unscale_tensor(inv_scale, grad):
    return grad * ops.cast(inv_scale, ops.dtype(grad))


_grad_nonfinite = ops.MultitypeFuncGraph("_grad_nonfinite")


@_grad_nonfinite.register("Tensor")
def _grad_nonfinite_tensor(grad):
    # 1.0 when the gradient holds an Inf or NaN, else 0.0
    return ops.cast(ops.logical_not(ops.isfinite(grad).all()), mstype.float32)


class TrainOneStepWithLossScaleCell(nn.TrainOneStepCell):
    """One training step with loss scaling that works on every device, CPU included.

    Same name, arguments and outputs as ``mindspore.nn.TrainOneStepWithLossScaleCell``, whose
    overflow check calls an Ascend-only op; here the check is a finite test of the unscaled
    gradients (summed over devices in data-parallel mode), so the result is the same everywhere.

    Args:
        network (Cell): the network with its loss (single output).
        optimizer (Cell): the optimizer.
        scale_sense (Union[Cell, Tensor]): an update cell (:class:`DynamicLossScaleUpdateCell`,
            :class:`FixedLossScaleUpdateCell`, or MindSpore's) that updates the scale on the device, or
            a Tensor of shape () or (1,) holding a scale the host sets with :meth:`set_sense_scale`.

    Outputs:
        (loss, overflow, scale): the loss of this step, a bool scalar that is True when a gradient was
        not finite, and the loss scale after this step's update (the one the next step uses; in
        GRAPH mode MindSpore's cell returns the same). On an overflow step the optimizer does not
        run: every parameter and optimizer state is left untouched.
    """

    def __init__(self, network, optimizer, scale_sense):
        super().__init__(network, optimizer, sens=None)
        where = "TrainOneStepWithLossScaleCell"
        self.hyper_map = ops.HyperMap()
        self.loss_scaling_manager = None
        if isinstance(scale_sense, nn.Cell):
            if not hasattr(scale_sense, "get_loss_scale"):
                _fail(where, "'scale_sense'", "a loss scale update cell with get_loss_scale()",
                      type(scale_sense).__name__, TypeError)
            self.loss_scaling_manager = scale_sense
            self.scale_sense = Parameter(Tensor(scale_sense.get_loss_scale(), mstype.float32),
                                         name="scale_sense")
        elif isinstance(scale_sense, Tensor):
            if scale_sense.shape not in ((), (1,)):
                _fail(where, "the shape of 'scale_sense'", "(1,) or ()", scale_sense.shape)
            self.scale_sense = Parameter(scale_sense, name="scale_sense")
        else:
            _fail(where, "'scale_sense'", "a Cell or a Tensor", type(scale_sense).__name__, TypeError)
        self.is_distributed = self.parallel_mode not in (ms.ParallelMode.STAND_ALONE,)
        self.allreduce = ops.AllReduce() if self.is_distributed else None

    def construct(self, *inputs):
        loss = self.network(*inputs)
        scale = self.scale_sense
        sens = ops.ones_like(loss) * ops.cast(scale, ops.dtype(loss))
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.hyper_map(ops.partial(_grad_unscale, ops.reciprocal(scale)), grads)
        grads = self.grad_reducer(grads)
        overflow = self.process_loss_scale(self.get_overflow_status(grads))
        if not overflow:
            loss = ops.depend(loss, self.optimizer(grads))
        return loss, overflow, ops.depend(self.scale_sense, overflow) * 1.0

    def get_overflow_status(self, grads):
        """True when any gradient (on any device) holds an Inf or NaN."""
        flags = ops.addn(self.hyper_map(_grad_nonfinite, grads))
        if self.is_distributed:
            flags = self.allreduce(flags)
        return flags > 0

    def process_loss_scale(self, overflow):
        """Let the update cell (if any) update the scale; returns ``overflow``."""
        if self.loss_scaling_manager is not None:
            return self.loss_scaling_manager(self.scale_sense, overflow)
        return overflow

    def set_sense_scale(self, sens):
        """Set the loss scale (a Tensor of the same shape and type as the current one)."""
        if not isinstance(sens, Tensor):
            _fail("TrainOneStepWithLossScaleCell", "'sens'", "a Tensor", type(sens).__name__, TypeError)
        self.scale_sense.set_data(sens)


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
        layers, width = [], num_dense + num_fields * dim
        for size in hidden:
            layers += [nn.Dense(width, _check_int(where, "hidden", size, minimum=1)), nn.ReLU()]
            width = size
        layers.append(nn.Dense(width, 1))
        self.mlp = nn.SequentialCell(layers)
        self.wide_dense = nn.Dense(num_dense, 1) if num_dense else None

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


# =====================================================================================================
# Command line: python -m recboost ...
# =====================================================================================================

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
    # RecModel
    "WideDeep",
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
