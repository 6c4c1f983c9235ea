"""The verity command: usage, --version, unknown commands, lazy dispatch to verity.cli.<name>."""

from __future__ import annotations

import sys
import types

import verity
from verity.cli import main as cli


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"verity {verity.__version__}"


def test_help_lists_every_command_with_its_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "sft", "eval", "quickstart", "data", "export", "diagnose"):
        assert f"  {name} " in out
    assert cli.COMMANDS["diagnose"] in out


def test_no_command_prints_usage_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: verity <command>" in capsys.readouterr().err


def test_unknown_command_is_named(capsys):
    assert cli.main(["trian", "x=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err
    assert "usage:" in err


def test_dispatch_passes_the_remaining_arguments(monkeypatch):
    received = []
    fake = types.ModuleType("verity.cli.fakecmd")
    fake.main = lambda argv: received.append(argv) or 7
    monkeypatch.setitem(sys.modules, "verity.cli.fakecmd", fake)
    monkeypatch.setitem(cli.COMMANDS, "fakecmd", "a test command")
    assert cli.main(["fakecmd", "a=1", "--flag"]) == 7
    assert received == [["a=1", "--flag"]]


def test_command_without_a_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "ghostcmd", "not written")
    assert cli.main(["ghostcmd"]) == 1
    assert "'ghostcmd' is not available" in capsys.readouterr().err


def test_diagnose_dispatches(capsys):
    assert cli.main(["diagnose", "--json"]) == 0
    assert '"versions"' in capsys.readouterr().out


def test_quickstart_table_says_which_evaluation_did_not_run():
    from verity.cli.quickstart import format_table

    summary = {"accuracy_before": None, "accuracy_after": 0.9, "steps": 4, "wall_seconds": 3.0}
    table = format_table(summary)  # trainer.val_before_train=false: no "before" figure
    assert "not run" in table and "90.0%" in table and "pts" not in table
    table = format_table({**summary, "accuracy_before": 0.5})
    assert "50.0%" in table and "+40.0 pts" in table


def test_a_resumed_run_says_so_and_a_complete_one_says_nothing_ran() -> None:
    from types import SimpleNamespace

    from verity.cli.train import resumed_line

    cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=10, output_dir="outputs/q"))
    assert resumed_line({"resumed_from_step": None}, cfg) is None
    assert resumed_line({}, cfg) is None
    assert resumed_line({"resumed_from_step": 4}, cfg) == "resumed from step 4: steps 5-10 ran now"
    line = resumed_line({"resumed_from_step": 10}, cfg)
    assert "outputs/q was already complete (step 10 of 10): no step ran now" in line
    assert "trainer.resume=off starts over" in line
