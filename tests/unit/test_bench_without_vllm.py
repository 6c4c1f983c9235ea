"""`python -m ci.bench` on a machine without vLLM: one sentence with the install command, exit 2, nothing run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.ci_scripts import load_ci_script

bench = load_ci_script("bench")


def _without(monkeypatch, absent: str) -> None:
    import verity.optional_packages as optional

    installed = optional.is_installed
    monkeypatch.setattr(optional, "is_installed", lambda module: module != absent and installed(module))


def test_bench_without_vllm_names_the_install_command(tmp_path: Path, monkeypatch, capsys) -> None:
    _without(monkeypatch, "vllm")
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: ran.append(kwargs))
    out = tmp_path / "bench.json"
    assert bench.main(["--repeats", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "ci/bench.py: the vLLM comparison needs vLLM, which is not installed here: pip install 'verity[vllm]'"
        in err
    )
    assert "--no-vllm" in err and "Traceback" not in err
    assert not ran and not out.exists()


def test_no_vllm_skips_the_check_and_run_bench_checks_too(monkeypatch) -> None:
    _without(monkeypatch, "vllm")
    bench.check_arguments(1, ())  # --no-vllm: nothing to install
    with pytest.raises(ValueError, match="needs vLLM, which is not installed"):
        bench.run_bench(repeats=1, vllm_sizes=("tiny",))


def test_the_check_passes_when_vllm_is_there(monkeypatch) -> None:
    import verity.optional_packages as optional

    monkeypatch.setattr(optional, "is_installed", lambda module: True)
    bench.check_arguments(1, tuple(bench.VLLM_SIZES))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench.check_arguments(0, ())
