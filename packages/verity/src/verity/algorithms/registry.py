"""Name registries for the algorithm library.

Every estimator, loss, KL kind and aggregation mode is a plain function stored
under a name (a :class:`verity.registry.Registry`), so a config chooses it with a
string. The registries are module-level instances defined here; the modules that
implement the functions import them and register into them, and
``verity.algorithms`` imports those modules so that importing the package fills
every registry. Plug-ins register more the same way (:mod:`verity.plugins`).
"""

from __future__ import annotations

from verity.registry import Registry, UnknownNameError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Registry",
    "UnknownNameError",
]

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
AGGREGATION_MODES: Registry = Registry("loss aggregation mode")
