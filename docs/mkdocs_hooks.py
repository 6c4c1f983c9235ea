"""MkDocs hooks of verity's site (``hooks:`` in mkdocs.yml): generated pages and repository links.

Pages added at build time, never committed, so they cannot drift:

* ``configuration.md``: the configuration reference, from the schema's field comments
  (docs/gen_config_reference.py);
* ``recipes/<name>.md``: each recipe's own recipes/<name>/README.md;
* ``changelog.md``: CHANGELOG.md;
* ``leaderboards/*.html``: the static leaderboard pages, copied as they are.

Links. The docs are written to be read in the repository too, so they name repository
files: as links (``[..](../recipes/vlm/README.md)``) and in backticks (`docs/engines.md`).
Per page, before MkDocs reads it:

* a link or a backticked path that is a page of this site (a file under docs/, a recipe's
  README, CHANGELOG.md, a leaderboard page) becomes a link to that page, which MkDocs then
  checks (missing pages and anchors fail ``mkdocs build --strict``: mkdocs.yml's ``validation``);
* a link to any other repository file is checked here — a missing one is a warning, so
  strict builds fail on it — and is written as the path in backticks (the site has no
  copy of the repository to link to).

Backticked paths that are not pages are left alone; tests/unit/test_docs_pointers.py
checks that every one exists.
"""

from __future__ import annotations

import importlib.util
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.verity")  # under "mkdocs": strict builds count its warnings

ROOT = Path(__file__).resolve().parents[1]

# site page (src_uri) -> the repository file its Markdown comes from, for generated pages
_SOURCES: dict[str, str] = {}

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_LINK_OR_CODE = re.compile(
    r"\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)|(?P<ticks>`+)(?P<code>[^`\n]+?)(?P=ticks)"
)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "docs" / "gen_config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    """Add the generated pages and the leaderboard copies."""
    files.append(File.generated(config, "configuration.md", content=_load_generator().render()))
    _SOURCES["configuration.md"] = "docs/configuration.md"
    for readme in sorted(ROOT.glob("recipes/*/README.md")):
        src = f"recipes/{readme.parent.name}.md"
        files.append(File.generated(config, src, content=readme.read_text()))
        _SOURCES[src] = readme.relative_to(ROOT).as_posix()
    changelog = ROOT / "CHANGELOG.md"
    if changelog.is_file():
        files.append(File.generated(config, "changelog.md", content=changelog.read_text()))
        _SOURCES["changelog.md"] = "CHANGELOG.md"
    for page in sorted(ROOT.glob("leaderboards/*.html")):
        src = f"leaderboards/{page.name}"
        files.append(File.generated(config, src, abs_src_path=str(page)))
        _SOURCES[src] = src
    return files


def _site_page(repo_path: str) -> str | None:
    """The site page (src_uri) holding the repository file ``repo_path``, if there is one."""
    if repo_path.startswith("docs/") and (ROOT / repo_path).is_file():
        return repo_path[len("docs/") :]
    for src, origin in _SOURCES.items():
        if origin == repo_path and src != "configuration.md":
            return src
    return None


def _relative(src: str, page_src: str) -> str:
    return posixpath.relpath(src, posixpath.dirname(page_src) or ".")


def _rewrite(prose: str, origin: str, page_src: str) -> str:
    def replace(match: re.Match) -> str:
        if match.group("code") is not None:
            code = match.group("code").strip()
            path, _, anchor = code.partition("#")
            if " " in code or not re.match(r"^(docs|recipes|leaderboards)/|^CHANGELOG\.md$", path):
                return match.group(0)
            src = _site_page(path)
            if src is None:
                return match.group(0)
            return f"[{match.group(0)}]({_relative(src, page_src)}{'#' + anchor if anchor else ''})"
        text, target = match.group("text"), match.group("target")
        if _SCHEME.match(target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))
        if repo_path.startswith("docs/"):
            # a page of the site (or one that is not there: MkDocs reports it, strict fails)
            src = repo_path[len("docs/") :]
        else:
            src = _site_page(repo_path)
        if src is not None:
            return f"[{text}]({_relative(src, page_src)}{'#' + anchor if anchor else ''})"
        if repo_path.startswith("..") or not (ROOT / repo_path).exists():
            log.warning(
                "%s links to '%s' (%s in the repository), which does not exist", origin, target, repo_path
            )
        shown = text.strip("`")
        return f"`{repo_path}`" if shown in (target, repo_path) else f"{text} (`{repo_path}`)"

    return _LINK_OR_CODE.sub(replace, prose)


def on_page_markdown(markdown, page, config, files):
    """Point repository paths at the site's pages; check and flatten links to other repository files."""
    page_src = page.file.src_uri
    origin = _SOURCES.get(page_src, f"docs/{page_src}")
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_rewrite(markdown[last : fence.start()], origin, page_src))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_rewrite(markdown[last:], origin, page_src))
    return "".join(out)
