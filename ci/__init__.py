"""The project's benchmarks, nightly and maintenance scripts, each run from the repository root as ``python -m ci.<name>``."""
