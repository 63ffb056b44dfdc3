"""Shared pieces of the compiled planner: tuning constants, the ``njit`` decorator, NumPy-order sums
and the ``log2phy`` table.

The constants are compile-time parameters of the algorithms (not user options): changing one changes
plans.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np

_INF = np.inf
# relative peak gap beyond which a losing candidate plan stops being refined
PRUNE_MARGIN = 0.01
# a row stops once a block of rounds lowers its load above the mean by less than this fraction
MIN_BLOCK_GAIN = 1e-6
# exchanges that improve a pair by less than this fraction of the mean bin load are ignored
REL_TOL = 1e-12
# a row whose peak is within this fraction of its lower bound stops refining (invisible in the
# reported balancedness, which has 4 decimals)
CLOSE_ENOUGH = 2e-5
# up to this many slots per GPU the exchange search scores every (x, y) pair; with more, a sweep over
# the bins' items sorted by load
BRUTE_FORCE_SLOTS = 16
# pairs of bins with at most this many slots are re-split exhaustively (C(2S, S) / 2 splits: 126 at 5)
MAX_RESPLIT_SLOTS = 5
# with more slots (up to this many), a round-robin start is refined beside the LPT start
RR_MAX_SLOTS = 16
# re-splits of the heaviest bin with the lightest ones at the end of every re-split round: they
# lower the peak directly (6 rounds with them end better balanced than 32 without)
PEAK_TRIES = 16
# rows of more than this many bins (one node of 72 GPUs): per round only the heavier half of the
# pairs is re-split and the heaviest bin gets PEAK_TRIES_MANY tries, over 5 rounds; better balanced
# and ~10% faster than every pair with 16 tries over 6 rounds (the peak step lowers the peak, the
# pairs of middle bins mostly do not)
MANY_BINS = 16
PEAK_TRIES_MANY = 32
# above this many bins per row, each round's bin order is sorted from scratch (merge sort), not by
# insertion from the previous round's order
SORT_FROM_SCRATCH_BINS = 32
# a layer whose heaviest GPU is within this fraction of the greedy plan's is compared with the
# greedy plan exactly (:func:`eplb_core._solve.greedy_fallback`)
GREEDY_MARGIN = 1e-9
# refinement rounds between two re-selections of the rows that still matter
BLOCK = 4
# with up to this many slots per GPU a row's repeats of an expert on a GPU are found by comparing
# every two slots of a GPU; with more, in one pass over the row
REPAIR_SCAN_SLOTS = 16
# bins of up to this many slots are written in order by ranks (all pairs compared), more by insertion;
# rows of up to RANK_SORT_BINS bins order their bins by ranks each round
RANK_SORT_SLOTS = 16
RANK_SORT_BINS = 16
# from this many items, a stable argsort tries buckets of the loads' bits first (a counting sort);
# a bucket of more than BUCKET_MAX items sends it back to the merge sort
BUCKET_SORT_MIN = 16
BUCKET_MAX = 16
# from this many replicas to hand out, the greedy replica split of a row of more than
# GREEDY_SCAN_EXPERTS experts keeps them in a heap; up to that many experts, a vectorised scan per
# replica beats the heap's unpredictable branches
GREEDY_HEAP_MIN = 8
GREEDY_SCAN_EXPERTS = 512


def default_iters(num_bins: int, slots: int) -> int:
    """Refinement rounds at most: enough for every bin to meet several partners; 5 re-split rounds
    on more than ``MANY_BINS`` GPUs (each round ends with up to ``PEAK_TRIES_MANY`` re-splits of the
    heaviest bin)."""
    if slots <= MAX_RESPLIT_SLOTS and num_bins > MANY_BINS:
        return 5
    return int(min(32, max(12, num_bins + 8)))


def _sources_digest() -> str:
    """SHA-256 of every module of this subpackage."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.name == "runner.py":
            continue  # it compiles nothing (it picks the compiled or the interpreted form)
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _package_cache_class() -> Any:
    """Numba's on-disk function cache, stamped with :func:`_sources_digest` instead of the one file
    that holds the function.

    Numba checks a cached function against its own source file only, but a compiled function holds
    the machine code of everything it calls, here spread over several modules: a change to a callee
    (an upgrade that keeps the caller's file) must not load stale machine code. None when Numba's
    cache classes are not where this expects them (then Numba's own cache is used).
    """
    try:
        from numba.core.caching import CompileResultCacheImpl, FunctionCache

        base_locators = list(CompileResultCacheImpl._locator_classes)
    except (ImportError, AttributeError):
        return None
    digest = _sources_digest()

    def stamped(locator: Any) -> type:
        def get_source_stamp(self: Any) -> Any:
            return (locator.get_source_stamp(self), digest)

        return type(locator.__name__, (locator,), {"get_source_stamp": get_source_stamp})

    impl = type(
        "PackageCacheImpl",
        (CompileResultCacheImpl,),
        {"_locator_classes": [stamped(c) for c in base_locators]},
    )
    return type("PackageFunctionCache", (FunctionCache,), {"_impl_class": impl})


_PACKAGE_CACHE = _package_cache_class()


# every compiled function of the planner, in definition order (the runner builds their interpreted forms)
REGISTRY: list[Any] = []
# False in compiled code, True in the interpreted forms (:mod:`eplb_core._numba.runner`): a few steps
# that are slow in the interpreter have an array-operation form, taken under ``if INTERPRETED:`` with
# the same result bit for bit (Numba drops the branch before compiling: the constant is False there)
INTERPRETED = False


def njit(fn: Callable[..., Any]) -> Any:
    """``numba.njit(cache=True, nogil=True)`` with the cache stamped by every module of the planner."""
    return _register(numba.njit(cache=True, nogil=True)(fn))


def njit_inline(fn: Callable[..., Any]) -> Any:
    """:func:`njit` for small helpers of hot loops, inlined by Numba into every compiled caller: a
    call of a compiled function costs a reference count update of each array it takes, often more
    than the helper's body."""
    return _register(numba.njit(cache=True, nogil=True, inline="always")(fn))


def _register(dispatcher: Any) -> Any:
    """Stamp the disk cache of ``dispatcher`` (see :func:`_package_cache_class`) and register it."""
    if _PACKAGE_CACHE is not None:
        dispatcher._cache = _PACKAGE_CACHE(dispatcher.py_func)
    REGISTRY.append(dispatcher)
    return dispatcher


@njit_inline
def _row_sum(a: np.ndarray, start: int, n: int) -> float:
    """``a[start:start + n].sum()`` with NumPy's summation order (pairwise, 8 accumulators; n <= 128)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[start + i]
        return res
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        p = start + i
        r0 += a[p]
        r1 += a[p + 1]
        r2 += a[p + 2]
        r3 += a[p + 3]
        r4 += a[p + 4]
        r5 += a[p + 5]
        r6 += a[p + 6]
        r7 += a[p + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[start + i]
        i += 1
    return res


@njit_inline
def _half_sum(a: np.ndarray, start: int, n: int) -> float:
    """A range of :func:`_pairwise_sum` one split down (up to 4 * 128 items without the stack)."""
    if n <= 128:
        return _row_sum(a, start, n)
    half = n // 2
    half -= half % 8
    if n - half <= 128:
        return _row_sum(a, start, half) + _row_sum(a, start + half, n - half)
    return _pairwise_stack(a, start, n)


@njit
def _pairwise_sum(a: np.ndarray, start: int, n: int) -> float:
    """``a[start:start + n].sum()`` in NumPy's pairwise order for any ``n``.

    NumPy sums blocks of up to 128 items with :func:`_row_sum` and splits longer ranges at half
    (rounded down to a multiple of 8), adding the two halves; two levels of splits are written out
    (no work arrays), deeper ones run on a small stack (:func:`_pairwise_stack`).
    """
    if n <= 128:
        return _row_sum(a, start, n)
    half = n // 2
    half -= half % 8
    return _half_sum(a, start, half) + _half_sum(a, start + half, n - half)


@njit
def _pairwise_stack(a: np.ndarray, start: int, n: int) -> float:
    """:func:`_pairwise_sum` with the recursion on a small stack (work arrays), for any ``n``."""
    if n <= 128:
        return _row_sum(a, start, n)
    # pending ranges (combine marks: both halves are on the value stack) and computed values
    at = np.empty(96, dtype=np.int64)
    size = np.empty(96, dtype=np.int64)
    combine = np.empty(96, dtype=np.bool_)
    vals = np.empty(64)
    at[0], size[0], combine[0] = start, n, False
    top, nv = 1, 0
    while top > 0:
        top -= 1
        st, m = at[top], size[top]
        if combine[top]:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
        elif m <= 128:
            vals[nv] = _row_sum(a, st, m)
            nv += 1
        else:
            half = m // 2
            half -= half % 8
            at[top], size[top], combine[top] = st, m, True
            at[top + 1], size[top + 1], combine[top + 1] = st + half, m - half, False
            at[top + 2], size[top + 2], combine[top + 2] = st, half, False
            top += 3
    return vals[0]


@njit
def log2phy(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``[L, N, max(logcnt)]`` physical slots of each expert, ascending, ``-1`` padded (``ValueError``
    when ``phy2log`` does not fit ``logcnt``)."""
    num_layers, num_replicas = phy2log.shape
    num_experts = logcnt.shape[1]
    width = max(1, logcnt.max())
    out = np.empty((num_layers, num_experts, width), dtype=np.int64)
    fill = np.zeros(num_experts, dtype=np.int64)
    for layer in range(num_layers):
        # a layer's block is padded just before its slots go in (one pass over the output, in cache)
        block = out[layer]
        block[:] = -1
        fill[:] = 0
        for p in range(num_replicas):
            e = phy2log[layer, p]
            if e < 0 or e >= num_experts or fill[e] >= width:
                raise ValueError("phy2log holds an expert id outside [0, N) or more replicas than logcnt")
            block[e, fill[e]] = p
            fill[e] += 1
    return out
