"""The documentation site builds with ``mkdocs build --strict`` (what ``nox -s docs`` runs).

Strict: a page missing from the nav, a link to a page or an anchor that does not exist, or a
link to a repository file that does not exist fails the build (mkdocs.yml's ``validation``;
docs/mkdocs_hooks.py for links that leave docs/). ``nox -s tests`` installs the ``docs`` extra,
so in CI this runs; elsewhere it is skipped when MkDocs is not installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _needs_mkdocs() -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            pytest.skip(
                f"{module} is not installed: pip install -c constraints.txt -e 'packages/verity[docs]'"
            )


def _hooks():
    spec = importlib.util.spec_from_file_location("verity_docs_hooks", ROOT / "docs" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    _needs_mkdocs()
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "WARNING" not in done.stderr, done.stderr[-4000:]
    landing = re.sub(r"<[^>]+>", "", (site / "index.html").read_text())  # code is highlighted in spans
    assert "pip install nox &amp;&amp; nox -s quickstart" in landing
    # generated pages: the configuration reference from the schema's comments, the plug-in API
    # from docstrings, one page per recipe README, the leaderboards copied
    reference = (site / "configuration.html").read_text()
    for key in ("trainer.nnodes", "trainer.n_workers_per_node", "trainer.ray_address", "actor.optim.lr"):
        assert f"<code>{key}</code>" in reference, key
    api = (site / "api.html").read_text()
    for name in ("verity.registry.Registry", "verity.workers.registry.register_role", "verity.plugins",
                 "verity.trainer.stage_plan.StagePlan", "verity.batch.Batch"):  # fmt: skip
        assert f'id="{name}"' in api, name
    for readme in ROOT.glob("recipes/*/README.md"):
        assert (site / "recipes" / f"{readme.parent.name}.html").is_file(), readme
    assert (site / "leaderboards" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_the_checks_are_errors() -> None:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor(
        "!", lambda loader, suffix, node: None
    )  # Material's !!python tags, none here
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    validation = config["validation"]
    assert validation["nav"]["omitted_files"] == "warn" and validation["nav"]["not_found"] == "warn"
    assert {validation["links"][k] for k in ("not_found", "anchors", "unrecognized_links")} == {"warn"}

    def pages(nav) -> list[str]:
        out = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += pages(value) if isinstance(value, list) else [value]
        return out

    in_nav = set(pages(config["nav"]))
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    generated = {"configuration.md", "changelog.md"} | {
        f"recipes/{p.parent.name}.md" for p in ROOT.glob("recipes/*/README.md")
    }
    assert on_disk | generated == in_nav, (
        f"not in the nav: {(on_disk | generated) - in_nav}; gone: {in_nav - on_disk - generated}"
    )


def test_links_out_of_docs_are_checked_and_shown_as_paths(caplog) -> None:
    pytest.importorskip("mkdocs")
    hooks = _hooks()
    text = (
        "See [the VLM recipe](../recipes/vlm/README.md), [a file](../packages/verity/pyproject.toml), "
        "[gone](../packages/nope.py), [engines](engines.md#fsdp2) and `docs/engines.md`.\n"
        "```bash\n[kept](../x.md) `docs/engines.md`\n```\n"
    )
    hooks._SOURCES["recipes/vlm.md"] = "recipes/vlm/README.md"
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.verity"):
        out = hooks.on_page_markdown(
            text, type("P", (), {"file": type("F", (), {"src_uri": "multimodal.md"})()})(), None, None
        )
    assert "[the VLM recipe](recipes/vlm.md)" in out  # a page of the site: MkDocs checks it
    assert "a file (`packages/verity/pyproject.toml`)" in out  # outside the site: a path
    assert "[engines](engines.md#fsdp2)" in out and "[`docs/engines.md`](engines.md)" in out
    assert out.endswith("```bash\n[kept](../x.md) `docs/engines.md`\n```\n")  # code blocks untouched
    assert [r.getMessage() for r in caplog.records] == [
        "docs/multimodal.md links to '../packages/nope.py' (packages/nope.py in the repository), which does not exist"
    ]
