# cython: language_level=3
"""Compiled host kernels for recboost (built as ``_recboost_fast``).

Kernels only: typed arrays in, arrays out, with arguments recboost.py has already checked (this
module never imports recboost). Validation, error messages, logging and MindSpore stay in
recboost.py, which holds a pure-numpy twin of every kernel here (named ``_py_<name>``, bit-identical
results) and binds each public name to one backend or the other. setup.py compiles this file with
``embedsignature`` and ``binding``, so ``inspect.signature`` and ``help()`` work on every function
and class as on the twins.

Sections: the 64-bit mixer (one, used by every hash here), Criteo parsing, the hash cache, gradient
freeze, PCA, host tables (gather, bag pooling, grouping by row, distinct ids of a row-wise step, fused
sparse optimizers, initial rows).
"""
cimport cython
import numpy as np
from libc.math cimport INFINITY, fabsf, pow, sqrt, sqrtf
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memchr, memcpy, memset

# Must equal recboost.__version__; recboost refuses a stale build.
__version__ = "0.2.0"

# =====================================================================================================
# The 64-bit mixer
# =====================================================================================================
# splitmix64's finaliser (a bijection of uint64) and its golden-ratio increment: the one mixer of
# this file (Criteo ids, hash-cache slots, distinct-id slots, freeze draws, initial rows). recboost.py's numpy side has
# the same constants once (``_GOLDEN``, ``_MIX_M1``, ``_MIX_M2``) and the same ``_mix64``.
# They are C (compile-time constants, one inline function) so that the bfloat16 encoder's C row loop
# below uses the same ones.
cdef extern from *:
    """
    #include <stdint.h>
    #define RB_GOLDEN 0x9E3779B97F4A7C15ULL
    #define RB_MIX_M1 0xBF58476D1CE4E5B9ULL
    #define RB_MIX_M2 0x94D049BB133111EBULL
    /* splitmix64's finaliser (wrapping 64-bit arithmetic) */
    static inline uint64_t rb_mix64(uint64_t x) {
        x ^= x >> 30;
        x *= RB_MIX_M1;
        x ^= x >> 27;
        x *= RB_MIX_M2;
        x ^= x >> 31;
        return x;
    }
    """
    const uint64_t _GOLDEN "RB_GOLDEN"
    uint64_t _mix64 "rb_mix64" (uint64_t x) noexcept nogil


cdef extern from *:
    """
    #include <stdint.h>
    static inline void rb_prefetch(const void *p) { __builtin_prefetch(p, 1, 3); }
    static inline void rb_prefetch_read(const void *p) { __builtin_prefetch(p, 0, 3); }
    /* every 64-byte cache line of the bytes [p, p + n): a row of 17 floats, or one not 64-byte
       aligned, spans two lines, and a prefetch of its first byte fetches only the first */
    static inline void rb_prefetch_span(const void *p, long n) {
        for (uintptr_t q = (uintptr_t)p & ~(uintptr_t)63; q < (uintptr_t)p + n; q += 64)
            __builtin_prefetch((const void *)q, 1, 3);
    }
    static inline void rb_prefetch_span_read(const void *p, long n) {
        for (uintptr_t q = (uintptr_t)p & ~(uintptr_t)63; q < (uintptr_t)p + n; q += 64)
            __builtin_prefetch((const void *)q, 0, 3);
    }
    """
    void rb_prefetch(const void *p) nogil          # a hint: the line at p will be written soon
    void rb_prefetch_read(const void *p) nogil     # ... read soon
    void rb_prefetch_span(const void *p, long n) nogil          # every line of n bytes at p: written soon
    void rb_prefetch_span_read(const void *p, long n) nogil     # ... read soon

# =====================================================================================================
# Criteo parsing
# =====================================================================================================
# parse_criteo: a buffer of text lines in the Criteo layout -> typed arrays. The twin is
# recboost._py_parse_criteo; the hashing and the per-line rules are documented there.
cdef uint64_t _CRITEO_MISSING_SALT = 0x6A09E667F3BCC909ULL
cdef uint64_t _CRITEO_INT64_MAX = 0x7FFFFFFFFFFFFFFFULL


cdef signed char _criteo_hex[256]       # byte -> hex digit value, -1 if not a hex digit


cdef void _criteo_fill_hex() noexcept:
    cdef int c
    for c in range(256):
        _criteo_hex[c] = (c - 48 if 48 <= c <= 57 else c - 87 if 97 <= c <= 102
                          else c - 55 if 65 <= c <= 70 else -1)


_criteo_fill_hex()


cdef inline int64_t _criteo_id(uint64_t h) noexcept nogil:
    cdef int64_t v = <int64_t>(h >> 1)
    return v if v > 0 else 1


cdef inline Py_ssize_t _criteo_tabs(const unsigned char* s, Py_ssize_t p, Py_ssize_t e) noexcept nogil:
    cdef Py_ssize_t t = 0
    while p < e:
        if s[p] == 9:
            t += 1
        p += 1
    return t


def parse_criteo(const unsigned char[::1] buf, int num_dense, int num_sparse):
    """Parse every line of ``buf`` (the last one may lack its newline).

    Returns ``(labels float32 [rows], dense int64 [rows, num_dense], ids int64 [rows, num_sparse],
    status int8 [lines], line_end int64 [lines])``: one row per line whose status is 0, in order;
    ``line_end[i]`` is the offset just past line ``i`` (past its newline). One pass per line: the
    fields are parsed as they are scanned; after a bad field only the tabs are counted, so that a
    wrong field count (status 1) still wins over a bad field, as in the twin."""
    cdef Py_ssize_t n = buf.shape[0], start, end, cend, p, q, n_lines = 0, r = 0, l
    cdef int nf = num_dense + num_sparse, f, k, code, c, digits
    cdef uint64_t acc, h
    cdef bint neg
    cdef const unsigned char* s = &buf[0] if n > 0 else NULL
    cdef const unsigned char* hit
    p = 0
    while p < n:
        hit = <const unsigned char*>memchr(s + p, 10, n - p)
        if hit == NULL:
            n_lines += 1
            break
        n_lines += 1
        p = (hit - s) + 1
    labels_a = np.empty(n_lines, dtype=np.float32)
    dense_a = np.empty((n_lines, num_dense), dtype=np.int64)
    ids_a = np.empty((n_lines, num_sparse), dtype=np.int64)
    status_a = np.empty(n_lines, dtype=np.int8)
    line_end_a = np.empty(n_lines, dtype=np.int64)
    salts_a = np.empty(max(num_sparse, 1), dtype=np.uint64)
    missing_a = np.empty(max(num_sparse, 1), dtype=np.int64)
    cdef float[::1] labels = labels_a
    cdef int64_t[:, ::1] dense = dense_a
    cdef int64_t[:, ::1] ids = ids_a
    cdef int8_t[::1] status = status_a
    cdef int64_t[::1] line_end = line_end_a
    cdef uint64_t[::1] salts = salts_a
    cdef int64_t[::1] missing = missing_a
    for f in range(num_sparse):
        salts[f] = <uint64_t>(f + 1) * _GOLDEN
        missing[f] = _criteo_id(_mix64(salts[f] ^ _CRITEO_MISSING_SALT))
    start = 0
    with nogil:
        for l in range(n_lines):
            hit = <const unsigned char*>memchr(s + start, 10, n - start)
            end = (hit - s) if hit != NULL else n
            line_end[l] = end + 1 if end < n else n
            cend = end
            if cend > start and s[cend - 1] == 13:
                cend -= 1
            code = 0
            p = start
            f = 0
            while True:                      # field f starts at p; on exit p is at its end
                if f == 0:                   # label: exactly "0" or "1"
                    if p + 1 <= cend and (s[p] == 48 or s[p] == 49) and (p + 1 == cend or s[p + 1] == 9):
                        labels[r] = <float>(s[p] - 48)
                        p += 1
                    else:
                        code = 2
                elif f <= num_dense:         # dense: empty, or [+-] and 1-19 digits within int64
                    acc = 0
                    neg = False
                    digits = 0
                    q = p
                    if q < cend and (s[q] == 45 or s[q] == 43):
                        neg = s[q] == 45
                        q += 1
                    while q < cend:
                        c = s[q] - 48
                        if c < 0 or c > 9:
                            break
                        acc = acc * 10 + <uint64_t>c
                        digits += 1
                        if digits > 19:
                            break
                        q += 1
                    if q < cend and s[q] != 9:
                        code = 3
                    elif q == p:
                        dense[r, f - 1] = 0
                    elif digits == 0:
                        code = 3
                    elif neg:
                        if acc > _CRITEO_INT64_MAX + 1:
                            code = 3
                        else:
                            dense[r, f - 1] = <int64_t>(<uint64_t>0 - acc)
                    elif acc > _CRITEO_INT64_MAX:
                        code = 3
                    else:
                        dense[r, f - 1] = <int64_t>acc
                    p = q
                else:                        # categorical: empty, or 1-16 hex digits of either case
                    k = f - 1 - num_dense
                    acc = 0
                    q = p
                    while q < cend and q - p < 17:
                        c = _criteo_hex[s[q]]
                        if c < 0:
                            break
                        acc = (acc << 4) | <uint64_t>c
                        q += 1
                    if q - p > 16 or (q < cend and s[q] != 9):
                        code = 4
                    elif q == p:
                        ids[r, k] = missing[k]
                    else:
                        ids[r, k] = _criteo_id(_mix64(_mix64(acc) ^ salts[k]))
                    p = q
                if code:                     # a bad field: the field count still decides first
                    if f + _criteo_tabs(s, p, cend) != nf:
                        code = 1
                    break
                if p == cend:
                    if f != nf:
                        code = 1
                    break
                f += 1                       # s[p] is a tab
                p += 1
                if f > nf:
                    code = 1
                    break
            status[l] = code
            if code == 0:
                r += 1
            start = line_end[l]
    return labels_a[:r], dense_a[:r], ids_a[:r], status_a, line_end_a

# =====================================================================================================
# Hash cache
# =====================================================================================================
# HashCache: the compiled kernel of recboost.HashCache (which documents the semantics and checks
# every argument before calling in here); recboost._py_HashCache is its numpy twin, and every result
# and every bit of state_dict() is identical. Open addressing with linear probing over one array of
# 32-byte slots (key, last-seen, count, row: one cache line probe per id), hashed by _mix64 onto any
# number of slots (_home_in: its low bits in a power-of-two map, else its low 32 bits scaled), doubled
# at 0.7 full but a large map never larger than a full table needs (_reserve), software prefetch
# _PREFETCH ids ahead, backward-shift deletion (no tombstones), and a min-heap of freed rows so a new
# id always gets the lowest free row.
cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    typedef struct { int64_t key; int64_t last; int64_t count; int32_t row; int32_t pad; } rb_slot;
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    #if defined(__unix__) || defined(__APPLE__)
    #include <pthread.h>
    #define RB_THREADS 1
    #endif
    typedef struct { rb_slot *s; size_t lo, hi; } rb_span;
    static void *rb_set_empty(void *arg) {
        rb_span *span = (rb_span *)arg;
        for (size_t i = span->lo; i < span->hi; i++) span->s[i].row = -2;
        return NULL;
    }
    /* Slots aligned to 2 MiB and, on Linux, backed by transparent huge pages when the kernel allows:
       random probes into a large table then miss the TLB far less often. Each slot is set empty; from
       64 MiB on, the upper half by a second thread: setting a new map empty is its first touch (the
       kernel zeroes each page, and a VM may have to back it), shared by two cores. Measured on a
       2^25-row table's 1.4 GB map: a whole rebuild of 30.2M entries into new memory took 1.93-3.04 s
       against 2.55-4.90 s on one thread (docs/performance.md); the setting alone was not timed. */
    static inline rb_slot *rb_alloc_raw(size_t n) {
        const size_t huge = (size_t)2 << 20;
        size_t bytes = n * sizeof(rb_slot);
        rb_slot *s;
        if (bytes >= huge) {
            bytes = (bytes + huge - 1) / huge * huge;
            s = (rb_slot *)aligned_alloc(huge, bytes);
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
            if (s) madvise(s, bytes, MADV_HUGEPAGE);
    #endif
        } else {
            s = (rb_slot *)aligned_alloc(64, bytes < 64 ? 64 : (bytes + 63) / 64 * 64);
        }
        return s;
    }
    /* A map's copy (HashCache.entries_copy): from 64 MiB on, the upper half by a second thread, as
       rb_alloc_slots sets a new map empty (a copy into fresh memory is also its first touch). */
    typedef struct { rb_slot *d; const rb_slot *s; size_t lo, hi; } rb_copy_span;
    static void *rb_copy_part(void *arg) {
        rb_copy_span *c = (rb_copy_span *)arg;
        memcpy(c->d + c->lo, c->s + c->lo, (c->hi - c->lo) * sizeof(rb_slot));
        return NULL;
    }
    static inline void rb_copy_slots(rb_slot *d, const rb_slot *s, size_t n) {
        rb_copy_span lower = {d, s, 0, n};
    #ifdef RB_THREADS
        rb_copy_span upper = {d, s, n / 2, n};
        pthread_t helper;
        int beside = n * sizeof(rb_slot) >= ((size_t)64 << 20) && pthread_create(&helper, NULL, rb_copy_part, &upper) == 0;
        if (beside) lower.hi = n / 2;
    #endif
        rb_copy_part(&lower);
    #ifdef RB_THREADS
        if (beside) pthread_join(helper, NULL);
    #endif
    }
    static inline rb_slot *rb_alloc_slots(size_t n) {
        size_t bytes = n * sizeof(rb_slot);
        rb_slot *s = rb_alloc_raw(n);
        if (s) {
            rb_span lower = {s, 0, n};
    #ifdef RB_THREADS
            rb_span upper = {s, n / 2, n};
            pthread_t helper;
            int beside = bytes >= ((size_t)64 << 20) && pthread_create(&helper, NULL, rb_set_empty, &upper) == 0;
            if (beside) lower.hi = n / 2;
    #endif
            rb_set_empty(&lower);
    #ifdef RB_THREADS
            if (beside) pthread_join(helper, NULL);
    #endif
        }
        return s;
    }
    """
    ctypedef struct rb_slot:
        int64_t key
        int64_t last
        int64_t count
        int32_t row
        int32_t pad            # 1: the entry's change is logged since record_changes() (else 0)
    rb_slot *rb_alloc_slots(size_t n) nogil
    rb_slot *rb_alloc_raw(size_t n) nogil
    void rb_copy_slots(rb_slot *d, const rb_slot *s, size_t n) nogil

cdef enum:
    _EMPTY = -2            # slot.row of an empty slot; -1: a candidate (tracked, no row); >= 0: its row
    _WANTS = -3            # ... of a candidate waiting, during a lookup, for a full table's victim row
    _UNFIT = -4            # ... of a candidate that admission by score refused for the rest of a lookup
    _PREFETCH = 64         # ids looked ahead (power of two)
    _RESERVED = 2
    _MAX_CAPACITY = 2147483647
    _CAPPED_FROM = 4194304     # the map's slots from which it grows no larger than a full table needs (128 MB:
    #                            below, the slack costs little and a sparser map looks up faster, its hits
    #                            rarely past the home slot, a branch the CPU then predicts: HashCache._reserve)
    _BUCKET = 32           # rows per eviction bucket (recboost._HASH_BUCKET)
    _LRU = 1               # eviction policies (recboost._HASH_POLICIES: None, "lru", "lfu")
    _LFU = 2
    _SCORE = 3             # ... "score": an entry's count is its score in fixed point (recboost._HASH_SCORE_UNIT)
    _SKETCH_MAX_DEPTH = 16  # recboost._HASH_SKETCH_MAX_DEPTH
    _SKETCH_MAX = 2147483647   # a sketch counter saturates here (int32)


cdef inline int64_t _decayed(int64_t count, int64_t last, int64_t now, int64_t half_life) noexcept nogil:
    """An LFU count as of ``now``: halved once per ``half_life`` elapsed since ``last``."""
    cdef uint64_t periods
    if now <= last:
        return count
    periods = (<uint64_t>now - <uint64_t>last) // <uint64_t>half_life     # unsigned: no overflow at 2**63
    return 0 if periods >= 63 else count >> periods


cdef inline int64_t _home_in(int64_t key, uint64_t nslots) noexcept nogil:
    """The slot where ``key``'s probe starts in a map of ``nslots`` slots: the low bits of ``mix64(key)``
    when ``nslots`` is a power of two, else its low 32 bits scaled to ``nslots`` (``(h32 * nslots) >> 32``:
    a multiply more, which a lookup of hot ids measured at 5-8%), so a map may have any number of slots."""
    cdef uint64_t h = _mix64(<uint64_t>key)
    if nslots & (nslots - 1) == 0:
        return <int64_t>(h & (nslots - 1))
    return <int64_t>((<uint64_t><uint32_t>h * nslots) >> 32)


cdef inline int64_t _slots_for(int64_t entries) noexcept nogil:
    """The map's slots for ``entries`` at load 3/4, rounded up to a multiple of 64 (2 KB)."""
    return max(<int64_t>64, (entries * 4 // 3 + 64) // 64 * 64)


# The compiled copies of the lookup loop (HashCache._lookup_loop), told apart at compile time: with or
# without an eviction policy, with the exact admission counter or the sketch.
ctypedef signed char _NoPolicy
ctypedef short _Policy
ctypedef int _NoPolicySketch
ctypedef long _PolicySketch
ctypedef fused _LoopKind:
    _NoPolicy
    _Policy
    _NoPolicySketch
    _PolicySketch

_POLICIES = (None, "lru", "lfu", "score")      # eviction_policy by code (recboost._HASH_POLICIES)
_POLICY_NAMES = ("none", "lru", "lfu", "score")  # ... as a state_dict holds it: a str numpy stores without pickle
_SCORE_UNIT = 65536    # recboost._HASH_SCORE_UNIT: units of a score point


def _score_units(weight):
    """A score in fixed point (recboost._score_units: the same rounding)."""
    return int(round(float(weight) * _SCORE_UNIT))


# The docstring opens with CPython's text signature ("name(...)", "--"): inspect.signature() of the class.
@cython.auto_pickle(False)
cdef class HashCache:
    """HashCache(capacity, access_threshold=-1, eviction_threshold=-1, grow=False, eviction_policy=None, lfu_half_life=3600, admission_counter='exact', sketch_width=0, sketch_depth=0, sketch_window=0, score_half_life=3600, score_click_weight=1.0, score_nonclick_weight=0.1, admit_score=-1.0)
--

The compiled kernel of ``recboost.HashCache``: ids to rows with admission, eviction and growth.

    ``recboost.HashCache`` (this class with its argument checks in front) documents the semantics
    and is what to use. The kernel takes checked values: ``capacity`` an int in [3, 2**31 - 1], the
    thresholds ints in [-1, 2**62], ``grow`` a bool (False with a policy), ``eviction_policy`` None,
    "lru", "lfu" or "score", ``lfu_half_life`` an int >= 1, ``admission_counter`` "exact" (sizes 0) or "sketch"
    (``sketch_width``, ``sketch_window`` in [1, 2**31 - 1], ``sketch_depth`` in [1, 16]); ``ids``
    C-contiguous int64 arrays of any shape;
    times ints within +-2**62; ``load_state_dict`` a state checked by ``recboost._hash_state_check``.
    Every result and every bit of ``state_dict()`` equals the numpy twin ``recboost._py_HashCache``.
    """
    cdef rb_slot *slots
    cdef int64_t nslots, size, n_rows_owned
    cdef int32_t *heap
    cdef int64_t heap_len, heap_cap
    cdef int64_t *pend
    cdef int64_t pend_cap
    cdef int64_t capacity_, next_row, t_access, t_evict, step_, now_
    cdef bint grow_
    cdef int policy_
    cdef int64_t half_life
    cdef int64_t decay              # the half-life that decays counts: score_half_life with "score", else half_life
    cdef int64_t t_admit            # the counts' admission threshold: t_access, or admit_score in units
    cdef int64_t unit_click, unit_shown     # with "score": what an element labelled 1 / 0 adds to its count
    cdef object score_settings      # (score_half_life, score_click_weight, score_nonclick_weight, admit_score)
    cdef int64_t *row_key           # with a policy, per row: its id, last-seen time and count
    cdef int64_t *row_last
    cdef int64_t *row_count
    cdef int64_t *repl              # (id, row) of each id replaced in the lookup running
    cdef int64_t *want              # the positions of the ids waiting for a victim's row in it
    cdef int64_t repl_cap           # entries of repl (pairs) and want
    cdef object replaced            # arrays of the ids and rows replaced since take_replaced()
    cdef int64_t st_admitted, st_rejected, st_overflowed, st_evicted, st_forgotten, st_grown, st_looked
    cdef int64_t st_replaced
    cdef int32_t *sketch            # with the "sketch" admission counter: depth rows of width counters
    cdef bint sketch_on
    cdef int64_t width, depth, window, pending, st_aged
    cdef uint64_t salts[_SKETCH_MAX_DEPTH]
    cdef int64_t *fresh             # the ids a lookup running started tracking (sketch only)
    cdef int64_t fresh_cap
    cdef bint recording             # after record_changes(): each entry's first change is logged
    cdef int64_t *chg               # the log: per entry changed, its id, whether it existed, row,
    cdef int64_t chg_len, chg_cap   # count and last-seen time before the change (5 int64); records
    cdef int64_t chg_start          # the first record of the lookup running

    def __cinit__(self, *args, **kwargs):
        # a valid empty cache even before (or without) __init__: a Python subclass cannot crash it
        self.slots = NULL
        self.heap = NULL
        self.pend = NULL
        self.pend_cap = 0
        self.row_key = self.row_last = self.row_count = NULL
        self.repl = self.want = NULL
        self.repl_cap = 0
        self.sketch = NULL
        self.sketch_on = False
        self.width = self.depth = self.window = 0
        self.fresh = NULL
        self.fresh_cap = 0
        self.chg = NULL
        self.chg_cap = 0
        self.capacity_ = _RESERVED + 1
        self.t_access = self.t_evict = -1
        self.grow_ = False
        self.policy_ = 0
        self.half_life = 1
        self._set_score(3600, 1.0, 0.1, -1.0)
        self._reset()

    def __dealloc__(self):
        free(self.slots)
        free(self.heap)
        free(self.pend)
        free(self.row_key)
        free(self.row_last)
        free(self.row_count)
        free(self.repl)
        free(self.want)
        free(self.sketch)
        free(self.fresh)
        free(self.chg)

    def __init__(self, capacity, access_threshold=-1, eviction_threshold=-1, grow=False, eviction_policy=None,
                 lfu_half_life=3600, admission_counter="exact", sketch_width=0, sketch_depth=0, sketch_window=0,
                 score_half_life=3600, score_click_weight=1.0, score_nonclick_weight=0.1, admit_score=-1.0):
        self.capacity_ = capacity
        self.t_access = access_threshold
        self.t_evict = eviction_threshold
        self.grow_ = grow
        self.policy_ = _POLICIES.index(eviction_policy)
        self.half_life = lfu_half_life
        self._set_score(score_half_life, score_click_weight, score_nonclick_weight, admit_score)
        self._reset()
        self._alloc_rows()
        self._alloc_sketch(admission_counter, sketch_width, sketch_depth, sketch_window)

    @cython.final
    cdef _set_score(self, half_life, click_weight, nonclick_weight, admit_score):
        """The score policy's settings and what the lookup takes from them (twin of
        ``recboost._py_HashCache._set_score``); policy_, half_life and t_access set first."""
        self.score_settings = (half_life, click_weight, nonclick_weight, admit_score)
        self.decay = half_life if self.policy_ == _SCORE else self.half_life
        self.unit_click = _score_units(click_weight)
        self.unit_shown = _score_units(nonclick_weight)
        if self.policy_ == _SCORE:
            self.t_admit = -1 if admit_score < 0 else int(np.floor(admit_score * _SCORE_UNIT))
        else:
            self.t_admit = self.t_access

    @cython.final
    cdef _reset(self):
        """Empty the map, the free rows and the counters (the configuration stays)."""
        free(self.slots)
        free(self.heap)
        self.slots = NULL
        self.heap = NULL
        self.nslots = 0
        self.size = 0
        self.n_rows_owned = 0
        self.heap_len = 0
        self.heap_cap = 0
        self.next_row = _RESERVED
        self.step_ = 0
        self.now_ = 0
        self.st_admitted = self.st_rejected = self.st_overflowed = self.st_evicted = 0
        self.st_forgotten = self.st_grown = self.st_looked = self.st_replaced = 0
        self.st_aged = self.pending = 0
        self.replaced = []
        self.recording = False
        self.chg_len = 0
        self._rehash(16)

    @cython.final
    cdef _alloc_rows(self):
        """With a policy, the per-row arrays for ``capacity_`` rows (a policy fixes the capacity)."""
        free(self.row_key)
        free(self.row_last)
        free(self.row_count)
        self.row_key = self.row_last = self.row_count = NULL
        if self.policy_ == 0:
            return
        self.row_key = <int64_t *>malloc(self.capacity_ * sizeof(int64_t))
        self.row_last = <int64_t *>malloc(self.capacity_ * sizeof(int64_t))
        self.row_count = <int64_t *>malloc(self.capacity_ * sizeof(int64_t))
        if self.row_key == NULL or self.row_last == NULL or self.row_count == NULL:
            raise MemoryError("HashCache: cannot allocate the eviction policy's rows")

    @cython.final
    cdef _alloc_sketch(self, counter, int64_t width, int64_t depth, int64_t window):
        """The admission counter: with "sketch", ``depth`` rows of ``width`` zero counters and the
        rows' salts ``mix64((d + 1) * golden)``; nothing with "exact"."""
        cdef int64_t d
        free(self.sketch)
        self.sketch = NULL
        self.sketch_on = counter == "sketch"
        self.width, self.depth, self.window = width, depth, window
        if not self.sketch_on:
            return
        self.sketch = <int32_t *>calloc(width * depth, sizeof(int32_t))
        if self.sketch == NULL:
            raise MemoryError("HashCache: cannot allocate the admission sketch")
        for d in range(depth):
            self.salts[d] = _mix64(<uint64_t>(d + 1) * _GOLDEN)

    @cython.final
    cdef inline int64_t _sketch_cell(self, int64_t key, int64_t d) noexcept nogil:
        """Where row ``d`` of the sketch counts ``key``: column ``((h >> 32) * width) >> 32`` of
        ``h = mix64(key ^ salt_d)`` (recboost._sketch_cells)."""
        cdef uint64_t h = _mix64(<uint64_t>key ^ self.salts[d])
        return d * self.width + <int64_t>(((h >> 32) * <uint64_t>self.width) >> 32)

    @cython.final
    cdef inline int64_t _sketch_count(self, int64_t key) noexcept nogil:
        """The sketch's count of ``key``: the least of its counters."""
        cdef int64_t d, c, best = self.sketch[self._sketch_cell(key, 0)]
        for d in range(1, self.depth):
            c = self.sketch[self._sketch_cell(key, d)]
            if c < best:
                best = c
        return best

    @cython.final
    cdef void _sketch_commit(self, int64_t nfresh, int64_t added) noexcept nogil:
        """After a lookup: each id it started tracking that ends it without a row goes back to the
        sketch (its counters raised to at least its count: conservative update, saturating) and is
        no longer tracked; then the sketch ages for ``added`` more counts (every counter halves once
        per ``window`` counts). Twin of ``recboost._py_HashCache._sketch_add``."""
        cdef int64_t i, j, d, cell, k, c, dropped = 0
        cdef int32_t *sk = self.sketch
        for i in range(nfresh):
            j = self._slot_of(self.fresh[i])
            if self.slots[j].row >= 0:
                continue
            c = min(self.slots[j].count, <int64_t>_SKETCH_MAX)
            for d in range(self.depth):
                cell = self._sketch_cell(self.fresh[i], d)
                if sk[cell] < c:
                    sk[cell] = <int32_t>c
            self._delete(j)
            dropped += 1
        if dropped and self.recording:
            self._log_forget_dropped()
        self.pending += added
        if self.pending >= self.window:
            k = self.pending // self.window
            self.pending -= k * self.window
            self.st_aged += k
            d = min(k, 31)
            for i in range(self.width * self.depth):
                sk[i] >>= d

    # ---- the map ---------------------------------------------------------------------------------
    @cython.final
    cdef inline int64_t _home(self, int64_t key) noexcept nogil:
        """The slot where ``key``'s probe starts (``_home_in`` of this map's slots)."""
        return _home_in(key, <uint64_t>self.nslots)

    @cython.final
    cdef inline int64_t _next(self, int64_t j) noexcept nogil:
        """The slot after ``j``, cyclically."""
        j += 1
        return 0 if j == self.nslots else j

    @cython.final
    cdef _rehash(self, int64_t n):
        """Move every entry into a fresh array of ``n`` slots."""
        cdef rb_slot *new = rb_alloc_slots(n) if n <= (<int64_t>1) << 32 else NULL   # (_home: a 32-bit hash, scaled)
        cdef rb_slot *old = self.slots
        cdef int64_t i, j, nold = self.nslots
        if new == NULL:
            raise MemoryError("HashCache: cannot allocate %d slots" % n)
        self.slots, self.nslots = new, n
        for i in range(nold):
            if old[i].row != _EMPTY:
                j = self._home(old[i].key)
                while new[j].row != _EMPTY:
                    j = self._next(j)
                new[j] = old[i]
        free(old)

    @cython.final
    cdef _reserve(self, int64_t extra):
        """Make room for ``extra`` more entries, so no batch rehashes midway: the map doubles until it
        is at most 0.7 full. From ``_CAPPED_FROM`` slots on, while the entries before the batch fit in
        the rows, it grows no larger than a full table needs (``_slots_for(capacity)``, 3/4 full when
        every row is taken), and a map that large takes a batch up to 7/8 full (a full table under an
        eviction policy looks up new ids beyond its rows; each leaves with a victim's row or none)."""
        cdef int64_t need = self.size + extra, n = self.nslots
        if need * 10 <= n * 7:
            return
        while need * 10 > n * 7:
            n *= 2
        if n > _CAPPED_FROM and self.size <= self.capacity_:
            n = min(n, max(_slots_for(self.capacity_), <int64_t>_CAPPED_FROM, (need * 8 // 7 + 64) // 64 * 64))
        if n > self.nslots:
            self._rehash(n)

    # ---- rows: lowest free first -----------------------------------------------------------------
    @cython.final
    cdef int _heap_push(self, int32_t r) except -1:
        cdef int64_t i, p
        cdef int32_t *grown
        if self.heap_len == self.heap_cap:
            self.heap_cap = max(64, 2 * self.heap_cap)
            grown = <int32_t *>realloc(self.heap, self.heap_cap * sizeof(int32_t))
            if grown == NULL:
                raise MemoryError("HashCache: cannot grow the free-row heap")
            self.heap = grown
        i = self.heap_len
        self.heap_len += 1
        while i > 0:
            p = (i - 1) >> 1
            if self.heap[p] <= r:
                break
            self.heap[i] = self.heap[p]
            i = p
        self.heap[i] = r
        return 0

    @cython.final
    cdef inline int32_t _heap_pop(self) noexcept nogil:
        cdef int32_t top = self.heap[0], last
        cdef int64_t i = 0, c, n
        self.heap_len -= 1
        n = self.heap_len
        if n == 0:
            return top
        last = self.heap[n]
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and self.heap[c + 1] < self.heap[c]:
                c += 1
            if self.heap[c] >= last:
                break
            self.heap[i] = self.heap[c]
            i = c
        self.heap[i] = last
        return top

    @cython.final
    cdef inline int32_t _allocate(self) noexcept nogil:
        """The lowest free row, growing the capacity when allowed; -1 when the table is full."""
        if self.heap_len > 0:
            return self._heap_pop()
        if self.next_row >= self.capacity_:
            if not self.grow_ or self.capacity_ >= _MAX_CAPACITY:
                return -1
            self.capacity_ = min(2 * self.capacity_, <int64_t>_MAX_CAPACITY)
            self.st_grown += 1
        self.next_row += 1
        return <int32_t>(self.next_row - 1)

    # ---- lookup ----------------------------------------------------------------------------------
    @cython.final
    cdef int64_t _lookup(self, const int64_t *ids, int64_t n, int64_t now, int64_t max_admit,
                         int32_t *out, const uint8_t *labels) noexcept nogil:
        """The lookup of ``n`` ids into ``out``; returns how many ids it replaced (into ``repl``). The
        loop is compiled four times (the fused type ``_LoopKind``): a table without a policy runs a
        copy with no policy code in it, one with the exact counter a copy with no sketch code."""
        cdef _NoPolicy none = 0
        cdef _Policy some = 0
        cdef _NoPolicySketch none_sketch = 0
        cdef _PolicySketch some_sketch = 0
        if self.sketch_on:
            if self.policy_ == 0:
                return self._lookup_loop(ids, n, now, max_admit, out, labels, none_sketch)
            return self._lookup_loop(ids, n, now, max_admit, out, labels, some_sketch)
        if self.policy_ == 0:
            return self._lookup_loop(ids, n, now, max_admit, out, labels, none)
        return self._lookup_loop(ids, n, now, max_admit, out, labels, some)

    @cython.final
    cdef int64_t _lookup_loop(self, const int64_t *ids, int64_t n, int64_t now, int64_t max_admit,
                              int32_t *out, const uint8_t *labels, _LoopKind kind) noexcept nogil:
        cdef bint policy = _LoopKind is _Policy or _LoopKind is _PolicySketch     # constants of each
        cdef bint sketch = _LoopKind is _NoPolicySketch or _LoopKind is _PolicySketch   # compiled copy
        cdef bint lfu = policy and self.policy_ >= _LFU         # counts decay ("lfu", "score")
        cdef bint scored = policy and self.policy_ == _SCORE    # elements add their label's weight, not 1
        cdef bint recording = self.recording     # (locals: the slots' stores would make the C compiler re-read them)
        cdef uint64_t nslots = <uint64_t>self.nslots
        cdef int64_t last_slot = self.nslots - 1
        cdef int64_t nfresh = 0, missed = self.st_rejected + self.st_overflowed
        cdef rb_slot *slots = self.slots
        cdef rb_slot *s
        cdef uint64_t ring[_PREFETCH]
        cdef uint64_t h
        cdef int64_t i, j, key, npend = 0, t = self.t_admit, nrepl = 0, nwant = 0, before
        cdef bint by_score = scored and t >= 0     # admission on the score before the lookup (see lookup)
        cdef int32_t r
        for i in range(min(n, <int64_t>_PREFETCH)):
            h = <uint64_t>_home_in(ids[i], nslots)
            ring[i] = h
            rb_prefetch(&slots[h])
        for i in range(n):
            j = <int64_t>ring[i & (_PREFETCH - 1)]
            if i + _PREFETCH < n:
                h = <uint64_t>_home_in(ids[i + _PREFETCH], nslots)
                ring[i & (_PREFETCH - 1)] = h
                rb_prefetch(&slots[h])
            key = ids[i]
            while True:
                s = &slots[j]
                if s.row == _EMPTY:
                    s.key = key
                    s.row = -1
                    s.pad = 0
                    if recording:
                        self._log(s, False)
                    self.size += 1
                    if sketch:                # starts at the sketch's count (as of before the batch)
                        s.count = self._sketch_count(key)
                        s.last = now
                        self.fresh[nfresh] = key
                        nfresh += 1
                    else:
                        s.count = 0
                    break
                if s.key == key:
                    if recording and s.pad == 0:
                        self._log(s, True)
                    break
                j = 0 if j == last_slot else j + 1
            if lfu and s.count:
                s.count = _decayed(s.count, s.last, now, self.decay)
            before = s.count
            if not scored:
                s.count += 1
            elif labels != NULL:              # no labels: no score moves
                s.count += self.unit_click if labels[i] else self.unit_shown
            s.last = now
            if s.row >= 0:
                out[i] = s.row
                if policy:
                    self.row_last[s.row] = now
                    self.row_count[s.row] = s.count
                continue
            if by_score and s.row == -1 and before <= t:      # (then the id's first element: its score
                s.row = _UNFIT                                # before the lookup; no row in this lookup)
            if s.count > t and max_admit != 0 and s.row == -1:
                r = self._allocate()
                if r < 0 and policy:          # full: a victim's row after the batch (see _take_victims)
                    s.row = _WANTS
                    self.want[nwant] = i
                    nwant += 1
                if r >= 0:
                    s.row = r
                    self.n_rows_owned += 1
                    self.st_admitted += 1
                    if max_admit > 0:
                        max_admit -= 1
                    out[i] = r
                    if policy:
                        self.row_key[r] = key
                        self.row_last[r] = now
                        self.row_count[r] = s.count
                    continue
            self.pend[2 * npend] = i          # settled after the batch: the id may get a row later
            self.pend[2 * npend + 1] = j
            npend += 1
        if nwant:
            nrepl = self._take_victims(ids, nwant, now, max_admit)
        for i in range(npend):
            if nrepl:                         # deletions moved entries: find each pending id again
                self.pend[2 * i + 1] = self._slot_of(ids[self.pend[2 * i]])
            s = &slots[self.pend[2 * i + 1]]
            if s.row >= 0:
                out[self.pend[2 * i]] = s.row
            else:
                out[self.pend[2 * i]] = 0
                if s.count > t and s.row != _UNFIT:
                    self.st_overflowed += 1
                else:
                    self.st_rejected += 1
        if by_score:
            for i in range(npend):
                s = &slots[self.pend[2 * i + 1]]
                if s.row == _UNFIT:
                    s.row = -1
        self.st_looked += n
        if sketch:
            self._sketch_commit(nfresh, self.st_rejected + self.st_overflowed - missed)
        return nrepl

    @cython.final
    cdef int64_t _take_victims(self, const int64_t *ids, int64_t nwant, int64_t now,
                               int64_t max_admit) noexcept nogil:
        """After a lookup's pass over its ids, a full table's rows for the ids that qualified without
        one (``want``: their first qualifying positions, in order), each from its bucket's victim
        while ``max_admit`` allows (-1: no limit). Every id of the batch holding a row was seen at
        ``now`` by then, so none is a victim. Returns how many ids were replaced; an id left without
        a row is a candidate again."""
        cdef int64_t w, j, key, nrepl = 0
        cdef int32_t r
        for w in range(nwant):
            key = ids[self.want[w]]
            r = self._replace(key, now, nrepl) if max_admit != 0 else -1
            j = self._slot_of(key)               # a victim's deletion may have moved this id
            if r < 0:
                self.slots[j].row = -1
                continue
            nrepl += 1
            self.slots[j].row = r
            self.n_rows_owned += 1
            self.st_admitted += 1
            if max_admit > 0:
                max_admit -= 1
            self.row_key[r] = key
            self.row_last[r] = now
            self.row_count[r] = self.slots[j].count
        return nrepl

    @cython.final
    cdef int32_t _replace(self, int64_t key, int64_t now, int64_t k) noexcept nogil:
        """A full table's row for ``key``: in the bucket of ``_BUCKET`` rows that ``key`` hashes to,
        the row whose id the policy ranks lowest (LRU: seen least recently; LFU: the lowest count
        decayed to ``now``, then least recently; then the lowest row), never an id seen at ``now``.
        That id is forgotten and recorded as replacement ``k``; -1 when every id of the bucket was
        seen at ``now``."""
        cdef int64_t nb = (self.capacity_ - _RESERVED + _BUCKET - 1) // _BUCKET
        cdef int64_t b = <int64_t>(((_mix64(<uint64_t>key) >> 32) * <uint64_t>nb) >> 32)
        cdef int64_t lo = _RESERVED + b * _BUCKET, hi = min(lo + _BUCKET, self.capacity_)
        cdef int64_t r, best = -1, score, best_score = 0, last, best_last = 0
        for r in range(lo, hi):
            last = self.row_last[r]
            if last == now:
                continue
            score = _decayed(self.row_count[r], last, now, self.decay) if self.policy_ != _LRU else last
            if best < 0 or score < best_score or (score == best_score and last < best_last):
                best, best_score, best_last = r, score, last
        if best < 0:
            return -1
        self.repl[2 * k] = self.row_key[best]
        self.repl[2 * k + 1] = best
        cdef int64_t gone = self._slot_of(self.row_key[best])
        if self.recording and self.slots[gone].pad == 0:
            self._log(&self.slots[gone], True)
        self._delete(gone)
        self.n_rows_owned -= 1
        self.st_replaced += 1
        return <int32_t>best

    def lookup(self, ids, timestamp=None, max_admit=-1, labels=None):
        """Rows (int32, shape of ``ids``) of a batch of ids at time ``timestamp`` (None: the step),
        admitting at most ``max_admit`` ids (-1: no limit); ``labels`` (C-contiguous uint8 0/1, one per
        id; "score" only; None: no score moves) make each id add its label's weight instead of 1. With
        ``admit_score`` >= 0 an id gets a row in a lookup only if its score before that lookup (decayed
        to ``timestamp``) exceeds it: no row of the lookup depends on its labels."""
        cdef int64_t now = self.step_ if timestamp is None else timestamp
        cdef int64_t limit = max_admit
        flat = ids.reshape(-1)
        cdef int64_t n = flat.shape[0]
        out = np.empty(n, np.int32)
        if n == 0:
            self.step_ += 1
            self.now_ = now
            return out.reshape(ids.shape)
        cdef const int64_t[::1] k = flat
        cdef int32_t[::1] o = out
        cdef const uint8_t[::1] lab
        cdef const uint8_t *lp = NULL
        if labels is not None and self.policy_ == _SCORE:
            lab = labels
            lp = &lab[0]
        cdef int64_t *p
        self._reserve(n)
        if self.pend_cap < n:
            p = <int64_t *>realloc(self.pend, 2 * n * sizeof(int64_t))
            if p == NULL:
                raise MemoryError("HashCache: cannot allocate the batch buffer")
            self.pend = p
            self.pend_cap = n
        if self.policy_ and self.repl_cap < n:
            p = <int64_t *>realloc(self.repl, 2 * n * sizeof(int64_t))
            if p == NULL:
                raise MemoryError("HashCache: cannot allocate the batch buffer")
            self.repl = p
            p = <int64_t *>realloc(self.want, n * sizeof(int64_t))
            if p == NULL:
                raise MemoryError("HashCache: cannot allocate the batch buffer")
            self.want = p
            self.repl_cap = n
        if self.sketch_on and self.fresh_cap < n:
            p = <int64_t *>realloc(self.fresh, n * sizeof(int64_t))
            if p == NULL:
                raise MemoryError("HashCache: cannot allocate the batch buffer")
            self.fresh = p
            self.fresh_cap = n
        if self.recording:                 # the batch's ids and the victims of its replacements
            self._log_reserve(2 * n)
        self.step_ += 1                    # every allocation succeeded: a failed lookup changes nothing
        self.now_ = now
        cdef int64_t nrepl
        self.chg_start = self.chg_len
        with nogil:
            nrepl = self._lookup(&k[0], n, now, limit, &o[0], lp)
        if nrepl:
            pairs = np.asarray(<int64_t[:2 * nrepl]>self.repl).reshape(nrepl, 2)
            self.replaced.append((pairs[:, 0].copy(), pairs[:, 1].astype(np.int32)))
        return out.reshape(ids.shape)

    def take_replaced(self):
        """``(ids, rows)`` (int64, int32) of the ids that lost their row to a new id since the last
        call, in the order it happened; each call takes them once."""
        found, self.replaced = self.replaced, []
        if not found:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])

    @cython.final
    cdef inline int64_t _slot_of(self, int64_t key) noexcept nogil:
        """The slot tracking ``key``, or -1 when the cache does not track it."""
        cdef int64_t j = self._home(key)
        while self.slots[j].row != _EMPTY:
            if self.slots[j].key == key:
                return j
            j = self._next(j)
        return -1

    def counts(self, ids):
        """How often each of ``ids`` has been looked up since it was last forgotten (int64, shape of
        ``ids``; 0 for an id the cache does not track; with the sketch, its count of an id without a
        row). Changes nothing."""
        return self._read(ids, True)

    def find(self, ids):
        """Rows of ``ids`` without counting or admitting anything (row 0 for ids without a row)."""
        return self._read(ids, False)

    @cython.final
    cdef _read(self, ids, bint counts):
        """Each of ``ids``'s count (int64, 0 when not tracked) or row (int32, 0 without one)."""
        flat = ids.reshape(-1)
        cdef int64_t n = flat.shape[0], i, j
        out = np.zeros(n, np.int64 if counts else np.int32)
        if n == 0:
            return out.reshape(ids.shape)
        cdef const int64_t[::1] k = flat
        cdef int64_t[::1] c
        cdef int32_t[::1] r
        if counts:
            c = out
        else:
            r = out
        with nogil:
            for i in range(n):
                j = self._slot_of(k[i])
                if j < 0:
                    if counts and self.sketch_on:
                        c[i] = self._sketch_count(k[i])
                    continue
                if counts:
                    c[i] = self.slots[j].count
                elif self.slots[j].row >= 0:
                    r[i] = self.slots[j].row
        return out.reshape(ids.shape)

    # ---- the change record (an incremental checkpoint's entries) -----------------------------------
    @cython.final
    cdef int _log_reserve(self, int64_t extra) except -1:
        """Room in the change log for ``extra`` more records."""
        cdef int64_t cap = self.chg_len + extra
        cdef int64_t *p
        if cap <= self.chg_cap:
            return 0
        cap = max(cap, 2 * self.chg_cap, 1024)
        p = <int64_t *>realloc(self.chg, 5 * cap * sizeof(int64_t))
        if p == NULL:
            raise MemoryError("HashCache: cannot grow the change record")
        self.chg = p
        self.chg_cap = cap
        return 0

    @cython.final
    cdef inline void _log(self, rb_slot *s, bint existed) noexcept nogil:
        """Log the entry of slot ``s`` as it is before its first change since ``record_changes()``
        (``existed`` False: a new entry, logged as zeros) and flag the slot."""
        cdef int64_t *c = self.chg + 5 * self.chg_len
        c[0] = s.key
        c[1] = existed
        c[2] = s.row if existed else 0
        c[3] = s.count if existed else 0
        c[4] = s.last if existed else 0
        s.pad = 1
        self.chg_len += 1

    @cython.final
    cdef void _log_forget_dropped(self) noexcept nogil:
        """Drop the records the lookup running made of new entries it no longer tracks (ids the sketch
        took back): nothing of the state changed for them, and a stream of such ids would grow the
        log at every lookup."""
        cdef int64_t i, n = self.chg_start
        cdef int64_t *c
        for i in range(self.chg_start, self.chg_len):
            c = self.chg + 5 * i
            if c[1] == 0 and self._slot_of(c[0]) < 0:
                continue
            if n != i:
                memcpy(self.chg + 5 * n, c, 5 * sizeof(int64_t))
            n += 1
        self.chg_len = n

    def record_changes(self):
        """Record from now on which entries change (``changes()``): the record starts empty."""
        cdef int64_t i, j
        if self.recording:
            for i in range(self.chg_len):
                j = self._slot_of(self.chg[5 * i])
                if j >= 0:
                    self.slots[j].pad = 0
        self.chg_len = 0
        self.recording = True

    def changes(self):
        """None when no record runs (none started, or a load since); else the entries changed since
        ``record_changes()`` as they were then: a dict of ``keys`` (the ids looked up, evicted or
        replaced since, sorted, int64; not those a lookup started and ended without tracking), ``existed`` (bool: tracked then), ``rows`` (int32), ``counts``
        and ``last_seen`` (int64; 0 where not tracked then)."""
        if not self.recording:
            return None
        log = (np.asarray(<int64_t[:5 * self.chg_len]>self.chg).reshape(-1, 5) if self.chg_len
               else np.empty((0, 5), np.int64))
        keys, first = np.unique(log[:, 0], return_index=True)       # an id's first record: as it was
        rec = log[first]
        return {"keys": keys, "existed": rec[:, 1] != 0, "rows": rec[:, 2].astype(np.int32),
                "counts": rec[:, 3].copy(), "last_seen": rec[:, 4].copy()}

    def entries(self, ids):
        """``(tracked, rows, counts, last_seen)`` of each of ``ids`` now (bool, int32, int64, int64 1-d;
        zeros where not tracked). Changes nothing."""
        flat = np.ascontiguousarray(ids.reshape(-1))
        cdef int64_t n = flat.shape[0]
        tracked = np.zeros(n, np.uint8)
        rows = np.zeros(n, np.int32)
        counts = np.zeros(n, np.int64)
        last = np.zeros(n, np.int64)
        if n == 0:
            return tracked.view(np.bool_), rows, counts, last
        cdef const int64_t[::1] k = flat
        cdef uint8_t[::1] t = tracked
        cdef int32_t[::1] r = rows
        cdef int64_t[::1] c = counts, l = last
        with nogil:
            self._fields_of_keys(k, t, r, c, l)
        return tracked.view(np.bool_), rows, counts, last

    # ---- eviction --------------------------------------------------------------------------------
    @cython.final
    cdef void _delete(self, int64_t hole) noexcept nogil:
        """Empty slot ``hole`` and shift later members of its cluster back (Knuth's algorithm R)."""
        cdef int64_t j = hole, home
        while True:
            j = self._next(j)
            if self.slots[j].row == _EMPTY:
                break
            home = self._home(self.slots[j].key)
            # slot j may move to the hole unless its home lies cyclically in (hole, j]
            if (hole <= j and (home <= hole or home > j)) or (hole > j and home <= hole and home > j):
                self.slots[hole] = self.slots[j]
                hole = j
        self.slots[hole].row = _EMPTY
        self.size -= 1

    def evict(self, now=None):
        """Forget ids with ``now - last_seen > eviction_threshold``; ``(freed_ids, freed_rows)`` by row."""
        cdef int64_t t_now = self.now_ if now is None else now
        if self.t_evict < 0:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        cdef int64_t start = 0, c, i, nfree = 0, ngone = 0
        cdef int64_t oldest = t_now - self.t_evict    # now - last > threshold as last < oldest: no overflow
        freed_ids = np.empty(self.n_rows_owned, np.int64)
        freed_rows = np.empty(self.n_rows_owned, np.int32)
        cdef int64_t[::1] fi = freed_ids
        cdef int32_t[::1] fr = freed_rows
        while self.slots[start].row != _EMPTY:        # start after an empty slot: no cluster wraps
            start += 1
        if self.recording:
            self._log_reserve(self.size)
        with nogil:
            for c in range(1, self.nslots + 1):
                i = start + c - (self.nslots if start + c >= self.nslots else 0)
                while self.slots[i].row != _EMPTY and self.slots[i].last < oldest:
                    if self.recording and self.slots[i].pad == 0:
                        self._log(&self.slots[i], True)
                    if self.slots[i].row >= 0:
                        fi[nfree] = self.slots[i].key
                        fr[nfree] = self.slots[i].row
                        nfree += 1
                    ngone += 1
                    self._delete(i)
        order = np.argsort(freed_rows[:nfree], kind="stable")
        freed_ids = freed_ids[:nfree][order]
        freed_rows = freed_rows[:nfree][order]
        for i in range(nfree):
            self._heap_push(freed_rows[i])
        self.n_rows_owned -= nfree
        self.st_evicted += nfree
        self.st_forgotten += ngone - nfree
        return freed_ids, freed_rows

    # ---- views and state -------------------------------------------------------------------------
    @property
    def capacity(self):
        """Rows of the table (grows with ``grow``)."""
        return self.capacity_

    @property
    def access_threshold(self):
        """Admission: an id gets a row once its count exceeds this (-1: at its first sighting)."""
        return self.t_access

    @property
    def eviction_threshold(self):
        """``evict`` forgets ids unseen for longer than this (-1: never)."""
        return self.t_evict

    @property
    def grow(self):
        """Whether the capacity doubles when a row is needed and none is free."""
        return bool(self.grow_)

    @property
    def eviction_policy(self):
        """Which id a full table replaces for a new one: None (none: the new id overflows), "lru", "lfu"."""
        return _POLICIES[self.policy_]

    @property
    def lfu_half_life(self):
        """With "lfu": the time over which an unseen id's count halves."""
        return self.half_life

    @property
    def score_half_life(self):
        """With "score": the time over which an unseen id's score halves."""
        return self.score_settings[0]

    @property
    def score_click_weight(self):
        """With "score": what a shown element labelled 1 adds to its id's score."""
        return self.score_settings[1]

    @property
    def score_nonclick_weight(self):
        """With "score": what a shown element labelled 0 adds to its id's score."""
        return self.score_settings[2]

    @property
    def admit_score(self):
        """With "score": an id gets a row at its first lookup that starts with its score above this
        (-1: off, a row at first sight)."""
        return self.score_settings[3]

    @property
    def admission_counter(self):
        """Where ids without a row are counted: "exact" (an entry each) or "sketch" (a count-min sketch of fixed size)."""
        return "sketch" if self.sketch_on else "exact"

    @property
    def sketch_width(self):
        """Counters per row of the sketch (0: exact counter)."""
        return self.width

    @property
    def sketch_depth(self):
        """Rows of the sketch (0: exact counter)."""
        return self.depth

    @property
    def sketch_window(self):
        """The sketch halves every counter after this many counts (0: exact counter)."""
        return self.window

    @property
    def step(self):
        """Number of lookups so far."""
        return self.step_

    @property
    def now(self):
        """Time of the last lookup (timestamp or step)."""
        return self.now_

    def __len__(self):
        """Ids that own a row."""
        return self.n_rows_owned

    @cython.final
    cdef dict _totals(self):
        """The running totals, in ``recboost._HASH_STAT_NAMES`` order (``stats`` and ``state_dict``)."""
        return {"admitted": self.st_admitted, "rejected": self.st_rejected, "overflowed": self.st_overflowed,
                "evicted": self.st_evicted, "forgotten": self.st_forgotten, "grown": self.st_grown,
                "looked_up": self.st_looked, "replaced": self.st_replaced, "aged": self.st_aged}

    def stats(self):
        """Counters: ids ``size`` (own a row), ``candidates`` (tracked, no row; always 0 with the
        sketch), ``capacity``, ``sketch_bytes`` (the sketch's counters, 0 without), and the totals
        ``admitted``, ``rejected``, ``overflowed`` (batch elements sent to the default row),
        ``evicted`` (ids that lost a row), ``forgotten`` (candidates dropped by evict), ``grown``,
        ``looked_up`` (batch elements), ``replaced`` (ids a full table's policy took a row from),
        ``aged`` (halvings of the sketch)."""
        out = {"size": self.n_rows_owned, "candidates": self.size - self.n_rows_owned,
               "capacity": self.capacity_, "sketch_bytes": 4 * self.width * self.depth}
        out.update(self._totals())
        return out

    def state_dict(self, entries=True):
        """All state as a dict of numpy arrays, ints and strs (entries sorted by id; the eviction policy
        as "none", "lru" or "lfu"). ``entries`` False: the entries' four arrays are empty (an
        incremental checkpoint's delta takes them from ``changes()``: no pass over every entry)."""
        if not entries:
            return self._state(np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64),
                               np.empty(0, np.int64))
        keys = self.keys()
        _, rows, counts, last = self.entries(keys)
        return self._state(keys, rows, counts, last)

    def entries_copy(self, HashCache into=None):
        """A copy of the map of entries (ids, rows, counts, last-seen times): a cache of the same class
        that is only read (``stats()``' ``size`` and ``candidates``, :meth:`keys`,
        :meth:`keys_between`, :meth:`sample_keys`, :meth:`entries`), where a checkpoint written in the
        background reads the entries of its step while lookups go on here. One copy of the map (32 bytes
        a slot) into new memory (MemoryError when it cannot be allocated), or into ``into``'s, a copy
        made before whose map has as many slots (memory the process has written before: a copy into
        fresh memory costs its page faults, several times the copy). Returns the copy (``into`` when
        reused). Twin: ``recboost._py_HashCache.entries_copy``."""
        cdef HashCache out
        cdef rb_slot *slots
        if into is not None and type(into) is type(self) and into.nslots == self.nslots and into is not self:
            out, slots = into, into.slots
        else:
            out = type(self).__new__(type(self))
            slots = rb_alloc_raw(self.nslots)
            if slots == NULL:
                raise MemoryError("recboost: no memory for a copy of a hash table's map of %d slots" % self.nslots)
            free(out.slots)
        with nogil:
            rb_copy_slots(slots, self.slots, self.nslots)
        out.slots, out.nslots, out.size, out.n_rows_owned = slots, self.nslots, self.size, self.n_rows_owned
        out.capacity_ = self.capacity_
        return out

    def keys(self):
        """The id of every entry (those with a row and the candidates), sorted: a new int64 array, 8
        bytes an entry. (``state_dict``'s ``keys``; a checkpoint looks up the entries' other fields
        from it a chunk at a time, :meth:`entries`.)"""
        # (keys_between sorts with numpy's vectorised sort of the distinct ids: any sort gives the one
        # order, where an argsort of 10^8 ids took ~10x as long)
        keys = np.empty(self.size, np.int64)
        self.keys_between(-0x8000000000000000, 0x7FFFFFFFFFFFFFFF, keys)
        return keys

    def keys_between(self, int64_t low, int64_t high, int64_t[::1] out):
        """The ids ``low <= id <= high`` of the entries, sorted, into ``out``; returns how many there
        are (``out`` past them is scratch). When more than ``out`` holds, ``out`` holds some of them,
        unsorted: call again with a larger one. One pass over the map, for a checkpoint that writes
        the ids sorted a range at a time (``recboost._sorted_key_ranges``), never all of them at once."""
        cdef int64_t i, n = 0, cap = out.shape[0], key
        with nogil:
            for i in range(self.nslots):     # no branch on the slot: whether it is taken is a coin flip the
                key = self.slots[i].key      # CPU cannot predict. Every slot's key goes to out[n], and n
                if n < cap:                  # moves on past it when taken (so out[n] itself is scratch)
                    out[n] = key
                n += (self.slots[i].row != _EMPTY) & (key >= low) & (key <= high)
        if n <= cap:
            np.asarray(out)[:n].sort()
        return n

    def sample_keys(self, int64_t n):
        """The ids of at most ``n`` entries spread evenly over the map's slots (so, over the ids at
        random: a slot is an id's hash), unsorted; ``n`` >= 1. Where a checkpoint splits the ids into
        ranges of about equal size (``recboost._sorted_key_ranges``)."""
        out = np.empty(min(max(n, 1), self.size), np.int64)
        cdef int64_t[::1] o = out
        cdef int64_t j, i, end, m = o.shape[0], got = 0
        with nogil:
            for j in range(m):
                i, end = j * self.nslots // m, (j + 1) * self.nslots // m
                while i < end and self.slots[i].row == _EMPTY:
                    i += 1
                if i < end:
                    o[got] = self.slots[i].key
                    got += 1
        return out[:got]

    @cython.final
    cdef dict _state(self, keys, rows, counts, last):
        """``state_dict()`` with the entries' arrays given."""
        free_rows = np.sort(np.asarray(<int32_t[:self.heap_len]>self.heap) if self.heap_len else
                            np.empty(0, np.int32)).astype(np.int32)
        state = {"keys": keys, "rows": rows, "counts": counts,
                 "last_seen": last, "free_rows": free_rows, "next_row": self.next_row,
                 "capacity": self.capacity_, "step": self.step_, "now": self.now_,
                 "access_threshold": self.t_access, "eviction_threshold": self.t_evict,
                 "grow": bool(self.grow_), "eviction_policy": _POLICY_NAMES[self.policy_],
                 "lfu_half_life": self.half_life, "admission_counter": self.admission_counter,
                 "sketch_width": self.width, "sketch_depth": self.depth, "sketch_window": self.window,
                 "sketch_pending": self.pending, "score_half_life": self.score_settings[0],
                 "score_click_weight": self.score_settings[1], "score_nonclick_weight": self.score_settings[2],
                 "admit_score": self.score_settings[3],
                 "sketch": np.asarray(<int32_t[:self.width * self.depth]>self.sketch).copy() if self.sketch_on
                 else np.empty(0, np.int32)}
        state.update(self._totals())
        return state

    cdef void _fields_of_keys(self, const int64_t[::1] keys, uint8_t[::1] tracked, int32_t[::1] rows,
                              int64_t[::1] counts, int64_t[::1] last) noexcept nogil:
        """Whether each of ``keys`` is tracked, and the row, count and last-seen time of those that are
        (the outputs zeroed by the caller), the home slot of the id ``_PREFETCH`` ahead prefetched."""
        cdef int64_t i, j, n = keys.shape[0]
        for i in range(min(n, <int64_t>_PREFETCH)):
            rb_prefetch_read(&self.slots[self._home(keys[i])])
        for i in range(n):
            if i + _PREFETCH < n:
                rb_prefetch_read(&self.slots[self._home(keys[i + _PREFETCH])])
            j = self._slot_of(keys[i])
            if j >= 0:
                tracked[i] = 1
                rows[i] = self.slots[j].row
                counts[i] = self.slots[j].count
                last[i] = self.slots[j].last

    def load_state_dict(self, state):
        """Restore ``state`` (checked by ``recboost._hash_state_check``) exactly, its capacity too."""
        self._reset()
        self.capacity_ = state["capacity"]
        self.t_access = state["access_threshold"]
        self.t_evict = state["eviction_threshold"]
        self.grow_ = state["grow"]
        self.policy_ = _POLICIES.index(state["eviction_policy"])
        self.half_life = state["lfu_half_life"]
        self._set_score(state["score_half_life"], state["score_click_weight"], state["score_nonclick_weight"],
                        state["admit_score"])
        self._alloc_rows()
        self._alloc_sketch(state["admission_counter"], state["sketch_width"], state["sketch_depth"],
                           state["sketch_window"])
        cdef const int32_t[::1] sk = state["sketch"]
        if self.sketch_on:
            memcpy(self.sketch, &sk[0], self.width * self.depth * sizeof(int32_t))
        self.pending = state["sketch_pending"]
        cdef const int64_t[::1] kk = state["keys"], cc = state["counts"], ll = state["last_seen"]
        cdef const int32_t[::1] rr = state["rows"]
        cdef const int32_t[::1] fr = state["free_rows"]
        cdef int64_t i, j, n = kk.shape[0]
        self._reserve(n)
        for i in range(min(n, <int64_t>_PREFETCH)):
            rb_prefetch(&self.slots[self._home(kk[i])])
        for i in range(n):
            if i + _PREFETCH < n:          # the slot of the id _PREFETCH ahead: its cache miss overlaps these
                rb_prefetch(&self.slots[self._home(kk[i + _PREFETCH])])
            j = self._home(kk[i])
            while self.slots[j].row != _EMPTY:
                j = self._next(j)
            self.slots[j].key = kk[i]
            self.slots[j].row = rr[i]
            self.slots[j].count = cc[i]
            self.slots[j].last = ll[i]
            self.slots[j].pad = 0
            if rr[i] >= 0:
                self.n_rows_owned += 1
                if self.policy_:
                    self.row_key[rr[i]] = kk[i]
                    self.row_last[rr[i]] = ll[i]
                    self.row_count[rr[i]] = cc[i]
        self.size = n
        for i in range(fr.shape[0]):        # ascending: already a valid min-heap
            self._heap_push(fr[i])
        self.next_row = state["next_row"]
        self.step_ = state["step"]
        self.now_ = state["now"]
        self.st_admitted, self.st_rejected = state["admitted"], state["rejected"]
        self.st_overflowed, self.st_evicted = state["overflowed"], state["evicted"]
        self.st_forgotten, self.st_grown = state["forgotten"], state["grown"]
        self.st_looked = state["looked_up"]
        self.st_replaced = state["replaced"]
        self.st_aged = state["aged"]

# =====================================================================================================
# Gradient freeze
# =====================================================================================================
# freeze_index_sequence; the twin is recboost._py_freeze_index_sequence.


def freeze_index_sequence(int groups, int strategy, double freeze_p, long long total_steps,
                          unsigned long long seed):
    """Per-step freeze index (0 = train every group, i = train groups i.. only) as int32.

    Strategy 0 is MindSpore's repeated pattern ``[0]*z + [1..groups-1]`` (exactly its sequence);
    strategy 1 places frozen steps where MindSpore does (deterministic) and draws each frozen index
    ``i`` with probability ``(groups - i) / sum(1..groups-1)``: draw d (d = 1, 2, ...) is the top 32
    bits of ``mix64(seed + (d + 1) * golden)`` (splitmix64's output d + 1 from ``seed``) scaled to
    ``[0, sum)``, so ``groups`` must stay below 2**16.
    """
    cdef long long total = int(total_steps * 1.01)
    cdef long long n, i, j, zero_cnt, freeze_cnt, period
    cdef uint64_t s, u
    cdef int32_t[::1] pos
    cdef uint64_t[::1] tri
    cdef int32_t[::1] table
    cdef object table_arr
    cdef bint use_table
    cdef object pos_arr, tri_arr
    cdef object out
    cdef int32_t[::1] ov
    cdef double keep = 1.0 - freeze_p
    cdef int k
    cdef object py_p
    cdef double t
    cdef bint frozen
    if groups <= 1:
        return np.zeros(total, dtype=np.int32)
    if strategy == 0:
        py_p = float(freeze_p)      # Python float semantics for '//', as MindSpore computes it
        zero_cnt = int(py_p * (groups - 1) // (1 - py_p) + 0.5)
        period = zero_cnt + groups - 1
        n = ((total + period - 1) // period) * period
        out = np.empty(n, dtype=np.int32)
        ov = out
        with nogil:
            for i in range(period):
                ov[i] = 0 if i < zero_cnt else <int32_t>(i - zero_cnt + 1)
            j = period
            while j < n:            # doubling copies of the first period
                i = j if 2 * j <= n else n - j
                memcpy(&ov[j], &ov[0], i * sizeof(int32_t))
                j += i
        return out
    if strategy == 1:
        n = max(total, 1)
        out = np.zeros(n, dtype=np.int32)
        ov = out
        # at most ceil(keep * n) + 1 frozen steps: a small position buffer
        pos_arr = np.empty(min(n, <long long>(keep * n) + 2), dtype=np.int32)
        pos = pos_arr
        tri_arr = np.empty(groups, dtype=np.uint64)
        tri = tri_arr
        for k in range(groups - 1):
            tri[k] = (<uint64_t>(k + 1) * <uint64_t>(k + 2)) // 2
        s = tri[groups - 2]                 # sum(1 .. groups-1)
        use_table = s <= 4096               # u -> index lookup table for the usual small group counts
        table_arr = np.empty(s if use_table else 1, dtype=np.int32)
        table = table_arr
        if use_table:
            k = 0
            for j in range(<long long>s):
                while <uint64_t>j >= tri[k]:
                    k += 1
                table[j] = groups - 1 - k
        with nogil:
            # pass 1: where MindSpore freezes (branch-free except for too-close-to-call ratios)
            zero_cnt = 1
            freeze_cnt = 0
            for i in range(1, total):
                # MindSpore's test is ``freeze_cnt / (zero_cnt + freeze_cnt) < 1 - freeze_p`` in
                # doubles; decide it by a multiplication unless too close to call, then divide.
                t = keep * <double>(zero_cnt + freeze_cnt)
                frozen = <double>freeze_cnt < t * (1.0 - 1e-9)
                if not frozen and <double>freeze_cnt <= t * (1.0 + 1e-9):
                    frozen = (<double>freeze_cnt) / (<double>(zero_cnt + freeze_cnt)) < keep
                pos[freeze_cnt] = <int32_t>i
                freeze_cnt += frozen
                zero_cnt += 1 - frozen
            # pass 2: the frozen index of each frozen step, P(index = groups-1-k) = (k+1)/s
            for j in range(freeze_cnt):
                u = ((_mix64(<uint64_t>seed + <uint64_t>(j + 2) * _GOLDEN) >> 32) * s) >> 32   # draw j + 1
                if use_table:
                    ov[pos[j]] = table[u]
                else:
                    k = 0
                    for i in range(groups - 1):
                        k += u >= tri[i]
                    ov[pos[j]] = groups - 1 - k
        return out
    raise ValueError("unsupported freeze strategy %r" % strategy)


# =====================================================================================================
# PCA
# =====================================================================================================

ctypedef fused _pca_src_t:
    float
    double


@cython.boundscheck(False)
@cython.wraparound(False)
def pca_rows_copy(const _pca_src_t[:, ::1] src, long long row_start, float[:, ::1] out):
    """Copy rows ``row_start : row_start + out.shape[0]`` of ``src`` into float32 ``out``.

    Rows past the end of ``src`` are zero (the last rank's padding). ``src`` is typically a
    read-only memory map of the full PCA matrix; only the touched rows are read.
    """
    cdef Py_ssize_t rows = out.shape[0], cols = out.shape[1], i, j, r
    if src.shape[1] != cols:
        raise ValueError("column mismatch: %d != %d" % (src.shape[1], cols))
    with nogil:
        for i in range(rows):
            r = row_start + i
            if r < 0 or r >= src.shape[0]:
                for j in range(cols):
                    out[i, j] = 0
                continue
            if _pca_src_t is float:
                if cols > 0:
                    memcpy(&out[i, 0], &src[r, 0], cols * sizeof(float))
            else:
                for j in range(cols):
                    out[i, j] = <float>src[r, j]
    return out


# =====================================================================================================
# Host tables: gather, bag pooling, grouping by row, fused sparse optimizers, id-keyed initial rows
# =====================================================================================================
# Twins: recboost._py_gather_rows, _py_gather_pool, _py_gather_max, _py_unique_inverse,
# _py_sparse_*_update, _py_init_rows. The float arithmetic is float32 in the twins' operation order
# (setup.py builds with -ffp-contract=off, so no fused multiply-add changes a rounding), which makes
# both backends agree bit for bit. Bags (multi-hot pooling): ``offsets`` (int64, nb+1 entries, 0 ..
# number of positions, non-decreasing) splits the positions into nb bags, bag b being positions
# offsets[b] .. offsets[b+1]-1;
# ``scale`` (float32, one per bag) weights each bag (1 for sum, 1/n for mean, 1/sqrt(n) for sqrtn);
# ``weights`` (float32, one per position; weighted ids) weights each position (``gather_pool``,
# ``gather_max``, and their backward in ``_sum_by_row``, which every fused update sums with).
cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    /* Row updates of the fused sparse optimizers, with restrict pointers so the compiler vectorizes
       them (SIMD sqrt and division round exactly like the scalar ones: the bits do not change), and,
       with GCC on x86-64, an AVX2 clone picked at load time where the CPU has it. */
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    #define RB_SIMD __attribute__((target_clones("avx2", "default"))) static
    #else
    #define RB_SIMD static inline
    #endif
    RB_SIMD void rb_sum_rows(float *restrict acc, const float *restrict g, const int32_t *restrict inv,
                             long n, long d) {     /* acc[inv[i]] += g[i], i in order */
        for (long i = 0; i < n; i++) {
            float *restrict a = acc + (long)inv[i] * d;
            const float *restrict x = g + i * d;
            for (long j = 0; j < d; j++) a[j] = a[j] + x[j];
        }
    }
    RB_SIMD void rb_sum_bags(float *restrict acc, const float *restrict g, const float *restrict scale,
                             const int32_t *restrict inv, const int64_t *restrict off, long nb, long d) {
        /* acc[inv[p]] += g[b] * scale[b] for p in off[b] .. off[b+1]-1, bags and positions in order */
        for (long b = 0; b < nb; b++) {
            const float *restrict x = g + b * d;
            const float s = scale[b];
            for (long p = off[b]; p < off[b + 1]; p++) {
                float *restrict a = acc + (long)inv[p] * d;
                for (long j = 0; j < d; j++) a[j] = a[j] + x[j] * s;
            }
        }
    }
    RB_SIMD void rb_sum_bags_w(float *restrict acc, const float *restrict g, const float *restrict scale,
                               const float *restrict w, const int32_t *restrict inv, const int64_t *restrict off,
                               long nb, long d) {
        /* weighted ids: acc[inv[p]] += (g[b] * scale[b]) * w[p] for p in off[b] .. off[b+1]-1, bags and
           positions in order (the products in that order) */
        for (long b = 0; b < nb; b++) {
            const float *restrict x = g + b * d;
            const float s = scale[b];
            for (long p = off[b]; p < off[b + 1]; p++) {
                float *restrict a = acc + (long)inv[p] * d;
                const float wp = w[p];
                for (long j = 0; j < d; j++) a[j] = a[j] + (x[j] * s) * wp;
            }
        }
    }
    static void rb_sum_argmax(float *acc, const float *g, const float *scale, const float *w,
                              const int64_t *am, const int32_t *inv, long nb, long d) {
        /* max pooling: value j of bag b goes to its arg-max position p = am[b, j] alone (none when -1):
           acc[inv[p], j] += g[b, j] * scale[b], times w[p] when w is not NULL; bags, then values, in
           order. (The positions that are not the arg-max would add +0.0, which leaves every sum as it
           is: a sum that starts at +0.0 is never -0.0.) */
        for (long b = 0; b < nb; b++) {
            const float s = scale[b];
            for (long j = 0; j < d; j++) {
                const int64_t p = am[b * d + j];
                if (p < 0) continue;
                float x = g[b * d + j] * s;
                if (w) x = x * w[p];
                float *a = acc + (long)inv[p] * d + j;
                *a = *a + x;
            }
        }
    }
    RB_SIMD void rb_pool_rows(float *restrict out, const float *restrict t, const int32_t *restrict rows,
                              const int64_t *restrict off, const float *restrict scale, long nb, long d,
                              long ahead) {
        /* out[b] = (0 + t[rows[p]] + ..., p in off[b] .. off[b+1]-1 in order) * scale[b] */
        const long n = off[nb];
        for (long b = 0; b < nb; b++) {
            float *restrict o = out + b * d;
            for (long j = 0; j < d; j++) o[j] = 0.0f;
            for (long p = off[b]; p < off[b + 1]; p++) {
                if (p + ahead < n) rb_prefetch_span_read(t + (long)rows[p + ahead] * d, d * (long)sizeof(float));
                const float *restrict x = t + (long)rows[p] * d;
                for (long j = 0; j < d; j++) o[j] = o[j] + x[j];
            }
            for (long j = 0; j < d; j++) o[j] = o[j] * scale[b];
        }
    }
    RB_SIMD void rb_pool_rows_w(float *restrict out, const float *restrict t, const int32_t *restrict rows,
                                const int64_t *restrict off, const float *restrict scale,
                                const float *restrict w, long nb, long d, long ahead) {
        /* out[b] = (0 + t[rows[p]] * w[p] + ..., p in off[b] .. off[b+1]-1 in order) * scale[b] */
        const long n = off[nb];
        for (long b = 0; b < nb; b++) {
            float *restrict o = out + b * d;
            for (long j = 0; j < d; j++) o[j] = 0.0f;
            for (long p = off[b]; p < off[b + 1]; p++) {
                if (p + ahead < n) rb_prefetch_span_read(t + (long)rows[p + ahead] * d, d * (long)sizeof(float));
                const float *restrict x = t + (long)rows[p] * d;
                const float wp = w[p];
                for (long j = 0; j < d; j++) o[j] = o[j] + x[j] * wp;
            }
            for (long j = 0; j < d; j++) o[j] = o[j] * scale[b];
        }
    }
    RB_SIMD void rb_sgd_row(float *restrict w, const float *restrict g, long d, float lr) {
        for (long j = 0; j < d; j++) w[j] = w[j] - lr * g[j];
    }
    RB_SIMD void rb_adagrad_row(float *restrict w, float *restrict a, const float *restrict g, long d,
                                      float lr) {
        for (long j = 0; j < d; j++) { a[j] = a[j] + g[j] * g[j]; w[j] = w[j] - (lr * g[j]) / sqrtf(a[j]); }
    }
    RB_SIMD void rb_rowwise_adagrad_row(float *restrict w, float *restrict a, const float *restrict g, long d,
                                        float lr, float eps) {
        /* one accumulator per row: a += (g[0]*g[0] + g[1]*g[1] + ..., in order) / d; w -= r * g with
           r = lr / (sqrt(a) + eps) */
        float s = 0.0f;
        for (long j = 0; j < d; j++) s = s + g[j] * g[j];
        const float acc = a[0] + s / (float)d;
        a[0] = acc;
        const float r = lr / (sqrtf(acc) + eps);
        for (long j = 0; j < d; j++) w[j] = w[j] - r * g[j];
    }
    RB_SIMD void rb_adam_row(float *restrict w, float *restrict m, float *restrict v,
                                   const float *restrict g, long d, float lr_t, float b1, float b2, float c1,
                                   float c2, float eps) {
        for (long j = 0; j < d; j++) {
            float m1 = b1 * m[j] + c1 * g[j];
            float v1 = b2 * v[j] + c2 * (g[j] * g[j]);
            m[j] = m1; v[j] = v1;
            w[j] = w[j] - lr_t * (m1 / (sqrtf(v1) + eps));
        }
    }
    """
    void rb_sum_rows(float *acc, const float *g, const int32_t *inv, long n, long d) nogil
    void rb_sum_bags(float *acc, const float *g, const float *scale, const int32_t *inv, const int64_t *off,
                     long nb, long d) nogil
    void rb_sum_bags_w(float *acc, const float *g, const float *scale, const float *w, const int32_t *inv,
                       const int64_t *off, long nb, long d) nogil
    void rb_sum_argmax(float *acc, const float *g, const float *scale, const float *w, const int64_t *am,
                       const int32_t *inv, long nb, long d) nogil
    void rb_pool_rows(float *out, const float *t, const int32_t *rows, const int64_t *off, const float *scale,
                      long nb, long d, long ahead) nogil
    void rb_pool_rows_w(float *out, const float *t, const int32_t *rows, const int64_t *off, const float *scale,
                        const float *w, long nb, long d, long ahead) nogil
    void rb_sgd_row(float *w, const float *g, long d, float lr) nogil
    void rb_adagrad_row(float *w, float *a, const float *g, long d, float lr) nogil
    void rb_adam_row(float *w, float *m, float *v, const float *g, long d, float lr_t, float b1, float b2,
                     float c1, float c2, float eps) nogil
    void rb_rowwise_adagrad_row(float *w, float *a, const float *g, long d, float lr, float eps) nogil

# ---- bfloat16 rows ------------------------------------------------------------------------------------
# A bfloat16 is the top 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits), stored as uint16:
# decoding is exact (bits << 16); encoding rounds the low 16 bits away, to nearest even or stochastically.
cdef extern from *:
    """
    #include <string.h>
    /* float32 -> bfloat16 bits: (bits + r) >> 16 (r in [0, 65535]: stochastic with r uniform, r = 0x7FFF +
       the lowest kept bit: to nearest even); infinities stay, a NaN stays a (quiet) NaN */
    static inline uint16_t rb_bf16_round(float x, uint32_t r) {
        uint32_t u;
        memcpy(&u, &x, 4);
        if ((u & 0x7F800000u) == 0x7F800000u)
            return (uint16_t)((u >> 16) | ((u & 0x007FFFFFu) ? 0x40u : 0u));
        return (uint16_t)((u + r) >> 16);
    }
    /* One row of bf16_encode's stochastic rounding: value j's 16 random bits are the low quarter of
       mix64(k_row + (j + 1) * golden). The values are independent, so the loop vectorises; on x86-64
       GCC with glibc also builds an AVX-512 clone (64-bit multiplies), picked at load time (an ifunc)
       where the CPU has it. */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
    __attribute__((target_clones("arch=x86-64-v4", "default")))
    #endif
    static void rb_bf16_round_row(uint16_t *bits, const float *x, long d, uint64_t k_row) {
        for (long j = 0; j < d; j++)
            bits[j] = rb_bf16_round(x[j], (uint32_t)(rb_mix64(k_row + (uint64_t)(j + 1) * RB_GOLDEN) & 0xFFFFu));
    }
    """
    uint16_t _bf16_round "rb_bf16_round" (float x, uint32_t r) noexcept nogil
    void _bf16_round_row "rb_bf16_round_row" (uint16_t *bits, const float *x, long d, uint64_t k_row) noexcept nogil


cdef inline uint64_t _rounding_key(uint64_t seed, uint64_t counter) noexcept nogil:
    """The stochastic rounding's key of one (seed, counter): row r's key is ``mix64(key ^ r)``
    (``bf16_encode`` and the fused updates' bfloat16 rows)."""
    return _mix64(_mix64(seed + _GOLDEN) ^ counter)


cdef inline void _bf16_decode_row(float *row, const uint16_t *bits, Py_ssize_t d) noexcept nogil:
    """``row[j] = bits[j] << 16`` as float32, for ``j < d``: one row decoded, exactly (``bf16_decode``
    and the fused updates' bfloat16 blocks)."""
    cdef Py_ssize_t j
    cdef uint32_t u
    for j in range(d):
        u = (<uint32_t>bits[j]) << 16
        memcpy(&row[j], &u, 4)


cdef enum:
    _ROW_AHEAD = 16        # rows prefetched ahead: random rows of a large table miss every cache


@cython.boundscheck(False)
@cython.wraparound(False)
def gather_rows(table, rows, out):
    """``out[i] = table[rows[i]]`` (float32 rows, int32 row numbers); returns ``out``. A row outside
    the table raises IndexError."""
    cdef const float[:, ::1] t = table
    cdef const int32_t[::1] r = rows
    cdef float[:, ::1] o = out
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], i, bad = -1
    if o.shape[0] != n or o.shape[1] != d:
        raise ValueError("out has shape (%d, %d), expected (%d, %d)" % (o.shape[0], o.shape[1], n, d))
    with nogil:
        for i in range(n):
            if r[i] < 0 or r[i] >= c:
                bad = i
                break
            if i + _ROW_AHEAD < n and 0 <= r[i + _ROW_AHEAD] < c and d:
                rb_prefetch_span_read(&t[r[i + _ROW_AHEAD], 0], d * sizeof(float))
            if d:
                memcpy(&o[i, 0], &t[r[i], 0], d * sizeof(float))
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def scatter_rows(src, rows, table):
    """``table[rows[i]] = src[i]`` in order (float32 rows, int32 row numbers; a repeated row keeps the
    last); returns ``table``. A row outside the table raises IndexError before anything is written."""
    cdef const float[:, ::1] x = src
    cdef const int32_t[::1] r = rows
    cdef float[:, ::1] t = table
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], i, bad
    if x.shape[0] != n or x.shape[1] != d:
        raise ValueError("src has shape (%d, %d), expected (%d, %d)" % (x.shape[0], x.shape[1], n, d))
    with nogil:
        bad = _first_row_outside(r, c)
        if bad < 0 and d:
            for i in range(n):
                if i + _ROW_AHEAD < n:
                    rb_prefetch_span(&t[r[i + _ROW_AHEAD], 0], d * sizeof(float))
                memcpy(&t[r[i], 0], &x[i, 0], d * sizeof(float))
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return table


cdef inline Py_ssize_t _check_bags(const int64_t[::1] off, Py_ssize_t n, const float[::1] sc) except -1 nogil:
    """Check ``offsets`` over n positions (from 0 to n, non-decreasing) and one ``scale`` per bag (None:
    no scale); returns the number of bags."""
    cdef Py_ssize_t m = off.shape[0], b
    if m < 1:
        with gil:
            raise ValueError("offsets is empty, expected one entry per bag plus one (offsets[0] == 0)")
    if off[0] != 0:
        with gil:
            raise ValueError("offsets[0] is %d, expected 0" % off[0])
    if off[m - 1] != n:
        with gil:
            raise ValueError("offsets[%d] is %d, expected %d (the number of positions)" % (m - 1, off[m - 1], n))
    for b in range(m - 1):
        if off[b] > off[b + 1]:
            with gil:
                raise ValueError("offsets decrease at bag %d (%d > %d)" % (b, off[b], off[b + 1]))
    if sc is not None and sc.shape[0] != m - 1:
        with gil:
            raise ValueError("scale has %d entries, expected %d (one per bag)" % (sc.shape[0], m - 1))
    return m - 1


cdef inline int _check_weights(const float[::1] w, Py_ssize_t n) except -1 nogil:
    """Check per-position ``weights`` (None, or one float32 per position)."""
    if w is not None and w.shape[0] != n:
        with gil:
            raise ValueError("weights has %d entries, expected %d (one per position)" % (w.shape[0], n))
    return 0


cdef inline Py_ssize_t _first_row_outside(const int32_t[::1] r, Py_ssize_t c) noexcept nogil:
    """The first position whose row is outside a table of c rows, or -1."""
    cdef Py_ssize_t i
    for i in range(r.shape[0]):
        if r[i] < 0 or r[i] >= c:
            return i
    return -1


@cython.boundscheck(False)
@cython.wraparound(False)
def gather_pool(table, rows, offsets, scale, out, weights=None):
    """Multi-hot pooling: for each bag b, in order, ``out[b] = 0`` (+0.0), then
    ``out[b] = out[b] + table[rows[p]]`` for p = offsets[b] .. offsets[b+1]-1 in order, then
    ``out[b] = out[b] * scale[b]`` (float32 table and out [nb, d], int32 rows, int64 offsets [nb+1],
    float32 scale [nb]); an empty bag gives zeros. With ``weights`` (float32, one per position) each
    row is first multiplied by its weight: ``out[b] + table[rows[p]] * weights[p]``. Returns ``out``.
    Bad offsets, scale, weights or out shape raise ValueError, a row outside the table IndexError
    (both before anything is written)."""
    cdef const float[:, ::1] t = table
    cdef const int32_t[::1] r = rows
    cdef const int64_t[::1] off = offsets
    cdef const float[::1] sc = scale
    cdef const float[::1] w = weights
    cdef float[:, ::1] o = out
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], nb, bad = -1
    nb = _check_bags(off, n, sc)
    _check_weights(w, n)
    if o.shape[0] != nb or o.shape[1] != d:
        raise ValueError("out has shape (%d, %d), expected (%d, %d)" % (o.shape[0], o.shape[1], nb, d))
    with nogil:
        bad = _first_row_outside(r, c)
        if bad < 0 and nb and d:
            if w is None:
                rb_pool_rows(&o[0, 0], &t[0, 0], &r[0], &off[0], &sc[0], nb, d, _ROW_AHEAD)
            elif n:
                rb_pool_rows_w(&o[0, 0], &t[0, 0], &r[0], &off[0], &sc[0], &w[0], nb, d, _ROW_AHEAD)
            else:
                rb_pool_rows(&o[0, 0], &t[0, 0], &r[0], &off[0], &sc[0], nb, d, _ROW_AHEAD)
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def gather_max(table, rows, offsets, weights, out, argmax):
    """Max pooling: ``out[b, j]`` is the largest ``v = table[rows[p], j]`` (times ``weights[p]`` when
    weights are given, float32) over the positions p of bag b, and ``argmax[b, j]`` that p (int64):
    positions in order, a later one replacing the kept one only when ``v > kept`` (a tie keeps the
    first position). With weights a position of weight 0 is left out (MindSpore's
    MultiFieldEmbeddingLookup: weight 0 marks padding). A bag with no position left gives +0.0 and
    argmax -1. Returns ``out``. Shapes as ``gather_pool`` (``argmax`` int64 [nb, d]); bad ones raise
    ValueError, a row outside the table IndexError (both before anything is written)."""
    cdef const float[:, ::1] t = table
    cdef const int32_t[::1] r = rows
    cdef const int64_t[::1] off = offsets
    cdef const float[::1] w = weights
    cdef float[:, ::1] o = out
    cdef int64_t[:, ::1] a = argmax
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], nb, b, p, j, bad = -1
    cdef float v, wp
    cdef bint weighted = w is not None
    nb = _check_bags(off, n, None)
    _check_weights(w, n)
    if o.shape[0] != nb or o.shape[1] != d or a.shape[0] != nb or a.shape[1] != d:
        raise ValueError("out/argmax have shapes (%d, %d)/(%d, %d), expected (%d, %d)" % (
            o.shape[0], o.shape[1], a.shape[0], a.shape[1], nb, d))
    with nogil:
        bad = _first_row_outside(r, c)
        if bad < 0:
            for b in range(nb):
                for j in range(d):
                    o[b, j] = 0.0
                    a[b, j] = -1
                for p in range(off[b], off[b + 1]):
                    if p + _ROW_AHEAD < n and d:
                        rb_prefetch_span_read(&t[r[p + _ROW_AHEAD], 0], d * sizeof(float))
                    wp = w[p] if weighted else 1.0
                    if weighted and wp == 0.0:
                        continue
                    for j in range(d):
                        v = t[r[p], j] * wp if weighted else t[r[p], j]
                        if a[b, j] < 0 or v > o[b, j]:
                            o[b, j] = v
                            a[b, j] = p
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def unique_inverse(rows, mark):
    """``(uniq, inverse)`` of int32 ``rows``: the distinct rows in first-occurrence order and each
    row's position in ``uniq`` (``uniq[inverse] == rows``). ``mark`` is an int32 scratch array longer
    than the largest row, all -1 on entry and again on return."""
    cdef const int32_t[::1] r = rows
    cdef int32_t[::1] m = mark
    cdef Py_ssize_t n = r.shape[0], size = m.shape[0], i, k = 0, bad = -1
    uniq = np.empty(n, np.int32)
    inverse = np.empty(n, np.int32)
    cdef int32_t[::1] u = uniq
    cdef int32_t[::1] v = inverse
    cdef int32_t x
    with nogil:
        for i in range(n):
            x = r[i]
            if x < 0 or x >= size:
                bad = i
                break
            if i + _ROW_AHEAD < n and 0 <= r[i + _ROW_AHEAD] < size:
                rb_prefetch(&m[r[i + _ROW_AHEAD]])
            if m[x] < 0:
                m[x] = <int32_t>k
                u[k] = x
                k += 1
            v[i] = m[x]
        for i in range(k):
            m[u[i]] = -1
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the mark array of %d" % (r[bad], bad, size))
    return uniq[:k].copy(), inverse


@cython.boundscheck(False)
@cython.wraparound(False)
def unique_ids(ids):
    """``(keys, inverse)`` of 1-D int64 ``ids``: the distinct ids in first-occurrence order (int64) and
    each id's position among them (int32; ``keys[inverse] == ids``), through an open-addressing table
    of ``mix64(id)`` (row-wise hash tables number the ids of a step's union this way)."""
    cdef const int64_t[::1] v = ids
    cdef Py_ssize_t n = v.shape[0], cap = 16, i, u = 0
    cdef int32_t j
    cdef uint64_t mask, slot
    if n >= (1 << 30):
        raise ValueError("unique_ids takes fewer than 2**30 ids, got %d" % n)
    while cap < 2 * n:
        cap <<= 1
    mask = <uint64_t>(cap - 1)
    table = np.full(cap, -1, np.int32)
    keys = np.empty(n, np.int64)
    inverse = np.empty(n, np.int32)
    cdef int32_t[::1] t = table
    cdef int64_t[::1] k = keys
    cdef int32_t[::1] inv = inverse
    with nogil:
        for i in range(n):
            slot = _mix64(<uint64_t>v[i]) & mask
            while True:
                j = t[slot]
                if j < 0:
                    t[slot] = <int32_t>u
                    k[u] = v[i]
                    inv[i] = <int32_t>u
                    u += 1
                    break
                if k[j] == v[i]:
                    inv[i] = j
                    break
                slot = (slot + 1) & mask
    return keys[:u].copy(), inverse


cdef inline Py_ssize_t _sum_by_row(const int32_t[::1] inv, const float[:, ::1] g, float[:, ::1] acc,
                                   Py_ssize_t u, const int64_t[::1] off, const float[::1] sc,
                                   const float[::1] w, const int64_t[:, ::1] am) except -1 nogil:
    """The gradient summed per touched row, ``acc[:u] = 0`` first. Without bags (``off`` and ``sc``
    None) g has one row per position: ``acc[inv[i]] += g[i]``, i in order. With bags g has one row
    per bag: ``acc[inv[p]] += g[b] * sc[b]`` for p in off[b] .. off[b+1]-1, bags and p in order; with
    per-position weights ``w`` (weighted ids) ``(g[b] * sc[b]) * w[p]``; with the arg-max positions
    ``am`` of max pooling ([nb, d], -1: none) value j of bag b goes to position ``am[b, j]`` alone.
    Weights and arg-max take bags."""
    cdef Py_ssize_t n = inv.shape[0], d = g.shape[1], nb = n, i, k, b, j
    cdef int64_t p
    cdef const float *wp = NULL
    cdef bint bags = off is not None
    if bags != (sc is not None):
        with gil:
            raise ValueError("offsets and scale go together: give both or neither")
    if not bags and (w is not None or am is not None):
        with gil:
            raise ValueError("weights and argmax are per bag: give them with offsets and scale")
    if bags:
        nb = _check_bags(off, n, sc)
        if g.shape[0] != nb:
            with gil:
                raise ValueError("grad has %d rows, expected %d (one per bag)" % (g.shape[0], nb))
        _check_weights(w, n)
    if acc.shape[0] < u or acc.shape[1] != d or g.shape[0] != nb:
        with gil:
            raise ValueError("grad/acc shapes do not fit: grad (%d, %d), acc (%d, %d), %d ids, %d rows"
                             % (g.shape[0], g.shape[1], acc.shape[0], acc.shape[1], n, u))
    if am is not None:
        if am.shape[0] != nb or am.shape[1] != d:
            with gil:
                raise ValueError("argmax has shape (%d, %d), expected (%d, %d) (one per value of each bag)"
                                 % (am.shape[0], am.shape[1], nb, d))
        for b in range(nb):
            for j in range(d):
                p = am[b, j]
                if p != -1 and (p < off[b] or p >= off[b + 1]):
                    with gil:
                        raise ValueError("argmax[%d, %d] is %d, expected -1 or a position of bag %d (%d .. %d)"
                                         % (b, j, p, b, off[b], off[b + 1] - 1))
    if d == 0:
        return 0
    if u:
        memset(&acc[0, 0], 0, u * d * sizeof(float))
    for i in range(n):
        k = inv[i]
        if k < 0 or k >= u:
            with gil:
                raise IndexError("inverse %d (at %d) is outside the %d rows" % (k, i, u))
    if am is not None:
        if w is not None and n:
            wp = &w[0]
        if nb and n:
            rb_sum_argmax(&acc[0, 0], &g[0, 0], &sc[0], wp, &am[0, 0], &inv[0], nb, d)
    elif w is not None:
        if nb and n:
            rb_sum_bags_w(&acc[0, 0], &g[0, 0], &sc[0], &w[0], &inv[0], &off[0], nb, d)
    elif bags and nb:
        rb_sum_bags(&acc[0, 0], &g[0, 0], &sc[0], &inv[0], &off[0], nb, d)
    elif not bags and n:
        rb_sum_rows(&acc[0, 0], &g[0, 0], &inv[0], n, d)
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
def sum_by_row(uniq, inverse, grad, acc, offsets=None, scale=None, weights=None, argmax=None):
    """The gradient summed per row of ``uniq`` into ``acc[:u]`` (u = len(uniq)), as every fused update
    does first (see ``sparse_sgd_update``): ``acc[:u] = 0``, then ``acc[inverse[i]] += grad[i]`` in
    order, or with bags (``offsets`` and ``scale``, both or neither) position p of bag b adding
    ``grad[b] * scale[b]``, times ``weights[p]`` with weights, and with ``argmax`` (max pooling) only
    to the arg-max position of each value. Returns ``acc[:u]``. Data-parallel tables sum each rank's
    part this way, combine the parts across ranks, then update with ``inverse = arange(u)``."""
    cdef const int32_t[::1] q = uniq
    cdef const int32_t[::1] inv = inverse
    cdef const float[:, ::1] g = grad
    cdef float[:, ::1] a = acc
    cdef const int64_t[::1] off = offsets
    cdef const float[::1] sc = scale
    cdef const float[::1] w = weights
    cdef const int64_t[:, ::1] am = argmax
    cdef Py_ssize_t u = q.shape[0], k
    for k in range(u):
        if q[k] < 0:
            raise IndexError("a negative row")
    with nogil:
        _sum_by_row(inv, g, a, u, off, sc, w, am)
    return acc[:u]


# The fused updates take float32 rows or bfloat16 rows (uint16 bits): ``_rows_t``. Bfloat16 rows are
# stepped in float32, a block of _ROW_AHEAD rows at a time: the block decoded exactly into scratch
# (``_row_in``, at its first row), each row stepped there with its slots in place, the block rounded back
# stochastically (``_row_out``, at its last row). Each touched row and slot is fetched from memory once,
# as a float32 row is (the block's rows are prefetched a block ahead). Done row by row (each row decoded,
# stepped and encoded before the next), SparseAdagrad's update took 1.2x the three separate passes it
# replaces (decode, the float32 kernel on compact copies, encode) on a 2^25-row table; each part read what
# the one before had just stored, in vectors of other widths (SSE2 here, the rules' AVX2 clone, the
# rounding's AVX-512 one), which store forwarding does not serve (not verified further). By blocks: 0.76x.
# The bits equal the three passes' (the twins compose them).
ctypedef fused _rows_t:
    float
    uint16_t


cdef struct _Rounding:
    # a bfloat16 table's update: the block of rows being stepped, in float32 (_ROW_AHEAD rows), and
    # the stochastic rounding's key
    float *rows
    uint64_t key


cdef _rounding(_Rounding* r, _rows_t[:, ::1] table, uint64_t seed, uint64_t counter):
    """Set up ``r`` for an update of ``table`` (the rounding key of ``seed`` and ``counter``; for bfloat16
    rows, a block of scratch) and return what owns the scratch: keep it for the call."""
    cdef float[::1] rows
    r.key, r.rows = _rounding_key(seed, counter), NULL
    if _rows_t is uint16_t:
        rows = np.empty(_ROW_AHEAD * table.shape[1] + 1, np.float32)   # (+ 1: width 0 has an address too)
        r.rows = &rows[0]
        return rows
    else:
        return None


cdef inline float* _row_in(_rows_t[:, ::1] table, const int32_t[::1] uniq, Py_ssize_t k, _Rounding r) noexcept nogil:
    """Row ``uniq[k]`` to step, in float32: the row itself, or its place in the block of scratch (the
    block's rows ``uniq[k:k + _ROW_AHEAD]`` decoded there, exactly, when ``k`` starts a block)."""
    cdef Py_ssize_t d = table.shape[1], i, n
    if _rows_t is float:
        return &table[uniq[k], 0]
    else:
        if k % _ROW_AHEAD == 0:
            n = min(_ROW_AHEAD, uniq.shape[0] - k)
            for i in range(n):
                _bf16_decode_row(r.rows + i * d, &table[uniq[k + i], 0], d)
        return r.rows + (k % _ROW_AHEAD) * d


cdef inline void _row_out(_rows_t[:, ::1] table, const int32_t[::1] uniq, Py_ssize_t k, _Rounding r) noexcept nogil:
    """After row ``uniq[k]`` is stepped: nothing for float32 rows (stepped in place); for bfloat16, when
    ``k`` ends a block, its rows rounded back stochastically, each with ``bf16_encode``'s random bits."""
    cdef Py_ssize_t d = table.shape[1], first, i
    if _rows_t is uint16_t:
        if k % _ROW_AHEAD == _ROW_AHEAD - 1 or k == uniq.shape[0] - 1:
            first = k - k % _ROW_AHEAD
            for i in range(first, k + 1):
                _bf16_round_row(&table[uniq[i], 0], r.rows + (i - first) * d, d, _mix64(r.key ^ <uint64_t>uniq[i]))


cdef inline void _prefetch_row(_rows_t[:, ::1] a, const int32_t[::1] uniq, Py_ssize_t k) noexcept nogil:
    """Prefetch (for writing) the row ``uniq[k + _ROW_AHEAD]`` of ``a``, if there is one: every cache line
    of a row wider than a line (dim 17 spans two), one prefetch for a row of at most a line (a table's
    rows are 64-byte aligned, so it is the row; on misaligned rows in cache, as the gate's
    ``fused_adam_dim16`` row times them, a second prefetch per row cost 15-20% of the update). Bfloat16
    rows: the row ``uniq[k + 2 * _ROW_AHEAD]``, every line it spans (dim 17: 34 bytes, not aligned); a
    block of them is decoded at once (``_row_in``), so each is fetched a block ahead of its block."""
    cdef Py_ssize_t ahead = 2 * _ROW_AHEAD if _rows_t is uint16_t else _ROW_AHEAD
    if k + ahead < uniq.shape[0] and a.shape[1]:
        if _rows_t is uint16_t:
            rb_prefetch_span(&a[uniq[k + ahead], 0], a.shape[1] * sizeof(uint16_t))
        elif a.shape[1] * sizeof(float) > 64:
            rb_prefetch_span(&a[uniq[k + ahead], 0], a.shape[1] * sizeof(float))
        else:
            rb_prefetch(&a[uniq[k + ahead], 0])


cdef inline int _check_rows(const int32_t[::1] uniq, Py_ssize_t capacity) except -1 nogil:
    cdef Py_ssize_t k
    for k in range(uniq.shape[0]):
        if uniq[k] < 0 or uniq[k] >= capacity:
            with gil:
                raise IndexError("row %d is outside the table of %d rows" % (uniq[k], capacity))
    return 0


cdef inline float _row_top(const float* a, Py_ssize_t d, float top) noexcept nogil:
    """The larger of ``top`` and the largest of ``a[0:d]`` (a NaN entry is passed over)."""
    cdef Py_ssize_t j
    for j in range(d):
        if a[j] > top:
            top = a[j]
    return top


cdef inline float _row_top_abs(const float* a, Py_ssize_t d, float top) noexcept nogil:
    """The larger of ``top`` and the largest of ``|a[0:d]|`` (a NaN entry is passed over)."""
    cdef Py_ssize_t j
    for j in range(d):
        if fabsf(a[j]) > top:
            top = fabsf(a[j])
    return top


cdef inline int _check_largest(float[::1] largest, Py_ssize_t n) except -1:
    if largest is not None and largest.shape[0] < n:
        raise ValueError("largest has %d entries, expected at least %d" % (largest.shape[0], n))
    return 0


# ---- The options off: each kernel's row loop, twice -------------------------------------------------
# What 9cf14f1's row loops (the options) executed per touched row, every option off and no ``largest``,
# that 6e21d66's (before them) did not, read in the C Cython writes and in gcc 12's -O3 assembly:
# - a load and test of each flag: ``prep`` and ``track`` (SGD, Adam, FTRL), ``prep``, ``track`` and
#   ``track_w`` (Adagrad, row-wise Adagrad). Loop-invariant and predictable, but gcc did not unswitch
#   the loop on them: each was read from the stack on every row;
# - around them the loop no longer fit the registers once ``_prepare_row``'s four loops and
#   ``_row_top_abs`` were inlined into its body: the row pointers' bases and strides (``uniq``, ``table``,
#   ``acc``) spilled and were reloaded on every row (SGD: 5 loads a row more, the flags' included);
# - ``_prefetch_row``'s ``a.shape[1] != 0`` test, which gcc had hoisted out of the loop (a loop for
#   d > 0, another for d == 0), was tested again on every row;
# - the hot path laid out around the cold branches: two more taken jumps a row.
# Unchanged: the rules (``rb_*_row``, called through their target_clones dispatch, restrict and
# vectorised as before), ``_sum_by_row``, the arguments' checks (a few per call, not per row), the
# memory traffic (the same rows in the same order, the same prefetches; no row read again without
# ``largest``). So each kernel's row loop is one ``cdef inline`` function (``_sgd_rows`` ...) taking the
# flags as arguments, called from two sites: with the flags of the call (an option on, or ``largest``
# given) and with ``False`` literals (nothing on). gcc inlines both and folds the constants: the second
# site compiles to 6e21d66's loop (prefetch, rule; checked in the assembly: the same instructions but one
# stride reload), and the rule is written once.
cdef struct _Options:
    # a kernel's per-row options (``_prepare_row``): bounds Inf and decays 0 when off
    float clip_value, clip_norm, weight_decay, decay


cdef inline _Options _options(float clip_value, float clip_norm, float weight_decay, float decay) noexcept nogil:
    cdef _Options o
    o.clip_value, o.clip_norm, o.weight_decay, o.decay = clip_value, clip_norm, weight_decay, decay
    return o


cdef inline void _prepare_row(float* w, float* g, Py_ssize_t d, _Options o) noexcept nogil:
    """A touched row's gradient ``g`` (summed) and its row ``w`` before the optimizer's rule: ``g``
    clipped to ``[-clip_value, clip_value]`` entry by entry, then scaled to at most ``clip_norm`` in L2
    norm (``n = sqrt(g[0]*g[0] + g[1]*g[1] + ...)`` in float32 and column order; where ``n > clip_norm``,
    ``g = (g * clip_norm) / n``, as ``ops.clip_by_norm``), then ``g = g + weight_decay * w`` (L2 decay into
    the gradient, as ``nn.Adam``'s ``weight_decay``), then ``w = w - decay * w`` (decoupled decay,
    ``decay = lr * decoupled_weight_decay`` from the caller). A bound of Inf or a decay of 0: that part
    is off. NaN entries stay NaN."""
    cdef Py_ssize_t j
    cdef float s = 0.0, n, clip_value = o.clip_value, clip_norm = o.clip_norm
    cdef float weight_decay = o.weight_decay, decay = o.decay
    if clip_value < INFINITY:
        for j in range(d):
            if g[j] > clip_value:
                g[j] = clip_value
            elif g[j] < -clip_value:
                g[j] = -clip_value
    if clip_norm < INFINITY:
        for j in range(d):
            s = s + g[j] * g[j]
        n = sqrtf(s)
        if n > clip_norm:
            for j in range(d):
                g[j] = (g[j] * clip_norm) / n
    if weight_decay != 0.0:
        for j in range(d):
            g[j] = g[j] + weight_decay * w[j]
    if decay != 0.0:
        for j in range(d):
            w[j] = w[j] - decay * w[j]


cdef inline bint _prepares(_Options o) noexcept nogil:
    return o.clip_value < INFINITY or o.clip_norm < INFINITY or o.weight_decay != 0.0 or o.decay != 0.0


cdef inline float _sgd_rows(_rows_t[:, ::1] table, const int32_t[::1] uniq, float[:, ::1] acc, float lr,
                           bint prep, _Options o, bint track_w, float top_w, _Rounding r) noexcept nogil:
    """``sparse_sgd_update``'s row loop (see "The options off"); returns ``top_w`` raised."""
    cdef Py_ssize_t d = table.shape[1], k
    cdef float *w
    for k in range(uniq.shape[0]):
        _prefetch_row(table, uniq, k)
        w = _row_in(table, uniq, k, r)
        if prep:
            _prepare_row(w, &acc[k, 0], d, o)
        rb_sgd_row(w, &acc[k, 0], d, lr)
        if track_w:
            top_w = _row_top_abs(w, d, top_w)
        _row_out(table, uniq, k, r)
    return top_w


@cython.boundscheck(False)
@cython.wraparound(False)
def sparse_sgd_update(_rows_t[:, ::1] table, const int32_t[::1] uniq, const int32_t[::1] inverse,
                      const float[:, ::1] grad, float[:, ::1] acc, float lr, const int64_t[::1] offsets=None,
                      const float[::1] scale=None, float[::1] largest=None, float clip_value=INFINITY,
                      float clip_norm=INFINITY, float weight_decay=0.0, float decay=0.0,
                      const float[::1] weights=None, const int64_t[:, ::1] argmax=None,
                      unsigned long long seed=0, unsigned long long counter=0):
    """Fused SGD: the gradient summed per row, then ``w = w - lr * g`` on each touched row.

    Every fused update sums ``grad`` per row of ``uniq`` into the scratch ``acc`` (at least u rows)
    first: one grad row per position, ``g[inverse[i]] += grad[i]`` in order; or, given ``offsets`` and
    ``scale`` (bags, both or neither), one grad row per bag, position p of bag b adding
    ``grad[b] * scale[b]`` (float32 product, then sum; bags and positions in order). With bags,
    ``weights`` (float32, one per position: weighted ids) make position p add
    ``(grad[b] * scale[b]) * weights[p]``, and ``argmax`` (int64 [bags, dim], ``gather_max``'s: max
    pooling) sends value j of bag b to position ``argmax[b, j]`` alone (none where -1): no per-position
    gradient is built. Bad shapes or an arg-max outside its bag raise ValueError.

    Every fused update then prepares each touched row's gradient and row (``_prepare_row``:
    ``clip_value``, ``clip_norm``, L2 ``weight_decay`` into the gradient, decoupled ``decay``) before its
    rule. Given ``largest`` (three entries or more) with a ``weight_decay``, ``largest[2]`` becomes the
    larger of itself and the largest ``|w|`` written (the decay's term in the step's overflow bound).

    Every fused update takes float32 rows, or bfloat16 rows (a uint16 ``table``, ``bf16_decode``'s bits):
    each touched row is decoded exactly, stepped in float32 as a float32 row would be (its slots, float32,
    in place; ``largest`` raised by the float32 row), then rounded back stochastically with the random
    bits ``bf16_encode(..., seed, counter, True)`` gives the row: bit for bit ``bf16_decode`` of the rows,
    this update on them, ``bf16_encode``. ``seed`` and ``counter`` are read only for bfloat16 rows."""
    cdef Py_ssize_t u = uniq.shape[0]
    cdef _Options o = _options(clip_value, clip_norm, weight_decay, decay)
    cdef bint prep = _prepares(o)
    cdef bint track = largest is not None and weight_decay != 0.0
    cdef float top_w = 0.0
    cdef _Rounding r
    keep = _rounding(&r, table, seed, counter)
    _check_largest(largest, 3 if track else 0)
    if track:
        top_w = largest[2]
    with nogil:
        _check_rows(uniq, table.shape[0])
        _sum_by_row(inverse, grad, acc, u, offsets, scale, weights, argmax)
        if prep or track:
            top_w = _sgd_rows(table, uniq, acc, lr, prep, o, track, top_w, r)
        else:                       # the options off: constant flags (see "The options off")
            _sgd_rows(table, uniq, acc, lr, False, o, False, top_w, r)
    if track:
        largest[2] = top_w


cdef inline void _adagrad_rows(_rows_t[:, ::1] table, float[:, ::1] accum, const int32_t[::1] uniq,
                               float[:, ::1] acc, float lr, bint prep, _Options o, bint track, bint track_w,
                               float* top, float* top_w, _Rounding r) noexcept nogil:
    """``sparse_adagrad_update``'s row loop (see "The options off"); raises ``top[0]`` and ``top_w[0]``."""
    cdef Py_ssize_t d = table.shape[1], k
    cdef float *w
    for k in range(uniq.shape[0]):
        _prefetch_row(table, uniq, k)
        _prefetch_row(accum, uniq, k)
        w = _row_in(table, uniq, k, r)
        if prep:
            _prepare_row(w, &acc[k, 0], d, o)
        rb_adagrad_row(w, &accum[uniq[k], 0], &acc[k, 0], d, lr)
        if track:
            top[0] = _row_top(&accum[uniq[k], 0], d, top[0])
        if track_w:
            top_w[0] = _row_top_abs(w, d, top_w[0])
        _row_out(table, uniq, k, r)


@cython.boundscheck(False)
@cython.wraparound(False)
def sparse_adagrad_update(_rows_t[:, ::1] table, float[:, ::1] accum, const int32_t[::1] uniq,
                          const int32_t[::1] inverse, const float[:, ::1] grad, float[:, ::1] acc, float lr,
                          const int64_t[::1] offsets=None, const float[::1] scale=None, float[::1] largest=None,
                          float clip_value=INFINITY, float clip_norm=INFINITY, float weight_decay=0.0,
                          float decay=0.0, const float[::1] weights=None, const int64_t[:, ::1] argmax=None,
                          unsigned long long seed=0, unsigned long long counter=0):
    """Fused Adagrad: ``a = a + g*g; w = w - (lr*g) / sqrt(a)`` on each touched row (g summed per row
    as in ``sparse_sgd_update``, with or without bags). Given ``largest`` (float32, one entry or more),
    ``largest[0]`` becomes the larger of itself and the largest accumulator entry written (a NaN is
    passed over): a running bound of the accumulators for the step's overflow check; with a
    ``weight_decay``, ``largest[2]`` too (as in ``sparse_sgd_update``). The rows are prepared, and bfloat16
    rows stepped, as there."""
    cdef Py_ssize_t u = uniq.shape[0]
    cdef bint track = largest is not None, track_w = largest is not None and weight_decay != 0.0
    cdef _Options o = _options(clip_value, clip_norm, weight_decay, decay)
    cdef bint prep = _prepares(o)
    cdef float top = 0.0, top_w = 0.0
    cdef _Rounding r
    keep = _rounding(&r, table, seed, counter)
    _check_largest(largest, 3 if track_w else 1)
    if track:
        top = largest[0]
    if track_w:
        top_w = largest[2]
    with nogil:
        _check_rows(uniq, table.shape[0])
        _sum_by_row(inverse, grad, acc, u, offsets, scale, weights, argmax)
        if prep or track:
            _adagrad_rows(table, accum, uniq, acc, lr, prep, o, track, track_w, &top, &top_w, r)
        else:                       # the options off: constant flags (see "The options off")
            _adagrad_rows(table, accum, uniq, acc, lr, False, o, False, False, &top, &top_w, r)
    if track:
        largest[0] = top
    if track_w:
        largest[2] = top_w


cdef inline void _rowwise_adagrad_rows(_rows_t[:, ::1] table, float[:, ::1] accum, const int32_t[::1] uniq,
                                       float[:, ::1] acc, float lr, float eps, bint prep, _Options o, bint track,
                                       bint track_w, float* top, float* top_w, _Rounding r) noexcept nogil:
    """``sparse_rowwise_adagrad_update``'s row loop (see "The options off"); raises ``top[0]`` and
    ``top_w[0]``."""
    cdef Py_ssize_t d = table.shape[1], k
    cdef float *w
    for k in range(uniq.shape[0]):
        _prefetch_row(table, uniq, k)
        _prefetch_row(accum, uniq, k)
        w = _row_in(table, uniq, k, r)
        if prep:
            _prepare_row(w, &acc[k, 0], d, o)
        rb_rowwise_adagrad_row(w, &accum[uniq[k], 0], &acc[k, 0], d, lr, eps)
        if track:
            top[0] = _row_top(&accum[uniq[k], 0], 1, top[0])
        if track_w:
            top_w[0] = _row_top_abs(w, d, top_w[0])
        _row_out(table, uniq, k, r)


@cython.boundscheck(False)
@cython.wraparound(False)
def sparse_rowwise_adagrad_update(_rows_t[:, ::1] table, float[:, ::1] accum, const int32_t[::1] uniq,
                                  const int32_t[::1] inverse, const float[:, ::1] grad, float[:, ::1] acc, float lr,
                                  float eps, const int64_t[::1] offsets=None, const float[::1] scale=None,
                                  float[::1] largest=None, float clip_value=INFINITY, float clip_norm=INFINITY,
                                  float weight_decay=0.0, float decay=0.0, const float[::1] weights=None,
                                  const int64_t[:, ::1] argmax=None, unsigned long long seed=0,
                                  unsigned long long counter=0):
    """Fused row-wise Adagrad (FBGEMM's): one accumulator per row, ``accum`` of shape (rows, 1). On each
    touched row, ``a = a + s / d`` with ``s = g[0]*g[0] + g[1]*g[1] + ...`` (float32, in column order),
    then ``r = lr / (sqrt(a) + eps)`` and ``w = w - r*g`` (g summed per row as in
    ``sparse_sgd_update``, with or without bags). An ``accum`` of another shape raises ValueError.
    ``largest``, the prepared rows and bfloat16 rows: as in ``sparse_adagrad_update``."""
    cdef Py_ssize_t u = uniq.shape[0]
    cdef bint track = largest is not None, track_w = largest is not None and weight_decay != 0.0
    cdef _Options o = _options(clip_value, clip_norm, weight_decay, decay)
    cdef bint prep = _prepares(o)
    cdef float top = 0.0, top_w = 0.0
    cdef _Rounding r
    keep = _rounding(&r, table, seed, counter)
    if accum.shape[0] != table.shape[0] or accum.shape[1] != 1:
        raise ValueError("accum has shape (%d, %d), expected (%d, 1)" % (accum.shape[0], accum.shape[1],
                                                                         table.shape[0]))
    _check_largest(largest, 3 if track_w else 1)
    if track:
        top = largest[0]
    if track_w:
        top_w = largest[2]
    with nogil:
        _check_rows(uniq, table.shape[0])
        _sum_by_row(inverse, grad, acc, u, offsets, scale, weights, argmax)
        if prep or track:
            _rowwise_adagrad_rows(table, accum, uniq, acc, lr, eps, prep, o, track, track_w, &top, &top_w, r)
        else:                       # the options off: constant flags (see "The options off")
            _rowwise_adagrad_rows(table, accum, uniq, acc, lr, eps, False, o, False, False, &top, &top_w, r)
    if track:
        largest[0] = top
    if track_w:
        largest[2] = top_w


cdef inline float _adam_rows(_rows_t[:, ::1] table, float[:, ::1] m, float[:, ::1] v, const int32_t[::1] uniq,
                            float[:, ::1] acc, float lr_t, float beta1, float beta2, float c1, float c2, float eps,
                            bint prep, _Options o, bint track_w, float top_w, _Rounding r) noexcept nogil:
    """``sparse_adam_update``'s row loop (see "The options off"); returns ``top_w`` raised."""
    cdef Py_ssize_t d = table.shape[1], k
    cdef float *w
    for k in range(uniq.shape[0]):
        _prefetch_row(table, uniq, k)
        _prefetch_row(m, uniq, k)
        _prefetch_row(v, uniq, k)
        w = _row_in(table, uniq, k, r)
        if prep:
            _prepare_row(w, &acc[k, 0], d, o)
        rb_adam_row(w, &m[uniq[k], 0], &v[uniq[k], 0], &acc[k, 0], d, lr_t, beta1, beta2, c1, c2, eps)
        if track_w:
            top_w = _row_top_abs(w, d, top_w)
        _row_out(table, uniq, k, r)
    return top_w


@cython.boundscheck(False)
@cython.wraparound(False)
def sparse_adam_update(_rows_t[:, ::1] table, float[:, ::1] m, float[:, ::1] v, const int32_t[::1] uniq,
                       const int32_t[::1] inverse, const float[:, ::1] grad, float[:, ::1] acc, float lr_t,
                       float beta1, float beta2, float c1, float c2, float eps, const int64_t[::1] offsets=None,
                       const float[::1] scale=None, float[::1] largest=None, float clip_value=INFINITY,
                       float clip_norm=INFINITY, float weight_decay=0.0, float decay=0.0,
                       const float[::1] weights=None, const int64_t[:, ::1] argmax=None,
                       unsigned long long seed=0, unsigned long long counter=0):
    """Fused lazy Adam (MindSpore's LazyAdam), each touched row and slot read once and written once:
    ``m = b1*m + c1*g; v = b2*v + c2*(g*g); w = w - lr_t * (m / (sqrt(v) + eps))`` with
    ``c1 = 1-b1``, ``c2 = 1-b2`` and the bias-corrected ``lr_t`` given by the caller (g summed per row
    as in ``sparse_sgd_update``, with or without bags; the rows prepared and ``largest`` as there: the
    decoupled ``decay`` is ``lr * decoupled_weight_decay`` with the rate before the bias correction;
    bfloat16 rows as there)."""
    cdef Py_ssize_t u = uniq.shape[0]
    cdef _Options o = _options(clip_value, clip_norm, weight_decay, decay)
    cdef bint prep = _prepares(o)
    cdef bint track = largest is not None and weight_decay != 0.0
    cdef float top_w = 0.0
    cdef _Rounding r
    keep = _rounding(&r, table, seed, counter)
    _check_largest(largest, 3 if track else 0)
    if track:
        top_w = largest[2]
    with nogil:
        _check_rows(uniq, table.shape[0])
        _sum_by_row(inverse, grad, acc, u, offsets, scale, weights, argmax)
        if prep or track:
            top_w = _adam_rows(table, m, v, uniq, acc, lr_t, beta1, beta2, c1, c2, eps, prep, o, track, top_w, r)
        else:                       # the options off: constant flags (see "The options off")
            _adam_rows(table, m, v, uniq, acc, lr_t, beta1, beta2, c1, c2, eps, False, o, False, top_w, r)
    if track:
        largest[2] = top_w


cdef inline void _ftrl_rows(_rows_t[:, ::1] table, float[:, ::1] accum, float[:, ::1] linear,
                            const int32_t[::1] uniq, float[:, ::1] acc, float lr, float lr_power, float l1, float l2,
                            bint prep, _Options o, bint track, float* tops, _Rounding r) noexcept nogil:
    """``sparse_ftrl_update``'s row loop (see "The options off"); raises ``tops[0:3]``."""
    cdef Py_ssize_t d = table.shape[1], k, j
    cdef float *w
    cdef float *a
    cdef float *ln
    cdef float *g
    cdef float p = -lr_power, two_l2 = 2.0 * l2, an, pn, po, sigma, lin, sgn
    cdef bint half = lr_power == -0.5
    for k in range(uniq.shape[0]):
        _prefetch_row(table, uniq, k)
        _prefetch_row(accum, uniq, k)
        _prefetch_row(linear, uniq, k)
        w = _row_in(table, uniq, k, r)
        a = &accum[uniq[k], 0]
        ln = &linear[uniq[k], 0]
        g = &acc[k, 0]
        if prep:
            _prepare_row(w, g, d, o)
        for j in range(d):
            an = a[j] + g[j] * g[j]
            if half:
                pn = sqrtf(an)
                po = sqrtf(a[j])
            else:                       # the double pow, rounded: see the numpy twin
                pn = <float>pow(<double>an, <double>p)
                po = <float>pow(<double>a[j], <double>p)
            sigma = (pn - po) / lr
            lin = (ln[j] + g[j]) - sigma * w[j]
            ln[j] = lin
            a[j] = an
            if lin > l1 or lin < -l1:
                sgn = 1.0 if lin > 0 else -1.0
                w[j] = (sgn * l1 - lin) / (pn / lr + two_l2)
            else:
                w[j] = 0.0
        if track:
            tops[0] = _row_top(a, d, tops[0])
            tops[1] = _row_top_abs(ln, d, tops[1])
            tops[2] = _row_top_abs(w, d, tops[2])
        _row_out(table, uniq, k, r)


@cython.boundscheck(False)
@cython.wraparound(False)
def sparse_ftrl_update(_rows_t[:, ::1] table, float[:, ::1] accum, float[:, ::1] linear, const int32_t[::1] uniq,
                       const int32_t[::1] inverse, const float[:, ::1] grad, float[:, ::1] acc, float lr,
                       float lr_power, float l1, float l2, const int64_t[::1] offsets=None,
                       const float[::1] scale=None, float[::1] largest=None, float clip_value=INFINITY,
                       float clip_norm=INFINITY, float weight_decay=0.0, const float[::1] weights=None,
                       const int64_t[:, ::1] argmax=None, unsigned long long seed=0, unsigned long long counter=0):
    """Fused FTRL-proximal (MindSpore's form, ``lr_power <= 0``, p = -lr_power): ``a' = a + g*g``;
    ``sigma = (a'^p - a^p) / lr``; ``lin = (lin + g) - sigma*w``; ``quad = a'^p / lr + 2*l2``;
    ``w = (sign(lin)*l1 - lin) / quad`` where ``|lin| > l1``, else 0. ``x^0.5`` is ``sqrtf``; any
    other power is the C library's double ``pow`` rounded to float32 (numpy's float32 ``power`` may
    take its own SIMD routine, whose last bit can differ, so the twin calls the C library too). g is
    summed per row as in ``sparse_sgd_update``, with or without bags. Given ``largest`` (float32, three
    entries or more), its entries become the larger of themselves and the largest accumulator entry,
    ``|linear|`` and ``|weight|`` written (NaNs passed over): running bounds for the step's overflow
    check. ``clip_value`` and ``clip_norm`` clip each row's gradient first, then ``weight_decay`` adds
    ``weight_decay * w`` to it (``_prepare_row``: ``nn.FTRL``'s ``weight_decay``, before the FTRL rule;
    no decoupled decay: FTRL's weights are derived from ``linear`` and ``accum``). bfloat16 rows: as in
    ``sparse_sgd_update``."""
    cdef Py_ssize_t u = uniq.shape[0]
    cdef bint track = largest is not None
    cdef float tops[3]
    cdef _Rounding r
    keep = _rounding(&r, table, seed, counter)
    cdef _Options o = _options(clip_value, clip_norm, weight_decay, 0.0)
    cdef bint prep = _prepares(o)
    _check_largest(largest, 3)
    tops[0] = tops[1] = tops[2] = 0.0
    if track:
        tops[0], tops[1], tops[2] = largest[0], largest[1], largest[2]
    with nogil:
        _check_rows(uniq, table.shape[0])
        _sum_by_row(inverse, grad, acc, u, offsets, scale, weights, argmax)
        if prep or track:
            _ftrl_rows(table, accum, linear, uniq, acc, lr, lr_power, l1, l2, prep, o, track, tops, r)
        else:                       # the options off: constant flags (see "The options off")
            _ftrl_rows(table, accum, linear, uniq, acc, lr, lr_power, l1, l2, False, o, False, tops, r)
    if track:
        largest[0], largest[1], largest[2] = tops[0], tops[1], tops[2]


@cython.boundscheck(False)
@cython.wraparound(False)
def init_rows(ids, unsigned long long seed, double stddev, out):
    """Id-keyed initial rows: row i of float32 ``out`` is a function of ``(seed, ids[i])`` alone.
    Element (i, j) is ``stddev * sqrt(3) * (s / 65536 - 2)``, where s is the sum of the four 16-bit
    quarters of a 64-bit hash of (seed, id, j), plus 2: an Irwin-Hall sum of four uniforms (mean 0,
    standard deviation ``stddev``, within +-3.46 stddev), in exact arithmetic. Returns ``out``."""
    cdef const int64_t[::1] x = ids
    cdef float[:, ::1] o = out
    cdef Py_ssize_t n = x.shape[0], d = o.shape[1], i, j
    cdef uint64_t k_seed = _mix64(seed + _GOLDEN), k_id, h
    cdef double scale = stddev * sqrt(3.0), s
    if o.shape[0] != n:
        raise ValueError("out has %d rows, expected %d" % (o.shape[0], n))
    with nogil:
        for i in range(n):
            k_id = _mix64(k_seed ^ <uint64_t>x[i])
            for j in range(d):
                h = _mix64(k_id + <uint64_t>(j + 1) * _GOLDEN)
                s = <double>((h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48)) + 2.0
                o[i, j] = <float>(scale * (s / 65536.0 - 2.0))
    return out


# ---- bfloat16 rows: decode and encode (the rounding is above, with the host tables) ------------------
@cython.boundscheck(False)
@cython.wraparound(False)
def bf16_decode(table, rows, out):
    """``out[i] = table[rows[i]]`` as float32 (uint16 bfloat16 bits in, exact: bits << 16; int32 row
    numbers); returns ``out``. A row outside the table raises IndexError."""
    cdef const uint16_t[:, ::1] t = table
    cdef const int32_t[::1] r = rows
    cdef float[:, ::1] o = out
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], i, bad = -1
    if o.shape[0] != n or o.shape[1] != d:
        raise ValueError("out has shape (%d, %d), expected (%d, %d)" % (o.shape[0], o.shape[1], n, d))
    with nogil:
        bad = _first_row_outside(r, c)
        if bad < 0 and d:
            for i in range(n):
                if i + _ROW_AHEAD < n:
                    rb_prefetch_span_read(&t[r[i + _ROW_AHEAD], 0], d * sizeof(uint16_t))
                _bf16_decode_row(&o[i, 0], &t[r[i], 0], d)
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def bf16_encode(src, rows, table, unsigned long long seed, unsigned long long counter, bint stochastic):
    """``table[rows[i]] = bfloat16(src[i])`` (float32 ``src`` [n, d] -> uint16 bits; int32 rows).
    ``stochastic``: element (i, j) rounds up with probability equal to its distance from the lower
    neighbour over the gap (expected value: the float32 value), its 16 random bits the low quarter of
    ``mix64(mix64(mix64(mix64(seed + golden) ^ counter) ^ row) + (j + 1) * golden)``: a function of
    (seed, counter, row, column) alone, whatever the order or thread. Else to nearest, ties to even.
    A row outside the table raises IndexError before anything is written."""
    cdef const float[:, ::1] x = src
    cdef const int32_t[::1] r = rows
    cdef uint16_t[:, ::1] t = table
    cdef Py_ssize_t n = r.shape[0], d = t.shape[1], c = t.shape[0], i, j, bad = -1
    cdef uint64_t k_count = _rounding_key(seed, counter), k_row
    cdef uint32_t u
    cdef const float *row
    cdef uint16_t *bits
    if x.shape[0] != n or x.shape[1] != d:
        raise ValueError("src has shape (%d, %d), expected (%d, %d)" % (x.shape[0], x.shape[1], n, d))
    with nogil:
        bad = _first_row_outside(r, c)
        if bad < 0 and d:
            for i in range(n):
                if i + _ROW_AHEAD < n:
                    rb_prefetch_span(&t[r[i + _ROW_AHEAD], 0], d * sizeof(uint16_t))
                row = &x[i, 0]
                bits = &t[r[i], 0]
                if stochastic:
                    k_row = _mix64(k_count ^ <uint64_t>r[i])
                    _bf16_round_row(bits, row, d, k_row)
                else:
                    for j in range(d):
                        memcpy(&u, &row[j], 4)
                        bits[j] = _bf16_round(row[j], 0x7FFF + ((u >> 16) & 1))
    if bad >= 0:
        raise IndexError("row %d (at %d) is outside the table of %d rows" % (r[bad], bad, c))
    return table


# What the hash cache holds, in bytes (recboost.HashEmbedding.bytes_per_row reports them): one map entry
# per tracked id (key, last-seen time, count, row), and with an eviction policy, per row, its id,
# last-seen time and count.
HASH_ENTRY_BYTES = sizeof(rb_slot)
HASH_POLICY_ROW_BYTES = 3 * sizeof(int64_t)
