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
import tarfile
import zipfile
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
# What an unlocked session prints as the versions it resolved.
UNLOCKED_REPORT = ("torch", "triton", "numpy")
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


def _cpu_tests(session: nox.Session, package: str) -> None:
    """A package's CPU tests, then its documentation examples, in the session's environment."""
    session.env["TRITON_INTERPRET"] = "1"
    # Property tests draw the same examples on every run of this session (a landing must not hinge on a
    # lucky draw); HYPOTHESIS_SEED picks another set, and plain pytest runs draw fresh ones.
    seed = os.environ.get("HYPOTHESIS_SEED", "0")
    # Tests that need a GPU are deselected by marker (each worker deselects them, so the summary does not
    # count them). Two workers (pytest-xdist, the CI machine's two cores): the distributed tests spend much
    # of their time waiting on their ranks, which the other worker's tests fill; `-- -n 0` runs serially.
    # Work stealing: an idle worker takes tests queued on the other one (the minutes-long sm_90 compile
    # tests of a file would otherwise stay queued together on one worker).
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
        "--numprocesses=2",
        "--dist=worksteal",
        *session.posargs,
    )
    _examples(session, package, CPU_MARKERS, workers=2)


def _examples(
    session: nox.Session, package: str, marker: str, *, allow_none: bool = False, workers: int = 0
) -> None:
    """Execute every ```python block of the package's README and docs pages (tests/test_examples.py);
    ``workers`` > 0: that many pages at once (each runs in its own interpreter)."""
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_examples.py",
        "-m",
        marker,
        "-p",
        "no:cacheprovider",
        *([f"--numprocesses={workers}"] if workers else []),  # (GPU machines may lack pytest-xdist)
        env={"EXAMPLES_PACKAGE": package},
        # Every package has CPU examples (its quick start); GPU-only blocks are optional.
        success_codes=[0, 5] if allow_none else [0],
    )


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """CPU tests of one package: Triton kernels under TRITON_INTERPRET=1, distributed code on gloo."""
    extras = [arg for extra in TEST_EXTRAS.get(package, []) for arg in ("--extra", extra)]
    _sync(session, "--package", package, "--group", "test", *extras)
    _cpu_tests(session, package)


def _install_unlocked(session: nox.Session, package: str, resolution: str) -> None:
    """Install one package and the test group without the lockfile, resolved as a user's installer would."""
    pyproject = nox.project.load_toml("pyproject.toml")
    extras = ",".join(TEST_EXTRAS.get(package, []))
    target = f"./packages/{package}" + (f"[{extras}]" if extras else "")
    # --no-config: the workspace's pins for the lockfile ([tool.uv] constraint-dependencies) must not apply.
    session.install(
        "--no-config", f"--resolution={resolution}", target, *nox.project.dependency_groups(pyproject, "test")
    )
    report = "import importlib.metadata as m, sys; print(sys.version.split()[0], *(f'{d} {m.version(d)}' for d in DISTS))"
    session.run("python", "-c", f"DISTS = {UNLOCKED_REPORT!r}; {report}")


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests_newest(session: nox.Session, package: str) -> None:
    """The `tests` session without the lockfile, at the newest versions the registry serves."""
    _install_unlocked(session, package, "highest")
    _cpu_tests(session, package)


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests_lowest(session: nox.Session, package: str) -> None:
    """The `tests` session at the lowest versions each package declares (`--resolution lowest-direct`)."""
    _install_unlocked(session, package, "lowest-direct")
    _cpu_tests(session, package)


def _check_package_metadata(session: nox.Session) -> None:
    """Every package ships the root LICENSE unchanged and points its URLs at the one repository and site."""
    urls = nox.project.load_toml("pyproject.toml")["tool"]["moe-kernels"]
    license_text = (ROOT / "LICENSE").read_text()
    for dist in PACKAGES:
        folder = ROOT / "packages" / dist
        if (folder / "LICENSE").read_text() != license_text:
            session.error(f"packages/{dist}/LICENSE differs from the root LICENSE")
        project = nox.project.load_toml(folder / "pyproject.toml")["project"]
        for name, url in project["urls"].items():
            base = urls["documentation"] if name == "Documentation" else urls["repository"]
            if not url.startswith(base):
                session.error(
                    f"packages/{dist}/pyproject.toml: [project.urls] {name} = {url!r} is not under {base}"
                )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format), mypy on every package's src/, and a schema check of the workflows."""
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    for dist in PACKAGES:
        session.run("mypy", f"packages/{dist}/src")
    _check_package_metadata(session)
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx site, warnings as errors, no network."""
    _sync(session, "--all-packages", "--group", "docs")
    out = ROOT / "docs" / "_build" / "html"
    shutil.rmtree(out, ignore_errors=True)
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", str(out))


def _check_artifacts(session: nox.Session, dist: str, wheel: Path, sdist: Path) -> None:
    """The LICENSE file ships in the wheel and the sdist, and the wheel's metadata names the project URLs."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        session.error(f"{wheel.name}: no LICENSE file in the wheel")
    urls = {
        ln.split(":", 1)[1].split(",")[0].strip()
        for ln in metadata.splitlines()
        if ln.startswith("Project-URL:")
    }
    missing = {"Homepage", "Documentation", "Source", "Issues", "Changelog"} - urls
    if missing:
        session.error(f"{wheel.name}: no Project-URL for {sorted(missing)}")
    with tarfile.open(sdist) as tf:
        if not any(
            n.endswith(f"{dist.replace('-', '_')}-{wheel.name.split('-')[1]}/LICENSE") for n in tf.getnames()
        ):
            session.error(f"{sdist.name}: no LICENSE file in the sdist")


@nox.session
def build(session: nox.Session) -> None:
    """Build each package's wheel and sdist, check them, and run each wheel's demo installed alone.

    Each wheel goes into a fresh venv with nothing else, resolved without the lockfile (the newest
    dependencies, as a user's `pip install` gets them), and its demo runs on the CPU from an empty folder.
    """
    session.install("twine>=6.1")
    dist_dir = ROOT / ".nox" / "_dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    for dist, module in PACKAGES.items():
        out = dist_dir / dist
        session.run("uv", "build", "--package", dist, "--out-dir", str(out), external=True)
        wheels = sorted(out.glob("*.whl"))
        sdists = sorted(out.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(f"{dist}: expected one wheel and one sdist in {out}, found {wheels + sdists}")
        session.run("twine", "check", "--strict", str(wheels[0]), str(sdists[0]))
        _check_artifacts(session, dist, wheels[0], sdists[0])
        venv = out / "venv"
        session.run("uv", "venv", "--quiet", "--python", sys.executable, str(venv), external=True)
        py = str(venv / "bin" / "python")
        # --no-config: resolved as a user's installer would, without the workspace's pins for the lockfile.
        session.run(
            "uv", "pip", "install", "--no-config", "--quiet", "--python", py, str(wheels[0]), external=True
        )
        # Run from an empty folder so that the installed wheel, not the source tree, is imported.
        with session.chdir(out):
            session.run(
                py, "-c", f"import {module}; print({module}.__name__, {module}.__version__)", external=True
            )
            session.run(py, "-m", f"{module}.demo", external=True, env={"TRITON_INTERPRET": "1"})


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
    _examples(session, package, "gpu", allow_none=True)


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
        "tests/integration",
        "-m",
        "multigpu",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


@nox.session(venv_backend="none")
@nox.parametrize("package", list(PACKAGES))
def bench(session: nox.Session, package: str) -> None:
    """A package's published benchmark on this machine's GPU: writes docs/benchmarks/<package>/<gpu>.json."""
    _current_python_env(session)
    session.run("python", f"packages/{package}/benchmarks/run.py", *session.posargs)
