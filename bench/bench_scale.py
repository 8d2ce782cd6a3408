"""Production-size tables (issue 38 item 1): step time, memory and checkpoint cost against the table's
size, one child process per size (so each size's RSS figures are its own). Reported, not gated.

    .venv/bin/python bench/bench_scale.py --sizes 20,23,26 --ids uniform,zipf --out bench/results/scale.json
    .venv/bin/python bench/bench_scale.py --sizes 22 --memory-only --out bench/results/scale-memory.json
    .venv/bin/python bench/bench_scale.py --sizes 27 --rows-dtype bfloat16 --optimizer rowwise_adagrad \\
        --phases save,export --out bench/results/scale-27-bf16.json          (item 2: 10^8 ids in 24 GB)
    .venv/bin/python bench/bench_scale.py --sizes 16,18 --quick --out bench/results/scale-quick.json   (proves it runs)

The model: the bench Wide&Deep (26 fields, 13 dense, MLP 400-400-1) over one ``HashEmbedding(DIM + 1,
2^k)`` (``--dim`` deep columns and the wide one; ``--optimizer``, default ``SparseAdam``; ``--rows-dtype``,
default float32), no admission threshold, no eviction, no growth.

**Fill.** The table is filled to ``--fill`` (default 0.9) of its rows with live ids before anything is
measured, through the table's own training path in big batches: ``HashEmbedding.prepare`` (the cache
admits each new id: it gets a row) then ``HashEmbedding.take`` (its id-keyed initial row and fresh
optimizer slots are written), ``--fill-batch`` ids (default 2^20) at a time, at the data time of the
stream's start. The ids are ``-1, -2, ..., -n`` (negative: ``SyntheticClickStream`` never draws them).
No gradient step is run: a filled row holds exactly what its id's first lookup gives it, which is what a
row holds before its first update; the memory it takes is the same.

**Per size** (the child process, ``--child``), in this order:

1. ``rss``: VmRSS (``/proc/self/status``) before the table is made and after it is filled: ``per_live_row``
   = their difference over the live rows, against ``bytes_per_row`` (``HashEmbedding.bytes_per_row``,
   total and its parts). ``table_bytes``: the arrays of the row store (rows, slots, live flags) plus the
   cache's entries (live rows x ``bytes_per_row["cache"]``); the figure the peaks are compared with.
2. ``--warmup`` training steps (the graph compiles), untimed; then per phase of ``--phases`` (default
   ``save,load,export``): ``RecModel.save_checkpoint`` to ``--dir``, ``RecModel.load_checkpoint`` of it
   into the same model, ``RecModel.export`` of a full bundle; ``serve``: a ``Predictor`` starting on that
   bundle (a fresh copy of the network, made before). Each phase's peak: VmHWM reset before it
   (writing "5" to ``/proc/self/clear_refs``; where the kernel does not allow it, VmRSS sampled every
   2 ms in a thread: ``peak_method`` says which), ``extra`` = the peak minus the VmRSS before the phase,
   and ``extra_over_table`` = extra / ``table_bytes``. A save and an export need no more than a fixed
   buffer (target: extra_over_table ~ 0); a load holds the checkpoint's new state beside the model's own
   until every byte is checked (all or nothing), so its target is ~ 1.0. ``resume``: a job restarting
   on the same machine, measured by the parent once this child has ended: a new process builds the
   same model, untrained, and loads the checkpoint this child saved; its
   peak (``peak``, VmHWM) against this process's RSS after training (``peak_over_trained_rss``): at most
   1 means a table that trains here also resumes here.
3. Unless ``--memory-only``: the phases' seconds, interleaved with the alternative a user would pick:
   ``np.save`` of the same arrays (rows and slots, one file, written from the table's own arrays: no
   copy) + flush + fsync on the same disk, and ``np.load`` of that file (each array into new memory),
   ``--io-rounds`` rounds in ABBA order. Both loads read from the disk: the file's pages are dropped
   from the page cache first (``posix_fadvise(DONTNEED)``), as after a restart. ``rate_vs_np_save``:
   the phase's bytes per second over np.save's (checkpoint: the file's bytes; export: the bundle's),
   ``load_rate_vs_np_load``: the load's over np.load's. ``serve_rate_vs_np_load``: a ``Predictor``'s start
   on the bundle (its pages dropped first, as on a new server; the fresh network made before the
   clock starts), by the bytes of the bundle's table files, over ``np_load_bundle``'s: ``np.load`` of
   those files, dropped first too. ``np_save_new``: the same np.save into a new
   file each round, the one before removed once it is complete, as a save that keeps its last good
   file must write (np.save truncates its own file, whose freed pages it takes back at once; a new
   file takes pages that sat free, which a VM's host may have to back again), and
   ``rate_vs_np_save_new``: the phase's rate over that one's. Every phase starts ``_SETTLE`` seconds after
   the phase before (see there). Medians, and the same of each side's fastest round
   (``*_of_fastest``): on a VM whose host backs memory lazily, the first touch of new page-cache or
   array pages costs some rounds seconds that the other rounds do not pay. ``cpu_seconds``: each
   side's CPU seconds (every thread's). ``floor``: what these cores allow, the work a checked save,
   export or load cannot leave out (sha256 and CRC-32 over every byte, the copy numpy's CPU seconds
   measure, the cache's entries and an export's rows put in id order, a load's cache state checked and
   its map rebuilt from the entries), each part timed alone in CPU
   seconds, and ``best_rate_vs_numpy``: the rate against numpy's were that work spread over every core
   without a gap (``_floor``).
4. Unless ``--memory-only``: the steady-state step time per ``--ids`` kind, interleaved (ABBA, ``--rounds``
   rounds of ``--steps`` steps) against the same model with a ``2^--reference`` row table filled the same
   way, built in this process after the memory figures: ``uniform``: batches of ids drawn uniformly over
   the live ids (every lookup a hit, rows scattered over the whole table: the cache-miss worst case);
   ``zipf``: ``SyntheticClickStream(seed=0)``'s batches (its ids are new to the filled table; a full table
   gives them the default row). ``ratio``: median step time over the reference's.

``RECBOOST_BENCH_TREE`` (default: this checkout) names the tree whose ``recboost.py`` and ``_recboost_fast``
build the children import (each size's record and its resume's name the file, ``recboost_file``): two trees, e.g. main
and a branch, are compared by runs of this script alternating between them, each size's ratio against
2^--reference measured in its own process as above.

Each child runs with ``MALLOC_MMAP_THRESHOLD_=1048576``: every allocation of 1 MB or more is its own
mapping, returned to the kernel when freed, so a phase's peak is not hidden by memory an earlier phase
freed into the heap (glibc otherwise raises its threshold to 32 MB as big blocks are freed).

Progress lines go to stderr (fill, each phase, every 10 s of a long phase). The parent writes ``--out``
(JSON: the command, the settings, one record per size) after every size, so a size that runs out of
memory leaves the others' figures; such a size's record says how its child ended.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIELDS, DENSE = 26, 13
OPTIMIZERS = {"adam": "SparseAdam", "adagrad": "SparseAdagrad", "rowwise_adagrad": "SparseRowWiseAdagrad",
              "sgd": "SparseSGD", "ftrl": "SparseFtrl"}
PHASES = ("save", "load", "resume", "export", "serve")
IDS = ("uniform", "zipf")
EXPORT_CHUNK = 1 << 22      # bytes of float32 rows an export gathers at a time (recboost's _EXPORT_CHUNK_BYTES)


def _log(text):
    print("[bench_scale] " + text, file=sys.stderr, flush=True)


# ---- memory ----------------------------------------------------------------------------------------
def _status(key):
    """``key`` (VmRSS, VmHWM) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no %s" % key)


def _reset_hwm():
    """Reset VmHWM to the current RSS; False when the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Phase:
    """A measured phase: its peak RSS (VmHWM after a reset, or VmRSS sampled every 2 ms), its extra over
    the RSS before it, its seconds (``timed``), and a progress line every 10 s."""

    def __init__(self, name, timed):
        self.name, self.timed = name, timed

    def __enter__(self):
        self.before = _status("VmRSS")
        self.method = "VmHWM after clear_refs" if _reset_hwm() else "VmRSS sampled every 2 ms"
        self.sampled, self.done = self.before, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def _watch(self):
        last = time.monotonic()
        sampling = self.method.startswith("VmRSS")
        while not self.done.wait(0.002 if sampling else 0.5):
            if sampling:
                self.sampled = max(self.sampled, _status("VmRSS"))
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                _log("  %s: running, RSS %.2f GB" % (self.name, _status("VmRSS") / 1e9))

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.done.set()
        self.thread.join()
        self.peak = max(self.sampled, _status("VmRSS")) if self.method.startswith("VmRSS") else _status("VmHWM")
        return False

    def record(self, table_bytes):
        out = {"rss_before": self.before, "peak": self.peak, "extra": self.peak - self.before,
               "extra_over_table": (self.peak - self.before) / table_bytes, "peak_method": self.method}
        if self.timed:
            out["seconds"] = self.seconds
        return out


# ---- the model ---------------------------------------------------------------------------------------
def _model(rb, nn, ms, args, capacity):
    ms.set_seed(0)
    optimizer = rb.sparse_optimizer(OPTIMIZERS.get(args.optimizer, args.optimizer))
    table = rb.HashEmbedding(args.dim + 1, capacity, input_index=1, optimizer=optimizer, seed=0, name="ids",
                             row_dtype=args.rows_dtype)
    net = rb.WideDeep(DENSE, FIELDS, args.dim, (400, 400), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))


def _fill(np, table, live, start, chunk, label):
    """Make ``live`` ids (-1 .. -live) own rows: prepare (the cache admits them) and take (their initial
    rows and slots), ``chunk`` ids at a time, at data time ``start``."""
    done, t0 = 0, time.monotonic()
    while done < live:
        ids = -np.arange(done + 1, min(done + chunk, live) + 1, dtype=np.int64)
        table.take(table.prepare(ids, start))
        done += ids.size
        if time.monotonic() - t0 > 10 or done == live:
            t0 = time.monotonic()
            _log("  %s: fill %d / %d ids (%.0f%%), RSS %.2f GB" % (label, done, live, 100.0 * done / live,
                                                                _status("VmRSS") / 1e9))
    if len(table.cache) < live:
        raise RuntimeError("%s: the table holds %d ids after filling %d" % (label, len(table.cache), live))


def _table_bytes(table):
    store = table.store
    arrays = store.weight.nbytes + sum(a.nbytes for a in store.slots.values()) + store.live.nbytes
    return int(arrays + len(table.cache) * table.bytes_per_row["cache"])


def _uniform_batches(np, live, batch, steps, start, seed):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        out.append({"dense": rng.random((batch, DENSE), np.float32),
                    "ids": -rng.integers(1, live + 1, (batch, FIELDS), dtype=np.int64),
                    "label": (rng.random((batch, 1)) < 0.25).astype(np.float32), "timestamp": start + s})
    return out


def _zipf_batches(rb, batch, steps, skip):
    stream = rb.SyntheticClickStream(seed=0, batch_size=batch, with_timestamp=True)
    out = []
    for s, (dense, ids, label, ts) in enumerate(stream):
        if s >= skip:
            out.append({"dense": dense, "ids": ids, "label": label, "timestamp": ts})
        if len(out) == steps:
            return out


def _np_save(np, arrays, path):
    with open(path, "wb") as fh:
        for a in arrays:
            np.save(fh, a)
        fh.flush()
        os.fsync(fh.fileno())


# Seconds each I/O phase waits before it starts, so that every phase finds the memory the phases before
# freed in the same state: a VM that reports free pages to its host (Linux page_reporting, 2 s after
# they are freed) has the host back them again on their next first touch, at about 1 s per GB here.
# Without the wait, a load right after a phase that freed the table's old arrays gets them back hot,
# and a write right after one that freed a file's cached pages (an export after a save that replaced
# its checkpoint) takes those for its own, which in a run, minutes apart, it never could.
_SETTLE = 3.0


def _np_load(np, count, path):
    with open(path, "rb") as fh:
        for _ in range(count):
            np.load(fh)


def _drop_cached(path):
    """Drop the pages of ``path`` (fsynced: clean) from the page cache: its next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _bundle_tables(path):
    """The table files of the bundle ``path`` (``table-*.npy``), sorted."""
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith("table-"))


def _bundle_tables_bytes(path):
    return sum(os.path.getsize(f) for f in _bundle_tables(path))


def _recboost():
    """The recboost module of ``RECBOOST_BENCH_TREE`` (default: this checkout), imported: every child
    (a size's, the resuming one) runs the same tree's code."""
    sys.path.insert(0, os.path.abspath(os.environ.get("RECBOOST_BENCH_TREE") or ROOT))
    import recboost  # pylint: disable=import-outside-toplevel
    return recboost


def child(args):
    """One size: the figures of the module docstring, as JSON to ``args.child_out``."""
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    rb = _recboost()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    k = args.child
    capacity, label = 1 << k, "2^%d" % k
    live = min(int(args.fill * capacity + 0.999999), capacity - 2)
    start = rb.SyntheticClickStream(seed=0).timestamp_of(0)
    timed = not args.memory_only
    out = {"log2_rows": k, "capacity": capacity, "backend": "fast" if rb.FAST_BACKEND else "py",
           "recboost_file": os.path.abspath(rb.__file__)}
    rss0 = _status("VmRSS")
    table, model = _model(rb, nn, ms, args, capacity)
    _log("%s: filling %d ids (%.0f%% of %d rows)" % (label, live, 100.0 * live / capacity, capacity))
    t0 = time.perf_counter()
    _fill(np, table, live, start, args.fill_batch, label)
    fill_seconds = time.perf_counter() - t0
    rss1 = _status("VmRSS")
    held = len(table.cache)
    table_bytes = _table_bytes(table)
    bpr = {key: int(v) for key, v in table.bytes_per_row.items()}
    out.update(live_rows=held, fill_fraction=held / capacity, fill="prepare + take, %d ids a call" % args.fill_batch,
               bytes_per_row=bpr, table_bytes=table_bytes,
               rss={"before_table": rss0, "after_fill": rss1, "per_live_row": (rss1 - rss0) / held,
                    "per_live_row_over_bytes_per_row": (rss1 - rss0) / held / bpr["total"],
                    "target_per_live_row_over_bytes_per_row": "<= 1.1"})
    if timed:
        out["fill_seconds"] = fill_seconds
    # a few training steps (the graph compiles; the checkpoint then holds trained state), untimed
    model.train(1, _uniform_batches(np, held, args.batch, args.warmup, start, seed=1))
    rss_trained = _status("VmRSS")
    out["rss"]["after_training"] = rss_trained
    scratch = os.path.join(args.dir, "scale-%d-%d" % (k, os.getpid()))
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    phases, ckpt = {}, os.path.join(scratch, "ckpt.npz")

    def new_server():
        """A fresh copy of the network, made now; returns the call that starts a Predictor of it on a bundle."""
        network = _model(rb, nn, ms, args, capacity)[1].network
        return lambda bundle: rb.Predictor(network, bundle)
    try:
        for phase in args.phases:
            _log("%s: %s" % (label, phase))
            if phase == "resume":           # last, once this process has let its model go
                continue
            target = os.path.join(scratch, "bundle")
            if phase != "serve":
                shutil.rmtree(target, ignore_errors=True)
            start_server = new_server() if phase == "serve" else None
            with _Phase(phase, timed) as p:
                if phase == "save":
                    model.save_checkpoint(ckpt)
                elif phase == "load":
                    model.load_checkpoint(ckpt)
                elif phase == "export":
                    model.export(target)
                else:
                    served = start_server(target)
            phases[phase] = p.record(table_bytes)
            phases[phase]["bytes"] = _dir_bytes(target) if phase == "export" else \
                _bundle_tables_bytes(target) if phase == "serve" else os.path.getsize(ckpt)
            start_server = served = None
            _log("%s: %s peak extra %.3f GB (%.2f x the table's %.3f GB)" % (
                label, phase, phases[phase]["extra"] / 1e9, phases[phase]["extra_over_table"], table_bytes / 1e9))
        out["phases"] = phases
        if timed and args.io_rounds:
            out["io"] = _io_rounds(np, model, table, args, scratch, ckpt, new_server)
        if timed:
            out["steps"] = _step_times(np, rb, nn, ms, args, model, held, start)
    finally:
        if "resume" in args.phases and os.path.exists(ckpt):
            out["resume_checkpoint"] = ckpt     # the parent resumes from it once this process has ended
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    with open(args.child_out, "w") as fh:
        json.dump(out, fh, indent=1)


def _resume(args, k, size):
    """The ``resume`` phase of size ``k`` (its record ``size``), run by the parent once the child that
    trained and saved has ended (a restarted job: the trained process's memory is gone)."""
    ckpt = size.pop("resume_checkpoint", None)
    if ckpt is None:
        return
    _log("2^%d: resume" % k)
    try:
        args.child = k
        fresh = size["phases"]["resume"] = _resume_child(args, ckpt)
    finally:
        args.child = None
        shutil.rmtree(os.path.dirname(ckpt), ignore_errors=True)
    if "peak" in fresh:
        trained = size["rss"]["after_training"]
        fresh["peak_over_trained_rss"] = fresh["peak"] / trained
        _log("2^%d: resume peak %.3f GB (%.2f x the trained process's RSS %.3f GB)" % (
            k, fresh["peak"] / 1e9, fresh["peak_over_trained_rss"], trained / 1e9))


def _resume_child(args, ckpt):
    """The ``resume`` phase: a new process (as a job restarting) builds the same model, untrained, and
    loads ``ckpt``: its RSS before and after, and its peak (VmHWM), in bytes."""
    part = ckpt + ".resume.json"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    command = [sys.executable, os.path.abspath(__file__), "--out", part, "--resume-child", ckpt, "--child",
               str(args.child), "--dim", str(args.dim), "--rows-dtype", args.rows_dtype, "--optimizer",
               args.optimizer]
    if subprocess.call(command, env=env) != 0:
        return {"failed": "the resuming process failed (out of memory?)"}
    with open(part) as fh:
        return json.load(fh)


def resume_child(args):
    """The resuming process of :func:`_resume_child` (``--resume-child``)."""
    import mindspore as ms
    from mindspore import nn
    rb = _recboost()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    before_model = _status("VmRSS")
    _, model = _model(rb, nn, ms, args, 1 << args.child)
    before = _status("VmRSS")
    method = "VmHWM after clear_refs" if _reset_hwm() else "VmHWM (not reset: includes the model's build)"
    t0 = time.perf_counter()
    model.load_checkpoint(args.resume_child)
    out = {"rss_before_model": before_model, "rss_before": before, "rss_after": _status("VmRSS"),
           "peak": _status("VmHWM"), "peak_method": method, "seconds": time.perf_counter() - t0,
           "recboost_file": rb.__file__}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


def _io_rounds(np, model, table, args, scratch, ckpt, new_server):
    """save / load / export against np.save + fsync of the table's rows and slots, and serve (the call
    ``new_server()`` returns, made before the clock starts) against np.load of the bundle's table
    files, ABBA rounds."""
    arrays = [table.store.weight] + list(table.store.slots.values())
    raw = sum(a.nbytes for a in arrays)
    npy = os.path.join(scratch, "rows.npy")
    bundle = os.path.join(scratch, "bundle")

    def run(name):
        if name == "export":
            shutil.rmtree(bundle, ignore_errors=True)
        if name in ("load", "np_load"):
            _drop_cached(ckpt if name == "load" else npy)
        if name in ("serve", "np_load_bundle"):
            for path in os.listdir(bundle):
                _drop_cached(os.path.join(bundle, path))
        start_server = new_server() if name == "serve" else None
        time.sleep(_SETTLE)
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "save":
            model.save_checkpoint(ckpt)
        elif name == "load":
            model.load_checkpoint(ckpt)
        elif name == "export":
            model.export(bundle)
        elif name == "serve":
            start_server(bundle)
        elif name == "np_load_bundle":
            for path in _bundle_tables(bundle):
                np.load(path)
        elif name == "np_save":
            _np_save(np, arrays, npy)
        elif name == "np_save_new":       # into a new file, the one before removed once it is complete
            beside.append(os.path.join(scratch, "rows-%d.npy" % len(beside)))
            _np_save(np, arrays, beside[-1])
            if len(beside) > 1:
                os.unlink(beside[-2])
        else:
            _np_load(np, len(arrays), npy)
        cpu[name].append(time.process_time() - c0)
        return time.perf_counter() - t0

    beside = []                           # np_save_new's files, in order
    names = [p for p in args.phases if p != "resume"] + ["np_save", "np_save_new"] + \
        (["np_load"] if "load" in args.phases else []) + (["np_load_bundle"] if "serve" in args.phases else [])
    times, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.io_rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            _log("  io round %d: %s" % (r, name))
            times[name].append(run(name))
    sizes = {n: os.path.getsize(ckpt if n in ("save", "load") else npy) for n in times
             if n not in ("export", "serve", "np_load_bundle")}
    if "export" in times:
        sizes["export"] = _dir_bytes(bundle)
    if "serve" in times:
        sizes["serve"] = sizes["np_load_bundle"] = _bundle_tables_bytes(bundle)
    out = {"rounds": args.io_rounds, "seconds_each": times, "bytes": sizes, "np_save_array_bytes": raw,
           "target_rate_vs_numpy": ">= 0.7"}
    for suffix, pick in (("", statistics.median), ("_of_fastest", min)):
        rate = {n: sizes[n] / pick(v) for n, v in times.items()}
        out["seconds" + suffix] = {n: pick(v) for n, v in times.items()}
        out["bytes_per_second" + suffix] = rate
        out["rate_vs_np_save" + suffix] = {n: rate[n] / rate["np_save"] for n in ("save", "export") if n in rate}
        out["rate_vs_np_save_new" + suffix] = {n: rate[n] / rate["np_save_new"] for n in ("save", "export")
                                               if n in rate}
        if "load" in rate:
            out["load_rate_vs_np_load" + suffix] = rate["load"] / rate["np_load"]
        if "serve" in rate:
            out["serve_rate_vs_np_load" + suffix] = rate["serve"] / rate["np_load_bundle"]
    out["cpu_seconds"] = {n: statistics.median(v) for n, v in cpu.items()}
    out["floor"] = _floor(np, table, arrays, out)
    return out


def _cpu(fn):
    """The process's CPU seconds (every thread's, user and system) while ``fn()`` runs."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _floor(np, table, arrays, io):
    """The fastest each of ``io``'s phases could be on this machine's cores, against numpy: the CPU work
    a checked save, export or load cannot leave out, each part run alone and timed in CPU seconds, over
    the cores. A save must copy its bytes into the page cache (what ``np.save`` does: its CPU seconds,
    scaled to the file's bytes), compute each member's sha256 (the manifest's) and CRC-32 (the zip's:
    ``np.load`` checks it) over every byte, and put the cache's entries in id order (the format is the
    same for both backends): the ids sorted (``HashCache.keys``: one pass over the map and a sort, where
    a save of more than ``_KEYS_HELD`` ids makes a pass a range) and each id's row, count and last-seen
    time looked up (``HashCache.entries``, 2^19 ids a call; a save spreads the calls over two threads:
    the same CPU seconds). An export copies, hashes (sha256) and puts its rows in id order: the ids
    sorted, their rows looked up and gathered (``rows_float32``, ``EXPORT_CHUNK`` bytes of float32 rows
    a call, as an export does). A load copies (``np.load``'s CPU seconds), hashes, checks the cache's
    state and rebuilds its map from the entries (``HashCache.load_state_dict`` into a new cache: the
    format stores the entries, not the map). The digests' CPU
    seconds a byte are measured over the table's own arrays. ``best_rate_vs_numpy``: the phase's bytes
    over ``max(numpy's seconds for as many bytes, work / cores)``, against numpy's rate; below the
    target, the target cannot be met by any overlap of this work on these cores. It holds the cache's
    ids and their rows whole meanwhile (12 bytes an entry), then a copy of the cache's state and the new
    cache's map when there was a load, after the timed rounds."""
    import hashlib  # pylint: disable=import-outside-toplevel
    import zlib  # pylint: disable=import-outside-toplevel
    raw, cores = sum(a.nbytes for a in arrays), len(os.sched_getaffinity(0))

    def over_arrays(update):
        for a in arrays:
            flat = memoryview(a.reshape(-1).view(np.uint8))
            for start in range(0, flat.nbytes, 4 << 20):
                update(flat[start:start + (4 << 20)])
    sha, crc = hashlib.sha256(), [0]
    per_byte = {"sha256": _cpu(lambda: over_arrays(sha.update)) / raw,
                "crc32": _cpu(lambda: over_arrays(lambda b: crc.__setitem__(0, zlib.crc32(b, crc[0])))) / raw}
    cache, keys, rows = table.cache, [], []
    order = {"sorted_ids": _cpu(lambda: keys.append(cache.keys()))}
    keys, chunk = keys[0], 1 << 19
    order["entries_looked_up"] = _cpu(lambda: rows.extend(cache.entries(keys[i:i + chunk])[1]
                                                          for i in range(0, keys.size, chunk)))
    step = max(1, EXPORT_CHUNK // (4 * table.embedding_size))
    order["rows_gathered"] = _cpu(lambda: [table.rows_float32(at[i:i + step]) for at in rows
                                           for i in range(0, at.size, step)])
    keys = rows = None
    if "load" in io["seconds"]:
        state = cache.state_dict()
        order["state_checked_map_rebuilt"] = _cpu(lambda: type(cache)(3).load_state_dict(state))
        state = None
    per_np = {n: io["cpu_seconds"][n] / io["bytes"][n] for n in ("np_save", "np_load") if n in io["cpu_seconds"]}
    out = {"cores": cores, "cpu_seconds_per_byte": dict(per_byte, **per_np), "order_cpu_seconds": order,
           "work_cpu_seconds": {}, "best_rate_vs_numpy": {}}
    for phase in ("save", "export", "load"):
        if phase not in io["seconds"]:
            continue
        n, ref = io["bytes"][phase], ("np_load" if phase == "load" else "np_save")
        work = n * (per_np[ref] + per_byte["sha256"])
        if phase == "save":
            work += n * per_byte["crc32"] + order["sorted_ids"] + order["entries_looked_up"]
        elif phase == "export":
            work += order["sorted_ids"] + order["entries_looked_up"] + order["rows_gathered"]
        else:
            work += order["state_checked_map_rebuilt"]
        numpy_seconds = io["seconds"][ref] * n / io["bytes"][ref]
        out["work_cpu_seconds"][phase] = work
        out["best_rate_vs_numpy"][phase] = numpy_seconds / max(numpy_seconds, work / cores)
    return out


def _step_times(np, rb, nn, ms, args, model, held, start):
    """Median seconds per step of this size's model and of the reference, interleaved (ABBA)."""
    ref_k = args.reference
    ref_table, ref_model = _model(rb, nn, ms, args, 1 << ref_k)
    ref_live = min(int(args.fill * (1 << ref_k) + 0.999999), (1 << ref_k) - 2)
    _fill(np, ref_table, ref_live, start, args.fill_batch, "reference 2^%d" % ref_k)
    ref_model.train(1, _uniform_batches(np, ref_live, args.batch, args.warmup, start, seed=1))
    out = {"batch": args.batch, "steps_per_round": args.steps, "rounds": args.rounds, "reference_log2_rows": ref_k}
    step0 = args.warmup + 1
    for kind in args.ids:
        n = args.steps * args.rounds
        if kind == "uniform":
            mine = _uniform_batches(np, held, args.batch, n, start + step0, seed=2)
            ref = _uniform_batches(np, ref_live, args.batch, n, start + step0, seed=2)
        else:
            mine = ref = _zipf_batches(rb, args.batch, n, args.warmup)
        times = {"table": [], "reference": []}
        for r in range(args.rounds):
            part = slice(r * args.steps, (r + 1) * args.steps)
            order = [("table", model, mine), ("reference", ref_model, ref)]
            for name, m, batches in (order if r % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                m.train(1, batches[part])
                times[name].append((time.perf_counter() - t0) / args.steps)
            _log("  steps %s round %d: %.1f ms / %.1f ms (reference)" % (kind, r, 1e3 * times["table"][-1],
                                                                        1e3 * times["reference"][-1]))
        med = {n: statistics.median(v) for n, v in times.items()}
        out[kind] = {"seconds_per_step": med["table"], "reference_seconds_per_step": med["reference"],
                     "ratio": med["table"] / med["reference"], "target_ratio": "<= 1.10 (uniform, 2^26)"}
    return out


def _list(text, cast, allowed=None):
    items = [cast(x) for x in text.split(",") if x.strip()]
    if allowed is not None:
        for item in items:
            if item not in allowed:
                raise argparse.ArgumentTypeError("%r is not one of %s" % (item, list(allowed)))
    return items


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="20,23,26", type=lambda t: _list(t, int),
                    help="log2 of the table's rows, comma-separated (one child process each)")
    ap.add_argument("--ids", default="uniform,zipf", type=lambda t: _list(t, str, IDS), help="uniform, zipf")
    ap.add_argument("--out", required=True, help="the JSON file of every figure")
    ap.add_argument("--dim", type=int, default=16, help="deep columns of a row (the table is dim + 1 wide)")
    ap.add_argument("--rows-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--optimizer", default="adam", help="%s or a sparse optimizer's class name" % list(OPTIMIZERS))
    ap.add_argument("--fill", type=float, default=0.9, help="live rows / rows (>= 0.9 for the issue's figures)")
    ap.add_argument("--fill-batch", type=int, default=1 << 20, help="ids per prepare + take while filling")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds per model (ABBA)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    ap.add_argument("--io-rounds", type=int, default=2, help="rounds of save/load/export vs np.save (ABBA)")
    ap.add_argument("--reference", type=int, default=20, help="log2 rows of the reference table")
    ap.add_argument("--phases", default=",".join(PHASES), type=lambda t: _list(t, str, PHASES),
                    help="which of save, load, resume, export, serve to run (load and resume need save, "
                         "serve needs export)")
    ap.add_argument("--memory-only", action="store_true",
                    help="only RSS and the peaks of save, load and export: no timing")
    ap.add_argument("--quick", action="store_true", help="tiny rounds: proves the script runs")
    ap.add_argument("--dir", default=os.path.join(HERE, "results"),
                    help="scratch folder for checkpoints and bundles (the disk measured)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--resume-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.rounds, args.warmup, args.io_rounds = 256, 3, 2, 1, 1
        args.fill_batch = min(args.fill_batch, 1 << 16)
    if not 0 < args.fill < 1 or args.dim < 1:
        ap.error("--fill must be in (0, 1) and --dim >= 1")
    args.phases = [p for p in PHASES if p in args.phases]
    if {"load", "resume"} & set(args.phases) and "save" not in args.phases:
        ap.error("--phases: load and resume need save")
    if "serve" in args.phases and "export" not in args.phases:
        ap.error("--phases: serve needs export")
    return args


def main(argv=None):
    args = parse(argv)
    if args.resume_child is not None:
        return resume_child(args)
    if args.child is not None:
        return child(args)
    record = {"command": [sys.executable] + sys.argv, "settings": {
        "dim": args.dim, "rows_dtype": args.rows_dtype, "optimizer": OPTIMIZERS.get(args.optimizer, args.optimizer),
        "fill": args.fill, "batch": args.batch, "ids": args.ids, "phases": args.phases,
        "memory_only": args.memory_only, "quick": args.quick, "dir": args.dir}, "sizes": []}
    os.makedirs(args.dir, exist_ok=True)
    own = list(argv if argv is not None else sys.argv[1:])
    for k in args.sizes:
        part = os.path.join(args.dir, ".scale-%d-%d.json" % (k, os.getpid()))
        _log("2^%d: child process" % k)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
        rc = subprocess.call([sys.executable, os.path.abspath(__file__)] + own +
                             ["--child", str(k), "--child-out", part], env=env)
        if rc == 0 and os.path.exists(part):
            with open(part) as fh:
                record["sizes"].append(json.load(fh))
            os.remove(part)
            _resume(args, k, record["sizes"][-1])
        else:
            record["sizes"].append({"log2_rows": k, "failed": "the child exited with code %d%s" % (
                rc, " (killed: out of memory?)" if rc < 0 else "")})
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(tmp, args.out)
    _log("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
