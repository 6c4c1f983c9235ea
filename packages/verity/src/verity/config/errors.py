"""The error every config check raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run: names the key and what was expected."""
