"""Puts tests/ and the repository root on sys.path: test files import shared code as ``helpers.<module>``
and the scripts of ``ci/`` as ``ci.<module>``.

Pytest's default (prepend) import mode would add tests/ anyway, for this conftest; doing it here
too keeps ``helpers`` importable under ``--import-mode=importlib``. Processes spawned by a test
inherit sys.path, so their workers import ``helpers`` the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _folder in (str(_TESTS), str(_TESTS.parent)):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)


def pytest_collection_modifyitems(items: list) -> None:
    """Every file that holds a ``slow`` test first, the rest after, each in its collected order.

    ``nox -s tests`` runs the suite in two processes a file at a time (pytest-xdist,
    ``--dist loadfile``): handing the long files out first keeps one process from finishing
    its share early and idling while the other runs a long file last.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
