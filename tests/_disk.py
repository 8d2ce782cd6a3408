"""A failing disk for tests, without filling one: :class:`FailingDisk` makes every file recboost writes
through ``_atomic_write`` (checkpoints, their parts, checked JSON files) fail with an errno after a
few bytes, as a full disk (ENOSPC), a dying one (EIO) or a folder turned read-only (EACCES) would."""
import errno
import os

import recboost as rb


class _FailingFile:
    """The open temporary file ``fh`` of ``_atomic_write``: takes ``room`` bytes, then every write raises
    ``OSError(error)``."""

    def __init__(self, fh, room, error):
        self._fh, self._room, self._error = fh, room, error

    def write(self, data):
        data = memoryview(data).cast("B")
        if data.nbytes > self._room:
            self._fh.write(data[:self._room])
            self._room = 0
            raise OSError(self._error, os.strerror(self._error))
        self._room -= data.nbytes
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)


class FailingDisk:
    """While :attr:`error` is set (an errno such as ``errno.ENOSPC``), every ``_atomic_write`` writes
    ``room`` bytes of its file and then fails with that errno; None: the disk works."""

    def __init__(self, monkeypatch, room=17, error=None):
        self.error, self.room, self.real = error, room, rb._atomic_write
        monkeypatch.setattr(rb, "_atomic_write", self)

    @property
    def full(self):
        return self.error == errno.ENOSPC

    @full.setter
    def full(self, value):
        self.error = errno.ENOSPC if value else None

    def __call__(self, path, write, size=None, recycle=None):
        if self.error is None:
            return self.real(path, write, size=size, recycle=recycle)
        error, room = self.error, self.room
        return self.real(path, lambda fh: write(_FailingFile(fh, room, error)), size=size, recycle=recycle)


def swap_on_first_open(monkeypatch, replacements):
    """Each file of ``replacements`` (path -> the path of other bytes) replaced on disk the moment it is
    first opened: the opener reads the old file through its handle; whoever opens the path again gets
    the other bytes, as if someone changed the file between a check and its use. Returns the paths
    opened so far (a set)."""
    import builtins
    real, opened = builtins.open, set()

    def spy(file, *args, **kwargs):
        handle = real(file, *args, **kwargs)
        path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else None
        if path in replacements and path not in opened:
            opened.add(path)
            os.replace(replacements[path], path)
        return handle
    monkeypatch.setattr(builtins, "open", spy)
    return opened
