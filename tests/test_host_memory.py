"""A table's host memory (issue #38 items 1 and 5): every per-row host array of a table (rows, optimizer
slots, live flags, changed flags) comes from one allocator: zero-filled (or its slot's fill),
C-contiguous and writeable, its data 64-byte aligned (a dim-16 float32 row is one cache line), and from
2 MB on on an anonymous mapping of its own, 2 MB aligned and advised ``MADV_HUGEPAGE``. Every path that
makes, grows, empties or loads a table (a checkpoint too) keeps it there.

The tables here hold arrays of at least 2 MB: numpy's own allocation of such an array (glibc's mmap
behind a 16-byte header) is never 2 MB aligned, so a path that falls back to ``np.zeros``,
``np.concatenate`` or ``np.array`` fails here every time, not by chance. Only public names are used."""
import mmap
import re

import numpy as np
import pytest
from mindspore import nn

import recboost as rb

HUGE = 2 << 20         # the huge page (x86-64, arm64): arrays of at least this size are aligned to it
BIG = 1 << 15          # rows: a dim-16 float32 array of them is 2 MB


def _vma_flags(array):
    """The ``VmFlags`` of the mapping of this process that holds ``array``'s first byte (/proc/self/smaps)."""
    addr, inside = array.ctypes.data, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= addr < int(span.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError("no mapping holds address %#x" % addr)


def _placed(array):
    """Whether ``array`` is where the allocator puts a table's array: C-contiguous, writeable, its data
    64-byte aligned, and 2 MB aligned from 2 MB on."""
    align = HUGE if array.nbytes >= HUGE else 64
    return array.flags.c_contiguous and array.flags.writeable and array.ctypes.data % align == 0


def _assert_placed(store, what):
    arrays = {"weight": store.weight, "live": store.live, **{"slot " + n: a for n, a in store.slots.items()}}
    if store.changed is not None:
        arrays["changed"] = store.changed
    for name, array in arrays.items():
        assert array.shape[0] >= store.capacity, (what, name)     # (live flags follow the cache's growth first)
        assert _placed(array), "%s: %s (%d bytes at %#x) is not in the tables' memory" % (
            what, name, array.nbytes, array.ctypes.data)


def _root(array):
    """The object that owns ``array``'s memory (the end of its ``base`` chain)."""
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


def _table(optimizer, row_dtype="float32", capacity=BIG, dim=16):
    return rb.HashEmbedding(dim, capacity, optimizer=optimizer, use_dynamic_expansion=True, seed=3,
                            row_dtype=row_dtype, max_unique=64)


@pytest.mark.parametrize("capacity, dim", [(BIG, 16), (BIG + 3, 17), (50, 16), (7, 3)])
def test_a_new_tables_arrays_are_zeroed_or_filled_aligned_and_writeable(capacity, dim):
    table = _table(rb.SparseAdagrad(0.1, initial_accumulator_value=0.25), capacity=capacity, dim=dim)
    store = table.store
    _assert_placed(store, "new")
    assert store.weight.shape == (capacity, dim) and store.weight.dtype == np.float32 and not store.weight.any()
    accum = store.slots["accum"]
    assert accum.shape == (capacity, dim) and accum.dtype == np.float32 and np.all(accum == np.float32(0.25))
    assert store.live.dtype == np.bool_ and store.live.tolist() == [True] * 2 + [False] * (capacity - 2)
    store.weight[-1] = 1.5                                       # its own memory
    assert np.all(store.weight[-1] == 1.5) and not _table(rb.SparseSGD(0.1), capacity=capacity, dim=dim).weight.any()


def test_a_large_tables_arrays_are_huge_paged_and_outlive_every_other_reference():
    table = _table(rb.SparseAdam(0.01))
    weight, m = table.store.weight, table.store.slots["moment1"]
    if hasattr(mmap, "MADV_HUGEPAGE"):               # (Linux >= 2.6.38, Python >= 3.8)
        assert "hg" in _vma_flags(weight) and "hg" in _vma_flags(m)     # the kernel's mark of MADV_HUGEPAGE
    # small: not a mapping of its own (its VMA's flags are whatever earlier allocations of the process left:
    # numpy advises huge pages on its own large arrays, whose heap memory a small array may reuse)
    assert not isinstance(_root(_table(rb.SparseAdam(0.01), capacity=50).store.weight), mmap.mmap)
    assert isinstance(_root(weight), mmap.mmap)                  # large: a mapping of its own
    view = weight[5:9]
    del table, weight, m
    view[...] = 2.5                                   # the mapping lives as long as an array of it
    assert np.all(view == 2.5)


def test_without_madvise_a_large_tables_arrays_are_still_aligned(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    table = _table(rb.SparseAdagrad(0.1, initial_accumulator_value=1.5))
    _assert_placed(table.store, "without madvise")
    assert "hg" not in _vma_flags(table.store.weight) and np.all(table.store.slots["accum"] == 1.5)


@pytest.mark.parametrize("optimizer, row_dtype", [(lambda: rb.SparseAdam(0.01), "float32"),
                                                  (lambda: rb.SparseRowWiseAdagrad(0.1), "bfloat16"),
                                                  (lambda: rb.SparseFtrl(0.05), "float32")])
def test_every_array_of_a_table_stays_in_its_memory(backend, optimizer, row_dtype):
    """Made, grown (by the cache and by ``take``), trained, with changes tracked, emptied, given a new
    optimizer, saved and loaded (copies; with ``copy=False`` a state of plain numpy arrays: copied in;
    the table's own copies: taken), resharded, and loaded across row storages: every per-row array of
    the table is in the allocator's memory, and the values stay what they were."""
    table = _table(optimizer(), row_dtype)
    _assert_placed(table.store, "new")
    table.store.track_changes()
    ids = np.arange(BIG + 10, dtype=np.int64)        # more ids than rows: the cache grows, then the store
    batch = table.prepare(ids)
    _assert_placed(table.store, "after the cache grew")
    table.take(batch)
    assert table.capacity == table.cache.capacity > BIG
    _assert_placed(table.store, "grown")
    step = table.prepare(np.array([5, 7, 5, 9], np.int64))
    table.take(step)
    table.apply_gradients(step, np.ones((4, 16), np.float32))
    _assert_placed(table.store, "trained")
    assert table.store.changed[2:].all() and not table.store.changed[:2].any()      # (rows 0, 1: reserved)
    state = table.state_dict()
    for name, array in [("table", state["table"]), ("live", state["live"])] + list(state["slots"].items()):
        assert _placed(array), name                   # a state's copies: in the tables' memory too
    _assert_placed(table.store.emptied(BIG + 1), "emptied")

    other = _table(optimizer(), row_dtype)
    for copy in (True, False):
        plain = table.state_dict()
        plain.update(table=np.array(plain["table"]), live=np.array(plain["live"]),
                     slots={n: np.array(a) for n, a in plain["slots"].items()})     # np.array: numpy's memory
        other.load_state_dict(plain, copy=copy)
        _assert_placed(other.store, "loaded plain arrays, copy=%s" % copy)
        assert np.array_equal(other.store.weight, state["table"]) and np.array_equal(other.store.live, state["live"])
        assert all(np.array_equal(other.store.slots[n], state["slots"][n]) for n in state["slots"])
    own = table.state_dict()
    other.load_state_dict(own, copy=False)
    assert other.store.weight is own["table"] and other.store.live is own["live"]      # taken, not copied
    assert all(other.store.slots[n] is own["slots"][n] for n in own["slots"])
    other.store.use_optimizer(optimizer())
    _assert_placed(other.store, "a new optimizer")

    whole = _table(optimizer(), row_dtype)
    whole.load_state_dict(whole.restore_states([table.check_state_dict(table.state_dict())]))
    _assert_placed(whole.store, "resharded")
    across = _table(optimizer(), "float32" if row_dtype == "bfloat16" else "bfloat16")
    across.load_state_dict(table.state_dict(), strict=False, copy=False)
    _assert_placed(across.store, "loaded into the other row storage")


def test_a_checkpoints_tables_are_read_into_their_memory(tmp_path, graph_mode):
    """``RecModel.load_checkpoint`` reads each array straight into the tables' memory, and the table
    takes it as it is (no copy, no plain numpy memory)."""
    def model():
        table = rb.HashEmbedding(16, BIG, input_index=1, seed=1, name="ids", optimizer=rb.SparseAdam(0.01))
        net = rb.WideDeep(2, 3, 15, (8,), embedding=table)
        return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    table, saved = model()
    table.take(table.prepare(np.arange(1000, dtype=np.int64)))
    path = str(tmp_path / "c.npz")
    saved.save_checkpoint(path)
    loaded_table, loaded = model()
    loaded.load_checkpoint(path)
    _assert_placed(loaded_table.store, "loaded from a checkpoint")
    assert np.array_equal(loaded_table.store.weight, table.store.weight)
    assert np.array_equal(loaded_table.store.slots["moment2"], table.store.slots["moment2"])
