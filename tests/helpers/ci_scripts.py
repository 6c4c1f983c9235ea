"""Import a script of ``ci/`` as the module ``ci.<name>``, for the tests of the benches and the nightly."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_ci_script(name: str) -> ModuleType:
    """The module ``ci.<name>`` (the repository root is on ``sys.path``: ``tests/conftest.py``)."""
    return importlib.import_module(f"ci.{name}")
