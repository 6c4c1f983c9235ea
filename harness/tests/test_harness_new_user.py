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
