"""Random problem generators shared by the tests, the benchmarks and the demo.

Indices are drawn without repetition per query (like an indexer's top-k), optionally sprinkled with
invalid entries; KV rows that no valid index selects can be poisoned with NaN so that a kernel that reads
a row it should skip produces NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def random_indices(
    s_q: int,
    s_kv: int,
    topk: int,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """``[s_q, 1, topk]`` int32 indices, distinct within each row when ``topk <= s_kv``.

    Rows are drawn as the top-k of uniform noise, ``chunk`` rows at a time (bounded memory at s_kv 128K).
    When ``topk > s_kv`` the extra slots are filled with -1.
    """
    out = torch.full((s_q, 1, topk), -1, dtype=torch.int32, device=device)
    k = min(topk, s_kv)
    for s0 in range(0, s_q, chunk):
        s1 = min(s0 + chunk, s_q)
        noise = torch.rand(s1 - s0, s_kv, device=device, generator=generator)
        out[s0:s1, 0, :k] = noise.topk(k, dim=-1).indices.int()
    return out


def random_problem(
    s_q: int,
    h_q: int,
    d_qk: int,
    s_kv: int,
    topk: int,
    *,
    device: torch.device | str,
    seed: int,
    invalid_frac: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]`` and :func:`random_indices`, with a fraction of the
    indices replaced by invalid ones (:func:`sprinkle_invalid`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, device=device, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, device=device, generator=g).bfloat16()
    idx = random_indices(s_q, s_kv, topk, device=device, generator=g)
    if invalid_frac:
        idx = sprinkle_invalid(idx, s_kv, invalid_frac, generator=g)
    return q, kv, idx


def poison_unselected(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``kv [s_kv, 1, d]`` whose rows that no in-range index selects are NaN."""
    s_kv = kv.shape[0]
    idx = indices.flatten().long()
    idx = idx[(idx >= 0) & (idx < s_kv)]
    used = torch.zeros(s_kv, dtype=torch.bool, device=kv.device)
    used[idx] = True
    return kv.masked_fill(~used[:, None, None], float("nan"))


def sprinkle_invalid(
    indices: torch.Tensor, s_kv: int, frac: float, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Replace a fraction of entries by invalid values (-1, s_kv, s_kv + 7, 2**31 - 1, -2**31)."""
    zoo = torch.tensor([-1, s_kv, s_kv + 7, 2**31 - 1, -(2**31)], dtype=torch.int64, device=indices.device)
    pick = torch.rand(indices.shape, device=indices.device, generator=generator) < frac
    which = torch.randint(0, len(zoo), indices.shape, device=indices.device, generator=generator)
    return torch.where(pick, zoo[which], indices.long()).to(torch.int32)


def kernel_test_device() -> str:
    """Device on which the kernels can run here: ``"cpu"`` under ``TRITON_INTERPRET=1``, else ``"cuda"``.

    Raises:
        RuntimeError: neither the interpreter is on nor a GPU is present.
    """
    from sparse_mla_attn._runtime import interpreting

    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    raise RuntimeError(
        "the kernels need a GPU, or TRITON_INTERPRET=1 on a CPU-only machine (nox -s tests sets it)"
    )


_ID_LETTERS = {"s_q": "S", "h_q": "H", "d_qk": "D", "s_kv": "K", "topk": "T"}


def case_ids(names: Sequence[str], cases: Iterable[Sequence[object]]) -> list[str]:
    """Test ids of the parameter tuples ``cases`` whose leading fields are named ``names``.

    A string field stands as it is, a shape field as its letter and value (``s_kv`` in units of 1024 when a
    whole multiple): ``("backend", "h_q", "d_qk", "topk")`` gives ``"gluon-H128-D576-T1000"``, ``("s_q",
    "h_q", "s_kv", "topk")`` gives ``"S256-H128-K8K-T2048"``. Fields past ``names`` are left out of the id.
    """
    return [
        "-".join(_id_part(name, value) for name, value in zip(names, case, strict=False)) for case in cases
    ]


def _id_part(name: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if name == "s_kv" and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        return f"K{value // 1024}K"
    return f"{_ID_LETTERS[name]}{value}"


def gluon_skip_reason(backend: str) -> str | None:
    """Why a test of ``backend`` cannot run here (the Gluon kernels need an sm_90 GPU), else None."""
    from sparse_mla_attn._runtime import is_sm90

    if backend == "gluon" and not (torch.cuda.is_available() and is_sm90(torch.device("cuda"))):
        return "the Gluon kernels need an sm_90 GPU (H100/H200)"
    return None
