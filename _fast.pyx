# cython: language_level=3
"""Compiled host kernels for recboost (built as ``_recboost_fast``).

Kernels only: typed arrays in, arrays out. Validation, logging and MindSpore stay in recboost.py,
which also holds a pure-numpy twin of every kernel here (named ``_py_<name>``); both must give
bit-identical results.
"""

# Must equal recboost.__version__; recboost refuses a stale build.
__version__ = "0.1.0"

# =====================================================================================================
# Criteo parsing
# =====================================================================================================
# parse_criteo: a buffer of text lines in the Criteo layout -> typed arrays. The twin is
# recboost._py_parse_criteo; the hashing and the per-line rules are documented there.
import numpy as np
from libc.stdint cimport int8_t, int64_t, uint64_t
from libc.string cimport memchr

cdef uint64_t _CRITEO_M1 = 0xBF58476D1CE4E5B9ULL
cdef uint64_t _CRITEO_M2 = 0x94D049BB133111EBULL
cdef uint64_t _CRITEO_FIELD_MUL = 0x9E3779B97F4A7C15ULL
cdef uint64_t _CRITEO_MISSING_SALT = 0x6A09E667F3BCC909ULL
cdef uint64_t _CRITEO_INT64_MAX = 0x7FFFFFFFFFFFFFFFULL


cdef signed char _criteo_hex[256]       # byte -> hex digit value, -1 if not a hex digit


cdef void _criteo_fill_hex() noexcept:
    cdef int c
    for c in range(256):
        _criteo_hex[c] = (c - 48 if 48 <= c <= 57 else c - 87 if 97 <= c <= 102
                          else c - 55 if 65 <= c <= 70 else -1)


_criteo_fill_hex()


cdef inline uint64_t _criteo_mix64(uint64_t x) noexcept nogil:
    x ^= x >> 30
    x *= _CRITEO_M1
    x ^= x >> 27
    x *= _CRITEO_M2
    x ^= x >> 31
    return x


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
        salts[f] = <uint64_t>(f + 1) * _CRITEO_FIELD_MUL
        missing[f] = _criteo_id(_criteo_mix64(salts[f] ^ _CRITEO_MISSING_SALT))
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
                        ids[r, k] = _criteo_id(_criteo_mix64(_criteo_mix64(acc) ^ salts[k]))
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
