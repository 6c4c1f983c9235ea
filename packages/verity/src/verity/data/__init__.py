"""verity.data."""
