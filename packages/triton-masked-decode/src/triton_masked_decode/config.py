"""The tuning object of :func:`~triton_masked_decode.masked_decode` and its tuned default table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from triton_masked_decode import _tuned

__all__ = ["LaunchClassDefaults", "MaskedDecodeConfig", "TunedDefaults", "tuned_defaults"]

_PATHS = ("auto", "dense", "sparse")


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True, kw_only=True)
class MaskedDecodeConfig:
    """Launch knobs of :func:`~triton_masked_decode.masked_decode`; every default is the tuned choice.

    None of these changes the result beyond floating-point rounding: they choose how the work is split
    and which loop runs it. A field left at ``None`` takes the value of :func:`tuned_defaults` for the
    device and the launch's class (``"one_wave"`` when every program of the launch fits on the GPU at
    once, as at small batch; ``"multi_wave"`` otherwise).

    Attributes:
        path: ``"auto"`` (default) lets each split choose on the device between the sparse loop (gather the
            visible rows) and the dense loop (walk the chunk, loads predicated on the mask) by its visible
            fraction; ``"dense"`` / ``"sparse"`` force one loop. Without a mask the dense loop runs.
        sparse_threshold: largest visible fraction of a split that takes the sparse loop under
            ``path="auto"``, in ``[0, 1]``. At 1 (the tuned default of both classes) every split with a
            mask takes the sparse loop and the kernel is compiled without the dense loop.
        num_splits: KV splits per (sequence, KV head); default from shapes and the SM count
            (:func:`~triton_masked_decode.choose_num_splits`).
        programs_per_sm: programs per SM the split count aims at when the batch alone does not fill the
            GPU (default 4).
        max_chunk: most positions per split (default 2048 with a mask, 4096 without).
        block_n, num_warps, num_stages: dense-loop tile (positions per step, warps, pipelining depth).
            Default: autotuned per shape class on the first call when the dense loop can run (GPU), else
            64 x 4 warps x 3 stages at head dim 128. Setting any of them fixes the tile (no autotuning).
        block_ns, sparse_stages: sparse-loop gather tile (visible rows per step, pipelining depth); default
            64 rows (scaled to keep the bytes of a tile at other head dims; half as many rows for an FP8
            cache) with 2 stages for one-wave and 3 for multi-wave launches.
        block_c: mask positions compacted per step of the sparse loop's index pass (power of two; default
            the split length, at most 2048).
        merge_splits: partial results per query head that the last split of a (sequence, KV head) merges
            per step in one-launch (eager) calls (power of two; default: 4096 to 8192 values per step over
            the group's query heads). Calls captured into a CUDA graph merge in a separate kernel.
        autotune: allow autotuning of the dense-loop tile on GPU (default True).

    Raises:
        ValueError: a field out of its range (the message names it).
    """

    path: Literal["auto", "dense", "sparse"] = "auto"
    sparse_threshold: float | None = None
    num_splits: int | None = None
    programs_per_sm: int | None = None
    max_chunk: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    block_ns: int | None = None
    sparse_stages: int | None = None
    block_c: int | None = None
    merge_splits: int | None = None
    autotune: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> None:
            raise ValueError(f"MaskedDecodeConfig: {name} must be {want}, got {getattr(self, name)!r}")

        if self.path not in _PATHS:
            bad("path", f"one of {_PATHS}")
        if self.sparse_threshold is not None and not 0.0 <= self.sparse_threshold <= 1.0:
            bad("sparse_threshold", "in [0, 1] or None")
        for name in ("num_splits", "programs_per_sm", "max_chunk", "num_stages", "sparse_stages"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                bad(name, "an int >= 1 or None")
        for name in ("block_n", "block_ns", "block_c", "num_warps", "merge_splits"):
            val = getattr(self, name)
            if val is not None and (
                isinstance(val, bool) or not isinstance(val, int) or not _power_of_two(val)
            ):
                bad(name, "a power of two")
        for name, lo in (("block_n", 16), ("block_ns", 16), ("block_c", 16)):
            val = getattr(self, name)
            if val is not None and val < lo:
                bad(name, f">= {lo}")

    @property
    def fixed_dense_tile(self) -> bool:
        """Whether the dense-loop tile is set by hand (then it is never autotuned)."""
        return (self.block_n, self.num_warps, self.num_stages) != (None, None, None)


@dataclass(frozen=True)
class LaunchClassDefaults:
    """Tuned defaults of one launch class: the gather tile at head dim 128 and the sparse threshold."""

    block_ns: int
    sparse_stages: int
    sparse_threshold: float


@dataclass(frozen=True)
class TunedDefaults:
    """Tuned defaults of one device (see :func:`tuned_defaults`)."""

    measured_on: str
    programs_per_sm: int
    max_chunk_masked: int
    one_wave: LaunchClassDefaults
    multi_wave: LaunchClassDefaults


def tuned_defaults(device_name: str = "default") -> TunedDefaults:
    """The tuned defaults for a device name (``torch.cuda.get_device_name()``), or the ``"default"``
    entry (measured on an H100) for a device without its own.

    These are the values a :class:`MaskedDecodeConfig` field left at ``None`` takes; they are written by
    ``benchmarks/tune_masked_decode.py --write-defaults``.
    """
    raw = _tuned.TUNED.get(device_name, _tuned.TUNED["default"])
    return TunedDefaults(
        measured_on=str(raw["measured_on"]),
        programs_per_sm=int(raw["programs_per_sm"]),  # type: ignore[call-overload]
        max_chunk_masked=int(raw["max_chunk_masked"]),  # type: ignore[call-overload]
        one_wave=LaunchClassDefaults(**raw["one_wave"]),  # type: ignore[arg-type]
        multi_wave=LaunchClassDefaults(**raw["multi_wave"]),  # type: ignore[arg-type]
    )
