"""Fault injection for recboost, as SQLite's test harness fails malloc and I/O: :class:`Faults` makes
the Nth call of a chosen set of injection points fail and counts how often each point is hit.

Points (each patched at recboost's module level, never process-wide):

- ``alloc``: each allocation of table memory (``recboost._host_array``, which the growth path
  ``_host_grown`` and the row store call): ``OSError(ENOMEM)``;
- ``write``: each ``write`` to a file recboost opened with ``os.fdopen`` (``_atomic_write``'s
  temporary file), each ``os.replace`` / ``os.rename`` / ``os.fsync`` / ``os.fdatasync`` recboost calls:
  ``OSError(ENOSPC)`` for writes, ``OSError(EIO)`` for the others;
- ``assign``: each ``ops.assign`` recboost calls from Python (a load's dense parameters):
  ``RuntimeError`` as MindSpore's Assign raises out of memory;
- ``user``: each call into user code wrapped with :meth:`Faults.user` (schedules, callbacks, data
  iterators): ``RuntimeError`` from the user's code.

Usage::

    with Faults(("alloc", "write"), fail_at=3) as faults:
        ...                 # the 3rd hit among those points raises
    faults.hits             # {"alloc": n, "write": m}
    Faults(("write",), fail_at=5, persist=True)    # the 5th hit and every one after it: a disk that stays full
"""
import errno
import types

import numpy as np

import recboost

INJECTED = "(injected)"


class _FileProxy:
    """A file object whose ``write`` is an injection point."""

    def __init__(self, fh, faults):
        self._fh, self._faults = fh, faults

    def write(self, data):
        self._faults.hit("write", lambda: OSError(errno.ENOSPC, "No space left on device " + INJECTED))
        return self._fh.write(data)

    def __enter__(self):
        self._fh.__enter__()
        return self

    def __exit__(self, *exc):
        return self._fh.__exit__(*exc)

    def __iter__(self):
        return iter(self._fh)

    def __getattr__(self, name):
        return getattr(self._fh, name)


class Faults:
    """Count every hit of the injection points ``points`` (a subset of ``alloc``, ``write``,
    ``assign``, ``user``) while active; the ``fail_at``-th hit overall (1-based; None: none) raises,
    and with ``persist`` every hit after it too (``failures`` counts them)."""

    POINTS = ("alloc", "write", "assign", "user")

    def __init__(self, points, fail_at=None, persist=False):
        unknown = set(points) - set(self.POINTS)
        assert not unknown, unknown
        self.points, self.fail_at, self.persist = tuple(points), fail_at, persist
        self.failures = 0
        self.hits = dict.fromkeys(self.points, 0)
        self.total = 0
        self.failed = None                  # the point that failed, once it has
        self._saved = []

    def hit(self, point, error):
        """One call of ``point``: counted; raises ``error()`` when it is the one to fail."""
        if point not in self.hits or not self._saved:
            return
        self.hits[point] += 1
        self.total += 1
        if self.total == self.fail_at or self.persist and self.fail_at is not None and self.total > self.fail_at:
            self.failed = self.failed or point
            self.failures += 1
            raise error()

    def user(self, fn):
        """``fn`` as an injection point of user code."""
        def call(*args, **kwargs):
            self.hit("user", lambda: RuntimeError("user code failed " + INJECTED))
            return fn(*args, **kwargs)
        return call

    def _patch(self, name, value):
        """Bind recboost's module-level ``name`` to ``value`` while active; returns what it was."""
        self._saved.append((name, getattr(recboost, name)))
        setattr(recboost, name, value)
        return self._saved[-1][1]

    def __enter__(self):
        self._saved.append(("", None))      # (active)
        if "alloc" in self.points:
            def host_array(*args, **kwargs):
                self.hit("alloc", lambda: OSError(errno.ENOMEM, "Cannot allocate memory " + INJECTED))
                return real[0](*args, **kwargs)
            real = [self._patch("_host_array", host_array)]
        if "write" in self.points:
            real_os = recboost.os
            proxy = types.ModuleType("os")
            proxy.__dict__.update(real_os.__dict__)

            def failing(name, code):
                def call(*args, **kwargs):
                    self.hit("write", lambda: OSError(code, "%s failed %s" % (name, INJECTED)))
                    return getattr(real_os, name)(*args, **kwargs)
                return call
            for name in ("replace", "rename", "fsync", "fdatasync"):
                if hasattr(real_os, name):
                    setattr(proxy, name, failing(name, errno.EIO))
            proxy.fdopen = lambda *args, **kwargs: _FileProxy(real_os.fdopen(*args, **kwargs), self)
            self._patch("os", proxy)
        if "assign" in self.points:
            real_ops = recboost.ops

            class _Ops:
                def __getattr__(_, name):
                    return getattr(real_ops, name)

                def assign(_, *args, **kwargs):
                    self.hit("assign", lambda: RuntimeError("Allocate output memory failed " + INJECTED))
                    return real_ops.assign(*args, **kwargs)
            self._patch("ops", _Ops())
        return self

    def __exit__(self, *exc):
        while self._saved:
            name, value = self._saved.pop()
            if name:
                setattr(recboost, name, value)
        return False


def files(directory):
    """``{name: bytes}`` of every file in ``directory`` (recursively, relative names)."""
    import os
    out = {}
    for root, _, names in os.walk(str(directory)):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, str(directory))] = fh.read()
    return out


def snapshot(model, directory=None):
    """The state of ``model`` as plain copies: every parameter of its network (and its optimizer's),
    every hash table's state_dict arrays, the step; with ``directory``, its files."""
    state = {"step": model.step}
    for name, param in model.network.parameters_and_names():
        state["param:" + name] = param.asnumpy().copy()
    optimizer = getattr(model, "optimizer", None) or getattr(model, "_optimizer", None)
    if optimizer is not None:
        for param in optimizer.parameters_and_names() if hasattr(optimizer, "parameters_and_names") else ():
            state["opt:" + param[0]] = param[1].asnumpy().copy()
    for k, table in enumerate(model.tables):
        for key, value in table_snapshot(table).items():
            state["table%d:%s" % (k, key)] = value
    if directory is not None:
        state["files"] = files(directory)
    return state


def table_snapshot(table):
    """A hash table's ``state_dict`` as one flat dict of plain copies (keys joined by "."), for
    :func:`differences`."""
    return {key: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
            for key, value in _flat(table.state_dict())}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key in sorted(tree):
            yield from _flat(tree[key], "%s%s." % (prefix, key))
    else:
        yield prefix.rstrip("."), tree


def differences(before, after):
    """The keys whose values differ between two :func:`snapshot` results (array by array)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                    and a.dtype == b.dtype and a.tobytes() == b.tobytes())
        else:
            same = a == b
        if not same:
            out.append(key)
    return out
