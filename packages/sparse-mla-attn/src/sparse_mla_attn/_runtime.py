"""Runtime helpers shared by every op: interpreter check, device queries, custom-op registration and the
registry of the latest kernel launch per op (read by the benchmarks and the GPU tests)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

F = TypeVar("F", bound=Callable[..., Any])


def _triton_interprets() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # Triton without knobs: the variable as Triton reads it
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Triton decides when a kernel is defined (at import) whether it is interpreted, so that decision is the one
# that counts for this package's kernels; a later change of TRITON_INTERPRET does not affect them.
_INTERPRETING = _triton_interprets()
#: Whether the kernels run under the interpreter, as a constant the kernels can read.
INTERPRETER = tl.constexpr(_INTERPRETING)


def interpreting() -> bool:
    """True when this package's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` set when
    the package was imported, as Triton reads it)."""
    return _INTERPRETING


@triton.jit
def mask_and(block_mask, scalar):
    """``block_mask & scalar`` for a block mask and a scalar condition. The interpreter of Triton 3.9
    rejects that ``&`` as a load / store mask ("mask has unsupported dtype"), so it gets the same mask
    through ``tl.where``; compiled kernels keep the ``&``."""
    if INTERPRETER:
        return tl.where(scalar, block_mask, False)
    else:
        return block_mask & scalar


@triton.jit
def dot(a, b, acc=None):
    """``tl.dot(a, b, acc)``; under the interpreter, whose bf16 products are wrong (numpy has no bf16), the
    operands are multiplied in float32."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def causal_max_k(q_pos, k_stride):
    """Largest KV index visible from query position ``q_pos >= 0`` under the causal rule:
    ``(q_pos + 1 - k_stride) / k_stride`` with C truncation, i.e. 0 while the numerator is negative
    (:func:`sparse_mla_attn._validate.causal_limit` on the host)."""
    return tl.maximum(q_pos + 1 - k_stride, 0) // k_stride


@triton.jit
def causal_hi(s_kv, q_pos, k_stride, CAUSAL: tl.constexpr):
    """Exclusive upper bound of the valid KV indices of the query at ``q_pos``: ``s_kv``, and with
    ``CAUSAL`` at most :func:`causal_max_k` ``+ 1``."""
    hi = s_kv
    if CAUSAL:
        hi = tl.minimum(hi, causal_max_k(q_pos, k_stride) + 1)
    return hi


def check_kernel_device(t: torch.Tensor, what: str) -> None:
    """Raise ValueError unless ``t`` can feed a kernel: a CUDA tensor, or a CPU tensor under the interpreter."""
    if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
        raise ValueError(
            f"{what}: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got device {t.device}; use the sparse_mla_attn.reference functions on other devices"
        )


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 for any other device)."""
    return _num_sms(_device_index(device)) if device.type == "cuda" else 0


@functools.lru_cache(maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))  # type: ignore[return-value]


def is_sm90(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.0 (H100, H200)."""
    return device.type == "cuda" and _capability(_device_index(device)) == (9, 0)


@dataclass(frozen=True)
class Launch:
    """What the latest launch of an op ran: its compiled kernel (``None`` under the interpreter), the kernel
    family (``"gluon"`` or ``"triton"``) and the split-K factor (forward and decode)."""

    kernel: Any
    backend: str = "triton"
    splits: int = 1


_LAUNCHES: dict[str, Launch] = {}


def record_launch(name: str, kernel: Any, *, backend: str = "triton", splits: int = 1) -> None:
    """Remember the latest launch of kernel ``name`` (e.g. ``"fwd"``, ``"attn_dist"``, ``"bwd.main"``)."""
    _LAUNCHES[name] = Launch(kernel, backend, splits)


def last_launch(name: str) -> Launch | None:
    """The latest launch recorded under ``name`` in this process, if any."""
    return _LAUNCHES.get(name)


def launches() -> dict[str, Launch]:
    """All launches recorded in this process, by name."""
    return dict(_LAUNCHES)


def define_op(name: str, fake: Callable[..., Any]) -> Callable[[F], F]:
    """Register the decorated function as the custom op ``sparse_mla_attn::<name>`` with its fake (meta)
    implementation ``fake`` (which receives the op's arguments and returns empty outputs)."""

    def register(fn: F) -> F:
        op = torch.library.custom_op(f"sparse_mla_attn::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        return fn

    return register
