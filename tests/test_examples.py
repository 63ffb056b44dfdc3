"""Every ```python block in the packages' READMEs and documentation pages runs as pasted.

Blocks of one file run in order in one namespace, in a fresh interpreter whose working directory is an
empty temporary folder, with ``TRITON_INTERPRET=1`` so that Triton kernels run on the CPU. An HTML comment
on the line before a block changes how it runs:

- ``<!-- example: gpu -->``: needs a CUDA GPU; runs (with the file's other blocks) only under the ``gpu``
  marker, with the GPU's own Triton.
- ``<!-- example: torchrun N -->``: a whole program for N processes; it runs alone under
  ``python -m torch.distributed.run --nproc-per-node N`` and picks its own backend (gloo without CUDA).

``EXAMPLES_PACKAGE=<distribution>`` restricts the run to one package's files (the nox sessions set it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["eplb-core", "triton-masked-decode", "sparse-mla-attn", "ep-a2a"]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`\n]*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*example:\s*(?P<kind>gpu|torchrun\s+(?P<nproc>\d+))\s*-->\s*$")
TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first code line
    code: str
    gpu: bool
    nproc: int  # > 0: a torchrun program for this many processes


def parse_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file with the directive on the line before each, if any."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if info.split()[:1] == ["python"]:
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            d = DIRECTIVE.match(prev)
            code = "\n".join(ln[indent:] for ln in lines[i + 1 : j])
            nproc = int(d["nproc"]) if d and d["nproc"] else 0
            blocks.append(Block(path, i + 2, code + "\n", gpu=bool(d and d["kind"] == "gpu"), nproc=nproc))
        i = j + 1
    return blocks


def example_files(package: str) -> list[Path]:
    files = [ROOT / "packages" / package / "README.md", *sorted((ROOT / "docs" / package).glob("*.md"))]
    return [f for f in files if f.exists()]


def _selected_packages() -> list[str]:
    only = os.environ.get("EXAMPLES_PACKAGE")
    if only and only not in PACKAGES:
        raise ValueError(f"EXAMPLES_PACKAGE={only!r}: expected one of {PACKAGES}")
    return [only] if only else PACKAGES


def _cases() -> list:
    cases = []
    for package in _selected_packages():
        for path in example_files(package):
            blocks = parse_blocks(path)
            rel = path.relative_to(ROOT).as_posix()
            in_process = [b for b in blocks if not b.nproc]
            if in_process:
                gpu = any(b.gpu for b in in_process)
                marks = [pytest.mark.gpu] if gpu else []
                cases.append(pytest.param(in_process, id=rel, marks=marks))
            for b in blocks:
                if b.nproc:
                    marks = [pytest.mark.gpu] if b.gpu else []
                    cases.append(pytest.param([b], id=f"{rel}:{b.line}", marks=marks))
    return cases


def _program(blocks: list[Block]) -> str:
    """One script that compiles each block under its own file name and line, so tracebacks point at the page."""
    parts = ["ns = {'__name__': '__main__'}"]
    for b in blocks:
        source = "\n" * (b.line - 1) + b.code
        parts.append(f"exec(compile({source!r}, {str(b.path)!r}, 'exec'), ns)")
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("blocks", _cases())
def test_examples_run_as_pasted(blocks: list[Block], tmp_path: Path) -> None:
    env = dict(os.environ)
    if not blocks[0].gpu:
        env["TRITON_INTERPRET"] = "1"
    script = tmp_path / "example.py"
    if blocks[0].nproc:
        script.write_text("\n" * (blocks[0].line - 1) + blocks[0].code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={blocks[0].nproc}", str(script)]
    else:
        script.write_text(_program(blocks))
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def test_parser_sees_directives(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- example: gpu -->\n```python\ny = 2\n```\n"
        "<!-- example: torchrun 2 -->\n\n```python\nz = 3\n```\n```text\nnot python\n```\n"
    )
    blocks = parse_blocks(page)
    assert [(b.line, b.code, b.gpu, b.nproc) for b in blocks] == [
        (2, "x = 1\n", False, 0),
        (7, "y = 2\n", True, 0),
        (12, "z = 3\n", False, 2),
    ]
