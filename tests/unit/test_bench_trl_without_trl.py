"""`python -m ci.bench_trl` on a machine without TRL: one sentence with the install command, exit 2, nothing run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.ci_scripts import load_ci_script

bench_trl = load_ci_script("bench_trl")


def test_bench_trl_without_trl_names_the_install_command(tmp_path: Path, monkeypatch, capsys) -> None:
    import verity.optional_packages as optional

    installed = optional.is_installed
    monkeypatch.setattr(optional, "is_installed", lambda module: module != "trl" and installed(module))
    built = []
    monkeypatch.setattr("verity_toyworld.build.ensure_embedded_default", lambda *a, **k: built.append(a))
    out = tmp_path / "bench.json"
    argv = [
        "--shapes",
        "quickstart",
        "--steps-quickstart",
        "2",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "w"),
    ]
    assert bench_trl.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "ci/bench_trl.py: the TRL side needs TRL, which is not installed here: pip install -c constraints.txt"
        in err
    )
    assert "Traceback" not in err and not built and not out.exists()


def test_the_check_passes_when_trl_is_there(tmp_path: Path, monkeypatch) -> None:
    """With TRL present the same call goes on to build the inputs (here stopped right there)."""
    import verity.optional_packages as optional

    monkeypatch.setattr(optional, "is_installed", lambda module: True)

    def stop(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("inputs built")

    monkeypatch.setattr("verity_toyworld.build.ensure_embedded_default", stop)
    with pytest.raises(RuntimeError, match="inputs built"):
        bench_trl.prepare_inputs(bench_trl.SHAPES["quickstart"], tmp_path, str(tmp_path))
