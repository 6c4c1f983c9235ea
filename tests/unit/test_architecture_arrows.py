"""The rooms of the runtime import only rooms below them (docs/architecture.md, "the runtime, room by room")."""

from __future__ import annotations

import ast
from pathlib import Path

import verity

# top to bottom: a room may import itself and rooms after it, never one before it
ROOMS = [
    "cli",
    "launch",
    "trainer",
    "evaluation",
    "sft",
    "workers",
    "checkpoint",
    "config",
    "tracking",
    "engines",
    "rollout",
    "resharding",
    "rewards",
    "data",
    "algorithms",
    "controller",
    "batch",
    "hardware",
    "plugins",
    "registry",
    "testing",
    "optional_packages",
    "errors",
]
SRC = Path(verity.__file__).parent


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "verity" else None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_rooms_import_only_downwards() -> None:
    order = {room: i for i, room in enumerate(ROOMS)}
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        here = rel.parts[0].removesuffix(".py")
        if here not in order:
            continue  # verity/__init__.py and package data
        for module in _imports(path):
            there = _room(module)
            if there in order and order[there] < order[here]:
                upward.append(f"{rel} imports {module} ({here} -> {there})")
    assert not upward, "imports that point up the room table:\n" + "\n".join(upward)


def test_every_room_is_in_the_table() -> None:
    rooms = {p.name.removesuffix(".py") for p in SRC.iterdir() if not p.name.startswith("_")}
    rooms = {r for r in rooms if (SRC / r).is_dir() or (SRC / f"{r}.py").is_file()} - {"py.typed"}
    assert rooms <= set(ROOMS), f"rooms missing from the table: {sorted(rooms - set(ROOMS))}"


# packages the runtime must never import: they plug into it (the toy world through
# verity.data.task_registry and verity.data.embedded), and a recipe or the harness sits above it
PLUG_INS = ("verity_toyworld", "verity_recipe_", "verity_harness", "verity_demo_plugin")


def test_the_runtime_imports_no_plug_in() -> None:
    found = [
        f"{path.relative_to(SRC)} imports {module}"
        for path in sorted(SRC.rglob("*.py"))
        for module in _imports(path)
        if module.startswith(PLUG_INS)
    ]
    assert not found, "the runtime imports a plug-in package:\n" + "\n".join(found)


def test_the_toy_world_imports_the_runtime_only_downwards_of_the_trainer() -> None:
    """The toy world sits beside the recipes: it may use the runtime's data, model and training
    tools, never the CLI (which reaches it only through the registries)."""
    import verity_toyworld

    root = Path(verity_toyworld.__file__).parent
    found = [
        f"{path.relative_to(root)} imports {module}"
        for path in sorted(root.rglob("*.py"))
        for module in _imports(path)
        if _room(module) == "cli"
    ]
    assert not found, "\n".join(found)
