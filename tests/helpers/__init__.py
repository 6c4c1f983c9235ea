"""Helpers shared by the test files (imported as ``helpers.<module>``; tests/conftest.py puts tests/ on sys.path)."""
