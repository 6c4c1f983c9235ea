"""Puts tests/ on sys.path so that test files import shared code as ``helpers.<module>``.

Pytest's default (prepend) import mode would add this folder anyway, for this conftest; doing
it here too keeps ``helpers`` importable under ``--import-mode=importlib``. Processes spawned by
a test inherit sys.path, so their workers import ``helpers`` the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
