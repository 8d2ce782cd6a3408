# cython: language_level=3
"""Compiled host kernels for recboost (built as ``_recboost_fast``).

Kernels only: typed arrays in, arrays out. Validation, logging and MindSpore stay in recboost.py,
which also holds a pure-numpy twin of every kernel here (named ``_py_<name>``); both must give
bit-identical results.
"""

# Must equal recboost.__version__; recboost refuses a stale build.
__version__ = "0.1.0"


# =====================================================================================================
# Gradient freeze
# =====================================================================================================

cimport cython
import numpy as np
from libc.stdint cimport uint64_t, int32_t, int64_t
from libc.string cimport memcpy


cdef inline uint64_t _splitmix64(uint64_t x) nogil:
    x += <uint64_t>0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


def freeze_index_sequence(int groups, int strategy, double freeze_p, long long total_steps,
                          unsigned long long seed):
    """Per-step freeze index (0 = train every group, i = train groups i.. only) as int32.

    Strategy 0 is MindSpore's repeated pattern ``[0]*z + [1..groups-1]`` (exactly its sequence);
    strategy 1 places frozen steps where MindSpore does (deterministic) and draws each frozen index
    ``i`` with probability ``(groups - i) / sum(1..groups-1)`` from splitmix64(seed + draw number)
    (top 32 bits scaled to ``[0, sum)``, so ``groups`` must stay below 2**16).
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
                u = ((_splitmix64(<uint64_t>seed + <uint64_t>(j + 1) * <uint64_t>0x9E3779B97F4A7C15ULL)
                      >> 32) * s) >> 32
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
