"""Test setup shared by every package's tests when pytest runs from the workspace root.

Under ``TRITON_INTERPRET=1``, Triton's interpreter re-patches ``triton.language`` on every call of a
``@triton.jit`` helper from inside a kernel, although the kernel's launch has already patched the same
modules with the same builder for the whole launch; that rescan is a large share of the interpreted
tests' CPU time. :func:`_skip_repatching_inside_a_launch` makes such a nested call reuse the
launch's patches; a helper whose module sees a language module the launch did not patch is patched as
before, and nothing changes outside the interpreter.
"""

from __future__ import annotations

import os
from typing import Any


def _skip_repatching_inside_a_launch() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "_reuses_launch_patches", False):
        return
    lang_modules = (interpreter.tl, interpreter.tl.core)
    patched: set[int] = set()  # ids of the language modules the running launch patched

    langs_by_fn: dict[Any, frozenset[int]] = {}

    def langs_of(fn: Any) -> frozenset[int]:
        if fn not in langs_by_fn:
            langs_by_fn[fn] = frozenset(
                id(m) for m in lang_modules if any(v is m for v in fn.__globals__.values())
            )
        return langs_by_fn[fn]

    def patch_lang(fn: Any) -> Any:
        langs = langs_of(fn)
        if patched and langs <= patched:  # a helper called inside a launch: already patched
            return scope_type()
        scope = original(fn)
        if patched:  # a helper that sees another language module: patched as the interpreter does
            patched.update(langs)
            return scope
        patched.update(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang._reuses_launch_patches = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_repatching_inside_a_launch()
