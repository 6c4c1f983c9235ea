"""verity.algorithms."""
