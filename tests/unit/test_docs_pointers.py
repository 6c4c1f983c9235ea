"""Every repository path the docs and the command-line help name exists.

Read: docs/*.md, README.md, CHANGELOG.md, recipes/*/README.md, harness/README.md, and the help of
``verity train``, ``verity eval``, ``verity config`` and ``verity-harness`` (each parser's
``--help`` rendered in-process, plus the command module's docstring, which is the longer help
these commands document themselves with).

A *path* is a backticked word or a markdown link target (code blocks included, word by word)
that starts with a top-level folder of the repository (``packages/``, ``recipes/``,
``harness/``, ``ci/``, ``tests/``, ``docs/``, ``leaderboards/``), or names one of the root
files (:data:`ROOT_FILES`). A link target is read relative to the document that holds it.
``*`` and ``...`` (elisions) match as a glob; a path with a ``<placeholder>`` is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("packages/", "recipes/", "harness/", "ci/", "tests/", "docs/", "leaderboards/")
ROOT_FILES = (
    "README.md",
    "CHANGELOG.md",
    "noxfile.py",
    "constraints.txt",
    "pytest.ini",
    "ruff.toml",
    "mkdocs.yml",
)

# what may follow a path inside a backticked word: punctuation, a :line, an #anchor, [extras]
_TRAILING = re.compile(r"(#[\w\-.]*|:\d+(-\d+)?|\[[\w,\-]*\])$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_OTHER_REPO = re.compile(r"\bverl(?:'s)?[,:]?\s*$")


def documents() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "harness" / "README.md"]
    found += sorted((ROOT / "docs").glob("*.md"))
    found += sorted((ROOT / "recipes").glob("*/README.md"))
    if (ROOT / "CHANGELOG.md").is_file():
        found.append(ROOT / "CHANGELOG.md")
    return found


def _clean(word: str) -> str:
    word = word.strip().strip("'\"(){},;")
    word = re.sub(r"\[[\w,\- ]*\]?$", "", word)  # packages/verity[docs] (the extras), also unclosed
    word = re.sub(r"'s$", "", word).strip("[]").rstrip(".:,;")
    if "=" in word:  # --config=recipes/... or key=docs/...
        word = word.rsplit("=", 1)[1]
    while True:
        stripped = _TRAILING.sub("", word).rstrip(".:,;)")
        if stripped == word:
            return word
        word = stripped


def _placeholder(path: str) -> bool:
    """``<name>``, or an upper-case metavariable as in --help (``A.json``, ``RUN_DIR``)."""
    if "<" in path or ">" in path:
        return True
    stems = [part.split(".")[0] for part in path.split("/") if part]
    return any(s.isupper() and (len(s) <= 3 or "_" in s) for s in stems)


def candidates(text: str) -> list[str]:
    """The repository paths ``text`` names in backticks and code blocks (links: :func:`link_targets`).

    A span right after the word "verl" names a file of verl's repository, not this one.
    """
    chunks = [m.group(1) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    chunks += [m.group(2) for m in _CODE_SPAN.finditer(prose) if not _OTHER_REPO.search(prose[: m.start()])]
    out = []
    for chunk in chunks:
        for word in chunk.split():
            path = _clean(word)
            if path.startswith(TOP_FOLDERS) or path in ROOT_FILES:
                out.append(path)
    return out


def link_targets(text: str) -> list[str]:
    """Relative link targets outside code (anchors and web addresses left out)."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    out = []
    for target in _LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def exists(path: str, base: Path = ROOT) -> bool:
    """``path`` (relative to ``base``) exists; ``*`` and ``...``/``…`` (any folders) match as a glob.

    A pytest node id (``tests/x.py::test_name[param]``) needs the file to define the test too.
    """
    path, _, node = path.partition("::")
    pattern = re.sub(r"(^|/)(\.\.\.|…)(/|$)", r"\1**\3", path)  # a folder elided: any folders
    pattern = re.sub(r"\.\.\.|…", "*", pattern)  # part of a name elided
    if "*" in pattern:
        found = bool(glob.glob(str(base / pattern), recursive=True))
    else:
        found = (base / path).exists()
    if found and node:
        name = re.split(r"[\[:]", node)[0]
        return bool(re.search(rf"^\s*(async )?def {re.escape(name)}\(", (base / path).read_text(), re.M))
    return found


def site_page(target: Path) -> bool:
    """``target`` (under docs/) is a page the site build generates (docs/mkdocs_hooks.py) from a file that exists."""
    try:
        rel = target.resolve().relative_to(ROOT / "docs").as_posix()
    except ValueError:
        return False
    if rel == "configuration.md":
        return (ROOT / "docs" / "gen_config_reference.py").is_file()
    if rel == "changelog.md":
        return (ROOT / "CHANGELOG.md").is_file()
    recipe = re.fullmatch(r"recipes/([\w-]+)\.md", rel)
    if recipe:
        return (ROOT / "recipes" / recipe.group(1) / "README.md").is_file()
    return rel.startswith("leaderboards/") and (ROOT / rel).is_file()


def missing_in(text: str, doc_dir: Path = ROOT) -> list[str]:
    """Paths ``text`` names that do not exist (placeholders skipped).

    A link from a page under docs/ may name a page the site generates (:func:`site_page`).
    """
    bad = []
    for path in candidates(text):
        if not _placeholder(path) and not exists(path):
            bad.append(path)
    for target in link_targets(text):
        if _placeholder(target) or site_page(doc_dir / target.split("#")[0]):
            continue
        if not exists(target, doc_dir):
            bad.append(f"link {target}")
    return sorted(set(bad))


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(doc: Path) -> None:
    bad = missing_in(doc.read_text(), doc.parent)
    assert not bad, f"{doc.relative_to(ROOT)} names paths that do not exist: {bad}"


def _help(parser: argparse.ArgumentParser) -> str:
    """The parser's --help and every sub-command's."""
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [_help(sub) for sub in action.choices.values()]
    return "\n".join(texts)


def _help_of(parse, *args) -> str:
    """What ``parse(["--help"], ...)`` prints (the parser is built inside ``parse``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"], *args)
    return out.getvalue()


def help_texts() -> dict[str, str]:
    from verity.cli import config as config_cli
    from verity.cli import eval as eval_cli
    from verity.cli import train as train_cli

    texts = {
        "verity train --help": _help_of(train_cli.parse, "verity train", "Run one RL training job."),
        "verity train (module doc)": train_cli.__doc__ or "",
        "verity eval --help": _help(eval_cli._parser()),
        "verity eval (module doc)": eval_cli.__doc__ or "",
        "verity config (module doc)": config_cli.__doc__ or "",
    }
    try:
        from verity_harness import cli as harness_cli
    except ImportError:  # the harness is installed by `nox -s tests`; without it, the runtime's help only
        return texts
    texts["verity-harness --help"] = _help(harness_cli._parser())
    texts["verity-harness (module doc)"] = harness_cli.__doc__ or ""
    return texts


def _words(text: str) -> list[str]:
    return [_clean(w) for w in text.split()]


def test_every_path_the_command_line_help_names_exists() -> None:
    bad = {}
    for name, text in help_texts().items():
        paths = [w for w in _words(text) if w.startswith(TOP_FOLDERS) and not _placeholder(w)]
        missing = [p for p in paths if not exists(p)]
        if missing:
            bad[name] = missing
    assert not bad, f"help texts name paths that do not exist: {bad}"


def test_the_checker_finds_what_it_should() -> None:
    text = (
        'See `docs/engines.md`, "Seams" and `recipes/*/src/*/expected/cpu-hf.yaml`; run\n'
        "`python ci/nowhere.py --x` or `recipes/<name>/README.md`; `tests/.../test_config.py`.\n"
        "```bash\nverity train --config recipes/grpo/configs/cpu.yaml\n```\n"
        "[the engines](engines.md#fsdp2) and [gone](gone.md); `noxfile.py`; `pip install 'packages/verity[docs]'`\n"
    )
    assert missing_in(text, ROOT / "docs") == [
        "ci/nowhere.py",
        "link gone.md",
        "recipes/grpo/configs/cpu.yaml",
    ]
