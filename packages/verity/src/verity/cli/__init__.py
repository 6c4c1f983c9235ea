"""verity.cli."""
