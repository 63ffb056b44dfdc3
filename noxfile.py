"""Sessions for the whole workspace: `uv run nox -l` lists them.

CPU sessions (tests, lint, docs, build, demo) make their own uv environments from `uv.lock`.
GPU sessions (gpu, multigpu, bench) run on the current interpreter, whose torch/triton must already be
CUDA builds (a GPU machine's image): they put the packages' `src/` folders on PYTHONPATH instead of
installing anything, so the machine's torch is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "docs", "build"]
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
# distribution name -> import name
PACKAGES = {
    "eplb-core": "eplb_core",
    "triton-masked-decode": "triton_masked_decode",
    "sparse-mla-attn": "sparse_mla_attn",
    "ep-a2a": "ep_a2a",
}
CPU_MARKERS = "not gpu and not multigpu"
# Extras a package's own tests exercise (eplb-core's CLI tests need its `cli` extra).
TEST_EXTRAS = {"eplb-core": ["cli"]}
# Multi-GPU machines of this project must keep NVLink multicast off (see CONTRIBUTING in docs/).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _sync(session: nox.Session, *args: str) -> None:
    """Install from the lockfile into the session's environment (never re-resolves)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location, "UV_PYTHON_DOWNLOADS": "never"},
    )


def _src_path() -> str:
    return os.pathsep.join(str(ROOT / "packages" / dist / "src") for dist in PACKAGES)


def _current_python_env(session: nox.Session) -> None:
    """GPU sessions: use the machine's interpreter and the working tree's sources."""
    session.env["PYTHONPATH"] = os.pathsep.join(filter(None, [_src_path(), os.environ.get("PYTHONPATH")]))
    session.env.update(NO_MULTICAST)


def _pytest_selected(session: nox.Session, dist: str, marker: str, *extra: str) -> None:
    """Run pytest; exit code 5 (nothing selected) is reported, not hidden and not a failure."""
    code = session.run(
        "python",
        "-m",
        "pytest",
        f"packages/{dist}/tests",
        "-m",
        marker,
        *extra,
        *session.posargs,
        success_codes=[0, 5],
    )
    if code == 5:
        session.log(f"{dist}: no test is marked for this session ({marker!r})")


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """CPU tests of one package: Triton kernels under TRITON_INTERPRET=1, distributed code on gloo."""
    extras = [arg for extra in TEST_EXTRAS.get(package, []) for arg in ("--extra", extra)]
    _sync(session, "--package", package, "--group", "test", *extras)
    session.env["TRITON_INTERPRET"] = "1"
    # Property tests draw the same examples on every run of this session (a landing must not hinge on a
    # lucky draw); HYPOTHESIS_SEED picks another set, and plain pytest runs draw fresh ones.
    seed = os.environ.get("HYPOTHESIS_SEED", "0")
    # Tests that need a GPU are deselected by marker; pytest's summary prints how many ('N deselected').
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/{package}/tests",
        "-m",
        CPU_MARKERS,
        "-p",
        "no:cacheprovider",
        f"--hypothesis-seed={seed}",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format), mypy on every package's src/, and a schema check of the workflows."""
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    for dist in PACKAGES:
        session.run("mypy", f"packages/{dist}/src")
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx site, warnings as errors, no network."""
    _sync(session, "--all-packages", "--group", "docs")
    out = ROOT / "docs" / "_build" / "html"
    shutil.rmtree(out, ignore_errors=True)
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", str(out))


@nox.session
def build(session: nox.Session) -> None:
    """Build each package's wheel and sdist, install the wheel alone in a fresh venv and run its demo."""
    dist_dir = ROOT / ".nox" / "_dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    # Pin third-party versions to the lockfile's so the fresh venvs reuse uv's cache.
    constraints = dist_dir / "constraints.txt"
    dist_dir.mkdir(parents=True)
    session.run(
        "uv",
        "export",
        "--all-packages",
        "--no-hashes",
        "--no-emit-workspace",
        "--no-default-groups",
        "--all-extras",
        "--frozen",
        "-o",
        str(constraints),
        "--quiet",
        external=True,
    )
    # flash-attn is an optional benchmark extra that is never built here.
    lines = [ln for ln in constraints.read_text().splitlines() if not ln.startswith("flash-attn")]
    constraints.write_text("\n".join(lines) + "\n")
    for dist, module in PACKAGES.items():
        out = dist_dir / dist
        session.run("uv", "build", "--package", dist, "--out-dir", str(out), external=True)
        wheels = sorted(out.glob("*.whl"))
        sdists = sorted(out.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(f"{dist}: expected one wheel and one sdist in {out}, found {wheels + sdists}")
        venv = out / "venv"
        session.run("uv", "venv", "--quiet", "--python", sys.executable, str(venv), external=True)
        py = str(venv / "bin" / "python")
        session.run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            py,
            "--constraint",
            str(constraints),
            str(wheels[0]),
            external=True,
        )
        # Run from an empty folder so that the installed wheel, not the source tree, is imported.
        with session.chdir(out):
            session.run(
                py, "-c", f"import {module}; print({module}.__name__, {module}.__version__)", external=True
            )
            session.run(py, "-m", f"{module}.demo", external=True)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: each package's demo (CPU here; the GPU path where a GPU is present)."""
    _sync(session, "--all-packages")
    for module in PACKAGES.values():
        session.log(f"=== {module} ===")
        session.run("python", "-m", f"{module}.demo")


@nox.session(venv_backend="none")
@nox.parametrize("package", list(PACKAGES))
def gpu(session: nox.Session, package: str) -> None:
    """`gpu`-marked tests on this machine's own (CUDA) torch/triton; installs nothing."""
    _current_python_env(session)
    _pytest_selected(session, package, "gpu")


@nox.session(venv_backend="none")
def multigpu(session: nox.Session) -> None:
    """`multigpu`-marked tests (ep-a2a and the cross-package MoE test) under torchrun on every visible GPU."""
    _current_python_env(session)
    ngpu = int(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    if ngpu < 2:
        session.error(f"multigpu needs at least 2 CUDA GPUs, this machine has {ngpu}")
    session.run(
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ngpu}",
        "-m",
        "pytest",
        "packages/ep-a2a/tests",
        "-m",
        "multigpu",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


@nox.session(venv_backend="none")
@nox.parametrize("package", list(PACKAGES))
def bench(session: nox.Session, package: str) -> None:
    """A package's benchmark on this machine's GPU: prints a table, writes docs/benchmarks/<package>.json/.md."""
    _current_python_env(session)
    session.run(
        "python", f"packages/{package}/benchmarks/run.py", "--out-dir", "docs/benchmarks", *session.posargs
    )
