"""The ``verity`` command: dispatches ``verity <command> [args...]`` to ``verity.cli.<command>``.

Each command lives in its own module exposing ``main(argv: list[str]) -> int``
and is imported only when it runs, so ``verity diagnose`` does not pay for
importing the trainer.
"""

from __future__ import annotations

import importlib
import sys

import verity

# name -> one-line help; the module is verity.cli.<name>
COMMANDS: dict[str, str] = {
    "quickstart": "GRPO on the embedded tiny model: warm-start, evaluate, train, evaluate again",
    "train": "run an RL recipe (Hydra overrides: verity train actor.optim.lr=1e-6 ...)",
    "sft": "supervised fine-tuning (the warm-start before RL)",
    "eval": "held-out accuracy, avg@k, pass@k, maj@k of a model or checkpoint",
    "config": "show every config key with its value and meaning (verity config show [section])",
    "data": "prepare datasets (synthetic tasks, verl-schema parquet)",
    "export": "export a checkpoint to Hugging Face format",
    "diagnose": "print versions, hardware and Ray status (paste into bug reports)",
}


def usage() -> str:
    """The help text listing every command."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: verity <command> [args...]",
        "       verity --version",
        "",
        "commands:",
        *(f"  {name:<{width}}  {help_line}" for name, help_line in COMMANDS.items()),
        "",
        "Run 'verity <command> --help' for a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``verity`` console script; returns the process exit code.

    Exit codes: the command's own, 0 for --help/--version, 2 for a missing or
    unknown command, 1 when a command's module cannot be imported.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    first = args[0]
    if first in ("-h", "--help", "help"):
        print(usage())
        return 0
    if first in ("-V", "--version"):
        print(f"verity {verity.__version__}")
        return 0
    if first not in COMMANDS:
        print(f"verity: unknown command {first!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = f"verity.cli.{first}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the command exists but one of its own imports is missing: show it
        print(f"verity: command {first!r} is not available in this installation", file=sys.stderr)
        return 1
    command_main = getattr(module, "main", None)
    if not callable(command_main):
        print(f"verity: {module_name} has no main(argv) function", file=sys.stderr)
        return 1
    code = command_main(args[1:])
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
