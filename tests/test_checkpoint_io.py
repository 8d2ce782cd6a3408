"""The checkpoint file's I/O (issue 38 item 1: save, load and export at the disk's rate): a checkpoint is
written from the arrays' own memory and read straight into the new arrays (no bytes copies of the
data), its sha256 computed on a thread beside the write or the read (``_Sha256Beside``), and the files
stay byte for byte what numpy's ``.npy`` writer gives, so every file written before still reads and
``np.load`` still opens the new ones."""
import ctypes
import hashlib
import io
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

import recboost as rb

BIG = 6 << 20            # float32 values of the large array: 24 MB, above numpy's 16 MB write chunk


def _arrays():
    rng = np.random.default_rng(7)
    big = rng.standard_normal(BIG).astype(np.float32).reshape(-1, 64)
    return {"big": big,
            "fortran": np.asfortranarray(rng.standard_normal((300, 7))),
            "strided": np.arange(40000, dtype=np.int64).reshape(200, 200)[:, ::3],
            "scalar": np.array(3.5, np.float64), "empty": np.zeros((0, 5), np.int32),
            "flags": rng.random(1000) < 0.5, "names": np.array(["a", "bcd", ""]),
            "odd": rng.integers(0, 255, (1 << 18) + 3, dtype=np.uint8)}


def _write(path, arrays):
    """A checkpoint file (format 4) of ``arrays`` at ``path``, as RecModel.save_checkpoint writes its arrays."""
    with open(str(path), "wb") as fh:
        rb._write_checkpoint_file(fh, {"format": 4}, arrays)


def _atomic(path, write, recycle=None):
    """``rb._atomic_write`` of ``write`` to ``path`` (taking the cached pages of the file ``recycle``)."""
    rb._atomic_write(str(path), write, recycle=None if recycle is None else str(recycle))


def _read(path):
    """``(manifest, arrays)`` of the checkpoint file at ``path``, every byte verified (as a load reads it)."""
    return rb._read_checkpoint_file(str(path))


def _numpy_bytes(array):
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def test_members_are_numpys_npy_bytes_and_read_back_exactly(tmp_path):
    """Each member holds exactly the bytes ``np.lib.format.write_array`` gives (C order, a Fortran array's
    transpose, a strided view copied a chunk at a time, 0-d, empty, bool, str), its listed sha256 is
    theirs, np.load opens the file, and recboost's reader gives the arrays back bit for bit."""
    arrays, path = _arrays(), tmp_path / "c.npz"
    _write(path, arrays)
    with zipfile.ZipFile(str(path)) as zf:
        for name, value in arrays.items():
            assert zf.read(name + ".npy") == _numpy_bytes(value), name
    manifest, back = _read(path)
    for name, value in arrays.items():
        expected = _numpy_bytes(value)
        assert manifest["members"][name] == {"bytes": len(expected), "sha256": hashlib.sha256(expected).hexdigest()}
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert back[name].tobytes() == value.tobytes(), name
    with np.load(str(path)) as loaded:
        assert np.array_equal(loaded["big"], arrays["big"]) and np.array_equal(loaded["fortran"], arrays["fortran"])


def _peak(fn):
    """The peak of the memory Python and numpy allocate during ``fn()`` (tracemalloc), and its result."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def test_a_save_copies_no_data(tmp_path):
    """Writing a 24 MB array allocates under 1 MB: the bytes go from the array's memory to the zip
    member (before, numpy's writer copied the data to a bytes object 16 MB at a time)."""
    big = _arrays()["big"]
    peak, _ = _peak(lambda: _write(tmp_path / "c.npz", {"big": big}))
    assert peak < 1 << 20, "a save allocated %.1f MB for a %.0f MB array" % (peak / 2 ** 20, big.nbytes / 2 ** 20)


def test_a_load_reads_into_the_new_array_only(tmp_path):
    """Reading a 24 MB member allocates the array and under 1 MB more (before: zipfile's 4 MB bytes
    chunks, then copied into the array)."""
    big = _arrays()["big"]
    _write(tmp_path / "c.npz", {"big": big})
    peak, (_, back) = _peak(lambda: _read(tmp_path / "c.npz"))
    assert np.array_equal(back["big"], big)
    assert peak - big.nbytes < 1 << 20, "a load allocated %.1f MB beside the %.0f MB array" % (
        (peak - big.nbytes) / 2 ** 20, big.nbytes / 2 ** 20)


class _Recorder:
    """Stands in for the sha256 object: records each piece's bytes and the thread that hashed it."""

    def __init__(self):
        self.pieces, self.threads = [], []

    def update(self, view):
        self.pieces.append(bytes(view))
        self.threads.append(threading.current_thread().name)


def test_sha256_beside_hashes_large_pieces_on_its_thread_in_order():
    """Pieces of 64 KB and more are hashed on the helper thread, smaller ones in line, all in order:
    the digest is hashlib's of the whole; once closed, the thread has ended."""
    rng = np.random.default_rng(1)
    sizes = [10, 1 << 16, 3, (1 << 20) + 1, 0, 5000, 1 << 22]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    whole = hashlib.sha256(b"".join(p.tobytes() for p in pieces)).hexdigest()
    for record in (False, True):
        beside = rb._Sha256Beside()
        if record:
            beside.sha = _Recorder()
        for piece in pieces:
            beside.update(piece)
        beside.close()
        assert not [t for t in threading.enumerate() if t.name.startswith("recboost-sha256")]
        if not record:
            assert beside.hexdigest() == whole
    assert beside.sha.pieces == [p.tobytes() for p in pieces]
    main = threading.current_thread().name
    assert [name != main for name in beside.sha.threads] == [n >= 1 << 16 for n in sizes]


def _member_data(data, name):
    """The offset of the data of the member ``name`` in the zip ``data`` (bytes)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = zf.getinfo(name)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("where", ["data_start", "data_end"])
def test_a_flipped_byte_of_a_large_member_is_refused_by_its_sha256(tmp_path, where):
    """A flipped byte in a large member, at its first chunk or its last, is refused naming the file's
    member and the sha256 of its damaged bytes against the one its manifest lists (computed beside the
    reading of the other members; the zip's CRC-32, which zipfile would check, is not computed)."""
    _write(tmp_path / "c.npz", {"big": _arrays()["big"], "small": np.arange(5)})
    data = bytearray((tmp_path / "c.npz").read_bytes())
    start = _member_data(bytes(data), "big.npy")
    at = start + (200 if where == "data_start" else 128 + BIG * 4 - 1)
    data[at] ^= 0x10
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    damaged = hashlib.sha256(bytes(data[start:start + 128 + BIG * 4])).hexdigest()
    listed = _read(tmp_path / "c.npz")[0]["members"]["big"]["sha256"]
    with pytest.raises(ValueError, match=r"^cannot be read \(its member 'big' has sha256 %s, its manifest lists %s: "
                       r"the file is damaged\)$" % (damaged, listed)):
        _read(tmp_path / "bad.npz")
    assert not [t for t in threading.enumerate() if t.name.startswith("recboost-sha256")]


def test_a_local_header_naming_another_member_is_refused(tmp_path):
    """The local zip header of a member must name it (as zipfile checks): a renamed one is refused by name."""
    _write(tmp_path / "c.npz", {"big": _arrays()["big"], "bog": np.arange(3)})
    data = bytearray((tmp_path / "c.npz").read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        offset = zf.getinfo("big.npy").header_offset
    data[offset + 30:offset + 37] = b"bog.npy"
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^cannot be read \(its member 'big\.npy' is damaged \(its local zip "
                       r"header names 'bog\.npy'\)"):
        _read(tmp_path / "bad.npz")


def test_file_digest_is_hashlibs_over_chunks(tmp_path):
    """A bundle file's digest on read (two 4 MB buffers: one read while the other is hashed on the
    thread) is hashlib's sha256 of the file, over three chunks and a short last one."""
    data = np.random.default_rng(3).integers(0, 256, (9 << 20) + 12345, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert rb._file_digest(str(tmp_path / "f")) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.slow
def test_a_digest_taken_while_the_interpreter_exits_is_hashed_in_line(tmp_path):
    """From an atexit handler (a last save or load), no new thread may start (concurrent.futures
    refuses): the digests of ``_Sha256Beside`` and ``_DigestsBeside`` and a cache's entry lookups
    (``_entry_field_chunks``) are then done in line, the same, instead of failing the save or the load."""
    script = tmp_path / "late.py"
    script.write_text(
        "import atexit, hashlib, os\nimport recboost as rb\n\n"
        "cache = rb.HashCache(3000, access_threshold=1)\n"
        "cache.lookup(list(range(0, 6000, 3)))\ncache.lookup(list(range(0, 6000, 6)))\n\n"
        "def entries_file(path):\n"
        "    arrays = rb._cache_entries_chunked(cache, os.path.dirname(path))\n"
        "    rb._atomic_write(path, lambda fh: rb._write_checkpoint_file(fh, {'format': 4}, arrays))\n"
        "    return open(path, 'rb').read()\n\n"
        "before = entries_file(%r)\n\n"
        "def late():\n"
        "    print('same' if entries_file(%r) == before else 'differs')\n" % (str(tmp_path / "a.npz"), str(tmp_path / "b.npz"))
        + "    beside, data = rb._Sha256Beside(), bytes(range(256)) * 4096\n"
        "    beside.update(data)\n"
        "    print('same' if beside.hexdigest() == hashlib.sha256(data).hexdigest() else 'differs')\n"
        "    with rb._DigestsBeside() as digests:\n"
        "        digest = digests.submit([data, data]).result()\n"
        "    print('same' if digest == hashlib.sha256(data + data).hexdigest() else 'differs')\n\n"
        "atexit.register(late)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (0, ["same", "same", "same"]), proc.stderr[-2000:]


def _tracked_cache(seed=3):
    """A HashCache of ~24K entries (rows and candidates), ids spread over the whole int64 line."""
    rng = np.random.default_rng(seed)
    cache = rb.HashCache(40_000, access_threshold=1)
    ids = np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 20_000, dtype=np.int64), np.arange(4000) - 2000,
                          [-2 ** 63, 2 ** 63 - 1]])
    cache.lookup(ids)
    cache.lookup(ids[::2])
    return cache


def _write_entries(path, cache):
    """A checkpoint of ``cache``'s four entry arrays as a save writes them (``_cache_entries_chunked``,
    through ``_atomic_write``'s temporary file); returns the file's bytes."""
    arrays = rb._cache_entries_chunked(cache, str(path.parent))
    _atomic(path, lambda fh: rb._write_checkpoint_file(fh, {"format": 4}, arrays))
    return path.read_bytes()


@pytest.mark.fallback
def test_a_save_looks_each_entry_up_once_and_keeps_two_fields_on_disk_meanwhile(backend, tmp_path, monkeypatch):
    """The rows, counts and last-seen times of a cache's entries are written one member after the
    other, from one lookup of each id (not one a member): the two fields written later wait in unnamed
    temporary files in the checkpoint's folder, which leave nothing there. The bytes are the state's."""
    cache = _tracked_cache()
    state = cache.state_dict()
    looked_up = []
    original = type(cache).entries

    def counted(self, ids):
        looked_up.append(ids.size)
        return original(self, ids)
    monkeypatch.setattr(type(cache), "entries", counted)
    monkeypatch.setattr(rb, "_ENTRY_CHUNK", 1000)
    data = _write_entries(tmp_path / "c.npz", cache)
    assert sum(looked_up) == state["keys"].size and len(looked_up) > 10
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for name in ("keys", "rows", "counts", "last_seen"):
            assert zf.read(name + ".npy") == _numpy_bytes(state[name]), name
    assert os.listdir(str(tmp_path)) == ["c.npz"]


@pytest.mark.parametrize("damage", ["flipped", "short"])
def test_an_entry_field_read_back_damaged_from_its_temporary_file_stops_the_save(backend, tmp_path, monkeypatch,
                                                                                 damage):
    """The fields a save keeps in temporary files meanwhile are read back checked (CRC-32): a byte
    changed or a file cut short stops the save with a RuntimeError naming the folder, and no file is
    left."""
    cache = _tracked_cache()
    real = tempfile.TemporaryFile

    class Damaging:                     # the file, its reads damaged
        def __init__(self, *args, **kwargs):
            self.fh = real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def read(self, n=-1):
            data = bytearray(self.fh.read(n))
            if data and damage == "flipped":
                data[len(data) // 2] ^= 1
            return bytes(data[:-3] if data and damage == "short" else data)
    monkeypatch.setattr(tempfile, "TemporaryFile", Damaging)
    with pytest.raises(RuntimeError, match="in %s read back damaged" % re.escape(repr(str(tmp_path)))):
        _write_entries(tmp_path / "c.npz", cache)
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.fallback
@pytest.mark.parametrize("held, sample", [(5000, 1 << 16), (5000, 3), (1, 1 << 16)])
def test_a_caches_ids_written_a_range_at_a_time_give_the_same_file(backend, tmp_path, monkeypatch, held, sample):
    """A save writes a cache's ids sorted a range of about ``_KEYS_HELD`` at a time (a pass over the map
    each) and looks up the other fields from the ids read back from its file (64 at a time here): the
    bytes are those of the ids sorted whole (one range), whatever the ranges: 3 sampled ids give
    ranges the sample misjudged, taken again with room for them all; one id a range gives thousands.
    With a real sample, no range is taken twice and none asks for room far above its share."""
    cache = _tracked_cache()
    state = cache.state_dict()
    whole = _write_entries(tmp_path / "whole.npz", cache)
    with zipfile.ZipFile(io.BytesIO(whole)) as zf:
        for name in ("keys", "rows", "counts", "last_seen"):
            assert zf.read(name + ".npy") == _numpy_bytes(state[name]), name
    calls = []
    original = type(cache).keys_between

    def recorded(self, low, high, out):
        calls.append((low, high, out.size, original(self, low, high, out)))
        return calls[-1][-1]
    monkeypatch.setattr(rb, "_KEYS_HELD", held)
    monkeypatch.setattr(rb, "_KEYS_SAMPLE", sample)
    monkeypatch.setattr(rb, "_ENTRY_CHUNK", 64)
    monkeypatch.setattr(type(cache), "keys_between", recorded)
    assert _write_entries(tmp_path / "ranges.npz", cache) == whole
    size = state["keys"].size
    ranges = sorted({(low, high) for low, high, _, _ in calls})
    assert ranges[0][0] == -2 ** 63 and ranges[-1][1] == 2 ** 63 - 1
    assert all(a[0] <= a[1] and a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))   # they tile the line
    assert 1 < len(ranges) <= min(-(-size // held), sample + 1)
    assert sum(n for _, _, room, n in calls if n <= room) == size
    if sample == 3:
        assert any(n > room for _, _, room, n in calls)         # misjudged: asked again
    else:
        assert len(calls) == len(ranges) and all(n <= room for _, _, room, n in calls)
        assert max(room for _, _, room, _ in calls) <= 1.5 * size / len(ranges) + 64


@pytest.mark.parametrize("damage", ["swapped", "shifted", "short"])
def test_ids_read_back_damaged_stop_the_save_and_leave_no_file(backend, tmp_path, monkeypatch, damage):
    """The ids a save reads back from its own file to look up the other fields are checked: out of
    order, an id the cache does not track, or a short read stops the save with a RuntimeError, and
    neither the checkpoint nor its temporary file is left."""
    cache = _tracked_cache()
    real = os.pread

    def damaged(fd, n, offset):
        data = bytearray(real(fd, n, offset))
        ids = np.frombuffer(data, np.int64)
        if damage == "swapped":
            ids[[10, 11]] = ids[[11, 10]]
        elif damage == "shifted":        # still increasing, but not an id of the cache
            ids[10] = ids[10] + 1 if ids[11] > ids[10] + 1 else ids[10]
            assert not cache.entries(ids[10:11])[0][0]
        else:
            return bytes(data[:-8])
        return bytes(data)
    monkeypatch.setattr(os, "pread", damaged)
    with pytest.raises(RuntimeError, match="not increasing|not tracked|read back"):
        _write_entries(tmp_path / "c.npz", cache)
    assert os.listdir(str(tmp_path)) == []


def test_a_file_being_written_has_its_disk_writes_started_beside_and_is_fsynced(tmp_path, monkeypatch):
    """``_atomic_write`` starts the disk writes of its temporary file while ``write`` still fills it
    (``_WritebackBeside``: an ``os.fdatasync`` on a helper thread each ``_WRITEBACK_BYTES`` more), and
    still fsyncs it whole at the end: the file holds every byte written."""
    monkeypatch.setattr(rb, "_WRITEBACK_BYTES", 1 << 16)
    calls, real_sync, real_fsync = [], os.fdatasync, os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(
        ("fdatasync", threading.current_thread() is threading.main_thread(), os.fstat(fd).st_size)) or real_sync(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", None, os.fstat(fd).st_size)) or real_fsync(fd))
    piece = bytes(range(256)) * 1024                # 256 KB

    def write(fh):
        for _ in range(5):
            fh.write(piece)
            fh.flush()
            time.sleep(0.1)                         # the helper reads the size every 20 ms
        calls.append(("written", None, None))

    _atomic(tmp_path / "f.bin", write)
    assert (tmp_path / "f.bin").read_bytes() == piece * 5
    early = calls[:calls.index(("written", None, None))]
    assert len(early) >= 2 and all(kind == "fdatasync" and not main for kind, main, _ in early), calls
    assert [size for _, _, size in early] == sorted(size for _, _, size in early)
    assert all(size < 5 * len(piece) for _, _, size in early[:-1])
    assert ("fsync", None, 5 * len(piece)) in calls[calls.index(("written", None, None)):]


@pytest.mark.parametrize("existing", [False, True])
def test_a_write_back_failing_beside_fails_the_write_and_keeps_the_old_file(tmp_path, monkeypatch, existing):
    """An ``os.fdatasync`` of the helper thread that fails (an I/O error) fails the write as an OSError of
    its errno naming the path (Linux reports a failed write-back to one fsync only), the old file stays
    whole, and no temporary file is left."""
    path = tmp_path / "ckpt.npz"
    if existing:
        path.write_bytes(b"the old checkpoint")
    monkeypatch.setattr(rb, "_WRITEBACK_BYTES", 1 << 16)

    def failing(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fdatasync", failing)

    def write(fh):
        fh.write(bytes(1 << 18))
        fh.flush()
        time.sleep(0.2)

    with pytest.raises(OSError) as info:
        _atomic(path, write)
    assert info.value.errno == 5 and str(path) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == (["ckpt.npz"] if existing else [])
    if existing:
        assert path.read_bytes() == b"the old checkpoint"


def test_the_file_a_write_replaces_is_let_go_on_another_thread(tmp_path, monkeypatch):
    """The file ``_atomic_write`` replaces, and a checkpoint ``_unlink_beside`` removes, are let go by
    closing the last descriptor on them on a helper thread (``_close_beside``): the kernel frees their
    cached pages there. The descriptor is the old file's, its name already gone."""
    let_go, real_close = [], rb._close_beside

    def recorded(fd):
        info = os.fstat(fd)
        let_go.append((info.st_ino, info.st_nlink))
        real_close(fd)
    monkeypatch.setattr(rb, "_close_beside", recorded)
    path, before = tmp_path / "f.bin", []
    for content in (b"old", b"new"):                # the first replaces nothing
        before.append(os.stat(path).st_ino if path.exists() else None)
        _atomic(path, lambda fh, content=content: fh.write(content))
    old = before[1]
    assert path.read_bytes() == b"new" and let_go == [(old, 0)]
    now = os.stat(path).st_ino
    rb._unlink_beside(str(path))
    assert not path.exists() and let_go == [(old, 0), (now, 0)]
    read_end, write_end = os.pipe()                 # and _close_beside closes what it is given
    os.close(write_end)
    real_close(read_end)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.fstat(read_end)
        except OSError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("_close_beside left its descriptor open")



HUGE = 2 << 20          # recboost's _HUGE_PAGE: arrays this large lie on a mapping of their own
POPULATE_WRITE = 23     # Linux's MADV_POPULATE_WRITE


def _resident_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _new_array(nbytes):
    """A new host array of ``nbytes`` bytes, as a table's (``_host_array``)."""
    return rb._host_array(nbytes, np.uint8)


def _faulting_in(array):
    return rb._FaultInBeside(array)


def _populate_or_skip():
    """libc's madvise, or a skip where the kernel refuses ``MADV_POPULATE_WRITE`` (not Linux, or Linux
    before 5.14: there ``_FaultInBeside`` does nothing, and the reader faults its pages in itself)."""
    madvise, probe = rb._libc_madvise(), _new_array(HUGE)
    if madvise is None or madvise(probe.ctypes.data, 4096, POPULATE_WRITE) != 0:
        pytest.skip("this system has no MADV_POPULATE_WRITE (Linux 5.14 on)")
    return madvise


def _recording(monkeypatch, madvise, calls, delay=0.0, chunk=HUGE):
    """``_libc_madvise`` replaced by ``madvise`` recording each call (thread name, address, length,
    advice), and ``_FaultInBeside``'s chunk set to ``chunk``."""
    def recorded(address, length, advice):
        calls.append((threading.current_thread().name, address, length, advice))
        time.sleep(delay)
        return madvise(address, length, advice)
    monkeypatch.setattr(rb, "_LIBC_MADVISE", [recorded])
    monkeypatch.setattr(rb, "_FAULT_IN_CHUNK", chunk)


def test_a_new_arrays_pages_are_faulted_in_beside_the_filling_and_its_bytes_kept(monkeypatch):
    """While a new host array is filled, ``_FaultInBeside`` faults its pages in on a helper thread, in
    address order from the start, ``_FAULT_IN_CHUNK`` at a time (the process's resident memory grows by
    the whole array while the caller writes one page), and leaves what the caller wrote as it is."""
    calls = []
    _recording(monkeypatch, _populate_or_skip(), calls, chunk=4 << 20)
    array = _new_array(64 << 20)
    before = _resident_bytes()
    with _faulting_in(array):
        array[:4096] = 7
        deadline = time.monotonic() + 30
        while len(calls) < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert _resident_bytes() - before >= 60 << 20
    start = array.ctypes.data
    assert calls == [("recboost-fault-in", start + k * (4 << 20), 4 << 20, POPULATE_WRITE) for k in range(16)]
    assert (array[:4096] == 7).all() and not np.count_nonzero(array[4096:])


def test_faulting_in_stops_when_the_filling_ends_or_fails_or_the_kernel_refuses(monkeypatch):
    """Leaving the context (here by an error, which passes through) stops the helper after its chunk and
    waits for it: no thread is left. A refused advice stops it at once; an array under 2 MB (not on a
    mapping of its own) starts none."""
    calls, refused = [], []
    _recording(monkeypatch, _populate_or_skip(), calls, delay=0.05)
    with pytest.raises(ValueError, match="the read failed"):
        with _faulting_in(_new_array(64 << 20)):
            time.sleep(0.2)
            raise ValueError("the read failed")
    assert "recboost-fault-in" not in [t.name for t in threading.enumerate()]
    assert 1 <= len(calls) < 32
    _recording(monkeypatch, lambda address, length, advice: refused.append(length) or -1, [])
    with _faulting_in(_new_array(64 << 20)):
        time.sleep(0.2)
    with _faulting_in(_new_array(HUGE - 64)):
        pass
    assert refused == [HUGE]


@pytest.mark.parametrize("refused", [False, True])
def test_a_checkpoint_member_is_read_with_its_pages_faulted_in_beside(tmp_path, monkeypatch, refused):
    """A large member is read into an array whose pages the helper faults in (its calls cover that
    array's memory), and the arrays read back are the same bytes whether the kernel takes the advice
    or refuses it."""
    madvise, calls = _populate_or_skip(), []
    _recording(monkeypatch, (lambda *args: -1) if refused else madvise, calls, delay=0.01)
    arrays = _arrays()
    _write(tmp_path / "c.npz", arrays)
    _, back = _read(tmp_path / "c.npz")
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes(), name
    big = back["big"].ctypes.data
    assert calls and calls[0][1] == big and all(address - big < back["big"].nbytes for _, address, _, _ in calls)
    assert len(calls) == 1 if refused else calls == [("recboost-fault-in", big + k * HUGE, HUGE, POPULATE_WRITE)
                                                      for k in range(len(calls))]


def _cached_share(path):
    """The share of the file ``path``'s pages that are in the page cache (``mincore`` over a mapping
    of it, made and removed here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    pages = ctypes.create_string_buffer(-(-size // page))
    fd = os.open(str(path), os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)        # PROT_READ, MAP_SHARED
        assert address not in (None, ctypes.c_void_p(-1).value)
        try:
            assert libc.mincore(address, size, pages) == 0, ctypes.get_errno()
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in pages.raw) / len(pages.raw)


def _on_disk(path, data):
    """``data`` written to ``path`` and fsynced: on disk, its pages cached and clean."""
    with open(str(path), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _dropping_or_skip(tmp_path):
    """Skip unless this system caches a written file's pages and drops them on ``POSIX_FADV_DONTNEED``
    (Linux on a disk's file system; not tmpfs, whose pages are the file)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("page cache advice and mincore are Linux's here")
    probe = tmp_path / "probe"
    _on_disk(probe, bytes(1 << 20))
    cached = _cached_share(probe)
    fd = os.open(str(probe), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    dropped = _cached_share(probe)
    probe.unlink()
    if cached < 0.9 or dropped > 0.1:
        pytest.skip("this file system keeps %.0f%% of a written file's pages cached and %.0f%% after "
                    "POSIX_FADV_DONTNEED" % (100 * cached, 100 * dropped))


def test_a_write_takes_the_cached_pages_of_the_file_it_replaces_then_of_the_one_before(tmp_path, monkeypatch):
    """``_atomic_write`` drops the cached pages of the file it replaces, then of ``recycle`` (the file
    written before), ``_WRITEBACK_BYTES`` ahead of the new file's size as it grows (not all at once:
    the new file takes them as they come free); both files' bytes stay as they were on disk. (The
    kernel caches a file in folios of up to 2 MB and drops one only whole: hence the 2 MB margin.)"""
    _dropping_or_skip(tmp_path)
    mb = 1 << 20
    monkeypatch.setattr(rb, "_WRITEBACK_BYTES", mb)
    rng = np.random.default_rng(5)
    old, before = (rng.integers(0, 256, 8 * mb, dtype=np.uint8).tobytes() for _ in range(2))
    path, previous = tmp_path / "ckpt.npz", tmp_path / "earlier.npz"
    _on_disk(path, old)
    _on_disk(previous, before)
    piece, seen = rng.integers(0, 256, 2 * mb, dtype=np.uint8).tobytes(), []

    def write(fh):
        for _ in range(8):
            seen.append((os.fstat(fh.fileno()).st_size, _cached_share(path), _cached_share(previous)))
            fh.write(piece)
            fh.flush()
            time.sleep(0.15)                        # the helper reads the size every 20 ms
        seen.append((os.fstat(fh.fileno()).st_size, _cached_share(path), _cached_share(previous)))

    _atomic(path, write, recycle=previous)
    assert path.read_bytes() == piece * 8 and previous.read_bytes() == before

    def kept(dropped):                              # the share of an 8 MB file left once ``dropped`` bytes are
        return 1 - min(max(dropped, 0), 8 * mb) / (8 * mb)

    for size, replaced, earlier in seen:            # dropped up to the size + 1 MB: the replaced file first
        upto = size + mb
        assert kept(upto) - 0.01 <= replaced <= kept(upto - 2 * mb) + 0.01, seen
        assert kept(upto - 8 * mb) - 0.01 <= earlier <= kept(upto - 10 * mb) + 0.01, seen
    assert seen[-1][1:] == (0.0, 0.0)               # at the end, both whole


def test_a_file_that_refuses_the_advice_is_left_cached_and_the_write_goes_on(tmp_path, monkeypatch):
    """Dropping a recycled file's pages is advice: when the kernel refuses it (an OSError), the helper
    stops advising after that one call, and the write completes and replaces the file as ever."""
    monkeypatch.setattr(rb, "_WRITEBACK_BYTES", 1 << 16)
    calls = []

    def refused(fd, offset, length, advice):
        calls.append((offset, length, advice))
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(os, "posix_fadvise", refused)
    path, previous = tmp_path / "ckpt.npz", tmp_path / "earlier.npz"
    path.write_bytes(bytes(1 << 20))
    previous.write_bytes(b"x" * (1 << 20))

    def write(fh):
        for _ in range(4):
            fh.write(b"n" * (1 << 17))
            fh.flush()
            time.sleep(0.1)

    _atomic(path, write, recycle=previous)
    assert path.read_bytes() == b"n" * (1 << 19) and previous.read_bytes() == b"x" * (1 << 20)
    assert calls == [(0, 1 << 16, os.POSIX_FADV_DONTNEED)]


@pytest.mark.slow
def test_a_save_recycles_the_checkpoint_it_replaces_or_else_the_one_it_wrote_before(graph_mode, tmp_path,
                                                                                    monkeypatch):
    """``RecModel.save_checkpoint`` to a new path (as ``OnlineCheckpoint`` names one a step) takes the
    cached pages of the checkpoint the model wrote before; to the same path, those of the file it
    replaces. Each earlier checkpoint's bytes are unchanged."""
    from mindspore import nn
    table = rb.HashEmbedding(9, 4096, input_index=1, seed=0, name="ids", optimizer=rb.SparseAdagrad(0.05))
    net = rb.WideDeep(4, 6, 8, (16,), embedding=table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    stream = rb.SyntheticClickStream(seed=0, num_dense=4, num_sparse=6, vocab_sizes=[3000] * 6, batch_size=64)
    recycled, real = set(), os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *args: recycled.add(os.fstat(fd).st_ino) or real(fd, *args))
    first, second = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    model.train(1, [next(stream) for _ in range(3)])
    model.save_checkpoint(first)
    written = open(first, "rb").read()
    model.train(1, [next(stream) for _ in range(2)])
    recycled.clear()
    model.save_checkpoint(second)
    assert recycled == {os.stat(first).st_ino}          # a new path: the checkpoint written before
    model.train(1, [next(stream) for _ in range(2)])
    replaced = os.stat(second).st_ino
    recycled.clear()
    model.save_checkpoint(second)
    assert recycled == {replaced}                       # the same path: the file it replaces
    assert open(first, "rb").read() == written
