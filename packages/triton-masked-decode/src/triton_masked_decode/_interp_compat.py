"""Triton interpreter fix-up for NumPy >= 2.3 (only active under ``TRITON_INTERPRET=1``).

The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``, which NumPy 2.3
turned into an error; loop bounds read at run time (``range(lo, hi)``) then fail. This wraps the
interpreter's tensor patching so that ``__index__`` goes through ``.item()``. Compiled kernels are
untouched.
"""

from __future__ import annotations

import os


def install() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tmd_wrapped", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tmd_wrapped = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
