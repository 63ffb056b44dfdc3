"""Helpers shared by the package's modules: the interpreter switch and device queries."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when the kernels are defined, at import: so is it read here.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Every launch: fused multiply-add as the kernels are tuned and tested, whatever Triton's default (off in 3.10).
ENABLE_FP_FUSION = True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _INTERPRET


def install_interpreter_fix() -> None:
    """Triton interpreter fix-up for NumPy >= 2.3 (only active under ``TRITON_INTERPRET=1``).

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``, which NumPy
    2.3 turned into an error; loop bounds read at run time (``range(lo, hi)``) then fail. This wraps the
    interpreter's tensor patching so that ``__index__`` reads the element. Compiled kernels are untouched.
    """
    if not interpreting():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tmd_wrapped", False):
        return

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, *scope):  # Triton < 3.4 passes no scope and patches the class itself
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._tmd_wrapped = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_CUDA_PROPERTIES: dict[int, tuple[int, tuple[int, int], str]] = {}


def _cuda_properties(index: int) -> tuple[int, tuple[int, int], str]:
    """(SM count, capability, name) of a CUDA device, queried once."""
    props = _CUDA_PROPERTIES.get(index)
    if props is None:
        p = torch.cuda.get_device_properties(index)
        props = _CUDA_PROPERTIES[index] = (p.multi_processor_count, (p.major, p.minor), p.name)
    return props


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for CPU tensors (the interpreter), so splits still occur."""
    if device.type != "cuda":
        return 4
    return _cuda_properties(_cuda_index(device))[0]


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability of ``device``; ``(0, 0)`` for CPU tensors."""
    if device.type != "cuda":
        return (0, 0)
    return _cuda_properties(_cuda_index(device))[1]


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of ``device``; ``"cpu"`` for CPU tensors."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_properties(_cuda_index(device))[2]
