"""The public namespace and the tuning object (no process group needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ep_a2a
from ep_a2a import TritonTuning


def test_namespace_names_the_api_only() -> None:
    names = set(dir(ep_a2a))
    assert {"EPLayer", "EPAll2AllLayer", "TritonTuning", "EPProtocolError", "__version__"} <= names
    assert set(ep_a2a.__all__) <= names
    assert not names & {"version", "PackageNotFoundError", "annotations"}
    assert all(not n.startswith("_") or n == "__version__" for n in names)


def test_import_prints_nothing() -> None:
    run = subprocess.run([sys.executable, "-c", "import ep_a2a"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert "NumPy" not in run.stderr, run.stderr


def test_tuning_defaults_and_errors() -> None:
    t = TritonTuning()
    assert (t.num_sm, t.send_ctas, t.heap, t.copy_engine, t.pdl) == (None, None, None, False, True)
    assert t.for_device(132).num_sm == 132
    assert TritonTuning(num_sm=20).for_device(132).num_sm == 20
    assert TritonTuning(num_sm=132) == TritonTuning(num_sm=132)
    assert TritonTuning(num_sm=132).fingerprint() != t.fingerprint()
    with pytest.raises(TypeError):
        TritonTuning(132)  # type: ignore[misc]  (keyword-only)
    bad = {
        "num_sm": 0,
        "chunk": 3,
        "block_h": 0,
        "num_warps": -1,
        "send_ctas": 20,
        "combine_send_ctas": -2,
        "combine_maxnreg": 8,
        "heap": "shm",
        "ce_pieces": 0,
        "force_remote": 0,
    }
    for field, value in bad.items():
        with pytest.raises(ValueError, match=f"TritonTuning.{field}"):
            TritonTuning(num_sm=20, **{field: value}) if field != "num_sm" else TritonTuning(num_sm=value)
    with pytest.raises(ValueError, match="copy_engine=True leaves nothing"):
        TritonTuning(copy_engine=True, send_ctas=4)


def test_engine_options_follow_the_tuning() -> None:
    """The backend's launch options: the documented defaults, and explicit fields kept as given."""
    import torch

    from ep_a2a import EPConfig
    from ep_a2a.backends.triton import engine_options

    cfg = EPConfig(
        max_tokens=4096, hidden=7168, topk=8, num_tot_experts=256, rank=0, world_size=2, local_world_size=2
    )
    opts = engine_options(TritonTuning(num_sm=132), cfg, 132, remote=False)
    assert (opts["chunk"], opts["num_warps"], opts["block_h"]) == (8, 16, 1024)
    assert (opts["send_ctas"], opts["combine_send_ctas"], opts["steal"]) == (44, 66, True)
    assert (opts["ce_pieces"], opts["pdl"], opts["early_send"]) == (0, True, True)
    opts = engine_options(TritonTuning(num_sm=20, chunk=4, send_ctas=0), cfg, 20, remote=False)
    assert (opts["chunk"], opts["num_warps"], opts["block_h"], opts["send_ctas"]) == (4, None, None, 0)
    opts = engine_options(TritonTuning(copy_engine=True, ce_pieces=3), cfg, 132, remote=False)
    assert (opts["send_ctas"], opts["ce_pieces"]) == (0, 3)
    with pytest.raises(ValueError, match="copy_engine"):
        engine_options(TritonTuning(copy_engine=True), cfg, 132, remote=True)
    small = EPConfig(max_tokens=128, hidden=7168, topk=8, num_tot_experts=256, rank=0, world_size=2,
                     local_world_size=2, token_dtype=torch.bfloat16)  # fmt: skip
    assert engine_options(TritonTuning(), small, 20, remote=False)["chunk"] == 1
