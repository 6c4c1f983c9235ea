"""Import a script of ``ci/`` (not a package) as a module, for the tests of the benches and the nightly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CI = Path(__file__).resolve().parents[2] / "ci"


def load_ci_script(name: str) -> ModuleType:
    """``ci/<name>.py`` executed as the module ``ci_<name>`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"ci_{name}", CI / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
