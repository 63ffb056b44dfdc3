"""Reading load statistics and writing placements in the forms serving systems use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb_core.placement import Placement

__all__ = ["load_loads", "physical_to_logical_load", "save_sglang", "to_sglang_dict", "zero_layers"]


def _from_obj(obj: Any, source: str) -> torch.Tensor:
    if isinstance(obj, dict):
        for key in ("logical_count", "expert_load", "weight", "loads"):
            if key in obj:
                return _from_obj(obj[key], f"{source}[{key!r}]")
        raise ValueError(
            f"path {source!r}: a dict needs a 'logical_count' (SGLang) or 'expert_load' entry, got keys {sorted(obj)}"
        )
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", torch.float64)
    try:
        return torch.as_tensor(np.asarray(obj, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"path {source!r}: cannot read a numeric load matrix ({exc})") from exc


def _first_array(path: Path) -> torch.Tensor:
    with np.load(path) as z:
        if not z.files:
            raise ValueError("the archive holds no array")
        return torch.as_tensor(z[z.files[0]].astype(np.float64))


def load_loads(path: str | Path) -> torch.Tensor:
    """Read expert loads from a file.

    Accepted forms (by extension):

    * ``.json``: SGLang expert-distribution dumps ``{"logical_count": [[...]]}``, any dict with an
      ``expert_load``/``weight``/``loads`` entry, or a bare nested list;
    * ``.pt``/``.pth``: a tensor, or a dict as above (SGLang's ``.pt`` dumps, a saved vLLM load tensor);
    * ``.npy``/``.npz`` (first array), ``.csv`` (one layer per row, comma separated, ``#`` comments).

    Returns:
        float64 CPU tensor, ``[L, N]`` or a history ``[T, L, N]`` (e.g. SGLang per-step or vLLM windowed
        statistics); ``[N]`` is read as one layer.

    Raises:
        ValueError: naming the file, when it is missing, has another extension, cannot be read in its
            format (truncated, empty, foreign), or holds no ``[L, N]`` / ``[T, L, N]`` numbers.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"path {str(p)!r} does not exist or is not a file")
    suffix = p.suffix.lower()
    readers = {
        ".json": lambda: _from_obj(json.loads(p.read_text()), str(p)),
        ".pt": lambda: _from_obj(torch.load(p, map_location="cpu", weights_only=True), str(p)),
        ".npy": lambda: torch.as_tensor(np.load(p).astype(np.float64)),
        ".npz": lambda: _first_array(p),
        ".csv": lambda: torch.as_tensor(
            np.loadtxt(p, delimiter=",", comments="#", ndmin=2, dtype=np.float64)
        ),
    }
    readers[".pth"] = readers[".pt"]
    if suffix not in readers:
        raise ValueError(
            f"path {str(p)!r}: unknown extension {suffix!r} (use .json, .pt, .npy, .npz or .csv)"
        )
    try:
        t = readers[suffix]()
    except ValueError as exc:
        if str(p) in str(exc):
            raise
        raise ValueError(f"path {str(p)!r}: cannot read a {suffix} load file ({exc})") from exc
    except Exception as exc:  # a truncated or foreign file fails in many ways inside the readers
        first_line = next(iter(str(exc).strip().splitlines()), "")
        raise ValueError(
            f"path {str(p)!r}: cannot read a {suffix} load file ({type(exc).__name__}: {first_line})"
        ) from exc
    if not t.is_floating_point() and t.dtype not in (
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    ):
        raise ValueError(f"path {str(p)!r}: loads must be real numbers, got dtype {t.dtype}")
    t = t.to(torch.float64)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() not in (2, 3):
        raise ValueError(f"path {str(p)!r}: loads must be [L, N] or [T, L, N], got shape {tuple(t.shape)}")
    return t


def physical_to_logical_load(physical_load: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
    """Logical loads from per-physical-slot loads (vLLM records its expert load per physical expert).

    Args:
        physical_load: ``[L, R]`` or ``[T, L, R]`` tokens per physical slot.
        phy2log: ``[L, R]`` int64 mapping the loads were recorded under.

    Returns:
        ``[L, N]`` (or ``[T, L, N]``) float64 with ``N = phy2log.max() + 1``.
    """
    load = torch.as_tensor(physical_load).to(torch.float64)
    phy = torch.as_tensor(phy2log).to(torch.int64)
    if phy.dim() != 2:
        raise ValueError(f"phy2log must be [L, R], got shape {tuple(phy.shape)}")
    if load.shape[-2:] != phy.shape:
        raise ValueError(f"physical_load must end in {tuple(phy.shape)}, got shape {tuple(load.shape)}")
    num_logical = int(phy.max()) + 1
    idx = phy.expand_as(load)
    out = torch.zeros(*load.shape[:-1], num_logical, dtype=torch.float64)
    return out.scatter_add_(-1, idx, load)


def zero_layers(weight: torch.Tensor) -> list[int]:
    """Indices of layers whose load is all zero (dense layers, or layers that saw no traffic)."""
    w = torch.as_tensor(weight)
    return torch.nonzero(w.reshape(-1, w.shape[-2], w.shape[-1]).sum((0, 2)) == 0).flatten().tolist()


def to_sglang_dict(placement: Placement) -> dict[str, Any]:
    """The dict SGLang's ``--init-expert-location`` reads: ``{"physical_to_logical_map": [[...]]}``."""
    return {"physical_to_logical_map": placement.phy2log.cpu().tolist()}


def save_sglang(placement: Placement, path: str | Path) -> None:
    """Write ``placement`` for ``sglang.launch_server --init-expert-location PATH`` (.json or .pt).

    SGLang rebuilds ``logical_to_all_physical_map`` from the mapping. Its physical expert ``p`` lives on
    EP rank ``p // (R / ep_size)``, the GPU-major layout of this package, so ``num_gpus`` must equal
    SGLang's ``ep_size`` and ``R = num_logical + ep_num_redundant_experts``.
    """
    p = Path(path)
    data = to_sglang_dict(placement)
    if p.suffix.lower() == ".pt":
        torch.save({"physical_to_logical_map": placement.phy2log.cpu()}, p)
    elif p.suffix.lower() == ".json":
        p.write_text(json.dumps(data))
    else:
        raise ValueError(f"path {str(p)!r}: use a .json or .pt file name")
