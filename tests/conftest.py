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
