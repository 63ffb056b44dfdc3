"""Which implementation runs a call of the planner: its compiled or its interpreted form.

The planner is one algorithm written once, as the functions of this subpackage; it runs two ways: as
machine code compiled by Numba (cached on disk), and as the same functions run by the Python
interpreter over the same NumPy arrays. Both give the same plans, bit for bit (the tests compare them).

A call of an entry point (:func:`call`) runs the compiled form when it is in this process or in the
disk cache. When it is not (the first use in a fresh environment, where compiling would keep the call
waiting far longer than the interpreted form takes), the call runs the interpreted form, and then a
background thread compiles the entry point into the disk cache; calls switch to the compiled form when
it is ready. ``python -m eplb_core.warmup`` compiles every entry point ahead of time.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from eplb_core._numba import utils

__all__ = ["call", "forced", "interpreted", "wait_compiled"]

# "auto" (compiled when ready, else interpreted while compiling in the background), "compiled"
# (compile in the caller when needed) or "interpreted"; only the tests and warmup change it
_mode = "auto"
_lock = threading.Lock()
_twins: dict[int, Callable[..., Any]] = {}
_jobs: queue.Queue[tuple[Any, tuple[Any, ...]]] = queue.Queue()
_pending: set[tuple[int, tuple[Any, ...]]] = set()
_failed: set[tuple[int, tuple[Any, ...]]] = set()
# (entry point, quick key of the arguments) whose compiled form is in this process
_ready: set[tuple[int, Any]] = set()
_worker: threading.Thread | None = None
_announced = False
# calls of an entry point that ran interpreted in this process (the CLI labels its timings with it)
interpreted_calls = 0


def _build_twins() -> None:
    """The interpreted form of every compiled function: its Python function with a copy of its module's
    globals in which every compiled function is replaced by its interpreted form and ``INTERPRETED``
    is True."""
    modules: dict[str, dict[str, Any]] = {}
    for dispatcher in utils.REGISTRY:
        fn = dispatcher.py_func
        env = modules.setdefault(fn.__module__, {**fn.__globals__, "INTERPRETED": True})
        twin = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
        twin.__qualname__ = fn.__qualname__
        twin.__doc__ = fn.__doc__
        _twins[id(dispatcher)] = twin
    for env in modules.values():
        for name, value in list(env.items()):
            if id(value) in _twins:
                env[name] = _twins[id(value)]


def interpreted(dispatcher: Any) -> Callable[..., Any]:
    """The interpreted form of a compiled function of the planner."""
    with _lock:
        if not _twins:
            _build_twins()
    return _twins[id(dispatcher)]


def _signature(dispatcher: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(dispatcher.typeof_pyval(a) for a in args)


def _quick_key(a: Any) -> Any:
    """What Numba's type of an argument depends on, cheap to compute (typing an array costs tens of
    microseconds): dtype, dimensions, layout and flags of an array, the type of anything else."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return (a.dtype.str, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    if isinstance(a, tuple):
        return tuple(_quick_key(x) for x in a)
    return type(a)


def _in_disk_cache(dispatcher: Any, sig: tuple[Any, ...]) -> bool:
    """Whether Numba's disk cache holds machine code of ``dispatcher`` for ``sig`` (False when that
    cannot be told: then it is compiled in the background, and loaded from the cache there if present)."""
    try:
        cache = dispatcher._cache
        key = cache._index_key(sig, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # Numba internals moved, or no usable cache: not known
        return False


def _work() -> None:
    """The background thread: compile the queued entry points (or load them from the disk cache)."""
    global _worker
    with contextlib.suppress(AttributeError, OSError):
        # a lower scheduling priority for this thread only (Linux): the compiler yields the CPU
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    while True:
        with _lock:
            if _jobs.empty():
                _worker = None
                return
            dispatcher, sig = _jobs.get_nowait()
        key = (id(dispatcher), sig)
        try:
            dispatcher.compile(sig)
        except Exception as exc:  # reported; the interpreted form keeps serving
            with _lock:
                _failed.add(key)
            print(
                f"eplb-core: compiling {dispatcher.py_func.__name__} failed ({exc!r}); the planner keeps "
                "running interpreted (the same plans, slower)",
                file=sys.stderr,
                flush=True,
            )
        with _lock:
            _pending.discard(key)


def _announce() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    print(
        "eplb-core: the compiled planner is not in this environment's cache yet; it compiles in a "
        "background thread (once per environment, about a minute of one CPU core) and plans come from "
        "the same planner run by the Python interpreter until then (the same plans, about a second each); "
        "`python -m eplb_core.warmup` compiles it ahead of time",
        file=sys.stderr,
        flush=True,
    )


def call(dispatcher: Any, *args: Any) -> Any:
    """Run ``dispatcher(*args)`` compiled when ready, interpreted otherwise (see the module)."""
    global interpreted_calls
    if _mode == "interpreted":
        interpreted_calls += 1
        return interpreted(dispatcher)(*args)
    if _mode == "compiled":
        return dispatcher(*args)
    quick = (id(dispatcher), _quick_key(args))
    if quick in _ready:
        return dispatcher(*args)
    sig = _signature(dispatcher, args)
    if sig in dispatcher.overloads:
        _ready.add(quick)
        return dispatcher(*args)
    key = (id(dispatcher), sig)
    with _lock:
        load = _worker is None and key not in _failed and _in_disk_cache(dispatcher, sig)
    if load:
        return dispatcher(*args)  # loads the machine code from the disk cache
    _announce()
    interpreted_calls += 1
    try:
        return interpreted(dispatcher)(*args)
    finally:
        # compiled after this call: the first call runs alone, not beside the compiler
        _queue(dispatcher, sig)


def _queue(dispatcher: Any, sig: tuple[Any, ...]) -> None:
    """Queue ``dispatcher`` for ``sig`` on the background thread (started if it is not running)."""
    global _worker
    key = (id(dispatcher), sig)
    with _lock:
        if key in _pending or key in _failed:
            return
        _pending.add(key)
        _jobs.put((dispatcher, sig))
        if _worker is None:
            _worker = threading.Thread(target=_work, name="eplb-core-compile", daemon=True)
            _worker.start()


def wait_compiled(timeout: float | None = None) -> bool:
    """Wait for the background compiles; returns whether none is left."""
    worker = _worker
    if worker is not None:
        worker.join(timeout)
    return _worker is None or not _worker.is_alive()


@contextlib.contextmanager
def forced(mode: str) -> Iterator[None]:
    """Within the block every call runs ``mode`` (``"compiled"`` or ``"interpreted"``)."""
    global _mode
    assert mode in ("auto", "compiled", "interpreted")
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before
