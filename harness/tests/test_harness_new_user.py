"""Mistakes a new user makes with the harness: one sentence naming the input, exit 2 (docs/failures.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from verity_harness.cli import main


def test_harness_compare_of_a_binary_file_names_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    binary = tmp_path / "train.parquet"
    binary.write_bytes(b"PAR1\x15\x04\xe2\x80\xff\xfe" * 8)
    assert main(["compare", str(binary), str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"verity-harness compare: {binary}: not a result file (a JSON document); it is not text" in err
    assert "codec" not in err and "Traceback" not in err


def test_harness_run_without_a_needed_package_refuses_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpo cpu-lora with peft missing: the install sentence, exit 2, no MLflow store or run folder made."""
    import verity.optional_packages as optional

    installed = optional.is_installed
    monkeypatch.setattr(optional, "is_installed", lambda module: module != "peft" and installed(module))
    root = tmp_path / "harness"
    assert main(["run", "grpo", "--config", "cpu-lora", "--output-root", str(root), "--no-result-file"]) == 2
    err = capsys.readouterr().err
    assert "actor.lora.rank=8 needs peft, which is not installed here: pip install peft" in err
    assert not root.exists() or not any(root.iterdir())


def test_the_commit_recorded_is_the_running_codes_wherever_the_command_starts(tmp_path, monkeypatch):
    """A result run from another folder (here a different git checkout) names verity's own commit."""
    import subprocess
    from pathlib import Path

    import verity
    from verity_harness.machine import git_commit

    source = Path(verity.__file__).resolve().parent
    expected = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, check=True
    ).stdout.strip()
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=other, check=True,
    )  # fmt: skip
    monkeypatch.chdir(other)
    commit, _ = git_commit()
    assert commit == expected
